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

// A live snapshot seals the sandbox's disk where its QEMU can
// (vmm.Machine.Seal): instead of copying the overlay while the guest is
// stopped, QEMU stacks a new, empty overlay on it and writes only there,
// and the old overlay, unchanged from that instant, becomes the snapshot's
// disk in place (one file with two names until the sandbox's directory
// names the new overlay). The sandbox then stands on the snapshot as a
// sandbox made from it does: its record names the snapshot (held by it)
// and its overlay's header names the snapshot's disk as its backing file.
//
// The order makes every crash recoverable (settleInterruptedSeal): the
// snapshot's directory gets the second name of the overlay, the record
// names the snapshot and the new overlay exists before the vCPUs stop;
// the state is saved before the seal, so a sealed disk always has a
// complete state beside it; after the seal the operation only goes
// forward (the guest runs on over the new overlay whatever fails next).
//
// Each seal adds an image to the sandbox's chain; past maxSealedChain the
// snapshot copies the overlay as before.

// nextOverlayName is the overlay a seal is about to stack, in the
// sandbox's directory until it becomes overlayName.
const nextOverlayName = "overlay.next.qcow2"

// maxSealedChain bounds the snapshots' disks in a sandbox's disk chain
// that seals make (reads fall through the chain; each image is two
// descriptors in QEMU).
var maxSealedChain = 32 // a variable for the test of the bound

// sealsDisk reports whether a live snapshot of s seals its disk: the
// QEMU can (probed, and this machine's root disk is inherited as an
// fdset, which machines started by older nodes are not), the node was
// not told to copy, and the chain is not too deep. It also returns the
// overlay's header, read with the chain.
func (n *Node) sealsDisk(ctx context.Context, s *sandboxes.Sandbox, m *vmm.Machine) (*storage.ImageInfo, bool) {
	if n.cfg.CopyDisk || !n.qemu.SealsDisks() {
		return nil, false
	}
	if ok, err := m.Sealable(ctx); err != nil || !ok {
		return nil, false
	}
	chain, err := storage.BackingChain(ctx, filepath.Join(n.sandboxDir(s.ID), overlayName))
	if err != nil || len(chain) == 0 {
		return nil, false
	}
	// The snapshots' disks in it (a template's own layers do not count).
	snaps := 0
	root := filepath.Join(n.cfg.DataDir, snapshotsDir)
	for _, img := range chain {
		if filepath.Dir(filepath.Dir(img.Filename)) == root {
			snaps++
		}
	}
	return &chain[0], snaps < maxSealedChain
}

