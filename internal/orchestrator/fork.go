package orchestrator

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/agentenv/agentenv/internal/faults"
	"github.com/agentenv/agentenv/internal/storage"
	"github.com/agentenv/agentenv/internal/vmm"
)

// MaxForkChildren bounds one fork.
const MaxForkChildren = 16

// Files of a fork snapshot, in <data>/snapshots/<id>/.
const (
	snapshotsDir     = "snapshots"
	snapMemName      = "memory"
	snapDiskName     = "disk.qcow2"
	snapStateName    = "devices.vmstate"
	snapManifestName = "manifest.json"
)

// ForkResult is one child of a fork: the sandbox, or why it failed.
type ForkResult struct {
	Sandbox *Sandbox
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
}

// snapshotRAM tells how a snapshot's memory is restored: image is the RAM
// image to map, and with stateHasRAM the state file holds the pages that
// differ from it.
func (n *Node) snapshotRAM(snapID string) (image string, stateHasRAM bool, err error) {
	var m snapshotManifest
	if err := readJSON(filepath.Join(n.cfg.DataDir, snapshotsDir, snapID, snapManifestName), &m); err != nil {
		return "", false, fmt.Errorf("%w: snapshot %s manifest: %v", ErrCorrupt, snapID, err)
	}
	owner := snapID
	if m.MemoryBase != "" {
		owner = m.MemoryBase
	}
	return filepath.Join(n.cfg.DataDir, snapshotsDir, owner, snapMemName), m.StateHasRAM || m.MemoryBase != "", nil
}

// verifySnapshotState checks a snapshot's state file against the checksum
// in its manifest.
func (n *Node) verifySnapshotState(snapID string) error {
	sdir := filepath.Join(n.cfg.DataDir, snapshotsDir, snapID)
	var m snapshotManifest
	if err := readJSON(filepath.Join(sdir, snapManifestName), &m); err != nil {
		return fmt.Errorf("%w: snapshot %s manifest: %v", ErrCorrupt, snapID, err)
	}
	sum, err := fileSHA256(filepath.Join(sdir, snapStateName))
	if err != nil {
		return fmt.Errorf("%w: snapshot %s state: %v", ErrCorrupt, snapID, err)
	}
	if sum != m.StateSHA256 {
		return fmt.Errorf("%w: snapshot %s state checksum mismatch (%s, recorded %s)", ErrCorrupt, snapID, sum, m.StateSHA256)
	}
	return nil
}

// memoryBaseOf names the snapshot whose RAM image a copy-on-write sandbox
// maps ("" if it maps none).
func (n *Node) memoryBaseOf(s *Sandbox) string {
	if !s.MemPrivate || s.MemFile == "" {
		return ""
	}
	root := filepath.Join(n.cfg.DataDir, snapshotsDir)
	if filepath.Dir(filepath.Dir(s.MemFile)) != root || filepath.Base(s.MemFile) != snapMemName {
		return ""
	}
	return filepath.Base(filepath.Dir(s.MemFile))
}

// runOnSnapshot points a sandbox's record at a snapshot it now runs on: its
// disk stacks on the snapshot's and its RAM maps the snapshot's image
// copy-on-write.
func (n *Node) runOnSnapshot(ctx context.Context, s *Sandbox, snapID string) error {
	image, _, err := n.snapshotRAM(snapID)
	if err != nil {
		return err
	}
	if err := n.setFields(ctx, s.ID, "snapshot_id = ?, mem_file = ?, mem_private = 1", snapID, image); err != nil {
		return err
	}
	s.SnapshotID, s.MemFile, s.MemPrivate = snapID, image, true
	return nil
}

// Fork clones a running sandbox into count children on this node. The parent
// is paused while its RAM file, disk and device state are frozen into a
// snapshot; then the parent and every child are restored from that snapshot,
// each mapping the frozen RAM copy-on-write (so unchanged pages are shared
// through the page cache) over a disk overlay of its own. Children inherit
// processes, files, cpu/memory, env vars and metadata, and get their own id,
// access token, network namespace and fresh entropy.
func (n *Node) Fork(ctx context.Context, id string, count int, timeout time.Duration) ([]ForkResult, error) {
	if count < 1 || count > MaxForkChildren {
		return nil, fmt.Errorf("%w: count must be between 1 and %d", ErrInvalid, MaxForkChildren)
	}
	if timeout == 0 {
		timeout = n.cfg.DefaultTimeout
	}
	if timeout < 0 || timeout > n.cfg.MaxTimeout {
		return nil, fmt.Errorf("%w: timeout must be between 1s and %s", ErrInvalid, n.cfg.MaxTimeout)
	}
	snap, results, err := n.capture(ctx, id, count, timeout, StateForking)
	if snap != "" {
		n.unpinSnapshot(snap) // the children's records refer to it now
	}
	return results, err
}

