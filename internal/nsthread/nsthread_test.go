package nsthread

import (
	"errors"
	"os"
	"testing"

	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// TestRunSwitchesAndHandsBack runs code in a namespace of its own: it
// sees that namespace, its error comes back, and no thread of the runtime
// is left in it (the goroutines after it all see the caller's namespace).
// With no namespace it runs where the caller is.
func TestRunSwitchesAndHandsBack(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (a network namespace)")
	}
	host, err := netns.Get()
	if err != nil {
		t.Fatal(err)
	}
	defer host.Close()
	ns, err := netns.New() // switches this thread: switch it back at once
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()
	if err := netns.Set(host); err != nil {
		t.Fatal(err)
	}
	here := func() netns.NsHandle {
		t.Helper()
		h, err := netns.Get()
		if err != nil {
			t.Fatal(err)
		}
		return h
	}
	want := errors.New("from fn")
	err = Run(ns, func() error {
		h := here()
		defer h.Close()
		if !h.Equal(ns) {
			t.Error("fn did not run in the namespace")
		}
		return want
	})
	if err != want {
		t.Fatalf("Run returned %v", err)
	}
	if err := Run(netns.None(), func() error {
		h := here()
		defer h.Close()
		if !h.Equal(host) {
			t.Error("with no namespace, fn did not run in the caller's")
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	for range 50 {
		done := make(chan bool)
		go func() {
			h, err := netns.Get()
			done <- err == nil && h.Equal(host)
			h.Close()
		}()
		if !<-done {
			t.Fatal("a goroutine after Run runs in its namespace")
		}
	}
}

// TestRunAndDiscardNeverHandsBack changes the thread's scheduling policy
// inside RunAndDiscard: no goroutine after it runs with that policy.
func TestRunAndDiscardNeverHandsBack(t *testing.T) {
	idle := &unix.SchedAttr{Size: unix.SizeofSchedAttr, Policy: unix.SCHED_IDLE}
	for range 5 {
		if err := RunAndDiscard(netns.None(), func() error { return unix.SchedSetAttr(0, idle, 0) }); err != nil {
			t.Fatal(err)
		}
	}
	for range 50 {
		done := make(chan uint32)
		go func() {
			a, err := unix.SchedGetAttr(0, 0)
			if err != nil {
				done <- 99
				return
			}
			done <- a.Policy
		}()
		if p := <-done; p != unix.SCHED_NORMAL {
			t.Fatalf("a goroutine after RunAndDiscard runs with policy %d", p)
		}
	}
}
