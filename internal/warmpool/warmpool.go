// Package warmpool owns a node's warm pool: per key (a template and its
// current snapshot), a few entries prepared up to the last step before use,
// handed out to creates, topped up in the background, replaced when one
// dies, and dropped once their key is no longer current (the template was
// rebuilt or deleted). How an entry is made and torn down is its Starter's
// business; the pool only keeps the books, under its own lock.
package warmpool

import (
	"context"
	"errors"
	"log/slog"
	"sync"
)

// Key names what a pool entry was prepared from.
type Key struct {
	Template string // the template's name
	Snapshot string // the template snapshot the entry was restored from
}

// Entry is one prepared sandbox waiting in the pool.
type Entry interface {
	// ID names the entry (its sandbox id).
	ID() string
	// Fits reports whether the entry has the given size.
	Fits(vcpus, memMiB int) bool
	// Exited is closed when the entry's machine is gone.
	Exited() <-chan struct{}
}

// ErrStale is what a Starter answers for a key that is no longer current.
var ErrStale = errors.New("warm pool: the template snapshot is no longer current")

// Starter makes and discards the entries of a pool.
type Starter[E Entry] interface {
	// Start prepares one entry of key, or fails with ErrStale when key
	// is no longer current.
	Start(ctx context.Context, key Key) (E, error)
	// Discard tears down an entry that has left the pool.
	Discard(ctx context.Context, e E)
}

// Pool keeps up to Size entries per key.
type Pool[E Entry] struct {
	starter Starter[E]
	log     *slog.Logger

	mu      sync.Mutex
	size    int         // guarded by mu
	entries map[Key][]E // guarded by mu
	closed  bool        // guarded by mu

	filling sync.Mutex // one filler at a time
	stop    chan struct{}
	wg      sync.WaitGroup // background fillers
}

// New returns a pool of size entries per key (0: a pool that stays empty).
func New[E Entry](size int, s Starter[E], log *slog.Logger) *Pool[E] {
	if log == nil {
		log = slog.Default()
	}
	return &Pool[E]{size: size, starter: s, log: log, entries: map[Key][]E{}, stop: make(chan struct{})}
}

// SetSize changes how many entries per key the pool keeps from now on
// (entries beyond it wait to be taken).
func (p *Pool[E]) SetSize(size int) {
	p.mu.Lock()
	p.size = size
	p.mu.Unlock()
}

// Size is how many entries the pool keeps per key.
func (p *Pool[E]) Size() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.size
}

// Take hands out a live entry of key that fits, if one waits.
func (p *Pool[E]) Take(key Key, vcpus, memMiB int) (E, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	list := p.entries[key]
	for i, e := range list {
		if !e.Fits(vcpus, memMiB) || exited(e) {
			continue // a dead one is Lost's to remove
		}
		p.entries[key] = append(list[:i:i], list[i+1:]...)
		return e, true
	}
	var none E
	return none, false
}

func exited(e Entry) bool {
	select {
	case <-e.Exited():
		return true
	default:
		return false
	}
}

// Len is how many entries of key wait.
func (p *Pool[E]) Len(key Key) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.entries[key])
}

// Entries returns the entries of key that wait (a copy).
func (p *Pool[E]) Entries(key Key) []E {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]E(nil), p.entries[key]...)
}

// Fill starts entries of key until Size wait, the key goes stale, a start
// fails, ctx ends or the pool closes. Fillers run one at a time.
func (p *Pool[E]) Fill(ctx context.Context, key Key) {
	p.filling.Lock()
	defer p.filling.Unlock()
	for p.wants(key) && ctx.Err() == nil {
		e, err := p.starter.Start(ctx, key)
		if errors.Is(err, ErrStale) {
			return
		}
		if err != nil {
			p.log.Error("pre-start pooled sandbox", "template", key.Template, "err", err)
			return
		}
		if !p.add(key, e) {
			p.starter.Discard(context.WithoutCancel(ctx), e)
			return
		}
	}
}

// add puts e in the pool unless it has closed.
func (p *Pool[E]) add(key Key, e E) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return false
	}
	p.entries[key] = append(p.entries[key], e)
	return true
}

// wants reports whether the pool, open, holds fewer than size entries of
// key.
func (p *Pool[E]) wants(key Key) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return !p.closed && len(p.entries[key]) < p.size
}

// Refill tops the entries of key up in the background.
func (p *Pool[E]) Refill(key Key) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed || p.size == 0 {
		return
	}
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		go func() {
			select {
			case <-p.stop:
				cancel()
			case <-ctx.Done():
			}
		}()
		p.Fill(ctx, key)
	}()
}

// Lost takes the entry named id, whose machine has exited, out of the
// pool, discards it and starts a replacement. It reports whether the entry
// was in the pool (a claimed one is not the pool's any more).
func (p *Pool[E]) Lost(id string) bool {
	p.mu.Lock()
	var (
		lost  E
		key   Key
		found bool
	)
	for k, list := range p.entries {
		for i, e := range list {
			if e.ID() == id && exited(e) {
				lost, key, found = e, k, true
				p.entries[k] = append(list[:i:i], list[i+1:]...)
				break
			}
		}
	}
	p.mu.Unlock()
	if !found {
		return false
	}
	p.log.Warn("a pooled sandbox's machine exited; replacing it", "sandbox", id, "template", key.Template)
	p.starter.Discard(context.Background(), lost)
	p.Refill(key)
	return true
}

// DrainStale discards the entries whose key current rejects.
func (p *Pool[E]) DrainStale(ctx context.Context, current func(Key) bool) {
	for _, e := range p.takeAll(func(k Key) bool { return !current(k) }) {
		p.log.Info("pooled sandbox of an old template snapshot removed", "sandbox", e.ID())
		p.starter.Discard(ctx, e)
	}
}

// takeAll removes from the pool the entries of the keys drop selects.
func (p *Pool[E]) takeAll(drop func(Key) bool) []E {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []E
	for k, list := range p.entries {
		if drop(k) {
			out = append(out, list...)
			delete(p.entries, k)
		}
	}
	return out
}

// Close stops the background fillers, waits for them and discards every
// entry; entries started afterwards are discarded at once.
func (p *Pool[E]) Close(ctx context.Context) {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return
	}
	p.closed = true
	close(p.stop)
	p.mu.Unlock()
	p.wg.Wait()
	for _, e := range p.takeAll(func(Key) bool { return true }) {
		p.starter.Discard(ctx, e)
	}
}
