// Package store owns the node's immutable things and what keeps them: disk
// layers and snapshots (objects, each a file or directory that never
// changes once committed), what each needs (edges: a layer its backing
// layer, a snapshot the layer its disk stacks on and the snapshot whose RAM
// image it is relative to), and who holds them: references from records
// (a sandbox holds what its disk and RAM are made of), leases of operations
// in progress, and labels (a template name points at one layer chain, a
// snapshot name at one snapshot). All of it lives in the node's SQLite
// database, so a record and the references it holds are written in one
// transaction. GC is the one function that deletes objects: exactly those
// no reference, lease or label reaches.
//
// Layers are named by content (the SHA-256 of the file, or for layers made
// by builds and image imports the content-derived key those use); a label
// that moves (a rebuilt template) leaves the old chain alive while anything
// still reaches it.
package store

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"database/sql"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/agentenv/agentenv/internal/errkind"
	"github.com/agentenv/agentenv/internal/storage"
)

// Kind is the kind of an object.
type Kind string

// The kinds of objects.
const (
	KindLayer    Kind = "layer"    // a read-only qcow2 disk layer
	KindSnapshot Kind = "snapshot" // a directory: RAM image, device state, disk layer, manifest
)

// Directories of the data dir the store owns.
const (
	LayersDir    = "layers"
	SnapshotsDir = "snapshots"
)

// The kinds of labels. Template and snapshot names share one namespace:
// a name is either (see NameTaken).
const (
	LabelTemplate         = "template"          // a template's name → its root layer
	LabelTemplateSnapshot = "template-snapshot" // a template's name → its snapshot on this node
	LabelSnapshot         = "snapshot"          // a named snapshot → its snapshot
	LabelTemplateTag      = "template-tag"      // "template:tag" → the root layer of that build
	LabelLazyImage        = "lazy-image"        // an image's top chain ID → the overlay over its layers in the repository
)

// NameTaken reports what a template or snapshot name already names, in
// tx: "template", "snapshot", or "".
func NameTaken(tx *sql.Tx, name string) (string, error) {
	var kind string
	err := tx.QueryRow(`SELECT kind FROM labels WHERE name = ? AND kind IN (?, ?) ORDER BY kind LIMIT 1`, name, LabelSnapshot, LabelTemplate).Scan(&kind)
	if errors.Is(err, sql.ErrNoRows) {
		return "", nil
	}
	return kind, err
}

// Errors callers test for.
var (
	ErrNotFound = errkind.ErrNotFound
	ErrMissing  = errors.New("object is gone") // a reference to an object that no longer exists
)

const schema = `
CREATE TABLE IF NOT EXISTS objects (
	id         TEXT PRIMARY KEY,
	kind       TEXT NOT NULL,
	path       TEXT NOT NULL,
	owned      INTEGER NOT NULL,
	created_at INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS edges (
	object TEXT NOT NULL REFERENCES objects(id) ON DELETE CASCADE,
	needs  TEXT NOT NULL REFERENCES objects(id) DEFERRABLE INITIALLY DEFERRED,
	PRIMARY KEY (object, needs)
);
CREATE INDEX IF NOT EXISTS edges_needs ON edges(needs);
CREATE TABLE IF NOT EXISTS refs (
	holder TEXT NOT NULL,
	object TEXT NOT NULL REFERENCES objects(id),
	PRIMARY KEY (holder, object)
);
CREATE INDEX IF NOT EXISTS refs_object ON refs(object);
CREATE TABLE IF NOT EXISTS labels (
	kind       TEXT NOT NULL,
	name       TEXT NOT NULL,
	object     TEXT NOT NULL REFERENCES objects(id),
	data       TEXT NOT NULL,
	updated_at INTEGER NOT NULL,
	PRIMARY KEY (kind, name)
);
CREATE INDEX IF NOT EXISTS labels_object ON labels(object);
CREATE TABLE IF NOT EXISTS leases (
	id         TEXT PRIMARY KEY,
	purpose    TEXT NOT NULL,
	created_at INTEGER NOT NULL,
	expires_at INTEGER NOT NULL
);
`

