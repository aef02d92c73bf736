// Package templates owns the node's templates. A template is a label in
// the store: its name points at one immutable disk layer (the top of a
// chain) and carries the settings of the sandboxes made from it. Building
// or importing a template under a name that exists makes a new chain and
// moves the label; sandboxes, snapshots and pooled machines of the old
// build keep the old chain, which lives in the store until nothing reaches
// it. The package also imports OCI images into shared layers, and adopts
// the template directories of releases before the store (one-time
// migration).
package templates

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"time"

	"github.com/agentenv/agentenv/internal/envd"
	"github.com/agentenv/agentenv/internal/errkind"
	"github.com/agentenv/agentenv/internal/statedb"
	"github.com/agentenv/agentenv/internal/storage"
	"github.com/agentenv/agentenv/internal/store"
)

// Template is a bootable image sandboxes are created from: a read-only root
// disk layer plus the defaults of sandboxes made from it.
type Template struct {
	Name string `json:"name"`
	// Layer is the store object of the root disk layer, and RootDisk its
	// path.
	Layer       string `json:"-"`
	RootDisk    string `json:"-"`
	VCPUs       int    `json:"vcpus"`
	MemoryMiB   int    `json:"memoryMiB"`
	DiskMiB     int    `json:"diskMiB"`
	DefaultUser string `json:"defaultUser"`
	// DefaultWorkdir is where commands in its sandboxes run by default
	// (its last WORKDIR; "": the default user's home).
	DefaultWorkdir string `json:"defaultWorkdir,omitempty"`
	// EnvdVersion is the envd version inside sandboxes of this template.
	EnvdVersion string `json:"envdVersion"`
	// EnvVars are set in every sandbox of the template (a create's own
	// take precedence).
	EnvVars map[string]string `json:"envVars,omitempty"`
	// Image is the OCI image the template was imported from, if any.
	Image string `json:"image,omitempty"`
	// StartCmd is started (in the background, as StartUser in StartCwd)
	// when the template is booted for its snapshot, which is taken once
	// ReadyCmd exits 0; sandboxes resume with it running.
	StartCmd  string `json:"startCmd,omitempty"`
	ReadyCmd  string `json:"readyCmd,omitempty"`
	StartUser string `json:"startUser,omitempty"`
	StartCwd  string `json:"startCwd,omitempty"`
	// LazyLayers are the repository layers (bottom first) a template loaded
	// lazily boots from, served by the node's NBD server.
	LazyLayers []string `json:"lazyLayers,omitempty"`
	// BuildID is the build that made this version of the template ("" for
	// templates aenv setup made or images imported).
	BuildID string `json:"buildID,omitempty"`
}

// LabelKind is the store label kind of templates.
const LabelKind = store.LabelTemplate

// Defaults of a template's sandboxes.
const (
	DefaultVCPUs  = 2
	DefaultMemMiB = 512
)

// NameRE is the form of template (and snapshot) names.
var NameRE = regexp.MustCompile(`^[a-z0-9][a-z0-9._-]{0,62}$`)

// Catalog is the templates of one data dir.
type Catalog struct {
	st      *store.Store
	dataDir string
}

// NewCatalog returns the templates kept in st.
func NewCatalog(st *store.Store, dataDir string) *Catalog {
	return &Catalog{st: st, dataDir: dataDir}
}

// Store is the store the catalog keeps its labels in.
func (c *Catalog) Store() *store.Store { return c.st }

// Get looks a template up by name.
func (c *Catalog) Get(ctx context.Context, name string) (*Template, error) {
	if name == "" {
		return nil, fmt.Errorf("%w: templateID is required", errkind.ErrInvalid)
	}
	if base, tag, ok := strings.Cut(name, ":"); ok {
		return c.getTagged(ctx, base, tag)
	}
	if !NameRE.MatchString(name) {
		return nil, fmt.Errorf("%w: template %q", errkind.ErrNotFound, name)
	}
	l, err := c.st.Label(ctx, LabelKind, name)
	if errors.Is(err, errkind.ErrNotFound) {
		return nil, fmt.Errorf("%w: template %q (build it with `aenv setup` or `aenv template build`)", errkind.ErrNotFound, name)
	}
	if err != nil {
		return nil, err
	}
	return c.fromLabel(ctx, l)
}

func (c *Catalog) fromLabel(ctx context.Context, l *store.Label) (*Template, error) {
	var t Template
	if err := json.Unmarshal([]byte(l.Data), &t); err != nil {
		return nil, fmt.Errorf("%w: template %s record: %v", errkind.ErrCorrupt, l.Name, err)
	}
	o, err := c.st.Get(ctx, l.Object)
	if err != nil {
		return nil, fmt.Errorf("%w: template %s layer %s: %v", errkind.ErrCorrupt, l.Name, l.Object, err)
	}
	t.Name, t.Layer, t.RootDisk = l.Name, l.Object, c.st.Abs(o.Path)
	return &t, nil
}

// List returns every template by name.
func (c *Catalog) List(ctx context.Context) ([]*Template, error) {
	ls, err := c.st.Labels(ctx, LabelKind)
	if err != nil {
		return nil, err
	}
	out := make([]*Template, 0, len(ls))
	for i := range ls {
		t, err := c.fromLabel(ctx, &ls[i])
		if err != nil {
			return nil, err
		}
		out = append(out, t)
	}
	return out, nil
}

