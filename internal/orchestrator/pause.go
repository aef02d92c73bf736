package orchestrator

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"time"

	"github.com/agentenv/agentenv/internal/faults"
	"github.com/agentenv/agentenv/internal/guestexec"
	"github.com/agentenv/agentenv/internal/network"
	"github.com/agentenv/agentenv/internal/operation"
	"github.com/agentenv/agentenv/internal/sandboxes"
	"github.com/agentenv/agentenv/internal/storage"
	"github.com/agentenv/agentenv/internal/store"
	"github.com/agentenv/agentenv/internal/vmm"
)

// stateFileName holds a paused sandbox's device state; its RAM is in
// memFileName and its disk in overlayName, all in the sandbox directory.
const stateFileName = "devices.vmstate"

func (n *Node) pause(ctx context.Context, id string, keepMemory bool) (*sandboxes.Sandbox, error) {
	s, err := n.records.Get(ctx, id)
	if err != nil {
		return nil, err
	}
	if s.State == sandboxes.Paused {
		return nil, fmt.Errorf("%w: sandbox %s is already paused", ErrConflict, id)
	}
	if !s.State.Resting() {
		return nil, sandboxes.Busy(s)
	}
	unlock := n.lockOp(id)
	defer unlock()
	o := operation.Start(ctx, "pause", n.cfg.OperationTimeout, n.log)
	octx := o.Context()
	if s, err = n.records.Get(octx, id); err != nil {
		return nil, o.Finish(err)
	}
	if err := n.records.Move(octx, id, sandboxes.Running, sandboxes.Pausing, ""); err != nil {
		return nil, o.Finish(err)
	}
	n.resumeOnFailure(o, s, sandboxes.Pausing)
	pauseMachine := n.pauseMachine
	if !keepMemory {
		pauseMachine = n.pauseFilesystem
	}
	if err := pauseMachine(octx, s, sandboxes.Pausing, o.Do); err != nil {
		n.log.Error("pause failed; the sandbox runs on", "sandbox", id, "err", err)
		return nil, o.Finish(fmt.Errorf("pause %s: %w", id, err))
	}
	o.Finish(nil)
	n.log.Info("sandbox paused", "sandbox", id, "memory", keepMemory, "took", o.Elapsed().Round(time.Microsecond))
	if n.sharesPaused() {
		n.sharePausedLater(id)
	}
	return n.withAddr(s), nil
}

// stepFunc runs one named step of an operation (operation.Op.Do, or
// runStep outside one).
type stepFunc func(name string, fn func(context.Context) error) error

// runStep runs fn on ctx as a step of no operation.
func runStep(ctx context.Context) stepFunc {
	return func(_ string, fn func(context.Context) error) error { return fn(ctx) }
}

// stopMachine kills a sandbox's QEMU, if the node holds one. The machine
// leaves the table before it exits, so the exit watcher does not take the
// exit for a crash.
func (n *Node) stopMachine(id string) error {
	n.dropHot(id)
	m := n.machines.take(id)
	if m == nil {
		return nil
	}
	return m.Kill()
}

