package orchestrator

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"

	"github.com/agentenv/agentenv/internal/sandboxes"
	"github.com/agentenv/agentenv/internal/storage"
	"github.com/agentenv/agentenv/internal/store"
	"github.com/agentenv/agentenv/internal/vmm"
)

// recover reconciles the database with what exists on the host after a
// restart: running sandboxes whose QEMU is still alive are re-adopted,
// sandboxes caught mid-operation are brought back to a stable state where
// their files allow it (recoverInterrupted) and removed otherwise, and
// anything on the host that no record owns (QEMU processes, namespaces,
// veths, directories, unused snapshots) is removed.
func (n *Node) recover(ctx context.Context) error {
	all, err := n.records.List(ctx, "")
	if err != nil {
		return err
	}
	// The volumes the sandboxes hold stay theirs (those of sandboxes
	// removed below are given back with them).
	n.holdRecordedVolumes(ctx, all)
	known := map[string]bool{}
	slots := map[string]bool{}
	for _, s := range all {
		switch s.State {
		case sandboxes.Running:
			m, err := vmm.Attach(ctx, n.sandboxDir(s.ID), n.logCap())
			if err == nil {
				n.adopt(s.ID, m)
				known[s.ID] = true
				slots[fmt.Sprint(s.Slot)] = true
				n.log.Info("re-adopted running sandbox", "sandbox", s.ID, "pid", m.PID())
				continue
			}
			n.log.Warn("running sandbox lost its QEMU; removing it", "sandbox", s.ID, "err", err)
		case sandboxes.Paused:
			// A crash between a pause's commit and its QEMU's exit leaves a
			// stopped QEMU behind.
			if m, err := vmm.Attach(ctx, n.sandboxDir(s.ID), n.logCap()); err == nil {
				_ = m.Kill()
			}
			known[s.ID] = true
			slots[fmt.Sprint(s.Slot)] = true
			continue
		case sandboxes.Pausing, sandboxes.Resuming, sandboxes.Forking, sandboxes.Snapshotting:
			// Interrupted in the middle of an operation: keep the sandbox in
			// the last state it can be trusted in.
			if to := n.recoverInterrupted(ctx, s); to != "" {
				known[s.ID] = true
				slots[fmt.Sprint(s.Slot)] = true
				n.log.Warn("sandbox was mid-operation at restart; recovered", "sandbox", s.ID, "was", s.State, "now", to)
				continue
			}
			n.log.Warn("sandbox was mid-operation at restart and cannot be recovered; removing it", "sandbox", s.ID, "state", s.State)
		default:
			n.log.Warn("sandbox was mid-operation at restart; removing it", "sandbox", s.ID, "state", s.State)
		}
		n.destroy(ctx, s)
	}

	// The guests' resolvers and egress proxies live in the node: start them
	// again for the sandboxes kept.
	for _, s := range all {
		if !known[s.ID] {
			continue
		}
		if ep, err := n.endpoint(s); err == nil && n.net.Exists(ep) {
			if err := n.net.Attach(ep); err != nil {
				n.log.Warn("guest resolver and egress proxy", "sandbox", s.ID, "err", err)
			}
		}
	}
	for pid, id := range vmm.Running(n.sandboxDir("")) {
		if !known[id] {
			n.log.Warn("killing orphaned QEMU", "pid", pid, "sandbox", id)
			vmm.KillStray(pid, n.sandboxDir(id))
		}
	}
	nss, err := n.net.Namespaces()
	if err != nil {
		return err
	}
	for _, ns := range nss {
		if id := n.net.NamespaceOwner(ns); !known[id] {
			n.log.Warn("removing orphaned network namespace", "netns", ns)
			if err := netns.DeleteNamed(ns); err != nil {
				n.log.Error("remove netns", "netns", ns, "err", err)
			}
		}
	}
	veths, err := n.net.HostVeths()
	if err != nil {
		return err
	}
	for _, v := range veths {
		if !slots[fmt.Sprint(n.net.VethSlot(v))] {
			if l, err := netlink.LinkByName(v); err == nil {
				n.log.Warn("removing orphaned veth", "veth", v)
				_ = netlink.LinkDel(l)
			}
		}
	}
	// Cgroups of sandboxes no record owns (their QEMU is gone: removal
	// fails while a process is inside).
	for _, name := range vmm.CgroupNames() {
		if id, ok := strings.CutPrefix(name, n.net.Instance()+"-"); ok && !known[id] {
			if err := vmm.RemoveCgroup(name); err == nil {
				n.log.Warn("removed an orphaned cgroup", "cgroup", name)
			}
		}
	}
	// Leases of operations the restart cut short end; what they and no one
	// else held goes, with the debris of unfinished snapshots.
	if err := n.store.Recover(ctx); err != nil {
		return err
	}
	ents, err := os.ReadDir(filepath.Join(n.cfg.DataDir, "sandboxes"))
	if err != nil {
		return err
	}
	for _, e := range ents {
		if !known[e.Name()] {
			n.log.Warn("removing orphaned sandbox files", "dir", e.Name())
			_ = os.RemoveAll(filepath.Join(n.cfg.DataDir, "sandboxes", e.Name()))
		}
	}
	return nil
}

