package orchestrator

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"errors"
	"fmt"
	"github.com/agentenv/agentenv/internal/idempotency"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/agentenv/agentenv/internal/faults"
	"github.com/agentenv/agentenv/internal/operation"
	"github.com/agentenv/agentenv/internal/sandboxes"
	"github.com/agentenv/agentenv/internal/storage"
	"github.com/agentenv/agentenv/internal/store"
	"github.com/agentenv/agentenv/internal/vmm"
)

// MaxForkChildren bounds one fork.
const MaxForkChildren = 16

// Files of a snapshot, in <data>/snapshots/<id>/.
const (
	snapshotsDir     = store.SnapshotsDir
	snapMemName      = "memory"
	snapDiskName     = "disk.qcow2"
	snapStateName    = "devices.vmstate"
	snapManifestName = "manifest.json"
)

// ForkResult is one child of a fork: the sandbox, or why it failed.
type ForkResult struct {
	Sandbox *sandboxes.Sandbox
	Err     error
}

// snapshotManifest records a frozen sandbox image; it is written last.
type snapshotManifest struct {
	ID          string    `json:"id"`
	SandboxID   string    `json:"sandboxID"`
	TemplateID  string    `json:"templateID"`
	ParentLayer string    `json:"parentLayer"`
	MemoryMiB   int       `json:"memoryMiB"`
	StateSHA256 string    `json:"stateSHA256"`
	CreatedAt   time.Time `json:"createdAt"`
	// MemoryBase names the snapshot whose RAM image this one's memory is
	// relative to (an incremental snapshot: the state file carries the pages
	// that differ from that image). Empty: the snapshot has its own image.
	MemoryBase string `json:"memoryBase,omitempty"`
	// StateHasRAM: the state file carries the pages that differ from the
	// RAM image (always so with a MemoryBase; imported incremental
	// snapshots have their base image beside them).
	StateHasRAM bool `json:"stateHasRAM,omitempty"`
	// DiffPages is how many pages of RAM an incremental snapshot wrote.
	DiffPages int64 `json:"diffPages,omitempty"`
	// FilesystemOnly: the snapshot is a disk (and volumes) alone, with no
	// memory or device state.
	FilesystemOnly bool `json:"filesystemOnly,omitempty"`
	// GatewayMAC is the MAC of the tap the captured guest ran behind (see
	// tapModeFor); empty in snapshots made before it was kept, and in
	// imported ones.
	GatewayMAC string `json:"gatewayMAC,omitempty"`
}

func (n *Node) snapshotDir(id string) string { return filepath.Join(n.cfg.DataDir, snapshotsDir, id) }

// snapshotRAM tells how a snapshot's memory is restored: image is the RAM
// image to map, and with stateHasRAM the state file holds the pages that
// differ from it.
func (n *Node) snapshotRAM(snapID string) (image string, stateHasRAM bool, err error) {
	var m snapshotManifest
	if err := storage.ReadJSON(filepath.Join(n.snapshotDir(snapID), snapManifestName), &m); err != nil {
		return "", false, fmt.Errorf("%w: snapshot %s manifest: %v", ErrCorrupt, snapID, err)
	}
	owner := snapID
	if m.MemoryBase != "" {
		owner = m.MemoryBase
	}
	return filepath.Join(n.snapshotDir(owner), snapMemName), m.StateHasRAM || m.MemoryBase != "", nil
}

// verifySnapshotState checks a snapshot's state file against the checksum
// in its manifest.
func (n *Node) verifySnapshotState(snapID string) error {
	sdir := n.snapshotDir(snapID)
	var m snapshotManifest
	if err := storage.ReadJSON(filepath.Join(sdir, snapManifestName), &m); err != nil {
		return fmt.Errorf("%w: snapshot %s manifest: %v", ErrCorrupt, snapID, err)
	}
	sum, err := store.FileSHA256(filepath.Join(sdir, snapStateName))
	if err != nil {
		return fmt.Errorf("%w: snapshot %s state: %v", ErrCorrupt, snapID, err)
	}
	if sum != m.StateSHA256 {
		return fmt.Errorf("%w: snapshot %s state checksum mismatch (%s, recorded %s)", ErrCorrupt, snapID, sum, m.StateSHA256)
	}
	return nil
}

