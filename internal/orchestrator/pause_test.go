package orchestrator

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/agentenv/agentenv/internal/faults"
	"github.com/agentenv/agentenv/internal/network"
	"github.com/agentenv/agentenv/internal/sandboxes"
)

func TestPauseResume(t *testing.T) {
	dir := newTestDataDir(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	// The cold tier: the pause's QEMU exits (hot_test.go has the hot one).
	n := openTestNodeIn(t, dir, 0, coldPauseOnly)
	s := create(t, n, CreateRequest{TemplateID: "base", Secure: true, EnvVars: map[string]string{"K": "v"}})
	c := newEnvdClient(s)
	// A background process that counts, and a file.
	r, err := c.run(ctx, "", "bash", "-c", "nohup bash -c 'i=0; while true; do i=$((i+1)); echo $i > /tmp/c.tmp; mv /tmp/c.tmp /tmp/counter; sleep 0.1; done' >/dev/null 2>&1 & echo $!; echo data > /home/user/f")
	if err != nil || r.exit != 0 {
		t.Fatalf("start background process: %+v %v", r, err)
	}
	bgPID := strings.TrimSpace(r.stdout)
	time.Sleep(500 * time.Millisecond)

	p, err := n.Pause(ctx, s.ID)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("pause phases: %v", p.Phases)
	got, _ := n.Get(ctx, s.ID)
	if got.State != sandboxes.Paused || got.PID != 0 || got.PauseMode != sandboxes.PauseFull {
		t.Fatalf("after pause: %+v", got)
	}
	if err := unixKill0(s.PID); err == nil {
		if b, _ := os.ReadFile("/proc/" + strconv.Itoa(s.PID) + "/cmdline"); strings.Contains(string(b), s.ID) {
			t.Fatal("QEMU still running after pause")
		}
	}
	if _, err := n.Pause(ctx, s.ID); !errors.Is(err, ErrConflict) {
		t.Fatalf("second pause = %v, want conflict", err)
	}
	if _, err := n.SetTimeout(ctx, s.ID, time.Minute); !errors.Is(err, ErrConflict) {
		t.Fatalf("set timeout on paused = %v, want conflict", err)
	}

	// The paused sandbox survives a restart of the node.
	n.Close()
	n = openTestNode(t, dir)
	defer func() {
		all, _ := n.List(context.Background())
		for _, s := range all {
			n.Kill(context.Background(), s.ID)
		}
		n.Close()
	}()
	if got, err := n.Get(ctx, s.ID); err != nil || got.State != sandboxes.Paused {
		t.Fatalf("paused sandbox after restart: %+v %v", got, err)
	}

	time.Sleep(1500 * time.Millisecond) // the guest's clock must not show this gap
	res, err := n.Resume(ctx, s.ID, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("resume phases: %v", res.Phases)
	if res.State != sandboxes.Running || time.Until(res.EndAt) < 55*time.Second {
		t.Fatalf("after resume: %+v", res)
	}
	if _, err := n.Resume(ctx, s.ID, 0); !errors.Is(err, ErrConflict) {
		t.Fatalf("resume running = %v, want conflict", err)
	}
	c = newEnvdClient(res)
	r1, err := c.run(ctx, "", "bash", "-c", "kill -0 "+bgPID+" && cat /tmp/counter /home/user/f && echo $K")
	if err != nil || r1.exit != 0 {
		t.Fatalf("after resume: %+v %v", r1, err)
	}
	time.Sleep(time.Second)
	r2, err := c.run(ctx, "", "bash", "-c", "cat /tmp/counter; date +%s")
	if err != nil {
		t.Fatal(err)
	}
	lines1, lines2 := strings.Fields(r1.stdout), strings.Fields(r2.stdout)
	if len(lines1) != 3 || lines1[1] != "data" || lines1[2] != "v" || len(lines2) != 2 {
		t.Fatalf("unexpected output %q / %q", r1.stdout, r2.stdout)
	}
	c1, _ := strconv.Atoi(lines1[0])
	c2, _ := strconv.Atoi(lines2[0])
	if c1 < 2 || c2 <= c1 {
		t.Fatalf("background process did not keep counting: %d then %d", c1, c2)
	}
	guestNow, _ := strconv.ParseInt(lines2[1], 10, 64)
	if skew := time.Now().Unix() - guestNow; skew > 2 || skew < -2 {
		t.Fatalf("guest clock off by %ds after resume", skew)
	}

	if err := n.Kill(ctx, s.ID); err != nil {
		t.Fatal(err)
	}
	assertGone(t, n, s)
	if _, err := n.Resume(ctx, s.ID, 0); !errors.Is(err, ErrNotFound) {
		t.Fatalf("resume killed = %v, want not found", err)
	}
}

func TestExpiryPausesWithAutoPause(t *testing.T) {
	n := testNode(t)
	s := create(t, n, CreateRequest{TemplateID: "minimal", Timeout: 2 * time.Second, AutoPause: true})
	deadline := time.Now().Add(20 * time.Second)
	for {
		got, err := n.Get(context.Background(), s.ID)
		if err != nil {
			t.Fatal(err)
		}
		if got.State == sandboxes.Paused {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("sandbox %s 20s after its timeout", got.State)
		}
		time.Sleep(200 * time.Millisecond)
	}
	res, err := n.Resume(context.Background(), s.ID, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	r, err := newEnvdClient(res).run(context.Background(), "", "/bin/sh", "-c", "echo back")
	if err != nil || r.stdout != "back\n" {
		t.Fatalf("resumed sandbox: %+v %v", r, err)
	}
}

// TestPauseWithoutMemory: a filesystem-only pause (E2B's memory: false)
// keeps what the guest wrote (synced before QEMU exits, without the
// program calling sync) and no RAM; resume boots the sandbox again on its
// disk (processes gone, env vars and secure token as before); traffic's
// auto-resume refuses it; it survives a restart of the node; and a
// sandbox paused with memory can be rebooted from its disk instead
// (connect's memory: false), keeping what its guest had not flushed.
func TestPauseWithoutMemory(t *testing.T) {
	dir := newTestDataDir(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	n := openTestNode(t, dir)
	defer func() {
		all, _ := n.List(context.Background())
		for _, s := range all {
			n.Kill(context.Background(), s.ID)
		}
		n.Close()
	}()
	s := create(t, n, CreateRequest{TemplateID: "base", Secure: true, EnvVars: map[string]string{"K": "v"}})
	c := newEnvdClient(s)
	r, err := c.run(ctx, "", "bash", "-c", "nohup sleep 1000 >/dev/null 2>&1 & echo $!; head -c 3000000 /dev/urandom | sha256sum | cut -c1-64 > /home/user/f; cat /home/user/f")
	if err != nil || r.exit != 0 {
		t.Fatalf("write a file, start a process: %+v %v", r, err)
	}
	lines := strings.Fields(r.stdout)
	bgPID, sum := lines[0], lines[1]

	if _, err := n.PauseFilesystem(ctx, s.ID); err != nil {
		t.Fatal(err)
	}
	got, _ := n.Get(ctx, s.ID)
	if got.State != sandboxes.Paused || got.PID != 0 || got.MemFile != "" || got.MemPrivate || got.PauseMode != sandboxes.PauseFilesystem {
		t.Fatalf("after the pause: %+v", got)
	}
	sdir := n.sandboxDir(s.ID)
	for _, f := range []string{memFileName, stateFileName} {
		if _, err := os.Stat(filepath.Join(sdir, f)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("a pause without memory kept %s: %v", f, err)
		}
	}
	if _, err := n.ResumeWith(ctx, s.ID, ResumeOptions{Auto: true}); !errors.Is(err, ErrConflict) {
		t.Fatalf("auto-resume of a sandbox paused without memory = %v, want conflict", err)
	}
	if got, _ := n.Get(ctx, s.ID); got.State != sandboxes.Paused {
		t.Fatalf("after the refused auto-resume: %s", got.State)
	}

	n.Close()
	n = openTestNode(t, dir)
	if got, err := n.Get(ctx, s.ID); err != nil || got.State != sandboxes.Paused {
		t.Fatalf("after a restart of the node: %+v %v", got, err)
	}
	res, err := n.Resume(ctx, s.ID, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("resume phases: %v", phaseNames(res))
	if !strings.Contains(strings.Join(phaseNames(res), ","), "guest boot") {
		t.Errorf("the resume did not boot: phases %v", phaseNames(res))
	}
	c = newEnvdClient(res)
	out, err := c.run(ctx, "", "bash", "-c", "cat /home/user/f; echo $K; kill -0 "+bgPID+" 2>/dev/null && ps -o comm= -p "+bgPID+" || echo gone")
	if err != nil || out.exit != 0 {
		t.Fatalf("after the resume: %+v %v", out, err)
	}
	if want := sum + "\nv\n"; !strings.HasPrefix(out.stdout, want) || strings.Contains(out.stdout, "sleep") {
		t.Fatalf("after the resume: %q, want the file, the env var, and no sleep", out.stdout)
	}

	// Paused with memory, then rebooted from the disk: the processes go,
	// what the guest wrote stays, also what it had not flushed yet (the
	// memory is restored to sync it before the boot).
	if _, err := c.run(ctx, "", "bash", "-c", "nohup sleep 1000 >/dev/null 2>&1 & echo more > /home/user/g"); err != nil {
		t.Fatal(err)
	}
	if _, err := n.Pause(ctx, s.ID); err != nil {
		t.Fatal(err)
	}
	res, err = n.ResumeWith(ctx, s.ID, ResumeOptions{Reboot: true})
	if err != nil {
		t.Fatal(err)
	}
	out, err = newEnvdClient(res).run(ctx, "", "bash", "-c", "cat /home/user/g; pgrep -x sleep || echo no-sleep")
	if err != nil || out.stdout != "more\nno-sleep\n" {
		t.Fatalf("rebooted from the disk: %+v %v", out, err)
	}
	for _, f := range []string{stateFileName, pauseRecordName, memFileName + ".kept"} {
		if _, err := os.Stat(filepath.Join(sdir, f)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("the dropped memory left %s: %v", f, err)
		}
	}
	// And it pauses and resumes with memory again.
	if _, err := n.Pause(ctx, s.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := n.Resume(ctx, s.ID, time.Minute); err != nil {
		t.Fatal(err)
	}
}

// TestResumeKnowsTheGatewayMAC: a guest whose pause record names the tap
// MAC every tap has resumes with its MAC a permanent neighbour of the
// namespace (no ARP round trip through a cold guest before envd's answer);
// a guest that ran behind a tap with another MAC (every state saved before
// taps had one MAC, and records without the field) is asked, learns the
// new tap's MAC from the request and answers, and its next pause records
// the fixed MAC.
func TestResumeKnowsTheGatewayMAC(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	n := testNode(t, coldPauseOnly)
	s := create(t, n, CreateRequest{TemplateID: "base"})
	inNS := func(args ...string) string { return inNamespace(t, n, s, args...) }
	permanent := func() bool { return guestIsPermanentNeighbour(t, n, s) }
	if !permanent() {
		t.Fatal("a booted guest's tap has no permanent neighbour entry for it")
	}
	// The tap takes another MAC and the namespace forgets the guest's: the
	// next packet to the guest asks it, and it learns the other MAC.
	const other = "02:00:00:00:00:99"
	inNS("ip", "link", "set", network.TapName, "address", other)
	inNS("ip", "neigh", "flush", "dev", network.TapName, "nud", "all")
	if r, err := newEnvdClient(s).run(ctx, "", "true"); err != nil || r.exit != 0 {
		t.Fatalf("a command behind the other MAC: %+v %v", r, err)
	}
	// resume checks the paused sandbox's record and resumes it.
	resume := func(wantRecorded string, wantPermanent bool) {
		t.Helper()
		rec, err := readPauseRecord(n.sandboxDir(s.ID))
		if err != nil || rec.GatewayMAC != wantRecorded {
			t.Fatalf("pause record's gateway MAC %q (%v), want %q", rec.GatewayMAC, err, wantRecorded)
		}
		r, err := n.Resume(ctx, s.ID, time.Hour)
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("resume phases: %v", r.Phases)
		if got := permanent(); got != wantPermanent {
			t.Fatalf("after the resume the guest's MAC is a permanent neighbour: %v, want %v", got, wantPermanent)
		}
		if res, err := newEnvdClient(r).run(ctx, "", "true"); err != nil || res.exit != 0 {
			t.Fatalf("a command after the resume: %+v %v", res, err)
		}
	}
	pause := func() {
		t.Helper()
		if _, err := n.Pause(ctx, s.ID); err != nil {
			t.Fatal(err)
		}
	}
	pause()
	resume(other, false) // asked: it learns TapMAC
	pause()
	resume(network.TapMAC, true) // known
	// A resume that fails once its guest runs pauses it again without the
	// MAC (the guest may not have answered through that tap): asked next.
	pause()
	if _, err := n.Resume(faults.With(ctx, faults.NewInjector("resume/envd-init")), s.ID, time.Hour); !errors.Is(err, faults.ErrInjected) {
		t.Fatalf("resume failing at envd-init: %v", err)
	}
	resume("", false)
}

// inNamespace runs a command in s's network namespace and returns its output.
func inNamespace(t *testing.T, n *Node, s *sandboxes.Sandbox, args ...string) string {
	t.Helper()
	ep, err := n.endpoint(s)
	if err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command("ip", append([]string{"netns", "exec", ep.Namespace}, args...)...).CombinedOutput()
	if err != nil {
		t.Fatal(args, err, string(out))
	}
	return string(out)
}

// guestIsPermanentNeighbour is whether s's namespace has its guest's MAC
// as a permanent neighbour (network.GuestKnows).
func guestIsPermanentNeighbour(t *testing.T, n *Node, s *sandboxes.Sandbox) bool {
	t.Helper()
	return strings.Contains(inNamespace(t, n, s, "ip", "neigh", "show", "dev", network.TapName),
		network.GuestIP.String()+" lladdr "+network.GuestMAC+" PERMANENT")
}
