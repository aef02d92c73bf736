package orchestrator

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"time"

	"github.com/agentenv/agentenv/internal/faults"
	"github.com/agentenv/agentenv/internal/network"
	"github.com/agentenv/agentenv/internal/storage"
	"github.com/agentenv/agentenv/internal/vmm"
)

// stateFileName holds a paused sandbox's device state; its RAM is in
// memFileName and its disk in overlayName, all in the sandbox directory.
const stateFileName = "devices.vmstate"

// Pause stops a running sandbox and keeps it on disk: the guest's vCPUs are
// stopped, its device state is saved beside its RAM file (guest memory is a
// shared file mapping, so only devices need writing), and QEMU exits, freeing
// its memory and CPU. Resume brings it back where it stopped.
func (n *Node) Pause(ctx context.Context, id string) (*Sandbox, error) {
	unlock := n.lockOp(id)
	defer unlock()
	s, err := n.loadSandbox(ctx, id)
	if err != nil {
		return nil, err
	}
	if s.State == StatePaused {
		return nil, fmt.Errorf("%w: sandbox %s is already paused", ErrConflict, id)
	}
	if err := n.transition(ctx, id, StatePausing, StateRunning); err != nil {
		return nil, err
	}
	start := time.Now()
	if err := n.pause(ctx, s); err != nil {
		// The machine is still there and may still run: put it back.
		n.log.Error("pause failed; resuming the sandbox", "sandbox", id, "err", err)
		if m := n.machine(id); m != nil {
			_ = m.Resume(context.WithoutCancel(ctx))
		}
		_ = n.transition(context.WithoutCancel(ctx), id, StateRunning, StatePausing)
		return nil, fmt.Errorf("pause %s: %w", id, err)
	}
	if err := n.setFields(ctx, id, "state = ?, pid = 0", StatePaused); err != nil {
		return nil, err
	}
	s.State, s.PID = StatePaused, 0
	n.log.Info("sandbox paused", "sandbox", id, "took", time.Since(start).Round(time.Microsecond))
	if n.sharesPaused() {
		n.sharePausedLater(id)
	}
	return n.withAddr(s), nil
}

func (n *Node) machine(id string) *vmm.Machine {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.machines[id]
}

// stopMachine kills a sandbox's QEMU, if the node holds one. The machine
// leaves the map before it exits, so the exit watcher does not take the exit
// for a crash.
func (n *Node) stopMachine(id string) error {
	n.mu.Lock()
	m := n.machines[id]
	delete(n.machines, id)
	n.mu.Unlock()
	if m == nil {
		return nil
	}
	return m.Kill()
}

func (n *Node) pause(ctx context.Context, s *Sandbox) error {
	m := n.machine(s.ID)
	if m == nil {
		return errors.New("no running machine")
	}
	dir := n.sandboxDir(s.ID)
	phase := s.phaseTimer()
	if err := m.Pause(ctx); err != nil {
		return err
	}
	phase("stop vcpus")
	tmp := filepath.Join(dir, stateFileName+".tmp")
	_ = os.Remove(tmp)
	var sum string // of the state, if known as it was written
	if s.MemPrivate {
		// Copy-on-write RAM is no file of the sandbox's own: the pages that
		// differ from the image it maps go into the state.
		st, err := m.SaveStateDiff(ctx, tmp, n.ramFile(s))
		if err != nil {
			return err
		}
		sum = st.SHA256
		n.log.Info("incremental memory state", "sandbox", s.ID, "pages", st.PagesKept, "of", st.PagesSent, "bytes", st.Bytes)
		phase("save state and changed RAM")
	} else {
		if err := m.SaveState(ctx, tmp); err != nil {
			return err
		}
		phase("save device state")
	}
	// A completed migration has flushed and released the disk, so QEMU has
	// nothing left to write: kill it rather than wait for an orderly quit.
	if err := n.stopMachine(s.ID); err != nil {
		return err
	}
	phase("qemu exit")
	// QEMU has flushed the disk and RAM file mappings; make them and the
	// state durable, then publish the state file.
	files := []string{overlayName}
	if !s.MemPrivate {
		files = append(files, memFileName, stateFileName+".tmp")
	}
	for _, f := range files {
		if err := syncFile(filepath.Join(dir, f)); err != nil {
			return err
		}
	}
	if sum == "" {
		var err error
		if sum, err = fileSHA256(tmp); err != nil {
			return err
		}
	}
	// The record is written first, then the state file takes its final
	// name: a state file under its final name always has a valid record.
	rec := pauseRecord{StateSHA256: sum, RAMInState: s.MemPrivate, RAMDiff: s.MemPrivate, PausedAt: time.Now().UTC()}
	if err := writeJSONAtomic(filepath.Join(dir, pauseRecordName), rec); err != nil {
		return err
	}
	if err := os.Rename(tmp, filepath.Join(dir, stateFileName)); err != nil {
		return err
	}
	faults.Point(faults.PauseSaved)
	phase("sync to disk")
	return nil
}

const pauseRecordName = "paused.json"

// pauseRecord describes a paused sandbox's saved state.
type pauseRecord struct {
	StateSHA256 string `json:"stateSHA256"`
	RAMInState  bool   `json:"ramInState"`
	// RAMDiff: the RAM in the state is only what differs from the image
	// the sandbox maps (its mem_file), loaded over that image.
	RAMDiff  bool      `json:"ramDiff,omitempty"`
	PausedAt time.Time `json:"pausedAt"`
}

