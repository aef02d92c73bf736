package orchestrator

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"sort"
	"sync"
	"syscall"
	"time"

	"github.com/agentenv/agentenv/internal/operation"
	"github.com/agentenv/agentenv/internal/sandboxes"
	"github.com/agentenv/agentenv/internal/vmm"
)

// Hot pause. Once a pause has written a sandbox's state to disk exactly as
// a cold pause does, its QEMU may stay, stopped (no vCPU runs, no CPU is
// spent), within a node-wide budget of guest memory (Config.HotPausedMiB,
// the least recently paused demoted first) and for a while
// (Config.HotPausedFor). Resuming it is then continuing that QEMU and
// setting the guest's clock: no new process, no state to load, and under
// TCG none of the guest's code to translate again. The copy on disk stays
// the truth: a restart or crash of the node, a kill, any operation that
// starts another QEMU for the sandbox, another node's claim of its shared
// copy (each ends in stopMachine or startMachine), and any change to the
// files the stopped QEMU holds drop the hot copy, and the resume is cold.

// hotCopy is the stopped QEMU of a paused sandbox.
type hotCopy struct {
	m        *vmm.Machine
	bytes    int64 // guest memory it holds
	pausedAt time.Time
	// files are the files the QEMU writes when it runs, as the pause
	// left them, and record the pause it belongs to.
	files  []fileStamp
	record pauseRecord
}

// fileStamp identifies a file's content as far as the node can tell
// without reading it: the same inode, size and modification time.
type fileStamp struct {
	path     string
	dev, ino uint64
	size     int64
	mtime    time.Time
}

func stampFile(path string) (fileStamp, error) {
	st, err := os.Stat(path)
	if err != nil {
		return fileStamp{}, err
	}
	sys, ok := st.Sys().(*syscall.Stat_t)
	if !ok {
		return fileStamp{}, errors.New("no inode")
	}
	return fileStamp{path: path, dev: uint64(sys.Dev), ino: sys.Ino, size: st.Size(), mtime: st.ModTime()}, nil
}

// hotPaused is the node's table of hot copies.
type hotPaused struct {
	mu     sync.Mutex
	budget int64         // bytes of guest memory; <= 0: no hot pause
	ttl    time.Duration // how long a copy stays
	copies map[string]*hotCopy
	now    func() time.Time
}

func newHotPaused(budgetMiB int, ttl time.Duration) *hotPaused {
	return &hotPaused{budget: int64(budgetMiB) << 20, ttl: ttl, copies: map[string]*hotCopy{}, now: time.Now}
}

func (h *hotPaused) enabled() bool { return h.budget > 0 }

// keep holds c as id's hot copy and returns the machines to stop: the
// least recently paused copies the budget has no room for any more, or c's
// own when it alone is larger than the budget.
func (h *hotPaused) keep(id string, c *hotCopy) []*vmm.Machine {
	h.mu.Lock()
	defer h.mu.Unlock()
	var out []*vmm.Machine
	if old := h.copies[id]; old != nil {
		out = append(out, old.m)
		delete(h.copies, id)
	}
	if !h.enabled() || c.bytes > h.budget {
		return append(out, c.m)
	}
	h.copies[id] = c
	var used int64
	for _, o := range h.copies {
		used += o.bytes
	}
	if used <= h.budget {
		return out
	}
	ids := make([]string, 0, len(h.copies))
	for k := range h.copies {
		ids = append(ids, k)
	}
	sort.Slice(ids, func(i, j int) bool { return h.copies[ids[i]].pausedAt.Before(h.copies[ids[j]].pausedAt) })
	for _, k := range ids {
		if used <= h.budget {
			break
		}
		if k == id {
			continue
		}
		used -= h.copies[k].bytes
		out = append(out, h.copies[k].m)
		delete(h.copies, k)
	}
	return out
}

// has reports whether id has a hot copy.
func (h *hotPaused) has(id string) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.copies[id] != nil
}

// take removes and returns id's hot copy (nil if none).
func (h *hotPaused) take(id string) *hotCopy {
	h.mu.Lock()
	defer h.mu.Unlock()
	c := h.copies[id]
	delete(h.copies, id)
	return c
}

// expired removes and returns the machines of copies kept longer than the
// table's time.
func (h *hotPaused) expired() []*vmm.Machine {
	h.mu.Lock()
	defer h.mu.Unlock()
	var out []*vmm.Machine
	for id, c := range h.copies {
		if h.now().Sub(c.pausedAt) >= h.ttl {
			out = append(out, c.m)
			delete(h.copies, id)
		}
	}
	return out
}

