package orchestrator

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/agentenv/agentenv/internal/storage"
	"github.com/agentenv/agentenv/internal/vmm"
)

// A sandbox running copy-on-write on a snapshot's RAM image is captured
// without stopping its QEMU: vCPUs stop, the disk's top layer is handed to
// the snapshot while QEMU switches to a new overlay stacked on it, the state
// with the pages that differ from the image is written, and the vCPUs go on.
// The snapshot is incremental over the same image; nothing is restarted.

// canSnapshotLive reports whether s can be captured without a restart.
func (n *Node) canSnapshotLive(s *Sandbox) bool {
	return n.memoryBaseOf(s) != ""
}

// snapshotLive captures a running copy-on-write sandbox into a new
// incremental snapshot; it runs on from the snapshot afterwards. On error
// the sandbox's QEMU still holds a consistent disk and the caller resumes it.
func (n *Node) snapshotLive(ctx context.Context, s *Sandbox) (string, error) {
	m := n.machine(s.ID)
	if m == nil {
		return "", errors.New("no running machine")
	}
	base := n.memoryBaseOf(s)
	snapID := "fork-" + randomHex(8)
	sdir := filepath.Join(n.cfg.DataDir, snapshotsDir, snapID)
	pdir := n.sandboxDir(s.ID)
	top := filepath.Join(pdir, overlayName)
	phase := s.phaseTimer()
	if err := os.MkdirAll(sdir, 0o700); err != nil {
		return "", err
	}
	before, err := storage.Info(ctx, top)
	if err != nil {
		os.RemoveAll(sdir)
		return "", err
	}
	man := snapshotManifest{ID: snapID, SandboxID: s.ID, TemplateID: s.TemplateID,
		ParentLayer: before.BackingFilename, MemoryMiB: s.MemoryMiB, CreatedAt: time.Now().UTC(),
		MemoryBase: base, StateHasRAM: true}
	if err := writeJSONAtomic(filepath.Join(sdir, snapManifestName), man); err != nil {
		os.RemoveAll(sdir)
		return "", err
	}
	// The sandbox's record names the snapshot before its disk depends on
	// it, so garbage collection never takes the layer from under it.
	prevSnap := s.SnapshotID
	if err := n.setFields(ctx, s.ID, "snapshot_id = ?", snapID); err != nil {
		os.RemoveAll(sdir)
		return "", err
	}
	switched := false
	abandon := func() {
		if !switched {
			_ = n.setFields(context.WithoutCancel(ctx), s.ID, "snapshot_id = ?", prevSnap)
			os.RemoveAll(sdir)
		}
	}
	if err := m.Pause(ctx); err != nil {
		abandon()
		return "", err
	}
	phase("stop vcpus")
	// QEMU reopens the current top read-only by the name it knows it by:
	// make that name the top's, whatever renames came before.
	qemuTop, err := m.RootDiskFile(ctx)
	if err != nil {
		abandon()
		return "", err
	}
	if qemuTop != top {
		_ = os.Remove(qemuTop)
		if err := os.Link(top, qemuTop); err != nil {
			abandon()
			return "", err
		}
	}
	// The snapshot's disk is the current top, under a second name.
	if err := os.Link(top, filepath.Join(sdir, snapDiskName)); err != nil {
		abandon()
		return "", err
	}
	next := filepath.Join(pdir, "overlay-"+randomHex(4)+".qcow2")
	if err := storage.CreateOverlay(ctx, filepath.Join(sdir, snapDiskName), next, 0); err != nil {
		abandon()
		return "", err
	}
	if err := m.SwitchRootDisk(ctx, next); err != nil {
		os.Remove(next)
		abandon()
		return "", err
	}
	switched = true
	phase("switch disk")
	st, err := m.SaveStateDiff(ctx, filepath.Join(sdir, snapStateName), s.MemFile)
	if err != nil {
		// The disk has moved on; the snapshot stays as its layer.
		n.settleOverlay(s.ID, next, qemuTop)
		return "", fmt.Errorf("write incremental snapshot: %w", err)
	}
	phase("save state and changed RAM")
	if err := m.Resume(ctx); err != nil {
		n.settleOverlay(s.ID, next, qemuTop)
		return "", err
	}
	phase("resume vcpus")
	n.settleOverlay(s.ID, next, qemuTop)
	if err := os.Chmod(filepath.Join(sdir, snapDiskName), 0o400); err != nil {
		return "", err
	}
	sum, err := fileSHA256(filepath.Join(sdir, snapStateName))
	if err != nil {
		return "", err
	}
	man.StateSHA256, man.DiffPages = sum, st.PagesKept
	if err := writeJSONAtomic(filepath.Join(sdir, snapManifestName), man); err != nil {
		return "", err
	}
	if err := n.runOnSnapshot(ctx, s, snapID); err != nil {
		return "", err
	}
	n.log.Info("incremental snapshot", "sandbox", s.ID, "snapshot", snapID, "pages", st.PagesKept, "of", st.PagesSent, "phases", s.Phases)
	return snapID, nil
}

// settleOverlay gives the overlay QEMU now writes (next) the sandbox's
// usual overlay name, for later restarts, and drops the extra name the
// former top had (QEMU never reopens a layer below the top).
func (n *Node) settleOverlay(id, next, formerTopName string) {
	top := filepath.Join(n.sandboxDir(id), overlayName)
	if err := os.Rename(next, top); err != nil {
		n.log.Error("rename the new disk overlay", "sandbox", id, "err", err)
		return
	}
	if formerTopName != top {
		_ = os.Remove(formerTopName)
	}
}

// adoptedOverlay puts the overlay a re-adopted QEMU writes under the
// sandbox's usual overlay name, if a crash came between a disk switch and
// its rename.
func (n *Node) adoptedOverlay(ctx context.Context, id string, m *vmm.Machine) {
	cur, err := m.RootDiskFile(ctx)
	top := filepath.Join(n.sandboxDir(id), overlayName)
	if err != nil || cur == top {
		return
	}
	if _, err := os.Stat(cur); err != nil {
		return // renamed already
	}
	if err := os.Rename(cur, top); err != nil {
		n.log.Error("settle the disk overlay of a re-adopted sandbox", "sandbox", id, "err", err)
	}
}
