package orchestrator

import (
	"context"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/agentenv/agentenv/internal/procstat"
	"github.com/agentenv/agentenv/internal/sandboxes"
	"github.com/agentenv/agentenv/internal/vmm"
)

// coldPauseOnly configures a node whose pauses keep no hot copy.
func coldPauseOnly(c *Config) { c.HotPausedMiB = -1 }

// TestHotPause: a pause keeps its QEMU stopped (no CPU spent) with the
// state on disk as a cold pause writes it; the resume continues that very
// QEMU (its processes and files there, its clock set). Beyond the budget
// the least recently paused copy is demoted, past its time a copy exits,
// a change to the files it holds makes the resume a cold one, a kill ends
// it, and a restart of the node drops it (the sandbox resumes from disk).
func TestHotPause(t *testing.T) {
	dir := newTestDataDir(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	n := openTestNodeIn(t, dir, 0, func(c *Config) { c.HotPausedMiB = 300; c.HotPausedFor = time.Hour })
	closed := false
	defer func() {
		if !closed {
			all, _ := n.List(context.Background())
			for _, s := range all {
				n.Kill(context.Background(), s.ID)
			}
			n.Close()
		}
	}()
	prepare := func() (*sandboxes.Sandbox, string) {
		t.Helper()
		s := create(t, n, CreateRequest{TemplateID: "minimal", MemoryMiB: 256, Secure: true})
		r, err := newEnvdClient(s).run(ctx, "", "/bin/sh", "-c", "echo kept > /home/user/f; sleep 100000 >/dev/null 2>&1 & echo $!")
		if err != nil || r.exit != 0 {
			t.Fatalf("prepare: %+v %v", r, err)
		}
		return s, strings.TrimSpace(r.stdout)
	}
	check := func(s *sandboxes.Sandbox, pid string) {
		t.Helper()
		r, err := newEnvdClient(s).run(ctx, "", "/bin/sh", "-c", "cat /home/user/f; kill -0 "+pid+" && echo alive; date +%s")
		lines := strings.Split(strings.TrimSpace(r.stdout), "\n")
		if err != nil || len(lines) != 3 || lines[0] != "kept" || lines[1] != "alive" {
			t.Fatalf("after the resume: %+v %v", r, err)
		}
		if d := time.Since(time.Unix(parseInt(t, lines[2]), 0)); d > 5*time.Second || d < -5*time.Second {
			t.Errorf("the guest's clock is %s off after the resume", d.Round(time.Second))
		}
	}
	qemuOf := func(id string) int {
		for pid, sid := range vmmRunning(n) {
			if sid == id {
				return pid
			}
		}
		return 0
	}

	a, aPID := prepare()
	qemuA := qemuOf(a.ID)
	if _, err := n.Pause(ctx, a.ID); err != nil {
		t.Fatal(err)
	}
	if !n.hot.has(a.ID) || qemuOf(a.ID) != qemuA {
		t.Fatalf("after the pause: hot %v, QEMU %d (was %d)", n.hot.has(a.ID), qemuOf(a.ID), qemuA)
	}
	// The state is on disk as for a cold pause.
	if err := n.verifyPausedState(a); err != nil {
		t.Fatalf("the hot paused sandbox's state on disk: %v", err)
	}
	cpu0, _ := procstat.CPUSeconds(qemuA)
	time.Sleep(2 * time.Second)
	if cpu1, _ := procstat.CPUSeconds(qemuA); cpu1-cpu0 > 0.1 {
		t.Errorf("a stopped QEMU used %.2fs of CPU in 2 s", cpu1-cpu0)
	}
	time.Sleep(3 * time.Second) // the guest's clock falls behind
	start := time.Now()
	res, err := n.Resume(ctx, a.ID, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("hot resume in %s: %v", time.Since(start).Round(time.Millisecond), res.Phases)
	if res.PID != qemuA || n.hot.has(a.ID) {
		t.Fatalf("the hot resume runs QEMU %d (was %d), hot %v", res.PID, qemuA, n.hot.has(a.ID))
	}
	if _, err := os.Stat(filepath.Join(n.sandboxDir(a.ID), pauseRecordName)); !os.IsNotExist(err) {
		t.Errorf("the pause record outlived the resume: %v", err)
	}
	check(res, aPID)

	// The budget (300 MiB) holds one 256 MiB copy: the older is demoted.
	b, bPID := prepare()
	if _, err := n.Pause(ctx, a.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := n.Pause(ctx, b.ID); err != nil {
		t.Fatal(err)
	}
	if n.hot.has(a.ID) || !n.hot.has(b.ID) || qemuOf(a.ID) != 0 {
		t.Fatalf("past the budget: a hot %v (QEMU %d), b hot %v", n.hot.has(a.ID), qemuOf(a.ID), n.hot.has(b.ID))
	}
	if n.hot.bytes() != 256<<20 {
		t.Errorf("hot copies hold %d bytes", n.hot.bytes())
	}
	res, err = n.Resume(ctx, a.ID, time.Minute) // cold
	if err != nil {
		t.Fatal(err)
	}
	check(res, aPID)

	// A change to a file the stopped QEMU holds: the resume is cold.
	qemuB := qemuOf(b.ID)
	overlay := filepath.Join(n.sandboxDir(b.ID), overlayName)
	if err := os.Chtimes(overlay, time.Now(), time.Now()); err != nil {
		t.Fatal(err)
	}
	res, err = n.Resume(ctx, b.ID, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if res.PID == qemuB {
		t.Fatal("resumed the hot copy of a sandbox whose disk changed")
	}
	check(res, bPID)

	// A kill ends the stopped QEMU.
	if _, err := n.Pause(ctx, b.ID); err != nil {
		t.Fatal(err)
	}
	qemuB = qemuOf(b.ID)
	if err := n.Kill(ctx, b.ID); err != nil {
		t.Fatal(err)
	}
	if unixKill0(qemuB) == nil && qemuOf(b.ID) != 0 {
		t.Fatal("the hot copy of a killed sandbox runs")
	}

	// A restart drops the hot copy; the sandbox resumes from disk.
	if _, err := n.Pause(ctx, a.ID); err != nil {
		t.Fatal(err)
	}
	n.Close()
	closed = true
	n = openTestNodeIn(t, dir, 0, func(c *Config) { c.HotPausedMiB = 300 })
	closed = false
	if qemuOf(a.ID) != 0 || n.hot.has(a.ID) {
		t.Fatal("a hot copy outlived the node's restart")
	}
	res, err = n.Resume(ctx, a.ID, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	check(res, aPID)
}

// TestHotPauseExpires: a hot copy kept past its time exits; the sandbox
// resumes from disk.
func TestHotPauseExpires(t *testing.T) {
	n := testNode(t, func(c *Config) { c.HotPausedFor = time.Second })
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	s := create(t, n, CreateRequest{TemplateID: "minimal", Secure: true})
	if _, err := n.Pause(ctx, s.ID); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for n.hot.has(s.ID) {
		if time.Now().After(deadline) {
			t.Fatal("the hot copy stayed past its time")
		}
		time.Sleep(200 * time.Millisecond)
	}
	for pid, id := range vmmRunning(n) {
		if id == s.ID {
			t.Fatalf("QEMU %d of an expired hot copy runs", pid)
		}
	}
	res, err := n.Resume(ctx, s.ID, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if out, err := newEnvdClient(res).run(ctx, "", "/bin/true"); err != nil || out.exit != 0 {
		t.Fatalf("after a cold resume: %+v %v", out, err)
	}
}

// vmmRunning is the QEMUs of n's sandboxes, by pid.
func vmmRunning(n *Node) map[int]string { return vmm.Running(n.sandboxDir("")) }

func parseInt(t *testing.T, s string) int64 {
	t.Helper()
	v, err := strconv.ParseInt(strings.TrimSpace(s), 10, 64)
	if err != nil {
		t.Fatalf("%q: %v", s, err)
	}
	return v
}
