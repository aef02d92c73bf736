package gateway

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"testing"

	"connectrpc.com/connect"

	"github.com/agentenv/agentenv/internal/api"
	"github.com/agentenv/agentenv/internal/scheduler"
	pb "github.com/agentenv/agentenv/internal/scheduler/gen/schedulerpb"
	"github.com/agentenv/agentenv/internal/statedb"
	"github.com/agentenv/agentenv/internal/webhooks"
)

// recordsNode stands in for a node's webhook records routes over a real
// webhook store.
func recordsNode(t *testing.T, name string) (*httptest.Server, *webhooks.Store) {
	db, err := statedb.Open(filepath.Join(t.TempDir(), name+".db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	store, err := webhooks.Open(t.Context(), db, nil)
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /events/webhook-records", func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get(api.HeaderNodeToken) != testNodeToken {
			w.WriteHeader(http.StatusUnauthorized)
			return
		}
		recs, _ := store.Records(r.Context())
		json.NewEncoder(w).Encode(recs)
	})
	mux.HandleFunc("POST /events/webhook-records", func(w http.ResponseWriter, r *http.Request) {
		var recs []webhooks.Record
		if r.Header.Get(api.HeaderNodeToken) != testNodeToken || json.NewDecoder(r.Body).Decode(&recs) != nil {
			w.WriteHeader(http.StatusBadRequest)
			return
		}
		n, err := store.Apply(r.Context(), recs)
		if err != nil {
			w.WriteHeader(http.StatusBadRequest)
			return
		}
		json.NewEncoder(w).Encode(map[string]int{"applied": n})
	})
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return srv, store
}

// A node that joins after a webhook was registered gets it (with its
// secret); one that was away during a deletion takes the deletion and
// does not bring the webhook back to the others.
func TestWebhooksReachLateNodes(t *testing.T) {
	sa, a := recordsNode(t, "a")
	sb, b := recordsNode(t, "b")
	sc, c := recordsNode(t, "c")
	sched := scheduler.New(scheduler.Config{Token: key, Logger: slog.New(slog.DiscardHandler)})
	mux := http.NewServeMux()
	mux.Handle(sched.Handler())
	ss := httptest.NewServer(mux)
	t.Cleanup(ss.Close)
	client := scheduler.NewClient(ss.Client(), ss.URL, key)
	join := func(i int, s *httptest.Server) {
		rep := &pb.NodeReport{NodeId: fmt.Sprintf("n%d", i), Url: s.URL, Cpus: 2, MemoryTotalBytes: 8 << 30, MemoryAvailableBytes: 8 << 30}
		if _, err := client.Heartbeat(context.Background(), connect.NewRequest(&pb.HeartbeatRequest{Node: rep})); err != nil {
			t.Fatal(err)
		}
	}
	g := New(Config{Scheduler: client, APIKey: key, NodeToken: testNodeToken, Logger: slog.New(slog.DiscardHandler), RouteTTL: 1})
	sync := func() {
		t.Helper()
		g.mu.Lock()
		g.nodes = nil
		g.mu.Unlock()
		nodes, err := g.readyNodes(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		if err := g.syncWebhooks(t.Context(), nodes); err != nil {
			t.Fatal(err)
		}
	}
	ptr := func(s string) *string { return &s }
	join(0, sa)
	join(2, sc)
	// Registered on a and c; c then leaves with it (its heartbeats stop).
	for _, s := range []*webhooks.Store{a, c} {
		if _, err := s.Create(t.Context(), webhooks.Spec{ID: ptr("wh_x"), URL: ptr("http://127.0.0.1:9/x"), Secret: ptr("s3cret"), Revision: 10}); err != nil {
			t.Fatal(err)
		}
	}
	if err := a.Delete(t.Context(), "wh_x", 20); err != nil {
		t.Fatal(err)
	}
	if _, err := a.Create(t.Context(), webhooks.Spec{ID: ptr("wh_y"), URL: ptr("http://127.0.0.1:9/y"), Secret: ptr("s3cret"), Revision: 30}); err != nil {
		t.Fatal(err)
	}
	join(1, sb) // late
	sync()
	for name, s := range map[string]*webhooks.Store{"a": a, "b": b, "c": c} {
		if _, err := s.Get(t.Context(), "wh_x"); err == nil {
			t.Errorf("node %s has the deleted webhook", name)
		}
		if w, err := s.Get(t.Context(), "wh_y"); err != nil || w.Secret != "s3cret" {
			t.Errorf("node %s: %+v %v", name, w, err)
		}
	}
	recs, _ := b.Records(t.Context())
	if len(recs) != 1 {
		t.Errorf("the late node has %+v, want only wh_y (it never had wh_x)", recs)
	}
}