// bytes is the guest memory the hot copies hold.
func (h *hotPaused) bytes() int64 {
	h.mu.Lock()
	defer h.mu.Unlock()
	var sum int64
	for _, c := range h.copies {
		sum += c.bytes
	}
	return sum
}

// machines returns every hot copy's machine (the node closes).
func (h *hotPaused) machines() []*vmm.Machine {
	h.mu.Lock()
	defer h.mu.Unlock()
	out := make([]*vmm.Machine, 0, len(h.copies))
	for _, c := range h.copies {
		out = append(out, c.m)
	}
	return out
}

// hotFiles are the files of a paused sandbox its QEMU writes when it runs.
func (n *Node) hotFiles(s *sandboxes.Sandbox) []string {
	dir := n.sandboxDir(s.ID)
	files := []string{filepath.Join(dir, overlayName)}
	if !s.MemPrivate {
		files = append(files, filepath.Join(dir, memFileName))
	}
	return files
}

// keepHot keeps the stopped QEMU of a sandbox just paused (rec published,
// its record paused) as its hot copy, or stops it when the node keeps none
// or has no room.
func (n *Node) keepHot(s *sandboxes.Sandbox, rec pauseRecord) {
	m := n.machines.take(s.ID)
	if m == nil {
		return
	}
	stop := []*vmm.Machine{m}
	if n.hot.enabled() && alive(m) {
		c := &hotCopy{m: m, bytes: int64(s.MemoryMiB) << 20, pausedAt: time.Now(), record: rec}
		var err error
		for _, f := range n.hotFiles(s) {
			st, serr := stampFile(f)
			if serr != nil {
				err = serr
			}
			c.files = append(c.files, st)
		}
		if err == nil {
			stop = n.hot.keep(s.ID, c)
		}
	}
	for _, m := range stop {
		if err := m.Kill(); err != nil {
			n.log.Warn("stop the QEMU of a paused sandbox", "err", err)
		}
	}
}

// dropHot stops id's hot copy, if it has one.
func (n *Node) dropHot(id string) {
	if c := n.hot.take(id); c != nil {
		_ = c.m.Kill()
	}
}

// takeHot returns id's hot copy when it can still resume: its QEMU is
// there and stopped, the pause on disk is the one it stopped at, and its
// files are as the pause left them. A copy that cannot is stopped.
func (n *Node) takeHot(ctx context.Context, s *sandboxes.Sandbox, rec *pauseRecord) *hotCopy {
	c := n.hot.take(s.ID)
	if c == nil {
		return nil
	}
	usable := alive(c.m) && rec.StateSHA256 == c.record.StateSHA256 && rec.PausedAt.Equal(c.record.PausedAt)
	for _, f := range c.files {
		if st, err := stampFile(f.path); err != nil || st != f {
			usable = false
		}
	}
	if usable {
		// Stopped by the pause (postmigrate after the state was written).
		if st, err := c.m.Status(ctx); err != nil || (st != "postmigrate" && st != "paused") {
			usable = false
		}
	}
	if !usable {
		n.log.Info("a hot paused copy cannot resume; resuming from disk", "sandbox", s.ID)
		_ = c.m.Kill()
		return nil
	}
	return c
}

// resumeHot runs a hot copy again: its QEMU goes back into the node's
// table and continues. A failure before the guest runs stops that QEMU
// and the sandbox stays paused on disk (resumeMachine's "stay paused").
func (n *Node) resumeHot(o *operation.Op, s *sandboxes.Sandbox, c *hotCopy, phase func(string)) error {
	ep, err := n.endpoint(s)
	if err != nil {
		return err
	}
	n.machines.set(s.ID, c.m)
	s.PID = c.m.PID()
	phase("hot copy")
	if err := o.Do("resume-vcpus", func(ctx context.Context) error { return c.m.Resume(ctx) }); err != nil {
		return err
	}
	phase("resume vcpus")
	return n.guestRuns(o, s, ep, phase)
}

// hotExpiryLoop stops, now and then, the hot copies kept long enough.
func (n *Node) hotExpiryLoop() {
	defer n.wg.Done()
	for {
		select {
		case <-n.stop:
			return
		case <-time.After(5 * time.Second):
		}
		for _, m := range n.hot.expired() {
			_ = m.Kill()
		}
	}
}
