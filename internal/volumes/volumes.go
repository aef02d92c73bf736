// Package volumes owns a node's named volumes: persistent filesystems a
// user creates (POST /volumes), reads and writes from outside any sandbox
// (the /volumecontent routes, with the volume's own bearer token), and
// mounts into sandboxes. A volume's record (id, name, token, size) is a
// row of the node's database; its content is an ext4 filesystem in a qcow2
// image of its own, which the host opens only in userspace (QEMU's storage
// daemon exports the image through FUSE, fuse2fs mounts the filesystem in
// it), so that a filesystem a guest wrote is never parsed by the host's
// kernel. Every path a client names is resolved inside the volume (os.Root):
// symbolic links a guest made cannot lead outside it.
package volumes

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/base32"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"time"

	"github.com/agentenv/agentenv/internal/errkind"
	"github.com/agentenv/agentenv/internal/operation"
)

const schema = `
CREATE TABLE IF NOT EXISTS volumes (
	id         TEXT PRIMARY KEY,
	name       TEXT NOT NULL UNIQUE,
	token      TEXT NOT NULL,
	size_bytes INTEGER NOT NULL,
	created_at INTEGER NOT NULL
);`

// Volume is one volume's record.
type Volume struct {
	ID   string
	Name string
	// Token is the bearer token of the volume's content routes.
	Token   string
	Size    int64
	Created time.Time
}

