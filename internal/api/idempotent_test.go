package api

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/agentenv/agentenv/internal/idempotency"
	"github.com/agentenv/agentenv/internal/orchestrator"
	"github.com/agentenv/agentenv/internal/sandboxes"
	"github.com/agentenv/agentenv/internal/statedb"
)

// newIdempotentAPI is the test API with a store of idempotent requests in
// the database at path.
func newIdempotentAPI(t *testing.T, node *fakeNode, path string) *testAPI {
	t.Helper()
	db, err := statedb.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	st, err := idempotency.Open(t.Context(), db, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	srv, err := New(node, Config{APIKey: testKey, Domain: "sandbox.test", SandboxProxy: http.NotFoundHandler(), Idempotency: st})
	if err != nil {
		t.Fatal(err)
	}
	return &testAPI{t: t, node: node, srv: srv}
}

func (a *testAPI) withKey(ctx context.Context, method, path, key, body string) *httptest.ResponseRecorder {
	a.t.Helper()
	req := httptest.NewRequestWithContext(ctx, method, path, strings.NewReader(body))
	req.Header.Set("X-API-Key", testKey)
	req.Header.Set("Content-Type", "application/json")
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	rec := httptest.NewRecorder()
	a.srv.ServeHTTP(rec, req)
	return rec
}

// A create retried with its Idempotency-Key gets the same sandbox, also
// from a restarted node; another body with the key is a 422; another key
// is another sandbox; a create without a key is never replayed.
func TestIdempotentCreate(t *testing.T) {
	path := filepath.Join(t.TempDir(), "aenv.db")
	node := newFakeNode()
	a := newIdempotentAPI(t, node, path)
	body := `{"templateID":"base","timeout":60}`
	first := a.withKey(t.Context(), "POST", "/v2/sandboxes", "episode-1", body)
	if first.Code != http.StatusCreated || first.Header().Get(idempotency.ReplayedHeader) != "" {
		t.Fatalf("%d %s", first.Code, first.Body)
	}
	again := a.withKey(t.Context(), "POST", "/v2/sandboxes", "episode-1", body)
	if again.Code != http.StatusCreated || again.Body.String() != first.Body.String() || again.Header().Get(idempotency.ReplayedHeader) != "true" {
		t.Fatalf("retry: %d %s (first %s)", again.Code, again.Body, first.Body)
	}
	if len(node.creates) != 1 {
		t.Fatalf("%d creates for one key", len(node.creates))
	}
	// The v1 route is another route: the key there is another request.
	if rec := a.withKey(t.Context(), "POST", "/sandboxes", "episode-1", body); rec.Code != http.StatusCreated || rec.Body.String() == first.Body.String() {
		t.Fatalf("v1: %d %s", rec.Code, rec.Body)
	}
	rec := a.withKey(t.Context(), "POST", "/v2/sandboxes", "episode-1", `{"templateID":"minimal"}`)
	assertError(t, rec, http.StatusUnprocessableEntity)
	if !strings.Contains(rec.Body.String(), "Idempotency-Key") {
		t.Fatalf("%s", rec.Body)
	}
	if rec := a.withKey(t.Context(), "POST", "/v2/sandboxes", strings.Repeat("k", 256), body); rec.Code != http.StatusBadRequest {
		t.Fatalf("long key: %d %s", rec.Code, rec.Body)
	}
	// A node restarted on the same database still knows the key.
	b := newIdempotentAPI(t, node, path)
	if rec := b.withKey(t.Context(), "POST", "/v2/sandboxes", "episode-1", body); rec.Body.String() != first.Body.String() {
		t.Fatalf("after a restart: %d %s", rec.Code, rec.Body)
	}
	if len(node.creates) != 2 { // the first and the v1 one
		t.Fatalf("%d creates", len(node.creates))
	}
}

// A failed create leaves nothing: its retry runs again.
func TestIdempotentCreateFailureRetries(t *testing.T) {
	node := newFakeNode()
	a := newIdempotentAPI(t, node, filepath.Join(t.TempDir(), "aenv.db"))
	for range 2 {
		if rec := a.withKey(t.Context(), "POST", "/v2/sandboxes", "k", `{"templateID":"full"}`); rec.Code != http.StatusTooManyRequests {
			t.Fatalf("%d %s", rec.Code, rec.Body)
		}
	}
	if len(node.creates) != 2 {
		t.Fatalf("%d creates, want 2 (a failure is not kept)", len(node.creates))
	}
}

// The client of the first request hangs up while its sandbox is made;
// its retry, sent meanwhile, waits for that create and gets its sandbox,
// and no second sandbox is made.
func TestIdempotentCreateClientGone(t *testing.T) {
	node := newFakeNode()
	node.createGate, node.createHeld = make(chan struct{}), make(chan struct{}, 1)
	a := newIdempotentAPI(t, node, filepath.Join(t.TempDir(), "aenv.db"))
	ctx, cancel := context.WithCancel(t.Context())
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		a.withKey(ctx, "POST", "/v2/sandboxes", "k", `{"templateID":"base"}`)
	}()
	<-node.createHeld // the sandbox is being made
	cancel()          // and the client went
	retried := make(chan *httptest.ResponseRecorder)
	go func() { retried <- a.withKey(t.Context(), "POST", "/v2/sandboxes", "k", `{"templateID":"base"}`) }()
	time.Sleep(50 * time.Millisecond)
	close(node.createGate)
	rec := <-retried
	wg.Wait()
	var sb struct{ SandboxID string }
	if rec.Code != http.StatusCreated || json.Unmarshal(rec.Body.Bytes(), &sb) != nil || sb.SandboxID == "" {
		t.Fatalf("retry: %d %s", rec.Code, rec.Body)
	}
	if len(node.creates) != 1 {
		t.Fatalf("%d creates", len(node.creates))
	}
}

