package warmpool

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"
)

type fakeEntry struct {
	id          string
	vcpus, mem  int
	exit        chan struct{}
	dieOnce     sync.Once
	discardOnce sync.Once
}

func (e *fakeEntry) ID() string               { return e.id }
func (e *fakeEntry) Fits(vcpus, mem int) bool { return e.vcpus == vcpus && e.mem == mem }
func (e *fakeEntry) Exited() <-chan struct{}  { return e.exit }
func (e *fakeEntry) die()                     { e.dieOnce.Do(func() { close(e.exit) }) }
func (e *fakeEntry) String() string           { return e.id }
func newEntry(id string, vcpus, mem int) *fakeEntry {
	return &fakeEntry{id: id, vcpus: vcpus, mem: mem, exit: make(chan struct{})}
}

// starter makes entries of 1 vCPU and 512 MiB for the current key, and
// records every start and discard.
type starter struct {
	mu        sync.Mutex
	current   Key
	fail      error
	block     chan struct{} // when set, Start waits for it
	started   []string
	discarded []string
	n         int
}

func (s *starter) Start(ctx context.Context, key Key) (*fakeEntry, error) {
	s.mu.Lock()
	block, cur, fail := s.block, s.current, s.fail
	s.mu.Unlock()
	if block != nil {
		select {
		case <-block:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	if key != cur {
		return nil, ErrStale
	}
	if fail != nil {
		return nil, fail
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.n++
	e := newEntry(fmt.Sprintf("%s-%d", key.Snapshot, s.n), 1, 512)
	s.started = append(s.started, e.id)
	return e, nil
}

func (s *starter) Discard(_ context.Context, e *fakeEntry) {
	e.discardOnce.Do(func() {
		s.mu.Lock()
		s.discarded = append(s.discarded, e.id)
		s.mu.Unlock()
	})
}

func (s *starter) counts() (started, discarded int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.started), len(s.discarded)
}

var k1, k2 = Key{"base", "snap-1"}, Key{"base", "snap-2"}

func eventually(t *testing.T, what string, ok func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !ok() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting until %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func TestFillAndTake(t *testing.T) {
	s := &starter{current: k1}
	p := New[*fakeEntry](3, s, nil)
	defer p.Close(context.Background())
	p.Fill(t.Context(), k1)
	if p.Len(k1) != 3 {
		t.Fatalf("%d entries after Fill, want 3", p.Len(k1))
	}
	for _, tc := range []struct {
		name      string
		key       Key
		vcpus     int
		mem       int
		want      bool
		remaining int
	}{
		{"wrong size", k1, 2, 512, false, 3},
		{"other key", k2, 1, 512, false, 3},
		{"fits", k1, 1, 512, true, 2},
	} {
		e, ok := p.Take(tc.key, tc.vcpus, tc.mem)
		if ok != tc.want || (ok && e == nil) {
			t.Errorf("%s: Take = %v, %v", tc.name, e, ok)
		}
		if got := p.Len(k1); got != tc.remaining {
			t.Errorf("%s: %d entries left, want %d", tc.name, got, tc.remaining)
		}
	}
	// A dead entry is never handed out.
	for _, e := range p.Entries(k1) {
		e.die()
	}
	if e, ok := p.Take(k1, 1, 512); ok {
		t.Fatalf("Take handed out dead entry %v", e)
	}
}

func TestFillStopsOnStaleKeyAndErrors(t *testing.T) {
	s := &starter{current: k2}
	p := New[*fakeEntry](2, s, nil)
	defer p.Close(context.Background())
	p.Fill(t.Context(), k1)
	if started, _ := s.counts(); started != 0 || p.Len(k1) != 0 {
		t.Fatalf("a stale key was filled: %d started", started)
	}
	s.fail = errors.New("no room")
	s.current = k1
	p.Fill(t.Context(), k1)
	if p.Len(k1) != 0 {
		t.Fatal("failed starts left entries")
	}
}

// An entry whose machine dies leaves the pool, is discarded, and is
// replaced; an id the pool does not hold (claimed meanwhile) is left alone.
func TestLostEntryIsReplaced(t *testing.T) {
	s := &starter{current: k1}
	p := New[*fakeEntry](2, s, nil)
	defer p.Close(context.Background())
	p.Fill(t.Context(), k1)
	victim := p.Entries(k1)[0]
	if p.Lost(victim.id) {
		t.Fatal("Lost took an entry whose machine still runs")
	}
	victim.die()
	if !p.Lost(victim.id) {
		t.Fatal("Lost did not find the dead entry")
	}
	eventually(t, "the pool is refilled", func() bool { return p.Len(k1) == 2 })
	if slices.ContainsFunc(p.Entries(k1), func(e *fakeEntry) bool { return e == victim }) {
		t.Fatal("the dead entry is still in the pool")
	}
	if _, discarded := s.counts(); discarded != 1 {
		t.Fatalf("%d discarded, want the dead one", discarded)
	}
	if p.Lost("claimed-meanwhile") {
		t.Fatal("Lost reported an id the pool does not hold")
	}
}

// A rebuild moves the template to a new snapshot: the old entries go, the
// new ones stay.
func TestDrainStale(t *testing.T) {
	s := &starter{current: k1}
	p := New[*fakeEntry](2, s, nil)
	defer p.Close(context.Background())
	p.Fill(t.Context(), k1)
	s.mu.Lock()
	s.current = k2
	s.mu.Unlock()
	p.Fill(t.Context(), k2)
	p.DrainStale(t.Context(), func(k Key) bool { return k == k2 })
	if p.Len(k1) != 0 || p.Len(k2) != 2 {
		t.Fatalf("after drain: %d old, %d new entries", p.Len(k1), p.Len(k2))
	}
	if _, discarded := s.counts(); discarded != 2 {
		t.Fatalf("%d discarded, want the 2 old ones", discarded)
	}
}

// Close discards every entry, including one a filler was still starting,
// and refuses further fills: nothing the pool started outlives it.
func TestCloseDiscardsEverything(t *testing.T) {
	s := &starter{current: k1}
	p := New[*fakeEntry](3, s, nil)
	p.Fill(t.Context(), k1)
	e, _ := p.Take(k1, 1, 512) // a create's; not the pool's any more
	s.mu.Lock()
	s.block = make(chan struct{})
	s.mu.Unlock()
	p.Refill(k1) // blocks in Start until Close cancels it
	done := make(chan struct{})
	go func() { p.Close(context.Background()); close(done) }()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("Close did not stop the filler")
	}
	started, discarded := s.counts()
	if discarded != started-1 {
		t.Fatalf("started %d, discarded %d: only the taken entry may survive", started, discarded)
	}
	if slices.Contains(s.discarded, e.id) {
		t.Fatal("Close discarded an entry a create had taken")
	}
	p.Fill(t.Context(), k1)
	p.Refill(k1)
	if p.Len(k1) != 0 {
		t.Fatal("a closed pool was filled")
	}
}

// Takes, losses and refills racing each other (run with -race): every
// entry the starter made is, in the end, taken or discarded exactly once.
func TestConcurrentUse(t *testing.T) {
	s := &starter{current: k1}
	p := New[*fakeEntry](4, s, nil)
	var wg sync.WaitGroup
	var taken sync.Map
	for w := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 50 {
				switch (w + i) % 3 {
				case 0:
					if e, ok := p.Take(k1, 1, 512); ok {
						if _, dup := taken.LoadOrStore(e.id, true); dup {
							t.Errorf("entry %s handed out twice", e.id)
						}
					}
				case 1:
					if l := p.Entries(k1); len(l) > 0 {
						l[0].die()
						p.Lost(l[0].id)
					}
				case 2:
					p.Refill(k1)
				}
			}
		}()
	}
	wg.Wait()
	p.Close(context.Background())
	if p.Len(k1) != 0 {
		t.Fatal("entries left after Close")
	}
	n := 0
	taken.Range(func(id, _ any) bool {
		n++
		if slices.Contains(s.discarded, id.(string)) {
			t.Errorf("entry %s was taken and discarded", id)
		}
		return true
	})
	if started, discarded := s.counts(); started != n+discarded {
		t.Fatalf("started %d entries, %d taken + %d discarded", started, n, discarded)
	}
}