// Object is one immutable thing of the store.
type Object struct {
	ID   string
	Kind Kind
	// Path is where it is: relative to the data dir for objects the store
	// owns (and deletes when unreachable), absolute for objects adopted
	// from elsewhere (kept on disk; only their record goes).
	Path  string
	Owned bool
	Needs []string
}

// Store is the node's store.
type Store struct {
	db      *sql.DB
	dataDir string
	log     *slog.Logger
	// commitMu orders GC's removal of files after content-named objects
	// that a commit may be bringing back under the same name.
	commitMu sync.Mutex
}

// Open creates the store's tables in db (the node's database) for the data
// dir dataDir.
func Open(db *sql.DB, dataDir string, log *slog.Logger) (*Store, error) {
	if _, err := db.Exec(schema); err != nil {
		return nil, fmt.Errorf("store tables: %w", err)
	}
	if log == nil {
		log = slog.Default()
	}
	for _, d := range []string{LayersDir, SnapshotsDir} {
		if err := os.MkdirAll(filepath.Join(dataDir, d), 0o755); err != nil {
			return nil, err
		}
	}
	return &Store{db: db, dataDir: dataDir, log: log}, nil
}

// OpenReadOnly is Open for a database opened read-only (its tables must
// exist): for commands that only read a data dir a server may be using.
func OpenReadOnly(db *sql.DB, dataDir string, log *slog.Logger) *Store {
	if log == nil {
		log = slog.Default()
	}
	return &Store{db: db, dataDir: dataDir, log: log}
}

// DB is the database the store's tables are in.
func (s *Store) DB() *sql.DB { return s.db }

// Abs is the absolute path of an object's path.
func (s *Store) Abs(path string) string {
	if filepath.IsAbs(path) {
		return path
	}
	return filepath.Join(s.dataDir, path)
}

// rel is path relative to the data dir when it is inside it ("" if not).
func (s *Store) rel(path string) string {
	r, err := filepath.Rel(s.dataDir, path)
	if err != nil || r == ".." || strings.HasPrefix(r, "../") {
		return ""
	}
	return r
}

// Tx runs fn in one transaction (committed when fn returns nil).
func (s *Store) Tx(ctx context.Context, fn func(tx *sql.Tx) error) error {
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	if err := fn(tx); err != nil {
		tx.Rollback()
		return err
	}
	return tx.Commit()
}

// Add records an object that is in place on disk. An object inside the
// data dir is owned (GC deletes it); one outside is adopted (GC forgets
// it). Adding an id that exists is a no-op.
func (s *Store) Add(tx *sql.Tx, id string, kind Kind, path string, needs ...string) error {
	if id == "" {
		return errors.New("store: empty object id")
	}
	owned, p := true, s.rel(path)
	if p == "" {
		owned, p = false, path
	}
	if _, err := tx.Exec(`INSERT INTO objects (id, kind, path, owned, created_at) VALUES (?, ?, ?, ?, ?)
		ON CONFLICT (id) DO NOTHING`, id, string(kind), p, owned, time.Now().UnixMilli()); err != nil {
		return fmt.Errorf("record %s %s: %w", kind, id, err)
	}
	for _, nd := range needs {
		if nd == "" || nd == id {
			continue
		}
		if _, err := tx.Exec(`INSERT INTO edges (object, needs) VALUES (?, ?) ON CONFLICT DO NOTHING`, id, nd); err != nil {
			return fmt.Errorf("record that %s needs %s: %w", id, nd, err)
		}
	}
	return nil
}

// Get returns an object.
func (s *Store) Get(ctx context.Context, id string) (*Object, error) {
	o, err := getObject(ctx, s.db, id)
	if err != nil {
		return nil, err
	}
	rows, err := s.db.QueryContext(ctx, `SELECT needs FROM edges WHERE object = ? ORDER BY needs`, id)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	for rows.Next() {
		var nd string
		if err := rows.Scan(&nd); err != nil {
			return nil, err
		}
		o.Needs = append(o.Needs, nd)
	}
	return o, rows.Err()
}

