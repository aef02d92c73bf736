package vmm

import (
	"fmt"
	"os/exec"
	"runtime"

	"github.com/vishvananda/netns"
)

// startIn starts cmd inside the network namespace at path ("" : the
// caller's). The child is forked from a thread switched into the
// namespace, so it is born there and never has the host's network; the
// thread switches back (or, if it cannot, dies with its goroutine).
func startIn(path string, cmd *exec.Cmd) error {
	if path == "" {
		return cmd.Start()
	}
	target, err := netns.GetFromPath(path)
	if err != nil {
		return fmt.Errorf("open network namespace %s: %w", path, err)
	}
	defer target.Close()
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		orig, err := netns.Get()
		if err != nil {
			errc <- err
			runtime.UnlockOSThread()
			return
		}
		defer orig.Close()
		if err := netns.Set(target); err != nil {
			errc <- fmt.Errorf("enter network namespace %s: %w", path, err)
			runtime.UnlockOSThread()
			return
		}
		errc <- cmd.Start()
		if netns.Set(orig) == nil {
			runtime.UnlockOSThread()
		} // otherwise the thread exits with the goroutine, still locked
	}()
	return <-errc
}