// pauseMachine saves a running sandbox (in state from) to disk and stops
// its QEMU: vCPUs stop, the device state (with the changed pages of a
// copy-on-write sandbox) is written, files are made durable, the pause
// record and state are published, the record moves to paused, and only
// then QEMU exits. On failure QEMU is still there, stopped, nothing is
// published, and the caller runs it on.
func (n *Node) pauseMachine(ctx context.Context, s *sandboxes.Sandbox, from sandboxes.State, step stepFunc) (err error) {
	m := n.machines.get(s.ID)
	if !alive(m) {
		return errors.New("no running machine")
	}
	dir := n.sandboxDir(s.ID)
	phase := s.PhaseTimer()
	tmp := filepath.Join(dir, stateFileName+".tmp")
	published := false
	defer func() {
		if err != nil {
			os.Remove(tmp)
			if published {
				os.Remove(filepath.Join(dir, stateFileName))
				os.Remove(filepath.Join(dir, pauseRecordName))
			}
		}
	}()
	// A record and state of an earlier pause are stale: recovery must never
	// take them for this pause's.
	os.Remove(filepath.Join(dir, pauseRecordName))
	os.Remove(filepath.Join(dir, stateFileName))
	// The tap's MAC, while its QEMU holds it: what the guest knows once it
	// has answered through it. A resume that failed may not have got so
	// far (the guest never asked, nor was asked): its next restore asks.
	gateway := ""
	if from != sandboxes.Resuming {
		gateway = n.gatewayMAC(s)
	}
	if err := step("stop-vcpus", func(ctx context.Context) error { return m.Pause(ctx) }); err != nil {
		return err
	}
	phase("stop vcpus")
	_ = os.Remove(tmp)
	var sum string // of the state, if known as it was written
	if err := step("save-state", func(ctx context.Context) error {
		if s.MemPrivate {
			// Copy-on-write RAM is no file of the sandbox's own: the pages
			// that differ from the image it maps go into the state.
			st, err := n.saveRAMDiff(ctx, m, tmp, n.ramFile(s))
			if err != nil {
				return err
			}
			sum = st.SHA256
			n.log.Info("incremental memory state", "sandbox", s.ID, "pages", st.PagesKept, "of", st.PagesSent, "bytes", st.Bytes)
			return nil
		}
		return m.SaveState(ctx, tmp)
	}); err != nil {
		return err
	}
	phase("save state")
	// A completed migration has flushed the disk and QEMU writes nothing
	// more: the files are made durable with QEMU still there (to run on if
	// anything fails).
	if err := step("sync", func(ctx context.Context) error {
		files := []string{overlayName, stateFileName + ".tmp"}
		if !s.MemPrivate {
			files = append(files, memFileName)
		}
		for _, f := range files {
			if err := storage.SyncFile(filepath.Join(dir, f)); err != nil {
				return err
			}
		}
		if sum == "" {
			var err error
			sum, err = store.FileSHA256(tmp)
			return err
		}
		return nil
	}); err != nil {
		return err
	}
	phase("sync to disk")
	// The record is written first, then the state file takes its final
	// name: a state file under its final name always has a valid record.
	rec := pauseRecord{StateSHA256: sum, RAMInState: s.MemPrivate, RAMDiff: s.MemPrivate, GatewayMAC: gateway}
	if err := step("publish", func(ctx context.Context) error {
		rec.PausedAt = time.Now().UTC()
		if err := storage.WriteJSONAtomic(filepath.Join(dir, pauseRecordName), rec, 0o600); err != nil {
			return err
		}
		published = true
		return os.Rename(tmp, filepath.Join(dir, stateFileName))
	}); err != nil {
		return err
	}
	faults.Point(faults.PauseSaved)
	if err := step("commit", func(ctx context.Context) error {
		return n.records.Move(ctx, s.ID, from, sandboxes.Paused, "pid = 0")
	}); err != nil {
		return err
	}
	s.State, s.PID = sandboxes.Paused, 0
	// Paused: QEMU has nothing left to do but wait, stopped, as the hot
	// copy (see hotpause.go), or exit.
	n.keepHot(s, rec)
	phase("qemu kept or exit")
	return nil
}