// GetTx is Get's record part within a transaction (no needs).
func (s *Store) GetTx(tx *sql.Tx, id string) (*Object, error) {
	return getObject(context.Background(), tx, id)
}

// getObject reads an object's record (not what it needs).
func getObject(ctx context.Context, q interface {
	QueryRowContext(context.Context, string, ...any) *sql.Row
}, id string) (*Object, error) {
	var o Object
	var kind string
	err := q.QueryRowContext(ctx, `SELECT id, kind, path, owned FROM objects WHERE id = ?`, id).Scan(&o.ID, &kind, &o.Path, &o.Owned)
	if errors.Is(err, sql.ErrNoRows) {
		return nil, fmt.Errorf("%w: object %s", ErrNotFound, id)
	}
	if err != nil {
		return nil, err
	}
	o.Kind = Kind(kind)
	return &o, nil
}

// Reuse runs fn in a transaction that garbage collection cannot overlap:
// for recording again, under its fixed name, an object whose files exist
// (GC removes the files of what it collected after its own transaction).
func (s *Store) Reuse(ctx context.Context, fn func(tx *sql.Tx) error) error {
	s.commitMu.Lock()
	defer s.commitMu.Unlock()
	return s.Tx(ctx, fn)
}

// Objects lists every object.
func (s *Store) Objects(ctx context.Context) ([]Object, error) {
	rows, err := s.db.QueryContext(ctx, `SELECT id, kind, path, owned FROM objects ORDER BY id`)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []Object
	for rows.Next() {
		var o Object
		var kind string
		if err := rows.Scan(&o.ID, &kind, &o.Path, &o.Owned); err != nil {
			return nil, err
		}
		o.Kind = Kind(kind)
		out = append(out, o)
	}
	return out, rows.Err()
}

// SetRefs makes holder reference exactly the given objects (replacing what
// it held); empty ids are skipped. It fails, wrapping ErrMissing, when an
// object does not exist (GC took it).
func SetRefs(tx *sql.Tx, holder string, ids ...string) error {
	if _, err := tx.Exec(`DELETE FROM refs WHERE holder = ?`, holder); err != nil {
		return err
	}
	return addRefs(tx, holder, ids...)
}

func addRefs(tx *sql.Tx, holder string, ids ...string) error {
	for _, id := range ids {
		if id == "" {
			continue
		}
		if _, err := tx.Exec(`INSERT INTO refs (holder, object) VALUES (?, ?) ON CONFLICT DO NOTHING`, holder, id); err != nil {
			if strings.Contains(err.Error(), "FOREIGN KEY") {
				return fmt.Errorf("%w: %s (needed by %s)", ErrMissing, id, holder)
			}
			return fmt.Errorf("reference %s from %s: %w", id, holder, err)
		}
	}
	return nil
}

// DropRefs removes every reference of holder.
func DropRefs(tx *sql.Tx, holder string) error {
	_, err := tx.Exec(`DELETE FROM refs WHERE holder = ?`, holder)
	return err
}

// Refs lists what holder references.
func (s *Store) Refs(ctx context.Context, holder string) ([]string, error) {
	return s.strings(ctx, `SELECT object FROM refs WHERE holder = ? ORDER BY object`, holder)
}

// Leased reports whether a lease holds object id directly (an operation
// is assembling it).
func (s *Store) Leased(ctx context.Context, id string) (bool, error) {
	var n int
	err := s.db.QueryRowContext(ctx, `SELECT COUNT(*) FROM refs WHERE object = ? AND holder LIKE 'lease/%'`, id).Scan(&n)
	return n > 0, err
}

