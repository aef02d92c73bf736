package cli

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/url"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/spf13/cobra"

	"github.com/agentenv/agentenv/internal/apispec"
	"github.com/agentenv/agentenv/internal/envd/gen/processpb"
	"github.com/agentenv/agentenv/internal/procstat"
)

// aenv bench rollout: the episodes of an RL rollout against a server, and
// the same episode in containers (podman with runc) as the baseline most
// RL teams use, in the same run.

// rolloutOpts are the knobs of a rollout benchmark.
type rolloutOpts struct {
	template    string
	episodes    int
	concurrency int
	commands    int
	forkInto    int
	podmanImage string
}

// stepTimes are the durations of the steps of many episodes, by step.
type stepTimes struct {
	mu     sync.Mutex
	steps  map[string][]time.Duration
	order  []string
	errors map[string]int
}

func newStepTimes() *stepTimes {
	return &stepTimes{steps: map[string][]time.Duration{}, errors: map[string]int{}}
}

func (s *stepTimes) add(step string, d time.Duration, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.steps[step]; !ok {
		s.order = append(s.order, step)
		s.steps[step] = nil
	}
	if err != nil {
		s.errors[step]++
		return
	}
	s.steps[step] = append(s.steps[step], d)
}

// timed runs f as step and records it; its error is returned.
func (s *stepTimes) timed(step string, f func() error) error {
	start := time.Now()
	err := f()
	s.add(step, time.Since(start), err)
	return err
}

// rolloutReport is one kind of episode's results.
type rolloutReport struct {
	name      string
	episodes  int
	failed    int
	took      time.Duration
	steps     *stepTimes
	peakLive  int64
	pssPerBox int64 // host memory per sandbox at the peak (PSS), 0: not measured
	note      string
}

func rolloutCmd() *cobra.Command {
	var (
		conn connection
		o    rolloutOpts
	)
	cmd := &cobra.Command{
		Use:   "rollout",
		Short: "Run RL rollout episodes against the server (and in containers as the baseline) and report their throughput",
		Long: `Runs --episodes episodes, --concurrency at a time, of: create a sandbox → --commands commands and as many
file writes → kill. Then prepares one sandbox and forks it into --fork children → a command in each → reads
a file from each → kills them. With --podman-image, the same first episode runs in containers in the same
run (podman --runtime runc: run -d, exec, exec with stdin, rm -f), the baseline; containers cannot fork a
running process tree, so the fork episode has no container row. It reports episodes per minute, p50 and
p99 of each step, errors, the peak number of live sandboxes and host memory per sandbox (PSS, from the
server's /metrics, when it runs on this host's node).`,
		Example: `  aenv bench rollout --episodes 40 --concurrency 8
  aenv bench rollout --template base --podman-image localhost/aenv-base`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if o.episodes < 1 || o.concurrency < 1 || o.commands < 1 || o.forkInto < 0 || o.forkInto > 16 {
				return usageError{errors.New("--episodes, --concurrency and --commands must be at least 1, --fork 0 to 16")}
			}
			c, err := conn.client()
			if err != nil {
				return err
			}
			ctx := cmd.Context()
			var reports []rolloutReport
			reports = append(reports, sandboxEpisodes(ctx, c, o))
			if o.forkInto > 0 {
				reports = append(reports, forkEpisode(ctx, c, o))
			}
			if o.podmanImage != "" {
				reports = append(reports, containerEpisodes(ctx, o))
			}
			printRollout(cmd.OutOrStdout(), o, reports)
			return nil
		},
	}
	conn.flags(cmd)
	cmd.Flags().StringVar(&o.template, "template", "base", "template of the episodes' sandboxes")
	cmd.Flags().IntVar(&o.episodes, "episodes", 20, "episodes to run")
	cmd.Flags().IntVar(&o.concurrency, "concurrency", 4, "episodes at once")
	cmd.Flags().IntVar(&o.commands, "commands", 3, "commands (and file writes) per episode")
	cmd.Flags().IntVar(&o.forkInto, "fork", 16, "children of the fork episode (0: none)")
	cmd.Flags().StringVar(&o.podmanImage, "podman-image", "", "run the episode in podman containers of this image too (the baseline)")
	return cmd
}