// pauseFilesystem saves a running sandbox's file system and stops its
// QEMU, keeping no memory: the guest syncs its page cache to the disk,
// its vCPUs stop (QEMU drains and flushes the disk, its qcow2 caches
// included), the disk is made durable, the pause record is published, the
// record moves to paused (no RAM file any more), and only then QEMU exits
// and the RAM file goes. On failure QEMU is still there, stopped, nothing
// is published, and the caller runs it on.
func (n *Node) pauseFilesystem(ctx context.Context, s *sandboxes.Sandbox, from sandboxes.State, step stepFunc) (err error) {
	m := n.machines.get(s.ID)
	if !alive(m) {
		return errors.New("no running machine")
	}
	dir := n.sandboxDir(s.ID)
	phase := s.PhaseTimer()
	published := false
	defer func() {
		if err != nil && published {
			os.Remove(filepath.Join(dir, pauseRecordName))
		}
	}()
	os.Remove(filepath.Join(dir, pauseRecordName))
	os.Remove(filepath.Join(dir, stateFileName))
	if err := step("guest-sync", func(ctx context.Context) error {
		if err := n.guestSync(ctx, s, guestSyncTimeout); err != nil {
			// The guest's state, not the node's: the caller may pause with
			// memory instead.
			return fmt.Errorf("%w: the guest's envd did not sync its file systems (%v); a pause without memory needs it to, a pause with memory does not", ErrConflict, err)
		}
		return nil
	}); err != nil {
		return err
	}
	phase("guest sync")
	if err := step("stop-vcpus", func(ctx context.Context) error { return m.Pause(ctx) }); err != nil {
		return err
	}
	phase("stop vcpus")
	if err := step("sync", func(ctx context.Context) error {
		return storage.SyncFile(filepath.Join(dir, overlayName))
	}); err != nil {
		return err
	}
	phase("sync to disk")
	if err := step("publish", func(ctx context.Context) error {
		published = true
		return publishFilesystemPause(dir)
	}); err != nil {
		return err
	}
	faults.Point(faults.PauseSaved)
	if err := step("commit", func(ctx context.Context) error {
		return n.records.Move(ctx, s.ID, from, sandboxes.Paused, setPausedWithoutMemory)
	}); err != nil {
		return err
	}
	s.State, s.PID, s.MemFile, s.MemPrivate = sandboxes.Paused, 0, "", false
	if err := n.stopMachine(s.ID); err != nil {
		n.log.Warn("stop the QEMU of a paused sandbox", "sandbox", s.ID, "err", err)
	}
	// The RAM is not kept (a copy-on-write sandbox's is no file of its own).
	if err := os.Remove(filepath.Join(dir, memFileName)); err != nil && !errors.Is(err, os.ErrNotExist) {
		n.log.Warn("remove the RAM file of a sandbox paused without memory", "sandbox", s.ID, "err", err)
	}
	phase("qemu exit")
	return nil
}

// setPausedWithoutMemory is the record of a sandbox paused without
// memory: no QEMU, no RAM file.
const setPausedWithoutMemory = "pid = 0, mem_file = '', mem_private = 0"

// publishFilesystemPause writes the pause record of a sandbox paused
// without memory in its directory dir.
func publishFilesystemPause(dir string) error {
	return storage.WriteJSONAtomic(filepath.Join(dir, pauseRecordName),
		pauseRecord{FilesystemOnly: true, PausedAt: time.Now().UTC()}, 0o600)
}

// guestSyncTimeout bounds the guest's sync before a pause without memory.
const guestSyncTimeout = 30 * time.Second

// guestSync has s's guest sync its filesystems, within timeout.
func (n *Node) guestSync(ctx context.Context, s *sandboxes.Sandbox, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	g := guestexec.Target{Addr: n.withAddr(s).EnvdAddr, Token: s.AccessToken}
	code, err := guestexec.Run(ctx, g, guestexec.Command{Script: "sync"})
	if err == nil && code != 0 {
		err = fmt.Errorf("sync in the guest exited with %d", code)
	}
	return err
}

const pauseRecordName = "paused.json"

// pauseRecord describes a paused sandbox's saved state.
type pauseRecord struct {
	// FilesystemOnly: only the disk was kept (no device state, no RAM);
	// the sandbox boots again on resume.
	FilesystemOnly bool   `json:"filesystemOnly,omitempty"`
	StateSHA256    string `json:"stateSHA256,omitempty"`
	RAMInState     bool   `json:"ramInState"`
	// RAMDiff: the RAM in the state is only what differs from the image
	// the sandbox maps (its mem_file), loaded over that image.
	RAMDiff  bool      `json:"ramDiff,omitempty"`
	PausedAt time.Time `json:"pausedAt"`
	// GatewayMAC is the MAC of the tap the guest ran behind (see
	// tapModeFor); empty in records written before it was kept.
	GatewayMAC string `json:"gatewayMAC,omitempty"`
}

