// Package nsthread runs code on an OS thread of its own switched into a
// network namespace: what the code opens or forks there (sockets, links,
// child processes) belongs to that namespace, and no other goroutine ever
// runs on the thread while it is switched.
package nsthread

import (
	"fmt"
	"runtime"

	"github.com/vishvananda/netns"
)

// Run runs fn on a locked thread switched into ns (a closed handle: the
// caller's namespace, no switch). The thread goes back to the Go runtime
// once it is switched back; if it cannot be, it exits with its goroutine.
func Run(ns netns.NsHandle, fn func() error) error { return run(ns, true, fn) }

// RunAndDiscard is Run for an fn that changes the thread in other ways
// (its scheduling policy, say): the thread never serves anything else and
// exits with its goroutine.
func RunAndDiscard(ns netns.NsHandle, fn func() error) error { return run(ns, false, fn) }

func run(ns netns.NsHandle, handBack bool, fn func() error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		defer func() {
			if handBack {
				runtime.UnlockOSThread()
			}
		}()
		if ns.IsOpen() {
			orig, err := netns.Get()
			if err != nil {
				errc <- err
				return
			}
			defer orig.Close()
			if err := netns.Set(ns); err != nil {
				errc <- fmt.Errorf("enter network namespace: %w", err)
				return
			}
			defer func() {
				if netns.Set(orig) != nil {
					handBack = false
				}
			}()
		}
		errc <- fn()
	}()
	return <-errc
}
