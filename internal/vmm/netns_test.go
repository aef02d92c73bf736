package vmm

import (
	"os"
	"os/exec"
	"sort"
	"testing"
	"time"
)

// BenchmarkStartInNetNS measures what starting a process inside a network
// namespace (as every QEMU is) adds to a plain start, in the same run:
// `go test -bench StartInNetNS ./internal/vmm` (root).
func BenchmarkStartInNetNS(b *testing.B) {
	if os.Geteuid() != 0 {
		b.Skip("needs root to make a network namespace")
	}
	const ns = "aevmmbench"
	exec.Command("ip", "netns", "del", ns).Run()
	if out, err := exec.Command("ip", "netns", "add", ns).CombinedOutput(); err != nil {
		b.Fatalf("%v %s", err, out)
	}
	defer exec.Command("ip", "netns", "del", ns).Run()
	run := func(path string) time.Duration {
		cmd := exec.Command("/bin/true")
		start := time.Now()
		if err := startIn(path, false, cmd); err != nil {
			b.Fatal(err)
		}
		took := time.Since(start)
		cmd.Wait()
		return took
	}
	var plain, inNS []time.Duration
	for i := 0; i < b.N; i++ {
		plain = append(plain, run(""))
		inNS = append(inNS, run("/run/netns/"+ns))
	}
	report := func(name string, ds []time.Duration) {
		sort.Slice(ds, func(i, j int) bool { return ds[i] < ds[j] })
		b.Logf("%-22s n=%d p50 %v p90 %v", name, len(ds), ds[len(ds)/2], ds[len(ds)*9/10])
	}
	report("baseline: plain start", plain)
	report("start in a netns", inNS)
}