// A fork retried with its key gets the same children.
func TestIdempotentFork(t *testing.T) {
	node := newFakeNode()
	a := newIdempotentAPI(t, node, filepath.Join(t.TempDir(), "aenv.db"))
	id := a.create(`{"templateID":"base"}`)["sandboxID"].(string)
	first := a.withKey(t.Context(), "POST", "/sandboxes/"+id+"/fork", "f1", `{"count":2}`)
	again := a.withKey(t.Context(), "POST", "/sandboxes/"+id+"/fork", "f1", `{"count":2}`)
	if first.Code != http.StatusCreated || again.Body.String() != first.Body.String() {
		t.Fatalf("%d %s / %d %s", first.Code, first.Body, again.Code, again.Body)
	}
	if l, _ := node.List(t.Context()); len(l) != 3 {
		t.Fatalf("%d sandboxes, want the parent and 2 children", len(l))
	}
}

// With HeaderFindOnly a node answers for a key it holds and runs nothing:
// 404 for a key it does not hold (or when it keeps no keys), the first
// answer for one it does, 422 for another body.
func TestIdempotentFindOnly(t *testing.T) {
	node := newFakeNode()
	a := newIdempotentAPI(t, node, filepath.Join(t.TempDir(), "aenv.db"))
	body := `{"templateID":"base","timeout":60}`
	// Asked on the path of its own (what gateways send) and, every other
	// time, with the header of earlier gateways.
	asked := 0
	find := func(a *testAPI, key, body string) *httptest.ResponseRecorder {
		asked++
		path := FindOnlyPrefix + "/v2/sandboxes"
		if asked%2 == 0 {
			path = "/v2/sandboxes"
		}
		req := httptest.NewRequestWithContext(t.Context(), "POST", path, strings.NewReader(body))
		req.Header.Set("X-API-Key", testKey)
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Idempotency-Key", key)
		if asked%2 == 0 {
			req.Header.Set(HeaderFindOnly, "1")
		}
		rec := httptest.NewRecorder()
		a.srv.ServeHTTP(rec, req)
		return rec
	}
	assertError(t, find(a, "k1", body), http.StatusNotFound)
	if len(node.creates) != 0 {
		t.Fatalf("a find ran %d creates", len(node.creates))
	}
	first := a.withKey(t.Context(), "POST", "/v2/sandboxes", "k1", body)
	if first.Code != http.StatusCreated {
		t.Fatalf("%d %s", first.Code, first.Body)
	}
	if rec := find(a, "k1", body); rec.Code != http.StatusCreated || rec.Body.String() != first.Body.String() || rec.Header().Get(idempotency.ReplayedHeader) != "true" {
		t.Fatalf("find of a held key: %d %s", rec.Code, rec.Body)
	}
	if rec := find(a, "k1", body); rec.Code != http.StatusCreated || rec.Body.String() != first.Body.String() {
		t.Fatalf("find of a held key, the other way: %d %s", rec.Code, rec.Body)
	}
	assertError(t, find(a, "k1", `{"templateID":"minimal"}`), http.StatusUnprocessableEntity)
	// Under the prefix nothing but the idempotent routes answers.
	for _, r := range []struct{ method, path string }{
		{"POST", FindOnlyPrefix + "/sandboxes/sbx/pause"},
		{"GET", FindOnlyPrefix + "/sandboxes"},
		{"GET", FindOnlyPrefix + "/v2/sandboxes"},
		{"DELETE", FindOnlyPrefix + "/sandboxes/x"},
	} {
		req := httptest.NewRequestWithContext(t.Context(), r.method, r.path, nil)
		req.Header.Set("X-API-Key", testKey)
		rec := httptest.NewRecorder()
		a.srv.ServeHTTP(rec, req)
		assertError(t, rec, http.StatusNotFound)
	}
	if len(node.creates) != 1 {
		t.Fatalf("%d creates", len(node.creates))
	}
	// A node that keeps no keys holds none.
	plain := newTestAPI(t)
	assertError(t, find(plain, "k1", body), http.StatusNotFound)
	if len(plain.node.creates) != 0 {
		t.Fatal("a find ran a create on a node without keys")
	}
}

