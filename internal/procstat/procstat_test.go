package procstat

import (
	"os"
	"syscall"
	"testing"
	"time"
)

// TestCPUSeconds reads this process's CPU time around a busy
// loop that uses 300 ms of CPU (by getrusage): /proc's figure grows by as
// much, and a process that is not there is an error.
func TestCPUSeconds(t *testing.T) {
	used := func() time.Duration {
		var ru syscall.Rusage
		if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
			t.Fatal(err)
		}
		return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
	}
	before, err := CPUSeconds(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	start := used()
	for used()-start < 300*time.Millisecond {
	}
	after, err := CPUSeconds(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	if d := after - before; d < 0.25 || d > 1 {
		t.Fatalf("CPU time grew by %.2fs over a busy loop of 300 ms of CPU", d)
	}
	if _, err := CPUSeconds(1 << 30); err == nil {
		t.Fatal("a process that is not there has CPU time")
	}
}

// TestReadMemoryAndTree reads this process's memory, and its tree's (it
// and its descendants) at least about as much.
func TestReadMemoryAndTree(t *testing.T) {
	m, err := ReadMemory(os.Getpid())
	if err != nil || m.RSSBytes == 0 || m.PSSBytes == 0 {
		t.Fatalf("%+v %v", m, err)
	}
	if tree := TreePSS(os.Getpid()); tree < m.PSSBytes/2 {
		t.Fatalf("tree PSS %d, the process alone %d", tree, m.PSSBytes)
	}
	if _, err := ReadMemory(1 << 30); err == nil {
		t.Fatal("a process that is not there has memory")
	}
}
