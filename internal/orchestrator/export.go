package orchestrator

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/agentenv/agentenv/internal/storage"
	"github.com/agentenv/agentenv/internal/storage/repository"
	"github.com/agentenv/agentenv/internal/store"
)

// Named snapshots are committed to the node's snapshot repository (posix_fs
// or oss), self-contained but for the template's root layer: the RAM image
// (an incremental snapshot's base image), the state (with an incremental
// snapshot's changed pages), the disk as one qcow2 layer holding every block that
// differs from the template, and the snapshot record. A node that has lost
// its local copy (or, later, another node) restores the snapshot from there.

// repoKindSnapshot is the repository kind of named snapshots.
const repoKindSnapshot = "snapshot"

// Files of an exported snapshot.
const (
	exportRecordName = "snapshot.json"
	exportDiskName   = "disk-over-template.qcow2"
)

// exportSnapshot commits a named snapshot to the repository.
func (n *Node) exportSnapshot(ctx context.Context, ns *NamedSnapshot) error {
	if n.cfg.Repository == nil {
		return nil
	}
	start := time.Now()
	t, err := n.Template(ns.TemplateID)
	if err != nil {
		return fmt.Errorf("export snapshot %s: template: %w", ns.Name, err)
	}
	sdir := filepath.Join(n.cfg.DataDir, snapshotsDir, ns.SnapshotID)
	stage, err := os.MkdirTemp(filepath.Join(n.cfg.DataDir, snapshotsDir), ".export-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(stage)
	// An incremental snapshot goes with the RAM image it is relative to (a
	// filesystem snapshot has neither RAM nor state).
	image, hasRAM, err := n.snapshotRAM(ns.SnapshotID)
	if err != nil {
		return err
	}
	if !ns.FilesystemOnly {
		for _, f := range [][2]string{{image, snapMemName}, {filepath.Join(sdir, snapStateName), snapStateName}} {
			if err := os.Link(f[0], filepath.Join(stage, f[1])); err != nil {
				return fmt.Errorf("export snapshot %s: %w", ns.Name, err)
			}
		}
	}
	// One layer with everything that differs from the template, whatever the
	// chain of snapshot layers in between: the snapshot's top layer, rebased
	// (safely, comparing contents) from its chain onto the template's layer.
	// (`qemu-img convert -B` would copy only the top layer's clusters.)
	disk := filepath.Join(stage, exportDiskName)
	if _, err := storage.CloneFile(filepath.Join(sdir, snapDiskName), disk); err != nil {
		return fmt.Errorf("export snapshot %s: %w", ns.Name, err)
	}
	if err := os.Chmod(disk, 0o600); err != nil {
		return err
	}
	out, err := exec.CommandContext(ctx, "qemu-img", "rebase", "-q", "-f", "qcow2", "-b", t.RootDisk, "-F", "qcow2", disk).CombinedOutput()
	if err != nil {
		return fmt.Errorf("export snapshot %s: flatten disk: %v: %s", ns.Name, err, strings.TrimSpace(string(out)))
	}
	// The volumes' copies, each one standalone qcow2 (a fork child's copy
	// is an overlay of its parent's).
	for _, v := range ns.Volumes {
		name := volumeCopyName(v.Slot)
		out, err := exec.CommandContext(ctx, "qemu-img", "convert", "-q", "-O", "qcow2", filepath.Join(sdir, name), filepath.Join(stage, name)).CombinedOutput()
		if err != nil {
			return fmt.Errorf("export snapshot %s: volume %s: %v: %s", ns.Name, v.Name, err, strings.TrimSpace(string(out)))
		}
	}
	rec := *ns
	rec.TemplateLayer, rec.StateHasRAM = t.Layer, hasRAM
	var man snapshotManifest
	if err := storage.ReadJSON(filepath.Join(sdir, snapManifestName), &man); err == nil {
		rec.GatewayMAC = man.GatewayMAC
	}
	rec.AccessToken = n.tokens.Seal(ns.AccessToken) // never in plaintext in shared storage
	if err := storage.WriteJSONAtomic(filepath.Join(stage, exportRecordName), rec, 0o600); err != nil {
		return err
	}
	if _, err := n.cfg.Repository.Put(ctx, repoKindSnapshot, ns.Name, stage); err != nil {
		if errors.Is(err, repository.ErrExists) {
			return fmt.Errorf("%w: the repository holds another snapshot named %q (made on another node)", ErrConflict, ns.Name)
		}
		return fmt.Errorf("export snapshot %s: %w", ns.Name, err)
	}
	n.log.Info("snapshot committed to the repository", "snapshot", ns.Name, "took", time.Since(start).Round(time.Millisecond))
	return nil
}

// importSnapshot fetches a named snapshot from the repository into a new
// local snapshot and records it, for a node that does not have it.
func (n *Node) importSnapshot(ctx context.Context, name string) (*NamedSnapshot, error) {
	if n.cfg.Repository == nil {
		return nil, fmt.Errorf("%w: snapshot %q", ErrNotFound, name)
	}
	if _, err := n.cfg.Repository.Stat(ctx, repoKindSnapshot, name); err != nil {
		if errors.Is(err, repository.ErrNotFound) || errors.Is(err, repository.ErrInvalidName) {
			return nil, fmt.Errorf("%w: snapshot %q", ErrNotFound, name)
		}
		return nil, err
	}
	if err := os.MkdirAll(filepath.Join(n.cfg.DataDir, snapshotsDir), 0o700); err != nil {
		return nil, err
	}
	stage, err := os.MkdirTemp(filepath.Join(n.cfg.DataDir, snapshotsDir), ".import-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(stage)
	if _, err := n.cfg.Repository.Get(ctx, repoKindSnapshot, name, stage); err != nil {
		if errors.Is(err, repository.ErrCorrupt) {
			return nil, fmt.Errorf("%w: snapshot %q in the repository: %v", ErrCorrupt, name, err)
		}
		return nil, err
	}
	var rec NamedSnapshot
	if err := storage.ReadJSON(filepath.Join(stage, exportRecordName), &rec); err != nil {
		return nil, fmt.Errorf("%w: snapshot %q record: %v", ErrCorrupt, name, err)
	}
	token, legacy, err := n.tokens.Open(rec.AccessToken)
	if err != nil {
		return nil, fmt.Errorf("%w: snapshot %q was sealed with another secret than this node's (AENV_NODE_TOKEN differs)", ErrCorrupt, name)
	}
	if legacy {
		n.log.Warn("a snapshot in the repository holds its envd token in plaintext (written by an older release)", "snapshot", name)
	}
	rec.AccessToken = token
	t, err := n.Template(rec.TemplateID)
	if err != nil {
		return nil, fmt.Errorf("snapshot %q needs template %q: %w", name, rec.TemplateID, err)
	}
	if rec.TemplateLayer != t.Layer {
		n.log.Warn("importing a snapshot made over another build of its template", "snapshot", name, "template", t.Name)
	}
	// Point the disk layer at this node's copy of the template.
	disk := filepath.Join(stage, exportDiskName)
	if out, err := exec.CommandContext(ctx, "qemu-img", "rebase", "-u", "-b", t.RootDisk, "-F", "qcow2", disk).CombinedOutput(); err != nil {
		return nil, fmt.Errorf("import snapshot %s: rebase disk: %v: %s", name, err, strings.TrimSpace(string(out)))
	}
	snapID, lease, err := n.newSnapshot(ctx, "import of snapshot "+name, t.Layer)
	if err != nil {
		return nil, err
	}
	defer lease.Drop(context.WithoutCancel(ctx))
	sdir := n.snapshotDir(snapID)
	if err := os.Rename(disk, filepath.Join(stage, snapDiskName)); err != nil {
		return nil, err
	}
	os.Remove(filepath.Join(stage, exportRecordName))
	for _, v := range rec.Volumes {
		if err := os.Chmod(filepath.Join(stage, volumeCopyName(v.Slot)), 0o400); err != nil {
			return nil, fmt.Errorf("%w: snapshot %q: volume %s: %v", ErrCorrupt, name, v.Name, err)
		}
	}
	sum := ""
	if !rec.FilesystemOnly {
		if sum, err = store.FileSHA256(filepath.Join(stage, snapStateName)); err != nil {
			return nil, err
		}
	}
	if err := storage.WriteJSONAtomic(filepath.Join(stage, snapManifestName), snapshotManifest{
		ID: snapID, SandboxID: rec.SandboxID, TemplateID: rec.TemplateID, ParentLayer: t.RootDisk,
		MemoryMiB: rec.MemoryMiB, StateSHA256: sum, CreatedAt: time.Now().UTC(), StateHasRAM: rec.StateHasRAM,
		FilesystemOnly: rec.FilesystemOnly, GatewayMAC: rec.GatewayMAC,
	}, 0o600); err != nil {
		return nil, err
	}
	if err := os.Rename(stage, sdir); err != nil {
		return nil, err
	}
	if err := storage.SyncDir(filepath.Dir(sdir)); err != nil {
		return nil, err
	}
	rec.Name, rec.SnapshotID = name, snapID
	if err := n.store.Tx(ctx, func(tx *sql.Tx) error { return setNamedSnapshot(tx, &rec) }); err != nil {
		return nil, err
	}
	n.log.Info("snapshot imported from the repository", "snapshot", name, "local", snapID)
	return &rec, nil
}