// capture freezes a running sandbox into a snapshot, restores it, and
// restores count children from the same snapshot; op is the state the
// sandbox shows meanwhile. The snapshot it returns is pinned against garbage
// collection; the caller unpins it once a record refers to it.
func (n *Node) capture(ctx context.Context, id string, count int, timeout time.Duration, op State) (string, []ForkResult, error) {
	unlock := n.lockOp(id)
	defer unlock()
	parent, err := n.loadSandbox(ctx, id)
	if err != nil {
		return "", nil, err
	}
	if parent.State != StateRunning {
		return "", nil, fmt.Errorf("%w: sandbox %s is %s; only running sandboxes can be forked", ErrConflict, id, parent.State)
	}
	if err := n.transition(ctx, id, op, StateRunning); err != nil {
		return "", nil, err
	}
	start := time.Now()
	// A copy-on-write parent is captured without a restart; any other has
	// its RAM file frozen and is restored from the snapshot with the
	// children.
	live := n.canSnapshotLive(parent)
	var snap string
	if live {
		snap, err = n.snapshotLive(ctx, parent)
	} else if snap, err = n.freeze(ctx, parent); err == nil {
		n.pinSnapshot(snap)
	}
	if err != nil {
		n.log.Error("fork: freezing the parent failed", "sandbox", id, "err", err)
		if m := n.machine(id); m != nil {
			_ = m.Resume(context.WithoutCancel(ctx))
			_ = n.transition(context.WithoutCancel(ctx), id, StateRunning, op)
		} else {
			// The parent's QEMU is gone; it cannot be brought back.
			n.destroy(context.WithoutCancel(ctx), parent)
		}
		return "", nil, fmt.Errorf("fork %s: %w", id, err)
	}
	frozen := time.Since(start)
	faults.Point(faults.ForkFrozen)

	// Restore the parent and the children from the snapshot in parallel.
	results := make([]ForkResult, count)
	var wg sync.WaitGroup
	var parentErr error
	if !live {
		wg.Add(1)
		go func() {
			defer wg.Done()
			parentErr = n.restoreFromSnapshot(ctx, parent, snap, parent.AccessToken, false)
		}()
	}
	for i := range results {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			results[i] = n.forkChild(ctx, parent, snap, timeout)
		}(i)
	}
	wg.Wait()
	if parentErr != nil {
		n.log.Error("fork: restoring the parent failed", "sandbox", id, "err", parentErr)
		n.destroy(context.WithoutCancel(ctx), parent)
		if count == 0 {
			return snap, nil, fmt.Errorf("restore %s after capturing it: %w", id, parentErr)
		}
	} else if err := n.transition(ctx, id, StateRunning, op); err != nil {
		return snap, results, err
	}
	n.log.Info("sandbox forked", "sandbox", id, "children", count, "freeze", frozen.Round(time.Microsecond),
		"total", time.Since(start).Round(time.Millisecond))
	return snap, results, nil
}

