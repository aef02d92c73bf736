// Package idempotency owns the node's record of requests made with an
// Idempotency-Key: a create or fork retried with the same key (by the
// same client, on the same route, with the same body) within a window
// gets the answer of the first, which is kept in the node's database and
// so survives a restart. A retry while the first is still running waits
// for it; the same key with another body is refused. A first request that
// failed leaves nothing, so its retry runs again.
package idempotency

import (
	"context"
	"crypto/sha256"
	"database/sql"
	"encoding/hex"
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/agentenv/agentenv/internal/errkind"
)

const schema = `
CREATE TABLE IF NOT EXISTS idempotent_requests (
	id          TEXT PRIMARY KEY,  -- SHA-256 of the client, route and key
	fingerprint TEXT NOT NULL,     -- SHA-256 of the request body
	done        INTEGER NOT NULL,  -- 0: the first request is running
	status      INTEGER NOT NULL,
	content_type TEXT NOT NULL,
	body        BLOB NOT NULL,
	created_at  INTEGER NOT NULL   -- Unix ms
);`

// MaxKeyLength bounds an Idempotency-Key.
const MaxKeyLength = 255

// Store keeps the answers of idempotent requests.
type Store struct {
	db     *sql.DB
	window time.Duration
	// poll is how often a retry checks whether the first request ended.
	poll time.Duration
	now  func() time.Time
}

// Open creates the table if needed and forgets what a previous process
// left running (its requests did not survive it) or kept longer than
// window.
func Open(ctx context.Context, db *sql.DB, window time.Duration) (*Store, error) {
	if window <= 0 {
		window = 24 * time.Hour
	}
	s := &Store{db: db, window: window, poll: 50 * time.Millisecond, now: time.Now}
	if _, err := db.ExecContext(ctx, schema); err != nil {
		return nil, fmt.Errorf("idempotency table: %w", err)
	}
	if _, err := db.ExecContext(ctx, `DELETE FROM idempotent_requests WHERE done = 0 OR created_at < ?`,
		s.now().Add(-window).UnixMilli()); err != nil {
		return nil, fmt.Errorf("idempotency table: %w", err)
	}
	return s, nil
}

// Window is how long an answer is kept.
func (s *Store) Window() time.Duration { return s.window }

// Answer is a stored answer.
type Answer struct {
	Status      int
	ContentType string
	Body        []byte
}

// Request is one request made with a key.
type Request struct {
	// Client names who sent it (the hash of its API key), Route what it
	// asked ("POST /v2/sandboxes"), Key its Idempotency-Key.
	Client, Route, Key string
	Body               []byte
}

func (r Request) id() string {
	sum := sha256.Sum256([]byte(r.Client + "\x00" + r.Route + "\x00" + r.Key))
	return hex.EncodeToString(sum[:])
}

func (r Request) fingerprint() string {
	sum := sha256.Sum256(r.Body)
	return hex.EncodeToString(sum[:])
}

// Begin claims the request's key. It returns the first request's answer
// when the key was used before (waiting up to wait for one still
// running), or nil and a claim the caller ends with Claim.Finish once it
// has its answer. The same key with another body is an ErrMismatch; a
// first request still running after wait an ErrConflict.
func (s *Store) Begin(ctx context.Context, req Request, wait time.Duration) (*Answer, *Claim, error) {
	if req.Key == "" || len(req.Key) > MaxKeyLength {
		return nil, nil, fmt.Errorf("%w: Idempotency-Key must be 1 to %d characters", errkind.ErrInvalid, MaxKeyLength)
	}
	id, fp := req.id(), req.fingerprint()
	deadline := s.now().Add(wait)
	for {
		now := s.now()
		res, err := s.db.ExecContext(ctx, `INSERT INTO idempotent_requests (id, fingerprint, done, status, content_type, body, created_at)
			VALUES (?, ?, 0, 0, '', x'', ?) ON CONFLICT (id) DO UPDATE SET fingerprint = excluded.fingerprint,
			done = 0, status = 0, content_type = '', body = x'', created_at = excluded.created_at
			WHERE idempotent_requests.created_at < ?`, id, fp, now.UnixMilli(), now.Add(-s.window).UnixMilli())
		if err != nil {
			return nil, nil, fmt.Errorf("claim idempotency key: %w", err)
		}
		if n, _ := res.RowsAffected(); n == 1 {
			return nil, &Claim{s: s, id: id}, nil
		}
		var (
			have string
			done bool
			a    Answer
		)
		err = s.db.QueryRowContext(ctx, `SELECT fingerprint, done, status, content_type, body FROM idempotent_requests WHERE id = ?`, id).
			Scan(&have, &done, &a.Status, &a.ContentType, &a.Body)
		if errors.Is(err, sql.ErrNoRows) {
			continue // the first ended in a failure meanwhile: claim it again
		}
		if err != nil {
			return nil, nil, fmt.Errorf("read idempotency key: %w", err)
		}
		if have != fp {
			return nil, nil, fmt.Errorf("%w: this Idempotency-Key was used with another request body; a retry must send the same body (or use a new key)", errkind.ErrMismatch)
		}
		if done {
			return &a, nil, nil
		}
		if s.now().After(deadline) {
			return nil, nil, fmt.Errorf("%w: the first request with this Idempotency-Key is still running; retry later", errkind.ErrConflict)
		}
		select {
		case <-ctx.Done():
			return nil, nil, ctx.Err()
		case <-time.After(s.poll):
		}
	}
}