// verifyPausedState checks that a paused sandbox has every file its pause
// record needs (its RAM file, or the image its copy-on-write RAM maps) and
// that the saved state matches its checksum.
func (n *Node) verifyPausedState(s *sandboxes.Sandbox) error {
	dir := n.sandboxDir(s.ID)
	rec, err := readPauseRecord(dir)
	if err != nil {
		return err
	}
	if rec.FilesystemOnly {
		if _, err := os.Stat(filepath.Join(dir, overlayName)); err != nil {
			return fmt.Errorf("%w: paused sandbox is missing its disk: %v", ErrCorrupt, err)
		}
		return nil
	}
	need := []string{filepath.Join(dir, stateFileName), filepath.Join(dir, overlayName)}
	switch {
	case s.MemPrivate && s.MemFile != "":
		need = append(need, s.MemFile)
	case !rec.RAMInState:
		need = append(need, filepath.Join(dir, memFileName))
	}
	for _, f := range need {
		if _, err := os.Stat(f); err != nil {
			return fmt.Errorf("%w: paused sandbox is missing %s: %v", ErrCorrupt, filepath.Base(f), err)
		}
	}
	return rec.matchesState(dir)
}

// matchesState checks the saved device state in dir against the record.
func (rec *pauseRecord) matchesState(dir string) error {
	if rec.FilesystemOnly {
		return nil // no state: the disk is all there is
	}
	sum, err := store.FileSHA256(filepath.Join(dir, stateFileName))
	if err != nil {
		return err
	}
	if sum != rec.StateSHA256 {
		return fmt.Errorf("%w: saved device state checksum mismatch (%s, recorded %s); the sandbox stays paused", ErrCorrupt, sum, rec.StateSHA256)
	}
	return nil
}

func readPauseRecord(dir string) (*pauseRecord, error) {
	b, err := os.ReadFile(filepath.Join(dir, pauseRecordName))
	if err != nil {
		return nil, fmt.Errorf("paused sandbox record: %w", err)
	}
	var rec pauseRecord
	if err := json.Unmarshal(b, &rec); err != nil {
		return nil, fmt.Errorf("paused sandbox record is corrupt: %w", err)
	}
	return &rec, nil
}

// openTap opens a tap in a sandbox's namespace for a new QEMU, building the
// network again when the namespace is gone (a host reboot).
func (n *Node) openTap(ctx context.Context, ep *network.Endpoint, mode network.TapMode) (*os.File, error) {
	tap, err := n.net.OpenTap(ep, mode)
	if err == nil {
		return tap, nil
	}
	if err := n.net.Setup(ctx, ep); err != nil {
		return nil, err
	}
	return n.net.OpenTap(ep, mode)
}

// gatewayMAC is the MAC of the tap s's guest runs behind now, for the
// record of a state saved from it ("": it cannot be read, and a restore
// of that state asks the guest).
func (n *Node) gatewayMAC(s *sandboxes.Sandbox) string {
	ep, err := n.endpoint(s)
	if err != nil {
		return ""
	}
	mac, err := n.net.TapMAC(ep)
	if err != nil {
		return ""
	}
	return mac
}

// tapModeFor is how the tap of a guest restored from a state saved behind
// gatewayMAC is set up: a guest with TapMAC as its gateway's needs no ARP
// before the node's first packet to it; any other (a state saved before
// taps had one MAC, or with the MAC unknown) is asked, which also tells it
// the tap's MAC.
func tapModeFor(gatewayMAC string) network.TapMode {
	if gatewayMAC == network.TapMAC {
		return network.GuestKnows
	}
	return network.GuestAsks
}

// Resume restarts a paused sandbox exactly where it stopped and gives it a
// new time to live (0: the node's default). envd gets a fresh /init so the
// guest's wall clock is corrected. The resume runs to its end whatever the
// caller does; when it fails the sandbox stays paused (or, if its guest
// already ran, is paused again).
func (n *Node) Resume(ctx context.Context, id string, timeout time.Duration) (*sandboxes.Sandbox, error) {
	return n.ResumeWith(ctx, id, ResumeOptions{Timeout: timeout})
}

// ResumeOptions say how a paused sandbox resumes.
type ResumeOptions struct {
	// Timeout is its new time to live (0: the node default).
	Timeout time.Duration
	// Reboot boots it again on its disk even if its memory was kept
	// (E2B's memory: false at connect): the memory is dropped, and what
	// the guest had not written to its disk before the pause is lost.
	Reboot bool
	// Auto marks a resume that traffic asked for (auto-resume): a sandbox
	// paused without memory is not rebooted by it, only by an explicit
	// resume (ErrConflict).
	Auto bool
}

