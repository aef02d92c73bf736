//go:build linux

package cli

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestLoadAPIKey(t *testing.T) {
	t.Run("generated once and persisted 0600", func(t *testing.T) {
		t.Setenv("AENV_API_KEY", "")
		dir := t.TempDir()
		k1, err := loadAPIKey(dir, true)
		if err != nil {
			t.Fatal(err)
		}
		if !strings.HasPrefix(k1, "e2b_") || len(k1) != 44 {
			t.Fatalf("key %q", k1)
		}
		k2, err := loadAPIKey(dir, false)
		if err != nil || k2 != k1 {
			t.Fatalf("second load %q %v, want %q", k2, err, k1)
		}
		st, err := os.Stat(filepath.Join(dir, apiKeyFile))
		if err != nil || st.Mode().Perm() != 0o600 {
			t.Fatalf("key file mode %v %v", st.Mode(), err)
		}
	})
	tests := []struct {
		name, env, file string
		create, ok      bool
	}{
		{"env wins", "e2b_abc123", "", false, true},
		{"env must match the SDK pattern", "sk-nothex", "", true, false},
		{"env uppercase hex rejected", "e2b_ABC", "", true, false},
		{"corrupt file", "", "not-a-key\n", true, false},
		{"missing without create", "", "", false, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Setenv("AENV_API_KEY", tt.env)
			dir := t.TempDir()
			if tt.file != "" {
				os.WriteFile(filepath.Join(dir, apiKeyFile), []byte(tt.file), 0o600)
			}
			k, err := loadAPIKey(dir, tt.create)
			if (err == nil) != tt.ok {
				t.Fatalf("loadAPIKey = %q, %v; want ok=%v", k, err, tt.ok)
			}
			if tt.ok && tt.env != "" && k != tt.env {
				t.Fatalf("got %q, want env key", k)
			}
		})
	}
}
