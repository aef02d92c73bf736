package orchestrator

import (
	"context"
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/agentenv/agentenv/internal/sandboxes"
)

// TestLeaseExpiry: sandboxes bound to a lease that is not renewed end as
// their autoPause says (paused, killed), a fork's children with their
// parent; a renewed lease keeps its sandboxes; a keepalive after the
// expiry is refused; deleting a lease kills what it binds, paused ones
// too.
func TestLeaseExpiry(t *testing.T) {
	n := testNode(t)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	lease := &LeaseRequest{ID: "trainer-1", TTL: 10 * time.Second}
	// Creates may take longer than the ttl (cold boots under load): the
	// lease is renewed until the sandboxes are made, then forgotten.
	setup, renewed := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(renewed)
		for {
			select {
			case <-setup:
				return
			case <-time.After(time.Second):
				n.RenewLease(ctx, "trainer-1", 0)
			}
		}
	}()
	kept := create(t, n, CreateRequest{TemplateID: "minimal", AutoPause: true, Lease: lease})
	killed := create(t, n, CreateRequest{TemplateID: "minimal", AutoPause: false, Lease: lease})
	kids, err := n.Fork(ctx, kept.ID, 1, 0)
	if err != nil || len(kids) != 1 || kids[0].Err != nil {
		t.Fatalf("fork: %+v %v", kids, err)
	}
	child := kids[0].Sandbox
	other := create(t, n, CreateRequest{TemplateID: "minimal", AutoPause: false, Lease: &LeaseRequest{ID: "trainer-2", TTL: 30 * time.Second}})
	unbound := create(t, n, CreateRequest{TemplateID: "minimal", AutoPause: false})
	close(setup)
	<-renewed

	info, err := n.Lease(ctx, "trainer-1")
	if err != nil || !slices.Equal(sorted(info.Sandboxes), sorted([]string{kept.ID, killed.ID, child.ID})) {
		t.Fatalf("lease: %+v %v", info, err)
	}
	// trainer-2 stays alive by its keepalives; trainer-1 is forgotten.
	deadline := time.Now().Add(60 * time.Second)
	for {
		if _, err := n.RenewLease(ctx, "trainer-2", 0); err != nil {
			t.Fatal(err)
		}
		if s, _ := n.Get(ctx, kept.ID); s.State == sandboxes.Paused {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the sandboxes of the expired lease are still running")
		}
		time.Sleep(time.Second)
	}
	waitState := func(id string, want sandboxes.State) {
		t.Helper()
		for end := time.Now().Add(30 * time.Second); ; {
			s, err := n.Get(ctx, id)
			if want == "" && errors.Is(err, ErrNotFound) || err == nil && s.State == want {
				return
			}
			if time.Now().After(end) {
				t.Fatalf("sandbox %s: %+v %v, want %q", id, s, err, want)
			}
			time.Sleep(200 * time.Millisecond)
		}
	}
	waitState(child.ID, sandboxes.Paused) // autoPause, from its parent
	waitState(killed.ID, "")
	for _, id := range []string{other.ID, unbound.ID} {
		if s, err := n.Get(ctx, id); err != nil || s.State != sandboxes.Running {
			t.Fatalf("sandbox %s of a live lease or none: %+v %v", id, s, err)
		}
	}
	if _, err := n.RenewLease(ctx, "trainer-1", 0); !errors.Is(err, ErrConflict) {
		t.Fatalf("keepalive after the expiry: %v", err)
	}
	info, err = n.Lease(ctx, "trainer-1")
	if err != nil || !info.Expired {
		t.Fatalf("expired lease: %+v %v", info, err)
	}
	gone, err := n.EndLease(ctx, "trainer-1")
	if err != nil || !slices.Equal(sorted(gone), sorted([]string{kept.ID, child.ID})) {
		t.Fatalf("end lease: %v %v", gone, err)
	}
	for _, id := range gone {
		waitState(id, "")
	}
	if _, err := n.Lease(ctx, "trainer-1"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("after the end: %v", err)
	}
}

func sorted(s []string) []string {
	s = slices.Clone(s)
	slices.Sort(s)
	return s
}
