package e2e

import (
	"context"
	"errors"
	"fmt"
	"math/rand"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestDataDirHasOneOwner starts a second `aenv server`, `aenv setup` and
// `aenv template import` on the data dir the package's server uses: each
// refuses at once, saying who holds it, and the server runs on.
func TestDataDirHasOneOwner(t *testing.T) {
	s := needServer(t)
	archive := filepath.Join(t.TempDir(), "x.tar")
	os.WriteFile(archive, []byte("not read: the data dir is refused first"), 0o600)
	for _, args := range [][]string{
		{"server", "--data-dir", s.dataDir, "--listen", freeAddr(t), "--instance", "dupl", "--network-cidr", "10.221.0.0/16", "--dns", "none"},
		{"setup", "--data-dir", s.dataDir, "--templates", "minimal"},
		{"template", "import", "x", "--docker-archive", archive, "--data-dir", s.dataDir},
	} {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		cmd := exec.CommandContext(ctx, s.bin, args...)
		cmd.Env = append(os.Environ(), "AENV_API_KEY="+apiKey)
		out, err := cmd.CombinedOutput()
		cancel()
		var ee *exec.ExitError
		if !errors.As(err, &ee) || !strings.Contains(string(out), "in use") || !strings.Contains(string(out), "aenv server (pid ") {
			t.Errorf("aenv %s on a data dir in use: %v\n%s", args[0], err, out)
		}
	}
	if err := s.rest(context.Background(), "GET", "/v2/sandboxes", nil, nil); err != nil {
		t.Fatalf("the server after the refusals: %v", err)
	}
}

// TestClientGivesUpMidOperation sends create, pause, resume, snapshot,
// fork and network updates with a client that gives up after a random time
// (seeded, logged): each operation completes or rolls back on the server,
// the sandbox is never lost (a fork's parent included), it still holds its
// file and its process, and its network rules are the old or the new set.
func TestClientGivesUpMidOperation(t *testing.T) {
	s := needServer(t)
	seed := time.Now().UnixNano()
	t.Logf("seed %d", seed)
	rnd := rand.New(rand.NewSource(seed))
	sb := s.createSandbox(t, map[string]any{"templateID": "minimal"})
	out, code := s.run(t, sb, "/bin/sh", "-c", "echo kept > /home/user/marker; sleep 100000 >/dev/null 2>&1 & echo $!")
	if code != 0 {
		t.Fatalf("prepare: %q %d", out, code)
	}
	pid := strings.TrimSpace(out)
	// giveUp sends a request that the client abandons after d.
	giveUp := func(method, path string, body any, d time.Duration) error {
		ctx, cancel := context.WithTimeout(context.Background(), d)
		defer cancel()
		return s.rest(ctx, method, path, body, nil)
	}
	// settle waits until the sandbox rests, resumes it if it is paused,
	// and checks it.
	settle := func(what string) {
		t.Helper()
		deadline := time.Now().Add(2 * time.Minute)
		for {
			var info struct {
				State string `json:"state"`
			}
			err := s.rest(context.Background(), "GET", "/sandboxes/"+sb.SandboxID, nil, &info)
			if err != nil {
				t.Fatalf("after %s: the sandbox is gone: %v\n%s", what, err, s.log())
			}
			if info.State == "paused" {
				if err := s.rest(context.Background(), "POST", "/sandboxes/"+sb.SandboxID+"/connect", map[string]any{"timeout": 300}, nil); err != nil {
					var ae *apiError
					if !errors.As(err, &ae) || ae.Status != 409 { // 409: still busy
						t.Fatalf("after %s: connect: %v", what, err)
					}
				}
			}
			var got string
			var code int
			if info.State == "running" { // (the API shows an operation in progress as running)
				ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
				got, code, err = s.runQuiet(ctx, sb, "/bin/sh", "-c", "cat /home/user/marker; kill -0 "+pid+" && echo alive")
				cancel()
				if err == nil && code == 0 && got == "kept\nalive\n" {
					return
				}
			}
			if time.Now().After(deadline) {
				t.Fatalf("after %s: %s, holding %q (exit %d, %v)", what, info.State, got, code, err)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	killAllBut := func(keep string) {
		var list []map[string]any
		s.rest(context.Background(), "GET", "/v2/sandboxes", nil, &list)
		for _, x := range list {
			if id := x["sandboxID"].(string); id != keep {
				s.rest(context.Background(), "DELETE", "/sandboxes/"+id, nil, nil)
			}
		}
	}
	// The network rules are one set or the other, never a mix or none.
	allowOut := func() string {
		var info struct {
			Network struct {
				AllowOut []string `json:"allowOut"`
			} `json:"network"`
		}
		if err := s.rest(context.Background(), "GET", "/sandboxes/"+sb.SandboxID, nil, &info); err != nil {
			t.Fatal(err)
		}
		return strings.Join(info.Network.AllowOut, ",")
	}
	rules := allowOut()
	for round := 0; round < 4; round++ {
		for _, op := range []struct{ method, path string }{
			{"PUT", "/sandboxes/" + sb.SandboxID + "/network"},
			{"POST", "/sandboxes/" + sb.SandboxID + "/pause"},
			{"POST", "/sandboxes/" + sb.SandboxID + "/connect"},
			{"POST", "/sandboxes/" + sb.SandboxID + "/fork"},
			{"POST", "/sandboxes/" + sb.SandboxID + "/snapshots"},
			{"POST", "/v2/sandboxes"},
		} {
			d := time.Duration(5+rnd.Intn(600)) * time.Millisecond
			var body any = map[string]any{"timeout": 300}
			switch {
			case strings.HasSuffix(op.path, "/fork"):
				body = map[string]any{"count": 1 + rnd.Intn(3)}
			case strings.HasSuffix(op.path, "/snapshots"):
				body = map[string]any{"name": fmt.Sprintf("giveup-%d-%d", seed%1000, round)}
			case op.path == "/v2/sandboxes":
				body = map[string]any{"templateID": "minimal"}
			case strings.HasSuffix(op.path, "/network"):
				body = map[string]any{"allowOut": []string{fmt.Sprintf("192.0.2.%d", round), fmt.Sprintf("*.r%d.example.com", round)}}
			}
			err := giveUp(op.method, op.path, body, d)
			t.Logf("round %d: %s %s, client gone after %s: %v", round, op.method, op.path, d, err)
			settle(fmt.Sprintf("%s %s cut at %s", op.method, op.path, d))
			if strings.HasSuffix(op.path, "/network") {
				now, want := allowOut(), fmt.Sprintf("192.0.2.%d,*.r%d.example.com", round, round)
				if now != rules && now != want {
					t.Fatalf("after a network update cut at %s: rules %q, want %q or %q", d, now, rules, want)
				}
				rules = now
			}
			killAllBut(sb.SandboxID)
		}
	}
	var snaps []map[string]any
	s.rest(context.Background(), "GET", "/snapshots", nil, &snaps)
	for _, sn := range snaps {
		if names, ok := sn["names"].([]any); ok {
			for _, n := range names {
				s.rest(context.Background(), "DELETE", "/snapshots/"+n.(string), nil, nil)
			}
		}
	}
}
