package operation

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/agentenv/agentenv/internal/faults"
)

func TestDetachedFromCaller(t *testing.T) {
	parent, cancel := context.WithCancel(context.Background())
	o := Start(parent, "pause", time.Minute, nil)
	cancel()
	if err := o.Do("save", func(ctx context.Context) error { return ctx.Err() }); err != nil {
		t.Fatalf("a cancelled caller cancelled the operation: %v", err)
	}
	if err := o.Finish(nil); err != nil {
		t.Fatal(err)
	}
}

func TestOwnTimeout(t *testing.T) {
	o := Start(context.Background(), "fork", 20*time.Millisecond, nil)
	err := o.Do("wait", func(ctx context.Context) error { <-ctx.Done(); return ctx.Err() })
	err = o.Finish(err)
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("got %v", err)
	}
}

func TestCleanupsRunInReverseOnFailureOnly(t *testing.T) {
	for _, tc := range []struct {
		name    string
		fail    bool
		want    string
		wantErr bool
	}{
		{"success drops cleanups", false, "", false},
		{"failure runs them newest first", true, "cba", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var got strings.Builder
			o := Start(context.Background(), "create", time.Minute, nil)
			for _, s := range []string{"a", "b", "c"} {
				o.OnFailure(s, func(ctx context.Context) error {
					if ctx.Err() != nil {
						t.Errorf("cleanup %s ran on a dead context", s)
					}
					got.WriteString(s)
					return nil
				})
			}
			var err error
			if tc.fail {
				err = errors.New("boom")
			}
			if err := o.Finish(err); (err != nil) != tc.wantErr {
				t.Fatalf("Finish: %v", err)
			}
			if got.String() != tc.want {
				t.Fatalf("cleanups ran %q, want %q", got.String(), tc.want)
			}
		})
	}
}

func TestCleanupsRunAfterTimeout(t *testing.T) {
	o := Start(context.Background(), "x", time.Millisecond, nil)
	ran := false
	o.OnFailure("undo", func(ctx context.Context) error { ran = ctx.Err() == nil; return nil })
	<-o.Context().Done() // not a sleep: under load the timer may fire late
	err := o.Finish(o.Context().Err())
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Finish returned %v, want the deadline", err)
	}
	if !ran {
		t.Fatal("cleanup did not get a live context after the operation timed out")
	}
}

func TestStepsAreFaultPoints(t *testing.T) {
	inj := faults.NewInjector("pause/save-state")
	o := Start(faults.With(context.Background(), inj), "pause", time.Minute, nil)
	ran := 0
	if err := o.Do("stop-vcpus", func(context.Context) error { ran++; return nil }); err != nil {
		t.Fatal(err)
	}
	err := o.Do("save-state", func(context.Context) error { ran++; return nil })
	if !errors.Is(err, faults.ErrInjected) || ran != 1 {
		t.Fatalf("injected step: err %v, steps run %d", err, ran)
	}
	if seen := strings.Join(inj.Seen(), ","); seen != "pause/stop-vcpus,pause/save-state" {
		t.Fatalf("seen %s", seen)
	}
	if st := o.Steps(); len(st) != 2 || st[1].Name != "save-state" {
		t.Fatalf("steps %+v", st)
	}
}
