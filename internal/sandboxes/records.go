package sandboxes

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/agentenv/agentenv/internal/errkind"
	"github.com/agentenv/agentenv/internal/network"
	"github.com/agentenv/agentenv/internal/statedb"
	"github.com/agentenv/agentenv/internal/store"
)

const schema = `
CREATE TABLE IF NOT EXISTS sandboxes (
	id             TEXT PRIMARY KEY,
	template_id    TEXT NOT NULL,
	state          TEXT NOT NULL,
	vcpus          INTEGER NOT NULL,
	memory_mib     INTEGER NOT NULL,
	disk_mib       INTEGER NOT NULL,
	slot           INTEGER NOT NULL UNIQUE,
	pid            INTEGER NOT NULL DEFAULT 0,
	allow_internet INTEGER NOT NULL,
	secure         INTEGER NOT NULL,
	auto_pause     INTEGER NOT NULL,
	access_token   TEXT NOT NULL,
	traffic_token  TEXT NOT NULL,
	default_user   TEXT NOT NULL,
	metadata       TEXT NOT NULL,
	env_vars       TEXT NOT NULL,
	created_at     INTEGER NOT NULL,
	started_at     INTEGER NOT NULL,
	end_at         INTEGER NOT NULL,
	updated_at     INTEGER NOT NULL,
	mem_file       TEXT NOT NULL DEFAULT '',
	mem_private    INTEGER NOT NULL DEFAULT 0,
	snapshot_id    TEXT NOT NULL DEFAULT '',
	auto_resume    INTEGER NOT NULL DEFAULT 0,
	public_traffic INTEGER NOT NULL DEFAULT 1,
	base_layer     TEXT NOT NULL DEFAULT '',
	egress         TEXT NOT NULL DEFAULT '',
	default_workdir TEXT NOT NULL DEFAULT '',
	auto_pause_fs  INTEGER NOT NULL DEFAULT 0,
	volume_slots   INTEGER NOT NULL DEFAULT 0,
	volumes        TEXT NOT NULL DEFAULT '',
	lease          TEXT NOT NULL DEFAULT '',
	request        TEXT NOT NULL DEFAULT '',
	mask_request_host TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS sandboxes_state ON sandboxes(state);
-- A volume is mounted in one sandbox at most (its filesystem has one
-- writer): the sandbox's record holds it, written in the same transaction.
CREATE TABLE IF NOT EXISTS sandbox_volumes (
	volume_id  TEXT PRIMARY KEY,
	sandbox_id TEXT NOT NULL
);
`

// Records is the sandboxes table of a node's database.
type Records struct {
	db *sql.DB
	st *store.Store
	// refs names the store objects a sandbox is made of (held as its
	// references in the store, written with its record).
	refs func(*Sandbox) []string

	slotMu     sync.Mutex // serializes the slot choice and insert of new records
	lastSlot   int        // the slot handed out last; guarded by slotMu
	totalSlots int
}

// Open creates (or brings up to date) the sandboxes table of db, whose
// store st holds the references each record names through refs; new
// records get network slots in [0, slots).
func Open(db *sql.DB, st *store.Store, slots int, refs func(*Sandbox) []string) (*Records, error) {
	if err := Migrate(db); err != nil {
		return nil, err
	}
	return &Records{db: db, st: st, refs: refs, lastSlot: -1, totalSlots: slots}, nil
}

// Migrate creates (or brings up to date) the sandboxes table.
func Migrate(db *sql.DB) error {
	if _, err := db.Exec(schema); err != nil {
		return fmt.Errorf("migrate state db: %w", err)
	}
	if err := addMissingColumns(db); err != nil {
		return fmt.Errorf("migrate state db: %w", err)
	}
	if _, err := db.Exec(`CREATE INDEX IF NOT EXISTS sandboxes_request ON sandboxes(request) WHERE request != ''`); err != nil {
		return fmt.Errorf("migrate state db: %w", err)
	}
	return nil
}

// laterColumns were added to the sandboxes table after its first release;
// databases made before get them with their defaults.
var laterColumns = []struct{ name, decl string }{
	{"mem_file", "TEXT NOT NULL DEFAULT ''"},
	{"mem_private", "INTEGER NOT NULL DEFAULT 0"},
	{"snapshot_id", "TEXT NOT NULL DEFAULT ''"},
	{"auto_resume", "INTEGER NOT NULL DEFAULT 0"},
	{"public_traffic", "INTEGER NOT NULL DEFAULT 1"},
	{"base_layer", "TEXT NOT NULL DEFAULT ''"},
	{"egress", "TEXT NOT NULL DEFAULT ''"},
	{"default_workdir", "TEXT NOT NULL DEFAULT ''"},
	{"auto_pause_fs", "INTEGER NOT NULL DEFAULT 0"},
	{"volume_slots", "INTEGER NOT NULL DEFAULT 0"},
	{"volumes", "TEXT NOT NULL DEFAULT ''"},
	{"lease", "TEXT NOT NULL DEFAULT ''"},
	{"request", "TEXT NOT NULL DEFAULT ''"},
	{"mask_request_host", "TEXT NOT NULL DEFAULT ''"},
}

