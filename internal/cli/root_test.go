package cli

import (
	"errors"
	"io"
	"net/http"
	"testing"
	"time"

	"github.com/spf13/cobra"
)

// TestEveryCommandIsDocumented: every command a user can run has a short
// description and examples in its --help.
func TestEveryCommandIsDocumented(t *testing.T) {
	var walk func(c *cobra.Command)
	walk = func(c *cobra.Command) {
		for _, sub := range c.Commands() {
			walk(sub)
		}
		if c.Hidden || !c.Runnable() || c.Name() == "help" || c.HasParent() && c.Parent().Name() == "completion" || c.Name() == "completion" {
			return
		}
		if c.Short == "" || c.Example == "" {
			t.Errorf("`%s` lacks a short description or examples", c.CommandPath())
		}
	}
	walk(newRoot())
}

func TestExitStatus(t *testing.T) {
	for _, tc := range []struct {
		name string
		err  error
		want int
	}{
		{"success", nil, ExitOK},
		{"command's own code", exitCode(7), 7},
		{"usage", usageError{errors.New("x")}, ExitUsage},
		{"not found", &apiError{Status: http.StatusNotFound}, ExitNotFound},
		{"already reported not found", silent{&apiError{Status: http.StatusNotFound}}, ExitNotFound},
		{"server error", &apiError{Status: 500}, ExitFailure},
		{"other", errors.New("boom"), ExitFailure},
	} {
		if got := exitStatus(tc.err, io.Discard); got != tc.want {
			t.Errorf("%s: %d, want %d", tc.name, got, tc.want)
		}
	}
}

func TestSecondsFlag(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want time.Duration
		ok   bool
	}{
		{"300", 300 * time.Second, true},
		{"5m", 5 * time.Minute, true},
		{"1h30m", 90 * time.Minute, true},
		{"0", 0, false},
		{"-5", 0, false},
		{"soon", 0, false},
		{"500ms", 0, false},
	} {
		var d time.Duration
		err := seconds{&d}.Set(tc.in)
		if (err == nil) != tc.ok || (tc.ok && d != tc.want) {
			t.Errorf("%q: %v %v", tc.in, d, err)
		}
	}
}
