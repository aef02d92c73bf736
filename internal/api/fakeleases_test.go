package api

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"sort"
	"time"

	"github.com/agentenv/agentenv/internal/leases"
	"github.com/agentenv/agentenv/internal/orchestrator"
	"github.com/agentenv/agentenv/internal/statedb"
)

// leaseStore is the fake node's lease store (a real one, on a temporary
// database made on first use).
func (f *fakeNode) leaseStore() *leases.Store {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.leases == nil {
		dir, err := os.MkdirTemp("", "aenv-api-leases-")
		if err != nil {
			panic(err)
		}
		db, err := statedb.Open(filepath.Join(dir, "aenv.db"))
		if err == nil {
			f.leases, err = leases.Open(context.Background(), db)
		}
		if err != nil {
			panic(err)
		}
	}
	return f.leases
}

func (f *fakeNode) bound(id string) []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []string
	for _, sb := range f.sandboxes {
		if sb.Lease == id {
			out = append(out, sb.ID)
		}
	}
	sort.Strings(out)
	return out
}

func (f *fakeNode) Leases(ctx context.Context) ([]*orchestrator.LeaseInfo, error) {
	ls, err := f.leaseStore().List(ctx)
	if err != nil {
		return nil, err
	}
	var out []*orchestrator.LeaseInfo
	for _, l := range ls {
		out = append(out, &orchestrator.LeaseInfo{Lease: *l, Sandboxes: f.bound(l.ID)})
	}
	return out, nil
}

func (f *fakeNode) Lease(ctx context.Context, id string) (*orchestrator.LeaseInfo, error) {
	l, err := f.leaseStore().Get(ctx, id)
	if err != nil {
		return nil, err
	}
	return &orchestrator.LeaseInfo{Lease: *l, Sandboxes: f.bound(id)}, nil
}

func (f *fakeNode) RenewLease(ctx context.Context, id string, ttl time.Duration) (*orchestrator.LeaseInfo, error) {
	if _, err := f.leaseStore().Renew(ctx, id, ttl); err != nil {
		return nil, err
	}
	return f.Lease(ctx, id)
}

func (f *fakeNode) EndLease(ctx context.Context, id string) ([]string, error) {
	if _, err := f.leaseStore().Get(ctx, id); err != nil {
		return nil, err
	}
	var killed []string
	for _, sb := range f.bound(id) {
		if err := f.Kill(ctx, sb); err != nil && !errors.Is(err, orchestrator.ErrNotFound) {
			return killed, err
		}
		killed = append(killed, sb)
	}
	return killed, f.leaseStore().Delete(ctx, id)
}
