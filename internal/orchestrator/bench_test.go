package orchestrator

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/agentenv/agentenv/internal/procstat"
	"github.com/agentenv/agentenv/internal/sandboxes"
	"github.com/agentenv/agentenv/internal/vmm"
	"github.com/agentenv/agentenv/internal/warmpool"
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
			var phases phaseSeries
			for i := 0; i < b.N; i++ {
				start := time.Now()
				s, err := n.Create(context.Background(), CreateRequest{TemplateID: tmpl, Secure: true})
				if err != nil {
					b.Fatal(err)
				}
				ds = append(ds, time.Since(start))
				phases.add(s.Phases)
				b.StopTimer()
				if err := n.Kill(context.Background(), s.ID); err != nil {
					b.Fatal(err)
				}
				b.StartTimer()
			}
			reportPercentiles(b, ds)
			if os.Getenv("AENV_BENCH_PHASES") != "" {
				phases.print(tmpl + " phase ")
			}
		})
	}
}

// phaseSeries collects the phases of many operations (Sandbox.Phases),
// by name, in the order they first came.
type phaseSeries struct {
	order []string
	ds    map[string][]time.Duration
}

func (ps *phaseSeries) add(phases []sandboxes.Phase) {
	if ps.ds == nil {
		ps.ds = map[string][]time.Duration{}
	}
	for _, p := range phases {
		if _, ok := ps.ds[p.Name]; !ok {
			ps.order = append(ps.order, p.Name)
		}
		ps.ds[p.Name] = append(ps.ds[p.Name], p.Duration)
	}
}