// Set points template t.Name at layer t.Layer (an object of the store)
// with t's settings, in tx.
func Set(tx *sql.Tx, t Template) error {
	if !NameRE.MatchString(t.Name) {
		return fmt.Errorf("%w: template name %q must match %s", errkind.ErrInvalid, t.Name, NameRE)
	}
	if t.Layer == "" {
		return fmt.Errorf("template %s: no layer", t.Name)
	}
	if kind, err := store.NameTaken(tx, t.Name); err != nil {
		return err
	} else if kind == store.LabelSnapshot {
		return fmt.Errorf("%w: %q is a snapshot's name", errkind.ErrConflict, t.Name)
	}
	if t.VCPUs == 0 {
		t.VCPUs = DefaultVCPUs
	}
	if t.MemoryMiB == 0 {
		t.MemoryMiB = DefaultMemMiB
	}
	if t.EnvdVersion == "" {
		t.EnvdVersion = envd.DefaultVersion
	}
	b, err := json.Marshal(t)
	if err != nil {
		return err
	}
	return store.SetLabel(tx, LabelKind, t.Name, t.Layer, string(b))
}

// Install points template t.Name at layer t.Layer (creating or moving the
// label).
func (c *Catalog) Install(ctx context.Context, t Template) error {
	return c.st.Tx(ctx, func(tx *sql.Tx) error { return Set(tx, t) })
}

// InstallFile makes the qcow2 file at path (inside the data dir, with no
// backing file or one that is already a layer of the store, named in
// needs) the root layer of template t: the file becomes a layer named by
// its content, and the label points at it.
func (c *Catalog) InstallFile(ctx context.Context, t Template, path string, needs ...string) (*Template, error) {
	lease, err := c.st.NewLease(ctx, "install template "+t.Name, time.Hour)
	if err != nil {
		return nil, err
	}
	id, err := c.st.CommitLayer(ctx, path, lease.Holder(), needs...)
	if err != nil {
		lease.Drop(context.WithoutCancel(ctx))
		return nil, err
	}
	t.Layer = id
	err = c.st.Tx(ctx, func(tx *sql.Tx) error {
		if err := Set(tx, t); err != nil {
			return err
		}
		return lease.Release(tx)
	})
	if err != nil {
		lease.Drop(context.WithoutCancel(ctx))
		return nil, err
	}
	return c.Get(ctx, t.Name)
}

// Delete removes template name's label and its tags in tx; its layers go
// when nothing else reaches them.
func Delete(tx *sql.Tx, name string) error {
	if err := store.DeleteLabel(tx, LabelKind, name); err != nil {
		return err
	}
	return store.DeleteLabelsPrefixed(tx, store.LabelTemplateTag, name+":")
}

// tempFile names a scratch file in the store's layers dir.
func (c *Catalog) tempFile(pattern string) (string, error) {
	f, err := os.CreateTemp(c.st.Abs(store.LayersDir), pattern)
	if err != nil {
		return "", err
	}
	name := f.Name()
	f.Close()
	os.Remove(name)
	return name, nil
}

// OpenOffline opens the templates of dataDir for a command that runs no
// sandboxes (setup, image import); the caller holds the data dir's lock.
// Template directories of older releases are adopted first.
func OpenOffline(ctx context.Context, dataDir string, log *slog.Logger) (*Catalog, func() error, error) {
	db, err := statedb.Open(filepath.Join(dataDir, statedb.FileName))
	if err != nil {
		return nil, nil, err
	}
	st, err := store.Open(db, dataDir, log)
	if err != nil {
		db.Close()
		return nil, nil, err
	}
	c := NewCatalog(st, dataDir)
	if log == nil {
		log = slog.Default()
	}
	if err := c.AdoptLegacy(ctx, log); err != nil {
		db.Close()
		return nil, nil, err
	}
	return c, db.Close, nil
}

// OpenReadOnly opens the templates of dataDir for reading only (a server
// may be using the data dir).
func OpenReadOnly(dataDir string) (*Catalog, func() error, error) {
	path := filepath.Join(dataDir, statedb.FileName)
	if _, err := os.Stat(path); err != nil {
		return nil, nil, fmt.Errorf("%w: no node state in %s (run aenv setup): %v", errkind.ErrNotFound, dataDir, err)
	}
	db, err := statedb.OpenReadOnly(path)
	if err != nil {
		return nil, nil, err
	}
	return NewCatalog(store.OpenReadOnly(db, dataDir, nil), dataDir), db.Close, nil
}

// Export writes template name as a template directory in dir (see
// AdoptLegacy): template.json with its settings and rootfs.qcow2, a hard
// link to its root layer (a copy across file systems; a layer below it is
// referred to where it is). A data dir whose templates/<name> is such a
// directory, or a link to one, adopts it at start.
func (c *Catalog) Export(ctx context.Context, name, dir string) error {
	t, err := c.Get(ctx, name)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	root := filepath.Join(dir, legacyRoot)
	tmp := root + ".tmp"
	os.Remove(tmp)
	if err := linkOrCopy(t.RootDisk, tmp); err != nil {
		return err
	}
	if err := os.Rename(tmp, root); err != nil {
		return err
	}
	return storage.WriteJSONAtomic(filepath.Join(dir, legacyRecord), t, 0o644)
}