// episodeCommand is what each command of an episode runs: a short Python
// step, as an agent's tool call would.
func episodeCommand(i int) string {
	return fmt.Sprintf(`python3 -c 'import json,sys; print(json.dumps({"step": %d, "sum": sum(range(10000))}))'`, i)
}

// liveCounter counts live sandboxes and keeps the peak.
type liveCounter struct{ now, peak atomic.Int64 }

func (l *liveCounter) inc() {
	n := l.now.Add(1)
	for p := l.peak.Load(); n > p && !l.peak.CompareAndSwap(p, n); p = l.peak.Load() {
	}
}

func (l *liveCounter) dec() { l.now.Add(-1) }

// sandboxEpisodes runs the create → commands and writes → kill episodes.
func sandboxEpisodes(ctx context.Context, c *apiClient, o rolloutOpts) rolloutReport {
	r := rolloutReport{name: "sandboxes (" + o.template + ")", episodes: o.episodes, steps: newStepTimes()}
	var live liveCounter
	var pssMax atomic.Int64
	r.took, r.failed = runEpisodes(o, func() error { return sandboxEpisode(ctx, c, o, r.steps, &live, &pssMax) })
	r.peakLive, r.pssPerBox = live.peak.Load(), pssMax.Load()
	return r
}

// runEpisodes runs o.episodes episodes, o.concurrency at a time; it
// returns how long they took and how many failed.
func runEpisodes(o rolloutOpts, episode func() error) (time.Duration, int) {
	var failed atomic.Int64
	jobs := make(chan struct{})
	var wg sync.WaitGroup
	start := time.Now()
	for range o.concurrency {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range jobs {
				if err := episode(); err != nil {
					failed.Add(1)
				}
			}
		}()
	}
	for range o.episodes {
		jobs <- struct{}{}
	}
	close(jobs)
	wg.Wait()
	return time.Since(start), int(failed.Load())
}

func sandboxEpisode(ctx context.Context, c *apiClient, o rolloutOpts, st *stepTimes, live *liveCounter, pssMax *atomic.Int64) error {
	var sb apispec.Sandbox
	if err := st.timed("create", func() error {
		return c.do(ctx, "POST", "/sandboxes", map[string]any{"templateID": o.template, "timeout": 600, "autoPause": false}, &sb)
	}); err != nil {
		return err
	}
	live.inc()
	defer live.dec()
	defer st.timed("kill", func() error {
		return c.do(context.WithoutCancel(ctx), "DELETE", "/sandboxes/"+url.PathEscape(sb.SandboxID), nil, nil)
	})
	e, err := connectSandbox(ctx, c, sb.SandboxID, "")
	if err != nil {
		st.add("command", 0, err)
		return err
	}
	for i := range o.commands {
		if err := st.timed("command", func() error { return runIn(ctx, e, episodeCommand(i)) }); err != nil {
			return err
		}
		if err := st.timed("write file", func() error {
			return e.upload(ctx, fmt.Sprintf("/home/user/step-%d.json", i), strings.NewReader(fmt.Sprintf(`{"step": %d}`, i)))
		}); err != nil {
			return err
		}
	}
	if p := sandboxPSS(ctx, c, sb.SandboxID); p > pssMax.Load() {
		pssMax.Store(p)
	}
	return nil
}

// runIn runs a shell command in a sandbox; a non-zero exit is an error.
func runIn(ctx context.Context, e *envdConn, command string) error {
	code, err := e.run(ctx, &processpb.StartRequest{Process: &processpb.ProcessConfig{Cmd: "/bin/bash", Args: []string{"-c", command}}}, nil, discard{}, discard{}, false)
	if err == nil && code != 0 {
		err = fmt.Errorf("exit %d", code)
	}
	return err
}