// Holders lists who reaches object id, directly or through the objects
// that need it: reference holders and labels ("label:KIND/NAME").
func (s *Store) Holders(ctx context.Context, id string) ([]string, error) {
	return s.strings(ctx, `WITH RECURSIVE up(id) AS (
			SELECT ? UNION SELECT e.object FROM edges e JOIN up ON e.needs = up.id)
		SELECT holder FROM refs WHERE object IN (SELECT id FROM up)
		UNION SELECT 'label:' || kind || '/' || name FROM labels WHERE object IN (SELECT id FROM up)
		ORDER BY 1`, id)
}

func (s *Store) strings(ctx context.Context, q string, args ...any) ([]string, error) {
	rows, err := s.db.QueryContext(ctx, q, args...)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []string
	for rows.Next() {
		var v string
		if err := rows.Scan(&v); err != nil {
			return nil, err
		}
		out = append(out, v)
	}
	return out, rows.Err()
}

// Label is a name that points at one object.
type Label struct {
	Kind, Name, Object string
	// Data is the label's record (JSON), e.g. a template's settings.
	Data      string
	UpdatedAt time.Time
}

// SetLabel points label kind/name at object (moving it if it pointed
// elsewhere; what it pointed at lives on while anything else reaches it).
func SetLabel(tx *sql.Tx, kind, name, object, data string) error {
	_, err := tx.Exec(`INSERT INTO labels (kind, name, object, data, updated_at) VALUES (?, ?, ?, ?, ?)
		ON CONFLICT (kind, name) DO UPDATE SET object = excluded.object, data = excluded.data, updated_at = excluded.updated_at`,
		kind, name, object, data, time.Now().UnixMilli())
	if err != nil && strings.Contains(err.Error(), "FOREIGN KEY") {
		return fmt.Errorf("%w: %s (for %s %s)", ErrMissing, object, kind, name)
	}
	return err
}

// DeleteLabel removes label kind/name (ErrNotFound if there is none).
func DeleteLabel(tx *sql.Tx, kind, name string) error {
	res, err := tx.Exec(`DELETE FROM labels WHERE kind = ? AND name = ?`, kind, name)
	if err != nil {
		return err
	}
	if n, _ := res.RowsAffected(); n == 0 {
		return fmt.Errorf("%w: %s %q", ErrNotFound, kind, name)
	}
	return nil
}

// DeleteLabelsPrefixed removes the labels of kind whose names start with
// prefix, in tx.
func DeleteLabelsPrefixed(tx *sql.Tx, kind, prefix string) error {
	_, err := tx.Exec(`DELETE FROM labels WHERE kind = ? AND substr(name, 1, ?) = ?`, kind, len(prefix), prefix)
	return err
}

// DeleteLabelsOf removes, in tx, the labels of a kind that point at object.
func DeleteLabelsOf(tx *sql.Tx, kind, object string) error {
	_, err := tx.Exec(`DELETE FROM labels WHERE kind = ? AND object = ?`, kind, object)
	return err
}

// Label reads label kind/name.
func (s *Store) Label(ctx context.Context, kind, name string) (*Label, error) {
	l := Label{Kind: kind, Name: name}
	var upd int64
	err := s.db.QueryRowContext(ctx, `SELECT object, data, updated_at FROM labels WHERE kind = ? AND name = ?`, kind, name).Scan(&l.Object, &l.Data, &upd)
	if errors.Is(err, sql.ErrNoRows) {
		return nil, fmt.Errorf("%w: %s %q", ErrNotFound, kind, name)
	}
	if err != nil {
		return nil, err
	}
	l.UpdatedAt = time.UnixMilli(upd).UTC()
	return &l, nil
}

// Labels lists the labels of a kind by name.
func (s *Store) Labels(ctx context.Context, kind string) ([]Label, error) {
	rows, err := s.db.QueryContext(ctx, `SELECT name, object, data, updated_at FROM labels WHERE kind = ? ORDER BY name`, kind)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []Label
	for rows.Next() {
		l := Label{Kind: kind}
		var upd int64
		if err := rows.Scan(&l.Name, &l.Object, &l.Data, &upd); err != nil {
			return nil, err
		}
		l.UpdatedAt = time.UnixMilli(upd).UTC()
		out = append(out, l)
	}
	return out, rows.Err()
}

