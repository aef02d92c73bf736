package orchestrator

import (
	"context"
	"runtime"
	"sort"

	"github.com/agentenv/agentenv/internal/admission"
	"github.com/agentenv/agentenv/internal/sandboxes"
	"github.com/agentenv/agentenv/internal/sharing"
	"golang.org/x/sys/unix"
)

// Capacity is what a node tells a scheduler about itself.
type Capacity struct {
	CPUs                                   int
	MemoryTotalBytes, MemoryAvailableBytes int64
	// SandboxMemoryBytes is the guest RAM of the running sandboxes.
	SandboxMemoryBytes int64
	// DiskFreeBytes is free space under the data dir.
	DiskFreeBytes   int64
	Running, Paused int
	// Templates can start here without fetching anything.
	Templates []string
	Sandboxes []SandboxState
	// SharedPaused are paused sandboxes in shared storage.
	SharedPaused []string
}

// SandboxState is one sandbox in a capacity report.
type SandboxState struct {
	ID, TemplateID string
	State          sandboxes.State
}

// Capacity reports the node's resources and sandboxes (cheap enough to
// call every few seconds: no per-process accounting).
func (n *Node) Capacity(ctx context.Context) (*Capacity, error) {
	all, err := n.List(ctx)
	if err != nil {
		return nil, err
	}
	c := &Capacity{CPUs: runtime.NumCPU()}
	if c.MemoryTotalBytes, c.MemoryAvailableBytes, err = hostMemory(); err != nil {
		return nil, err
	}
	var st unix.Statfs_t
	if err := unix.Statfs(n.cfg.DataDir, &st); err == nil {
		c.DiskFreeBytes = int64(st.Bavail) * int64(st.Bsize)
	}
	for _, s := range all {
		// A sandbox in the middle of a snapshot, fork, pause or resume
		// still holds its memory here.
		state := sandboxes.Running
		switch s.State {
		case sandboxes.Running, sandboxes.Snapshotting, sandboxes.Forking, sandboxes.Pausing, sandboxes.Resuming:
			c.Running++
			c.SandboxMemoryBytes += int64(s.MemoryMiB) << 20
		case sandboxes.Paused:
			state = sandboxes.Paused
			c.Paused++
			if _, ok := sharing.ReadMark(n.sandboxDir(s.ID)); ok {
				c.SharedPaused = append(c.SharedPaused, s.ID)
			}
		default:
			continue
		}
		c.Sandboxes = append(c.Sandboxes, SandboxState{ID: s.ID, TemplateID: s.TemplateID, State: state})
	}
	ts, err := n.Templates()
	if err != nil {
		return nil, err
	}
	for _, t := range ts {
		c.Templates = append(c.Templates, t.Name)
	}
	sort.Strings(c.Templates)
	return c, nil
}

// newAdmission makes the node's admission of starts from its limits.
func newAdmission(cfg Config, committed admission.Committed) (*admission.Controller, error) {
	limits := admission.Limits{MaxStarting: max(cfg.MaxStarting, 0), Wait: cfg.AdmissionWait}
	if cfg.Overcommit > 0 {
		total, _, err := hostMemory()
		if err != nil {
			return nil, err
		}
		limits.MemoryBytes = int64(float64(total) * cfg.Overcommit)
	}
	return admission.New(limits, committed), nil
}

// committedMemory is the guest memory of the sandboxes that hold it and
// are not starting (creates, resumes and forks hold admission tickets for
// theirs), and of the hot paused copies.
func (n *Node) committedMemory(ctx context.Context) (int64, error) {
	all, err := n.records.List(ctx, "state IN (?, ?, ?, ?)",
		sandboxes.Running, sandboxes.Pausing, sandboxes.Snapshotting, sandboxes.Forking)
	if err != nil {
		return 0, err
	}
	// Hot paused copies hold theirs too.
	sum := n.hot.bytes()
	for _, s := range all {
		sum += int64(s.MemoryMiB) << 20
	}
	return sum, nil
}

// admit waits for a start's turn within the node's limits (see package
// admission); the ticket's Done ends it. A node below its floor of free
// disk space refuses the start at once (see package diskspace).
func (n *Node) admit(ctx context.Context, what string, count, memoryMiB int) (*admission.Ticket, error) {
	if err := n.floor.Check(what); err != nil {
		return nil, err
	}
	return n.admission.Admit(ctx, what, count, int64(memoryMiB)<<20)
}

// DiskRoom refuses what (e.g. "an upload") with an errkind.ErrNoSpace
// while the node is below its floor of free disk space.
func (n *Node) DiskRoom(what string) error { return n.floor.Check(what) }
