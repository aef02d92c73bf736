package e2e

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// TestBoundedLoad: a fixed amount of concurrent work on loopback (workers
// creating, using and killing sandboxes; many concurrent process streams
// through the proxy), with throughput, p50/p99 and errors reported, and the
// server back where it started afterwards: goroutines, open files, QEMU
// processes, sandbox directories.
func TestBoundedLoad(t *testing.T) {
	if os.Getenv("AENV_LOAD_WORKERS") == "" && testing.Short() {
		t.Skip("skipped in -short mode")
	}
	s := needServer(t)
	workers, rounds := 4, 3
	if v, err := strconv.Atoi(os.Getenv("AENV_LOAD_WORKERS")); err == nil && v > 0 {
		workers = v
	}
	// A warm-up create, then the baseline once the server is idle (its
	// template snapshots made, its pools of pre-started sandboxes full).
	warm := s.createSandbox(t, map[string]any{"templateID": "minimal"})
	s.rest(context.Background(), "DELETE", "/sandboxes/"+warm.SandboxID, nil, nil)
	before := settled(t, s)
	qemuBefore := qemuProcesses(s.dataDir)
	dirsBefore := sandboxDirs(s.dataDir)

	type sample struct {
		op string
		d  time.Duration
	}
	var mu sync.Mutex
	var samples []sample
	errs := map[string]int{}
	record := func(op string, start time.Time, err error) bool {
		mu.Lock()
		defer mu.Unlock()
		if err != nil {
			errs[op]++
			t.Logf("%s: %v", op, err)
			return false
		}
		samples = append(samples, sample{op, time.Since(start)})
		return true
	}
	began := time.Now()
	var wg sync.WaitGroup
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for r := 0; r < rounds; r++ {
				ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
				var sb sandbox
				st := time.Now()
				if !record("create", st, s.rest(ctx, "POST", "/sandboxes", map[string]any{"templateID": "minimal", "timeout": 300}, &sb)) {
					cancel()
					continue
				}
				st = time.Now()
				out, code, err := s.runQuiet(ctx, &sb, "/bin/sh", "-c", "echo $((6*7))")
				if err == nil && (code != 0 || out != "42\n") {
					err = fmt.Errorf("exec: %q exit %d", out, code)
				}
				record("exec", st, err)
				st = time.Now()
				record("kill", st, s.rest(ctx, "DELETE", "/sandboxes/"+sb.SandboxID, nil, nil))
				cancel()
			}
		}()
	}
	wg.Wait()
	lifecycle := time.Since(began)

	// The proxy under many concurrent streams to one sandbox.
	sb := s.createSandbox(t, map[string]any{"templateID": "minimal"})
	streams := 32
	began = time.Now()
	for i := 0; i < streams; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			st := time.Now()
			out, code, err := s.runQuiet(ctx, sb, "/bin/sh", "-c", fmt.Sprintf("sleep 0.5; echo stream-%d", i))
			if err == nil && (code != 0 || out != fmt.Sprintf("stream-%d\n", i)) {
				err = fmt.Errorf("stream %d: %q exit %d", i, out, code)
			}
			record("stream", st, err)
		}(i)
	}
	wg.Wait()
	streamWall := time.Since(began)
	if err := s.rest(context.Background(), "DELETE", "/sandboxes/"+sb.SandboxID, nil, nil); err != nil {
		t.Fatal(err)
	}

	byOp := map[string][]time.Duration{}
	for _, sm := range samples {
		byOp[sm.op] = append(byOp[sm.op], sm.d)
	}
	for _, op := range []string{"create", "exec", "kill", "stream"} {
		ds := byOp[op]
		sort.Slice(ds, func(i, j int) bool { return ds[i] < ds[j] })
		if len(ds) == 0 {
			t.Errorf("%s: no successful operation", op)
			continue
		}
		q := func(p float64) time.Duration { return ds[min(len(ds)-1, int(p*float64(len(ds))))] }
		t.Logf("%-7s n=%-3d errors=%d p50=%s p99=%s", op, len(ds), errs[op], q(0.50).Round(time.Millisecond), q(0.99).Round(time.Millisecond))
	}
	t.Logf("%d workers x %d create+exec+kill: %s, %.2f sandboxes/s; %d concurrent streams through the proxy: %s",
		workers, rounds, lifecycle.Round(time.Millisecond), float64(workers*rounds)/lifecycle.Seconds(), streams, streamWall.Round(time.Millisecond))
	for op, n := range errs {
		if n > 0 {
			t.Errorf("%d %s errors", n, op)
		}
	}

	// Nothing leaked: the test's own idle connections closed (each holds
	// server goroutines), and the proxy's idle connections to the killed
	// guests timed out (15 s), the server is back where it started.
	http.DefaultClient.CloseIdleConnections()
	http1Client.CloseIdleConnections()
	var after map[string]float64
	for deadline := time.Now().Add(60 * time.Second); ; time.Sleep(time.Second) {
		after = settled(t, s)
		if after["go_goroutines"] <= before["go_goroutines"]+5 && after["process_open_fds"] <= before["process_open_fds"]+5 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("server leaked: goroutines %v -> %v, open files %v -> %v",
				before["go_goroutines"], after["go_goroutines"], before["process_open_fds"], after["process_open_fds"])
		}
	}
	if q := qemuProcesses(s.dataDir); q > qemuBefore {
		t.Fatalf("QEMU processes %d -> %d", qemuBefore, q)
	}
	if d := sandboxDirs(s.dataDir); d > dirsBefore {
		t.Fatalf("sandbox directories %d -> %d", dirsBefore, d)
	}
	t.Logf("after the load: goroutines %v -> %v, open files %v -> %v, QEMUs %d, sandbox dirs %d",
		before["go_goroutines"], after["go_goroutines"], before["process_open_fds"], after["process_open_fds"], qemuProcesses(s.dataDir), sandboxDirs(s.dataDir))
}