// sharedSandboxMemoryMiB is the guest memory admission counts for the
// resume of a sandbox paused on another node before its record is read.
const sharedSandboxMemoryMiB = 512

// ResumeWith resumes a paused sandbox as opts say (see Resume).
func (n *Node) resumeWith(ctx context.Context, id string, opts ResumeOptions) (*sandboxes.Sandbox, error) {
	timeout := opts.Timeout
	if timeout == 0 {
		timeout = n.cfg.DefaultTimeout
	}
	if timeout < 0 || timeout > n.cfg.MaxTimeout {
		return nil, fmt.Errorf("%w: timeout must be between 1s and %s", ErrInvalid, n.cfg.MaxTimeout)
	}
	s, err := n.records.Get(ctx, id)
	if err == nil {
		if s.State == sandboxes.Running {
			return nil, fmt.Errorf("%w: sandbox %s is already running", ErrConflict, id)
		}
		if !s.State.Resting() {
			return nil, sandboxes.Busy(s)
		}
	} else if !errors.Is(err, ErrNotFound) || !n.sharesPaused() {
		return nil, n.notHere(err)
	}
	// A sandbox in shared storage has its size in its pause record, read
	// once adopted; until then it is taken as the usual template's.
	memMiB := sharedSandboxMemoryMiB
	if s != nil {
		memMiB = s.MemoryMiB
	}
	if n.hot.has(id) && !opts.Reboot {
		memMiB = 0 // a hot copy's memory is committed already
	}
	ticket, err := n.admit(ctx, "a resume", 1, memMiB)
	if err != nil {
		return nil, err
	}
	defer ticket.Done()
	unlock := n.lockOp(id)
	defer unlock()
	o := operation.Start(ctx, "resume", n.cfg.OperationTimeout, n.log)
	octx := o.Context()
	s, err = n.records.Get(octx, id)
	if errors.Is(err, ErrNotFound) && n.sharesPaused() {
		s, err = n.adoptShared(octx, id) // paused on another node, in shared storage
	}
	if err != nil {
		return nil, o.Finish(err)
	}
	if s.State == sandboxes.Running {
		return nil, o.Finish(fmt.Errorf("%w: sandbox %s is already running", ErrConflict, id))
	}
	if s.State == sandboxes.Paused {
		if err := n.takeBackShared(octx, s); err != nil {
			return nil, o.Finish(err)
		}
	}
	if opts.Auto {
		if rec, err := readPauseRecord(n.sandboxDir(id)); err == nil && rec.FilesystemOnly {
			return nil, o.Finish(fmt.Errorf("%w: sandbox %s was paused without memory: resume it explicitly (connect), which boots it again", ErrConflict, id))
		}
	}
	if err := n.records.Move(octx, id, sandboxes.Paused, sandboxes.Resuming, ""); err != nil {
		return nil, o.Finish(err)
	}
	resume := func() error { return n.resumeMachine(o, s, false) }
	if opts.Reboot {
		resume = func() error { return n.rebootFromMemory(o, s) }
	}
	if err := resume(); err != nil {
		return nil, o.Finish(fmt.Errorf("resume %s: %w", id, err))
	}
	now := time.Now().UTC().Truncate(time.Millisecond)
	if err := o.Do("commit", func(ctx context.Context) error {
		return n.records.Move(ctx, id, sandboxes.Resuming, sandboxes.Running, "pid = ?, started_at = ?, end_at = ?, mem_file = ?, mem_private = ?",
			s.PID, now.UnixMilli(), now.Add(timeout).UnixMilli(), s.MemFile, s.MemPrivate)
	}); err != nil {
		return nil, o.Finish(fmt.Errorf("resume %s: %w", id, err))
	}
	o.Finish(nil)
	s.StartedAt, s.EndAt, s.State = now, now.Add(timeout), sandboxes.Running
	n.log.Info("sandbox resumed", "sandbox", id, "took", o.Elapsed().Round(time.Microsecond), "phases", s.Phases)
	return n.withAddr(s), nil
}

