package orchestrator

import (
	"context"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/agentenv/agentenv/internal/procstat"
	"github.com/agentenv/agentenv/internal/sandboxes"
)

// allocFree makes the guest touch 200 MiB and free it again.
const allocFree = `python3 -c '
b = bytearray(200 << 20)
for i in range(0, len(b), 4096):
    b[i] = 1
del b
'`

// settledRSS waits until a sandbox's QEMU RSS stops falling (or until
// limit) and returns it.
func settledRSS(pid int, limit time.Duration) int64 {
	deadline := time.Now().Add(limit)
	last := int64(-1)
	for {
		m, _ := procstat.ReadMemory(pid)
		if time.Now().After(deadline) || (last >= 0 && m.RSSBytes >= last) {
			return m.RSSBytes
		}
		last = m.RSSBytes
		time.Sleep(2 * time.Second)
	}
}

// TestBalloonReturnsFreedMemory: memory the guest allocates and frees goes
// back to the host through the balloon's free page reporting.
func TestBalloonReturnsFreedMemory(t *testing.T) {
	n := testNode(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	s := create(t, n, CreateRequest{TemplateID: "base"})
	before := settledRSS(s.PID, 10*time.Second)
	if r, err := newEnvdClient(s).run(ctx, "", "bash", "-c", allocFree); err != nil || r.exit != 0 {
		t.Fatalf("allocate: %+v %v", r, err)
	}
	after := settledRSS(s.PID, 30*time.Second)
	t.Logf("QEMU RSS before %d MiB, after allocating and freeing 200 MiB in the guest %d MiB", before>>20, after>>20)
	if after-before > 100<<20 {
		t.Fatalf("freed guest memory stayed with the host: RSS grew by %d MiB", (after-before)>>20)
	}
	mem, err := n.Memory(ctx)
	if err != nil || len(mem.Sandboxes) != 1 || mem.Sandboxes[0].ID != s.ID || mem.Sandboxes[0].PSSBytes <= 0 || mem.TotalBytes <= 0 {
		t.Fatalf("memory report: %+v %v", mem, err)
	}
}

// BenchmarkBalloon creates 4 `base` sandboxes whose guests each allocate
// and free 200 MiB, and reports the host memory they hold afterwards (sum
// of PSS), with the balloon's free page reporting and, as the baseline in
// the same run, without it.
func BenchmarkBalloon(b *testing.B) {
	n := testNode(b)
	ctx := context.Background()
	const count = 4
	measure := func(reporting bool) (idle, afterFree int64) {
		n.cfg.NoFreePageReporting = !reporting
		var sbs []*sandboxes.Sandbox
		for i := 0; i < count; i++ {
			s, err := n.Create(ctx, CreateRequest{TemplateID: "base"})
			if err != nil {
				b.Fatal(err)
			}
			sbs = append(sbs, s)
		}
		sum := func() int64 {
			var t int64
			for _, s := range sbs {
				settledRSS(s.PID, 20*time.Second)
				m, _ := procstat.ReadMemory(s.PID)
				t += m.PSSBytes
			}
			return t
		}
		idle = sum()
		for _, s := range sbs {
			if r, err := newEnvdClient(s).run(ctx, "", "bash", "-c", allocFree); err != nil || r.exit != 0 {
				b.Fatalf("allocate: %+v %v", r, err)
			}
		}
		afterFree = sum()
		for _, s := range sbs {
			n.Kill(ctx, s.ID)
		}
		return idle, afterFree
	}
	for i := 0; i < b.N; i++ {
		offIdle, offAfter := measure(false)
		onIdle, onAfter := measure(true)
		fmt.Fprintf(os.Stderr, "%d sandboxes, sum of QEMU PSS (MiB)   idle  after 200 MiB allocated+freed each\n", count)
		fmt.Fprintf(os.Stderr, "baseline: no free page reporting   %5d  %5d\n", offIdle>>20, offAfter>>20)
		fmt.Fprintf(os.Stderr, "free page reporting (default)      %5d  %5d\n", onIdle>>20, onAfter>>20)
		b.ReportMetric(float64(onAfter>>20), "MiB-with-balloon")
		b.ReportMetric(float64(offAfter>>20), "MiB-without")
	}
}