// storeRefs are the store objects a sandbox is made of: the snapshot or
// layer its disk overlay stacks on, and the snapshot whose RAM image its
// memory maps.
func (n *Node) storeRefs(s *sandboxes.Sandbox) []string {
	base := s.SnapshotID
	if base == "" {
		base = s.BaseLayer
	}
	return []string{base, n.memoryBaseOf(s)}
}

// memoryBaseOf names the snapshot whose RAM image a copy-on-write sandbox
// maps ("" if it maps none).
func (n *Node) memoryBaseOf(s *sandboxes.Sandbox) string {
	if !s.MemPrivate || s.MemFile == "" {
		return ""
	}
	root := filepath.Join(n.cfg.DataDir, snapshotsDir)
	if filepath.Dir(filepath.Dir(s.MemFile)) != root || filepath.Base(s.MemFile) != snapMemName {
		return ""
	}
	return filepath.Base(filepath.Dir(s.MemFile))
}

// runOnSnapshot makes a sandbox's record point at a snapshot it now runs
// on (its disk stacks on the snapshot's and its RAM maps the snapshot's
// image copy-on-write), with its references, in one transaction.
func (n *Node) runOnSnapshot(ctx context.Context, s *sandboxes.Sandbox, snapID string) error {
	image, _, err := n.snapshotRAM(snapID)
	if err != nil {
		return err
	}
	next := *s
	next.SnapshotID, next.BaseLayer, next.MemFile, next.MemPrivate, next.PID = snapID, "", image, true, 0
	if err := n.records.Save(ctx, &next); err != nil {
		return err
	}
	s.SnapshotID, s.BaseLayer, s.MemFile, s.MemPrivate, s.PID = snapID, "", image, true, 0
	return nil
}

// newSnapshot names a snapshot about to be assembled from s and records it
// in the store, needing what s is made of and held by a lease (until a
// record refers to it), before its directory exists.
func (n *Node) newSnapshot(ctx context.Context, purpose string, needs ...string) (string, *store.Lease, error) {
	id := "snap-" + randomHex(10)
	lease, err := n.store.NewLease(ctx, purpose, n.cfg.OperationTimeout+operation.CleanupTimeout)
	if err != nil {
		return "", nil, err
	}
	err = n.store.Tx(ctx, func(tx *sql.Tx) error {
		if err := n.store.Add(tx, id, store.KindSnapshot, n.snapshotDir(id), needs...); err != nil {
			return err
		}
		return lease.Hold(tx, id)
	})
	if err != nil {
		lease.Drop(context.WithoutCancel(ctx))
		return "", nil, err
	}
	return id, lease, nil
}

// Fork clones a running sandbox into count children on this node. The parent
// is paused while its RAM file, disk and device state are frozen into a
// snapshot; then the parent and every child are restored from that snapshot,
// each mapping the frozen RAM copy-on-write (so unchanged pages are shared
// through the page cache) over a disk overlay of its own. Children inherit
// processes, files, cpu/memory, env vars and metadata, and get their own id,
// access token, network namespace and fresh entropy. The fork runs to its
// end whatever the caller does; the parent is never lost: when it cannot
// run on, it rests paused at the instant of the fork.
func (n *Node) fork(ctx context.Context, id string, count int, timeout time.Duration) ([]ForkResult, error) {
	if count < 1 || count > MaxForkChildren {
		return nil, fmt.Errorf("%w: count must be between 1 and %d", ErrInvalid, MaxForkChildren)
	}
	if timeout == 0 {
		timeout = n.cfg.DefaultTimeout
	}
	if timeout < 0 || timeout > n.cfg.MaxTimeout {
		return nil, fmt.Errorf("%w: timeout must be between 1s and %s", ErrInvalid, n.cfg.MaxTimeout)
	}
	parent, err := n.records.Get(ctx, id)
	if err != nil {
		return nil, err
	}
	ticket, err := n.admit(ctx, fmt.Sprintf("a fork into %d", count), count, parent.MemoryMiB)
	if err != nil {
		return nil, err
	}
	defer ticket.Done()
	c, err := n.capture(ctx, "fork", id, count, timeout, sandboxes.Forking)
	if c != nil && c.lease != nil {
		// The children's records refer to the snapshot now.
		c.lease.Drop(context.WithoutCancel(ctx))
	}
	if c == nil {
		return nil, err
	}
	if err == nil {
		// The parent runs on a memory base now: machines can wait for the
		// children of its next fork.
		if p, gerr := n.records.Get(context.WithoutCancel(ctx), id); gerr == nil && p.State == sandboxes.Running {
			n.registerFork(context.WithoutCancel(ctx), p)
		}
	}
	return c.children, err
}