// forkEpisode prepares a sandbox, forks it into o.forkInto children, runs
// a command in each, reads a file from each and kills them all.
func forkEpisode(ctx context.Context, c *apiClient, o rolloutOpts) rolloutReport {
	r := rolloutReport{name: fmt.Sprintf("fork into %d (%s)", o.forkInto, o.template), episodes: 1, steps: newStepTimes()}
	start := time.Now()
	var ids []string
	defer func() {
		for _, id := range ids {
			c.do(context.WithoutCancel(ctx), "DELETE", "/sandboxes/"+url.PathEscape(id), nil, nil)
		}
	}()
	fail := func(err error) rolloutReport {
		r.failed, r.took, r.note = 1, time.Since(start), err.Error()
		return r
	}
	var parent apispec.Sandbox
	if err := r.steps.timed("prepare", func() error {
		if err := c.do(ctx, "POST", "/sandboxes", map[string]any{"templateID": o.template, "timeout": 600, "autoPause": false}, &parent); err != nil {
			return err
		}
		ids = append(ids, parent.SandboxID)
		e, err := connectSandbox(ctx, c, parent.SandboxID, "")
		if err != nil {
			return err
		}
		return runIn(ctx, e, "echo prepared > /home/user/state")
	}); err != nil {
		return fail(err)
	}
	var kids []struct {
		Sandbox *apispec.Sandbox `json:"sandbox"`
	}
	if err := r.steps.timed("fork", func() error {
		return c.do(ctx, "POST", "/sandboxes/"+url.PathEscape(parent.SandboxID)+"/fork", map[string]any{"count": o.forkInto, "timeout": 600}, &kids)
	}); err != nil {
		return fail(err)
	}
	var children []string
	for _, k := range kids {
		if k.Sandbox != nil {
			children = append(children, k.Sandbox.SandboxID)
			ids = append(ids, k.Sandbox.SandboxID)
		}
	}
	r.peakLive = int64(len(ids))
	var wg sync.WaitGroup
	var errs atomic.Int64
	for i, id := range children {
		wg.Add(1)
		go func() {
			defer wg.Done()
			e, err := connectSandbox(ctx, c, id, "")
			if err == nil {
				err = r.steps.timed("child command", func() error { return runIn(ctx, e, episodeCommand(i)+" > /home/user/out.json") })
			}
			if err == nil {
				err = r.steps.timed("collect", func() error {
					var buf bytes.Buffer
					if err := e.download(ctx, "/home/user/out.json", &buf); err != nil {
						return err
					}
					if !strings.Contains(buf.String(), `"step"`) {
						return fmt.Errorf("child %s wrote %q", id, buf.String())
					}
					return nil
				})
			}
			if err != nil {
				errs.Add(1)
			}
		}()
	}
	wg.Wait()
	if len(children) > 0 {
		r.pssPerBox = sandboxPSS(ctx, c, children[0])
	}
	for _, id := range ids {
		r.steps.timed("kill", func() error {
			return c.do(context.WithoutCancel(ctx), "DELETE", "/sandboxes/"+url.PathEscape(id), nil, nil)
		})
	}
	ids = nil
	r.took = time.Since(start)
	if n := errs.Load(); n > 0 || len(children) < o.forkInto {
		r.failed = 1
		r.note = fmt.Sprintf("%d of %d children made, %d failed their steps", len(children), o.forkInto, n)
	}
	return r
}

// sandboxPSS is a sandbox's QEMU's PSS from the server's /metrics (0 when
// the server does not report it, e.g. a gateway).
func sandboxPSS(ctx context.Context, c *apiClient, id string) int64 {
	figures, _, err := scrapeSandboxes(ctx, c)
	if err != nil {
		return 0
	}
	return int64(figures[id].pss)
}

