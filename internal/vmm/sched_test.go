package vmm

import (
	"os/exec"
	"testing"

	"golang.org/x/sys/unix"
)

func policyOf(t *testing.T, tid int) uint32 {
	t.Helper()
	a, err := unix.SchedGetAttr(tid, 0)
	if err != nil {
		t.Fatalf("policy of %d: %v", tid, err)
	}
	return a.Policy
}

// TestIdleStartAndPrioritize starts a process idle: it runs under
// SCHED_IDLE from its first instruction, the thread it was forked from
// never serves another start (the processes started after it at normal
// priority are normal), and Prioritize gives it the normal policy back.
func TestIdleStartAndPrioritize(t *testing.T) {
	start := func(idle bool) *exec.Cmd {
		t.Helper()
		cmd := exec.Command("sleep", "30")
		if err := startIn("", idle, cmd); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
		return cmd
	}
	idle := start(true)
	if p := policyOf(t, idle.Process.Pid); p != unix.SCHED_IDLE {
		t.Fatalf("started idle, policy %d", p)
	}
	for i := range 20 {
		if p := policyOf(t, start(false).Process.Pid); p != unix.SCHED_NORMAL {
			t.Fatalf("start %d after an idle one: policy %d", i, p)
		}
	}
	m := &Machine{pid: idle.Process.Pid}
	if err := m.Prioritize(); err != nil {
		t.Fatal(err)
	}
	tids, err := m.Threads()
	if err != nil || len(tids) == 0 {
		t.Fatalf("threads: %v %v", tids, err)
	}
	for _, tid := range tids {
		if p := policyOf(t, tid); p != unix.SCHED_NORMAL {
			t.Fatalf("thread %d after Prioritize: policy %d", tid, p)
		}
	}
}