// captured is what capture made.
type captured struct {
	snapID   string
	children []ForkResult
	// lease holds the snapshot until the caller's record refers to it.
	lease *store.Lease
	// guestStopped is how long a live capture stopped the guest's vCPUs
	// (0: not live; the guest ran again only with its restore).
	guestStopped time.Duration
}

// capture freezes a running sandbox into a snapshot, brings it back, and
// restores count children from the same snapshot; opState is the state the
// sandbox shows meanwhile. It runs as operation opName, detached from ctx.
// On success (and when only the parent's restore failed) the snapshot is
// held by the returned lease, which the caller drops once a record refers
// to the snapshot.
func (n *Node) capture(ctx context.Context, opName, id string, count int, timeout time.Duration, opState sandboxes.State) (*captured, error) {
	s, err := n.records.Get(ctx, id)
	if err != nil {
		return nil, err
	}
	if !s.State.Resting() {
		return nil, sandboxes.Busy(s)
	}
	if s.State != sandboxes.Running {
		return nil, fmt.Errorf("%w: sandbox %s is %s; only running sandboxes can be forked or snapshotted (resume it first)", ErrConflict, id, s.State)
	}
	unlock := n.lockOp(id)
	defer unlock()
	o := operation.Start(ctx, opName, n.cfg.OperationTimeout, n.log)
	octx := o.Context()
	if s, err = n.records.Get(octx, id); err != nil {
		return nil, o.Finish(err)
	}
	if err := n.records.Move(octx, id, sandboxes.Running, opState, ""); err != nil {
		return nil, o.Finish(err)
	}
	n.resumeOnFailure(o, s, opState)
	start := time.Now()
	// A copy-on-write parent is captured without a restart; any other has
	// its RAM file frozen and is restored from the snapshot with the
	// children.
	live := n.canSnapshotLive(s)
	var guestStopped time.Duration
	var snap string
	var lease *store.Lease
	if live {
		snap, lease, err = n.snapshotLive(o, s, opState, &guestStopped)
	} else {
		snap, lease, err = n.freeze(o, s, opState)
	}
	if err != nil {
		n.log.Error(opName+": capturing the sandbox failed", "sandbox", id, "err", err)
		return nil, o.Finish(fmt.Errorf("%s %s: %w", opName, id, err))
	}
	frozen := time.Since(start)
	faults.Point(faults.ForkFrozen)
	c := &captured{snapID: snap, lease: lease, children: make([]ForkResult, count), guestStopped: guestStopped}

	// Restore the parent and the children from the snapshot in parallel.
	var wg sync.WaitGroup
	// The children are made from the parent's record as it is now (the
	// parent's restore changes its copy meanwhile).
	model := *s
	model.Phases = nil
	// Children of a fork whose disk stacks on its memory base's take the
	// machines pre-started for it, as far as there are any.
	var stack *forkStack
	var pre []*pooledSandbox
	if count > 0 {
		if stack = n.forkStackOf(octx, s, snap); stack != nil {
			pre = n.takeForkMachines(&model, stack, count)
		}
	}
	var parentErr error
	if !live {
		wg.Add(1)
		go func() {
			defer wg.Done()
			parentErr = o.Do("restore-parent", func(ctx context.Context) error {
				return n.restoreFromSnapshot(ctx, s, snap, s.AccessToken, false)
			})
		}()
	}
	atOnce := count
	if n.cfg.ForkRestores > 0 {
		atOnce = min(count, n.cfg.ForkRestores)
	}
	bound := make(chan struct{}, max(1, atOnce))
	for i := range c.children {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			bound <- struct{}{}
			defer func() { <-bound }()
			var e *pooledSandbox
			if i < len(pre) {
				e = pre[i]
			}
			c.children[i] = n.forkChild(o, &model, snap, timeout, e, stack)
		}(i)
	}
	wg.Wait()
	if parentErr != nil {
		// The parent rests at the instant of the capture, in the snapshot.
		n.log.Error(opName+": restoring the sandbox failed; it rests paused at the snapshot", "sandbox", id, "err", parentErr)
		_ = n.stopMachine(id)
		if err := n.restOnSnapshot(context.WithoutCancel(octx), s, snap, opState); err != nil {
			// Left in its operation state, naming the snapshot: the node's
			// next start completes it (recoverFreeze).
			n.log.Error(opName+": could not record the sandbox as paused; the node's next start does", "sandbox", id, "err", err)
			parentErr = fmt.Errorf("%w (and recording it paused failed: %v)", parentErr, err)
		}
		// The fork failed: its children go (nothing of them was the user's).
		for _, r := range c.children {
			if r.Sandbox != nil {
				n.destroy(context.WithoutCancel(octx), r.Sandbox)
			}
		}
		c.children = nil
		return c, o.Finish(fmt.Errorf("%s %s: the sandbox could not run on after the capture and is paused (resume it): %w", opName, id, parentErr))
	}
	// (On a context of its own: the operation's time may have run out while
	// the children restored.)
	if err := n.records.Move(context.WithoutCancel(octx), id, opState, sandboxes.Running, ""); err != nil {
		return c, o.Finish(err)
	}
	s.State = sandboxes.Running
	n.log.Info("sandbox captured", "op", opName, "sandbox", id, "snapshot", snap, "children", count,
		"freeze", frozen.Round(time.Microsecond), "total", time.Since(start).Round(time.Millisecond))
	return c, o.Finish(nil)
}

