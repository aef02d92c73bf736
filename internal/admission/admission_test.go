package admission

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/agentenv/agentenv/internal/errkind"
)

const mib = 1 << 20

func fixed(n int64) Committed {
	return func(context.Context) (int64, error) { return n, nil }
}

func admitted(t *testing.T, c *Controller, bytes int64) *Ticket {
	t.Helper()
	tk, err := c.Admit(t.Context(), "create", 1, bytes)
	if err != nil {
		t.Fatal(err)
	}
	return tk
}

// Starts beyond MaxStarting wait their turn, first come first served, and
// each Done admits the next.
func TestStartingLimitQueuesInOrder(t *testing.T) {
	c := New(Limits{MaxStarting: 2, Wait: 5 * time.Second}, fixed(0))
	a, b := admitted(t, c, mib), admitted(t, c, mib)
	order := make(chan int, 3)
	var wg sync.WaitGroup
	for i := 1; i <= 3; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			tk, err := c.Admit(context.Background(), "create", 1, mib)
			if err != nil {
				t.Error(err)
				return
			}
			order <- i
			tk.Done()
		}()
		// Queued in this order.
		for c.Stats().Waiting != i {
			time.Sleep(time.Millisecond)
		}
	}
	if s := c.Stats(); s.Starting != 2 || s.Waiting != 3 {
		t.Fatalf("stats %+v", s)
	}
	a.Done()
	a.Done() // a second Done changes nothing
	wg.Wait()
	close(order)
	got := []int{}
	for i := range order {
		got = append(got, i)
	}
	if len(got) != 3 || got[0] != 1 || got[1] != 2 || got[2] != 3 {
		t.Fatalf("admitted in order %v", got)
	}
	b.Done()
	if s := c.Stats(); s != (Stats{}) {
		t.Fatalf("after all Done: %+v", s)
	}
}

// A start that waits longer than Wait is refused with the limit named, a
// Retry-After, as a capacity error; it holds nothing afterwards.
func TestRefusedAfterWait(t *testing.T) {
	c := New(Limits{MaxStarting: 1, Wait: 50 * time.Millisecond}, fixed(0))
	a := admitted(t, c, mib)
	start := time.Now()
	_, err := c.Admit(t.Context(), "create", 1, mib)
	r, ok := IsRefusal(err)
	if !ok || r.Limit != Starting || !errors.Is(err, errkind.ErrCapacity) || r.RetryAfterSeconds() < 1 {
		t.Fatalf("err %v (%+v)", err, r)
	}
	if waited := time.Since(start); waited < 50*time.Millisecond || waited > 2*time.Second {
		t.Fatalf("waited %s", waited)
	}
	if s := c.Stats(); s.Starting != 1 || s.Waiting != 0 {
		t.Fatalf("stats %+v", s)
	}
	a.Done()
	admitted(t, c, mib).Done()
}

// Memory: the committed memory of the running sandboxes plus the starts'
// must fit; memory freed without a ticket (a kill) is seen by the waiting
// start's next check.
func TestMemoryLimit(t *testing.T) {
	var committed atomic.Int64
	committed.Store(700 * mib)
	c := New(Limits{MemoryBytes: 1024 * mib, Wait: 5 * time.Second}, func(context.Context) (int64, error) { return committed.Load(), nil })
	c.poll = 10 * time.Millisecond
	a := admitted(t, c, 200*mib) // 900 of 1024
	done := make(chan error, 1)
	go func() {
		tk, err := c.Admit(context.Background(), "create", 1, 200*mib)
		tk.Done()
		done <- err
	}()
	select {
	case err := <-done:
		t.Fatalf("admitted beyond the memory: %v", err)
	case <-time.After(100 * time.Millisecond):
	}
	committed.Store(100 * mib) // a sandbox was killed
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	a.Done()

	// Refused after the wait, naming memory.
	committed.Store(1000 * mib)
	c.limits.Wait = 30 * time.Millisecond
	_, err := c.Admit(t.Context(), "create", 1, 100*mib)
	if r, ok := IsRefusal(err); !ok || r.Limit != Memory {
		t.Fatalf("err %v", err)
	}
	// A start queued behind one that waits for memory is refused naming
	// memory too.
	committed.Store(1000 * mib)
	c.limits.Wait = 50 * time.Millisecond
	errs := make(chan error, 2)
	for range 2 {
		go func() { _, err := c.Admit(t.Context(), "create", 1, 100*mib); errs <- err }()
	}
	for range 2 {
		if r, ok := IsRefusal(<-errs); !ok || r.Limit != Memory {
			t.Fatalf("queued behind memory: %+v", r)
		}
	}
	// More than the node admits in all: refused at once.
	start := time.Now()
	_, err = c.Admit(t.Context(), "create", 1, 2048*mib)
	if r, ok := IsRefusal(err); !ok || r.Limit != Memory || time.Since(start) > 20*time.Millisecond {
		t.Fatalf("err %v after %s", err, time.Since(start))
	}
}