// freeze stops a parent that has a RAM file of its own, saves its device
// state and turns its RAM file and disk overlay into a read-only (full)
// snapshot; the parent's QEMU exits. The parent's record then points at the
// snapshot: it runs on, and resumes, from it, mapping its RAM image
// copy-on-write. (Copy-on-write sandboxes are captured by snapshotLive.)
func (n *Node) freeze(ctx context.Context, parent *Sandbox) (string, error) {
	m := n.machine(parent.ID)
	if m == nil {
		return "", errors.New("no running machine")
	}
	snapID, sdir := n.newSnapshotID()
	pdir := n.sandboxDir(parent.ID)
	if err := os.MkdirAll(sdir, 0o700); err != nil {
		return "", err
	}
	if parent.MemPrivate {
		os.RemoveAll(sdir)
		return "", fmt.Errorf("sandbox %s has no RAM file of its own to freeze", parent.ID)
	}
	// Record the snapshot before touching anything: its manifest names the
	// layer the parent's disk stacks on, and the parent's record names the
	// snapshot, so garbage collection keeps both and a restart after a crash
	// from here on can rebuild the parent from the snapshot's files
	// (recoverFreeze).
	before, err := storage.Info(ctx, filepath.Join(pdir, overlayName))
	if err != nil {
		os.RemoveAll(sdir)
		return "", err
	}
	early := snapshotManifest{ID: snapID, SandboxID: parent.ID, TemplateID: parent.TemplateID,
		ParentLayer: before.BackingFilename, MemoryMiB: parent.MemoryMiB, CreatedAt: time.Now().UTC()}
	if err := writeJSONAtomic(filepath.Join(sdir, snapManifestName), early); err != nil {
		os.RemoveAll(sdir)
		return "", err
	}
	prevSnap := parent.SnapshotID
	if err := n.setFields(ctx, parent.ID, "snapshot_id = ?", snapID); err != nil {
		os.RemoveAll(sdir)
		return "", err
	}
	abandon := func() {
		// Nothing was moved yet: the parent stays as it was.
		_ = n.setFields(context.WithoutCancel(ctx), parent.ID, "snapshot_id = ?", prevSnap)
		os.RemoveAll(sdir)
	}
	if err := m.Pause(ctx); err != nil {
		abandon()
		return "", err
	}
	if err := m.SaveState(ctx, filepath.Join(sdir, snapStateName)); err != nil {
		abandon()
		return "", err
	}
	moves := [][2]string{
		{filepath.Join(pdir, overlayName), filepath.Join(sdir, snapDiskName)},
		{filepath.Join(pdir, memFileName), filepath.Join(sdir, snapMemName)},
	}
	if err := n.stopMachine(parent.ID); err != nil {
		return "", err
	}
	// The state and the disk are made durable; a RAM image is left to the
	// kernel's writeback, so that freezing stays cheap (a paused sandbox
	// syncs its RAM file; a named snapshot's durable copy is the one
	// committed to the repository).
	for _, f := range []string{filepath.Join(sdir, snapStateName), moves[0][0]} {
		if err := syncFile(f); err != nil {
			return "", err
		}
	}
	for _, mv := range moves {
		if err := os.Rename(mv[0], mv[1]); err != nil {
			return "", fmt.Errorf("freeze %s: %w", filepath.Base(mv[0]), err)
		}
		if err := os.Chmod(mv[1], 0o400); err != nil {
			return "", err
		}
	}
	sum, err := fileSHA256(filepath.Join(sdir, snapStateName))
	if err != nil {
		return "", err
	}
	info, err := storage.Info(ctx, filepath.Join(sdir, snapDiskName))
	if err != nil {
		return "", err
	}
	early.ParentLayer, early.StateSHA256 = info.BackingFilename, sum
	if err := writeJSONAtomic(filepath.Join(sdir, snapManifestName), early); err != nil {
		return "", err
	}
	if err := n.setFields(ctx, parent.ID, "pid = 0"); err != nil {
		return "", err
	}
	return snapID, n.runOnSnapshot(ctx, parent, snapID)
}