// Lease keeps objects alive for an operation in progress, before any
// record references them. It ends when released, when it expires, or when
// the node restarts (no operation survives a restart).
type Lease struct {
	ID string
	s  *Store
}

func leaseHolder(id string) string { return "lease/" + id }

// NewLease starts a lease for purpose lasting at most ttl.
func (s *Store) NewLease(ctx context.Context, purpose string, ttl time.Duration) (*Lease, error) {
	id := randomHex(8)
	now := time.Now()
	if _, err := s.db.ExecContext(ctx, `INSERT INTO leases (id, purpose, created_at, expires_at) VALUES (?, ?, ?, ?)`,
		id, purpose, now.UnixMilli(), now.Add(ttl).UnixMilli()); err != nil {
		return nil, fmt.Errorf("lease for %s: %w", purpose, err)
	}
	return &Lease{ID: id, s: s}, nil
}

// Holder is the name the lease holds references under (for CommitLayer).
func (l *Lease) Holder() string { return leaseHolder(l.ID) }

// Hold adds objects to what the lease keeps (in tx, e.g. with the records
// of the objects themselves).
func (l *Lease) Hold(tx *sql.Tx, ids ...string) error { return addRefs(tx, leaseHolder(l.ID), ids...) }

// Release ends the lease within tx (e.g. in the transaction that makes a
// record reference what the lease kept).
func (l *Lease) Release(tx *sql.Tx) error {
	if _, err := tx.Exec(`DELETE FROM refs WHERE holder = ?`, leaseHolder(l.ID)); err != nil {
		return err
	}
	_, err := tx.Exec(`DELETE FROM leases WHERE id = ?`, l.ID)
	return err
}

// Drop ends the lease on its own.
func (l *Lease) Drop(ctx context.Context) error {
	return l.s.Tx(ctx, func(tx *sql.Tx) error { return l.Release(tx) })
}

// GC deletes every object no reference, live lease or label reaches,
// directly or through the objects that need it: its record first (in one
// transaction), then its files (owned objects only). Expired leases end
// first. It returns what it removed.
func (s *Store) GC(ctx context.Context) ([]Object, error) {
	s.commitMu.Lock()
	defer s.commitMu.Unlock()
	var garbage []Object
	err := s.Tx(ctx, func(tx *sql.Tx) error {
		now := time.Now().UnixMilli()
		if _, err := tx.Exec(`DELETE FROM leases WHERE expires_at <= ?`, now); err != nil {
			return err
		}
		if _, err := tx.Exec(`DELETE FROM refs WHERE holder LIKE 'lease/%' AND substr(holder, 7) NOT IN (SELECT id FROM leases)`); err != nil {
			return err
		}
		rows, err := tx.Query(`WITH RECURSIVE live(id) AS (
				SELECT object FROM refs UNION SELECT object FROM labels
				UNION SELECT e.needs FROM edges e JOIN live ON e.object = live.id)
			SELECT id, kind, path, owned FROM objects WHERE id NOT IN (SELECT id FROM live)`)
		if err != nil {
			return err
		}
		for rows.Next() {
			var o Object
			var kind string
			if err := rows.Scan(&o.ID, &kind, &o.Path, &o.Owned); err != nil {
				rows.Close()
				return err
			}
			o.Kind = Kind(kind)
			garbage = append(garbage, o)
		}
		rows.Close()
		if err := rows.Err(); err != nil {
			return err
		}
		for _, o := range garbage {
			if _, err := tx.Exec(`DELETE FROM objects WHERE id = ?`, o.ID); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("garbage collection: %w", err)
	}
	for _, o := range garbage {
		if o.Owned {
			if err := removeObject(s.Abs(o.Path)); err != nil {
				s.log.Error("remove unreachable object", "object", o.ID, "err", err)
				continue
			}
		}
		s.log.Info("removed unreachable object", "object", o.ID, "kind", o.Kind, "owned", o.Owned)
	}
	return garbage, nil
}

// removeObject deletes a file or directory, renaming it out of the way
// first so that it is never seen half removed.
func removeObject(p string) error {
	gone := filepath.Join(filepath.Dir(p), ".gone-"+filepath.Base(p))
	if err := os.Rename(p, gone); err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil
		}
		return err
	}
	return os.RemoveAll(gone)
}