var namePattern = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$`)

// ValidName reports (nil) whether name can name a volume.
func ValidName(name string) error {
	if !namePattern.MatchString(name) {
		return fmt.Errorf("%w: volume name %q (want 1-63 of [A-Za-z0-9._-], starting with a letter or digit)", errkind.ErrInvalid, name)
	}
	return nil
}

// Config configures a Store.
type Config struct {
	// Dir holds one directory per volume (its disk and, while the host has
	// it open, the mount points).
	Dir string
	// Size is the size of a new volume's filesystem (sparse: a volume
	// takes the room its files take).
	Size int64
	// Owner is the uid:gid that owns a new volume's root and, unless a
	// request says otherwise, what the content routes create: the
	// sandboxes' default user.
	UID, GID int
	// IdleClose is how long the host keeps a volume open after its last
	// content request (0: a default).
	IdleClose time.Duration
	Logger    *slog.Logger
	// Tools are the external programs the store runs (empty: from PATH).
	Tools Tools
}

// DefaultSize is a new volume's size unless configured otherwise.
const DefaultSize = 16 << 30

// Store is the node's volumes: their records and their disks.
type Store struct {
	db  *sql.DB
	cfg Config
	log *slog.Logger

	// mu guards the host's use of each volume (not the database, which
	// has its own locking); cond signals its changes.
	mu    sync.Mutex
	cond  *sync.Cond
	usage map[string]*usage // by volume id
}

// Open creates the table if needed and recovers what a server that
// stopped without closing left: host mounts of volumes still mounted,
// directories of volumes never recorded.
func Open(ctx context.Context, db *sql.DB, cfg Config) (*Store, error) {
	if cfg.Dir == "" {
		return nil, errors.New("volumes: no directory")
	}
	if cfg.Size <= 0 {
		cfg.Size = DefaultSize
	}
	if cfg.IdleClose <= 0 {
		cfg.IdleClose = 10 * time.Second
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	cfg.Tools = cfg.Tools.withDefaults()
	if _, err := db.ExecContext(ctx, schema); err != nil {
		return nil, fmt.Errorf("migrate volumes: %w", err)
	}
	if err := os.MkdirAll(cfg.Dir, 0o700); err != nil {
		return nil, err
	}
	s := &Store{db: db, cfg: cfg, log: cfg.Logger, usage: map[string]*usage{}}
	s.cond = sync.NewCond(&s.mu)
	if err := s.recover(ctx); err != nil {
		return nil, err
	}
	return s, nil
}

// recover unmounts what a previous server left mounted and removes the
// directories of volumes whose creation never committed.
func (s *Store) recover(ctx context.Context) error {
	entries, err := os.ReadDir(s.cfg.Dir)
	if err != nil {
		return err
	}
	for _, e := range entries {
		if !e.IsDir() {
			continue
		}
		dir := filepath.Join(s.cfg.Dir, e.Name())
		if err := closeStale(ctx, dir, s.cfg.Tools); err != nil {
			return fmt.Errorf("volume %s: close what the last server left open: %w", e.Name(), err)
		}
		_, err := s.lookup(ctx, `id = ?`, e.Name())
		switch {
		case errors.Is(err, errkind.ErrNotFound):
			s.log.Warn("removing the disk of a volume never recorded", "volume", e.Name())
			if err := os.RemoveAll(dir); err != nil {
				return err
			}
		case err != nil:
			return err
		}
	}
	return nil
}

// Close closes every volume the host has open, once the content requests
// using them end.
func (s *Store) Close() error {
	s.mu.Lock()
	ids := make([]string, 0, len(s.usage))
	for id := range s.usage {
		ids = append(ids, id)
	}
	s.mu.Unlock()
	var errs []error
	for _, id := range ids {
		errs = append(errs, s.closeHost(context.Background(), id, "closing"))
	}
	return errors.Join(errs...)
}

func (s *Store) dir(id string) string { return filepath.Join(s.cfg.Dir, id) }

// Create makes volume name: its disk (an empty filesystem), then its
// record. A name in use is ErrConflict.
func (s *Store) Create(ctx context.Context, name string) (*Volume, error) {
	if err := ValidName(name); err != nil {
		return nil, err
	}
	if _, err := s.lookup(ctx, `name = ?`, name); err == nil {
		return nil, fmt.Errorf("%w: a volume named %q exists", errkind.ErrConflict, name)
	} else if !errors.Is(err, errkind.ErrNotFound) {
		return nil, err
	}
	v := &Volume{ID: newID(), Name: name, Token: newToken(), Size: s.cfg.Size, Created: time.Now().UTC().Truncate(time.Millisecond)}
	op := operation.Start(ctx, "volume-create", 2*time.Minute, s.log)
	err := s.create(op, v)
	return v, op.Finish(err)
}

func (s *Store) create(op *operation.Op, v *Volume) error {
	dir := s.dir(v.ID)
	if err := op.Do("dir", func(context.Context) error { return os.Mkdir(dir, 0o700) }); err != nil {
		return err
	}
	op.OnFailure("remove the volume's directory", func(context.Context) error { return os.RemoveAll(dir) })
	if err := op.Do("disk", func(ctx context.Context) error {
		return makeDisk(ctx, s.cfg.Tools, dir, v.Size, s.cfg.UID, s.cfg.GID)
	}); err != nil {
		return err
	}
	return op.Do("record", func(ctx context.Context) error {
		_, err := s.db.ExecContext(ctx, `INSERT INTO volumes (id, name, token, size_bytes, created_at) VALUES (?, ?, ?, ?, ?)`,
			v.ID, v.Name, v.Token, v.Size, v.Created.UnixMilli())
		if err != nil && strings.Contains(err.Error(), "UNIQUE") {
			return fmt.Errorf("%w: a volume named %q exists", errkind.ErrConflict, v.Name)
		}
		return err
	})
}

// Get returns volume id.
func (s *Store) Get(ctx context.Context, id string) (*Volume, error) {
	return s.lookup(ctx, `id = ?`, id)
}

// ByName returns the volume named name.
func (s *Store) ByName(ctx context.Context, name string) (*Volume, error) {
	return s.lookup(ctx, `name = ?`, name)
}

func (s *Store) lookup(ctx context.Context, where string, arg string) (*Volume, error) {
	row := s.db.QueryRowContext(ctx, `SELECT id, name, token, size_bytes, created_at FROM volumes WHERE `+where, arg)
	v, err := scan(row)
	if errors.Is(err, sql.ErrNoRows) {
		return nil, fmt.Errorf("%w: no volume %q", errkind.ErrNotFound, arg)
	}
	return v, err
}

type scanner interface{ Scan(...any) error }

func scan(r scanner) (*Volume, error) {
	var (
		v       Volume
		created int64
	)
	if err := r.Scan(&v.ID, &v.Name, &v.Token, &v.Size, &created); err != nil {
		return nil, err
	}
	v.Created = time.UnixMilli(created).UTC()
	return &v, nil
}

// List returns the volumes, oldest first.
func (s *Store) List(ctx context.Context) ([]*Volume, error) {
	rows, err := s.db.QueryContext(ctx, `SELECT id, name, token, size_bytes, created_at FROM volumes ORDER BY created_at, id`)
	if err != nil {
		return nil, fmt.Errorf("list volumes: %w", err)
	}
	defer rows.Close()
	var out []*Volume
	for rows.Next() {
		v, err := scan(rows)
		if err != nil {
			return nil, err
		}
		out = append(out, v)
	}
	return out, rows.Err()
}

// Delete removes volume id: its record first (from then on it is gone for
// every client), then its disk. A volume in use by a content request is
// closed first; one being created or deleted is ErrConflict.
func (s *Store) Delete(ctx context.Context, id string) error {
	if _, err := s.Get(ctx, id); err != nil {
		return err
	}
	op := operation.Start(ctx, "volume-delete", 2*time.Minute, s.log)
	err := op.Do("close", func(ctx context.Context) error { return s.closeHost(ctx, id, "being deleted") })
	if err == nil {
		defer s.release(id) // (a hold of another, a sandbox's, stays)
		err = op.Do("record", func(ctx context.Context) error {
			_, err := s.db.ExecContext(ctx, `DELETE FROM volumes WHERE id = ?`, id)
			return err
		})
	}
	if err == nil {
		op.Settle()
		// The record is gone: a disk left behind (a failure here) is
		// removed by the next start's recovery.
		err = op.Do("disk", func(context.Context) error { return os.RemoveAll(s.dir(id)) })
		if err != nil {
			s.log.Error("volume deleted, its disk stays until the next start", "volume", id, "err", err)
			err = nil
		}
	}
	return op.Finish(err)
}

var idEncoding = base32.StdEncoding.WithPadding(base32.NoPadding)

// newID is a volume id: 20 random lowercase letters and digits.
func newID() string {
	b := make([]byte, 12)
	if _, err := rand.Read(b); err != nil {
		panic(err)
	}
	return strings.ToLower(idEncoding.EncodeToString(b))
}

// newToken is a volume's bearer token.
func newToken() string {
	b := make([]byte, 24)
	if _, err := rand.Read(b); err != nil {
		panic(err)
	}
	return "vol_" + hex.EncodeToString(b)
}