// recoverInterrupted brings a sandbox whose operation was cut short by a
// crash back to a stable state and returns it ("" when nothing can be
// trusted): a paused sandbox if its saved state is complete, else a running
// one if its QEMU is still alive (vCPUs continued, envd re-initialised).
func (n *Node) recoverInterrupted(ctx context.Context, s *sandboxes.Sandbox) sandboxes.State {
	dir := n.sandboxDir(s.ID)
	if s.State == sandboxes.Pausing || s.State == sandboxes.Resuming {
		if rec, err := readPauseRecord(dir); err == nil && rec.matchesState(dir) == nil {
			m, aerr := vmm.Attach(ctx, dir, n.logCap())
			if aerr == nil && s.State == sandboxes.Resuming {
				// The resume got as far as a live QEMU: finish it. A QEMU
				// still stopped after the pause's save (postmigrate) is
				// its hot copy, which only the resume could check against
				// the pause on disk: the state on disk is trusted instead.
				if n.finishInterruptedResume(ctx, s, m, false) {
					return sandboxes.Running
				}
			} else if aerr == nil {
				_ = m.Kill()
			}
			set := "pid = 0"
			if rec.FilesystemOnly {
				set = setPausedWithoutMemory
			}
			if n.records.Move(ctx, s.ID, s.State, sandboxes.Paused, set) == nil {
				return sandboxes.Paused
			}
			return ""
		}
	}
	capture := s.State == sandboxes.Forking || s.State == sandboxes.Snapshotting
	// A freeze cut short names its snapshot in the record, held by the
	// capture's lease (leases end only after this recovery).
	freezing := capture && n.freezeInProgress(ctx, s)
	if m, err := vmm.Attach(ctx, dir, n.logCap()); err == nil {
		if freezing && n.frozenFiles(s) {
			// The files are the snapshot's now: the old QEMU must not run
			// on them again.
			_ = m.Kill()
		} else {
			// The QEMU lives and its files are its own: the capture is
			// dropped and the sandbox runs on, its record pointing back
			// at what its overlay stacks on.
			if capture {
				n.settleInterruptedSeal(ctx, s, m)
				n.pointAtOverlayBase(ctx, s)
			}
			if n.finishInterruptedResume(ctx, s, m, true) {
				if capture {
					if _, err := m.ReleaseSealed(ctx); err != nil {
						n.log.Error("release the sealed images of an interrupted capture", "sandbox", s.ID, "err", err)
					}
				}
				return sandboxes.Running
			}
		}
	}
	if freezing && n.recoverFreeze(ctx, s) {
		return sandboxes.Paused
	}
	return ""
}

// freezeInProgress reports whether s's record names the snapshot a freeze
// of s was assembling (not the one s was restored from, nor one a live
// capture sealed its disk into).
func (n *Node) freezeInProgress(ctx context.Context, s *sandboxes.Sandbox) bool {
	if s.SnapshotID == "" {
		return false
	}
	if leased, err := n.store.Leased(ctx, s.SnapshotID); err != nil || !leased {
		return false
	}
	// A live capture's snapshot (its state holds the changed RAM) may be
	// named too, by a seal: its sandbox ran on over a disk of its own and
	// must not be reset to the snapshot.
	var man snapshotManifest
	return storage.ReadJSON(filepath.Join(n.snapshotDir(s.SnapshotID), snapManifestName), &man) == nil && man.SandboxID == s.ID &&
		!man.StateHasRAM
}

// frozenFiles reports whether a freeze of s moved its disk (and RAM) into
// its snapshot already.
func (n *Node) frozenFiles(s *sandboxes.Sandbox) bool {
	if _, err := os.Stat(filepath.Join(n.snapshotDir(s.SnapshotID), snapDiskName)); err == nil {
		return true
	}
	_, err := os.Stat(filepath.Join(n.sandboxDir(s.ID), overlayName))
	return errors.Is(err, os.ErrNotExist)
}

