package e2e

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
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
	// Other tests' sandboxes send events too: wait for ours.
	missing := func() []string {
		mu.Lock()
		defer mu.Unlock()
		// Each as many times as wanted (paused comes twice).
		need := map[[2]string]int{}
		for _, w := range want {
			need[[2]string{w.typ, w.sandbox}]++
		}
		for _, e := range events {
			need[[2]string{e.Type, e.SandboxID}]--
		}
		var out []string
		for k, n := range need {
			if n > 0 {
				out = append(out, k[0]+" of "+k[1])
			}
		}
		return out
	}
	deadline := time.Now().Add(90 * time.Second)
	for len(missing()) > 0 {
		if time.Now().After(deadline) {
			t.Fatalf("events that did not arrive: %v", missing())
		}
		time.Sleep(200 * time.Millisecond)
	}
	mu.Lock()
	for _, e := range events {
		if (e.SandboxID == id || e.SandboxID == child) && seen[e.ID] != 1 {
			t.Errorf("event %s (%s) arrived %d times", e.ID, e.Type, seen[e.ID])
		}
	}
	got0 := slices.Clone(events)
	mu.Unlock()
	var deliveries []struct {
		State     string `json:"state"`
		Attempts  int    `json:"attempts"`
		Type      string `json:"type"`
		SandboxID string `json:"sandboxID"`
	}
	// A try is recorded once the receiver has answered: the last event can
	// be here a moment before its delivery says so.
	ours, retried := 0, 0
	var undelivered []string
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(200 * time.Millisecond) {
		if err := s.rest(ctx, "GET", "/events/webhooks/"+hook.ID+"/deliveries?limit=1000", nil, &deliveries); err != nil {
			t.Fatal(err)
		}
		ours, retried, undelivered = 0, 0, nil
		for _, d := range deliveries {
			if d.Attempts > 1 {
				retried++
			}
			if d.SandboxID != id && d.SandboxID != child {
				continue
			}
			ours++
			if d.State != "delivered" {
				undelivered = append(undelivered, fmt.Sprintf("%+v", d))
			}
		}
		if len(undelivered) == 0 || time.Now().After(deadline) {
			break
		}
	}
	if len(undelivered) > 0 {
		t.Errorf("deliveries not recorded as delivered: %v", undelivered)
	}
	if retried == 0 || ours < len(want) {
		t.Errorf("%d deliveries of ours, %d retried: %+v", ours, retried, deliveries)
	}
	t.Logf("%d events, %d deliveries (%d retried after the receiver's 503s)", len(got0), len(deliveries), retried)
}