func addMissingColumns(db *sql.DB) error {
	have, err := statedb.Columns(db, "sandboxes")
	if err != nil {
		return err
	}
	for _, c := range laterColumns {
		if !have[c.name] {
			if _, err := db.Exec(`ALTER TABLE sandboxes ADD COLUMN ` + c.name + ` ` + c.decl); err != nil {
				return fmt.Errorf("add column %s: %w", c.name, err)
			}
		}
	}
	return nil
}

const sandboxColumns = `id, template_id, state, vcpus, memory_mib, disk_mib, slot, pid, allow_internet, secure,
	auto_pause, access_token, traffic_token, default_user, metadata, env_vars, created_at, started_at, end_at,
	mem_file, mem_private, snapshot_id, auto_resume, public_traffic, base_layer, egress, default_workdir, auto_pause_fs,
	volume_slots, volumes, lease, request, mask_request_host`

func scanSandbox(row interface{ Scan(...any) error }) (*Sandbox, error) {
	var s Sandbox
	var meta, env, egress, volumes string
	var created, started, end int64
	if err := row.Scan(&s.ID, &s.TemplateID, &s.State, &s.VCPUs, &s.MemoryMiB, &s.DiskMiB, &s.Slot, &s.PID,
		&s.AllowInternet, &s.Secure, &s.AutoPause, &s.AccessToken, &s.TrafficToken, &s.DefaultUser,
		&meta, &env, &created, &started, &end, &s.MemFile, &s.MemPrivate, &s.SnapshotID,
		&s.AutoResume, &s.PublicTraffic, &s.BaseLayer, &egress, &s.DefaultWorkdir, &s.AutoPauseFilesystem,
		&s.VolumeSlots, &volumes, &s.Lease, &s.Request, &s.MaskRequestHost); err != nil {
		return nil, err
	}
	if volumes != "" {
		if err := json.Unmarshal([]byte(volumes), &s.Volumes); err != nil {
			return nil, fmt.Errorf("sandbox %s volumes: %w", s.ID, err)
		}
	}
	if egress != "" {
		if err := json.Unmarshal([]byte(egress), &s.Egress); err != nil {
			return nil, fmt.Errorf("sandbox %s egress rules: %w", s.ID, err)
		}
	}
	if err := json.Unmarshal([]byte(meta), &s.Metadata); err != nil {
		return nil, fmt.Errorf("sandbox %s metadata: %w", s.ID, err)
	}
	if err := json.Unmarshal([]byte(env), &s.EnvVars); err != nil {
		return nil, fmt.Errorf("sandbox %s env vars: %w", s.ID, err)
	}
	s.CreatedAt = time.UnixMilli(created).UTC()
	s.StartedAt = time.UnixMilli(started).UTC()
	s.EndAt = time.UnixMilli(end).UTC()
	return &s, nil
}

// Holder names a sandbox as a holder of store references.
func Holder(id string) string { return "sandbox/" + id }

// Insert records a new sandbox and what it references, in one transaction.
func (r *Records) Insert(ctx context.Context, s *Sandbox) error {
	meta, _ := json.Marshal(nonNil(s.Metadata))
	env, _ := json.Marshal(nonNil(s.EnvVars))
	err := r.st.Tx(ctx, func(tx *sql.Tx) error {
		if _, err := tx.ExecContext(ctx, `INSERT INTO sandboxes (`+sandboxColumns+`, updated_at)
		VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)`,
			s.ID, s.TemplateID, s.State, s.VCPUs, s.MemoryMiB, s.DiskMiB, s.Slot, s.PID, s.AllowInternet, s.Secure,
			s.AutoPause, s.AccessToken, s.TrafficToken, s.DefaultUser, string(meta), string(env),
			s.CreatedAt.UnixMilli(), s.StartedAt.UnixMilli(), s.EndAt.UnixMilli(), s.MemFile, s.MemPrivate, s.SnapshotID,
			s.AutoResume, s.PublicTraffic, s.BaseLayer, egressJSON(s.Egress), s.DefaultWorkdir, s.AutoPauseFilesystem,
			s.VolumeSlots, volumesJSON(s.Volumes), s.Lease, s.Request, s.MaskRequestHost, time.Now().UnixMilli()); err != nil {
			return err
		}
		if err := holdVolumes(ctx, tx, s); err != nil {
			return err
		}
		return store.SetRefs(tx, Holder(s.ID), r.refs(s)...)
	})
	if err != nil {
		return fmt.Errorf("record sandbox %s: %w", s.ID, err)
	}
	return nil
}

