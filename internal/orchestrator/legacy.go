package orchestrator

import (
	"context"
	"database/sql"
	"errors"
	"os"
	"path/filepath"
	"strings"

	"github.com/agentenv/agentenv/internal/storage"
	"github.com/agentenv/agentenv/internal/store"
)

// Releases before the store kept snapshots as bare directories
// (snapshots/<id>/ with manifest.json), named snapshots as
// named-snapshots/<name>.json, each template's current snapshot as
// template-snapshots/<name>.json, and no references at all (garbage
// collection walked the directories). adoptLegacySnapshots records them in
// the store once, at start: snapshot directories become objects needing
// what their disk stacks on and their RAM is relative to, named snapshots
// become labels, and sandbox records get their references. Template
// snapshots of old releases are dropped (each is rebuilt in the
// background, as for a rebuilt template).
const (
	legacyNamedSnapshotsDir    = "named-snapshots"
	legacyTemplateSnapshotsDir = "template-snapshots"
)

func (n *Node) adoptLegacySnapshots(ctx context.Context) error {
	objs, err := n.store.Objects(ctx)
	if err != nil {
		return err
	}
	known := map[string]bool{}
	for _, o := range objs {
		known[o.ID] = true
	}
	root := filepath.Join(n.cfg.DataDir, snapshotsDir)
	ents, err := os.ReadDir(root)
	if err != nil {
		return err
	}
	type legacySnap struct {
		id  string
		man snapshotManifest
	}
	var snaps []legacySnap
	for _, e := range ents {
		id := e.Name()
		if strings.HasPrefix(id, ".") || known[id] {
			continue
		}
		var man snapshotManifest
		if err := storage.ReadJSON(filepath.Join(root, id, snapManifestName), &man); err != nil && !strings.HasPrefix(id, ramSnapshotPrefix) {
			continue // debris: store.Recover removes it
		}
		snaps = append(snaps, legacySnap{id, man})
	}
	var adoptedFiles []string // removed once the transaction is committed
	err = n.store.Tx(ctx, func(tx *sql.Tx) error {
		for _, ls := range snaps {
			needs := []string{ls.man.MemoryBase}
			if ls.man.ParentLayer != "" {
				needs = append(needs, n.objectOfPath(ctx, tx, ls.man.ParentLayer))
			}
			if err := n.store.Add(tx, ls.id, store.KindSnapshot, filepath.Join(root, ls.id), needs...); err != nil {
				return err
			}
			n.log.Info("adopted a snapshot into the store", "snapshot", ls.id)
		}
		// Named snapshots become labels.
		dir := filepath.Join(n.cfg.DataDir, legacyNamedSnapshotsDir)
		files, _ := os.ReadDir(dir)
		for _, f := range files {
			name, ok := strings.CutSuffix(f.Name(), ".json")
			if !ok {
				continue
			}
			var ns NamedSnapshot
			if err := storage.ReadJSON(filepath.Join(dir, f.Name()), &ns); err != nil {
				n.log.Error("unreadable named snapshot of an older release left alone", "file", f.Name(), "err", err)
				continue
			}
			ns.Name = name
			if _, err := n.store.GetTx(tx, ns.SnapshotID); err != nil {
				n.log.Error("named snapshot of an older release without its files left alone", "snapshot", name, "err", err)
				continue
			}
			if err := setNamedSnapshot(tx, &ns); err != nil && !errors.Is(err, ErrConflict) {
				return err
			}
			adoptedFiles = append(adoptedFiles, filepath.Join(dir, f.Name()))
		}
		// Sandbox records that hold nothing yet.
		bare, err := n.records.UnreferencedTx(ctx, tx)
		if err != nil {
			return err
		}
		for _, s := range bare {
			if s.SnapshotID == "" && s.BaseLayer == "" {
				if info, err := storage.Info(ctx, filepath.Join(n.sandboxDir(s.ID), overlayName)); err == nil && info.BackingFilename != "" {
					s.BaseLayer = n.objectOfPath(ctx, tx, info.BackingFilename)
				}
			}
			if err := n.records.SaveTx(ctx, tx, s); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return err
	}
	for _, f := range adoptedFiles {
		os.Remove(f)
	}
	os.Remove(filepath.Join(n.cfg.DataDir, legacyNamedSnapshotsDir))
	os.RemoveAll(filepath.Join(n.cfg.DataDir, legacyTemplateSnapshotsDir))
	return nil
}

// objectOfPath names the object a file belongs to: the snapshot whose
// directory holds it, or the layer it is ("" if none).
func (n *Node) objectOfPath(ctx context.Context, tx *sql.Tx, path string) string {
	if real, err := filepath.EvalSymlinks(path); err == nil {
		path = real
	}
	if rel, err := filepath.Rel(filepath.Join(n.cfg.DataDir, snapshotsDir), path); err == nil && !strings.HasPrefix(rel, "..") {
		return strings.SplitN(rel, "/", 2)[0]
	}
	rel, _ := filepath.Rel(n.cfg.DataDir, path)
	var id string
	if err := tx.QueryRowContext(ctx, `SELECT id FROM objects WHERE path = ? OR path = ?`, rel, path).Scan(&id); err != nil {
		return ""
	}
	return id
}
