package orchestrator

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"time"

	"github.com/agentenv/agentenv/internal/sandboxes"
	"github.com/agentenv/agentenv/internal/vmm"
	"github.com/agentenv/agentenv/internal/warmpool"
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

// PooledMarker is a file in the directory of every pooled sandbox, removed
// when a create claims it.
const PooledMarker = "pooled"

// pooledSandbox is an entry of the node's warm pool: a pre-started sandbox
// and its running machine.
type pooledSandbox struct {
	s *sandboxes.Sandbox
	m *vmm.Machine
}

func (e *pooledSandbox) ID() string { return e.s.ID }

func (e *pooledSandbox) Fits(vcpus, memMiB int) bool {
	return e.s.VCPUs == vcpus && e.s.MemoryMiB == memMiB
}

func (e *pooledSandbox) Exited() <-chan struct{} { return e.m.Exited() }

// poolKey names the pool entries of a template's snapshot.
func poolKey(t *Template, ts *templateSnapshot) warmpool.Key {
	return warmpool.Key{Template: t.Name, Snapshot: ts.SnapshotID}
}

// poolStarter makes and tears down the node's pool entries.
type poolStarter struct{ n *Node }

// Start pre-starts a sandbox of the key's template snapshot, while it is
// still the template's current one.
func (p poolStarter) Start(ctx context.Context, key warmpool.Key) (*pooledSandbox, error) {
	t, err := p.n.Template(key.Template)
	if errors.Is(err, ErrNotFound) {
		return nil, warmpool.ErrStale
	}
	if err != nil {
		return nil, err
	}
	ts, err := p.n.currentTemplateSnapshot(t)
	if err != nil || ts.SnapshotID != key.Snapshot {
		return nil, warmpool.ErrStale
	}
	return p.n.prestart(ctx, t, ts)
}

// Discard kills a pooled sandbox and forgets it.
func (p poolStarter) Discard(ctx context.Context, e *pooledSandbox) { p.n.destroy(ctx, e.s) }

// drainStalePool kills the pooled sandboxes of template snapshots that are no
// template's current one (the template was rebuilt or deleted).
func (n *Node) drainStalePool(ctx context.Context) {
	current := map[string]bool{}
	ls, err := n.store.Labels(ctx, templateSnapshotLabel)
	if err != nil {
		n.log.Error("list template snapshots", "err", err)
		return
	}
	for _, l := range ls {
		current[l.Object] = true
	}
	n.pool.DrainStale(ctx, func(k warmpool.Key) bool { return current[k.Snapshot] })
}

func (n *Node) prestart(ctx context.Context, t *Template, ts *templateSnapshot) (*pooledSandbox, error) {
	now := time.Now().UTC().Truncate(time.Millisecond)
	s := &sandboxes.Sandbox{
		ID: NewSandboxID(), TemplateID: t.Name, State: sandboxes.Pooled, VCPUs: ts.VCPUs, MemoryMiB: ts.MemoryMiB,
		DiskMiB: t.DiskMiB, AllowInternet: true, PublicTraffic: true, DefaultUser: t.DefaultUser, DefaultWorkdir: t.DefaultWorkdir, SnapshotID: ts.SnapshotID,
		VolumeSlots: ts.VolumeSlots,
		CreatedAt:   now, StartedAt: now, EndAt: now,
	}
	return n.startPooled(ctx, s, func() (*vmm.Machine, error) {
		if err := n.copySnapshotRAM(ts.SnapshotID, s.ID); err != nil {
			return nil, err
		}
		m, err := n.startIncoming(ctx, s, ts.SnapshotID, false)
		if err != nil {
			return m, err
		}
		return m, n.warmUp(ctx, s, m, ts.SnapshotID)
	})
}

// startPooled records s (state pooled), makes its marked directory and
// starts its machine with start; on any failure it removes all of it.
// Both pools' entries are made this way.
func (n *Node) startPooled(ctx context.Context, s *sandboxes.Sandbox, start func() (*vmm.Machine, error)) (*pooledSandbox, error) {
	if err := n.records.InsertNew(ctx, s); err != nil {
		return nil, err
	}
	m, err := func() (*vmm.Machine, error) {
		if err := n.makePooledDir(s.ID); err != nil {
			return nil, err
		}
		return start()
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

// claimPooled turns a pooled sandbox into the one a create asked for:
// identity, limits and records from s, then network rules and envd init.
func (n *Node) claimPooled(ctx context.Context, s *sandboxes.Sandbox) error {
	if err := os.Remove(filepath.Join(n.sandboxDir(s.ID), PooledMarker)); err != nil {
		return err
	}
	if err := n.applyEgress(ctx, s); err != nil {
		return err
	}
	ep, err := n.endpoint(s)
	if err != nil {
		return err
	}
	phase := s.PhaseTimer()
	if err := initEnvdAs(ctx, ep.GuestAddr(EnvdPort), s, "", true); err != nil {
		return err
	}
	phase("envd init")
	return nil
}

// applyEgress gives a claimed pooled sandbox, which has the default
// rules, the egress rules of s.
func (n *Node) applyEgress(ctx context.Context, s *sandboxes.Sandbox) error {
	if s.AllowInternet && len(s.Egress.Allow) == 0 && len(s.Egress.Deny) == 0 {
		return nil
	}
	ep, err := n.endpoint(s)
	if err != nil {
		return err
	}
	return n.net.SetEgress(ctx, ep, s.AllowInternet, s.Egress)
}

// warmUp restores the snapshot into a pooled machine and lets it run, idle,
// with a few requests to envd: under TCG the first request after a restore
// pays for translating the guest's network stack and envd afresh, and this
// moves that cost out of the create path. The guest has no identity yet:
// no token, env vars or user, until a create claims it and sends /init.
func (n *Node) warmUp(ctx context.Context, s *sandboxes.Sandbox, m *vmm.Machine, snapID string) error {
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