// alive reports whether a machine's QEMU still runs.
func alive(m *vmm.Machine) bool {
	if m == nil {
		return false
	}
	select {
	case <-m.Exited():
		return false
	default:
		return true
	}
}

// resumeOnFailure pushes the cleanup that puts a sandbox whose vCPUs an
// operation stopped back to running; when its QEMU died meanwhile, nothing
// of it can run again and it is removed as a crashed machine would be.
func (n *Node) resumeOnFailure(o *operation.Op, s *sandboxes.Sandbox, from sandboxes.State) {
	o.OnFailure("run the sandbox on", func(ctx context.Context) error {
		if m := n.machines.get(s.ID); alive(m) {
			if err := m.Resume(ctx); err == nil {
				return n.records.Move(ctx, s.ID, from, sandboxes.Running, "")
			}
		}
		n.machineLost(ctx, s, from)
		return nil
	})
}

// machineLost removes a sandbox whose QEMU died in the middle of an
// operation before its state was saved anywhere: like a guest that crashed,
// nothing of it can run again.
func (n *Node) machineLost(ctx context.Context, s *sandboxes.Sandbox, from sandboxes.State) {
	n.log.Error("the sandbox's QEMU died before its state was saved; removing it", "sandbox", s.ID, "during", from)
	if err := n.records.Move(ctx, s.ID, from, sandboxes.Killing, ""); err != nil {
		n.log.Error("record a lost sandbox", "sandbox", s.ID, "err", err)
	}
	n.destroy(ctx, s)
}

