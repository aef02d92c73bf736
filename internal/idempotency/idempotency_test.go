package idempotency

import (
	"context"
	"errors"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/agentenv/agentenv/internal/errkind"
	"github.com/agentenv/agentenv/internal/statedb"
)

func openStore(t *testing.T, path string, window time.Duration) *Store {
	t.Helper()
	db, err := statedb.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	s, err := Open(t.Context(), db, window)
	if err != nil {
		t.Fatal(err)
	}
	s.poll = 5 * time.Millisecond
	return s
}

var req = Request{Client: "c1", Route: "POST /v2/sandboxes", Key: "k1", Body: []byte(`{"templateID":"base"}`)}

func TestReplayAndMismatch(t *testing.T) {
	s := openStore(t, filepath.Join(t.TempDir(), "aenv.db"), time.Hour)
	a, c, err := s.Begin(t.Context(), req, time.Second)
	if err != nil || a != nil || c == nil {
		t.Fatalf("first: %v %v %v", a, c, err)
	}
	if err := c.Finish(t.Context(), Answer{Status: 201, ContentType: "application/json", Body: []byte(`{"sandboxID":"s1"}`)}); err != nil {
		t.Fatal(err)
	}
	a, c, err = s.Begin(t.Context(), req, time.Second)
	if err != nil || c != nil || a == nil || a.Status != 201 || string(a.Body) != `{"sandboxID":"s1"}` {
		t.Fatalf("retry: %+v %v %v", a, c, err)
	}
	other := req
	other.Body = []byte(`{"templateID":"minimal"}`)
	if _, _, err := s.Begin(t.Context(), other, time.Second); !errors.Is(err, errkind.ErrMismatch) {
		t.Fatalf("another body: %v", err)
	}
	// Another client, route or key is another request.
	for _, r := range []Request{{Client: "c2", Route: req.Route, Key: req.Key, Body: req.Body},
		{Client: req.Client, Route: "POST /sandboxes", Key: req.Key, Body: req.Body},
		{Client: req.Client, Route: req.Route, Key: "k2", Body: req.Body}} {
		if a, c, err := s.Begin(t.Context(), r, time.Second); err != nil || a != nil || c == nil {
			t.Fatalf("%+v: %v %v %v", r, a, c, err)
		}
	}
	for _, k := range []string{"", string(make([]byte, MaxKeyLength+1))} {
		bad := req
		bad.Key = k
		if _, _, err := s.Begin(t.Context(), bad, time.Second); !errors.Is(err, errkind.ErrInvalid) {
			t.Fatalf("key of %d bytes: %v", len(k), err)
		}
	}
}

// A failed first request leaves nothing: its retry runs again.
func TestFailureForgets(t *testing.T) {
	s := openStore(t, filepath.Join(t.TempDir(), "aenv.db"), time.Hour)
	_, c, _ := s.Begin(t.Context(), req, time.Second)
	if err := c.Finish(t.Context(), Answer{Status: 503}); err != nil {
		t.Fatal(err)
	}
	if a, c, err := s.Begin(t.Context(), req, time.Second); err != nil || a != nil || c == nil {
		t.Fatalf("retry after a failure: %v %v %v", a, c, err)
	}
}

// A retry while the first runs waits for its answer; past its wait it is
// a conflict.
func TestRetryWaitsForTheFirst(t *testing.T) {
	s := openStore(t, filepath.Join(t.TempDir(), "aenv.db"), time.Hour)
	_, c, _ := s.Begin(t.Context(), req, time.Second)
	if _, _, err := s.Begin(t.Context(), req, 20*time.Millisecond); !errors.Is(err, errkind.ErrConflict) {
		t.Fatalf("still running: %v", err)
	}
	var wg sync.WaitGroup
	got := make([]*Answer, 5)
	for i := range got {
		wg.Add(1)
		go func() {
			defer wg.Done()
			a, c, err := s.Begin(context.Background(), req, 5*time.Second)
			if err != nil || c != nil {
				t.Errorf("retry %d: %v %v", i, c, err)
			}
			got[i] = a
		}()
	}
	time.Sleep(30 * time.Millisecond)
	c.Finish(t.Context(), Answer{Status: 201, Body: []byte("made")})
	wg.Wait()
	for i, a := range got {
		if a == nil || string(a.Body) != "made" {
			t.Fatalf("retry %d: %+v", i, a)
		}
	}
}

