// Package operation runs the node's state-changing operations (create,
// pause, resume, snapshot, fork, kill, builds, imports) as named steps with
// a cleanup stack. An operation runs on a context detached from its
// caller's (a client that hangs up does not stop it half way) under its own
// timeout. When a step fails, the cleanups registered so far run in reverse
// order, on a fresh context, and the operation reports the step's error:
// the caller's resources are back where they rested. Every step is a fault
// injection point ("<operation>/<step>", see package faults).
package operation

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"time"

	"github.com/agentenv/agentenv/internal/faults"
)

// CleanupTimeout bounds the cleanups of a failed operation.
const CleanupTimeout = 2 * time.Minute

// Op is one running operation. Its steps may run concurrently (a fork
// restores its children in parallel).
type Op struct {
	name   string
	ctx    context.Context
	cancel context.CancelFunc
	log    *slog.Logger
	start  time.Time

	mu       sync.Mutex
	cleanups []cleanup // guarded by mu
	steps    []Step    // guarded by mu
}

// Step is one timed step of an operation.
type Step struct {
	Name     string
	Duration time.Duration
}

type cleanup struct {
	what string
	fn   func(context.Context) error
}

// Start begins operation name on a context that keeps parent's values (an
// injector of faults among them) but not its cancellation, bounded by
// timeout.
func Start(parent context.Context, name string, timeout time.Duration, log *slog.Logger) *Op {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(parent), timeout)
	if log == nil {
		log = slog.Default()
	}
	return &Op{name: name, ctx: ctx, cancel: cancel, log: log, start: time.Now()}
}

// Context is the operation's context.
func (o *Op) Context() context.Context { return o.ctx }

// Name is the operation's name.
func (o *Op) Name() string { return o.name }

// Do runs step name: a fault point first, then fn; the step is timed.
func (o *Op) Do(name string, fn func(ctx context.Context) error) error {
	start := time.Now()
	err := faults.Check(o.ctx, o.name+"/"+name)
	if err == nil {
		err = fn(o.ctx)
	}
	o.mu.Lock()
	o.steps = append(o.steps, Step{name, time.Since(start)})
	o.mu.Unlock()
	if err != nil {
		return fmt.Errorf("%s: %w", name, err)
	}
	return nil
}

// Check is a fault point between steps, for code that runs its own steps.
func (o *Op) Check(name string) error {
	if err := faults.Check(o.ctx, o.name+"/"+name); err != nil {
		return fmt.Errorf("%s: %w", name, err)
	}
	return nil
}

// OnFailure pushes a cleanup that runs if the operation fails (last pushed,
// first run).
func (o *Op) OnFailure(what string, fn func(ctx context.Context) error) {
	o.mu.Lock()
	o.cleanups = append(o.cleanups, cleanup{what, fn})
	o.mu.Unlock()
}

// Steps times each step that ran so far, in the order they ended.
func (o *Op) Steps() []Step {
	o.mu.Lock()
	defer o.mu.Unlock()
	return append([]Step(nil), o.steps...)
}

// Settle drops the cleanups registered so far: the operation passed a
// point after which what they would undo is the new resting state (e.g. a
// sandbox's state is saved and its old machine gone).
func (o *Op) Settle() {
	o.mu.Lock()
	o.cleanups = nil
	o.mu.Unlock()
}

// Finish ends the operation: with err nil the cleanups are dropped; with
// an error they run, newest first, each on a fresh context (the
// operation's own may have timed out), and their failures are logged. It
// returns err.
func (o *Op) Finish(err error) error {
	defer o.cancel()
	o.mu.Lock()
	cleanups := o.cleanups
	o.cleanups = nil
	steps := o.steps
	o.mu.Unlock()
	// The steps passed, each a fault point (the crash tests arm a kill at
	// each of them in turn); listed only when debug logging is on.
	if o.log.Enabled(o.ctx, slog.LevelDebug) {
		names := make([]string, len(steps))
		for i, s := range steps {
			names[i] = s.Name
		}
		o.log.Debug("operation steps", "op", o.name, "steps", strings.Join(names, ","), "failed", err != nil)
	}
	if err == nil {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(o.ctx), CleanupTimeout)
	defer cancel()
	for i := len(cleanups) - 1; i >= 0; i-- {
		c := cleanups[i]
		if cerr := c.fn(ctx); cerr != nil {
			o.log.Error("cleanup after a failed operation", "op", o.name, "cleanup", c.what, "err", cerr, "cause", err)
		}
	}
	if errors.Is(o.ctx.Err(), context.DeadlineExceeded) && !errors.Is(err, context.DeadlineExceeded) {
		err = fmt.Errorf("%w (the operation's time ran out)", err)
	}
	return err
}

// Elapsed is the time since the operation started.
func (o *Op) Elapsed() time.Duration { return time.Since(o.start) }
