package orchestrator

import (
	"context"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/agentenv/agentenv/internal/vmm"
)

// The pool keeps, per template snapshot, a few sandboxes prepared up to the
// last step: RAM image copied, disk overlay created, network namespace up,
// QEMU restored from the snapshot and running idle with a warmed-up envd.
// Creating a sandbox from the template then takes one and gives it the
// request's identity, env vars, clock and fresh entropy through envd /init.
// Pooled sandboxes are recorded (state "pooled", hidden from listings, their
// record holding the template snapshot in the store) so a restart cleans
// them. A pooled QEMU that dies leaves the pool and is replaced; when a
// template's snapshot changes (a rebuild), the entries of the old one go.

// StatePooled marks a pre-started sandbox no user owns yet.
const StatePooled State = "pooled"

// PooledMarker is a file in the directory of every pooled sandbox, removed
// when a create claims it.
const PooledMarker = "pooled"

type pooledSandbox struct {
	s *Sandbox
	m *vmm.Machine
}

// warmPool is the node's pre-started sandboxes, by template snapshot.
type warmPool struct {
	mu      sync.Mutex
	entries map[string][]*pooledSandbox // guarded by mu
	filling sync.Mutex                  // one filler at a time
}

func newWarmPool() *warmPool { return &warmPool{entries: map[string][]*pooledSandbox{}} }

// take hands out a live pre-started sandbox of the snapshot, if any.
func (p *warmPool) take(snapID string, vcpus, memMiB int) *pooledSandbox {
	p.mu.Lock()
	defer p.mu.Unlock()
	list := p.entries[snapID]
	for i, e := range list {
		if e.s.VCPUs != vcpus || e.s.MemoryMiB != memMiB {
			continue
		}
		select {
		case <-e.m.Exited():
			continue // died while waiting; its exit watcher removes it
		default:
		}
		p.entries[snapID] = append(list[:i:i], list[i+1:]...)
		return e
	}
	return nil
}

func (p *warmPool) add(snapID string, e *pooledSandbox) {
	p.mu.Lock()
	p.entries[snapID] = append(p.entries[snapID], e)
	p.mu.Unlock()
}

func (p *warmPool) size(snapID string) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.entries[snapID])
}

// remove takes sandbox id out of the pool; it reports whether it was in.
func (p *warmPool) remove(id string) (*pooledSandbox, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for snap, list := range p.entries {
		for i, e := range list {
			if e.s.ID == id {
				p.entries[snap] = append(list[:i:i], list[i+1:]...)
				return e, true
			}
		}
	}
	return nil, false
}

// takeAll empties the pool of the entries keep rejects.
func (p *warmPool) takeAll(drop func(snapID string, e *pooledSandbox) bool) []*pooledSandbox {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []*pooledSandbox
	for snap, list := range p.entries {
		var kept []*pooledSandbox
		for _, e := range list {
			if drop(snap, e) {
				out = append(out, e)
			} else {
				kept = append(kept, e)
			}
		}
		if len(kept) == 0 {
			delete(p.entries, snap)
		} else {
			p.entries[snap] = kept
		}
	}
	return out
}

// drainStalePool kills the pooled sandboxes of template snapshots that are no
// template's current one (the template was rebuilt or deleted).
func (n *Node) drainStalePool(ctx context.Context) {
	current := map[string]bool{}
	if ls, err := n.store.Labels(ctx, templateSnapshotLabel); err == nil {
		for _, l := range ls {
			current[l.Object] = true
		}
	}
	for _, e := range n.pool.takeAll(func(snap string, _ *pooledSandbox) bool { return !current[snap] }) {
		n.log.Info("pooled sandbox of an old template snapshot removed", "sandbox", e.s.ID, "template", e.s.TemplateID)
		n.destroy(ctx, e.s)
	}
}

// fillPool starts pooled sandboxes of a template snapshot until the
// configured number wait.
func (n *Node) fillPool(ctx context.Context, t *Template, ts *templateSnapshot) {
	for n.pool.size(ts.SnapshotID) < n.cfg.PoolSize && ctx.Err() == nil {
		if cur, err := n.currentTemplateSnapshot(t); err != nil || cur.SnapshotID != ts.SnapshotID {
			return // the template changed meanwhile
		}
		p, err := n.prestart(ctx, t, ts)
		if err != nil {
			n.log.Error("pre-start pooled sandbox", "template", t.Name, "err", err)
			return
		}
		n.pool.add(ts.SnapshotID, p)
	}
}

// refillPool tops the pool of a template up in the background.
func (n *Node) refillPool(t *Template, ts *templateSnapshot) {
	if n.cfg.PoolSize == 0 {
		return
	}
	n.wg.Add(1)
	go func() {
		defer n.wg.Done()
		ctx, cancel := n.stopContext()
		defer cancel()
		n.pool.filling.Lock()
		defer n.pool.filling.Unlock()
		n.fillPool(ctx, t, ts)
	}()
}

