package templates

import (
	"context"
	"crypto/sha256"
	"database/sql"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"syscall"

	"github.com/agentenv/agentenv/internal/storage"
	"github.com/agentenv/agentenv/internal/store"
)

// Template directories: releases before the store kept each template as
// <data>/templates/<name>/ with template.json (its settings) and
// rootfs.qcow2 (its root layer, rewritten by a rebuild), and build and
// image layers as loose files in <data>/layers. AdoptLegacy moves such a
// data dir onto the store once: loose layers become objects (kept as a
// cache), each template's root layer becomes a layer named by its content
// (hard-linked, so a directory shared by several data dirs stays as it is)
// and its name a label. What may still point at the old path of a root
// layer (overlays of paused sandboxes, snapshot disks) keeps working: the
// old path becomes a link to the layer.

// LegacyDir is where template directories were kept.
const LegacyDir = "templates"

// LegacyCacheHolder holds the loose layers found at adoption.
const LegacyCacheHolder = "cache/legacy-layers"

// legacyFiles of a template directory.
const (
	legacyRecord = "template.json"
	legacyRoot   = "rootfs.qcow2"
)

// AdoptLegacy adopts the loose layers and template directories of dataDir
// (see above); it does nothing when there are none.
func (c *Catalog) AdoptLegacy(ctx context.Context, log *slog.Logger) error {
	if err := c.adoptLooseLayers(ctx); err != nil {
		return fmt.Errorf("adopt layers: %w", err)
	}
	ents, err := os.ReadDir(filepath.Join(c.dataDir, LegacyDir))
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	for _, e := range ents {
		dir := filepath.Join(c.dataDir, LegacyDir, e.Name())
		if _, err := os.Stat(filepath.Join(dir, legacyRecord)); err != nil {
			continue
		}
		if err := c.adoptDir(ctx, e.Name(), dir); err != nil {
			return fmt.Errorf("adopt template %s: %w", e.Name(), err)
		}
		log.Info("adopted a template directory into the layer store", "template", e.Name())
	}
	return nil
}

// adoptLooseLayers records every layer file of the layers dir that no
// object names (build and image layers of releases before the store).
func (c *Catalog) adoptLooseLayers(ctx context.Context) error {
	root := c.st.Abs(store.LayersDir)
	ents, err := os.ReadDir(root)
	if err != nil {
		return err
	}
	objs, err := c.st.Objects(ctx)
	if err != nil {
		return err
	}
	if len(objs) > 0 {
		// Not an older release's data dir: a layer file no object names is
		// the debris of a crash, which the store's recovery removes.
		return nil
	}
	known := map[string]bool{}
	var loose []string
	for _, e := range ents {
		if id, ok := strings.CutSuffix(e.Name(), ".qcow2"); ok && !strings.HasPrefix(id, ".") && !known[id] {
			loose = append(loose, id)
		}
	}
	if len(loose) == 0 {
		return nil
	}
	return c.st.Tx(ctx, func(tx *sql.Tx) error {
		for _, id := range loose {
			p := filepath.Join(root, id+".qcow2")
			parent, err := c.backingObject(ctx, tx, p)
			if err != nil {
				continue // unreadable (e.g. over a lazily loaded layer): left to the store's recovery
			}
			if err := c.st.Add(tx, id, store.KindLayer, p, parent); err != nil {
				return err
			}
			if _, err := tx.Exec(`INSERT INTO refs (holder, object) VALUES (?, ?) ON CONFLICT DO NOTHING`, LegacyCacheHolder, id); err != nil {
				return err
			}
		}
		return nil
	})
}

// backingObject records (if needed) and names the object a layer file's
// backing file is: a layer of the store, or a file elsewhere adopted as an
// external object (with its own chain). "" when the file has no backing.
func (c *Catalog) backingObject(ctx context.Context, tx *sql.Tx, layer string) (string, error) {
	info, err := storage.Info(ctx, layer)
	if err != nil {
		return "", err
	}
	b := info.BackingFilename
	if b == "" {
		return "", nil
	}
	if !filepath.IsAbs(b) {
		b = filepath.Join(filepath.Dir(layer), b)
	}
	if real, err := filepath.EvalSymlinks(b); err == nil {
		b = real
	}
	if rel, err := filepath.Rel(c.st.Abs(store.LayersDir), b); err == nil && !strings.Contains(rel, "/") {
		return strings.TrimSuffix(rel, ".qcow2"), nil // a layer of this store (recorded by the caller's pass)
	}
	var id string
	if err := tx.QueryRow(`SELECT id FROM objects WHERE path = ?`, b).Scan(&id); err == nil {
		return id, nil
	}
	parent, err := c.backingObject(ctx, tx, b)
	if err != nil {
		return "", err
	}
	sum := sha256.Sum256([]byte(b))
	id = "external-" + hex.EncodeToString(sum[:12])
	return id, c.st.Add(tx, id, store.KindLayer, b, parent)
}

// adoptDir adopts one template directory.
func (c *Catalog) adoptDir(ctx context.Context, name, dir string) error {
	b, err := os.ReadFile(filepath.Join(dir, legacyRecord))
	if err != nil {
		return err
	}
	var t Template
	if err := json.Unmarshal(b, &t); err != nil {
		return fmt.Errorf("template.json: %w", err)
	}
	t.Name = name
	root, err := filepath.EvalSymlinks(filepath.Join(dir, legacyRoot))
	if err != nil {
		return err
	}
	// A hard link of the root layer into the store, under a scratch name
	// that the commit renames to the layer's content name.
	tmp, err := c.tempFile(".adopt-*.qcow2")
	if err != nil {
		return err
	}
	if err := linkOrCopy(root, tmp); err != nil {
		return err
	}
	var parent string
	if err := c.st.Tx(ctx, func(tx *sql.Tx) error {
		var err error
		parent, err = c.backingObject(ctx, tx, tmp)
		return err
	}); err != nil {
		os.Remove(tmp)
		return err
	}
	at, err := c.InstallFile(ctx, t, tmp, parent)
	if err != nil {
		os.Remove(tmp)
		return err
	}
	// The old path now leads to the layer; the record goes. A link to a
	// directory shared with other data dirs is replaced by a directory of
	// this data dir's own (the shared one stays untouched).
	if st, err := os.Lstat(dir); err == nil && st.Mode()&os.ModeSymlink != 0 {
		if err := os.Remove(dir); err != nil {
			return err
		}
		if err := os.Mkdir(dir, 0o755); err != nil {
			return err
		}
		return os.Symlink(at.RootDisk, filepath.Join(dir, legacyRoot))
	}
	link := filepath.Join(dir, ".rootfs.link")
	os.Remove(link)
	if err := os.Symlink(at.RootDisk, link); err != nil {
		return err
	}
	if err := os.Rename(link, filepath.Join(dir, legacyRoot)); err != nil {
		return err
	}
	return os.Remove(filepath.Join(dir, legacyRecord))
}

// linkOrCopy hard-links src to dst, or copies it across file systems
// (a reflink where it can, holes kept).
func linkOrCopy(src, dst string) error {
	err := os.Link(src, dst)
	if err == nil || !errors.Is(err, syscall.EXDEV) {
		return err
	}
	if _, err := storage.CloneFile(src, dst); err != nil {
		return err
	}
	return os.Chmod(dst, 0o644)
}
