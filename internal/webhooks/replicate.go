package webhooks

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/agentenv/agentenv/internal/errkind"
	"github.com/agentenv/agentenv/internal/statedb"
)

// In a cluster every node keeps the same webhooks (each sends the events
// of its own sandboxes), and a node that was down, or joined later, has
// to be brought to what the others have. Each change of a webhook
// (registration, update, deletion) carries a revision, the gateway's
// clock in microseconds when it made the change on every node (the
// node's own clock otherwise), and a deletion leaves a tombstone with its
// revision for TombstoneKeep. Records lists a node's webhooks and
// tombstones; Apply takes another node's records, each where it is newer
// than what this node has of that id. The newest record of each id wins
// on every node, so a deletion the down node missed is not brought back
// by it.

// TombstoneKeep is how long a deletion is remembered: a node down longer
// than that may bring a deleted webhook back.
const TombstoneKeep = 30 * 24 * time.Hour

// Record is what a node has of one webhook id: the webhook (with its
// secret), or the deletion of it.
type Record struct {
	ID       string `json:"id"`
	Revision int64  `json:"revision"`
	// Deleted: the webhook was deleted (Webhook is nil).
	Deleted bool     `json:"deleted,omitempty"`
	Webhook *Webhook `json:"webhook,omitempty"`
}

// Supersedes reports whether r is newer than other (a record of the same
// id): a higher revision, or a deletion of the same revision. Every node
// and the gateway order records by it.
func (r Record) Supersedes(other Record) bool {
	return r.Revision > other.Revision || (r.Revision == other.Revision && r.Deleted && !other.Deleted)
}

const tombstoneSchema = `
CREATE TABLE IF NOT EXISTS webhook_tombstones (
	id         TEXT PRIMARY KEY,
	revision   INTEGER NOT NULL,
	deleted_at INTEGER NOT NULL
);`

// migrate adds what older databases lack: revisions (a webhook made
// before them stands at its registration time) and tombstones.
func migrate(ctx context.Context, db *sql.DB) error {
	have, err := statedb.Columns(db, "webhooks")
	if err != nil {
		return err
	}
	if !have["revision"] {
		if _, err := db.ExecContext(ctx, `ALTER TABLE webhooks ADD COLUMN revision INTEGER NOT NULL DEFAULT 0;
			UPDATE webhooks SET revision = created_at * 1000`); err != nil {
			return err
		}
	}
	_, err = db.ExecContext(ctx, tombstoneSchema)
	return err
}

// nextRevision is the revision of a change made here: the one given (a
// gateway's), or the clock, and in any case past what the id has.
func (s *Store) nextRevision(ctx context.Context, q querier, id string, given int64) (int64, error) {
	cur, err := currentRevision(ctx, q, id)
	if err != nil {
		return 0, err
	}
	rev := given
	if rev <= 0 {
		rev = s.now().UnixMicro()
	}
	return max(rev, cur+1), nil
}

type querier interface {
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}

// currentRevision is the newest revision this node has of id, a
// webhook's or a tombstone's (0: none).
func currentRevision(ctx context.Context, q querier, id string) (int64, error) {
	cur, err := current(ctx, q, id)
	return cur.Revision, err
}

// current is what this node has of id (revision 0: nothing); a node
// holds either the webhook or its tombstone, never both.
func current(ctx context.Context, q querier, id string) (Record, error) {
	var live, gone int64
	err := q.QueryRowContext(ctx, `SELECT
		coalesce((SELECT revision FROM webhooks WHERE id = ?1), 0),
		coalesce((SELECT revision FROM webhook_tombstones WHERE id = ?1), 0)`, id).Scan(&live, &gone)
	if gone > live {
		return Record{ID: id, Revision: gone, Deleted: true}, err
	}
	return Record{ID: id, Revision: live}, err
}

// Records are this node's webhooks (with their secrets) and tombstones.
func (s *Store) Records(ctx context.Context) ([]Record, error) {
	rows, err := s.db.QueryContext(ctx, `SELECT revision, `+webhookColumns+` FROM webhooks ORDER BY id`)
	hooks, err := statedb.Collect(rows, err, func(row interface{ Scan(...any) error }) (Record, error) {
		var rev int64
		w, err := scanWebhook(revisionFirst{row, &rev})
		if err != nil {
			return Record{}, err
		}
		return Record{ID: w.ID, Revision: rev, Webhook: w}, nil
	})
	if err != nil {
		return nil, err
	}
	rows, err = s.db.QueryContext(ctx, `SELECT id, revision FROM webhook_tombstones ORDER BY id`)
	gone, err := statedb.Collect(rows, err, func(row interface{ Scan(...any) error }) (Record, error) {
		r := Record{Deleted: true}
		return r, row.Scan(&r.ID, &r.Revision)
	})
	if err != nil {
		return nil, err
	}
	return append(hooks, gone...), nil
}

