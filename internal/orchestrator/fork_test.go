package orchestrator

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/agentenv/agentenv/internal/faults"
	"github.com/agentenv/agentenv/internal/sandboxes"
	"github.com/agentenv/agentenv/internal/vmm"
	"golang.org/x/sys/unix"
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

// TestForkIntoPrestartedMachines forks a sandbox that was forked before:
// its children take the machines pre-started for its memory base (as many
// as wait; the rest restore as usual), read the parent's disk as it was at
// this fork (not the memory base's), and pause and resume cold on it. A
// claim that fails removes that child and nothing else; once no sandbox
// runs on the memory base its machines go, and with them the snapshots.
func TestForkIntoPrestartedMachines(t *testing.T) {
	n := testNode(t, coldPauseOnly, func(c *Config) { c.ForkPoolSize = 2 })
	if !n.qemu.RestacksDisks() {
		t.Fatal("this QEMU cannot restack a waiting machine's disk")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	parent := create(t, n, CreateRequest{TemplateID: "base"})
	runOK := func(s *sandboxes.Sandbox, script string) string {
		t.Helper()
		cur, err := n.Get(ctx, s.ID)
		if err != nil {
			t.Fatal(err)
		}
		r, err := newEnvdClient(cur).run(ctx, "root", "bash", "-c", script)
		if err != nil || r.exit != 0 {
			t.Fatalf("%s: %q: %+v %v", s.ID, script, r, err)
		}
		return r.stdout
	}
	// What the guests read must come from their disks, not the page cache
	// their RAM carries.
	const fromDisk = "sync; echo 3 > /proc/sys/vm/drop_caches; cat /home/user/f"
	runOK(parent, "echo first > /home/user/f; sync")
	first, err := n.Fork(ctx, parent.ID, 1, time.Minute)
	if err != nil || first[0].Err != nil {
		t.Fatalf("first fork: %v %v", err, first)
	}
	p, err := n.records.Get(ctx, parent.ID)
	if err != nil {
		t.Fatal(err)
	}
	key := forkPoolKey("base", n.memoryBaseOf(p))
	waitPool := func(want int) []string {
		t.Helper()
		deadline := time.Now().Add(90 * time.Second)
		for n.forkPool.Len(key) != want {
			if time.Now().After(deadline) {
				t.Fatalf("fork pool holds %d machines, want %d", n.forkPool.Len(key), want)
			}
			time.Sleep(100 * time.Millisecond)
		}
		var ids []string
		for _, e := range n.forkPool.Entries(key) {
			ids = append(ids, e.s.ID)
		}
		return ids
	}
	waitPool(2)
	// A waiting machine whose QEMU dies is removed and replaced.
	dead := n.forkPool.Entries(key)[0].s
	if err := syscall.Kill(dead.PID, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(60 * time.Second)
	for {
		ids := waitPool(2)
		if !slices.Contains(ids, dead.ID) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the dead machine %s is still in the fork pool", dead.ID)
		}
		time.Sleep(100 * time.Millisecond)
	}
	if _, err := n.records.Get(ctx, dead.ID); !errors.Is(err, ErrNotFound) {
		t.Fatalf("the dead machine's record: %v", err)
	}
	pooled := waitPool(2)
	// A waiting machine takes only CPU nobody else wants.
	for _, e := range n.forkPool.Entries(key) {
		assertPolicy(t, e.m, unix.SCHED_IDLE)
	}

	runOK(parent, "echo second > /home/user/f; sync")
	res, err := n.Fork(ctx, parent.ID, 3, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	took := 0
	for i, fr := range res {
		if fr.Err != nil {
			t.Fatalf("child %d: %v", i, fr.Err)
		}
		for _, id := range pooled {
			if fr.Sandbox.ID == id {
				took++
			}
		}
		if out := runOK(fr.Sandbox, fromDisk+"; echo child-"+strconv.Itoa(i)+" > /home/user/f; sync"); out != "second\n" {
			t.Fatalf("child %d reads %q, want the parent's disk at the fork", i, out)
		}
	}
	if took != 2 {
		t.Fatalf("%d of the fork's children took the 2 pre-started machines %v", took, pooled)
	}
	// Every child runs at normal priority, those on pre-started machines
	// too.
	for _, fr := range res {
		m := n.machines.get(fr.Sandbox.ID)
		if m == nil {
			t.Fatalf("child %s has no machine", fr.Sandbox.ID)
		}
		assertPolicy(t, m, unix.SCHED_NORMAL)
	}
	// A child on a pre-started machine pauses and resumes cold on its own
	// disk, whose header names the fork's image.
	var child *sandboxes.Sandbox
	for _, fr := range res {
		if fr.Sandbox.ID == pooled[0] {
			child = fr.Sandbox
		}
	}
	if _, err := n.Pause(ctx, child.ID); err != nil {
		t.Fatal(err)
	}
	if n.hot.has(child.ID) {
		t.Fatal("the pause stayed hot; this test wants the cold path")
	}
	if _, err := n.Resume(ctx, child.ID, time.Minute); err != nil {
		t.Fatal(err)
	}
	if out := runOK(child, fromDisk); !strings.HasPrefix(out, "child-") {
		t.Fatalf("child after a cold pause and resume reads %q", out)
	}
	if out := runOK(parent, fromDisk); out != "second\n" {
		t.Fatalf("parent reads %q after its children wrote", out)
	}

	// Killing the children that took pre-started machines, and the pool's
	// refill, leave the parent as it was.
	for _, fr := range res {
		if err := n.Kill(ctx, fr.Sandbox.ID); err != nil {
			t.Fatal(err)
		}
	}
	waitPool(2)
	if out := runOK(parent, fromDisk); out != "second\n" {
		t.Fatalf("parent reads %q after its children were killed", out)
	}

	// A step of a pre-started child that fails (recording it, claiming the
	// machine, or between the restack and the overlay's new header)
	// removes that child; the rest of the fork and the parent are
	// untouched. record-child fails the fresh child too.
	for _, point := range []struct {
		name   string
		failed int
	}{{"fork/record-child", 3}, {"fork/claim-prestarted", 2}, {forkRebaseFault, 2}} {
		pooled = waitPool(2)
		bad, err := n.Fork(faults.With(ctx, faults.NewInjector(point.name)), parent.ID, 3, time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		failed := 0
		for _, fr := range bad {
			if fr.Err == nil {
				if out := runOK(fr.Sandbox, fromDisk); out != "second\n" {
					t.Fatalf("%s: restored child reads %q", point.name, out)
				}
				continue
			}
			if !errors.Is(fr.Err, faults.ErrInjected) {
				t.Fatalf("%s: child failed with %v", point.name, fr.Err)
			}
			failed++
		}
		if failed != point.failed {
			t.Fatalf("%s: %d children failed, want %d", point.name, failed, point.failed)
		}
		for _, id := range pooled {
			if _, err := n.records.Get(ctx, id); !errors.Is(err, ErrNotFound) {
				t.Fatalf("%s: failed child %s left a record: %v", point.name, id, err)
			}
			if _, err := os.Stat(n.sandboxDir(id)); !os.IsNotExist(err) {
				t.Fatalf("%s: failed child %s left its directory: %v", point.name, id, err)
			}
		}
		if out := runOK(parent, "cat /home/user/f"); out != "second\n" {
			t.Fatalf("%s: parent after the failed children: %q", point.name, out)
		}
	}

	// A caller that goes away at any step of a fork onto pre-started
	// machines changes nothing of how it ends: gone before the fork
	// began, nothing was made (the pool's machines wait on); gone at any
	// step (the steps recorded from a fork that fails nowhere), the fork
	// runs to its end and every child runs on the parent's disk.
	running, err := n.records.List(ctx, "state != ?", sandboxes.Pooled)
	if err != nil {
		t.Fatal(err)
	}
	before := map[string]bool{}
	for _, s := range running {
		before[s.ID] = true
	}
	forkGone := func(cctx context.Context, at string) {
		t.Helper()
		pooled := waitPool(2)
		res, err := n.Fork(cctx, parent.ID, 2, time.Minute)
		if at == "" {
			if !errors.Is(err, context.Canceled) {
				t.Fatalf("a fork whose caller was gone before it began: %v", err)
			}
			all, _ := n.records.List(ctx, "state != ?", sandboxes.Pooled)
			for _, s := range all {
				if !before[s.ID] {
					t.Fatalf("the fork that did not begin left %s (%s)", s.ID, s.State)
				}
			}
			if ids := waitPool(2); !slices.Equal(ids, pooled) {
				t.Fatalf("the fork that did not begin changed the pool: %v, was %v", ids, pooled)
			}
		} else if err != nil {
			t.Fatalf("caller gone at %s: %v", at, err)
		}
		for _, fr := range res {
			if fr.Err != nil {
				t.Fatalf("caller gone at %s: child: %v", at, fr.Err)
			}
			if !slices.Contains(pooled, fr.Sandbox.ID) {
				t.Fatalf("caller gone at %s: child %s is not on a pre-started machine %v", at, fr.Sandbox.ID, pooled)
			}
			if out := runOK(fr.Sandbox, fromDisk); out != "second\n" {
				t.Fatalf("caller gone at %s: child reads %q", at, out)
			}
			if err := n.Kill(ctx, fr.Sandbox.ID); err != nil {
				t.Fatal(err)
			}
		}
		p, err := n.records.Get(ctx, parent.ID)
		if err != nil || p.State != sandboxes.Running {
			t.Fatalf("caller gone at %s: parent %+v %v", at, p, err)
		}
		if out := runOK(parent, "cat /home/user/f"); out != "second\n" {
			t.Fatalf("caller gone at %s: parent reads %q", at, out)
		}
	}
	gone, hangUp := context.WithCancel(ctx)
	hangUp()
	forkGone(gone, "")
	rec := faults.NewInjector()
	forkGone(faults.With(ctx, rec), "nowhere")
	steps := distinct(rec.Seen(), "fork")
	if !slices.Contains(steps, "fork/claim-prestarted") {
		t.Fatalf("the fork's steps %v miss the pre-started claim", steps)
	}
	for _, step := range steps {
		cctx, hangUp := context.WithCancel(ctx)
		inj := faults.NewInjector()
		inj.Hook = func(name string) {
			if name == step {
				hangUp()
			}
		}
		forkGone(faults.With(cctx, inj), step)
		hangUp()
	}

	// Once nothing runs on the memory base, its machines and the snapshots go.
	waitPool(2)
	all, _ := n.records.List(ctx, "state != ?", sandboxes.Pooled)
	for _, s := range all {
		if err := n.Kill(ctx, s.ID); err != nil {
			t.Fatal(err)
		}
	}
	waitPool(0)
	deadline = time.Now().Add(30 * time.Second)
	for {
		left, _ := n.records.List(ctx, "")
		snaps, _ := os.ReadDir(filepath.Join(n.cfg.DataDir, snapshotsDir))
		if len(left) == 0 && len(snaps) == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("left after every sandbox was killed: %d records, snapshots %v", len(left), snaps)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// assertPolicy fails unless every thread of m's QEMU has the scheduling
// policy want.
func assertPolicy(t *testing.T, m *vmm.Machine, want uint32) {
	t.Helper()
	tids, err := m.Threads()
	if err != nil || len(tids) == 0 {
		t.Fatalf("threads of qemu %d: %v %v", m.PID(), tids, err)
	}
	for _, tid := range tids {
		a, err := unix.SchedGetAttr(tid, 0)
		if err != nil {
			t.Fatalf("policy of qemu %d thread %d: %v", m.PID(), tid, err)
		}
		if a.Policy != want {
			t.Fatalf("qemu %d thread %d (of %d) has policy %d, want %d", m.PID(), tid, len(tids), a.Policy, want)
		}
	}
}