// settled waits until the server's gauges hold still for three seconds
// (background work done) and returns them.
func settled(t *testing.T, s *server) map[string]float64 {
	t.Helper()
	last, same := serverGauges(t, s), 0
	for deadline := time.Now().Add(2 * time.Minute); same < 3 && time.Now().Before(deadline); {
		time.Sleep(time.Second)
		g := serverGauges(t, s)
		if g["go_goroutines"] == last["go_goroutines"] && g["process_open_fds"] == last["process_open_fds"] {
			same++
		} else {
			same = 0
		}
		last = g
	}
	return last
}

// serverGauges reads the server's own gauges from /metrics.
func serverGauges(t *testing.T, s *server) map[string]float64 {
	t.Helper()
	req, _ := http.NewRequest("GET", s.url+"/metrics", nil)
	req.Header.Set("X-API-Key", apiKey)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	out := map[string]float64{}
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) == 2 && (f[0] == "go_goroutines" || f[0] == "process_open_fds") {
			out[f[0]], _ = strconv.ParseFloat(f[1], 64)
		}
	}
	io.Copy(io.Discard, resp.Body)
	if len(out) != 2 {
		t.Fatalf("metrics lack the process gauges: %v", out)
	}
	return out
}

// qemuProcesses counts the QEMUs of sandboxes in dataDir.
func qemuProcesses(dataDir string) int {
	n := 0
	procs, _ := filepath.Glob("/proc/[0-9]*/cmdline")
	for _, c := range procs {
		if b, err := os.ReadFile(c); err == nil && strings.Contains(string(b), "qemu") && strings.Contains(string(b), dataDir) {
			n++
		}
	}
	return n
}

func sandboxDirs(dataDir string) int {
	ents, _ := os.ReadDir(filepath.Join(dataDir, "sandboxes"))
	return len(ents)
}