// resumeMachine starts a paused sandbox's QEMU on its saved state and runs
// it. Until the guest runs, a failure stops that QEMU and the sandbox stays
// paused, its files untouched; once it ran (its RAM and disk moved on), a
// failure pauses it again.
func (n *Node) resumeMachine(o *operation.Op, s *sandboxes.Sandbox, reboot bool) error {
	o.OnFailure("stay paused", func(ctx context.Context) error {
		_ = n.stopMachine(s.ID)
		return n.records.Move(ctx, s.ID, sandboxes.Resuming, sandboxes.Paused, "pid = 0")
	})
	dir := n.sandboxDir(s.ID)
	state := filepath.Join(dir, stateFileName)
	if !reboot {
		// The hot copy, if the pause left one that can still run.
		if rec, err := readPauseRecord(dir); err == nil && !rec.FilesystemOnly {
			if c := n.takeHot(o.Context(), s, rec); c != nil {
				return n.resumeHot(o, s, c, s.PhaseTimer())
			}
		}
	}
	if err := o.Do("verify", func(context.Context) error { return n.verifyPausedState(s) }); err != nil {
		return err
	}
	rec, err := readPauseRecord(dir)
	if err != nil {
		return err
	}
	if rec.FilesystemOnly || reboot {
		return n.rebootPaused(o, s)
	}
	phase := s.PhaseTimer()
	ep, err := n.endpoint(s)
	if err != nil {
		return err
	}
	m, err := n.startMachine(o, s, ep, true, tapModeFor(rec.GatewayMAC), phase)
	if err != nil {
		return err
	}
	load := m.LoadState
	if rec.RAMDiff {
		load = m.LoadFullState
	}
	if err := o.Do("load-state", func(ctx context.Context) error { return load(ctx, state) }); err != nil {
		return err
	}
	phase("load state")
	if err := o.Do("resume-vcpus", func(ctx context.Context) error { return m.Resume(ctx) }); err != nil {
		return err
	}
	phase("resume vcpus")
	return n.guestRuns(o, s, ep, phase)
}

// guestRuns finishes a resume once the guest's vCPUs run: its paused state
// is history (and goes, so that a restart never takes it for the present),
// a failure from here pauses it again as it is now, and envd gets a fresh
// /init (the guest's clock).
func (n *Node) guestRuns(o *operation.Op, s *sandboxes.Sandbox, ep *network.Endpoint, phase func(string)) error {
	dir := n.sandboxDir(s.ID)
	o.Settle()
	os.Remove(filepath.Join(dir, pauseRecordName))
	os.Remove(filepath.Join(dir, stateFileName))
	o.OnFailure("pause again", func(ctx context.Context) error {
		if m := n.machines.get(s.ID); alive(m) {
			if err := n.pauseMachine(ctx, s, sandboxes.Resuming, runStep(ctx)); err == nil {
				return nil
			} else if m.Resume(ctx) == nil {
				n.log.Error("a failed resume could not pause the sandbox again; it runs", "sandbox", s.ID, "err", err)
				return n.records.Move(ctx, s.ID, sandboxes.Resuming, sandboxes.Running, "pid = ?", m.PID())
			}
		}
		n.machineLost(ctx, s, sandboxes.Resuming)
		return nil
	})
	if err := o.Do("envd-init", func(ctx context.Context) error { return initEnvd(ctx, ep.GuestAddr(EnvdPort), s) }); err != nil {
		return err
	}
	phase("envd init")
	return nil
}

// rebootFromMemory boots a sandbox paused with memory again from its disk
// (the caller's record is resuming) without losing what its guest had not
// written to that disk yet: the memory is restored first, the guest syncs
// its disks and stops, and then it boots. That first part is an operation
// of its own (resume-sync): when anything in it fails the sandbox is
// paused as it was, and the boot goes on from the disk as it is, as asked
// (the memory may be the very thing that is broken, e.g. an envd that no
// longer answers).
func (n *Node) rebootFromMemory(o *operation.Op, s *sandboxes.Sandbox) error {
	dir := n.sandboxDir(s.ID)
	if rec, err := readPauseRecord(dir); err == nil && !rec.FilesystemOnly {
		first := operation.Start(o.Context(), "resume-sync", n.cfg.OperationTimeout, n.log)
		err := n.resumeMachine(first, s, false)
		if err == nil {
			err = n.pauseFilesystem(first.Context(), s, sandboxes.Resuming, first.Do)
		}
		if err = first.Finish(err); err != nil {
			n.log.Warn("a reboot could not sync the guest's disks first; it boots from the disk as it is", "sandbox", s.ID, "err", err)
		}
		// Paused again, with its memory (a failure) or without (synced):
		// the reboot takes it from there.
		if err := n.records.Move(o.Context(), s.ID, sandboxes.Paused, sandboxes.Resuming, ""); err != nil {
			return err
		}
	}
	return n.resumeMachine(o, s, true)
}