// CommitLayer makes the qcow2 file at tmp (inside the data dir) an
// immutable layer named by its content: it is checksummed, made read-only
// and renamed to layers/sha256-<hex>.qcow2, and recorded with the layers
// it needs, held by holder, in one transaction. An identical layer already
// there is reused (tmp is removed).
func (s *Store) CommitLayer(ctx context.Context, tmp, holder string, needs ...string) (string, error) {
	sum, err := FileSHA256(tmp)
	if err != nil {
		return "", err
	}
	id := "sha256-" + sum
	final := filepath.Join(s.dataDir, LayersDir, id+".qcow2")
	s.commitMu.Lock()
	defer s.commitMu.Unlock()
	if _, err := s.Get(ctx, id); err == nil {
		os.Remove(tmp)
		return id, s.Tx(ctx, func(tx *sql.Tx) error { return addRefs(tx, holder, id) })
	}
	if err := os.Chmod(tmp, 0o444); err != nil {
		return "", err
	}
	f, err := os.Open(tmp)
	if err != nil {
		return "", err
	}
	serr := f.Sync()
	f.Close()
	if serr != nil {
		return "", serr
	}
	if err := os.Rename(tmp, final); err != nil {
		return "", err
	}
	if err := storage.SyncDir(filepath.Dir(final)); err != nil {
		return "", err
	}
	err = s.Tx(ctx, func(tx *sql.Tx) error {
		if err := s.Add(tx, id, KindLayer, final, needs...); err != nil {
			return err
		}
		return addRefs(tx, holder, id)
	})
	return id, err
}

// Recover runs at start, when no operation is in progress: every lease
// ends (an operation a restart cut short holds nothing), files and
// directories in the store's dirs that no object names are removed (debris
// of a crash before a commit), and GC runs.
func (s *Store) Recover(ctx context.Context) error {
	if _, err := s.db.ExecContext(ctx, `DELETE FROM refs WHERE holder LIKE 'lease/%'`); err != nil {
		return err
	}
	if _, err := s.db.ExecContext(ctx, `DELETE FROM leases`); err != nil {
		return err
	}
	objs, err := s.Objects(ctx)
	if err != nil {
		return err
	}
	known := map[string]bool{}
	for _, o := range objs {
		if o.Owned {
			known[filepath.Clean(o.Path)] = true
		}
	}
	for _, d := range []string{LayersDir, SnapshotsDir} {
		ents, err := os.ReadDir(filepath.Join(s.dataDir, d))
		if err != nil {
			return err
		}
		for _, e := range ents {
			rel := filepath.Join(d, e.Name())
			if known[rel] || (d == LayersDir && sidecarOfKnown(known, rel)) {
				continue
			}
			s.log.Warn("removing store debris no object names", "path", rel)
			if err := removeObject(filepath.Join(s.dataDir, rel)); err != nil {
				s.log.Error("remove store debris", "path", rel, "err", err)
			}
		}
	}
	_, err = s.GC(ctx)
	return err
}

// sidecarOfKnown reports whether rel is the metadata file (<layer>.json)
// or lock of a known layer, which image imports keep beside it.
func sidecarOfKnown(known map[string]bool, rel string) bool {
	if stem, ok := strings.CutSuffix(rel, ".json"); ok {
		return known[stem+".qcow2"]
	}
	return false
}

// FileSHA256 is the hex SHA-256 of a file's content.
func FileSHA256(path string) (string, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return "", fmt.Errorf("checksum %s: %w", filepath.Base(path), err)
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}

func randomHex(n int) string {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		panic(err)
	}
	return hex.EncodeToString(b)
}