// snapshotSealed is snapshotLive sealing the disk.
// info is the sandbox's overlay's header (sealsDisk).
func (n *Node) snapshotSealed(o *operation.Op, s *sandboxes.Sandbox, m *vmm.Machine, info *storage.ImageInfo, opState sandboxes.State, guestStopped *time.Duration) (string, *store.Lease, error) {
	pdir := n.sandboxDir(s.ID)
	overlay, next := filepath.Join(pdir, overlayName), filepath.Join(pdir, nextOverlayName)
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
	disk := filepath.Join(sdir, snapDiskName)
	// Until the seal, a failure removes the snapshot's directory: its
	// name for the overlay goes, the overlay stays the sandbox's.
	n.forgetStageOnFailure(o, sdir, lease)
	man := snapshotManifest{ID: snapID, SandboxID: s.ID, TemplateID: s.TemplateID,
		ParentLayer: info.BackingFilename, MemoryMiB: s.MemoryMiB, CreatedAt: time.Now().UTC(),
		MemoryBase: n.memoryBaseOf(s), StateHasRAM: true, GatewayMAC: n.gatewayMAC(s)}
	if err := o.Do("link-disk", func(context.Context) error {
		if err := os.MkdirAll(sdir, 0o700); err != nil {
			return err
		}
		return os.Link(overlay, disk)
	}); err != nil {
		return "", nil, err
	}
	prev := *s
	if err := o.Do("point-record", func(ctx context.Context) error {
		rec := *s
		rec.SnapshotID, rec.BaseLayer = snapID, ""
		return n.records.Save(ctx, &rec)
	}); err != nil {
		return "", nil, err
	}
	o.OnFailure("the sandbox's record as it was", func(ctx context.Context) error {
		p := prev
		return n.records.Save(ctx, &p)
	})
	o.OnFailure("remove the next overlay", func(context.Context) error {
		if err := os.Remove(next); err != nil && !errors.Is(err, os.ErrNotExist) {
			return err
		}
		return nil
	})
	if err := o.Do("new-overlay", func(ctx context.Context) error {
		return storage.CreateOverlayOver(ctx, disk, next, info.VirtualSize)
	}); err != nil {
		return "", nil, err
	}
	phase("prepare the seal")
	stopped := time.Now()
	if err := o.Do("stop-vcpus", func(ctx context.Context) error { return m.Pause(ctx) }); err != nil {
		return "", nil, err
	}
	phase("stop vcpus")
	if err := o.Do("save-state", func(ctx context.Context) error {
		st, err := n.saveRAMDiff(ctx, m, filepath.Join(sdir, snapStateName), s.MemFile)
		if err != nil {
			return fmt.Errorf("write incremental snapshot: %w", err)
		}
		man.StateSHA256, man.DiffPages = st.SHA256, st.PagesKept
		return nil
	}); err != nil {
		return "", nil, err
	}
	phase("save state and changed RAM")
	if err := o.Do("copy-volumes", func(context.Context) error { return n.copyVolumes(s, sdir) }); err != nil {
		return "", nil, err
	}
	if err := o.Do("seal", func(ctx context.Context) error {
		err := m.Seal(ctx, next)
		if err != nil {
			// An answer lost (the context ran out) after QEMU switched
			// is a seal all the same.
			if sealed, serr := m.Sealed(context.WithoutCancel(ctx)); serr == nil && sealed {
				return nil
			}
		}
		return err
	}); err != nil {
		return "", nil, err
	}
	phase("seal disk")
	// The guest's disk is the new overlay now: from here the snapshot is
	// completed, never undone, and the guest runs on whatever fails.
	o.Settle()
	n.resumeOnFailure(o, s, opState)
	o.OnFailure("release the snapshot to the sandbox's record", func(ctx context.Context) error { return lease.Drop(ctx) })
	if err := o.Do("resume-vcpus", func(ctx context.Context) error { return m.Resume(ctx) }); err != nil {
		return "", nil, err
	}
	phase("resume vcpus")
	*guestStopped = time.Since(stopped)
	s.SnapshotID, s.BaseLayer = snapID, ""
	if err := o.Do("seat-overlay", func(context.Context) error { return n.seatSealedOverlay(s.ID, disk) }); err != nil {
		return "", nil, err
	}
	if err := o.Do("release-sealed", func(ctx context.Context) error {
		if _, err := m.ReleaseSealed(ctx); err != nil {
			return err
		}
		// What the snapshot promises: nothing the guest can reach
		// writes its disk any more.
		if w, err := vmm.WritableDescriptors(m.PID(), disk); err != nil || w > 0 {
			return fmt.Errorf("QEMU still holds %d writable descriptors of the sealed disk (%v)", w, err)
		}
		return nil
	}); err != nil {
		return "", nil, err
	}
	if err := n.syncState(o, sdir, &man); err != nil {
		return "", nil, err
	}
	phase("sync state")
	if err := o.Do("commit", func(context.Context) error {
		if err := storage.WriteJSONAtomic(filepath.Join(sdir, snapManifestName), man, 0o600); err != nil {
			return err
		}
		return storage.SyncDir(filepath.Dir(sdir))
	}); err != nil {
		return "", nil, err
	}
	phase("commit")
	o.Settle()
	n.log.Info("incremental snapshot, disk sealed", "sandbox", s.ID, "snapshot", snapID, "pages", man.DiffPages,
		"guest_stopped", guestStopped.Round(time.Microsecond), "phases", s.Phases)
	return snapID, lease, nil
}

// seatSealedOverlay makes the overlay a seal stacked the sandbox's
// (renamed over the sealed one, which the snapshot's directory names) and
// the sealed image read-only and root's (QEMU owned it when an older node
// started it).
func (n *Node) seatSealedOverlay(id, sealed string) error {
	pdir := n.sandboxDir(id)
	next := filepath.Join(pdir, nextOverlayName)
	if _, err := os.Stat(next); err == nil {
		if err := os.Rename(next, filepath.Join(pdir, overlayName)); err != nil {
			return err
		}
		if err := storage.SyncDir(pdir); err != nil {
			return err
		}
	}
	if err := os.Chown(sealed, 0, 0); err != nil {
		return err
	}
	return os.Chmod(sealed, 0o400)
}

// settleInterruptedSeal completes or undoes the seal of a live snapshot
// that a crash cut short, from what the sandbox's QEMU, alive, runs on:
// if its top is the next overlay, that becomes the sandbox's overlay;
// if not, the next overlay goes. The caller then points the record at
// what the overlay stacks on (pointAtOverlayBase) and, once the guest
// runs, releases the sealed images (vmm.Machine.ReleaseSealed).
func (n *Node) settleInterruptedSeal(ctx context.Context, s *sandboxes.Sandbox, m *vmm.Machine) {
	next := filepath.Join(n.sandboxDir(s.ID), nextOverlayName)
	if _, err := os.Stat(next); err != nil {
		return // no seal under way, or one already seated
	}
	top, err := m.TopIs(ctx, next)
	if err != nil {
		n.log.Error("settle an interrupted seal", "sandbox", s.ID, "err", err)
		return
	}
	if !top {
		_ = os.Remove(next)
		n.log.Warn("a seal cut short before QEMU switched: the new overlay is gone", "sandbox", s.ID)
		return
	}
	info, err := storage.Info(ctx, next)
	if err == nil {
		err = n.seatSealedOverlay(s.ID, info.BackingFilename)
	}
	if err != nil {
		n.log.Error("complete an interrupted seal", "sandbox", s.ID, "err", err)
		return
	}
	n.log.Warn("a seal cut short after QEMU switched: completed", "sandbox", s.ID, "sealed", info.BackingFilename)
}
