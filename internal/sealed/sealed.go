// Package sealed owns how secrets (envd access tokens, traffic tokens) are
// written into storage the nodes share: sealed with AES-256-GCM under a key
// derived (HKDF-SHA256) from a secret the nodes share, so that the
// repository never holds them in plaintext, and a copy one node made opens
// on any other node with the same secret.
package sealed

import (
	"crypto/aes"
	"crypto/cipher"
	"crypto/hkdf"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/agentenv/agentenv/internal/storage"
)

// prefix marks a sealed value (and its format version).
const prefix = "sealed:v1:"

// ErrOpen: a sealed value that this key cannot open (another cluster's
// secret, or tampered with).
var ErrOpen = errors.New("sealed value cannot be opened with this node's secret")

// Key seals and opens values for one purpose.
type Key struct{ aead cipher.AEAD }

// NewKey derives the key for purpose from secret (at least 16 bytes).
func NewKey(secret []byte, purpose string) (*Key, error) {
	if len(secret) < 16 {
		return nil, errors.New("sealing secret shorter than 16 bytes")
	}
	k, err := hkdf.Key(sha256.New, secret, nil, "agentenv sealed "+purpose, 32)
	if err != nil {
		return nil, err
	}
	block, err := aes.NewCipher(k)
	if err != nil {
		return nil, err
	}
	aead, err := cipher.NewGCM(block)
	if err != nil {
		return nil, err
	}
	return &Key{aead: aead}, nil
}

// Seal returns plain sealed ("" stays "": nothing to hide).
func (k *Key) Seal(plain string) string {
	if plain == "" {
		return ""
	}
	nonce := make([]byte, k.aead.NonceSize())
	if _, err := rand.Read(nonce); err != nil {
		panic(err)
	}
	out := k.aead.Seal(nonce, nonce, []byte(plain), []byte(prefix))
	return prefix + base64.RawURLEncoding.EncodeToString(out)
}

// Open returns the plaintext of a sealed value. A value without the sealed
// form is returned as it is, with legacy true: a copy an older release
// wrote in plaintext.
func (k *Key) Open(s string) (plain string, legacy bool, err error) {
	if s == "" {
		return "", false, nil
	}
	rest, ok := strings.CutPrefix(s, prefix)
	if !ok {
		return s, true, nil
	}
	raw, err := base64.RawURLEncoding.DecodeString(rest)
	if err != nil || len(raw) < k.aead.NonceSize() {
		return "", false, ErrOpen
	}
	n := k.aead.NonceSize()
	out, err := k.aead.Open(nil, raw[:n], raw[n:], []byte(prefix))
	if err != nil {
		return "", false, ErrOpen
	}
	return string(out), false, nil
}

// LocalSecret returns the sealing secret kept in file SecretFile of
// dataDir, making it (32 random bytes, 0600) on first use: the secret of a
// node whose repository no other node shares.
func LocalSecret(dataDir string) ([]byte, error) {
	path := filepath.Join(dataDir, SecretFile)
	b, err := os.ReadFile(path)
	if err == nil && len(b) >= 32 {
		return b, nil
	}
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, err
	}
	if err == nil {
		return nil, fmt.Errorf("%s is shorter than 32 bytes", path)
	}
	b = make([]byte, 32)
	if _, err := rand.Read(b); err != nil {
		return nil, err
	}
	if err := storage.WriteFileAtomic(path, b, 0o600); err != nil {
		return nil, err
	}
	return b, nil
}

// SecretFile is the local sealing secret in a data dir.
const SecretFile = "repository.secret"