// freeze stops a sandbox that has a RAM file of its own (its caller has
// registered the cleanup that runs it on), saves its device
// state and turns its RAM file and disk overlay into a read-only (full)
// snapshot; its QEMU exits. Its record then points at the snapshot: it
// runs on, and resumes, from it, mapping its RAM image copy-on-write.
// (Copy-on-write sandboxes are captured by snapshotLive.) Before QEMU
// exits a failure puts the sandbox back to running; after, the freeze is
// completed as far as it needs to be for the sandbox to rest paused on the
// snapshot.
func (n *Node) freeze(o *operation.Op, s *sandboxes.Sandbox, opState sandboxes.State) (string, *store.Lease, error) {
	ctx := o.Context()
	m := n.machines.get(s.ID)
	if !alive(m) {
		return "", nil, errors.New("no running machine")
	}
	if s.MemPrivate {
		return "", nil, fmt.Errorf("sandbox %s has no RAM file of its own to freeze", s.ID)
	}
	pdir := n.sandboxDir(s.ID)
	var snapID string
	var lease *store.Lease
	prev := *s
	// Record the snapshot before touching anything: the store keeps it, and
	// the sandbox's record names it, so that a restart after a crash from
	// here on can rebuild the sandbox from the snapshot's files
	// (recoverFreeze).
	if err := o.Do("record-snapshot", func(ctx context.Context) error {
		var err error
		if snapID, lease, err = n.newSnapshot(ctx, o.Name()+" of "+s.ID, n.storeRefs(s)...); err != nil {
			return err
		}
		sdir := n.snapshotDir(snapID)
		if err := os.MkdirAll(sdir, 0o700); err != nil {
			return err
		}
		before, err := storage.Info(ctx, filepath.Join(pdir, overlayName))
		if err != nil {
			return err
		}
		early := snapshotManifest{ID: snapID, SandboxID: s.ID, TemplateID: s.TemplateID,
			ParentLayer: before.BackingFilename, MemoryMiB: s.MemoryMiB, CreatedAt: time.Now().UTC(), GatewayMAC: n.gatewayMAC(s)}
		if err := storage.WriteJSONAtomic(filepath.Join(sdir, snapManifestName), early, 0o600); err != nil {
			return err
		}
		next := *s
		next.SnapshotID = snapID
		return n.records.Save(ctx, &next)
	}); err != nil {
		if lease != nil {
			lease.Drop(context.WithoutCancel(ctx))
		}
		return "", nil, err
	}
	o.OnFailure("forget the snapshot", func(ctx context.Context) error {
		if err := lease.Drop(ctx); err != nil {
			return err
		}
		n.gc(ctx)
		return nil
	})
	o.OnFailure("the sandbox's record as it was", func(ctx context.Context) error {
		cur, err := n.records.Get(ctx, s.ID)
		if err != nil || cur.SnapshotID != snapID || cur.MemPrivate {
			return err // the freeze went further: restOnSnapshot settled it
		}
		p := prev
		return n.records.Save(ctx, &p)
	})
	sdir := n.snapshotDir(snapID)
	if err := o.Do("stop-vcpus", func(ctx context.Context) error { return m.Pause(ctx) }); err != nil {
		return "", nil, err
	}
	if err := o.Do("save-state", func(ctx context.Context) error {
		// Under a temporary name until complete: a state file under its
		// own name is always whole.
		tmp := filepath.Join(sdir, snapStateName+".tmp")
		if err := m.SaveState(ctx, tmp); err != nil {
			return err
		}
		if err := storage.SyncFile(tmp); err != nil {
			return err
		}
		return os.Rename(tmp, filepath.Join(sdir, snapStateName))
	}); err != nil {
		return "", nil, err
	}
	// The state is saved: from here the sandbox's state is the snapshot's,
	// and a failure completes the freeze (restOnSnapshot) rather than undo
	// it. When even that fails, the sandbox stays in its operation state,
	// its record naming the snapshot (held by a lease until the restart,
	// and by the record after), and the node's start completes the freeze
	// (recoverFreeze): nothing is given up.
	o.Settle()
	err := n.stopMachine(s.ID)
	if err == nil {
		err = n.finishFreeze(o, s, snapID)
	}
	if err == nil {
		err = n.runOnSnapshot(ctx, s, snapID)
	}
	if err != nil {
		n.log.Error("freeze failed after the sandbox's state was saved; completing it", "sandbox", s.ID, "err", err)
		if rerr := n.restOnSnapshot(context.WithoutCancel(ctx), s, snapID, opState); rerr != nil {
			n.log.Error("complete an interrupted freeze; the node's next start completes it", "sandbox", s.ID, "err", rerr)
			return "", nil, fmt.Errorf("%w; the sandbox could not be completed as paused (%v): it is kept as it is until the node restarts", err, rerr)
		}
		// Resting paused on the snapshot, held by its record.
		lease.Drop(context.WithoutCancel(ctx))
		return "", nil, fmt.Errorf("%w; the sandbox is paused at the snapshot (resume it)", err)
	}
	return snapID, lease, nil
}

