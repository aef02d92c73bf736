// Package admission owns a node's admission of sandbox starts (creates,
// resumes, fork children): at most so many starting at once, and the guest
// memory committed to sandboxes within the host's memory times an
// overcommit factor. A start beyond either limit waits its turn, first come
// first served, for a bounded time; then it is refused with an error that
// names the limit and says when to try again (HTTP 429 with Retry-After),
// having changed nothing.
package admission

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/agentenv/agentenv/internal/errkind"
)

// Limits are what a node admits.
type Limits struct {
	// MaxStarting is how many starts may run at once (0: no limit).
	MaxStarting int
	// MemoryBytes is how much guest memory the running and starting
	// sandboxes may have together (0: no limit): the host's memory times
	// the overcommit factor.
	MemoryBytes int64
	// Wait is how long a start waits for its turn before it is refused.
	Wait time.Duration
}

// Limit names the limit that refused a start.
type Limit string

const (
	// Starting: MaxStarting starts were running.
	Starting Limit = "starting"
	// Memory: the start's guest memory did not fit in MemoryBytes.
	Memory Limit = "memory"
)

// Refusal is the error of a start that was not admitted. It is an
// errkind.ErrCapacity (HTTP 429).
type Refusal struct {
	Limit   Limit
	Message string
	// RetryAfter is when trying again may succeed.
	RetryAfter time.Duration
}

func (r *Refusal) Error() string { return r.Message }

// Unwrap makes a refusal an errkind.ErrCapacity.
func (r *Refusal) Unwrap() error { return errkind.ErrCapacity }

// RetryAfterSeconds is the Retry-After an HTTP answer gives, whole seconds
// of at least 1.
func (r *Refusal) RetryAfterSeconds() int {
	return max(1, int((r.RetryAfter+time.Second-1)/time.Second))
}

// Committed reports the guest memory of the sandboxes that hold it and are
// not starting (a start's memory is counted by its ticket until it ends).
type Committed func(ctx context.Context) (int64, error)

// Controller admits starts within its limits.
type Controller struct {
	limits    Limits
	committed Committed
	// poll is how often a waiting start checks the memory again (memory
	// is also freed by kills and pauses, which hold no ticket).
	poll time.Duration

	mu       sync.Mutex
	starting int
	reserved int64
	queue    []*waiter
	// meanStart is a moving average of how long starts take (for
	// Retry-After).
	meanStart time.Duration
}

type waiter struct {
	starts   int // places it takes (a fork's children start together)
	bytes    int64
	admitted chan struct{} // closed when admitted
	blocked  Limit         // the limit it (or a start ahead of it) last waited for
}

// New makes a controller; committed reports the memory of the sandboxes
// that are not starting.
func New(limits Limits, committed Committed) *Controller {
	if limits.Wait <= 0 {
		limits.Wait = 30 * time.Second
	}
	return &Controller{limits: limits, committed: committed, poll: 200 * time.Millisecond, meanStart: time.Second}
}

// Limits are the controller's limits.
func (c *Controller) Limits() Limits { return c.limits }

// Ticket is an admitted start; Done ends it.
type Ticket struct {
	c      *Controller
	starts int
	bytes  int64
	start  time.Time
	once   sync.Once
}

// Done ends the start (whether it succeeded or not): its place and memory
// go to the next waiting start.
func (t *Ticket) Done() {
	if t == nil {
		return
	}
	t.once.Do(func() {
		c := t.c
		c.mu.Lock()
		defer c.mu.Unlock()
		c.starting -= t.starts
		c.reserved -= t.bytes
		took := time.Since(t.start)
		c.meanStart = (c.meanStart*7 + took) / 8
		c.dispatch(context.Background())
	})
}

