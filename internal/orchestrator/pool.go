package orchestrator

import (
	"context"
	"os"
	"path/filepath"
	"time"

	"github.com/agentenv/agentenv/internal/vmm"
)

// The pool keeps, per template snapshot, a few sandboxes prepared up to the
// last step: RAM image copied, disk overlay created, network namespace up,
// QEMU restored from the snapshot and running idle with a warmed-up envd.
// Creating a sandbox from the template then takes one and gives it the
// request's identity, env vars, clock and fresh entropy through envd /init. Pooled sandboxes are
// recorded (state "pooled", hidden from listings) so a restart cleans them.

// StatePooled marks a pre-started sandbox no user owns yet.
const StatePooled State = "pooled"

// PooledMarker is a file in the directory of every pooled sandbox, removed
// when a create claims it.
const PooledMarker = "pooled"

type pooledSandbox struct {
	s *Sandbox
	m *vmm.Machine
}

// takePooled hands out a pre-started sandbox of the snapshot, if any.
func (n *Node) takePooled(snapID string, vcpus, memMiB int) *pooledSandbox {
	n.mu.Lock()
	defer n.mu.Unlock()
	list := n.pool[snapID]
	for i, p := range list {
		if p.s.VCPUs == vcpus && p.s.MemoryMiB == memMiB {
			select {
			case <-p.m.Exited():
				continue // died while waiting; the exit watcher cleans it
			default:
			}
			n.pool[snapID] = append(list[:i:i], list[i+1:]...)
			return p
		}
	}
	return nil
}

// fillPool starts pooled sandboxes of a template snapshot until the
// configured number wait.
func (n *Node) fillPool(ctx context.Context, t *Template, ts *templateSnapshot) {
	for {
		n.mu.Lock()
		have := len(n.pool[ts.SnapshotID])
		n.mu.Unlock()
		if have >= n.cfg.PoolSize || ctx.Err() != nil {
			return
		}
		p, err := n.prestart(ctx, t, ts)
		if err != nil {
			n.log.Error("pre-start pooled sandbox", "template", t.Name, "err", err)
			return
		}
		n.mu.Lock()
		n.pool[ts.SnapshotID] = append(n.pool[ts.SnapshotID], p)
		n.mu.Unlock()
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
		n.poolMu.Lock()
		defer n.poolMu.Unlock()
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
	n.mu.Lock()
	slot, err := n.freeSlot(ctx)
	if err == nil {
		s.Slot = slot
		err = n.insertSandbox(ctx, s)
	}
	n.mu.Unlock()
	if err != nil {
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
	n.mu.Lock()
	var all []*pooledSandbox
	for id, list := range n.pool {
		all = append(all, list...)
		delete(n.pool, id)
	}
	n.mu.Unlock()
	for _, p := range all {
		n.destroy(ctx, p.s)
	}
}

// claimPooled turns a pooled sandbox into the one a create asked for:
// identity, limits and records from s, then network rules, device state,
// resume and envd init.
func (n *Node) claimPooled(ctx context.Context, s *Sandbox, p *pooledSandbox, ts *templateSnapshot) error {
	if err := os.Remove(filepath.Join(n.sandboxDir(s.ID), PooledMarker)); err != nil {
		return err
	}
	if !s.AllowInternet {
		ep, err := n.endpoint(s)
		if err != nil {
			return err
		}
		if err := n.net.SetInternet(ctx, ep, false); err != nil {
			return err
		}
	}
	ep, err := n.endpoint(s)
	if err != nil {
		return err
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
	if err := m.LoadState(ctx, filepath.Join(n.cfg.DataDir, snapshotsDir, snapID, snapStateName)); err != nil {
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