// finishInterruptedResume continues a live machine and re-initialises envd.
// With afterSave a machine stopped after writing its state (postmigrate)
// runs on too: its files are its own (the operation that wrote the state
// never published it).
func (n *Node) finishInterruptedResume(ctx context.Context, s *sandboxes.Sandbox, m *vmm.Machine, afterSave bool) bool {
	if !continuable(ctx, m, afterSave) {
		n.log.Warn("the QEMU of an interrupted operation cannot run on", "sandbox", s.ID)
		_ = m.Kill()
		return false
	}
	if err := m.Resume(ctx); err != nil {
		_ = m.Kill()
		return false
	}
	// A state a cut pause was writing is no pause of this machine now.
	_ = os.Remove(filepath.Join(n.sandboxDir(s.ID), stateFileName+".tmp"))
	n.adopt(s.ID, m)
	ep, err := n.endpoint(s)
	if err == nil {
		ictx, cancel := context.WithTimeout(ctx, 30*time.Second)
		err = initEnvd(ictx, ep.GuestAddr(EnvdPort), s)
		cancel()
	}
	if err != nil {
		_ = n.stopMachine(s.ID)
		return false
	}
	return n.records.Move(ctx, s.ID, s.State, sandboxes.Running, "pid = ?", m.PID()) == nil
}

// pointAtOverlayBase makes a sandbox's record name what its disk overlay
// really stacks on (a capture cut short may have named its new snapshot).
func (n *Node) pointAtOverlayBase(ctx context.Context, s *sandboxes.Sandbox) {
	info, err := storage.Info(ctx, filepath.Join(n.sandboxDir(s.ID), overlayName))
	if err != nil || info.BackingFilename == "" {
		return
	}
	var base string
	if err := n.store.Tx(ctx, func(tx *sql.Tx) error {
		base = n.objectOfPath(ctx, tx, info.BackingFilename)
		return nil
	}); err != nil || base == "" {
		return
	}
	if o, err := n.store.Get(ctx, base); err == nil && o.Kind == store.KindSnapshot {
		s.SnapshotID, s.BaseLayer = base, ""
	} else {
		s.SnapshotID, s.BaseLayer = "", base
	}
	if err := n.records.Save(ctx, s); err != nil {
		n.log.Error("repoint an interrupted capture's record", "sandbox", s.ID, "err", err)
	}
}

// continuable tells whether a QEMU found alive after a crash holds a
// guest that can run on: running, its vCPUs stopped (paused), or, with
// afterSave, stopped after writing its state (postmigrate: a pause or a
// capture cut after its save; the continue reactivates its disks). A
// migration still being written (finish-migrate) is cancelled first and
// waited out. A QEMU waiting for a state (inmigrate, prelaunch) holds no
// guest yet.
func continuable(ctx context.Context, m *vmm.Machine, afterSave bool) bool {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	for cancelled := false; ; {
		st, err := m.Status(ctx)
		if err != nil {
			return false
		}
		switch st {
		case "running", "paused":
			return true
		case "postmigrate":
			return afterSave
		case "finish-migrate":
			if !cancelled {
				_ = m.CancelMigration(ctx)
				cancelled = true
			}
			select {
			case <-ctx.Done():
				return false
			case <-time.After(20 * time.Millisecond):
			}
		default:
			return false
		}
	}
}

// endInterruptedInternal kills the sandboxes the node ran for operations
// of its own (a template build's builder, a template snapshot's sandbox)
// that a restart interrupted: nothing drives them any more (their builds
// are recorded as failed), and they are hidden from listings, so they
// would run on until their timeout.
func (n *Node) endInterruptedInternal(ctx context.Context) {
	all, err := n.records.List(ctx, "")
	if err != nil {
		n.log.Error("list sandboxes", "err", err)
		return
	}
	for _, s := range all {
		if !s.Internal() {
			continue
		}
		if err := n.kill(ctx, s.ID); err != nil {
			n.log.Error("end the sandbox of an interrupted operation", "sandbox", s.ID, "for", s.Metadata[sandboxes.MetaInternal], "err", err)
			continue
		}
		n.log.Info("ended the sandbox of an interrupted operation", "sandbox", s.ID, "for", s.Metadata[sandboxes.MetaInternal])
	}
}
