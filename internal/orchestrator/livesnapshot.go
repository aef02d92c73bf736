package orchestrator

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/agentenv/agentenv/internal/operation"
	"github.com/agentenv/agentenv/internal/sandboxes"
	"github.com/agentenv/agentenv/internal/storage"
	"github.com/agentenv/agentenv/internal/store"
	"github.com/agentenv/agentenv/internal/vmm"
)

// A sandbox running copy-on-write on a snapshot's RAM image is captured
// without restarting its QEMU: vCPUs stop (QEMU drains and flushes the
// disk), the state with the pages that differ from the image is written
// while the disk overlay (the blocks changed since the same base) is
// copied, and the vCPUs go on; the state file is then hashed and synced
// with the guest running. Both halves of the snapshot are relative to the
// base the sandbox was restored from; with the disk copied, the sandbox
// itself is unchanged.
//
// The changed pages are the mapping's private pages where QEMU can save
// its device state alone (vmm.CapturePrivatePages), else what a full
// migration sends that differs from the image (vmm.CaptureMigration, a
// walk over all of guest RAM: 330-470 ms of stop under the benchmark's
// write load, against 80-90 ms for the private pages, 2026-12-03). Hashing
// (about 1 GB/s) and syncing before the vCPUs go on would double the stop
// again; syncing after made no difference while the walk dominated it.
//
// Where QEMU can, the disk is not copied but sealed (sealsnapshot.go):
// QEMU stacks a new overlay and the old one becomes the snapshot's disk in
// place; the copy below stays for QEMUs that cannot, machines started by
// older nodes, and chains already maxSealedChain deep.

// canSnapshotLive reports whether s can be captured without a restart.
func (n *Node) canSnapshotLive(s *sandboxes.Sandbox) bool {
	return n.memoryBaseOf(s) != ""
}

// snapshotLive captures a running copy-on-write sandbox into a new
// incremental snapshot, held by the returned lease, and sets guestStopped
// to how long the guest's vCPUs were stopped. On failure the half-made
// snapshot goes (and the caller's cleanup runs the sandbox on).
func (n *Node) snapshotLive(o *operation.Op, s *sandboxes.Sandbox, opState sandboxes.State, guestStopped *time.Duration) (string, *store.Lease, error) {
	ctx := o.Context()
	m := n.machines.get(s.ID)
	if !alive(m) {
		return "", nil, errors.New("no running machine")
	}
	if info, ok := n.sealsDisk(ctx, s, m); ok {
		return n.snapshotSealed(o, s, m, info, opState, guestStopped)
	}
	overlay := filepath.Join(n.sandboxDir(s.ID), overlayName)
	phase := s.PhaseTimer()
	var snapID string
	var lease *store.Lease
	if err := o.Do("record-snapshot", func(ctx context.Context) error {
		var err error
		snapID, lease, err = n.newSnapshot(ctx, o.Name()+" of "+s.ID, n.storeRefs(s)...)
		return err
	}); err != nil {
		return "", nil, err
	}
	sdir := n.snapshotDir(snapID)
	// Assembled under a hidden name: a crash leaves nothing that looks like
	// a snapshot (recovery removes it with the lease).
	stage := filepath.Join(n.cfg.DataDir, snapshotsDir, ".stage-"+snapID)
	n.forgetStageOnFailure(o, stage, lease)
	info, err := storage.Info(ctx, overlay)
	if err != nil {
		return "", nil, err
	}
	man := snapshotManifest{ID: snapID, SandboxID: s.ID, TemplateID: s.TemplateID,
		ParentLayer: info.BackingFilename, MemoryMiB: s.MemoryMiB, CreatedAt: time.Now().UTC(),
		MemoryBase: n.memoryBaseOf(s), StateHasRAM: true, GatewayMAC: n.gatewayMAC(s)}
	if err := os.MkdirAll(stage, 0o700); err != nil {
		return "", nil, err
	}
	stopped := time.Now()
	if err := o.Do("stop-vcpus", func(ctx context.Context) error { return m.Pause(ctx) }); err != nil {
		return "", nil, err
	}
	phase("stop vcpus")
	// The disk overlay is copied while the state is written: both need
	// the vCPUs stopped, neither the other, and the guest waits for the
	// longer of the two instead of their sum.
	var pages, sent int64
	copied := make(chan error, 1)
	go func() {
		_, err := storage.CloneFile(overlay, filepath.Join(stage, snapDiskName))
		copied <- err
	}()
	saveErr := o.Do("save-state", func(ctx context.Context) error {
		st, err := n.saveRAMDiff(ctx, m, filepath.Join(stage, snapStateName), s.MemFile)
		if err != nil {
			return fmt.Errorf("write incremental snapshot: %w", err)
		}
		man.StateSHA256, man.DiffPages, pages, sent = st.SHA256, st.PagesKept, st.PagesKept, st.PagesSent
		return nil
	})
	phase("save state and changed RAM")
	copyErr := <-copied // before anything returns: the stage may go on failure
	phase("copy disk overlay (its rest)")
	if saveErr != nil {
		return "", nil, saveErr
	}
	if err := o.Do("copy-overlay", func(context.Context) error { return copyErr }); err != nil {
		return "", nil, err
	}
	if err := o.Do("copy-volumes", func(context.Context) error { return n.copyVolumes(s, stage) }); err != nil {
		return "", nil, err
	}
	if err := o.Do("resume-vcpus", func(ctx context.Context) error { return m.Resume(ctx) }); err != nil {
		return "", nil, err
	}
	phase("resume vcpus")
	*guestStopped = time.Since(stopped)
	if err := n.syncState(o, stage, &man); err != nil {
		return "", nil, err
	}
	phase("sync state")
	if err := o.Do("commit", func(context.Context) error { return commitStage(stage, sdir, man) }); err != nil {
		return "", nil, err
	}
	phase("commit")
	o.Settle()
	n.log.Info("incremental snapshot", "sandbox", s.ID, "snapshot", snapID, "pages", pages, "of", sent,
		"guest_stopped", guestStopped.Round(time.Microsecond), "phases", s.Phases)
	return snapID, lease, nil
}