// Save rewrites every recorded field of an existing sandbox but its state
// (which only Move changes), and what it references, in one transaction.
func (r *Records) Save(ctx context.Context, s *Sandbox) error {
	return r.st.Tx(ctx, func(tx *sql.Tx) error { return r.SaveTx(ctx, tx, s) })
}

// SaveTx is Save within the store transaction tx.
func (r *Records) SaveTx(ctx context.Context, tx *sql.Tx, s *Sandbox) error {
	meta, _ := json.Marshal(nonNil(s.Metadata))
	env, _ := json.Marshal(nonNil(s.EnvVars))
	_, err := tx.ExecContext(ctx, `UPDATE sandboxes SET template_id = ?, vcpus = ?, memory_mib = ?,
		disk_mib = ?, slot = ?, pid = ?, allow_internet = ?, secure = ?, auto_pause = ?, access_token = ?,
		traffic_token = ?, default_user = ?, metadata = ?, env_vars = ?, created_at = ?, started_at = ?, end_at = ?,
		mem_file = ?, mem_private = ?, snapshot_id = ?, auto_resume = ?, public_traffic = ?, base_layer = ?, egress = ?,
		default_workdir = ?, auto_pause_fs = ?, volume_slots = ?, volumes = ?, lease = ?, request = ?, mask_request_host = ?,
		updated_at = ? WHERE id = ?`,
		s.TemplateID, s.VCPUs, s.MemoryMiB, s.DiskMiB, s.Slot, s.PID, s.AllowInternet, s.Secure, s.AutoPause,
		s.AccessToken, s.TrafficToken, s.DefaultUser, string(meta), string(env), s.CreatedAt.UnixMilli(),
		s.StartedAt.UnixMilli(), s.EndAt.UnixMilli(), s.MemFile, s.MemPrivate, s.SnapshotID, s.AutoResume, s.PublicTraffic,
		s.BaseLayer, egressJSON(s.Egress), s.DefaultWorkdir, s.AutoPauseFilesystem, s.VolumeSlots, volumesJSON(s.Volumes),
		s.Lease, s.Request, s.MaskRequestHost, time.Now().UnixMilli(), s.ID)
	if err != nil {
		return fmt.Errorf("record sandbox %s: %w", s.ID, err)
	}
	if err := holdVolumes(ctx, tx, s); err != nil {
		return fmt.Errorf("record sandbox %s: %w", s.ID, err)
	}
	if err := store.SetRefs(tx, Holder(s.ID), r.refs(s)...); err != nil {
		return fmt.Errorf("record sandbox %s: %w", s.ID, err)
	}
	return nil
}

// volumesJSON is the recorded form of a sandbox's volume mounts ("" for
// none).
func volumesJSON(v []VolumeMount) string {
	if len(v) == 0 {
		return ""
	}
	b, _ := json.Marshal(v)
	return string(b)
}

// holdVolumes records, within tx, that s holds the volumes it mounts (and
// no others; copies of a volume hold nothing): a volume another sandbox
// holds is errkind.ErrConflict.
func holdVolumes(ctx context.Context, tx *sql.Tx, s *Sandbox) error {
	if _, err := tx.ExecContext(ctx, `DELETE FROM sandbox_volumes WHERE sandbox_id = ?`, s.ID); err != nil {
		return err
	}
	for _, v := range s.Volumes {
		if v.Copy {
			continue
		}
		var other string
		err := tx.QueryRowContext(ctx, `SELECT sandbox_id FROM sandbox_volumes WHERE volume_id = ?`, v.VolumeID).Scan(&other)
		if err == nil {
			return fmt.Errorf("%w: volume %s is mounted in sandbox %s", errkind.ErrConflict, v.Name, other)
		}
		if !errors.Is(err, sql.ErrNoRows) {
			return err
		}
		if _, err := tx.ExecContext(ctx, `INSERT INTO sandbox_volumes (volume_id, sandbox_id) VALUES (?, ?)`, v.VolumeID, s.ID); err != nil {
			return err
		}
	}
	return nil
}

// egressJSON is the recorded form of a sandbox's egress rules ("" for
// none, as in records made before they existed).
func egressJSON(e network.Egress) string {
	if e.IsZero() {
		return ""
	}
	b, _ := json.Marshal(e)
	return string(b)
}

func nonNil(m map[string]string) map[string]string {
	if m == nil {
		return map[string]string{}
	}
	return m
}

