package orchestrator

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/agentenv/agentenv/internal/sandboxes"
)

func TestFork(t *testing.T) {
	n := testNode(t)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	parent := create(t, n, CreateRequest{TemplateID: "base", Secure: true,
		EnvVars: map[string]string{"K": "v"}, Metadata: map[string]string{"team": "rl"}})
	pc := newEnvdClient(parent)
	r, err := pc.run(ctx, "", "bash", "-c", "nohup bash -c 'i=0; while true; do i=$((i+1)); echo $i > /tmp/c.tmp; mv /tmp/c.tmp /tmp/counter; sleep 0.1; done' >/dev/null 2>&1 & echo $!; echo parent-data > /home/user/f")
	if err != nil || r.exit != 0 {
		t.Fatalf("prepare parent: %+v %v", r, err)
	}
	bg := strings.TrimSpace(r.stdout)
	time.Sleep(500 * time.Millisecond) // let the counter write its first value

	for _, bad := range []int{0, 17, -1} {
		if _, err := n.Fork(ctx, parent.ID, bad, 0); !errors.Is(err, ErrInvalid) {
			t.Errorf("fork count %d = %v, want invalid", bad, err)
		}
	}
	start := time.Now()
	res, err := n.Fork(ctx, parent.ID, 3, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("fork of 3 took %s", time.Since(start))
	uuids := map[string]bool{}
	ids := map[string]bool{parent.ID: true}
	for i, fr := range res {
		if fr.Err != nil {
			t.Fatalf("child %d: %v", i, fr.Err)
		}
		c := fr.Sandbox
		if ids[c.ID] || c.AccessToken == parent.AccessToken || c.AccessToken == "" {
			t.Fatalf("child %d has no identity of its own: %+v", i, c)
		}
		ids[c.ID] = true
		if c.Metadata["team"] != "rl" || c.VCPUs != parent.VCPUs || c.MemoryMiB != parent.MemoryMiB || c.State != sandboxes.Running {
			t.Fatalf("child %d config: %+v", i, c)
		}
		cc := newEnvdClient(c)
		out, err := cc.run(ctx, "", "bash", "-c", "kill -0 "+bg+" && cat /tmp/counter /home/user/f /proc/sys/kernel/random/uuid && echo $K && echo child-"+strconv.Itoa(i)+" > /home/user/f")
		if err != nil || out.exit != 0 {
			t.Fatalf("child %d: %+v %v", i, out, err)
		}
		f := strings.Fields(out.stdout)
		if len(f) != 4 || f[1] != "parent-data" || f[3] != "v" {
			t.Fatalf("child %d state: %q", i, out.stdout)
		}
		uuids[f[2]] = true
		// The parent's token does not open the child.
		stale := *cc
		stale.token = parent.AccessToken
		if _, err := stale.run(ctx, "", "/bin/true"); err == nil {
			t.Fatalf("child %d accepted the parent's access token", i)
		}
	}
	if len(uuids) != 3 {
		t.Fatalf("children share random numbers: %v", uuids)
	}
	// The parent runs on, unaffected by the children's writes.
	p, err := n.Get(ctx, parent.ID)
	if err != nil || p.State != sandboxes.Running {
		t.Fatalf("parent after fork: %+v %v", p, err)
	}
	out, err := newEnvdClient(p).run(ctx, "", "bash", "-c", "kill -0 "+bg+" && cat /home/user/f")
	if err != nil || out.stdout != "parent-data\n" {
		t.Fatalf("parent after fork: %+v %v", out, err)
	}
	// A child can be forked in turn: its copy-on-write RAM is written into a
	// new image first, and both it and the grandchild run on.
	gres, err := n.Fork(ctx, res[1].Sandbox.ID, 1, time.Minute)
	if err != nil || gres[0].Err != nil {
		t.Fatalf("fork of a fork child: %v %v", err, gres)
	}
	ids[gres[0].Sandbox.ID] = true
	for _, sb := range []*sandboxes.Sandbox{res[1].Sandbox, gres[0].Sandbox} {
		cur, _ := n.Get(ctx, sb.ID)
		out, err := newEnvdClient(cur).run(ctx, "", "bash", "-c", "kill -0 "+bg+" && cat /home/user/f")
		if err != nil || out.stdout != "child-1\n" {
			t.Fatalf("%s after forking the child: %+v %v", sb.ID, out, err)
		}
	}
	// A child can be paused and resumed (its RAM goes into its own state).
	child := res[0].Sandbox
	pt0 := time.Now()
	if _, err := n.Pause(ctx, child.ID); err != nil {
		t.Fatal(err)
	}
	if st, err := os.Stat(filepath.Join(n.sandboxDir(child.ID), stateFileName)); err == nil {
		t.Logf("pause of a fork child took %v; its state (devices + changed pages) is %d bytes", time.Since(pt0), st.Size())
	}
	rc, err := n.Resume(ctx, child.ID, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	out, err = newEnvdClient(rc).run(ctx, "", "bash", "-c", "kill -0 "+bg+" && cat /home/user/f")
	if err != nil || out.stdout != "child-0\n" {
		t.Fatalf("child after pause/resume: %+v %v", out, err)
	}
	// Once every sandbox using it is gone, the snapshot is deleted.
	for id := range ids {
		if err := n.Kill(ctx, id); err != nil {
			t.Fatal(err)
		}
	}
	snaps, _ := os.ReadDir(filepath.Join(n.cfg.DataDir, snapshotsDir))
	if len(snaps) != 0 {
		t.Fatalf("snapshots left after all sandboxes were killed: %v", snaps)
	}
}