// finishFreeze moves a stopped sandbox's disk overlay and RAM file into its
// snapshot, read-only, and completes the snapshot's manifest.
func (n *Node) finishFreeze(o *operation.Op, s *sandboxes.Sandbox, snapID string) error {
	pdir, sdir := n.sandboxDir(s.ID), n.snapshotDir(snapID)
	moves := [][2]string{
		{filepath.Join(pdir, overlayName), filepath.Join(sdir, snapDiskName)},
		{filepath.Join(pdir, memFileName), filepath.Join(sdir, snapMemName)},
	}
	// The disk is made durable (the state was as it was saved); a RAM image
	// is left to the kernel's writeback, so that freezing stays cheap (a
	// paused sandbox syncs its RAM file; a named snapshot's durable copy is
	// the one committed to the repository).
	if err := o.Do("sync", func(context.Context) error { return storage.SyncFile(moves[0][0]) }); err != nil {
		return err
	}
	// The volumes as the saved state has them mounted, for the children.
	if err := o.Do("copy-volumes", func(context.Context) error { return n.copyVolumes(s, sdir) }); err != nil {
		return err
	}
	if err := o.Do("move-files", func(context.Context) error {
		for _, mv := range moves {
			if err := os.Rename(mv[0], mv[1]); err != nil {
				return fmt.Errorf("freeze %s: %w", filepath.Base(mv[0]), err)
			}
			if err := os.Chmod(mv[1], 0o400); err != nil {
				return err
			}
		}
		return nil
	}); err != nil {
		return err
	}
	return o.Do("manifest", func(ctx context.Context) error { return n.completeManifest(ctx, snapID) })
}

// completeManifest records a frozen snapshot's state checksum and disk
// layer in its manifest.
func (n *Node) completeManifest(ctx context.Context, snapID string) error {
	sdir := n.snapshotDir(snapID)
	var man snapshotManifest
	if err := storage.ReadJSON(filepath.Join(sdir, snapManifestName), &man); err != nil {
		return err
	}
	sum, err := store.FileSHA256(filepath.Join(sdir, snapStateName))
	if err != nil {
		return err
	}
	info, err := storage.Info(ctx, filepath.Join(sdir, snapDiskName))
	if err != nil {
		return err
	}
	man.ParentLayer, man.StateSHA256 = info.BackingFilename, sum
	return storage.WriteJSONAtomic(filepath.Join(sdir, snapManifestName), man, 0o600)
}

// recoverFreeze rebuilds, as a paused sandbox, a sandbox whose fork or
// snapshot was cut short by a crash after its state was saved. It returns
// false when the saved state is not there.
func (n *Node) recoverFreeze(ctx context.Context, s *sandboxes.Sandbox) bool {
	if s.SnapshotID == "" {
		return false
	}
	if err := n.restOnSnapshot(ctx, s, s.SnapshotID, s.State); err != nil {
		n.log.Error("recover frozen sandbox", "sandbox", s.ID, "err", err)
		return false
	}
	return true
}

// restOnSnapshot completes what a freeze of s into snapID left undone
// (moving what was not moved yet; a snapshot taken live has nothing to
// move) and leaves s paused on the snapshot: a fresh overlay on its disk,
// its state as the paused state, its record pointing at it and moved from
// state from to paused.
func (n *Node) restOnSnapshot(ctx context.Context, s *sandboxes.Sandbox, snapID string, from sandboxes.State) error {
	if err := faults.Check(ctx, "rest-on-snapshot"); err != nil {
		return err
	}
	sdir, pdir := n.snapshotDir(snapID), n.sandboxDir(s.ID)
	exists := func(p string) bool { _, err := os.Stat(p); return err == nil }
	var man snapshotManifest
	if err := storage.ReadJSON(filepath.Join(sdir, snapManifestName), &man); err != nil || !exists(filepath.Join(sdir, snapStateName)) {
		return fmt.Errorf("snapshot %s has no saved state", snapID)
	}
	moves := [][2]string{{filepath.Join(pdir, overlayName), filepath.Join(sdir, snapDiskName)}}
	if man.MemoryBase == "" && !man.StateHasRAM {
		moves = append(moves, [2]string{filepath.Join(pdir, memFileName), filepath.Join(sdir, snapMemName)})
	}
	for _, mv := range moves {
		if !exists(mv[1]) {
			if err := os.Rename(mv[0], mv[1]); err != nil {
				return fmt.Errorf("move %s: %w", filepath.Base(mv[0]), err)
			}
			if err := os.Chmod(mv[1], 0o400); err != nil {
				return err
			}
		}
	}
	if man.StateSHA256 == "" {
		if err := n.completeManifest(ctx, snapID); err != nil {
			return err
		}
	}
	// The sandbox gets a fresh overlay on the frozen disk.
	_ = os.Remove(filepath.Join(pdir, overlayName))
	if err := storage.CreateOverlay(ctx, filepath.Join(sdir, snapDiskName), filepath.Join(pdir, overlayName), 0); err != nil {
		return err
	}
	sum, err := store.FileSHA256(filepath.Join(sdir, snapStateName))
	if err != nil {
		return err
	}
	_ = os.Remove(filepath.Join(pdir, stateFileName))
	if _, err := storage.CloneFile(filepath.Join(sdir, snapStateName), filepath.Join(pdir, stateFileName)); err != nil {
		return err
	}
	_, hasRAM, err := n.snapshotRAM(snapID)
	if err != nil {
		return err
	}
	rec := pauseRecord{StateSHA256: sum, RAMInState: hasRAM, RAMDiff: hasRAM, PausedAt: time.Now().UTC(), GatewayMAC: man.GatewayMAC}
	if err := storage.WriteJSONAtomic(filepath.Join(pdir, pauseRecordName), rec, 0o600); err != nil {
		return err
	}
	if err := n.runOnSnapshot(ctx, s, snapID); err != nil {
		return err
	}
	if err := n.records.Move(ctx, s.ID, from, sandboxes.Paused, "pid = 0"); err != nil {
		return err
	}
	s.State, s.PID = sandboxes.Paused, 0
	return nil
}

