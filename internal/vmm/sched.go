package vmm

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"time"

	"golang.org/x/sys/unix"
)

// A machine started ahead of need (Config.Idle) runs under SCHED_IDLE:
// its QEMU is forked from a thread that has that policy, so the process
// and every thread it makes before Prioritize inherit it, and the kernel
// gives them only CPU that nothing of normal priority wants. Filling a
// pool then does not compete with the sandboxes that just took machines
// from it (their guests' first commands, under TCG all CPU).

// qmpWait is how long Start waits for QEMU's QMP socket: an idle QEMU
// initialises only on CPU nothing else wants, which on a busy node can
// take a while, and nobody waits for it.
func qmpWait(idle bool) time.Duration {
	if idle {
		return 2 * time.Minute
	}
	return 10 * time.Second
}

// setPolicy sets the scheduling policy of thread tid (0: the caller's) at
// nice 0.
func setPolicy(tid int, policy uint32) error {
	return unix.SchedSetAttr(tid, &unix.SchedAttr{Size: unix.SizeofSchedAttr, Policy: policy}, 0)
}

// Threads lists the thread ids of the machine's QEMU.
func (m *Machine) Threads() ([]int, error) {
	ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", m.pid))
	if err != nil {
		return nil, err
	}
	tids := make([]int, 0, len(ents))
	for _, e := range ents {
		if tid, err := strconv.Atoi(e.Name()); err == nil {
			tids = append(tids, tid)
		}
	}
	return tids, nil
}

// prioritizePasses bounds Prioritize's walks over the threads: each walk
// catches the threads made, by threads it had not reached yet, during the
// one before.
const prioritizePasses = 8

// Prioritize gives every thread of the machine the normal policy back
// (nice 0), for a machine started Idle that is now someone's. A thread
// that exits meanwhile is skipped; the walk repeats until it finds no
// thread it has not set.
func (m *Machine) Prioritize() error {
	set := map[int]bool{}
	for range prioritizePasses {
		tids, err := m.Threads()
		if err != nil {
			return fmt.Errorf("list qemu threads: %w", err)
		}
		fresh := false
		for _, tid := range tids {
			if set[tid] {
				continue
			}
			if err := setPolicy(tid, unix.SCHED_NORMAL); err != nil && !errors.Is(err, unix.ESRCH) {
				return fmt.Errorf("give qemu thread %d the normal policy: %w", tid, err)
			}
			set[tid], fresh = true, true
		}
		if !fresh {
			return nil
		}
	}
	return nil
}
