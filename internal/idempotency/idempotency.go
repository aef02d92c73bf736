// Package idempotency owns the node's record of requests made with an
// Idempotency-Key: a create or fork retried with the same key (by the
// same client, on the same route, with the same body) within a window
// gets the answer of the first, which is kept in the node's database and
// so survives a restart. A retry while the first is still running waits
// for it; the same key with another body is refused. A first request that
// failed leaves nothing, so its retry runs again. A first request cut off
// by the node's end (a crash between the sandbox made and its answer kept)
// is resumed by its retry: what it made carries its request id
// (WithRequest), so the retry answers with that instead of making more.
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
	done        INTEGER NOT NULL,  -- 0: the first request is running, 1: answered, 2: cut off by the node's end
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

// Row states (column done).
const (
	running     = 0
	answered    = 1
	interrupted = 2
)

// Open creates the table if needed, marks what a previous process left
// running as cut off (its retry looks for what it made) and forgets what
// was kept longer than window.
func Open(ctx context.Context, db *sql.DB, window time.Duration) (*Store, error) {
	if window <= 0 {
		window = 24 * time.Hour
	}
	s := &Store{db: db, window: window, poll: 50 * time.Millisecond, now: time.Now}
	if _, err := db.ExecContext(ctx, schema); err != nil {
		return nil, fmt.Errorf("idempotency table: %w", err)
	}
	if _, err := db.ExecContext(ctx, `DELETE FROM idempotent_requests WHERE created_at < ?`,
		s.now().Add(-window).UnixMilli()); err != nil {
		return nil, fmt.Errorf("idempotency table: %w", err)
	}
	if _, err := db.ExecContext(ctx, `UPDATE idempotent_requests SET done = ? WHERE done = ?`, interrupted, running); err != nil {
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

// ID names the request (its client, route and key): what it makes is
// marked with it (WithRequest).
func (r Request) ID() string { return r.id() }

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
// has its answer. A claim that is Interrupted takes over a first request
// cut off by the node's end: the caller looks for what that made before
// running anew. The same key with another body is an ErrMismatch; a first
// request still running after wait an ErrConflict.
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
			done int
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
			return nil, nil, errMismatch
		}
		switch done {
		case answered:
			return &a, nil, nil
		case interrupted:
			if c, err := s.takeOver(ctx, id); err != nil || c != nil {
				return nil, c, err
			}
			continue // another retry took it over: wait for that one
		}
		if s.now().After(deadline) {
			return nil, nil, errStillRunning
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
// running, as a retry does), ErrUnknown when it does not. A first request
// cut off by the node's end comes back as an Interrupted claim: the caller
// answers from what it made, or Releases the claim (and then the key is
// unknown here). A gateway that lost track of where a key's request went
// asks every node with it.
func (s *Store) Find(ctx context.Context, req Request, wait time.Duration) (*Answer, *Claim, error) {
	if req.Key == "" || len(req.Key) > MaxKeyLength {
		return nil, nil, fmt.Errorf("%w: Idempotency-Key must be 1 to %d characters", errkind.ErrInvalid, MaxKeyLength)
	}
	id, fp := req.id(), req.fingerprint()
	deadline := s.now().Add(wait)
	for {
		var (
			have    string
			done    int
			created int64
			a       Answer
		)
		err := s.db.QueryRowContext(ctx, `SELECT fingerprint, done, status, content_type, body, created_at FROM idempotent_requests WHERE id = ?`, id).
			Scan(&have, &done, &a.Status, &a.ContentType, &a.Body, &created)
		if errors.Is(err, sql.ErrNoRows) || (err == nil && created < s.now().Add(-s.window).UnixMilli()) {
			return nil, nil, ErrUnknown
		}
		if err != nil {
			return nil, nil, fmt.Errorf("read idempotency key: %w", err)
		}
		if have != fp {
			return nil, nil, errMismatch
		}
		switch done {
		case answered:
			return &a, nil, nil
		case interrupted:
			if c, err := s.takeOver(ctx, id); err != nil || c != nil {
				return nil, c, err
			}
			continue
		}
		if s.now().After(deadline) {
			return nil, nil, errStillRunning
		}
		select {
		case <-ctx.Done():
			return nil, nil, ctx.Err()
		case <-time.After(s.poll):
		}
	}
}

var (
	errMismatch     = fmt.Errorf("%w: this Idempotency-Key was used with another request body; a retry must send the same body (or use a new key)", errkind.ErrMismatch)
	errStillRunning = fmt.Errorf("%w: the first request with this Idempotency-Key is still running; retry later", errkind.ErrConflict)
)

// takeOver claims a first request cut off by the node's end; nil when
// another retry took it over first.
func (s *Store) takeOver(ctx context.Context, id string) (*Claim, error) {
	res, err := s.db.ExecContext(ctx, `UPDATE idempotent_requests SET done = ? WHERE id = ? AND done = ?`, running, id, interrupted)
	if err != nil {
		return nil, fmt.Errorf("claim idempotency key: %w", err)
	}
	if n, _ := res.RowsAffected(); n != 1 {
		return nil, nil
	}
	return &Claim{s: s, id: id, interrupted: true}, nil
}

// Claim is a key claimed by a first request, or by the retry of one cut
// off by the node's end (Interrupted).
type Claim struct {
	s           *Store
	id          string
	interrupted bool
}

// ID is the claimed request's Request.ID.
func (c *Claim) ID() string { return c.id }

// Interrupted reports that the claim took over a first request cut off by
// the node's end: what that made carries ID and may be there.
func (c *Claim) Interrupted() bool { return c.interrupted }

// Release forgets the key (a find-only request found nothing of the
// request it took over): its next request runs anew.
func (c *Claim) Release(ctx context.Context) error { return c.Finish(ctx, Answer{}) }

// Finish keeps a successful answer (2xx) for the key's retries, or
// forgets the key after a failure so that a retry runs again. ctx should
// outlive the client (the answer is kept even if it went).
func (c *Claim) Finish(ctx context.Context, a Answer) error {
	if a.Status < 200 || a.Status > 299 {
		_, err := c.s.db.ExecContext(ctx, `DELETE FROM idempotent_requests WHERE id = ? AND done = ?`, c.id, running)
		return err
	}
	_, err := c.s.db.ExecContext(ctx, `UPDATE idempotent_requests SET done = ?, status = ?, content_type = ?, body = ? WHERE id = ?`,
		answered, a.Status, a.ContentType, a.Body, c.id)
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

type requestKey struct{}

// WithRequest marks ctx as serving the idempotent request id
// (Claim.ID): the sandboxes it makes record it, so that a retry after the
// node's end finds them (RequestOf).
func WithRequest(ctx context.Context, id string) context.Context {
	return context.WithValue(ctx, requestKey{}, id)
}

// RequestOf is the idempotent request ctx serves ("" for none).
func RequestOf(ctx context.Context) string {
	id, _ := ctx.Value(requestKey{}).(string)
	return id
}