func fileSHA256(path string) (string, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return "", fmt.Errorf("checksum %s: %w", path, err)
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}

func writeJSONAtomic(path string, v any) error {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	return storage.WriteFileAtomic(path, append(b, '\n'), 0o600)
}

// verifyPausedState checks that a paused sandbox has every file its pause
// record needs (its RAM file, or the image its copy-on-write RAM maps) and
// that the saved state matches its checksum.
func (n *Node) verifyPausedState(s *Sandbox) error {
	dir := n.sandboxDir(s.ID)
	rec, err := readPauseRecord(dir)
	if err != nil {
		return err
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
	sum, err := fileSHA256(filepath.Join(dir, stateFileName))
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
func (n *Node) openTap(ctx context.Context, ep *network.Endpoint) (*os.File, error) {
	tap, err := n.net.OpenTap(ep)
	if err == nil {
		return tap, nil
	}
	if err := n.net.Setup(ctx, ep); err != nil {
		return nil, err
	}
	return n.net.OpenTap(ep)
}

func syncFile(path string) error {
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	if err := f.Sync(); err != nil {
		return fmt.Errorf("sync %s: %w", path, err)
	}
	return nil
}

// Resume restarts a paused sandbox exactly where it stopped and gives it a
// new time to live (0: the node's default). envd gets a fresh /init so the
// guest's wall clock is corrected.
func (n *Node) Resume(ctx context.Context, id string, timeout time.Duration) (*Sandbox, error) {
	if timeout == 0 {
		timeout = n.cfg.DefaultTimeout
	}
	if timeout < 0 || timeout > n.cfg.MaxTimeout {
		return nil, fmt.Errorf("%w: timeout must be between 1s and %s", ErrInvalid, n.cfg.MaxTimeout)
	}
	unlock := n.lockOp(id)
	defer unlock()
	s, err := n.loadSandbox(ctx, id)
	if errors.Is(err, ErrNotFound) && n.sharesPaused() {
		s, err = n.adoptShared(ctx, id) // paused on another node, in shared storage
	}
	if err != nil {
		return nil, err
	}
	if s.State == StateRunning {
		return nil, fmt.Errorf("%w: sandbox %s is already running", ErrConflict, id)
	}
	if s.State == StatePaused {
		if err := n.takeBackShared(ctx, s); err != nil {
			return nil, err
		}
	}
	if err := n.transition(ctx, id, StateResuming, StatePaused); err != nil {
		return nil, err
	}
	start := time.Now()
	if err := n.resume(ctx, s); err != nil {
		// Nothing of the paused state was changed: the sandbox stays paused.
		_ = n.stopMachine(id)
		_ = n.transition(context.WithoutCancel(ctx), id, StatePaused, StateResuming)
		return nil, fmt.Errorf("resume %s: %w", id, err)
	}
	now := time.Now().UTC().Truncate(time.Millisecond)
	s.StartedAt, s.EndAt, s.State = now, now.Add(timeout), StateRunning
	if err := n.setFields(ctx, id, "state = ?, pid = ?, started_at = ?, end_at = ?",
		StateRunning, s.PID, s.StartedAt.UnixMilli(), s.EndAt.UnixMilli()); err != nil {
		return nil, err
	}
	n.log.Info("sandbox resumed", "sandbox", id, "took", time.Since(start).Round(time.Microsecond))
	return n.withAddr(s), nil
}

func (n *Node) resume(ctx context.Context, s *Sandbox) error {
	dir := n.sandboxDir(s.ID)
	state := filepath.Join(dir, stateFileName)
	if err := n.verifyPausedState(s); err != nil {
		return err
	}
	phase := s.phaseTimer()
	ep, err := n.endpoint(s)
	if err != nil {
		return err
	}
	tap, err := n.openTap(ctx, ep)
	if err != nil {
		return err
	}
	defer tap.Close()
	phase("network")
	m, err := vmm.Start(ctx, n.vmConfig(s, tap, true))
	if err != nil {
		return err
	}
	n.adopt(s.ID, m)
	s.PID = m.PID()
	phase("qemu start")
	rec, err := readPauseRecord(dir)
	if err != nil {
		return err
	}
	load := m.LoadState
	if rec.RAMDiff {
		load = m.LoadFullState
	}
	if err := load(ctx, state); err != nil {
		return err
	}
	phase("load state")
	if err := m.Resume(ctx); err != nil {
		return err
	}
	phase("resume vcpus")
	if err := initEnvd(ctx, ep.GuestAddr(EnvdPort), s); err != nil {
		return err
	}
	phase("envd init")
	return nil
}

// vmConfig is the machine of a sandbox; incoming restores saved state.
func (n *Node) vmConfig(s *Sandbox, tap *os.File, incoming bool) vmm.Config {
	dir := n.sandboxDir(s.ID)
	cfg := vmm.Config{
		QEMU:          n.cfg.QEMU,
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
		TBSizeMiB:     n.cfg.TCGTranslationCacheMiB,
		Incoming:      incoming,
		Tap:           tap,

		NoFreePageReporting: n.cfg.NoFreePageReporting,
		User:                n.cfg.QEMUUser,
		Cgroup:              n.qemuCgroup(s.ID),
		Limits:              n.limits(s),
	}
	return cfg
}

// ramFile is the file a sandbox's RAM maps: the snapshot image it runs on
// copy-on-write, or its own RAM file.
func (n *Node) ramFile(s *Sandbox) string {
	if s.MemFile != "" {
		return s.MemFile
	}
	return filepath.Join(n.sandboxDir(s.ID), memFileName)
}
