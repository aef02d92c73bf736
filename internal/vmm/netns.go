package vmm

import (
	"fmt"
	"os/exec"
	"runtime"

	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// startIn starts cmd inside the network namespace at path ("" : the
// caller's), under SCHED_IDLE if idle. The child is forked from a thread
// switched into the namespace (and, if idle, to that policy), so it is
// born there and never has the host's network; the thread switches back
// if it can, otherwise (and always after SCHED_IDLE) it dies with its
// goroutine, still locked. A host that refuses SCHED_IDLE starts QEMU at
// normal priority.
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
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		handBack := true
		defer func() {
			if handBack {
				runtime.UnlockOSThread()
			}
		}()
		if path != "" {
			orig, err := netns.Get()
			if err != nil {
				errc <- err
				return
			}
			defer orig.Close()
			if err := netns.Set(target); err != nil {
				errc <- fmt.Errorf("enter network namespace %s: %w", path, err)
				return
			}
			defer func() {
				if netns.Set(orig) != nil {
					handBack = false
				}
			}()
		}
		if idle && setPolicy(0, unix.SCHED_IDLE) == nil {
			handBack = false
		}
		errc <- cmd.Start()
	}()
	return <-errc
}