// Admit waits until a start of count sandboxes with bytesEach of guest
// memory each fits the limits, at most the controller's Wait, and returns
// its ticket; what names the start in a refusal ("create", "resume", "a
// fork into 4"). A start of more sandboxes than MaxStarting takes all the
// places.
func (c *Controller) Admit(ctx context.Context, what string, count int, bytesEach int64) (*Ticket, error) {
	count = max(count, 1)
	bytes := int64(count) * bytesEach
	starts := count
	if c.limits.MaxStarting > 0 {
		starts = min(count, c.limits.MaxStarting)
	}
	if c.limits.MemoryBytes > 0 && bytes > c.limits.MemoryBytes {
		return nil, &Refusal{Limit: Memory, RetryAfter: time.Hour, Message: fmt.Sprintf(
			"%s needs %d MiB of guest memory, more than this node admits in all (%d MiB: host memory times --overcommit)",
			what, bytes>>20, c.limits.MemoryBytes>>20)}
	}
	w := &waiter{starts: starts, bytes: bytes, admitted: make(chan struct{})}
	c.mu.Lock()
	c.queue = append(c.queue, w)
	if err := c.dispatch(ctx); err != nil {
		c.remove(w)
		c.mu.Unlock()
		return nil, err
	}
	c.mu.Unlock()
	timeout := time.NewTimer(c.limits.Wait)
	defer timeout.Stop()
	poll := time.NewTicker(c.poll)
	defer poll.Stop()
	for {
		select {
		case <-w.admitted:
			return &Ticket{c: c, starts: starts, bytes: bytes, start: time.Now()}, nil
		case <-poll.C:
			c.mu.Lock()
			err := c.dispatch(ctx)
			c.mu.Unlock()
			if err != nil {
				return c.giveUp(w, err)
			}
		case <-timeout.C:
			return c.giveUp(w, nil)
		case <-ctx.Done():
			return c.giveUp(w, ctx.Err())
		}
	}
}

// giveUp takes w out of the queue and returns its refusal (err when the
// wait ended for another reason), or its ticket when it was admitted
// meanwhile.
func (c *Controller) giveUp(w *waiter, err error) (*Ticket, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	select {
	case <-w.admitted:
		if err == nil {
			return &Ticket{c: c, starts: w.starts, bytes: w.bytes, start: time.Now()}, nil
		}
		// Admitted as the caller went: give the place back.
		c.starting -= w.starts
		c.reserved -= w.bytes
		c.dispatch(context.Background())
		return nil, err
	default:
	}
	c.remove(w)
	if err != nil {
		return nil, err
	}
	return nil, c.refusal(w)
}

func (c *Controller) refusal(w *waiter) *Refusal {
	ahead := len(c.queue) + c.starting
	per := max(c.limits.MaxStarting, 1)
	retry := time.Duration(ahead/per+1) * c.meanStart
	retry = min(max(retry, time.Second), time.Minute)
	if w.blocked == Memory {
		return &Refusal{Limit: Memory, RetryAfter: max(retry, 5*time.Second), Message: fmt.Sprintf(
			"the node has no guest memory left for another %d MiB (it admits %d MiB in all: host memory times --overcommit); waited %s",
			w.bytes>>20, c.limits.MemoryBytes>>20, c.limits.Wait)}
	}
	return &Refusal{Limit: Starting, RetryAfter: retry, Message: fmt.Sprintf(
		"the node is starting %d sandboxes, its limit (--max-starting), with %d more waiting; waited %s",
		c.starting, len(c.queue), c.limits.Wait)}
}

// dispatch admits the waiting starts at the head of the queue while they
// fit; c.mu is held. An error is the memory report's.
func (c *Controller) dispatch(ctx context.Context) error {
	var committed int64
	read := false
	for len(c.queue) > 0 {
		w := c.queue[0]
		if c.limits.MaxStarting > 0 && c.starting+w.starts > c.limits.MaxStarting {
			c.blockedBy(Starting)
			return nil
		}
		if c.limits.MemoryBytes > 0 {
			if !read {
				var err error
				if committed, err = c.committed(ctx); err != nil {
					return fmt.Errorf("reading the committed guest memory: %w", err)
				}
				read = true
			}
			if committed+c.reserved+w.bytes > c.limits.MemoryBytes {
				c.blockedBy(Memory)
				return nil
			}
		}
		c.queue = c.queue[1:]
		c.starting += w.starts
		c.reserved += w.bytes
		close(w.admitted)
	}
	return nil
}

// blockedBy records that the head of the queue, and so every start behind
// it, waits for limit; c.mu is held.
func (c *Controller) blockedBy(limit Limit) {
	for _, w := range c.queue {
		w.blocked = limit
	}
}

func (c *Controller) remove(w *waiter) {
	for i, q := range c.queue {
		if q == w {
			c.queue = append(c.queue[:i], c.queue[i+1:]...)
			return
		}
	}
}

// Stats is what the controller is doing now.
type Stats struct {
	Starting, Waiting int
	ReservedBytes     int64
}

// Stats reports the starts running and waiting.
func (c *Controller) Stats() Stats {
	c.mu.Lock()
	defer c.mu.Unlock()
	return Stats{Starting: c.starting, Waiting: len(c.queue), ReservedBytes: c.reserved}
}

// IsRefusal reports whether err is a start the limits refused, and which.
func IsRefusal(err error) (*Refusal, bool) {
	var r *Refusal
	ok := errors.As(err, &r)
	return r, ok
}
