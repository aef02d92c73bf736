package orchestrator

import (
	"context"
	"github.com/agentenv/agentenv/internal/events"

	"github.com/agentenv/agentenv/internal/network"
	"github.com/agentenv/agentenv/internal/operation"
	"github.com/agentenv/agentenv/internal/sandboxes"
)

// SetNetwork replaces what a sandbox's guest may reach (E2B's PUT
// /sandboxes/{id}/network): internet access and the egress rules. A running
// sandbox gets them at once, in one nftables transaction; a paused one keeps
// them in its namespace and record for its resume (and for any node that
// adopts it). A sandbox in the middle of another operation is refused
// (ErrConflict). A failure leaves the old rules in force.
func (n *Node) SetNetwork(ctx context.Context, id string, internet bool, egress network.Egress) (*sandboxes.Sandbox, error) {
	s, err := n.records.Get(ctx, id)
	if err != nil {
		return nil, n.notHere(err)
	}
	if s.State != sandboxes.Running && s.State != sandboxes.Paused {
		return nil, sandboxes.Busy(s)
	}
	unlock := n.lockOp(id)
	defer unlock()
	if s, err = n.records.Get(ctx, id); err != nil {
		return nil, err
	}
	if s.State != sandboxes.Running && s.State != sandboxes.Paused {
		return nil, sandboxes.Busy(s)
	}
	o := operation.Start(ctx, "network", n.cfg.OperationTimeout, n.log)
	ep, err := n.endpoint(s)
	if err != nil {
		return nil, o.Finish(err)
	}
	oldInternet, oldEgress := s.AllowInternet, s.Egress
	// A paused sandbox whose namespace went (a host reboot) gets its
	// rules when resume builds the namespace again, from the record.
	live := s.State == sandboxes.Running || n.net.Exists(ep)
	if live {
		if err := o.Do("apply", func(ctx context.Context) error { return n.net.SetEgress(ctx, ep, internet, egress) }); err != nil {
			return nil, o.Finish(err)
		}
		o.OnFailure("restore the old rules", func(ctx context.Context) error {
			return n.net.SetEgress(ctx, ep, oldInternet, oldEgress)
		})
	}
	s.AllowInternet, s.Egress = internet, egress
	if err := o.Do("record", func(ctx context.Context) error { return n.records.Save(ctx, s) }); err != nil {
		return nil, o.Finish(err)
	}
	if err := o.Finish(nil); err != nil {
		return nil, err
	}
	n.emit(events.Updated, s, map[string]string{"network": "egress rules replaced"})
	return n.withAddr(s), nil
}
