package cli

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net/url"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/agentenv/agentenv/internal/apispec"
	"github.com/agentenv/agentenv/internal/procstat"
)

// idleOpts configure `aenv bench idle`.
type idleOpts struct {
	template      string
	sandboxes     int
	settle, watch time.Duration
	podmanImage   string
}

// idleUse is what idle boxes (sandboxes or containers) cost the host.
type idleUse struct {
	name     string
	pss, cpu []float64 // per box: bytes; share of one core over the window
}

func idleCmd() *cobra.Command {
	var (
		conn connection
		o    idleOpts
	)
	cmd := &cobra.Command{
		Use:   "idle",
		Short: "Measure what idle sandboxes cost the node (memory and CPU each) and how many its host holds",
		Long: `Starts --sandboxes sandboxes of --template, lets them settle, then reads the node's /metrics twice,
--window apart: each sandbox's host memory (PSS of its QEMU) and the CPU its QEMU used over the window.
It prints both per sandbox (median and max) and how many idle sandboxes the host holds by memory (its
memory over the PSS each) and by CPU (its cores over the CPU each). With --podman-image, as many idle
containers (podman, runc, sleeping) are measured the same way in the same run, the baseline. Run it on
the node's host: the cores counted are this host's, and the containers run here.`,
		Example: `  aenv bench idle --sandboxes 8
  aenv bench idle --template base --podman-image localhost/aenv-base`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if o.sandboxes < 1 || o.sandboxes > 500 || o.watch < time.Second {
				return usageError{errors.New("--sandboxes must be 1 to 500 and --window at least 1s")}
			}
			c, err := conn.client()
			if err != nil {
				return err
			}
			ctx := cmd.Context()
			sb, host, err := idleSandboxes(ctx, c, o)
			if err != nil {
				return err
			}
			uses := []idleUse{sb}
			if o.podmanImage != "" {
				ct, err := idleContainers(ctx, o)
				if err != nil {
					return err
				}
				uses = append(uses, ct)
			}
			printIdle(cmd.OutOrStdout(), o, host, uses)
			return nil
		},
	}
	conn.flags(cmd)
	cmd.Flags().StringVar(&o.template, "template", "base", "template of the idle sandboxes")
	cmd.Flags().IntVar(&o.sandboxes, "sandboxes", 8, "idle sandboxes to start")
	cmd.Flags().DurationVar(&o.settle, "settle", 20*time.Second, "wait this long after the last start before measuring")
	cmd.Flags().DurationVar(&o.watch, "window", 30*time.Second, "CPU is measured over this window")
	cmd.Flags().StringVar(&o.podmanImage, "podman-image", "", "measure as many idle podman containers of this image too (the baseline)")
	return cmd
}

// hostFacts is what the node reports of its host.
type hostFacts struct {
	totalBytes, availableBytes float64
	cores                      int
}

// idleSandboxes starts o.sandboxes sandboxes, measures them and kills them.
func idleSandboxes(ctx context.Context, c *apiClient, o idleOpts) (idleUse, hostFacts, error) {
	use := idleUse{name: "sandboxes (" + o.template + ")"}
	var ids []string
	defer func() {
		for _, id := range ids {
			_ = c.do(context.WithoutCancel(ctx), "DELETE", "/sandboxes/"+url.PathEscape(id), nil, nil)
		}
	}()
	timeout := int((o.settle + o.watch + 10*time.Minute).Seconds())
	for range o.sandboxes {
		var sb apispec.Sandbox
		if err := c.do(ctx, "POST", "/sandboxes", map[string]any{"templateID": o.template, "timeout": timeout, "autoPause": false}, &sb); err != nil {
			return use, hostFacts{}, fmt.Errorf("start sandbox %d of %d: %w", len(ids)+1, o.sandboxes, err)
		}
		ids = append(ids, sb.SandboxID)
	}
	if err := sleepCtx(ctx, o.settle); err != nil {
		return use, hostFacts{}, err
	}
	first, _, err := scrapeSandboxes(ctx, c)
	if err != nil {
		return use, hostFacts{}, err
	}
	start := time.Now()
	if err := sleepCtx(ctx, o.watch); err != nil {
		return use, hostFacts{}, err
	}
	second, host, err := scrapeSandboxes(ctx, c)
	if err != nil {
		return use, hostFacts{}, err
	}
	window := time.Since(start).Seconds()
	for _, id := range ids {
		a, okA := first[id]
		b, okB := second[id]
		if !okA || !okB || b.pss == 0 {
			return use, host, errors.New("the server's /metrics does not report the sandboxes' memory and CPU: run this against a node, not a gateway")
		}
		use.pss = append(use.pss, b.pss)
		use.cpu = append(use.cpu, (b.cpuSeconds-a.cpuSeconds)/window)
	}
	host.cores = runtime.NumCPU()
	return use, host, nil
}

// sandboxFigures is one sandbox's line of /metrics.
type sandboxFigures struct{ pss, cpuSeconds float64 }