// rebootPaused resumes a sandbox paused without memory: it boots again on
// its disk (envd initialised as at create, the template's start command
// started again). Until the guest answers, a failure stops that QEMU and
// the sandbox stays paused; its disk only ever moves forward.
func (n *Node) rebootPaused(o *operation.Op, s *sandboxes.Sandbox) error {
	dir := n.sandboxDir(s.ID)
	phase := s.PhaseTimer()
	// The boot gets a fresh RAM file (sandbox dir/memory); kept memory,
	// if any, stays as it is until the guest runs: its own RAM file is set
	// aside, a mapped image stays where it is.
	memFile, memPrivate := s.MemFile, s.MemPrivate
	ram, keptRAM := filepath.Join(dir, memFileName), filepath.Join(dir, memFileName+".kept")
	if _, err := os.Stat(ram); err == nil {
		if err := os.Rename(ram, keptRAM); err != nil {
			return err
		}
	}
	o.OnFailure("keep the memory it had", func(context.Context) error {
		s.MemFile, s.MemPrivate = memFile, memPrivate
		if _, err := os.Stat(keptRAM); err == nil {
			return os.Rename(keptRAM, ram)
		}
		return os.Remove(ram) // the boot's
	})
	s.MemFile, s.MemPrivate = "", false
	ep, err := n.endpoint(s)
	if err != nil {
		return err
	}
	m, err := n.startMachine(o, s, ep, false, network.GuestKnows, phase) // a boot
	if err != nil {
		return err
	}
	if err := o.Do("boot", func(ctx context.Context) error {
		bctx, cancel := context.WithTimeout(ctx, n.cfg.BootTimeout)
		defer cancel()
		if err := waitEnvd(bctx, m, ep.GuestAddr(EnvdPort)); err != nil {
			return fmt.Errorf("%w%s", err, consoleTail(dir))
		}
		if err := initEnvd(bctx, ep.GuestAddr(EnvdPort), s); err != nil {
			return err
		}
		return n.mountVolumes(bctx, s) // a booted guest mounts them afresh
	}); err != nil {
		return err
	}
	phase("guest boot to envd")
	// The guest runs on its disk: a failure from here pauses it again.
	o.Settle()
	os.Remove(filepath.Join(dir, pauseRecordName))
	os.Remove(filepath.Join(dir, stateFileName))
	os.Remove(keptRAM) // the dropped memory
	o.OnFailure("pause again", func(ctx context.Context) error {
		if m := n.machines.get(s.ID); alive(m) && n.pauseFilesystem(ctx, s, sandboxes.Resuming, runStep(ctx)) == nil {
			return nil
		}
		// No guest to sync with: its disk is what it wrote so far, and
		// stays the sandbox's.
		_ = n.stopMachine(s.ID)
		if err := publishFilesystemPause(dir); err != nil {
			return err
		}
		return n.records.Move(ctx, s.ID, sandboxes.Resuming, sandboxes.Paused, setPausedWithoutMemory)
	})
	if t, err := n.Template(s.TemplateID); err == nil && t.StartCmd != "" {
		// As in a sandbox booted cold at create; a start command that does
		// not become ready is the template's failure, not the resume's.
		if err := o.Do("start command", func(ctx context.Context) error { return n.startAndWaitReady(ctx, n.withAddr(s), t) }); err != nil {
			n.log.Warn("the start command of a rebooted sandbox did not become ready", "sandbox", s.ID, "err", err)
		}
	}
	return nil
}

