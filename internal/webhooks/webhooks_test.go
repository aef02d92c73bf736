package webhooks

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/agentenv/agentenv/internal/errkind"
	"github.com/agentenv/agentenv/internal/events"
	"github.com/agentenv/agentenv/internal/statedb"
)

func openStore(t *testing.T, path string) *Store {
	t.Helper()
	db, err := statedb.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	s, err := Open(t.Context(), db, nil)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func ptr[T any](v T) *T { return &v }

// received is what a loopback receiver got.
type received struct {
	mu     sync.Mutex
	bodies [][]byte
	heads  []http.Header
	tries  int
}

// receiver answers 503 to its first failFirst requests, then 200.
func receiver(t *testing.T, failFirst int) (*httptest.Server, *received) {
	got := &received{}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		got.mu.Lock()
		defer got.mu.Unlock()
		got.tries++
		if got.tries <= failFirst {
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		got.bodies = append(got.bodies, b)
		got.heads = append(got.heads, r.Header.Clone())
	}))
	t.Cleanup(srv.Close)
	return srv, got
}

func TestDeliveryRetriedAndSigned(t *testing.T) {
	s := openStore(t, filepath.Join(t.TempDir(), "aenv.db"))
	srv, got := receiver(t, 2)
	w, err := s.Create(t.Context(), Spec{Name: ptr("trainer"), URL: ptr(srv.URL + "/hook"), Secret: ptr("s3cret"),
		Events: &[]events.Type{events.Created, events.Killed}})
	if err != nil {
		t.Fatal(err)
	}
	other, _ := s.Create(t.Context(), Spec{URL: ptr(srv.URL + "/other"), Enabled: ptr(false)})
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	go s.Run(ctx, DeliverOptions{Backoff: 20 * time.Millisecond})

	ev := events.New(events.Created, "sbx1", "base", map[string]string{"job": "42"})
	s.Emit(ev)
	s.Emit(events.New(events.Paused, "sbx1", "base", nil)) // not subscribed
	// Delivered once the record says so: the receiver sees the body before
	// the deliverer has stored the answer.
	deadline := time.Now().Add(10 * time.Second)
	for {
		ds, err := s.Deliveries(t.Context(), w.ID, 10)
		if err != nil {
			t.Fatal(err)
		}
		if len(ds) == 1 && ds[0].State == Delivered {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("not delivered: %+v", ds)
		}
		time.Sleep(10 * time.Millisecond)
	}
	got.mu.Lock()
	n, tries := len(got.bodies), got.tries
	var body []byte
	var head http.Header
	if n > 0 {
		body, head = got.bodies[0], got.heads[0]
	}
	got.mu.Unlock()
	if n != 1 {
		t.Fatalf("%d bodies received, want 1", n)
	}
	if tries != 3 {
		t.Fatalf("%d tries, want 3 (two answered 503)", tries)
	}
	e2b, mac := Sign("s3cret", body)
	if head.Get(HeaderSignature) != e2b || head.Get(HeaderHMAC) != mac || head.Get(HeaderWebhookID) != w.ID ||
		head.Get(HeaderSignatureVersion) != "v1" || head.Get(HeaderDeliveryID) == "" {
		t.Fatalf("headers %v", head)
	}
	var p struct {
		Version, ID, Type, SandboxID, SandboxTemplateID string
		EventData                                       struct {
			SandboxMetadata map[string]string `json:"sandbox_metadata"`
		}
	}
	if err := json.Unmarshal(body, &p); err != nil || p.Version != "v2" || p.ID != ev.ID || p.Type != string(events.Created) ||
		p.SandboxID != "sbx1" || p.SandboxTemplateID != "base" || p.EventData.SandboxMetadata["job"] != "42" {
		t.Fatalf("payload %s: %v", body, err)
	}
	ds, err := s.Deliveries(t.Context(), w.ID, 10)
	if err != nil || len(ds) != 1 || ds[0].State != Delivered || ds[0].Attempts != 3 || ds[0].LastStatus != 200 {
		t.Fatalf("deliveries %+v %v", ds, err)
	}
	if ds, _ := s.Deliveries(t.Context(), other.ID, 10); len(ds) != 0 {
		t.Fatalf("a disabled webhook got %d deliveries", len(ds))
	}
}

