package orchestrator

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"testing"
	"time"

	"github.com/agentenv/agentenv/internal/vmm"
)

// BenchmarkColdBoot measures creating a sandbox by cold-booting a template
// until envd has answered /init, and reports the median (p50) and p90. The
// baseline, measured in the same run, is the bare QEMU process start (until
// QMP answers, no guest), so the difference is what the guest kernel, init,
// envd and our setup cost. Run with e.g. `-bench ColdBoot -benchtime 10x`.
func BenchmarkColdBoot(b *testing.B) {
	n := testNode(b)
	b.Run("baseline-qemu-start", func(b *testing.B) {
		bin, err := vmm.FindQEMU("")
		if err != nil {
			b.Fatal(err)
		}
		var ds []time.Duration
		for i := 0; i < b.N; i++ {
			dir := b.TempDir()
			sock := filepath.Join(dir, "qmp.sock")
			start := time.Now()
			cmd := exec.Command(bin, "-M", "microvm", "-accel", "tcg", "-m", "256M", "-nodefaults", "-no-user-config",
				"-display", "none", "-qmp", "unix:"+sock+",server=on,wait=off")
			if err := cmd.Start(); err != nil {
				b.Fatal(err)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			q, err := vmm.DialQMP(ctx, sock)
			cancel()
			if err != nil {
				b.Fatal(err)
			}
			ds = append(ds, time.Since(start))
			q.Close()
			cmd.Process.Kill()
			cmd.Wait()
		}
		reportPercentiles(b, ds)
	})
	for _, tmpl := range []string{"minimal", "base"} {
		b.Run(tmpl, func(b *testing.B) {
			var ds []time.Duration
			phases := map[string][]time.Duration{}
			for i := 0; i < b.N; i++ {
				start := time.Now()
				s, err := n.Create(context.Background(), CreateRequest{TemplateID: tmpl, Secure: true})
				if err != nil {
					b.Fatal(err)
				}
				ds = append(ds, time.Since(start))
				for _, p := range s.Phases {
					phases[p.Name] = append(phases[p.Name], p.Duration)
				}
				b.StopTimer()
				if err := n.Kill(context.Background(), s.ID); err != nil {
					b.Fatal(err)
				}
				b.StartTimer()
			}
			reportPercentiles(b, ds)
			if os.Getenv("AENV_BENCH_PHASES") != "" {
				for name, d := range phases {
					fmt.Fprintf(os.Stderr, "%s %-20s p50 %s\n", tmpl, name, percentile(d, 50).Round(time.Millisecond))
				}
			}
		})
	}
}

func percentile(ds []time.Duration, p int) time.Duration {
	s := append([]time.Duration(nil), ds...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	if len(s) == 0 {
		return 0
	}
	return s[(len(s)-1)*p/100]
}

func reportPercentiles(b *testing.B, ds []time.Duration) {
	b.ReportMetric(float64(percentile(ds, 50).Microseconds())/1000, "p50-ms")
	b.ReportMetric(float64(percentile(ds, 90).Microseconds())/1000, "p90-ms")
	b.ReportMetric(0, "ns/op")
}

// BenchmarkPauseResume pauses and resumes one running `base` sandbox b.N
// times and reports p50/p90 of each. The resume figure ends when envd has
// accepted /init (so the sandbox answers requests). Baseline in the same run:
// the bare QMP stop/cont round trip on the running machine.
func BenchmarkPauseResume(b *testing.B) {
	n := testNode(b)
	ctx := context.Background()
	s, err := n.Create(ctx, CreateRequest{TemplateID: "base", Secure: true})
	if err != nil {
		b.Fatal(err)
	}
	var stopCont, pause, resume []time.Duration
	for i := 0; i < b.N; i++ {
		m := n.machine(s.ID)
		t0 := time.Now()
		if err := m.Pause(ctx); err != nil {
			b.Fatal(err)
		}
		if err := m.Resume(ctx); err != nil {
			b.Fatal(err)
		}
		stopCont = append(stopCont, time.Since(t0))
		t0 = time.Now()
		if _, err := n.Pause(ctx, s.ID); err != nil {
			b.Fatal(err)
		}
		pause = append(pause, time.Since(t0))
		t0 = time.Now()
		if _, err := n.Resume(ctx, s.ID, time.Hour); err != nil {
			b.Fatal(err)
		}
		resume = append(resume, time.Since(t0))
	}
	for name, ds := range map[string][]time.Duration{"baseline-stop-cont": stopCont, "pause": pause, "resume": resume} {
		fmt.Fprintf(os.Stderr, "%-20s n=%d p50 %8s p90 %8s\n", name, len(ds),
			percentile(ds, 50).Round(10*time.Microsecond), percentile(ds, 90).Round(10*time.Microsecond))
	}
	reportPercentiles(b, resume)
}
