package orchestrator

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/agentenv/agentenv/internal/sandboxes"
)

func phaseNames(s *sandboxes.Sandbox) []string {
	var out []string
	for _, p := range s.Phases {
		out = append(out, p.Name)
	}
	return out
}

func TestCreateFromTemplateSnapshot(t *testing.T) {
	n := testNode(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	start := time.Now()
	if err := n.PrepareTemplateSnapshot(ctx, "base"); err != nil {
		t.Fatal(err)
	}
	t.Logf("template snapshot prepared in %s", time.Since(start))
	uuids := map[string]bool{}
	for i := 0; i < 2; i++ {
		s := create(t, n, CreateRequest{TemplateID: "base", Secure: true, EnvVars: map[string]string{"N": "x"}})
		if !slices.Contains(phaseNames(s), "copy RAM image") {
			t.Fatalf("create did not restore the template snapshot: %v", s.Phases)
		}
		t.Logf("restore phases: %v", s.Phases)
		r, err := newEnvdClient(s).run(ctx, "", "bash", "-c", "echo $N $(whoami); cat /proc/sys/kernel/random/uuid; date +%s")
		if err != nil || r.exit != 0 {
			t.Fatalf("restored sandbox: %+v %v", r, err)
		}
		f := strings.Fields(r.stdout)
		if len(f) != 4 || f[0] != "x" || f[1] != "user" {
			t.Fatalf("restored sandbox output %q", r.stdout)
		}
		uuids[f[2]] = true
		// The token is the new sandbox's own.
		anon := *newEnvdClient(s)
		anon.token = ""
		if _, err := anon.run(ctx, "", "/bin/true"); err == nil {
			t.Fatal("restored secure sandbox accepted a request without its token")
		}
		// Pause/resume works on a restored sandbox.
		if _, err := n.Pause(ctx, s.ID); err != nil {
			t.Fatal(err)
		}
		if _, err := n.Resume(ctx, s.ID, time.Minute); err != nil {
			t.Fatal(err)
		}
	}
	if len(uuids) != 2 {
		t.Fatal("two sandboxes restored from one snapshot produced the same random numbers")
	}
	// A size the snapshot does not have falls back to a cold boot.
	s := create(t, n, CreateRequest{TemplateID: "base", MemoryMiB: 640})
	if !slices.Contains(phaseNames(s), "guest boot to envd") {
		t.Fatalf("640 MiB create should cold-boot: %v", s.Phases)
	}
}

func TestCreateFromPool(t *testing.T) {
	n := testNode(t)
	n.pool.SetSize(2)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	if err := n.PrepareTemplateSnapshot(ctx, "minimal"); err != nil {
		t.Fatal(err)
	}
	tmpl, _ := n.Template("minimal")
	snap, err := n.currentTemplateSnapshot(tmpl)
	if err != nil {
		t.Fatal(err)
	}
	n.pool.Fill(ctx, poolKey(tmpl, snap))
	if all, _ := n.List(ctx); len(all) != 0 {
		t.Fatalf("pooled sandboxes are listed: %d", len(all))
	}
	off := false
	for i := 0; i < 3; i++ { // the third may find the pool still refilling
		s := create(t, n, CreateRequest{TemplateID: "minimal", Secure: true, AllowInternet: &off, EnvVars: map[string]string{"P": "1"}})
		t.Logf("create %d: %v", i, s.Phases)
		r, err := newEnvdClient(s).run(ctx, "", "/bin/sh", "-c", "echo $P")
		if err != nil || r.stdout != "1\n" {
			t.Fatalf("pooled create %d: %+v %v", i, r, err)
		}
		if got, err := n.Get(ctx, s.ID); err != nil || got.State != sandboxes.Running || got.AllowInternet {
			t.Fatalf("pooled sandbox record: %+v %v", got, err)
		}
	}
	n.Close()
	// Closing drains the pool: only the three created sandboxes remain recorded.
	n2 := openTestNode(t, n.cfg.DataDir)
	defer n2.Close()
	all, _ := n2.records.List(ctx, "")
	for _, s := range all {
		if s.State == sandboxes.Pooled {
			t.Fatalf("pooled sandbox left after close: %s", s.ID)
		}
		n2.Kill(ctx, s.ID)
	}
}
