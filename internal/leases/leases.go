// Package leases owns a node's client leases: a client (an RL trainer)
// binds the sandboxes it creates to a lease it names and keeps renewing;
// when the client stops renewing it (it crashed), the lease expires and
// the node ends its sandboxes (paused or killed, as each one's autoPause
// says), so no sandbox outlives the client that forgot it. A lease is
// kept, expired, until it is deleted: the sandboxes bound to it are then
// orphans that `aenv ls --orphans` and `aenv gc` find. Which sandboxes a
// lease binds is in their records (package sandboxes); this package keeps
// the leases themselves, in the node's database.
package leases

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"regexp"
	"time"

	"github.com/agentenv/agentenv/internal/errkind"
	"github.com/agentenv/agentenv/internal/statedb"
)

const schema = `
CREATE TABLE IF NOT EXISTS client_leases (
	id         TEXT PRIMARY KEY,
	ttl_ms     INTEGER NOT NULL,
	expires_at INTEGER NOT NULL, -- Unix ms
	expired    INTEGER NOT NULL, -- 1: not renewed in time, its sandboxes ended
	created_at INTEGER NOT NULL
);`

// Bounds of a lease's time to live.
const (
	MinTTL     = 5 * time.Second
	MaxTTL     = 24 * time.Hour
	DefaultTTL = 5 * time.Minute
)

// IDPattern is what a lease id may be.
var IDPattern = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$`)

// Lease is one lease.
type Lease struct {
	ID        string
	TTL       time.Duration
	ExpiresAt time.Time
	// Expired: it was not renewed in time and its sandboxes were ended.
	Expired   bool
	CreatedAt time.Time
}

// Store keeps the leases.
type Store struct {
	db  *sql.DB
	now func() time.Time
}

// Open creates the table if needed.
func Open(ctx context.Context, db *sql.DB) (*Store, error) {
	if _, err := db.ExecContext(ctx, schema); err != nil {
		return nil, fmt.Errorf("leases table: %w", err)
	}
	return &Store{db: db, now: time.Now}, nil
}

// Check validates a lease id and time to live (0: DefaultTTL), returning
// the time to live to use.
func Check(id string, ttl time.Duration) (time.Duration, error) {
	if !IDPattern.MatchString(id) {
		return 0, fmt.Errorf("%w: lease id %q must be 1 to 128 letters, digits, '.', '_' or '-'", errkind.ErrInvalid, id)
	}
	if ttl == 0 {
		ttl = DefaultTTL
	}
	if ttl < MinTTL || ttl > MaxTTL {
		return 0, fmt.Errorf("%w: lease ttl must be between %d and %d seconds", errkind.ErrInvalid, int(MinTTL.Seconds()), int(MaxTTL.Seconds()))
	}
	return ttl, nil
}

// Take makes the lease, or renews it (with this time to live; an expired
// one lives again): a create bound to it calls this before its record.
func (s *Store) Take(ctx context.Context, id string, ttl time.Duration) (*Lease, error) {
	ttl, err := Check(id, ttl)
	if err != nil {
		return nil, err
	}
	now := s.now()
	if _, err := s.db.ExecContext(ctx, `INSERT INTO client_leases (id, ttl_ms, expires_at, expired, created_at) VALUES (?, ?, ?, 0, ?)
		ON CONFLICT (id) DO UPDATE SET ttl_ms = excluded.ttl_ms, expires_at = excluded.expires_at, expired = 0`,
		id, ttl.Milliseconds(), now.Add(ttl).UnixMilli(), now.UnixMilli()); err != nil {
		return nil, fmt.Errorf("take lease %s: %w", id, err)
	}
	return s.Get(ctx, id)
}

// Renew extends a live lease by its time to live (or ttl, when not 0,
// which becomes its time to live). An unknown lease is ErrNotFound, an
// expired one ErrConflict (its sandboxes were ended; take it again with a
// create).
func (s *Store) Renew(ctx context.Context, id string, ttl time.Duration) (*Lease, error) {
	l, err := s.Get(ctx, id)
	if err != nil {
		return nil, err
	}
	if l.Expired {
		return nil, fmt.Errorf("%w: lease %s expired at %s and its sandboxes were ended", errkind.ErrConflict, id, l.ExpiresAt.Format(time.RFC3339))
	}
	if ttl == 0 {
		ttl = l.TTL
	}
	if ttl, err = Check(id, ttl); err != nil {
		return nil, err
	}
	res, err := s.db.ExecContext(ctx, `UPDATE client_leases SET ttl_ms = ?, expires_at = ? WHERE id = ? AND expired = 0`,
		ttl.Milliseconds(), s.now().Add(ttl).UnixMilli(), id)
	if err != nil {
		return nil, fmt.Errorf("renew lease %s: %w", id, err)
	}
	if n, _ := res.RowsAffected(); n != 1 {
		return nil, fmt.Errorf("%w: lease %s expired as it was renewed", errkind.ErrConflict, id)
	}
	return s.Get(ctx, id)
}

// Get is one lease (ErrNotFound when there is none).
func (s *Store) Get(ctx context.Context, id string) (*Lease, error) {
	l, err := scan(s.db.QueryRowContext(ctx, `SELECT id, ttl_ms, expires_at, expired, created_at FROM client_leases WHERE id = ?`, id))
	if errors.Is(err, sql.ErrNoRows) {
		return nil, fmt.Errorf("%w: lease %q", errkind.ErrNotFound, id)
	}
	return l, err
}

// List is every lease, oldest first.
func (s *Store) List(ctx context.Context) ([]*Lease, error) {
	rows, err := s.db.QueryContext(ctx, `SELECT id, ttl_ms, expires_at, expired, created_at FROM client_leases ORDER BY created_at, id`)
	return statedb.Collect(rows, err, scan)
}

// Delete forgets a lease.
func (s *Store) Delete(ctx context.Context, id string) error {
	res, err := s.db.ExecContext(ctx, `DELETE FROM client_leases WHERE id = ?`, id)
	if err != nil {
		return fmt.Errorf("delete lease %s: %w", id, err)
	}
	if n, _ := res.RowsAffected(); n == 0 {
		return fmt.Errorf("%w: lease %q", errkind.ErrNotFound, id)
	}
	return nil
}

// Expire marks the leases not renewed in time as expired and returns
// them: the caller ends their sandboxes.
func (s *Store) Expire(ctx context.Context) ([]*Lease, error) {
	now := s.now().UnixMilli()
	rows, err := s.db.QueryContext(ctx, `UPDATE client_leases SET expired = 1 WHERE expired = 0 AND expires_at <= ?
		RETURNING id, ttl_ms, expires_at, expired, created_at`, now)
	out, err := statedb.Collect(rows, err, scan)
	if err != nil {
		return nil, fmt.Errorf("expire leases: %w", err)
	}
	return out, nil
}

func scan(row interface{ Scan(...any) error }) (*Lease, error) {
	var l Lease
	var ttl, exp, created int64
	if err := row.Scan(&l.ID, &ttl, &exp, &l.Expired, &created); err != nil {
		return nil, err
	}
	l.TTL = time.Duration(ttl) * time.Millisecond
	l.ExpiresAt = time.UnixMilli(exp).UTC()
	l.CreatedAt = time.UnixMilli(created).UTC()
	return &l, nil
}
