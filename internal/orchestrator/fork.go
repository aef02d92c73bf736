package orchestrator

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

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
	_, results, err := n.capture(ctx, id, count, timeout, StateForking)
	return results, err
}

// capture freezes a running sandbox into a snapshot, restores it, and
// restores count children from the same snapshot; op is the state the
// sandbox shows meanwhile.
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
	snap, err := n.freeze(ctx, parent, true)
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

	// Restore the parent and the children from the snapshot in parallel.
	results := make([]ForkResult, count)
	var wg sync.WaitGroup
	var parentErr error
	wg.Add(1)
	go func() {
		defer wg.Done()
		parentErr = n.restoreFromSnapshot(ctx, parent, snap, parent.AccessToken, false)
	}()
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

// freeze stops the parent, saves its device state and turns its RAM file
// and disk overlay into a read-only snapshot. The parent's QEMU exits. With
// keepRAM the parent gets a copy of the frozen RAM to run on again.
func (n *Node) freeze(ctx context.Context, parent *Sandbox, keepRAM bool) (string, error) {
	m := n.machine(parent.ID)
	if m == nil {
		return "", errors.New("no running machine")
	}
	snapID := "fork-" + randomHex(8)
	sdir := filepath.Join(n.cfg.DataDir, snapshotsDir, snapID)
	pdir := n.sandboxDir(parent.ID)
	if err := os.MkdirAll(sdir, 0o700); err != nil {
		return "", err
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
	moves := [][2]string{
		{filepath.Join(pdir, memFileName), filepath.Join(sdir, snapMemName)},
		{filepath.Join(pdir, overlayName), filepath.Join(sdir, snapDiskName)},
	}
	if parent.MemPrivate {
		// Copy-on-write RAM is no file to freeze: write it into one first.
		if err := n.rebaseRAM(ctx, parent, m, sdir); err != nil {
			abandon()
			return "", fmt.Errorf("write private RAM into an image: %w", err)
		}
		moves = moves[1:] // the image is already in the snapshot
	} else {
		if err := m.SaveState(ctx, filepath.Join(sdir, snapStateName)); err != nil {
			abandon()
			return "", err
		}
		if err := n.stopMachine(parent.ID); err != nil {
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
	if err := os.Chmod(filepath.Join(sdir, snapMemName), 0o400); err != nil {
		return "", err
	}
	sum, err := fileSHA256(filepath.Join(sdir, snapStateName))
	if err != nil {
		return "", err
	}
	info, err := storage.Info(ctx, filepath.Join(sdir, snapDiskName))
	if err != nil {
		return "", err
	}
	// The parent now depends on the snapshot's disk and, from here on, runs
	// on RAM of its own.
	if err := n.setFields(ctx, parent.ID, "snapshot_id = ?, pid = 0, mem_file = '', mem_private = 0", snapID); err != nil {
		return "", err
	}
	parent.SnapshotID, parent.MemFile, parent.MemPrivate = snapID, "", false
	// The children map the frozen RAM copy-on-write; the parent gets a
	// shared copy of its own (a reflink where the filesystem allows), so it
	// stays cheap to pause and can be forked again.
	if keepRAM {
		if err := n.copySnapshotRAM(snapID, parent.ID); err != nil {
			return "", err
		}
	}
	early.ParentLayer, early.StateSHA256 = info.BackingFilename, sum
	if err := writeJSONAtomic(filepath.Join(sdir, snapManifestName), early); err != nil {
		return "", err
	}
	return snapID, nil
}

// recoverFreeze rebuilds, as a paused sandbox, a parent whose fork or
// snapshot was cut short by a crash after its QEMU had stopped: its device
// state, RAM image and disk are in its directory or already moved into the
// snapshot's. It returns false when the saved state is not there.
func (n *Node) recoverFreeze(ctx context.Context, s *Sandbox) bool {
	if s.SnapshotID == "" {
		return false
	}
	sdir := filepath.Join(n.cfg.DataDir, snapshotsDir, s.SnapshotID)
	pdir := n.sandboxDir(s.ID)
	exists := func(p string) bool { _, err := os.Stat(p); return err == nil }
	if !exists(filepath.Join(sdir, snapStateName)) {
		return false
	}
	if exists(filepath.Join(sdir, snapDiskName)) {
		// The disk was frozen: the parent gets a fresh overlay on it.
		_ = os.Remove(filepath.Join(pdir, overlayName))
		if err := storage.CreateOverlay(ctx, filepath.Join(sdir, snapDiskName), filepath.Join(pdir, overlayName), 0); err != nil {
			n.log.Error("recover frozen sandbox: overlay", "sandbox", s.ID, "err", err)
			return false
		}
	} else if !exists(filepath.Join(pdir, overlayName)) {
		return false
	}
	if exists(filepath.Join(sdir, snapMemName)) {
		if err := n.copySnapshotRAM(s.SnapshotID, s.ID); err != nil {
			n.log.Error("recover frozen sandbox: RAM image", "sandbox", s.ID, "err", err)
			return false
		}
	} else if !exists(filepath.Join(pdir, memFileName)) {
		return false
	}
	if _, err := storage.CloneFile(filepath.Join(sdir, snapStateName), filepath.Join(pdir, stateFileName)); err != nil {
		return false
	}
	sum, err := fileSHA256(filepath.Join(pdir, stateFileName))
	if err != nil {
		return false
	}
	if err := writeJSONAtomic(filepath.Join(pdir, pauseRecordName), pauseRecord{StateSHA256: sum, PausedAt: time.Now().UTC()}); err != nil {
		return false
	}
	return n.setFields(ctx, s.ID, "state = ?, pid = 0, mem_file = '', mem_private = 0", StatePaused) == nil
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
	if err := m.LoadState(ctx, filepath.Join(n.cfg.DataDir, snapshotsDir, snapID, snapStateName)); err != nil {
		return err
	}
	phase("load device state")
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
	c.MemFile, c.MemPrivate = filepath.Join(n.cfg.DataDir, snapshotsDir, snapID, snapMemName), true
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

func randomHex(n int) string {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		panic(err)
	}
	return hex.EncodeToString(b)
}

// gcSnapshots deletes fork snapshots no sandbox depends on any more, directly
// (its overlay or RAM image) or through another snapshot's disk layer.
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
	parentOf := map[string]string{}
	for _, e := range ents {
		var m snapshotManifest
		if b, err := os.ReadFile(filepath.Join(root, e.Name(), snapManifestName)); err == nil {
			if json.Unmarshal(b, &m) == nil && filepath.Dir(filepath.Dir(m.ParentLayer)) == root {
				parentOf[e.Name()] = filepath.Base(filepath.Dir(m.ParentLayer))
			}
		}
	}
	used := map[string]bool{}
	if named, err := n.Snapshots(); err == nil {
		for _, ns := range named {
			for id := ns.SnapshotID; id != "" && !used[id]; id = parentOf[id] {
				used[id] = true
			}
		}
	}
	if refs, err := os.ReadDir(filepath.Join(n.cfg.DataDir, templateSnapshotsDir)); err == nil {
		for _, r := range refs {
			var ts templateSnapshot
			if b, err := os.ReadFile(filepath.Join(n.cfg.DataDir, templateSnapshotsDir, r.Name())); err == nil && json.Unmarshal(b, &ts) == nil {
				for id := ts.SnapshotID; id != "" && !used[id]; id = parentOf[id] {
					used[id] = true
				}
			}
		}
	}
	for _, s := range all {
		for id := s.SnapshotID; id != "" && !used[id]; id = parentOf[id] {
			used[id] = true
		}
	}
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

// rebaseRAM turns a stopped machine with copy-on-write RAM into a RAM image
// plus device state in sdir. QEMU 7.2 always migrates private RAM, so the
// machine's full state is saved, loaded into a helper QEMU whose RAM is the
// new image file (mapped shared, so the load writes the image), and the
// helper saves the device state alone. Both QEMUs exit.
func (n *Node) rebaseRAM(ctx context.Context, s *Sandbox, m *vmm.Machine, sdir string) error {
	full := filepath.Join(sdir, "full.vmstate")
	defer os.Remove(full)
	if err := m.SaveFullState(ctx, full); err != nil {
		return err
	}
	if err := n.stopMachine(s.ID); err != nil {
		return err
	}
	ep, err := n.endpoint(s)
	if err != nil {
		return err
	}
	tap, err := n.net.OpenTap(ep)
	if err != nil {
		return err
	}
	defer tap.Close()
	img := *s
	img.MemFile, img.MemPrivate = filepath.Join(sdir, snapMemName), false
	helper, err := vmm.Start(ctx, n.vmConfig(&img, tap, true))
	if err != nil {
		return err
	}
	defer helper.Kill()
	if err := helper.LoadFullState(ctx, full); err != nil {
		return err
	}
	return helper.SaveState(ctx, filepath.Join(sdir, snapStateName))
}