// copySnapshotRAM gives a sandbox its own RAM file, a copy of a snapshot's
// frozen image (a reflink where the filesystem can).
func (n *Node) copySnapshotRAM(snapID, sandboxID string) error {
	src := filepath.Join(n.snapshotDir(snapID), snapMemName)
	if _, err := storage.CloneFile(src, filepath.Join(n.sandboxDir(sandboxID), memFileName)); err != nil {
		return fmt.Errorf("copy RAM image of snapshot %s: %w", snapID, err)
	}
	return nil
}

// restoreFromSnapshot starts s from a snapshot: a fresh overlay on the
// snapshot's disk, RAM mapped copy-on-write from its memory image, device
// state loaded, vCPUs resumed, envd re-initialised (authenticated with
// authToken, the token the snapshot's envd knows).
func (n *Node) restoreFromSnapshot(ctx context.Context, s *sandboxes.Sandbox, snapID, authToken string, reseed bool) error {
	if err := n.verifySnapshotState(snapID); err != nil {
		return err
	}
	phase := s.PhaseTimer()
	m, err := n.startIncoming(ctx, s, snapID, false)
	if err != nil {
		return err
	}
	phase("overlay, network, start qemu")
	return n.finishRestore(ctx, s, m, snapID, authToken, reseed)
}

// startIncoming prepares everything of s but the guest itself: its disk
// overlay on the snapshot's layer, its network, and a QEMU waiting for the
// snapshot's device state. The pool of pre-started sandboxes stops here.
// An idle machine (one the fork pool starts ahead of need) runs under
// SCHED_IDLE until it is claimed.
func (n *Node) startIncoming(ctx context.Context, s *sandboxes.Sandbox, snapID string, idle bool) (*vmm.Machine, error) {
	dir := n.sandboxDir(s.ID)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	overlay := filepath.Join(dir, overlayName)
	_ = os.Remove(overlay)
	if err := storage.CreateOverlay(ctx, filepath.Join(n.snapshotDir(snapID), snapDiskName), overlay, 0); err != nil {
		return nil, err
	}
	if err := n.volumeOverlays(ctx, s, snapID); err != nil {
		return nil, err
	}
	ep, err := n.endpoint(s)
	if err != nil {
		return nil, err
	}
	var man snapshotManifest // its gateway MAC; unread, the guest is asked
	_ = storage.ReadJSON(filepath.Join(n.snapshotDir(snapID), snapManifestName), &man)
	tap, err := n.openTap(ctx, ep, tapModeFor(man.GatewayMAC))
	if err != nil {
		return nil, err
	}
	defer tap.Close()
	cfg := n.vmConfig(s, tap, true)
	cfg.Idle = idle
	m, err := vmm.Start(ctx, cfg)
	if err != nil {
		return nil, err
	}
	n.adopt(s.ID, m)
	s.PID = m.PID()
	if err := n.records.Set(ctx, s.ID, "pid = ?", m.PID()); err != nil {
		return m, err
	}
	return m, nil
}