func (n *Node) prestart(ctx context.Context, t *Template, ts *templateSnapshot) (*pooledSandbox, error) {
	now := time.Now().UTC().Truncate(time.Millisecond)
	s := &Sandbox{
		ID: NewSandboxID(), TemplateID: t.Name, State: StatePooled, VCPUs: ts.VCPUs, MemoryMiB: ts.MemoryMiB,
		DiskMiB: t.DiskMiB, AllowInternet: true, PublicTraffic: true, DefaultUser: t.DefaultUser, SnapshotID: ts.SnapshotID,
		CreatedAt: now, StartedAt: now, EndAt: now,
	}
	if err := n.recordNew(ctx, s); err != nil {
		return nil, err
	}
	m, err := func() (*vmm.Machine, error) {
		if err := n.makePooledDir(s.ID); err != nil {
			return nil, err
		}
		if err := n.copySnapshotRAM(ts.SnapshotID, s.ID); err != nil {
			return nil, err
		}
		m, err := n.startIncoming(ctx, s, ts.SnapshotID)
		if err != nil {
			return m, err
		}
		return m, n.warmUp(ctx, s, m, ts.SnapshotID)
	}()
	if err != nil {
		n.destroy(context.WithoutCancel(ctx), s)
		return nil, err
	}
	return &pooledSandbox{s: s, m: m}, nil
}

// poolMachineExited cleans up after a pooled QEMU that died and tops the
// pool up again.
func (n *Node) poolMachineExited(id string, m *vmm.Machine) {
	e, ok := n.pool.remove(id)
	if !ok || e.m != m {
		return
	}
	n.log.Warn("a pooled sandbox's QEMU exited; replacing it", "sandbox", id, "exit", m.ExitErr())
	ctx := context.Background()
	n.destroy(ctx, e.s)
	t, err := n.Template(e.s.TemplateID)
	if err != nil {
		return
	}
	if ts, err := n.currentTemplateSnapshot(t); err == nil && ts.SnapshotID == e.s.SnapshotID {
		n.refillPool(t, ts)
	}
}

// makePooledDir creates the directory of a pooled sandbox with its marker
// already inside: it is made under a hidden name and renamed into place, so
// no one listing the sandboxes ever sees it unmarked (a crash leaves only the
// hidden name, which recovery removes as an orphan).
func (n *Node) makePooledDir(id string) error {
	dir := n.sandboxDir(id)
	tmp := filepath.Join(filepath.Dir(dir), "."+id+".new")
	if err := os.MkdirAll(tmp, 0o700); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(tmp, PooledMarker), nil, 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, dir)
}

// drainPool kills every pooled sandbox (on close).
func (n *Node) drainPool(ctx context.Context) {
	for _, e := range n.pool.takeAll(func(string, *pooledSandbox) bool { return true }) {
		n.destroy(ctx, e.s)
	}
}

// claimPooled turns a pooled sandbox into the one a create asked for:
// identity, limits and records from s, then network rules and envd init.
func (n *Node) claimPooled(ctx context.Context, s *Sandbox) error {
	if err := os.Remove(filepath.Join(n.sandboxDir(s.ID), PooledMarker)); err != nil {
		return err
	}
	ep, err := n.endpoint(s)
	if err != nil {
		return err
	}
	if !s.AllowInternet {
		if err := n.net.SetInternet(ctx, ep, false); err != nil {
			return err
		}
	}
	phase := s.phaseTimer()
	if err := initEnvdAs(ctx, ep.GuestAddr(EnvdPort), s, "", true); err != nil {
		return err
	}
	phase("envd init")
	return nil
}

// warmUp restores the snapshot into a pooled machine and lets it run, idle,
// with a few requests to envd: under TCG the first request after a restore
// pays for translating the guest's network stack and envd afresh, and this
// moves that cost out of the create path. The guest has no identity yet:
// no token, env vars or user, until a create claims it and sends /init.
func (n *Node) warmUp(ctx context.Context, s *Sandbox, m *vmm.Machine, snapID string) error {
	if err := m.LoadState(ctx, filepath.Join(n.snapshotDir(snapID), snapStateName)); err != nil {
		return err
	}
	if err := m.Resume(ctx); err != nil {
		return err
	}
	ep, err := n.endpoint(s)
	if err != nil {
		return err
	}
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	for i := 0; i < 3; i++ {
		if err := waitEnvd(wctx, m, ep.GuestAddr(EnvdPort)); err != nil {
			return err
		}
	}
	return nil
}
