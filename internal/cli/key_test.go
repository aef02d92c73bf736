//go:build linux

package cli

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/agentenv/agentenv/internal/apikeys"
	"github.com/agentenv/agentenv/internal/errkind"
	"github.com/agentenv/agentenv/internal/statedb"
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

// Keys of a data dir no node uses: made (printed once), listed (names and
// a hash prefix, never the key), revoked; a name in use is refused; the
// database holds no key in the clear.
func TestKeysOffline(t *testing.T) {
	t.Setenv("AENV_API_KEY", "")
	dir := t.TempDir()
	if _, err := runKey(t, "--data-dir", dir, "--exists"); err == nil {
		t.Fatal("--exists without a key")
	}
	out, err := runKey(t, "--data-dir", dir, "create", "trainer-1")
	key := strings.TrimSpace(out)
	if err != nil || !apikeys.Pattern.MatchString(key) || len(key) != 44 {
		t.Fatalf("create: %q %v", out, err)
	}
	if _, err := runKey(t, "--data-dir", dir, "create", "trainer-1"); !errors.Is(err, errkind.ErrConflict) {
		t.Fatalf("a second key of one name: %v", err)
	}
	if _, err := runKey(t, "--data-dir", dir, "create", "Bad Name"); !errors.Is(err, errkind.ErrInvalid) {
		t.Fatalf("a bad name: %v", err)
	}
	if _, err := runKey(t, "--data-dir", dir, "--exists"); err != nil {
		t.Fatalf("--exists: %v", err)
	}
	out, err = runKey(t, "--data-dir", dir, "ls")
	if err != nil || !strings.Contains(out, "trainer-1") || strings.Contains(out, key[4:12]) {
		t.Fatalf("ls: %q %v", out, err)
	}
	db, _ := os.ReadFile(filepath.Join(dir, statedb.FileName))
	wal, _ := os.ReadFile(filepath.Join(dir, statedb.FileName+"-wal"))
	if bytes.Contains(append(db, wal...), []byte(key[4:])) {
		t.Fatal("the key is stored in the clear")
	}
	if _, err := runKey(t, "--data-dir", dir, "revoke", "trainer-1"); err != nil {
		t.Fatal(err)
	}
	if _, err := runKey(t, "--data-dir", dir, "revoke", "trainer-1"); !errors.Is(err, errkind.ErrNotFound) {
		t.Fatalf("revoking a revoked key: %v", err)
	}
	if _, err := runKey(t, "--data-dir", dir, "--exists"); err == nil {
		t.Fatal("--exists after the last key went")
	}
}

// An older node's only key (hashed, or in plaintext before that) becomes
// the key named "default", and its file goes.
func TestLegacyKeyAdopted(t *testing.T) {
	t.Setenv("AENV_API_KEY", "")
	for _, tc := range []struct{ file, content string }{
		{legacyAPIKeyFile, "e2b_abc123\n"},
		{apiKeyHashFile, func() string { s := sha256.Sum256([]byte("e2b_abc123")); return hexString(s[:]) + "\n" }()},
	} {
		dir := t.TempDir()
		os.WriteFile(filepath.Join(dir, tc.file), []byte(tc.content), 0o600)
		out, err := runKey(t, "--data-dir", dir, "ls")
		if err != nil || !strings.Contains(out, defaultKeyName) {
			t.Fatalf("%s: ls %q %v", tc.file, out, err)
		}
		if _, err := os.Stat(filepath.Join(dir, tc.file)); !os.IsNotExist(err) {
			t.Fatalf("%s was kept", tc.file)
		}
		db, err := statedb.Open(filepath.Join(dir, statedb.FileName))
		if err != nil {
			t.Fatal(err)
		}
		keys, _ := apikeys.Open(db)
		if name, ok, err := keys.Check(context.Background(), "e2b_abc123"); err != nil || !ok || name != defaultKeyName {
			t.Fatalf("%s: the old key is not the default key: %q %v %v", tc.file, name, ok, err)
		}
		db.Close()
	}
	bad := t.TempDir()
	os.WriteFile(filepath.Join(bad, apiKeyHashFile), []byte("not-hex\n"), 0o600)
	if _, err := runKey(t, "--data-dir", bad, "ls"); err == nil {
		t.Fatal("a corrupt hash file was accepted")
	}
}

func hexString(b []byte) string {
	const digits = "0123456789abcdef"
	out := make([]byte, 0, 2*len(b))
	for _, c := range b {
		out = append(out, digits[c>>4], digits[c&15])
	}
	return string(out)
}

// On a running node the commands go through its admin socket, and a
// revoked key is refused from the next check on.
func TestKeysOfARunningNode(t *testing.T) {
	t.Setenv("AENV_API_KEY", "")
	dir := t.TempDir()
	db, err := statedb.Open(filepath.Join(dir, statedb.FileName))
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	keys, err := apikeys.Open(db)
	if err != nil {
		t.Fatal(err)
	}
	ln, err := apikeys.ListenAdmin(dir)
	if err != nil {
		t.Fatal(err)
	}
	if st, err := os.Stat(filepath.Join(dir, apikeys.SocketName)); err != nil || st.Mode().Perm() != 0o600 {
		t.Fatalf("admin socket: %v %v", st, err)
	}
	srv := &http.Server{Handler: keys.Handler(nil)}
	go srv.Serve(ln)
	defer srv.Close()
	out, err := runKey(t, "--data-dir", dir, "create", "live")
	key := strings.TrimSpace(out)
	if err != nil {
		t.Fatalf("create through the socket: %q %v", out, err)
	}
	if _, ok, _ := keys.Check(context.Background(), key); !ok {
		t.Fatal("the running node does not know the new key")
	}
	rotated, err := runKey(t, "--data-dir", dir, "--rotate")
	if err != nil || !apikeys.Pattern.MatchString(strings.TrimSpace(rotated)) {
		t.Fatalf("rotate: %q %v", rotated, err)
	}
	if _, err := runKey(t, "--data-dir", dir, "revoke", "live"); err != nil {
		t.Fatal(err)
	}
	if _, ok, _ := keys.Check(context.Background(), key); ok {
		t.Fatal("a revoked key is still accepted")
	}
	if name, ok, _ := keys.Check(context.Background(), strings.TrimSpace(rotated)); !ok || name != defaultKeyName {
		t.Fatal("the rotated default key is not accepted")
	}
}