// recoverFreeze rebuilds, as a paused sandbox, a parent whose fork or
// snapshot was cut short by a crash after its state was saved: it completes
// the freeze (moving what was not moved yet) and leaves the parent paused on
// the snapshot. It returns false when the saved state is not there.
func (n *Node) recoverFreeze(ctx context.Context, s *Sandbox) bool {
	if s.SnapshotID == "" {
		return false
	}
	sdir := filepath.Join(n.cfg.DataDir, snapshotsDir, s.SnapshotID)
	pdir := n.sandboxDir(s.ID)
	exists := func(p string) bool { _, err := os.Stat(p); return err == nil }
	var man snapshotManifest
	if readJSON(filepath.Join(sdir, snapManifestName), &man) != nil || !exists(filepath.Join(sdir, snapStateName)) {
		return false
	}
	fail := func(what string, err error) bool {
		n.log.Error("recover frozen sandbox", "sandbox", s.ID, "step", what, "err", err)
		return false
	}
	moves := [][2]string{{filepath.Join(pdir, overlayName), filepath.Join(sdir, snapDiskName)}}
	if man.MemoryBase == "" {
		moves = append(moves, [2]string{filepath.Join(pdir, memFileName), filepath.Join(sdir, snapMemName)})
	}
	for _, mv := range moves {
		if !exists(mv[1]) {
			if err := os.Rename(mv[0], mv[1]); err != nil {
				return fail("move "+filepath.Base(mv[0]), err)
			}
		}
	}
	// The parent gets a fresh overlay on the frozen disk.
	_ = os.Remove(filepath.Join(pdir, overlayName))
	if err := storage.CreateOverlay(ctx, filepath.Join(sdir, snapDiskName), filepath.Join(pdir, overlayName), 0); err != nil {
		return fail("overlay", err)
	}
	sum, err := fileSHA256(filepath.Join(sdir, snapStateName))
	if err != nil {
		return fail("checksum", err)
	}
	if man.StateSHA256 == "" {
		man.StateSHA256 = sum
		if err := writeJSONAtomic(filepath.Join(sdir, snapManifestName), man); err != nil {
			return fail("manifest", err)
		}
	}
	if _, err := storage.CloneFile(filepath.Join(sdir, snapStateName), filepath.Join(pdir, stateFileName)); err != nil {
		return fail("state", err)
	}
	_, hasRAM, err := n.snapshotRAM(s.SnapshotID)
	if err != nil {
		return fail("manifest", err)
	}
	rec := pauseRecord{StateSHA256: sum, RAMInState: hasRAM, RAMDiff: hasRAM, PausedAt: time.Now().UTC()}
	if err := writeJSONAtomic(filepath.Join(pdir, pauseRecordName), rec); err != nil {
		return fail("pause record", err)
	}
	if err := n.runOnSnapshot(ctx, s, s.SnapshotID); err != nil {
		return fail("record", err)
	}
	return n.setFields(ctx, s.ID, "state = ?, pid = 0", StatePaused) == nil
}

// copySnapshotRAM gives a sandbox its own RAM file, a copy of a snapshot's
// frozen image (a reflink where the filesystem can).
func (n *Node) copySnapshotRAM(snapID, sandboxID string) error {
	src := filepath.Join(n.cfg.DataDir, snapshotsDir, snapID, snapMemName)
	if _, err := storage.CloneFile(src, filepath.Join(n.sandboxDir(sandboxID), memFileName)); err != nil {
		return fmt.Errorf("copy RAM image of snapshot %s: %w", snapID, err)
	}
	return nil
}

// restoreFromSnapshot starts s from a fork snapshot: a fresh overlay on the
// snapshot's disk, RAM mapped copy-on-write from its memory image, device
// state loaded, vCPUs resumed, envd re-initialised (authenticated with
// authToken, the token the snapshot's envd knows).
func (n *Node) restoreFromSnapshot(ctx context.Context, s *Sandbox, snapID, authToken string, reseed bool) error {
	if err := n.verifySnapshotState(snapID); err != nil {
		return err
	}
	m, err := n.startIncoming(ctx, s, snapID)
	if err != nil {
		return err
	}
	return n.finishRestore(ctx, s, m, snapID, authToken, reseed)
}

// startIncoming prepares everything of s but the guest itself: its disk
// overlay on the snapshot's layer, its network, and a QEMU waiting for the
// snapshot's device state. The pool of pre-started sandboxes stops here.
func (n *Node) startIncoming(ctx context.Context, s *Sandbox, snapID string) (*vmm.Machine, error) {
	sdir := filepath.Join(n.cfg.DataDir, snapshotsDir, snapID)
	dir := n.sandboxDir(s.ID)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	if err := storage.CreateOverlay(ctx, filepath.Join(sdir, snapDiskName), filepath.Join(dir, overlayName), 0); err != nil {
		return nil, err
	}
	ep, err := n.endpoint(s)
	if err != nil {
		return nil, err
	}
	tap, err := n.openTap(ctx, ep)
	if err != nil {
		return nil, err
	}
	defer tap.Close()
	m, err := vmm.Start(ctx, n.vmConfig(s, tap, true))
	if err != nil {
		return nil, err
	}
	n.adopt(s.ID, m)
	s.PID = m.PID()
	if err := n.setFields(ctx, s.ID, "pid = ?", m.PID()); err != nil {
		return m, err
	}
	return m, nil
}

