//go:build linux

package cli

import (
	"bytes"
	"crypto/sha256"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func runKey(t *testing.T, args ...string) (string, error) {
	t.Helper()
	cmd := keyCmd()
	var out bytes.Buffer
	cmd.SetOut(&out)
	cmd.SetErr(&out)
	cmd.SetArgs(args)
	err := cmd.Execute()
	return out.String(), err
}

// TestAPIKeyStoredHashed: --rotate prints a new key once and stores only
// its SHA-256 (0600); the key cannot be printed again; a plaintext key
// file of an older version is replaced by its hash.
func TestAPIKeyStoredHashed(t *testing.T) {
	t.Setenv("AENV_API_KEY", "")
	dir := t.TempDir()
	if _, err := loadAPIKeyHash(dir); err == nil || !strings.Contains(err.Error(), "--rotate") {
		t.Fatalf("no key yet: %v", err)
	}
	if _, err := runKey(t, "--data-dir", dir, "--exists"); err == nil {
		t.Fatal("--exists without a key")
	}
	out, err := runKey(t, "--data-dir", dir, "--rotate")
	key := strings.TrimSpace(out)
	if err != nil || !strings.HasPrefix(key, "e2b_") || len(key) != 44 {
		t.Fatalf("rotate: %q %v", out, err)
	}
	st, err := os.Stat(filepath.Join(dir, apiKeyHashFile))
	if err != nil || st.Mode().Perm() != 0o600 {
		t.Fatalf("hash file: %v %v", st, err)
	}
	stored, _ := os.ReadFile(filepath.Join(dir, apiKeyHashFile))
	if bytes.Contains(stored, []byte(key)) || bytes.Contains(stored, []byte(key[4:])) {
		t.Fatal("the key is stored in the clear")
	}
	sum, err := loadAPIKeyHash(dir)
	if err != nil || sum != sha256.Sum256([]byte(key)) {
		t.Fatalf("hash %x %v", sum, err)
	}
	if out, err := runKey(t, "--data-dir", dir); err == nil || strings.Contains(out, key) {
		t.Fatalf("the key was shown again: %q %v", out, err)
	}
	if _, err := runKey(t, "--data-dir", dir, "--exists"); err != nil {
		t.Fatalf("--exists: %v", err)
	}

	legacy := t.TempDir()
	os.WriteFile(filepath.Join(legacy, legacyAPIKeyFile), []byte("e2b_abc123\n"), 0o600)
	if sum, err := loadAPIKeyHash(legacy); err != nil || sum != sha256.Sum256([]byte("e2b_abc123")) {
		t.Fatalf("legacy key: %x %v", sum, err)
	}
	if _, err := os.Stat(filepath.Join(legacy, legacyAPIKeyFile)); !os.IsNotExist(err) {
		t.Fatal("the plaintext key file was kept")
	}

	for _, tc := range []struct{ name, env, file string }{
		{"env must match the SDK pattern", "sk-nothex", ""},
		{"env uppercase hex rejected", "e2b_ABC", ""},
		{"corrupt hash file", "", "not-hex\n"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Setenv("AENV_API_KEY", tc.env)
			d := t.TempDir()
			if tc.file != "" {
				os.WriteFile(filepath.Join(d, apiKeyHashFile), []byte(tc.file), 0o600)
			}
			if _, err := loadAPIKeyHash(d); err == nil {
				t.Fatal("accepted")
			}
		})
	}
	t.Setenv("AENV_API_KEY", "e2b_abc123")
	if sum, err := loadAPIKeyHash(t.TempDir()); err != nil || sum != sha256.Sum256([]byte("e2b_abc123")) {
		t.Fatalf("env key: %v", err)
	}
}
