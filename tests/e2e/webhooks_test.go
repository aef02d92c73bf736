package e2e

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"sync"
	"testing"
	"time"
)

// TestLifecycleWebhooks: a webhook on a loopback receiver that fails its
// first two requests gets, signed, every event of a sandbox's life
// (created, paused, resumed, checkpointed, forked, killed, expired), each
// once (the failed tries retried), and the node lists the deliveries with
// their attempts. Bad registrations are refused.
func TestLifecycleWebhooks(t *testing.T) {
	s := needServer(t)
	const secret = "hook-secret"
	var mu sync.Mutex
	type got struct {
		Type      string `json:"type"`
		ID        string `json:"id"`
		SandboxID string `json:"sandboxId"`
	}
	var events []got
	seen := map[string]int{}
	tries := 0
	recv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		mu.Lock()
		defer mu.Unlock()
		tries++
		if tries <= 2 {
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		sum := sha256.Sum256(append([]byte(secret), body...))
		m := hmac.New(sha256.New, []byte(secret))
		m.Write(body)
		if r.Header.Get("e2b-signature") != base64.RawStdEncoding.EncodeToString(sum[:]) ||
			r.Header.Get("X-Aenv-Signature") != "sha256="+hex.EncodeToString(m.Sum(nil)) {
			t.Errorf("bad signature on %s", body)
			w.WriteHeader(http.StatusUnauthorized)
			return
		}
		var ev got
		if err := json.Unmarshal(body, &ev); err != nil {
			t.Errorf("payload %s: %v", body, err)
		}
		seen[ev.ID]++
		if seen[ev.ID] == 1 {
			events = append(events, ev)
		}
	}))
	defer recv.Close()
	ctx := context.Background()
	for _, bad := range []map[string]any{
		{"url": "not a url"},
		{"url": recv.URL, "events": []string{"sandbox.lifecycle.exploded"}},
		{"name": "no url"},
	} {
		var ae *apiError
		if err := s.rest(ctx, "POST", "/events/webhooks", bad, nil); !errors.As(err, &ae) || ae.Status != 400 {
			t.Errorf("register %v: %v", bad, err)
		}
	}
	var hook struct {
		ID string `json:"id"`
	}
	if err := s.rest(ctx, "POST", "/events/webhooks", map[string]any{"name": "e2e", "url": recv.URL, "signatureSecret": secret}, &hook); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.rest(ctx, "DELETE", "/events/webhooks/"+hook.ID, nil, nil) })

	sb := s.createSandbox(t, map[string]any{"templateID": "minimal", "metadata": map[string]string{"job": "hooks"}})
	id := sb.SandboxID
	step := func(method, path string, body any) {
		t.Helper()
		if err := s.rest(ctx, method, path, body, nil); err != nil {
			t.Fatalf("%s %s: %v", method, path, err)
		}
	}
	step("POST", "/sandboxes/"+id+"/pause", nil)
	step("POST", "/sandboxes/"+id+"/resume", map[string]any{})
	step("POST", "/sandboxes/"+id+"/snapshots", map[string]any{"name": "hooks-snap"})
	t.Cleanup(func() { s.rest(ctx, "DELETE", "/snapshots/hooks-snap", nil, nil) })
	var kids []struct {
		Sandbox struct {
			SandboxID string `json:"sandboxID"`
		} `json:"sandbox"`
	}
	if err := s.rest(ctx, "POST", "/sandboxes/"+id+"/fork", map[string]any{"count": 1}, &kids); err != nil || len(kids) != 1 {
		t.Fatalf("fork: %v %v", kids, err)
	}
	child := kids[0].Sandbox.SandboxID
	step("DELETE", "/sandboxes/"+child, nil)
	// The parent's time runs out: expired, then paused (it auto-pauses).
	step("POST", "/sandboxes/"+id+"/timeout", map[string]any{"timeout": 1})
	want := []struct{ typ, sandbox string }{
		{"sandbox.lifecycle.created", id}, {"sandbox.lifecycle.paused", id}, {"sandbox.lifecycle.resumed", id},
		{"sandbox.lifecycle.checkpointed", id}, {"sandbox.lifecycle.forked", child}, {"sandbox.lifecycle.killed", child},
		{"sandbox.lifecycle.updated", id}, {"sandbox.lifecycle.expired", id}, {"sandbox.lifecycle.paused", id},
	}
	deadline := time.Now().Add(90 * time.Second)
	for {
		mu.Lock()
		n := len(events)
		mu.Unlock()
		if n >= len(want) {
			break
		}
		if time.Now().After(deadline) {
			mu.Lock()
			t.Fatalf("%d of %d events arrived: %+v", n, len(want), events)
		}
		time.Sleep(200 * time.Millisecond)
	}
	mu.Lock()
	got0 := slices.Clone(events)
	mu.Unlock()
	for _, w := range want {
		if !slices.ContainsFunc(got0, func(e got) bool { return e.Type == w.typ && e.SandboxID == w.sandbox }) {
			t.Errorf("no %s of %s in %+v", w.typ, w.sandbox, got0)
		}
	}
	var deliveries []struct {
		State    string `json:"state"`
		Attempts int    `json:"attempts"`
		Type     string `json:"type"`
	}
	if err := s.rest(ctx, "GET", "/events/webhooks/"+hook.ID+"/deliveries?limit=100", nil, &deliveries); err != nil {
		t.Fatal(err)
	}
	retried := 0
	for _, d := range deliveries {
		if d.State != "delivered" {
			t.Errorf("delivery %+v", d)
		}
		if d.Attempts > 1 {
			retried++
		}
	}
	if retried == 0 || len(deliveries) < len(want) {
		t.Errorf("%d deliveries, %d retried: %+v", len(deliveries), retried, deliveries)
	}
	t.Logf("%d events, %d deliveries (%d retried after the receiver's 503s)", len(got0), len(deliveries), retried)
}