// Get returns the record of sandbox id (errkind.ErrNotFound if none).
func (r *Records) Get(ctx context.Context, id string) (*Sandbox, error) {
	row := r.db.QueryRowContext(ctx, `SELECT `+sandboxColumns+` FROM sandboxes WHERE id = ?`, id)
	s, err := scanSandbox(row)
	if errors.Is(err, sql.ErrNoRows) {
		return nil, fmt.Errorf("%w: sandbox %q", errkind.ErrNotFound, id)
	}
	return s, err
}

// List returns the records matching the SQL condition where (all when
// empty) with its args, oldest first.
func (r *Records) List(ctx context.Context, where string, args ...any) ([]*Sandbox, error) {
	q := `SELECT ` + sandboxColumns + ` FROM sandboxes`
	if where != "" {
		q += " WHERE " + where
	}
	q += " ORDER BY created_at, id"
	rows, err := r.db.QueryContext(ctx, q, args...)
	if err != nil {
		return nil, fmt.Errorf("list sandboxes: %w", err)
	}
	return scanSandboxes(rows)
}

// UnreferencedTx returns, within tx, the records that hold no store
// reference (made by a release before references were recorded).
func (r *Records) UnreferencedTx(ctx context.Context, tx *sql.Tx) ([]*Sandbox, error) {
	rows, err := tx.QueryContext(ctx, `SELECT `+sandboxColumns+` FROM sandboxes
		WHERE NOT EXISTS (SELECT 1 FROM refs WHERE refs.holder = 'sandbox/' || sandboxes.id)
		ORDER BY created_at, id`)
	if err != nil {
		return nil, fmt.Errorf("list sandboxes: %w", err)
	}
	return scanSandboxes(rows)
}

// scanSandboxes reads every row of a query of sandboxColumns.
func scanSandboxes(rows *sql.Rows) ([]*Sandbox, error) {
	defer rows.Close()
	var out []*Sandbox
	for rows.Next() {
		s, err := scanSandbox(rows)
		if err != nil {
			return nil, err
		}
		out = append(out, s)
	}
	return out, rows.Err()
}

// Set updates columns of sandbox id other than its state and references
// (set is e.g. "end_at = ?", with its args).
func (r *Records) Set(ctx context.Context, id string, set string, args ...any) error {
	args = append(args, time.Now().UnixMilli(), id)
	if _, err := r.db.ExecContext(ctx, `UPDATE sandboxes SET `+set+`, updated_at = ? WHERE id = ?`, args...); err != nil {
		return fmt.Errorf("update sandbox %s: %w", id, err)
	}
	return nil
}

// Delete forgets a sandbox and its references, in one transaction.
func (r *Records) Delete(ctx context.Context, id string) error {
	err := r.st.Tx(ctx, func(tx *sql.Tx) error {
		if _, err := tx.ExecContext(ctx, `DELETE FROM sandboxes WHERE id = ?`, id); err != nil {
			return err
		}
		if _, err := tx.ExecContext(ctx, `DELETE FROM sandbox_volumes WHERE sandbox_id = ?`, id); err != nil {
			return err
		}
		return store.DropRefs(tx, Holder(id))
	})
	if err != nil {
		return fmt.Errorf("forget sandbox %s: %w", id, err)
	}
	return nil
}

// InsertNew gives a new sandbox a free network slot and records it (with
// what it references), atomically with respect to other new sandboxes.
func (r *Records) InsertNew(ctx context.Context, s *Sandbox) error {
	r.slotMu.Lock()
	defer r.slotMu.Unlock()
	slot, err := r.freeSlot(ctx)
	if err != nil {
		return err
	}
	s.Slot = slot
	return r.Insert(ctx, s)
}

// freeSlot returns a network slot no sandbox uses, going round the range
// from the last one handed out, so a just-freed guest address is not reused
// at once (clients may still hold connections to it). r.slotMu is held.
func (r *Records) freeSlot(ctx context.Context) (int, error) {
	rows, err := r.db.QueryContext(ctx, `SELECT slot FROM sandboxes`)
	if err != nil {
		return 0, fmt.Errorf("find free network slot: %w", err)
	}
	defer rows.Close()
	used := map[int]bool{}
	for rows.Next() {
		var s int
		if err := rows.Scan(&s); err != nil {
			return 0, err
		}
		used[s] = true
	}
	if err := rows.Err(); err != nil {
		return 0, err
	}
	for i := 1; i <= r.totalSlots; i++ {
		s := (r.lastSlot + i) % r.totalSlots
		if !used[s] {
			r.lastSlot = s
			return s, nil
		}
	}
	return 0, fmt.Errorf("%w: all %d network slots are in use", errkind.ErrCapacity, r.totalSlots)
}