// A caller that goes away while it waits leaves the queue.
func TestCallerGoneWhileWaiting(t *testing.T) {
	c := New(Limits{MaxStarting: 1, Wait: 5 * time.Second}, fixed(0))
	a := admitted(t, c, mib)
	ctx, cancel := context.WithCancel(t.Context())
	go func() {
		for c.Stats().Waiting == 0 {
			time.Sleep(time.Millisecond)
		}
		cancel()
	}()
	if _, err := c.Admit(ctx, "create", 1, mib); !errors.Is(err, context.Canceled) {
		t.Fatalf("err %v", err)
	}
	if s := c.Stats(); s.Waiting != 0 || s.Starting != 1 {
		t.Fatalf("stats %+v", s)
	}
	a.Done()
	if s := c.Stats(); s != (Stats{}) {
		t.Fatalf("stats %+v", s)
	}
}

// The memory report failing refuses the start with that error, not a
// refusal, and holds nothing.
func TestCommittedFails(t *testing.T) {
	c := New(Limits{MemoryBytes: 1 << 30}, func(context.Context) (int64, error) { return 0, errors.New("disk on fire") })
	if _, err := c.Admit(t.Context(), "create", 1, mib); err == nil || errors.Is(err, errkind.ErrCapacity) {
		t.Fatalf("err %v", err)
	}
	if s := c.Stats(); s != (Stats{}) {
		t.Fatalf("stats %+v", s)
	}
}

// A storm: never more than MaxStarting at once, every start admitted or
// refused, nothing held at the end.
func TestStorm(t *testing.T) {
	c := New(Limits{MaxStarting: 3, MemoryBytes: 64 * mib, Wait: 30 * time.Millisecond}, fixed(0))
	var now, peak, ok, refused atomic.Int64
	var wg sync.WaitGroup
	for range 200 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			tk, err := c.Admit(context.Background(), "create", 1, 8*mib)
			if err != nil {
				if _, isRefusal := IsRefusal(err); !isRefusal {
					t.Error(err)
				}
				refused.Add(1)
				return
			}
			n := now.Add(1)
			for p := peak.Load(); n > p && !peak.CompareAndSwap(p, n); p = peak.Load() {
			}
			time.Sleep(2 * time.Millisecond)
			now.Add(-1)
			ok.Add(1)
			tk.Done()
		}()
	}
	wg.Wait()
	if peak.Load() > 3 || ok.Load() == 0 || ok.Load()+refused.Load() != 200 {
		t.Fatalf("peak %d, admitted %d, refused %d", peak.Load(), ok.Load(), refused.Load())
	}
	if s := c.Stats(); s != (Stats{}) {
		t.Fatalf("stats %+v", s)
	}
	t.Logf("admitted %d, refused %d", ok.Load(), refused.Load())
}

// A fork takes a place per child up to MaxStarting, and its children's
// memory together.
func TestForkTakesPlaces(t *testing.T) {
	c := New(Limits{MaxStarting: 4, MemoryBytes: 1024 * mib, Wait: 30 * time.Millisecond}, fixed(0))
	one := admitted(t, c, mib)
	if _, err := c.Admit(t.Context(), "a fork into 4", 4, 10*mib); err == nil {
		t.Fatal("a fork into 4 admitted beside a start with 4 places")
	}
	one.Done()
	fork, err := c.Admit(t.Context(), "a fork into 16", 16, 10*mib)
	if err != nil {
		t.Fatal(err)
	}
	if s := c.Stats(); s.Starting != 4 || s.ReservedBytes != 160*mib {
		t.Fatalf("stats %+v", s)
	}
	fork.Done()
	if _, err := c.Admit(t.Context(), "a fork into 16", 16, 100*mib); err == nil {
		t.Fatal("1600 MiB admitted in 1024")
	}
}