// ErrUnknown is Find's answer for a key this store does not hold.
var ErrUnknown = errors.New("this node holds no request with this Idempotency-Key")

// Find is Begin for a request that must not run here: the first request's
// answer when this store holds the key (waiting up to wait for one still
// running, as a retry does), ErrUnknown when it does not. A gateway that
// lost track of where a key's request went asks every node with it.
func (s *Store) Find(ctx context.Context, req Request, wait time.Duration) (*Answer, error) {
	if req.Key == "" || len(req.Key) > MaxKeyLength {
		return nil, fmt.Errorf("%w: Idempotency-Key must be 1 to %d characters", errkind.ErrInvalid, MaxKeyLength)
	}
	id, fp := req.id(), req.fingerprint()
	deadline := s.now().Add(wait)
	for {
		var (
			have    string
			done    bool
			created int64
			a       Answer
		)
		err := s.db.QueryRowContext(ctx, `SELECT fingerprint, done, status, content_type, body, created_at FROM idempotent_requests WHERE id = ?`, id).
			Scan(&have, &done, &a.Status, &a.ContentType, &a.Body, &created)
		if errors.Is(err, sql.ErrNoRows) || (err == nil && created < s.now().Add(-s.window).UnixMilli()) {
			return nil, ErrUnknown
		}
		if err != nil {
			return nil, fmt.Errorf("read idempotency key: %w", err)
		}
		if have != fp {
			return nil, fmt.Errorf("%w: this Idempotency-Key was used with another request body; a retry must send the same body (or use a new key)", errkind.ErrMismatch)
		}
		if done {
			return &a, nil
		}
		if s.now().After(deadline) {
			return nil, fmt.Errorf("%w: the first request with this Idempotency-Key is still running; retry later", errkind.ErrConflict)
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(s.poll):
		}
	}
}

// Claim is a key claimed by a first request.
type Claim struct {
	s  *Store
	id string
}

// Finish keeps a successful answer (2xx) for the key's retries, or
// forgets the key after a failure so that a retry runs again. ctx should
// outlive the client (the answer is kept even if it went).
func (c *Claim) Finish(ctx context.Context, a Answer) error {
	if a.Status < 200 || a.Status > 299 {
		_, err := c.s.db.ExecContext(ctx, `DELETE FROM idempotent_requests WHERE id = ? AND done = 0`, c.id)
		return err
	}
	_, err := c.s.db.ExecContext(ctx, `UPDATE idempotent_requests SET done = 1, status = ?, content_type = ?, body = ? WHERE id = ?`,
		a.Status, a.ContentType, a.Body, c.id)
	return err
}

// ReplayedHeader marks an answer that repeats the first request's.
const ReplayedHeader = "Idempotent-Replayed"

// Write writes a stored answer, marked as replayed.
func (a *Answer) Write(w http.ResponseWriter) {
	if a.ContentType != "" {
		w.Header().Set("Content-Type", a.ContentType)
	}
	w.Header().Set(ReplayedHeader, "true")
	w.WriteHeader(a.Status)
	_, _ = w.Write(a.Body)
}
