package orchestrator

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/agentenv/agentenv/internal/storage"
)

// A sandbox running copy-on-write on a snapshot's RAM image is captured
// without restarting its QEMU: vCPUs stop, the state with the pages that
// differ from the image is written (QEMU flushes the disk and lets go of it
// meanwhile), the disk overlay (the blocks changed since the same base) is
// copied, and the vCPUs go on. Both halves of the snapshot are relative to
// the base the sandbox was restored from; the sandbox itself is unchanged.
//
// (Switching QEMU to a new overlay over QMP instead of copying would make
// the snapshot's disk cost nothing, but QEMU 7.2 then fails the next
// migration of that process in bdrv_inactivate_all.)

// canSnapshotLive reports whether s can be captured without a restart.
func (n *Node) canSnapshotLive(s *Sandbox) bool {
	return n.memoryBaseOf(s) != ""
}

// snapshotLive captures a running copy-on-write sandbox into a new
// incremental snapshot. On error the sandbox's QEMU is still there, stopped,
// and the caller resumes it.
func (n *Node) snapshotLive(ctx context.Context, s *Sandbox) (string, error) {
	m := n.machine(s.ID)
	if m == nil {
		return "", errors.New("no running machine")
	}
	snapID, sdir := n.newSnapshotID()
	overlay := filepath.Join(n.sandboxDir(s.ID), overlayName)
	phase := s.phaseTimer()
	info, err := storage.Info(ctx, overlay)
	if err != nil {
		return "", err
	}
	man := snapshotManifest{ID: snapID, SandboxID: s.ID, TemplateID: s.TemplateID,
		ParentLayer: info.BackingFilename, MemoryMiB: s.MemoryMiB, CreatedAt: time.Now().UTC(),
		MemoryBase: n.memoryBaseOf(s), StateHasRAM: true}
	// Assembled under a hidden name: garbage collection and recovery leave
	// it alone, and a crash leaves nothing that looks like a snapshot.
	stage := filepath.Join(n.cfg.DataDir, snapshotsDir, "."+snapID)
	if err := os.MkdirAll(stage, 0o700); err != nil {
		return "", err
	}
	defer os.RemoveAll(stage)
	if err := m.Pause(ctx); err != nil {
		return "", err
	}
	phase("stop vcpus")
	st, err := m.SaveStateDiff(ctx, filepath.Join(stage, snapStateName), s.MemFile)
	if err != nil {
		return "", fmt.Errorf("write incremental snapshot: %w", err)
	}
	phase("save state and changed RAM")
	if _, err := storage.CloneFile(overlay, filepath.Join(stage, snapDiskName)); err != nil {
		return "", fmt.Errorf("copy disk overlay: %w", err)
	}
	phase("copy disk overlay")
	if err := m.Resume(ctx); err != nil {
		return "", err
	}
	phase("resume vcpus")
	// (The state file was synced as it was written.)
	if err := syncFile(filepath.Join(stage, snapDiskName)); err != nil {
		return "", err
	}
	if err := os.Chmod(filepath.Join(stage, snapDiskName), 0o400); err != nil {
		return "", err
	}
	man.StateSHA256, man.DiffPages = st.SHA256, st.PagesKept
	if err := writeJSONAtomic(filepath.Join(stage, snapManifestName), man); err != nil {
		return "", err
	}
	// Pinned until a record refers to it (the caller unpins).
	n.pinSnapshot(snapID)
	if err := os.Rename(stage, sdir); err != nil {
		n.unpinSnapshot(snapID)
		return "", err
	}
	if err := storage.SyncDir(filepath.Dir(sdir)); err != nil {
		return "", err
	}
	phase("commit")
	n.log.Info("incremental snapshot", "sandbox", s.ID, "snapshot", snapID, "pages", st.PagesKept, "of", st.PagesSent, "phases", s.Phases)
	return snapID, nil
}

// pinSnapshot keeps a snapshot from garbage collection until unpinned.
func (n *Node) pinSnapshot(id string) {
	n.mu.Lock()
	n.pinned[id]++
	n.mu.Unlock()
}

func (n *Node) unpinSnapshot(id string) {
	n.mu.Lock()
	if n.pinned[id]--; n.pinned[id] <= 0 {
		delete(n.pinned, id)
	}
	n.mu.Unlock()
}