// revisionFirst scans a row whose first column is the revision, then a
// webhook's columns.
type revisionFirst struct {
	row interface{ Scan(...any) error }
	rev *int64
}

func (r revisionFirst) Scan(dest ...any) error { return r.row.Scan(append([]any{r.rev}, dest...)...) }

// Apply takes records from another node: each one newer than what this
// node has of its id replaces it (a deletion drops the webhook and its
// deliveries). It returns how many it took; a record that is not a valid
// webhook is refused (ErrInvalid) and nothing is taken.
func (s *Store) Apply(ctx context.Context, recs []Record) (int, error) {
	for _, r := range recs {
		if err := checkRecord(r); err != nil {
			return 0, err
		}
	}
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		return 0, err
	}
	defer tx.Rollback()
	taken := 0
	now := s.now().UnixMilli()
	for _, r := range recs {
		cur, err := current(ctx, tx, r.ID)
		if err != nil {
			return 0, err
		}
		if !r.Supersedes(cur) {
			continue
		}
		taken++
		if r.Deleted {
			if err := deleteIn(ctx, tx, r.ID, r.Revision, now); err != nil {
				return 0, err
			}
			continue
		}
		w := r.Webhook
		evs, _ := json.Marshal(w.Events)
		if _, err := tx.ExecContext(ctx, `INSERT INTO webhooks (id, name, url, enabled, events, secret, created_at, revision)
			VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO UPDATE SET name = excluded.name, url = excluded.url,
			enabled = excluded.enabled, events = excluded.events, secret = excluded.secret, created_at = excluded.created_at,
			revision = excluded.revision`,
			r.ID, w.Name, w.URL, w.Enabled, string(evs), w.Secret, w.CreatedAt.UnixMilli(), r.Revision); err != nil {
			return 0, fmt.Errorf("take webhook %s: %w", r.ID, err)
		}
		if _, err := tx.ExecContext(ctx, `DELETE FROM webhook_tombstones WHERE id = ?`, r.ID); err != nil {
			return 0, err
		}
	}
	return taken, tx.Commit()
}

// checkRecord refuses a record that is not a webhook this node would
// have registered.
func checkRecord(r Record) error {
	if !IDPattern.MatchString(r.ID) || r.Revision <= 0 {
		return fmt.Errorf("%w: a webhook record needs an id matching %s and a positive revision", errkind.ErrInvalid, IDPattern)
	}
	if r.Deleted {
		if r.Webhook != nil {
			return fmt.Errorf("%w: webhook record %s is deleted and has a webhook", errkind.ErrInvalid, r.ID)
		}
		return nil
	}
	w := r.Webhook
	if w == nil || w.ID != r.ID {
		return fmt.Errorf("%w: webhook record %s has no webhook of that id", errkind.ErrInvalid, r.ID)
	}
	check := &Webhook{}
	return apply(check, Spec{Name: &w.Name, URL: &w.URL, Events: &w.Events, Secret: &w.Secret})
}

// deleteIn drops a webhook and its deliveries and leaves its tombstone.
func deleteIn(ctx context.Context, tx *sql.Tx, id string, rev, now int64) error {
	if _, err := tx.ExecContext(ctx, `DELETE FROM webhooks WHERE id = ?`, id); err != nil {
		return fmt.Errorf("delete webhook %s: %w", id, err)
	}
	if _, err := tx.ExecContext(ctx, `DELETE FROM webhook_deliveries WHERE webhook_id = ?`, id); err != nil {
		return fmt.Errorf("delete webhook %s: %w", id, err)
	}
	if _, err := tx.ExecContext(ctx, `INSERT INTO webhook_tombstones (id, revision, deleted_at) VALUES (?, ?, ?)
		ON CONFLICT (id) DO UPDATE SET revision = excluded.revision, deleted_at = excluded.deleted_at`, id, rev, now); err != nil {
		return fmt.Errorf("delete webhook %s: %w", id, err)
	}
	return nil
}

// pruneTombstones forgets deletions older than TombstoneKeep.
func (s *Store) pruneTombstones(ctx context.Context) {
	if _, err := s.db.ExecContext(ctx, `DELETE FROM webhook_tombstones WHERE deleted_at < ?`,
		s.now().Add(-TombstoneKeep).UnixMilli()); err != nil && ctx.Err() == nil && !errors.Is(err, context.Canceled) {
		s.log.Error("webhooks: prune tombstones", "err", err)
	}
}