// print writes each phase's p50 and p90 to stderr, a line each after prefix.
func (ps *phaseSeries) print(prefix string) {
	for _, name := range ps.order {
		ds := ps.ds[name]
		fmt.Fprintf(os.Stderr, "%s%-20s p50 %8s p90 %8s\n", prefix, name,
			percentile(ds, 50).Round(10*time.Microsecond), percentile(ds, 90).Round(10*time.Microsecond))
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
// accepted /init (so the sandbox answers requests), first with a RAM file of
// its own, then with copy-on-write RAM over a snapshot's image (pause writes
// the changed pages), and last without memory (the pause syncs the guest's
// disks, the resume boots it again). Each resume with memory is measured
// in both tiers, never mixed: cold (a new QEMU loads the state from disk)
// and hot (the pause's QEMU, kept stopped, continues). Baseline in the same
// run: the bare QMP stop/cont round trip on the running machine.
func BenchmarkPauseResume(b *testing.B) {
	n := testNode(b)
	ctx := context.Background()
	s, err := n.Create(ctx, CreateRequest{TemplateID: "base", Secure: true})
	if err != nil {
		b.Fatal(err)
	}
	type series struct {
		name   string
		ds     []time.Duration
		phases phaseSeries // of the resumes: where their time went
	}
	var all []*series
	// hot: the pause keeps its QEMU stopped and the resume continues it;
	// otherwise the hot copy is dropped and the resume is a cold one.
	cycle := func(kind string, hot bool) *series {
		tier := "-cold"
		if hot {
			tier = "-hot"
		}
		stopCont, pause, resume := &series{name: "baseline-stop-cont"}, &series{name: "pause" + kind}, &series{name: "resume" + tier + kind}
		all = append(all, stopCont, pause, resume)
		for i := 0; i < b.N; i++ {
			m := n.machines.get(s.ID)
			t0 := time.Now()
			if err := m.Pause(ctx); err != nil {
				b.Fatal(err)
			}
			if err := m.Resume(ctx); err != nil {
				b.Fatal(err)
			}
			stopCont.ds = append(stopCont.ds, time.Since(t0))
			t0 = time.Now()
			if _, err := n.Pause(ctx, s.ID); err != nil {
				b.Fatal(err)
			}
			pause.ds = append(pause.ds, time.Since(t0))
			if !hot {
				n.dropHot(s.ID)
			} else if !n.hot.has(s.ID) {
				b.Fatal("the pause kept no hot copy")
			}
			t0 = time.Now()
			r, err := n.Resume(ctx, s.ID, time.Hour)
			if err != nil {
				b.Fatal(err)
			}
			resume.ds = append(resume.ds, time.Since(t0))
			resume.phases.add(r.Phases)
		}
		return resume
	}
	// A sandbox with a RAM file of its own (cold-booted or from a template
	// snapshot), then the same sandbox once a snapshot has turned its RAM
	// into a copy-on-write mapping of the snapshot's image.
	resume := cycle("", false)
	cycle("", true)
	if _, err := n.Snapshot(ctx, s.ID, "bench-cow"); err != nil {
		b.Fatal(err)
	}
	cycle("-copy-on-write", false)
	cycle("-copy-on-write", true)
	// Without memory: the pause syncs the guest's disks and keeps no RAM,
	// the resume boots the guest again on its disk.
	fsPause, reboot := &series{name: "pause-filesystem"}, &series{name: "resume-boot"}
	all = append(all, fsPause, reboot)
	for i := 0; i < b.N; i++ {
		t0 := time.Now()
		if _, err := n.PauseFilesystem(ctx, s.ID); err != nil {
			b.Fatal(err)
		}
		fsPause.ds = append(fsPause.ds, time.Since(t0))
		t0 = time.Now()
		if _, err := n.Resume(ctx, s.ID, time.Hour); err != nil {
			b.Fatal(err)
		}
		reboot.ds = append(reboot.ds, time.Since(t0))
	}
	for _, sr := range all {
		fmt.Fprintf(os.Stderr, "%-28s n=%d p50 %8s p90 %8s\n", sr.name, len(sr.ds),
			percentile(sr.ds, 50).Round(10*time.Microsecond), percentile(sr.ds, 90).Round(10*time.Microsecond))
		sr.phases.print("    phase ")
	}
	reportPercentiles(b, resume.ds)
}

// BenchmarkFork forks a running `base` sandbox (which has a process running)
// into 1 and into 16 children, b.N times each, timing until every child's
// envd has accepted /init, and prints the RSS of the parent alone against
// the parent plus 16 idle children (file-backed pages are the page cache
// shared with the frozen RAM image). Each count runs fresh (the baseline)
// and with machines pre-started by the fork pool, and the 16-way fork also
// with its restores bounded; the phases of the children's restores are
// printed with each.
func BenchmarkFork(b *testing.B) {
	n := testNode(b, func(c *Config) { c.ForkPoolSize = MaxForkChildren })
	ctx := context.Background()
	parent, err := n.Create(ctx, CreateRequest{TemplateID: "base", Secure: true, Timeout: time.Hour})
	if err != nil {
		b.Fatal(err)
	}
	// Something running and some memory touched, as a prepared RL sandbox would have.
	if _, err := newEnvdClient(parent).run(ctx, "", "bash", "-c", "nohup python3 -c 'import time; x=bytearray(64<<20); time.sleep(1e6)' >/dev/null 2>&1 &"); err != nil {
		b.Fatal(err)
	}
	time.Sleep(2 * time.Second)
	parentRSS := rss(parent.PID)
	// The first fork gives the parent its memory base; the later ones,
	// measured, are incremental against it. children-N (no machines
	// pre-started) is the baseline of children-N-prestarted.
	if _, err := n.Fork(ctx, parent.ID, 1, time.Hour); err != nil {
		b.Fatal(err)
	}
	for _, mode := range []struct {
		count      int
		prestarted int // machines the fork pool keeps
		restores   int // children restoring at once (0: all)
	}{{1, 0, 0}, {1, 16, 0}, {16, 0, 0}, {16, 16, 0}, {16, 0, 2}, {16, 16, 2}, {16, 0, 4}, {16, 4, 4}, {16, 16, 4}} {
		name := fmt.Sprintf("children-%d", mode.count)
		if mode.prestarted > 0 {
			name += fmt.Sprintf("-prestarted-%d", mode.prestarted)
		}
		if mode.restores > 0 {
			name += fmt.Sprintf("-%d-at-a-time", mode.restores)
		}
		count := mode.count
		n.cfg.ForkRestores = mode.restores
		b.Run(name, func(b *testing.B) {
			var ds []time.Duration
			var split []cpuSplit
			phases := map[string][]time.Duration{}
			key := usePrestarted(b, n, parent.ID, mode.prestarted)
			for i := 0; i < b.N; i++ {
				if mode.prestarted > 0 {
					b.StopTimer()
					waitForkPool(b, n, key, i == 0)
					b.StartTimer()
				}
				// A fork may give the parent a new QEMU (the first fork of a
				// sandbox does): the one it ends is reaped, so its CPU is
				// counted with the tools', and the new one's whole.
				parentPID := func() int { p, _ := n.Get(ctx, parent.ID); return p.PID }
				pidBefore := parentPID()
				before, parentCPU := ourCPU(), qemuCPU(pidBefore)
				start := time.Now()
				res, err := n.Fork(ctx, parent.ID, count, time.Hour)
				if err != nil {
					b.Fatal(err)
				}
				ds = append(ds, time.Since(start))
				b.StopTimer()
				after := ourCPU()
				cs := cpuSplit{node: after.node - before.node, tools: after.tools - before.tools}
				if pid := parentPID(); pid == pidBefore {
					cs.qemu = qemuCPU(pid) - parentCPU
				} else {
					cs.qemu = qemuCPU(pid)
				}
				for _, r := range res {
					if r.Err == nil {
						cs.qemu += qemuCPU(r.Sandbox.PID)
					}
				}
				split = append(split, cs)
				if count == 16 && i == b.N-1 {
					time.Sleep(2 * time.Second) // let the children settle
					p, _ := n.Get(ctx, parent.ID)
					total := rss(p.PID)
					for _, r := range res {
						if r.Err == nil {
							total = total.add(rss(r.Sandbox.PID))
						}
					}
					fmt.Fprintf(os.Stderr, "parent before fork: %s\nparent+16 children: %s\nhost memory of parent+16 children (sum of PSS) = %.2fx the parent's RSS\n",
						parentRSS, total, float64(total.pssKB)/float64(parentRSS.total()))
				}
				for j, r := range res {
					if r.Err != nil {
						b.Fatalf("child %d: %v", j, r.Err)
					}
					for _, ph := range r.Sandbox.Phases {
						phases[ph.Name] = append(phases[ph.Name], ph.Duration)
					}
					n.Kill(ctx, r.Sandbox.ID)
				}
				b.StartTimer()
			}
			fmt.Fprintf(os.Stderr, "%s: n=%d p50 %s p90 %s\n", name, len(ds),
				percentile(ds, 50).Round(time.Millisecond), percentile(ds, 90).Round(time.Millisecond))
			fmt.Fprintf(os.Stderr, "%s, CPU seconds until every child answered /init (median of %d): %s\n",
				name, len(split), medianSplit(split))
			printPhases(name, phases)
			reportPercentiles(b, ds)
		})
	}
}

// usePrestarted makes the fork pool keep size machines for the forks of
// the sandbox id (0: none); it returns the pool's key.
func usePrestarted(b *testing.B, n *Node, id string, size int) warmpool.Key {
	b.Helper()
	ctx := context.Background()
	p, err := n.records.Get(ctx, id)
	if err != nil {
		b.Fatal(err)
	}
	key := forkPoolKey(p.TemplateID, n.memoryBaseOf(p))
	n.forkPool.SetSize(size)
	n.forkPool.DrainStale(ctx, func(warmpool.Key) bool { return false })
	if size == 0 {
		return key
	}
	n.registerFork(ctx, p)
	return key
}

// waitForkPool waits until the fork pool under key is full (it refills
// after each fork; a fork timed beside a refill would share the cores with
// it); the first time it prints what the waiting machines hold of the
// host's memory.
func waitForkPool(b *testing.B, n *Node, key warmpool.Key, report bool) {
	b.Helper()
	deadline := time.Now().Add(3 * time.Minute)
	start := time.Now()
	count := n.forkPool.Size()
	for n.forkPool.Len(key) < count {
		if time.Now().After(deadline) {
			b.Fatalf("the fork pool holds %d machines after 3 minutes, want %d", n.forkPool.Len(key), count)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if report {
		var total rssInfo
		for _, e := range n.forkPool.Entries(key) {
			total = total.add(rss(e.s.PID))
		}
		fmt.Fprintf(os.Stderr, "%d pre-started fork machines (filled in %s): %s\n", count, time.Since(start).Round(time.Millisecond), total)
	}
}

// printPhases prints the median and p90 of each phase of the children's
// restores.
func printPhases(name string, phases map[string][]time.Duration) {
	names := make([]string, 0, len(phases))
	for k := range phases {
		names = append(names, k)
	}
	sort.Strings(names)
	for _, k := range names {
		fmt.Fprintf(os.Stderr, "%s child phase %-30q n=%d p50 %s p90 %s\n", name, k, len(phases[k]),
			percentile(phases[k], 50).Round(10*time.Microsecond), percentile(phases[k], 90).Round(10*time.Microsecond))
	}
}

// BenchmarkForkFirstCalls forks a prepared `base` sandbox into 16 and makes
// each child's first three calls at once, as an RL trainer's SDK does (a
// command, a file written, the file read back): it reports the fork until
// every child answered its /init, each child's three calls, and the fork
// with the slowest child's calls. Baseline, same run: the same three calls
// on the parent. It runs with fresh children and with children taking
// machines pre-started by the fork pool (refilled while the children make
// their calls).
func BenchmarkForkFirstCalls(b *testing.B) {
	n := testNode(b, func(c *Config) { c.ForkPoolSize = MaxForkChildren })
	ctx := context.Background()
	parent, err := n.Create(ctx, CreateRequest{TemplateID: "base", Secure: true, Timeout: time.Hour})
	if err != nil {
		b.Fatal(err)
	}
	if _, err := newEnvdClient(parent).run(ctx, "", "bash", "-c", "nohup python3 -c 'import time; x=bytearray(64<<20); time.sleep(1e6)' >/dev/null 2>&1 &"); err != nil {
		b.Fatal(err)
	}
	time.Sleep(2 * time.Second)
	threeCalls := func(c *envdClient, name string) (time.Duration, error) {
		t0 := time.Now()
		if r, err := c.run(ctx, "", "echo", name); err != nil || r.exit != 0 {
			return 0, fmt.Errorf("command: %+v %v", r, err)
		}
		content := []byte("episode " + name)
		if err := c.upload(ctx, "/tmp/"+name, content); err != nil {
			return 0, err
		}
		got, err := c.download(ctx, "/tmp/"+name)
		if err != nil || !bytes.Equal(got, content) {
			return 0, fmt.Errorf("read back %q: %v", got, err)
		}
		return time.Since(t0), nil
	}
	const children = 16
	// The first fork gives the parent its memory base; the measured ones
	// are incremental against it, with no machines pre-started (the
	// baseline) and with them (the pool refills while the children run).
	if _, err := n.Fork(ctx, parent.ID, 1, time.Hour); err != nil {
		b.Fatal(err)
	}
	for _, mode := range []struct {
		name string
		pool int // machines the fork pool keeps
	}{{"fresh", 0}, {"prestarted", MaxForkChildren}} {
		name, prestarted := mode.name, mode.pool > 0
		b.Run(name, func(b *testing.B) {
			key := usePrestarted(b, n, parent.ID, mode.pool)
			var baseline, forks, calls, total []time.Duration
			for i := 0; i < b.N; i++ {
				b.StopTimer()
				if prestarted {
					waitForkPool(b, n, key, i == 0)
				}
				d, err := threeCalls(newEnvdClient(parent), fmt.Sprintf("parent-%d", i))
				if err != nil {
					p, gerr := n.records.Get(ctx, parent.ID)
					console, _ := n.ConsoleLog(ctx, parent.ID, 4096)
					b.Fatalf("the parent's calls: %v\nits record: %+v %v\nthe end of its console:\n%s", err, p, gerr, console)
				}
				baseline = append(baseline, d)
				b.StartTimer()
				start := time.Now()
				res, err := n.Fork(ctx, parent.ID, children, time.Hour)
				if err != nil {
					b.Fatal(err)
				}
				forks = append(forks, time.Since(start))
				each := make([]time.Duration, len(res))
				errs := make([]error, len(res))
				var wg sync.WaitGroup
				for j, r := range res {
					if r.Err != nil {
						b.Fatalf("child %d: %v", j, r.Err)
					}
					wg.Add(1)
					go func() {
						defer wg.Done()
						each[j], errs[j] = threeCalls(newEnvdClient(r.Sandbox), fmt.Sprintf("child-%d", j))
					}()
				}
				wg.Wait()
				total = append(total, time.Since(start))
				for j, err := range errs {
					if err != nil {
						b.Fatalf("child %d: %v", j, err)
					}
				}
				calls = append(calls, each...)
				b.StopTimer()
				for _, r := range res {
					n.Kill(ctx, r.Sandbox.ID)
				}
				b.StartTimer()
			}
			fmt.Fprintf(os.Stderr, "[%s] baseline: three calls on the parent  n=%d p50 %s p90 %s\n[%s] fork %d until each child answered /init n=%d p50 %s p90 %s\n[%s] each child's first three calls          n=%d p50 %s p90 %s max %s\n[%s] fork and every child's three calls     n=%d p50 %s p90 %s\n",
				name, len(baseline), percentile(baseline, 50).Round(time.Millisecond), percentile(baseline, 90).Round(time.Millisecond),
				name, children, len(forks), percentile(forks, 50).Round(time.Millisecond), percentile(forks, 90).Round(time.Millisecond),
				name, len(calls), percentile(calls, 50).Round(time.Millisecond), percentile(calls, 90).Round(time.Millisecond), percentile(calls, 100).Round(time.Millisecond),
				name, len(total), percentile(total, 50).Round(time.Millisecond), percentile(total, 90).Round(time.Millisecond))
			reportPercentiles(b, total)
		})
	}
}

// cpuSplit is where the CPU time of one operation went: this process (the
// node's own work, and the benchmark's), the tools it ran and waited for
// (qemu-img, ip, ...), and the QEMU processes of the sandboxes involved.
type cpuSplit struct{ node, tools, qemu time.Duration }

// ourCPU is this process's CPU time (node) and that of the children it has
// waited for (tools).
func ourCPU() cpuSplit {
	var self, children syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &self)
	_ = syscall.Getrusage(syscall.RUSAGE_CHILDREN, &children)
	used := func(u syscall.Rusage) time.Duration { return time.Duration(u.Utime.Nano() + u.Stime.Nano()) }
	return cpuSplit{node: used(self), tools: used(children)}
}

// qemuCPU is the CPU time process pid has used (0 if it cannot be read).
func qemuCPU(pid int) time.Duration {
	sec, _ := procstat.CPUSeconds(pid)
	return time.Duration(sec * float64(time.Second))
}

// medianSplit is the median of each part of splits, as a line.
func medianSplit(splits []cpuSplit) string {
	var node, tools, qemu []time.Duration
	for _, s := range splits {
		node, tools, qemu = append(node, s.node), append(tools, s.tools), append(qemu, s.qemu)
	}
	return fmt.Sprintf("node %.2f, tools %.2f, QEMU %.2f",
		percentile(node, 50).Seconds(), percentile(tools, 50).Seconds(), percentile(qemu, 50).Seconds())
}

// rssInfo is a process's memory: RSS split into anonymous and file pages,
// and PSS, which divides each shared page among the processes mapping it
// (so PSS sums to the host memory a group of processes really uses).
type rssInfo struct{ anonKB, fileKB, pssKB int64 }

func (r rssInfo) total() int64 { return r.anonKB + r.fileKB }
func (r rssInfo) add(o rssInfo) rssInfo {
	return rssInfo{r.anonKB + o.anonKB, r.fileKB + o.fileKB, r.pssKB + o.pssKB}
}
func (r rssInfo) String() string {
	return fmt.Sprintf("RSS %d MiB (anon %d MiB, file %d MiB), PSS %d MiB", r.total()>>10, r.anonKB>>10, r.fileKB>>10, r.pssKB>>10)
}

func rss(pid int) rssInfo {
	m, _ := procstat.ReadMemory(pid)
	return rssInfo{anonKB: m.AnonBytes >> 10, fileKB: (m.RSSBytes - m.AnonBytes) >> 10, pssKB: m.PSSBytes >> 10}
}

// BenchmarkCreateFromSnapshot creates `base` sandboxes by restoring the
// template snapshot (the default path of POST /sandboxes), reporting p50/p90
// until envd has accepted /init. Baseline, same run: a cold boot of the same
// template.
func BenchmarkCreateFromSnapshot(b *testing.B) {
	n := testNode(b)
	ctx := context.Background()
	if err := n.PrepareTemplateSnapshot(ctx, "base"); err != nil {
		b.Fatal(err)
	}
	cold, err := n.Create(ctx, CreateRequest{TemplateID: "base", noSnapshot: true})
	if err != nil {
		b.Fatal(err)
	}
	var coldTook time.Duration
	for _, p := range cold.Phases {
		coldTook += p.Duration
	}
	n.Kill(ctx, cold.ID)
	var ds []time.Duration
	for i := 0; i < b.N; i++ {
		start := time.Now()
		s, err := n.Create(ctx, CreateRequest{TemplateID: "base", Secure: true})
		if err != nil {
			b.Fatal(err)
		}
		ds = append(ds, time.Since(start))
		b.StopTimer()
		n.Kill(ctx, s.ID)
		b.StartTimer()
	}
	// The same with a pre-started sandbox waiting for every create.
	tmpl, _ := n.Template("base")
	snap, err := n.currentTemplateSnapshot(tmpl)
	if err != nil {
		b.Fatal(err)
	}
	n.pool.SetSize(1)
	var pooled []time.Duration
	for i := 0; i < b.N; i++ {
		b.StopTimer()
		n.pool.Fill(ctx, poolKey(tmpl, snap))
		b.StartTimer()
		start := time.Now()
		s, err := n.Create(ctx, CreateRequest{TemplateID: "base", Secure: true})
		if err != nil {
			b.Fatal(err)
		}
		pooled = append(pooled, time.Since(start))
		b.StopTimer()
		n.Kill(ctx, s.ID)
		b.StartTimer()
	}
	fmt.Fprintf(os.Stderr, "baseline cold boot: %s\ncreate from template snapshot: n=%d p50 %s p90 %s\ncreate from a pre-started pooled sandbox: n=%d p50 %s p90 %s\n",
		coldTook.Round(time.Millisecond), len(ds), percentile(ds, 50).Round(time.Millisecond), percentile(ds, 90).Round(time.Millisecond),
		len(pooled), percentile(pooled, 50).Round(time.Millisecond), percentile(pooled, 90).Round(time.Millisecond))
	reportPercentiles(b, pooled)
}

// BenchmarkSnapshotUnderWrites takes named snapshots of a `base` sandbox
// while a process in it rewrites 128 MiB of memory and a file on disk in a
// loop, and reports p50/p90 of the whole capture and of the time the guest
// was stopped, the disk sealed (what the node does); baselines, same run:
// the same snapshot with the disk copied (the one before sealing), with
// the migration filter too, and a pause of the same sandbox under the same
// load.
func BenchmarkSnapshotUnderWrites(b *testing.B) {
	n := testNode(b)
	ctx := context.Background()
	s, err := n.Create(ctx, CreateRequest{TemplateID: "base"})
	if err != nil {
		b.Fatal(err)
	}
	load := `nohup python3 -c '
import os
buf = bytearray(128 << 20)
i = 0
while True:
    for off in range(0, len(buf), 4096):
        buf[off] = i & 255
    with open("/tmp/churn", "wb") as f:
        f.write(os.urandom(4 << 20))
    i += 1
' >/dev/null 2>&1 &`
	if _, err := newEnvdClient(s).run(ctx, "", "bash", "-c", load); err != nil {
		b.Fatal(err)
	}
	time.Sleep(3 * time.Second)
	// Each round: a pause and resume (the baseline of earlier sessions),
	// then a snapshot each way: the changed RAM found by the migration
	// filter or from the private pages, the disk's overlay copied or
	// sealed (the last is what the node does on QEMUs that can). The
	// baseline of the seal is the copy with the private pages, in the
	// same round.
	type variant struct {
		name    string
		capture vmm.DiffCapture
		copy    bool
	}
	variants := []variant{
		{"migration filter, disk copied", vmm.CaptureMigration, true},
		{"private pages, disk copied", vmm.CapturePrivatePages, true},
		{"private pages, disk sealed", vmm.CapturePrivatePages, false},
	}
	// The first snapshot restarts the sandbox on its RAM image; the later
	// ones are live.
	if _, err := n.Snapshot(ctx, s.ID, "bench-warm"); err != nil {
		b.Fatal(err)
	}
	if err := n.DeleteSnapshot(ctx, "bench-warm"); err != nil {
		b.Fatal(err)
	}
	var pauses []time.Duration
	snaps := map[string][]time.Duration{}
	stopped := map[string][]time.Duration{}
	for i := 0; i < b.N; i++ {
		b.StopTimer()
		n.cfg.DiffCapture, n.cfg.CopyDisk = "", false
		t0 := time.Now()
		if _, err := n.Pause(ctx, s.ID); err != nil {
			b.Fatal(err)
		}
		pauses = append(pauses, time.Since(t0))
		if _, err := n.Resume(ctx, s.ID, time.Hour); err != nil {
			b.Fatal(err)
		}
		for k, v := range variants {
			n.cfg.DiffCapture, n.cfg.CopyDisk = v.capture, v.copy
			time.Sleep(500 * time.Millisecond) // let the load dirty memory again
			name := fmt.Sprintf("bench-%d-%d", i, k)
			if k == len(variants)-1 {
				b.StartTimer()
			}
			t0 = time.Now()
			ns, err := n.Snapshot(ctx, s.ID, name)
			if err != nil {
				b.Fatalf("%s: %v", v.name, err)
			}
			snaps[v.name] = append(snaps[v.name], time.Since(t0))
			stopped[v.name] = append(stopped[v.name], ns.GuestStopped)
			b.StopTimer()
			if err := n.DeleteSnapshot(ctx, name); err != nil {
				b.Fatal(err)
			}
		}
		b.StartTimer()
	}
	n.cfg.DiffCapture, n.cfg.CopyDisk = "", false
	fmt.Fprintf(os.Stderr, "baseline pause under writes: n=%d p50 %s p90 %s\n",
		len(pauses), percentile(pauses, 50).Round(time.Millisecond), percentile(pauses, 90).Round(time.Millisecond))
	for _, v := range variants {
		fmt.Fprintf(os.Stderr, "snapshot under writes (%s), until durable: n=%d p50 %s p90 %s\n  of which the guest was stopped:      n=%d p50 %s p90 %s\n", v.name,
			len(snaps[v.name]), percentile(snaps[v.name], 50).Round(time.Millisecond), percentile(snaps[v.name], 90).Round(time.Millisecond),
			len(stopped[v.name]), percentile(stopped[v.name], 50).Round(time.Millisecond), percentile(stopped[v.name], 90).Round(time.Millisecond))
	}
	sealed, copied := variants[2].name, variants[1].name
	b.ReportMetric(float64(percentile(stopped[sealed], 50).Microseconds())/1000, "stopped-p50-ms")
	b.ReportMetric(float64(percentile(stopped[sealed], 90).Microseconds())/1000, "stopped-p90-ms")
	b.ReportMetric(float64(percentile(stopped[copied], 50).Microseconds())/1000, "baseline-stopped-p50-ms")
	b.ReportMetric(float64(percentile(stopped[copied], 90).Microseconds())/1000, "baseline-stopped-p90-ms")
	reportPercentiles(b, snaps[sealed])
}
