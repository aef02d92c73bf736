package e2e

import (
	"context"
	"net/http"
	"strings"
	"testing"
	"time"
)

// TestAutoResumeOnTraffic pauses a sandbox created with autoResume and
// checks that plain traffic to it (envd /health through the proxy) resumes
// it, with its files and processes intact.
func TestAutoResumeOnTraffic(t *testing.T) {
	s := needServer(t)
	sb := s.createSandbox(t, map[string]any{"templateID": "minimal", "autoResume": map[string]any{"enabled": true}})
	out, code := s.run(t, sb, "/bin/sh", "-c", "echo kept > /tmp/f; sleep 1000 >/dev/null 2>&1 & echo $!")
	if code != 0 {
		t.Fatalf("prepare: %d %q", code, out)
	}
	pid := strings.TrimSpace(out)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if err := s.rest(ctx, "POST", "/sandboxes/"+sb.SandboxID+"/pause", nil, nil); err != nil {
		t.Fatal(err)
	}
	var d struct {
		State string `json:"state"`
	}
	if err := s.rest(ctx, "GET", "/sandboxes/"+sb.SandboxID, nil, &d); err != nil || d.State != "paused" {
		t.Fatalf("after pause: %+v %v", d, err)
	}
	resp, err := http1Client.Do(s.sandboxRequest(ctx, sb, envdPort, "GET", "/health", nil, false))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusNoContent {
		t.Fatalf("traffic to a paused autoResume sandbox: %d", resp.StatusCode)
	}
	if err := s.rest(ctx, "GET", "/sandboxes/"+sb.SandboxID, nil, &d); err != nil || d.State != "running" {
		t.Fatalf("after traffic: %+v %v", d, err)
	}
	out, code = s.run(t, sb, "/bin/sh", "-c", "cat /tmp/f && kill -0 "+pid+" && echo alive")
	if code != 0 || out != "kept\nalive\n" {
		t.Fatalf("after auto-resume: %d %q", code, out)
	}
}

// TestNamedSnapshotThroughREST snapshots a prepared sandbox and creates a
// new sandbox from the snapshot's name.
func TestNamedSnapshotThroughREST(t *testing.T) {
	s := needServer(t)
	src := s.createSandbox(t, map[string]any{"templateID": "minimal"})
	if _, code := s.run(t, src, "/bin/sh", "-c", "echo prepared > /home/user/state"); code != 0 {
		t.Fatal("prepare failed")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	name := "e2e-" + strings.ToLower(src.SandboxID[:8])
	var snap struct {
		SnapshotID string   `json:"snapshotID"`
		Names      []string `json:"names"`
	}
	if err := s.rest(ctx, "POST", "/sandboxes/"+src.SandboxID+"/snapshots", map[string]any{"name": name}, &snap); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.rest(context.Background(), "DELETE", "/snapshots/"+name, nil, nil) })
	if snap.SnapshotID != name || len(snap.Names) != 1 {
		t.Fatalf("snapshot response %+v", snap)
	}
	var list []map[string]any
	if err := s.rest(ctx, "GET", "/snapshots", nil, &list); err != nil || len(list) == 0 {
		t.Fatalf("GET /snapshots: %v %v", list, err)
	}
	child := s.createSandbox(t, map[string]any{"templateID": name})
	out, code := s.run(t, child, "/bin/sh", "-c", "cat /home/user/state")
	if code != 0 || out != "prepared\n" {
		t.Fatalf("sandbox from snapshot: %d %q", code, out)
	}
}