// containerEpisodes runs the first episode in podman containers (runc):
// run -d (create), exec (commands), exec with stdin (file writes), rm -f
// (kill). Memory per container is the PSS of its processes.
func containerEpisodes(ctx context.Context, o rolloutOpts) rolloutReport {
	r := rolloutReport{name: "containers (podman, runc)", episodes: o.episodes, steps: newStepTimes(),
		note: "containers cannot fork a running process tree: no fork row"}
	podman := runPodman
	var live liveCounter
	var pssMax atomic.Int64
	episode := func() error {
		var id string
		if err := r.steps.timed("create", func() error {
			var err error
			id, err = podman(ctx, nil, "run", "-d", "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024",
				"--network", "none", o.podmanImage, "sleep", "600")
			return err
		}); err != nil {
			return err
		}
		live.inc()
		defer live.dec()
		defer r.steps.timed("kill", func() error { _, err := podman(context.WithoutCancel(ctx), nil, "rm", "-f", "-t", "0", id); return err })
		for i := range o.commands {
			if err := r.steps.timed("command", func() error { _, err := podman(ctx, nil, "exec", id, "bash", "-c", episodeCommand(i)); return err }); err != nil {
				return err
			}
			if err := r.steps.timed("write file", func() error {
				_, err := podman(ctx, strings.NewReader(fmt.Sprintf(`{"step": %d}`, i)), "exec", "-i", id, "sh", "-c", fmt.Sprintf("cat > /tmp/step-%d.json", i))
				return err
			}); err != nil {
				return err
			}
		}
		if pid, err := podmanPID(ctx, id); err == nil {
			if p := procstat.TreePSS(pid); p > pssMax.Load() {
				pssMax.Store(p)
			}
		}
		return nil
	}
	r.took, r.failed = runEpisodes(o, episode)
	r.peakLive, r.pssPerBox = live.peak.Load(), pssMax.Load()
	return r
}

func printRollout(w io.Writer, o rolloutOpts, reports []rolloutReport) {
	rows := [][]string{}
	for _, r := range reports {
		perMin := float64(r.episodes-r.failed) / r.took.Minutes()
		mem := "-"
		if r.pssPerBox > 0 {
			mem = fmt.Sprintf("%.1f MiB", float64(r.pssPerBox)/(1<<20))
		}
		rows = append(rows, []string{r.name, fmt.Sprint(r.episodes), fmt.Sprint(r.failed), fmt.Sprintf("%.1f", perMin),
			fmt.Sprint(r.peakLive), mem, r.took.Round(time.Millisecond).String()})
	}
	fmt.Fprintf(w, "rollout: %d episodes, %d at once, %d commands and writes each\n", o.episodes, o.concurrency, o.commands)
	table(w, []string{"EPISODES OF", "N", "FAILED", "PER MINUTE", "PEAK LIVE", "MEMORY EACH (PSS)", "TOOK"}, rows)
	fmt.Fprintln(w)
	steps := [][]string{}
	for _, r := range reports {
		for _, step := range r.steps.order {
			ds := r.steps.steps[step]
			steps = append(steps, []string{r.name, step, fmt.Sprint(len(ds)), ms(pct(ds, 50)), ms(pct(ds, 99)), fmt.Sprint(r.steps.errors[step])})
		}
	}
	table(w, []string{"EPISODES OF", "STEP", "N", "P50", "P99", "ERRORS"}, steps)
	for _, r := range reports {
		if r.note != "" {
			fmt.Fprintf(w, "%s: %s\n", r.name, r.note)
		}
	}
}

// runPodman runs podman with runc (crun refuses this kind of host's hybrid
// cgroups) and returns its trimmed output, or an error with its stderr.
func runPodman(ctx context.Context, stdin io.Reader, args ...string) (string, error) {
	cmd := exec.CommandContext(ctx, "podman", append([]string{"--runtime", "runc"}, args...)...)
	cmd.Stdin = stdin
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	if err := cmd.Run(); err != nil {
		return "", fmt.Errorf("podman %s: %v: %s", args[0], err, strings.TrimSpace(errb.String()))
	}
	return strings.TrimSpace(out.String()), nil
}

// podmanPID is the host pid of a container's first process.
func podmanPID(ctx context.Context, id string) (int, error) {
	out, err := runPodman(ctx, nil, "inspect", "--format", "{{.State.Pid}}", id)
	if err != nil {
		return 0, err
	}
	return strconv.Atoi(out)
}
