package cli

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"sort"
	"time"

	"github.com/spf13/cobra"

	"github.com/agentenv/agentenv/internal/apispec"
	"github.com/agentenv/agentenv/internal/envd/gen/processpb"
)

func benchCmd() *cobra.Command {
	var (
		conn     connection
		template string
		n        int
	)
	cmd := &cobra.Command{
		Use:   "bench",
		Short: "Time a server's sandbox operations (create, exec, pause, resume, fork, kill) and print medians",
		Long: `Runs each operation N times against the server (or gateway) and prints p50, p90 and max. The
baseline, measured in the same run, is a REST round trip (GET /v2/sandboxes?limit=1): every other line
is also shown as a multiple of it. Sandboxes it creates are killed at the end.`,
		Example: `  aenv bench
  aenv bench --template minimal -n 20`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if n < 1 || n > 1000 {
				return usageError{errors.New("-n must be between 1 and 1000")}
			}
			c, err := conn.client()
			if err != nil {
				return err
			}
			ctx := cmd.Context()
			results, err := runBench(ctx, c, template, n, func(op string, i int) {
				if stdoutIsTerminal(cmd.ErrOrStderr()) {
					fmt.Fprintf(cmd.ErrOrStderr(), "\r%-8s %d/%d ", op, i+1, n)
				}
			})
			if stdoutIsTerminal(cmd.ErrOrStderr()) {
				fmt.Fprint(cmd.ErrOrStderr(), "\r\033[K")
			}
			if err != nil {
				return err
			}
			base := pct(results[0].d, 50)
			rows := [][]string{}
			for _, r := range results {
				p50 := pct(r.d, 50)
				rows = append(rows, []string{r.op, fmt.Sprint(len(r.d)), ms(p50), ms(pct(r.d, 90)), ms(pct(r.d, 100)),
					fmt.Sprintf("%.0fx", float64(p50)/float64(max(base, time.Microsecond)))})
			}
			return table(cmd.OutOrStdout(), []string{"OPERATION", "N", "P50", "P90", "MAX", "VS BASELINE"}, rows)
		},
	}
	conn.flags(cmd)
	cmd.Flags().StringVar(&template, "template", "base", "template to create sandboxes from")
	cmd.Flags().IntVarP(&n, "count", "n", 10, "runs of each operation")
	cmd.AddCommand(rolloutCmd(), idleCmd())
	return cmd
}

type benchResult struct {
	op string
	d  []time.Duration
}

func runBench(ctx context.Context, c *apiClient, template string, n int, progress func(string, int)) ([]benchResult, error) {
	timed := func(op string, f func() error) (benchResult, error) {
		r := benchResult{op: op}
		for i := 0; i < n; i++ {
			progress(op, i)
			start := time.Now()
			if err := f(); err != nil {
				return r, fmt.Errorf("%s: %w", op, err)
			}
			r.d = append(r.d, time.Since(start))
		}
		return r, nil
	}
	var created []string
	defer func() {
		for _, id := range created {
			c.do(context.WithoutCancel(ctx), "DELETE", "/sandboxes/"+url.PathEscape(id), nil, nil)
		}
	}()
	var out []benchResult
	add := func(r benchResult, err error) error {
		out = append(out, r)
		return err
	}
	if err := add(timed("baseline", func() error { return c.do(ctx, "GET", "/v2/sandboxes?limit=1", nil, nil) })); err != nil {
		return nil, err
	}
	var last string
	if err := add(timed("create", func() error {
		var sb apispec.Sandbox
		err := c.do(ctx, "POST", "/sandboxes", map[string]any{"templateID": template, "timeout": 600}, &sb)
		if err == nil {
			created = append(created, sb.SandboxID)
			last = sb.SandboxID
		}
		return err
	})); err != nil {
		return nil, err
	}
	e, err := connectSandbox(ctx, c, last, "")
	if err != nil {
		return nil, err
	}
	runTrue := func() error {
		code, err := e.run(ctx, &processpb.StartRequest{Process: &processpb.ProcessConfig{Cmd: "true"}}, nil, discard{}, discard{}, false)
		if err == nil && code != 0 {
			err = fmt.Errorf("true exited %d", code)
		}
		return err
	}
	if err := add(timed("exec", runTrue)); err != nil {
		return nil, err
	}
	// The other sandboxes go before the pauses and resumes, which are
	// timed on an otherwise idle node (as the node's own benchmark does):
	// twenty idle guests' timers and the pool's refills are not a resume's.
	kills := benchResult{op: "kill"}
	kill := func(id string) error {
		progress("kill", len(kills.d))
		start := time.Now()
		if err := c.do(ctx, "DELETE", "/sandboxes/"+url.PathEscape(id), nil, nil); err != nil {
			return fmt.Errorf("kill: %w", err)
		}
		kills.d = append(kills.d, time.Since(start))
		return nil
	}
	for _, id := range created[:len(created)-1] {
		if err := kill(id); err != nil {
			return nil, err
		}
	}
	created = created[len(created)-1:]
	// A resume, and the same resume until a command (true) has answered
	// in the guest: what a user waits for.
	var pauses, resumes, answered benchResult
	pauses.op, resumes.op, answered.op = "pause", "resume", "resume+exec"
	for i := 0; i < n; i++ {
		progress("pause", i)
		start := time.Now()
		if err := c.do(ctx, "POST", "/sandboxes/"+last+"/pause", nil, nil); err != nil {
			return nil, fmt.Errorf("pause: %w", err)
		}
		pauses.d = append(pauses.d, time.Since(start))
		start = time.Now()
		if err := c.do(ctx, "POST", "/sandboxes/"+last+"/resume", map[string]any{"timeout": 600}, nil); err != nil {
			return nil, fmt.Errorf("resume: %w", err)
		}
		resumes.d = append(resumes.d, time.Since(start))
		if err := runTrue(); err != nil {
			return nil, fmt.Errorf("exec after a resume: %w", err)
		}
		answered.d = append(answered.d, time.Since(start))
	}
	out = append(out, pauses, resumes, answered)
	if err := add(timed("fork", func() error {
		var res []struct {
			Sandbox *apispec.Sandbox `json:"sandbox"`
		}
		if err := c.do(ctx, "POST", "/sandboxes/"+last+"/fork", map[string]any{"count": 1, "timeout": 600}, &res); err != nil {
			return err
		}
		for _, r := range res {
			if r.Sandbox != nil {
				created = append(created, r.Sandbox.SandboxID)
			}
		}
		return nil
	})); err != nil {
		return nil, err
	}
	for _, id := range created {
		if err := kill(id); err != nil {
			return nil, err
		}
	}
	created = nil
	return append(out, kills), nil
}

type discard struct{}

func (discard) Write(p []byte) (int, error) { return len(p), nil }

// pct is the p-th percentile (nearest rank) of ds.
func pct(ds []time.Duration, p int) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := append([]time.Duration(nil), ds...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	i := (p*len(s) + 99) / 100
	return s[max(min(i, len(s))-1, 0)]
}

func ms(d time.Duration) string {
	return fmt.Sprintf("%.1f ms", float64(d.Microseconds())/1000)
}
