// Package faults holds the fault injection points of the failure tests.
//
// A point is a name in the code ("pause/save-state"). Two kinds of fault
// can be armed at it:
//
//   - kill: the process kills itself there with SIGKILL, exactly as
//     `kill -9` would, so crash tests can check what a restart recovers
//     (AENV_FAULT=NAME, or AENV_FAULT=kill:NAME);
//   - error: the step at that point fails with an injected error, so
//     failure tests can check that the operation rolls back to a resting
//     state (AENV_FAULT=error:NAME for a whole process, or an Injector
//     carried by an operation's context for one operation in a test).
//
// Unarmed (always, outside those tests) a point costs a string comparison
// and a context lookup.
package faults

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"syscall"
)

// ErrInjected marks every injected error.
var ErrInjected = errors.New("injected fault")

var armedKill, armedError = parseEnv(os.Getenv("AENV_FAULT"))

func parseEnv(v string) (kill, fail string) {
	switch {
	case v == "":
		return "", ""
	case strings.HasPrefix(v, "error:"):
		return "", strings.TrimPrefix(v, "error:")
	default:
		return strings.TrimPrefix(v, "kill:"), ""
	}
}

// Point crashes the process if AENV_FAULT names this point for a kill.
func Point(name string) {
	if armedKill != "" && armedKill == name {
		syscall.Kill(os.Getpid(), syscall.SIGKILL)
		select {} // the signal is on its way
	}
}

// Check is called at a point where a step may fail: it crashes the process
// when a kill is armed there, and returns an injected error when an error
// is armed there (process-wide, or by the Injector in ctx).
func Check(ctx context.Context, name string) error {
	Point(name)
	if armedError != "" && armedError == name {
		return fmt.Errorf("%w at %s", ErrInjected, name)
	}
	if inj, ok := ctx.Value(injectorKey{}).(*Injector); ok {
		return inj.check(name)
	}
	return nil
}

// Injector arms error faults for the operations whose context carries it,
// and records the points they passed.
type Injector struct {
	mu   sync.Mutex
	fail map[string]bool
	seen []string
	// Hook, if set, runs at every point passed (before any armed error),
	// e.g. to cancel a client at a chosen step.
	Hook func(name string)
}

// NewInjector returns an injector that fails the named points.
func NewInjector(fail ...string) *Injector {
	inj := &Injector{fail: map[string]bool{}}
	for _, f := range fail {
		inj.fail[f] = true
	}
	return inj
}

type injectorKey struct{}

// With returns ctx carrying inj.
func With(ctx context.Context, inj *Injector) context.Context {
	return context.WithValue(ctx, injectorKey{}, inj)
}

func (inj *Injector) check(name string) error {
	inj.mu.Lock()
	inj.seen = append(inj.seen, name)
	fail := inj.fail[name]
	hook := inj.Hook
	inj.mu.Unlock()
	if hook != nil {
		hook(name)
	}
	if fail {
		return fmt.Errorf("%w at %s", ErrInjected, name)
	}
	return nil
}

// Seen lists the points passed so far, in order (repeats included).
func (inj *Injector) Seen() []string {
	inj.mu.Lock()
	defer inj.mu.Unlock()
	return append([]string(nil), inj.seen...)
}

// Crash points the crash tests arm by name (AENV_FAULT=NAME).
const (
	CreateRecorded = "create-recorded" // a sandbox's record is written, nothing started
	CreateStarted  = "create-started"  // its QEMU runs, the record still says creating
	PauseSaved     = "pause-saved"     // the saved state is complete, the record says pausing
	RepoPutFile    = "repo-put-file"   // a repository upload has copied its first file
	ForkFrozen     = "fork-frozen"     // a fork's snapshot is taken, no child exists yet
	// IdempotentAnswered: a create or fork with an Idempotency-Key has its
	// answer, not yet kept for the key's retries (nor sent).
	IdempotentAnswered = "idempotent-answered"
)