// finishRestore loads the snapshot's device state into a machine from
// startIncoming, runs it and initialises its envd.
func (n *Node) finishRestore(ctx context.Context, s *sandboxes.Sandbox, m *vmm.Machine, snapID, authToken string, reseed bool) error {
	phase := s.PhaseTimer()
	_, hasRAM, err := n.snapshotRAM(snapID)
	if err != nil {
		return err
	}
	load := m.LoadState
	if hasRAM {
		load = m.LoadFullState
	}
	if err := load(ctx, filepath.Join(n.snapshotDir(snapID), snapStateName)); err != nil {
		return err
	}
	phase("load state")
	if err := m.Resume(ctx); err != nil {
		return err
	}
	phase("resume vcpus")
	ep, err := n.endpoint(s)
	if err != nil {
		return err
	}
	if err := initEnvdAs(ctx, ep.GuestAddr(EnvdPort), s, authToken, reseed); err != nil {
		return err
	}
	phase("envd init")
	return nil
}

// forkChild restores one child of parent from snapshot snapID. A child
// that fails is removed: it is new, and nothing of it was the user's.
func (n *Node) forkChild(o *operation.Op, parent *sandboxes.Sandbox, snapID string, timeout time.Duration, pre *pooledSandbox, stack *forkStack) ForkResult {
	ctx := o.Context()
	now := time.Now().UTC().Truncate(time.Millisecond)
	c := *parent
	c.ID = NewSandboxID()
	c.State = sandboxes.Creating
	c.Request = idempotency.RequestOf(ctx)
	c.PID = 0
	c.TrafficToken = newToken()
	if parent.Secure {
		c.AccessToken = newToken()
	}
	c.CreatedAt, c.StartedAt, c.EndAt = now, now, now.Add(timeout)
	c.Phases = nil
	image, _, err := n.snapshotRAM(snapID)
	if err != nil {
		if pre != nil { // taken from the pool, and nobody's now
			forkStarter{n}.Discard(context.WithoutCancel(ctx), pre)
		}
		return ForkResult{Err: err}
	}
	c.SnapshotID, c.BaseLayer, c.MemFile, c.MemPrivate = snapID, "", image, true
	c.Volumes = asCopies(parent.Volumes) // the parent keeps the volumes
	if pre != nil {
		// A pre-started machine becomes the child: it keeps its id,
		// network slot and QEMU, and takes everything else.
		c.ID, c.Slot, c.PID = pre.s.ID, pre.s.Slot, pre.s.PID
	}
	unlock := n.lockOp(c.ID)
	defer unlock()
	if err := o.Do("record-child", func(ctx context.Context) error {
		if pre == nil {
			return n.records.InsertNew(ctx, &c)
		}
		if err := n.records.Move(ctx, c.ID, sandboxes.Pooled, sandboxes.Creating, ""); err != nil {
			return err
		}
		return n.records.Save(ctx, &c)
	}); err != nil {
		if pre != nil {
			n.destroy(context.WithoutCancel(ctx), &c)
		}
		return ForkResult{Err: err}
	}
	if pre != nil {
		err = o.Do("claim-prestarted", func(ctx context.Context) error {
			return n.claimForkMachine(ctx, &c, pre, stack, snapID, parent.AccessToken)
		})
	} else {
		err = o.Do("restore-child", func(ctx context.Context) error {
			return n.restoreFromSnapshot(ctx, &c, snapID, parent.AccessToken, true)
		})
	}
	if err == nil {
		err = n.records.Move(ctx, c.ID, sandboxes.Creating, sandboxes.Running, "")
	}
	if err != nil {
		n.destroy(context.WithoutCancel(ctx), &c)
		return ForkResult{Err: err}
	}
	c.State = sandboxes.Running
	n.log.Info("fork child restored", "sandbox", c.ID, "parent", parent.ID, "phases", c.Phases)
	return ForkResult{Sandbox: n.withAddr(&c)}
}

func randomHex(n int) string {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		panic(err)
	}
	return hex.EncodeToString(b)
}