// finishRestore loads the snapshot's device state into a machine from
// startIncoming, runs it and initialises its envd.
func (n *Node) finishRestore(ctx context.Context, s *Sandbox, m *vmm.Machine, snapID, authToken string, reseed bool) error {
	phase := s.phaseTimer()
	_, hasRAM, err := n.snapshotRAM(snapID)
	if err != nil {
		return err
	}
	load := m.LoadState
	if hasRAM {
		load = m.LoadFullState
	}
	if err := load(ctx, filepath.Join(n.cfg.DataDir, snapshotsDir, snapID, snapStateName)); err != nil {
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

func (n *Node) forkChild(ctx context.Context, parent *Sandbox, snapID string, timeout time.Duration) ForkResult {
	now := time.Now().UTC().Truncate(time.Millisecond)
	c := *parent
	c.ID = NewSandboxID()
	c.State = StateCreating
	c.PID = 0
	c.TrafficToken = newToken()
	if parent.Secure {
		c.AccessToken = newToken()
	}
	c.CreatedAt, c.StartedAt, c.EndAt = now, now, now.Add(timeout)
	c.Phases = nil
	image, _, err := n.snapshotRAM(snapID)
	if err != nil {
		return ForkResult{Err: err}
	}
	c.SnapshotID, c.MemFile, c.MemPrivate = snapID, image, true
	unlock := n.lockOp(c.ID)
	defer unlock()
	n.mu.Lock()
	slot, err := n.freeSlot(ctx)
	if err == nil {
		c.Slot = slot
		err = n.insertSandbox(ctx, &c)
	}
	n.mu.Unlock()
	if err != nil {
		return ForkResult{Err: err}
	}
	if err := n.restoreFromSnapshot(ctx, &c, snapID, parent.AccessToken, true); err != nil {
		n.destroy(context.WithoutCancel(ctx), &c)
		return ForkResult{Err: err}
	}
	if err := n.transition(ctx, c.ID, StateRunning, StateCreating); err != nil {
		n.destroy(context.WithoutCancel(ctx), &c)
		return ForkResult{Err: err}
	}
	c.State = StateRunning
	return ForkResult{Sandbox: n.withAddr(&c)}
}

// newSnapshotID names a new snapshot and its directory.
func (n *Node) newSnapshotID() (id, dir string) {
	id = "fork-" + randomHex(8)
	return id, filepath.Join(n.cfg.DataDir, snapshotsDir, id)
}

func randomHex(n int) string {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		panic(err)
	}
	return hex.EncodeToString(b)
}

// gcSnapshots deletes fork snapshots no sandbox depends on any more, directly
// (its overlay or RAM image) or through another snapshot (whose disk layer
// stacks on it, or whose memory is relative to its RAM image).
func (n *Node) gcSnapshots(ctx context.Context) {
	root := filepath.Join(n.cfg.DataDir, snapshotsDir)
	ents, err := os.ReadDir(root)
	if err != nil {
		return
	}
	all, err := n.loadSandboxes(ctx, "")
	if err != nil {
		return
	}
	deps := map[string][]string{}
	for _, e := range ents {
		var m snapshotManifest
		if readJSON(filepath.Join(root, e.Name(), snapManifestName), &m) == nil {
			if filepath.Dir(filepath.Dir(m.ParentLayer)) == root {
				deps[e.Name()] = append(deps[e.Name()], filepath.Base(filepath.Dir(m.ParentLayer)))
			}
			if m.MemoryBase != "" {
				deps[e.Name()] = append(deps[e.Name()], m.MemoryBase)
			}
		}
	}
	used := map[string]bool{}
	var keep func(id string)
	keep = func(id string) {
		if id == "" || used[id] {
			return
		}
		used[id] = true
		for _, d := range deps[id] {
			keep(d)
		}
	}
	if named, err := n.Snapshots(); err == nil {
		for _, ns := range named {
			keep(ns.SnapshotID)
		}
	}
	if refs, err := os.ReadDir(filepath.Join(n.cfg.DataDir, templateSnapshotsDir)); err == nil {
		for _, r := range refs {
			var ts templateSnapshot
			if readJSON(filepath.Join(n.cfg.DataDir, templateSnapshotsDir, r.Name()), &ts) == nil {
				keep(ts.SnapshotID)
			}
		}
	}
	for _, s := range all {
		keep(s.SnapshotID)
		keep(n.memoryBaseOf(s))
	}
	n.mu.Lock()
	for id := range n.pinned {
		keep(id)
	}
	n.mu.Unlock()
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), ".") {
			continue // an export or import being staged
		}
		if !used[e.Name()] {
			if err := os.RemoveAll(filepath.Join(root, e.Name())); err != nil {
				n.log.Error("remove unused snapshot", "snapshot", e.Name(), "err", err)
			} else {
				n.log.Info("removed unused fork snapshot", "snapshot", e.Name())
			}
		}
	}
}