// Answers survive a restart; what a previous process left running comes
// back to its first retry as an interrupted claim (the retry looks for what
// it made), once; what is older than the window is forgotten.
func TestRestart(t *testing.T) {
	path := filepath.Join(t.TempDir(), "aenv.db")
	s := openStore(t, path, time.Hour)
	_, c, _ := s.Begin(t.Context(), req, time.Second)
	c.Finish(t.Context(), Answer{Status: 201, Body: []byte("made")})
	running := req
	running.Key = "running"
	s.Begin(t.Context(), running, time.Second)
	old := req
	old.Key = "old"
	s.now = func() time.Time { return time.Now().Add(-2 * time.Hour) }
	_, c, _ = s.Begin(t.Context(), old, time.Second)
	c.Finish(t.Context(), Answer{Status: 201, Body: []byte("old")})

	s2 := openStore(t, path, time.Hour)
	if a, _, err := s2.Begin(t.Context(), req, time.Second); err != nil || a == nil || string(a.Body) != "made" {
		t.Fatalf("after a restart: %+v %v", a, err)
	}
	a, cut, err := s2.Begin(t.Context(), running, time.Second)
	if err != nil || a != nil || cut == nil || !cut.Interrupted() || cut.ID() != running.ID() {
		t.Fatalf("cut off by the restart: %+v %+v %v", a, cut, err)
	}
	// Taken over once: a second retry waits for the first retry's answer.
	if _, _, err := s2.Begin(t.Context(), running, 20*time.Millisecond); !errors.Is(err, errkind.ErrConflict) {
		t.Fatalf("second retry of the cut-off request: %v", err)
	}
	if err := cut.Finish(t.Context(), Answer{Status: 201, Body: []byte("found")}); err != nil {
		t.Fatal(err)
	}
	if a, _, err := s2.Begin(t.Context(), running, time.Second); err != nil || a == nil || string(a.Body) != "found" {
		t.Fatalf("after the takeover answered: %+v %v", a, err)
	}
	if a, c, err := s2.Begin(t.Context(), old, time.Second); err != nil || a != nil || c == nil || c.Interrupted() {
		t.Fatalf("expired key after a restart: %+v %+v %v", a, c, err)
	}
	// Past the window a key is new again, also without a restart.
	s2.now = func() time.Time { return time.Now().Add(2 * time.Hour) }
	if a, c, err := s2.Begin(t.Context(), req, time.Second); err != nil || a != nil || c == nil {
		t.Fatalf("past the window: %+v %v", a, err)
	}
}

// Find answers for a key this store holds and never claims one: unknown,
// running (it waits like a retry), done, another body, expired.
func TestFind(t *testing.T) {
	s := openStore(t, filepath.Join(t.TempDir(), "aenv.db"), time.Hour)
	if _, _, err := s.Find(t.Context(), req, 0); !errors.Is(err, ErrUnknown) {
		t.Fatalf("unknown key: %v", err)
	}
	// Find claimed nothing: the first request still gets its claim.
	_, c, err := s.Begin(t.Context(), req, time.Second)
	if err != nil || c == nil {
		t.Fatalf("first after Find: %v %v", c, err)
	}
	if _, _, err := s.Find(t.Context(), req, 20*time.Millisecond); !errors.Is(err, errkind.ErrConflict) {
		t.Fatalf("running, not waited for long enough: %v", err)
	}
	got := make(chan *Answer, 1)
	go func() {
		a, c, err := s.Find(context.Background(), req, 5*time.Second)
		if err != nil || c != nil {
			t.Error(c, err)
		}
		got <- a
	}()
	time.Sleep(30 * time.Millisecond)
	if err := c.Finish(t.Context(), Answer{Status: 201, Body: []byte(`{"sandboxID":"s1"}`)}); err != nil {
		t.Fatal(err)
	}
	if a := <-got; a == nil || a.Status != 201 || string(a.Body) != `{"sandboxID":"s1"}` {
		t.Fatalf("waited for the first: %+v", a)
	}
	other := req
	other.Body = []byte(`{"templateID":"minimal"}`)
	if _, _, err := s.Find(t.Context(), other, 0); !errors.Is(err, errkind.ErrMismatch) {
		t.Fatalf("another body: %v", err)
	}
	s.now = func() time.Time { return time.Now().Add(2 * time.Hour) }
	if _, _, err := s.Find(t.Context(), req, 0); !errors.Is(err, ErrUnknown) {
		t.Fatalf("expired: %v", err)
	}
}

// Find takes over a request cut off by a restart (the caller answers from
// what it made or releases it); once released the key is unknown.
func TestFindTakesOverACutOffRequest(t *testing.T) {
	path := filepath.Join(t.TempDir(), "aenv.db")
	s := openStore(t, path, time.Hour)
	if _, _, err := s.Begin(t.Context(), req, time.Second); err != nil {
		t.Fatal(err)
	}
	s2 := openStore(t, path, time.Hour)
	other := req
	other.Body = []byte(`{"templateID":"minimal"}`)
	if _, _, err := s2.Find(t.Context(), other, 0); !errors.Is(err, errkind.ErrMismatch) {
		t.Fatalf("another body: %v", err)
	}
	a, c, err := s2.Find(t.Context(), req, 0)
	if err != nil || a != nil || c == nil || !c.Interrupted() {
		t.Fatalf("cut off: %+v %+v %v", a, c, err)
	}
	if err := c.Release(t.Context()); err != nil {
		t.Fatal(err)
	}
	if _, _, err := s2.Find(t.Context(), req, 0); !errors.Is(err, ErrUnknown) {
		t.Fatalf("released: %v", err)
	}
	if a, c, err := s2.Begin(t.Context(), req, time.Second); err != nil || a != nil || c == nil || c.Interrupted() {
		t.Fatalf("a new first request after the release: %+v %+v %v", a, c, err)
	}
}

func TestRequestRidesTheContext(t *testing.T) {
	if got := RequestOf(t.Context()); got != "" {
		t.Fatalf("no request: %q", got)
	}
	if got := RequestOf(WithRequest(t.Context(), req.ID())); got != req.ID() {
		t.Fatalf("got %q", got)
	}
}
