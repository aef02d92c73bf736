package orchestrator

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/agentenv/agentenv/internal/storage"
)

// BenchmarkSealOverlay measures, on a real copy-on-write sandbox, the
// mechanism P12 asks for in place of the overlay copy of a live snapshot:
// with the vCPUs stopped, the root disk's overlay is sealed (QEMU switches
// to a new, empty overlay on top of it with blockdev-snapshot-sync, mode
// existing, so the backing name is the one we wrote) and the state is
// saved as a live snapshot saves it; then the guest runs on and writes to
// its disk. Each round repeats it on the sandbox's QEMU, so round 2 and
// later are the "next migration after blockdev-snapshot-sync" that
// livesnapshot.go says QEMU 7.2 fails. The baseline, in the same run, is
// the overlay copy a live snapshot makes today (storage.CloneFile of the
// overlay). Pick the QEMU with AENV_QEMU.
func BenchmarkSealOverlay(b *testing.B) {
	n := testNode(b)
	ctx := context.Background()
	s, err := n.Create(ctx, CreateRequest{TemplateID: "base"})
	if err != nil {
		b.Fatal(err)
	}
	defer n.Kill(context.Background(), s.ID)
	// The first snapshot freezes the RAM file; the sandbox then runs
	// copy-on-write on it, as every later live snapshot finds it.
	if _, err := n.Snapshot(ctx, s.ID, "seal-bench"); err != nil {
		b.Fatal(err)
	}
	defer n.DeleteSnapshot(context.Background(), "seal-bench")
	if s, err = n.Get(ctx, s.ID); err != nil {
		b.Fatal(err)
	}
	if !n.canSnapshotLive(s) {
		b.Fatal("the sandbox does not run copy-on-write after its first snapshot")
	}
	m := n.machines.get(s.ID)
	uid, gid := m.Owner()
	top := filepath.Join(n.sandboxDir(s.ID), overlayName)
	sealDir, err := os.MkdirTemp("", "aenv-seal-")
	if err != nil {
		b.Fatal(err)
	}
	defer os.RemoveAll(sealDir)
	if err := os.Chown(sealDir, uid, gid); err != nil {
		b.Fatal(err)
	}
	guest := newEnvdClient(s)
	write := func(i int) {
		b.Helper()
		r, err := guest.run(ctx, "", "bash", "-c", fmt.Sprintf("dd if=/dev/urandom of=/home/user/seal-%d bs=1M count=8 status=none && sync && md5sum /home/user/seal-%d", i, i))
		if err != nil || r.exit != 0 {
			b.Fatalf("guest write after round %d: %v %+v", i, err, r)
		}
	}
	write(0)
	var seals, copies, saves []time.Duration
	for i := 0; i < b.N; i++ {
		// The baseline: what the live snapshot does with the overlay.
		if err := m.Pause(ctx); err != nil {
			b.Fatal(err)
		}
		t0 := time.Now()
		if _, err := storage.CloneFile(top, filepath.Join(b.TempDir(), "overlay-copy.qcow2")); err != nil {
			b.Fatal(err)
		}
		copies = append(copies, time.Since(t0))
		// The seal: a new overlay over the current top, made by us with
		// the top's real path as its backing name.
		// In a directory of QEMU's user, which QEMU (no longer root) can
		// open by name; the sandbox directory is root's. (The product
		// would pass the new overlay as a descriptor, QMP add-fd.)
		next := filepath.Join(sealDir, "seal-"+strconv.Itoa(i)+".qcow2")
		if out, err := exec.Command("qemu-img", "create", "-q", "-f", "qcow2", "-b", top, "-F", "qcow2", next).CombinedOutput(); err != nil {
			b.Fatalf("%v: %s", err, out)
		}
		if err := os.Chown(next, uid, gid); err != nil {
			b.Fatal(err)
		}
		t0 = time.Now()
		if _, err := m.QMP().Execute(ctx, "blockdev-snapshot-sync", map[string]any{
			"device": "root", "snapshot-file": next, "format": "qcow2", "mode": "existing"}); err != nil {
			b.Fatalf("round %d: seal: %v", i, err)
		}
		seals = append(seals, time.Since(t0))
		t0 = time.Now()
		if _, err := m.SaveStateDiff(ctx, filepath.Join(b.TempDir(), "state"), s.MemFile); err != nil {
			b.Fatalf("round %d: the migration after the seal: %v", i, err)
		}
		saves = append(saves, time.Since(t0))
		if err := m.Resume(ctx); err != nil {
			b.Fatalf("round %d: cont after the seal: %v", i, err)
		}
		top = next
		write(i + 1)
	}
	// The chain QEMU now runs on, as qemu-img reads it from the files.
	out, err := exec.Command("qemu-img", "info", "--backing-chain", "-U", top).CombinedOutput()
	if err != nil {
		b.Fatalf("%v: %s", err, out)
	}
	if depth := strings.Count(string(out), "image: "); depth < b.N+1 {
		b.Fatalf("backing chain of %d images after %d seals:\n%s", depth, b.N, out)
	}
	// Every image of the chain is consistent (read beside the running
	// QEMU, with its writes flushed by a stop).
	if err := m.Pause(ctx); err != nil {
		b.Fatal(err)
	}
	for p := top; p != ""; {
		if out, err := exec.Command("qemu-img", "check", "-q", "-U", p).CombinedOutput(); err != nil {
			b.Fatalf("qemu-img check %s: %v: %s", p, err, out)
		}
		info, err := storage.Info(ctx, p)
		if err != nil {
			b.Fatal(err)
		}
		p = info.BackingFilename
		if strings.Contains(p, "/layers/") || strings.Contains(p, "/snapshots/") {
			break // the shared stores below the sandbox's own overlay
		}
	}
	if err := m.Resume(ctx); err != nil {
		b.Fatal(err)
	}
	fmt.Fprintf(os.Stderr, "overlay copy (baseline): n=%d p50 %s p90 %s\nseal (blockdev-snapshot-sync): n=%d p50 %s p90 %s\nstate save after the seal:  n=%d p50 %s p90 %s\n",
		len(copies), percentile(copies, 50).Round(time.Microsecond), percentile(copies, 90).Round(time.Microsecond),
		len(seals), percentile(seals, 50).Round(time.Microsecond), percentile(seals, 90).Round(time.Microsecond),
		len(saves), percentile(saves, 50).Round(time.Millisecond), percentile(saves, 90).Round(time.Millisecond))
	b.ReportMetric(float64(percentile(copies, 50).Microseconds())/1000, "copy-p50-ms")
	b.ReportMetric(float64(percentile(seals, 50).Microseconds())/1000, "seal-p50-ms")
	b.ReportMetric(0, "ns/op")
}