// syncState flushes a live snapshot's state and disk in dir and hashes
// the state where saving it did not (saveRAMDiff): the state file may
// still be in the page cache only, and both happen with the guest running
// again.
func (n *Node) syncState(o *operation.Op, dir string, man *snapshotManifest) error {
	return o.Do("sync-state", func(context.Context) error {
		// The state and the disk are flushed while the state is hashed:
		// the flushes wait on the disk, the hash on a core.
		state := filepath.Join(dir, snapStateName)
		synced := make(chan error, 2)
		for _, f := range []string{state, filepath.Join(dir, snapDiskName)} {
			go func() { synced <- storage.SyncFile(f) }()
		}
		var err error
		if man.StateSHA256 == "" {
			man.StateSHA256, err = store.FileSHA256(state)
		}
		return errors.Join(err, <-synced, <-synced)
	})
}

// commitStage publishes a snapshot assembled in stage as sdir: its disk
// made durable and read-only, its manifest written last, the directory
// renamed into place.
func commitStage(stage, sdir string, man snapshotManifest) error {
	disk := filepath.Join(stage, snapDiskName)
	if err := storage.SyncFile(disk); err != nil {
		return err
	}
	if err := os.Chmod(disk, 0o400); err != nil {
		return err
	}
	if err := storage.WriteJSONAtomic(filepath.Join(stage, snapManifestName), man, 0o600); err != nil {
		return err
	}
	if err := os.Rename(stage, sdir); err != nil {
		return err
	}
	return storage.SyncDir(filepath.Dir(sdir))
}

// forgetStageOnFailure pushes the cleanup of a snapshot being assembled in
// stage: the stage goes, and the snapshot with the lease that holds it.
func (n *Node) forgetStageOnFailure(o *operation.Op, stage string, lease *store.Lease) {
	o.OnFailure("forget the snapshot", func(ctx context.Context) error {
		os.RemoveAll(stage)
		if err := lease.Drop(ctx); err != nil {
			return err
		}
		n.gc(ctx)
		return nil
	})
}

// saveRAMDiff writes the incremental state of m, stopped, whose RAM maps
// base copy-on-write, the way the node's QEMU allows (vmm.DiffCapture,
// Config.DiffCapture overriding it). The file may be left unsynced and its
// checksum unknown (""): the callers sync and hash it, which a guest
// stopped meanwhile need not wait for.
func (n *Node) saveRAMDiff(ctx context.Context, m *vmm.Machine, path, base string) (vmm.RAMDiffStats, error) {
	how := n.cfg.DiffCapture
	if how == "" {
		how = n.qemu.DiffCapture()
	}
	if how == vmm.CapturePrivatePages {
		return m.SaveStateFromPrivatePages(ctx, path, base)
	}
	return m.SaveStateDiff(ctx, path, base)
}
