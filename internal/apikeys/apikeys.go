// Package apikeys owns a node's client API keys: named keys of the form the
// E2B SDKs accept (e2b_<hex>), stored only as their SHA-256 in the node's
// database, checked in constant time, made and revoked while the node runs
// (through the node's admin socket, see Handler) or offline.
package apikeys

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"database/sql"
	"encoding/hex"
	"errors"
	"fmt"
	"regexp"
	"strings"
	"time"

	"github.com/agentenv/agentenv/internal/errkind"
)

// Pattern is the form of API keys the E2B SDKs accept.
var Pattern = regexp.MustCompile(`^e2b_[0-9a-f]+$`)

var namePattern = regexp.MustCompile(`^[a-z0-9][a-z0-9._-]{0,62}$`)

const schema = `
CREATE TABLE IF NOT EXISTS api_keys (
	name       TEXT PRIMARY KEY,
	sha256     TEXT NOT NULL UNIQUE,
	created_at INTEGER NOT NULL
);`

// Key is one stored key (never the key itself).
type Key struct {
	Name    string    `json:"name"`
	Created time.Time `json:"created"`
	// Hint is the start of the key's hash, to tell keys apart.
	Hint string `json:"hint"`
}

// Keys is the api_keys table of a node's database.
type Keys struct{ db *sql.DB }

// Open creates the table if needed.
func Open(db *sql.DB) (*Keys, error) {
	if _, err := db.Exec(schema); err != nil {
		return nil, fmt.Errorf("migrate api keys: %w", err)
	}
	return &Keys{db: db}, nil
}

// ValidName reports (nil) whether name can name a key.
func ValidName(name string) error {
	if !namePattern.MatchString(name) {
		return fmt.Errorf("%w: key name %q (want 1-63 of [a-z0-9._-], starting with a letter or digit)", errkind.ErrInvalid, name)
	}
	return nil
}

// Create makes a new key named name and returns it: the only time the key
// exists outside its holder's hands. A name in use is ErrConflict.
func (k *Keys) Create(ctx context.Context, name string) (string, error) {
	key, err := newKey(name)
	if err != nil {
		return "", err
	}
	if err := k.Add(ctx, name, sha256.Sum256([]byte(key))); err != nil {
		return "", err
	}
	return key, nil
}

// newKey checks a new key's name and makes the key (20 random bytes, in
// the form the E2B SDKs accept).
func newKey(name string) (string, error) {
	if err := ValidName(name); err != nil {
		return "", err
	}
	raw := make([]byte, 20)
	if _, err := rand.Read(raw); err != nil {
		return "", err
	}
	return "e2b_" + hex.EncodeToString(raw), nil
}

// Add stores the hash of a key made elsewhere (an older node's only key).
func (k *Keys) Add(ctx context.Context, name string, sum [32]byte) error {
	if err := ValidName(name); err != nil {
		return err
	}
	_, err := k.db.ExecContext(ctx, `INSERT INTO api_keys (name, sha256, created_at) VALUES (?, ?, ?)`,
		name, hex.EncodeToString(sum[:]), time.Now().UnixMilli())
	if err != nil && strings.Contains(err.Error(), "UNIQUE") {
		if strings.Contains(err.Error(), "api_keys.name") {
			return fmt.Errorf("%w: a key named %q exists", errkind.ErrConflict, name)
		}
		return fmt.Errorf("%w: that key is stored already", errkind.ErrConflict)
	}
	if err != nil {
		return fmt.Errorf("store api key: %w", err)
	}
	return nil
}

// List returns the stored keys by name.
func (k *Keys) List(ctx context.Context) ([]Key, error) {
	rows, err := k.db.QueryContext(ctx, `SELECT name, sha256, created_at FROM api_keys ORDER BY name`)
	if err != nil {
		return nil, fmt.Errorf("list api keys: %w", err)
	}
	defer rows.Close()
	var out []Key
	for rows.Next() {
		var (
			key     Key
			sum     string
			created int64
		)
		if err := rows.Scan(&key.Name, &sum, &created); err != nil {
			return nil, err
		}
		key.Created, key.Hint = time.UnixMilli(created).UTC(), sum[:8]
		out = append(out, key)
	}
	return out, rows.Err()
}

// Revoke deletes key name: from the next request on it is refused.
func (k *Keys) Revoke(ctx context.Context, name string) error {
	res, err := k.db.ExecContext(ctx, `DELETE FROM api_keys WHERE name = ?`, name)
	if err != nil {
		return fmt.Errorf("revoke api key: %w", err)
	}
	if n, _ := res.RowsAffected(); n == 0 {
		return fmt.Errorf("%w: no key named %q", errkind.ErrNotFound, name)
	}
	return nil
}

// Check returns the name of the stored key key is, comparing its hash with
// every stored one in constant time; ok is false for an unknown key.
func (k *Keys) Check(ctx context.Context, key string) (name string, ok bool, err error) {
	sum := sha256.Sum256([]byte(key))
	rows, err := k.db.QueryContext(ctx, `SELECT name, sha256 FROM api_keys`)
	if err != nil {
		return "", false, fmt.Errorf("check api key: %w", err)
	}
	defer rows.Close()
	for rows.Next() {
		var n, stored string
		if err := rows.Scan(&n, &stored); err != nil {
			return "", false, err
		}
		want, err := hex.DecodeString(stored)
		if err != nil || len(want) != len(sum) {
			continue
		}
		if subtle.ConstantTimeCompare(sum[:], want) == 1 && !ok {
			name, ok = n, true
		}
	}
	return name, ok, rows.Err()
}

// ErrNoKeys: a node without any key refuses every client.
var ErrNoKeys = errors.New("the node has no API key: make one with `aenv key create NAME`")