// A receiver that never answers 2xx: the delivery fails after MaxAttempts
// tries, with the last status and error recorded.
func TestDeliveryGivesUp(t *testing.T) {
	s := openStore(t, filepath.Join(t.TempDir(), "aenv.db"))
	srv, got := receiver(t, 1000)
	w, _ := s.Create(t.Context(), Spec{URL: ptr(srv.URL)})
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	go s.Run(ctx, DeliverOptions{Backoff: 5 * time.Millisecond})
	s.Emit(events.New(events.Killed, "sbx1", "base", nil))
	for deadline := time.Now().Add(10 * time.Second); ; {
		ds, _ := s.Deliveries(t.Context(), w.ID, 10)
		if len(ds) == 1 && ds[0].State == Failed {
			if ds[0].Attempts != MaxAttempts || ds[0].LastStatus != 503 || ds[0].LastError == "" {
				t.Fatalf("%+v", ds[0])
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("not failed: %+v", ds)
		}
		time.Sleep(10 * time.Millisecond)
	}
	got.mu.Lock()
	defer got.mu.Unlock()
	if got.tries != MaxAttempts {
		t.Fatalf("%d tries", got.tries)
	}
}

// A delivery recorded before a restart is sent after it.
func TestDeliverySurvivesRestart(t *testing.T) {
	path := filepath.Join(t.TempDir(), "aenv.db")
	s := openStore(t, path)
	srv, got := receiver(t, 0)
	w, _ := s.Create(t.Context(), Spec{URL: ptr(srv.URL)})
	s.Emit(events.New(events.Created, "sbx1", "base", nil)) // no deliverer runs
	s2 := openStore(t, path)
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	go s2.Run(ctx, DeliverOptions{})
	for deadline := time.Now().Add(10 * time.Second); ; {
		if ds, _ := s2.Deliveries(t.Context(), w.ID, 10); len(ds) == 1 && ds[0].State == Delivered {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("not delivered after the restart")
		}
		time.Sleep(10 * time.Millisecond)
	}
	got.mu.Lock()
	defer got.mu.Unlock()
	if got.tries != 1 {
		t.Fatalf("%d tries", got.tries)
	}
}

func TestWebhookCRUDAndBadInput(t *testing.T) {
	s := openStore(t, filepath.Join(t.TempDir(), "aenv.db"))
	for _, spec := range []Spec{
		{},
		{URL: ptr("ftp://x")},
		{URL: ptr("/relative")},
		{URL: ptr("http://127.0.0.1:1/"), Events: &[]events.Type{"sandbox.lifecycle.exploded"}},
		{URL: ptr("http://127.0.0.1:1/"), Events: &[]events.Type{}},
	} {
		if _, err := s.Create(t.Context(), spec); !errors.Is(err, errkind.ErrInvalid) {
			t.Errorf("%+v: %v", spec, err)
		}
	}
	if l, _ := s.List(t.Context()); len(l) != 0 {
		t.Fatalf("bad input registered %d", len(l))
	}
	w, err := s.Create(t.Context(), Spec{URL: ptr("http://127.0.0.1:1/")})
	if err != nil || !w.Enabled || len(w.Events) != len(events.All) {
		t.Fatalf("%+v %v", w, err)
	}
	u, err := s.Update(t.Context(), w.ID, Spec{Enabled: ptr(false), Events: &[]events.Type{events.Paused}})
	if err != nil || u.Enabled || len(u.Events) != 1 || u.URL != w.URL {
		t.Fatalf("update %+v %v", u, err)
	}
	if _, err := s.Update(t.Context(), w.ID, Spec{URL: ptr("nope")}); !errors.Is(err, errkind.ErrInvalid) {
		t.Fatalf("bad update: %v", err)
	}
	if err := s.Delete(t.Context(), w.ID, 0); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Get(t.Context(), w.ID); !errors.Is(err, errkind.ErrNotFound) {
		t.Fatalf("after delete: %v", err)
	}
}
