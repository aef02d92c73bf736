package vmm

import (
	"fmt"
	"os/exec"

	"github.com/agentenv/agentenv/internal/nsthread"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// startIn starts cmd inside the network namespace at path ("" : the
// caller's), under SCHED_IDLE if idle. The child is forked from a thread
// switched into the namespace (and, if idle, to that policy), so it is
// born there and never has the host's network; a thread switched to
// SCHED_IDLE is discarded after. A host that refuses SCHED_IDLE starts
// QEMU at normal priority.
func startIn(path string, idle bool, cmd *exec.Cmd) error {
	if path == "" && !idle {
		return cmd.Start()
	}
	target := netns.None()
	if path != "" {
		t, err := netns.GetFromPath(path)
		if err != nil {
			return fmt.Errorf("open network namespace %s: %w", path, err)
		}
		defer t.Close()
		target = t
	}
	if !idle {
		return nsthread.Run(target, cmd.Start)
	}
	return nsthread.RunAndDiscard(target, func() error {
		_ = setPolicy(0, unix.SCHED_IDLE)
		return cmd.Start()
	})
}