// cutOff makes what a first request with key did before its node ended
// between making its sandboxes and keeping its answer: the key claimed in
// the database at path and run (made with the request's id), no answer
// kept.
func cutOff(t *testing.T, path, route, key, body string, run func(ctx context.Context)) {
	t.Helper()
	db, err := statedb.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	st, err := idempotency.Open(t.Context(), db, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	r := httptest.NewRequest("POST", "/", nil)
	r.Header.Set("X-API-Key", testKey)
	_, claim, err := st.Begin(t.Context(), idempotency.Request{Client: ClientOf(r), Route: route, Key: key, Body: []byte(body)}, time.Second)
	if err != nil || claim == nil {
		t.Fatalf("claim: %v %v", claim, err)
	}
	run(idempotency.WithRequest(t.Context(), claim.ID()))
}

// The node ends after a create made its sandbox and before the answer was
// kept for the key: the retry (to the restarted node) gets that sandbox,
// as a replay, and no second one is made; a cut-off request that made
// nothing runs again.
func TestIdempotentCreateCutOffByTheNodesEnd(t *testing.T) {
	path := filepath.Join(t.TempDir(), "aenv.db")
	node := newFakeNode()
	body := `{"templateID":"base","timeout":60}`
	var made *sandboxes.Sandbox
	cutOff(t, path, "POST /v2/sandboxes", "episode-1", body, func(ctx context.Context) {
		var err error
		if made, err = node.Create(ctx, orchestrator.CreateRequest{TemplateID: "base", Timeout: time.Minute}); err != nil {
			t.Fatal(err)
		}
	})
	cutOff(t, path, "POST /v2/sandboxes", "episode-2", body, func(context.Context) {})
	a := newIdempotentAPI(t, node, path) // the restarted node
	rec := a.withKey(t.Context(), "POST", "/v2/sandboxes", "episode-1", body)
	var got struct {
		SandboxID       string
		EnvdAccessToken *string
	}
	if rec.Code != http.StatusCreated || json.Unmarshal(rec.Body.Bytes(), &got) != nil || got.SandboxID != made.ID ||
		rec.Header().Get(idempotency.ReplayedHeader) != "true" {
		t.Fatalf("retry: %d %s %v (made %s)", rec.Code, rec.Body, rec.Header(), made.ID)
	}
	if len(node.creates) != 1 {
		t.Fatalf("%d creates for one key", len(node.creates))
	}
	// Its answer is kept like any other.
	if again := a.withKey(t.Context(), "POST", "/v2/sandboxes", "episode-1", body); again.Body.String() != rec.Body.String() {
		t.Fatalf("second retry: %d %s", again.Code, again.Body)
	}
	assertError(t, a.withKey(t.Context(), "POST", "/v2/sandboxes", "episode-1", `{"templateID":"minimal"}`), http.StatusUnprocessableEntity)
	// Made nothing: it runs again.
	if rec := a.withKey(t.Context(), "POST", "/v2/sandboxes", "episode-2", body); rec.Code != http.StatusCreated || strings.Contains(rec.Body.String(), made.ID) {
		t.Fatalf("retry of a request that made nothing: %d %s", rec.Code, rec.Body)
	}
	if len(node.creates) != 2 {
		t.Fatalf("%d creates", len(node.creates))
	}
}

// A fork cut off by the node's end after one of its two children was made
// answers that child and an error for the other; a gateway's find-only
// request for a cut-off create that made nothing is told 404 and the key
// is forgotten (the gateway places it anew), one that made its sandbox
// gets it.
func TestIdempotentForkAndFindCutOff(t *testing.T) {
	path := filepath.Join(t.TempDir(), "aenv.db")
	node := newFakeNode()
	parent := node.add(&sandboxes.Sandbox{ID: "parent1", TemplateID: "base"})
	var child *sandboxes.Sandbox
	cutOff(t, path, "POST /sandboxes/parent1/fork", "f1", `{"count":2}`, func(ctx context.Context) {
		res, err := node.Fork(ctx, parent.ID, 1, 0)
		if err != nil {
			t.Fatal(err)
		}
		child = res[0].Sandbox
	})
	body := `{"templateID":"base"}`
	var made *sandboxes.Sandbox
	cutOff(t, path, "POST /v2/sandboxes", "made", body, func(ctx context.Context) {
		made, _ = node.Create(ctx, orchestrator.CreateRequest{TemplateID: "base"})
	})
	cutOff(t, path, "POST /v2/sandboxes", "nothing", body, func(context.Context) {})
	a := newIdempotentAPI(t, node, path)

	rec := a.withKey(t.Context(), "POST", "/sandboxes/parent1/fork", "f1", `{"count":2}`)
	var kids []struct {
		Sandbox *struct{ SandboxID string }
		Error   *Error
	}
	if rec.Code != http.StatusCreated || json.Unmarshal(rec.Body.Bytes(), &kids) != nil || len(kids) != 2 ||
		kids[0].Sandbox == nil || kids[0].Sandbox.SandboxID != child.ID || kids[1].Error == nil || kids[1].Error.Code != 500 ||
		!strings.Contains(kids[1].Error.Message, "request id") {
		t.Fatalf("fork retry: %d %s", rec.Code, rec.Body)
	}
	if l, _ := node.List(t.Context()); len(l) != 3 { // parent, child, made
		t.Fatalf("%d sandboxes", len(l))
	}

	find := func(key string) *httptest.ResponseRecorder {
		req := httptest.NewRequestWithContext(t.Context(), "POST", FindOnlyPrefix+"/v2/sandboxes", strings.NewReader(body))
		req.Header.Set("X-API-Key", testKey)
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Idempotency-Key", key)
		rec := httptest.NewRecorder()
		a.srv.ServeHTTP(rec, req)
		return rec
	}
	if rec := find("made"); rec.Code != http.StatusCreated || !strings.Contains(rec.Body.String(), made.ID) {
		t.Fatalf("find of a cut-off create that made its sandbox: %d %s", rec.Code, rec.Body)
	}
	assertError(t, find("nothing"), http.StatusNotFound)
	assertError(t, find("nothing"), http.StatusNotFound)
	if len(node.creates) != 1 {
		t.Fatalf("finds ran creates: %d", len(node.creates))
	}
}