// scrapeSandboxes reads the sandboxes' PSS and CPU time and the host's
// memory from the server's /metrics.
func scrapeSandboxes(ctx context.Context, c *apiClient) (map[string]sandboxFigures, hostFacts, error) {
	resp, err := c.send(ctx, "GET", "/metrics", nil)
	if err != nil {
		return nil, hostFacts{}, err
	}
	defer resp.Body.Close()
	out := map[string]sandboxFigures{}
	var host hostFacts
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		f := strings.Fields(line)
		if len(f) < 2 || strings.HasPrefix(line, "#") {
			continue
		}
		v, err := strconv.ParseFloat(f[len(f)-1], 64)
		if err != nil {
			continue
		}
		metric, labels, _ := strings.Cut(f[0], "{")
		switch metric {
		case "aenv_node_memory_total_bytes":
			host.totalBytes = v
		case "aenv_node_memory_available_bytes":
			host.availableBytes = v
		case "aenv_sandbox_memory_pss_bytes", "aenv_sandbox_cpu_seconds_total":
			id := labelValue(labels, "sandbox_id")
			s := out[id]
			if metric == "aenv_sandbox_memory_pss_bytes" {
				s.pss = v
			} else {
				s.cpuSeconds = v
			}
			out[id] = s
		}
	}
	return out, host, sc.Err()
}

// labelValue is a label's value in a metric line's `k="v",...}` part.
func labelValue(labels, key string) string {
	_, rest, ok := strings.Cut(labels, key+`="`)
	if !ok {
		return ""
	}
	v, _, _ := strings.Cut(rest, `"`)
	return v
}

// idleContainers starts as many sleeping podman containers and measures
// their process trees the same way (PSS; CPU from /proc over the window).
func idleContainers(ctx context.Context, o idleOpts) (idleUse, error) {
	use := idleUse{name: "containers (podman, runc)"}
	podman := func(args ...string) (string, error) { return runPodman(ctx, nil, args...) }
	var ids []string
	var pids []int
	defer func() {
		for _, id := range ids {
			_, _ = podman("rm", "-f", "-t", "0", id)
		}
	}()
	for range o.sandboxes {
		id, err := podman("run", "-d", "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024",
			"--network", "none", o.podmanImage, "sleep", "infinity")
		if err != nil {
			return use, err
		}
		ids = append(ids, id)
		pid, err := podmanPID(ctx, id)
		if err != nil {
			return use, err
		}
		pids = append(pids, pid)
	}
	if err := sleepCtx(ctx, o.settle); err != nil {
		return use, err
	}
	before := make([]float64, len(pids))
	for i, p := range pids {
		before[i] = procstat.TreeCPUSeconds(p)
	}
	start := time.Now()
	if err := sleepCtx(ctx, o.watch); err != nil {
		return use, err
	}
	window := time.Since(start).Seconds()
	for i, p := range pids {
		use.pss = append(use.pss, float64(procstat.TreePSS(p)))
		use.cpu = append(use.cpu, (procstat.TreeCPUSeconds(p)-before[i])/window)
	}
	return use, nil
}

func sleepCtx(ctx context.Context, d time.Duration) error {
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(d):
		return nil
	}
}

// median and largest of a sample.
func medianMax(v []float64) (float64, float64) {
	if len(v) == 0 {
		return 0, 0
	}
	s := append([]float64(nil), v...)
	sort.Float64s(s)
	return s[(len(s)-1)/2], s[len(s)-1]
}

func printIdle(w io.Writer, o idleOpts, host hostFacts, uses []idleUse) {
	fmt.Fprintf(w, "idle: %d of each, measured %s after the last start, CPU over %s; host: %.1f GiB memory (%.1f GiB available while they ran), %d cores\n",
		o.sandboxes, o.settle, o.watch, host.totalBytes/(1<<30), host.availableBytes/(1<<30), host.cores)
	rows := [][]string{}
	for _, u := range uses {
		pssMed, pssMax := medianMax(u.pss)
		cpuMed, cpuMax := medianMax(u.cpu)
		byMemory, byCPU := "-", "-"
		if pssMed > 0 {
			byMemory = fmt.Sprint(int(host.totalBytes / pssMed))
		}
		if cpuMed > 0 {
			byCPU = fmt.Sprint(int(float64(host.cores) / cpuMed))
		}
		rows = append(rows, []string{u.name, fmt.Sprint(len(u.pss)),
			fmt.Sprintf("%.1f / %.1f MiB", pssMed/(1<<20), pssMax/(1<<20)),
			fmt.Sprintf("%.2f%% / %.2f%%", cpuMed*100, cpuMax*100), byMemory, byCPU})
	}
	table(w, []string{"IDLE", "N", "MEMORY EACH (PSS, MEDIAN / MAX)", "CPU EACH (OF A CORE, MEDIAN / MAX)", "HOST HOLDS BY MEMORY", "BY CPU"}, rows)
}
