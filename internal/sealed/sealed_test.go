package sealed

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestSealOpen(t *testing.T) {
	secret := []byte("the cluster's node token, 32+ bytes long")
	k, err := NewKey(secret, "tokens")
	if err != nil {
		t.Fatal(err)
	}
	s := k.Seal("envd-token-123")
	if !strings.HasPrefix(s, prefix) || strings.Contains(s, "envd-token-123") {
		t.Fatalf("sealed %q", s)
	}
	if s2 := k.Seal("envd-token-123"); s2 == s {
		t.Fatal("two seals of one value are equal (nonce reused)")
	}
	// Another node with the same secret opens it.
	other, _ := NewKey(secret, "tokens")
	if got, legacy, err := other.Open(s); err != nil || legacy || got != "envd-token-123" {
		t.Fatalf("open: %q %v %v", got, legacy, err)
	}
	for name, key := range map[string]func() *Key{
		"another secret":  func() *Key { k, _ := NewKey([]byte("another cluster's secret, long enough"), "tokens"); return k },
		"another purpose": func() *Key { k, _ := NewKey(secret, "other"); return k },
	} {
		if _, _, err := key().Open(s); !errors.Is(err, ErrOpen) {
			t.Errorf("%s opened it: %v", name, err)
		}
	}
	tampered := s[:len(s)-2] + "AA"
	if _, _, err := k.Open(tampered); !errors.Is(err, ErrOpen) {
		t.Errorf("a tampered value opened: %v", err)
	}
	if got, legacy, err := k.Open("plain-old-token"); err != nil || !legacy || got != "plain-old-token" {
		t.Errorf("legacy plaintext: %q %v %v", got, legacy, err)
	}
	if k.Seal("") != "" {
		t.Error("an empty value was sealed")
	}
	if _, err := NewKey([]byte("short"), "tokens"); err == nil {
		t.Error("a short secret accepted")
	}
}

func TestLocalSecret(t *testing.T) {
	dir := t.TempDir()
	a, err := LocalSecret(dir)
	if err != nil || len(a) != 32 {
		t.Fatalf("%x %v", a, err)
	}
	if st, _ := os.Stat(filepath.Join(dir, SecretFile)); st.Mode().Perm() != 0o600 {
		t.Fatalf("mode %v", st.Mode())
	}
	b, err := LocalSecret(dir)
	if err != nil || string(a) != string(b) {
		t.Fatal("the secret changed between starts")
	}
	os.WriteFile(filepath.Join(dir, SecretFile), []byte("short"), 0o600)
	if _, err := LocalSecret(dir); err == nil {
		t.Fatal("a truncated secret accepted")
	}
}
