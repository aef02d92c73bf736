package orchestrator

import (
	"context"
	"errors"
	"time"

	"github.com/agentenv/agentenv/internal/leases"
	"github.com/agentenv/agentenv/internal/sandboxes"
)

// LeaseRequest binds a new sandbox to a client lease (package leases),
// made or renewed with TTL (0: leases.DefaultTTL).
type LeaseRequest struct {
	ID  string
	TTL time.Duration
}

// LeaseInfo is a lease and the sandboxes bound to it.
type LeaseInfo struct {
	leases.Lease
	Sandboxes []string
}

// Leases are the node's client leases, oldest first, with their sandboxes.
func (n *Node) Leases(ctx context.Context) ([]*LeaseInfo, error) {
	ls, err := n.leases.List(ctx)
	if err != nil {
		return nil, err
	}
	bound, err := n.leaseSandboxes(ctx, "")
	if err != nil {
		return nil, err
	}
	out := make([]*LeaseInfo, 0, len(ls))
	for _, l := range ls {
		out = append(out, &LeaseInfo{Lease: *l, Sandboxes: bound[l.ID]})
	}
	return out, nil
}

// Lease is one lease with its sandboxes.
func (n *Node) Lease(ctx context.Context, id string) (*LeaseInfo, error) {
	l, err := n.leases.Get(ctx, id)
	if err != nil {
		return nil, err
	}
	bound, err := n.leaseSandboxes(ctx, id)
	if err != nil {
		return nil, err
	}
	return &LeaseInfo{Lease: *l, Sandboxes: bound[id]}, nil
}

// RenewLease keeps a lease alive for its time to live (or ttl, when not
// 0) from now.
func (n *Node) RenewLease(ctx context.Context, id string, ttl time.Duration) (*LeaseInfo, error) {
	if _, err := n.leases.Renew(ctx, id, ttl); err != nil {
		return nil, err
	}
	return n.Lease(ctx, id)
}

// EndLease kills every sandbox bound to the lease, running or paused, and
// forgets the lease; it returns the sandboxes killed. A sandbox that could
// not be killed keeps the lease (the error says which).
func (n *Node) EndLease(ctx context.Context, id string) ([]string, error) {
	info, err := n.Lease(ctx, id)
	if err != nil {
		return nil, err
	}
	var killed []string
	var errs []error
	for _, sb := range info.Sandboxes {
		if err := n.Kill(ctx, sb); err != nil && !errors.Is(err, ErrNotFound) {
			errs = append(errs, err)
			continue
		}
		killed = append(killed, sb)
	}
	if len(errs) > 0 {
		return killed, errors.Join(errs...)
	}
	return killed, n.leases.Delete(ctx, id)
}

// leaseSandboxes are the sandboxes bound to lease id ("": to any lease),
// by lease.
func (n *Node) leaseSandboxes(ctx context.Context, id string) (map[string][]string, error) {
	where, args := "lease != ''", []any{}
	if id != "" {
		where, args = "lease = ?", []any{id}
	}
	all, err := n.records.List(ctx, where, args...)
	if err != nil {
		return nil, err
	}
	out := map[string][]string{}
	for _, s := range all {
		if s.State != sandboxes.Pooled {
			out[s.Lease] = append(out[s.Lease], s.ID)
		}
	}
	return out, nil
}

// expireLeases ends the sandboxes of the leases not renewed in time, as
// each one's autoPause says (a paused one without autoPause is killed).
func (n *Node) expireLeases(ctx context.Context) {
	expired, err := n.leases.Expire(ctx)
	if err != nil {
		n.log.Error("lease expiry", "err", err)
		return
	}
	for _, l := range expired {
		bound, err := n.records.List(ctx, "lease = ?", l.ID)
		if err != nil {
			n.log.Error("lease expiry", "lease", l.ID, "err", err)
			continue
		}
		n.log.Info("lease expired", "lease", l.ID, "sandboxes", len(bound))
		for _, s := range bound {
			switch {
			case s.State == sandboxes.Running:
				n.endExpired(ctx, s, "lease "+l.ID)
			case s.State == sandboxes.Paused && !s.AutoPause:
				if err := n.Kill(ctx, s.ID); err != nil && !errors.Is(err, ErrNotFound) {
					n.log.Error("end a sandbox of an expired lease", "sandbox", s.ID, "err", err)
				}
			}
		}
	}
}