// startMachine opens the tap of s's network (building the network again
// if it is gone) and starts its QEMU (incoming: waiting for saved state),
// as the steps network and qemu-start of o.
func (n *Node) startMachine(o *operation.Op, s *sandboxes.Sandbox, ep *network.Endpoint, incoming bool, mode network.TapMode, phase func(string)) (*vmm.Machine, error) {
	// Never two QEMUs on one sandbox's files.
	n.dropHot(s.ID)
	var tap *os.File
	if err := o.Do("network", func(ctx context.Context) error {
		var err error
		tap, err = n.openTap(ctx, ep, mode)
		return err
	}); err != nil {
		return nil, err
	}
	defer tap.Close() // QEMU holds its own copy
	phase("network")
	var m *vmm.Machine
	if err := o.Do("qemu-start", func(ctx context.Context) error {
		var err error
		if m, err = vmm.Start(ctx, n.vmConfig(s, tap, incoming)); err != nil {
			return err
		}
		n.adopt(s.ID, m)
		s.PID = m.PID()
		return nil
	}); err != nil {
		return nil, err
	}
	phase("qemu start")
	return m, nil
}

// vmConfig is the machine of a sandbox; incoming restores saved state.
func (n *Node) vmConfig(s *sandboxes.Sandbox, tap *os.File, incoming bool) vmm.Config {
	dir := n.sandboxDir(s.ID)
	cfg := vmm.Config{
		QEMU:          n.cfg.QEMU,
		RunWithUser:   n.qemu.RunWithUser(),
		Accel:         n.cfg.Accel,
		VCPUs:         s.VCPUs,
		MemoryMiB:     s.MemoryMiB,
		Kernel:        n.cfg.Kernel,
		Initrd:        n.cfg.Initrd,
		Cmdline:       kernelCmdline(n.cfg.KernelArgs),
		RootDisk:      filepath.Join(dir, overlayName),
		MemFile:       n.ramFile(s),
		MAC:           network.GuestMAC,
		PrivateMemory: s.MemPrivate,
		RunDir:        dir,
		LogCap:        n.logCap(),
		TBSizeMiB:     n.cfg.TCGTranslationCacheMiB,
		Incoming:      incoming,
		Tap:           tap,

		NoFreePageReporting: n.cfg.NoFreePageReporting,
		User:                n.qemuUser(s),
		NetNS:               n.net.NamespacePath(s.ID),
		Cgroup:              n.qemuCgroup(s.ID),
		Limits:              n.limits(s),
		Jail:                n.jail(dir),
		VolumeSlots:         s.VolumeSlots,
		Volumes:             n.volumeDisks(s),
	}
	return cfg
}

// jail is what a QEMU sees of the data dir: its sandbox's directory and
// the shared stores it opens its disk chain, RAM image, kernel and lazily
// loaded layers from (files there are root's: QEMU opens them before it
// drops its ids). The database, the secrets, the admin socket, the
// repository, build files and every other sandbox are out of its sight,
// and it holds no copy of a mount it does not need (an open volume's
// filesystem, the other sandboxes' network namespaces).
func (n *Node) jail(sandboxDir string) vmm.Jail {
	root := n.cfg.DataDir
	return vmm.Jail{Hide: root, Keep: []string{sandboxDir,
		filepath.Join(root, store.LayersDir), filepath.Join(root, snapshotsDir),
		filepath.Join(root, "cache"), filepath.Join(root, "run"), filepath.Join(root, "templates")},
		Drop: []string{network.NetnsDir}}
}

// qemuUser is who a sandbox's QEMU runs as ("": root).
func (n *Node) qemuUser(s *sandboxes.Sandbox) string {
	if n.cfg.QEMUUIDBase > 0 {
		id := n.cfg.QEMUUIDBase + s.Slot
		return strconv.Itoa(id) + ":" + strconv.Itoa(id)
	}
	return n.cfg.QEMUUser
}

// ramFile is the file a sandbox's RAM maps: the snapshot image it runs on
// copy-on-write, or its own RAM file.
func (n *Node) ramFile(s *sandboxes.Sandbox) string {
	if s.MemFile != "" {
		return s.MemFile
	}
	return filepath.Join(n.sandboxDir(s.ID), memFileName)
}
