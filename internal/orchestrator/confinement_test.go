package orchestrator

import (
	"context"
	"os"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/agentenv/agentenv/internal/storage"
	"github.com/agentenv/agentenv/internal/vmm"
)

// TestQEMUConfinement: a sandbox's QEMU runs under its seccomp filter and in
// a cgroup of its own bounding its CPU time, memory and threads; the cgroup
// goes with the sandbox.
func TestQEMUConfinement(t *testing.T) {
	n := testNode(t)
	s := create(t, n, CreateRequest{TemplateID: "minimal"})
	status, err := os.ReadFile("/proc/" + strconv.Itoa(s.PID) + "/status")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(status), "Seccomp:\t2") {
		t.Fatalf("QEMU runs without its seccomp filter:\n%s", status)
	}
	if n.cfg.QEMUUser == "" {
		t.Logf("QEMU runs as root: user %s does not exist (aenv setup makes it)", DefaultQEMUUser)
	} else {
		u, _ := user.Lookup(n.cfg.QEMUUser)
		if !strings.Contains(string(status), "Uid:\t"+u.Uid+"\t"+u.Uid+"\t"+u.Uid) {
			t.Fatalf("QEMU does not run as %s (uid %s):\n%s", n.cfg.QEMUUser, u.Uid, status)
		}
	}
	if m := n.machines.get(s.ID); m == nil || m.CgroupErr != nil {
		t.Skipf("skipped: this host's cgroups are not writable (%v)", m.CgroupErr)
	}
	name := n.cgroupName(s.ID)
	cg, err := os.ReadFile("/proc/" + strconv.Itoa(s.PID) + "/cgroup")
	if err != nil || !strings.Contains(string(cg), "/aenv/"+name) {
		t.Fatalf("QEMU is not in its cgroup %s: %s %v", name, cg, err)
	}
	want := n.limits(s)
	dirs := vmm.CgroupDirs(name)
	read := func(file string) string {
		for _, d := range dirs {
			if b, err := os.ReadFile(filepath.Join(d, file)); err == nil {
				return strings.TrimSpace(string(b))
			}
		}
		t.Fatalf("no %s in %v", file, dirs)
		return ""
	}
	if len(dirs) == 1 { // cgroup v2
		if got := read("memory.max"); got != strconv.FormatInt(want.MemoryBytes, 10) {
			t.Fatalf("memory.max %s, want %d", got, want.MemoryBytes)
		}
		if got := read("cpu.max"); got != strconv.Itoa(100000*(s.VCPUs+1))+" 100000" {
			t.Fatalf("cpu.max %s", got)
		}
	} else {
		if got := read("memory.limit_in_bytes"); got != strconv.FormatInt(want.MemoryBytes, 10) {
			t.Fatalf("memory.limit_in_bytes %s, want %d", got, want.MemoryBytes)
		}
		if got := read("cpu.cfs_quota_us"); got != strconv.Itoa(100000*(s.VCPUs+1)) {
			t.Fatalf("cpu.cfs_quota_us %s", got)
		}
	}
	if got := read("pids.max"); got != "1024" {
		t.Fatalf("pids.max %s", got)
	}
	t.Logf("QEMU %d: seccomp filter on, cgroup %v (memory %d MiB, %.0f CPUs, 1024 tasks)", s.PID, dirs, want.MemoryBytes>>20, want.CPUs)
	if err := n.Kill(context.Background(), s.ID); err != nil {
		t.Fatal(err)
	}
	for _, d := range dirs {
		if _, err := os.Stat(d); !os.IsNotExist(err) {
			t.Fatalf("cgroup %s left after kill: %v", d, err)
		}
	}
}

// TestDiskQuota: a guest that fills its disk gets ENOSPC at its disk's
// size, and the sandbox's overlay on the host stays within that size (plus
// qcow2 metadata): no sandbox can fill the host's disk.
func TestDiskQuota(t *testing.T) {
	n := testNode(t)
	s := create(t, n, CreateRequest{TemplateID: "minimal"})
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	r, err := newEnvdClient(s).run(ctx, "root", "/bin/sh", "-c", "dd if=/dev/zero of=/fill bs=1M 2>&1; sync; df -m / | tail -1")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(r.stdout, "No space left on device") {
		t.Fatalf("the guest never ran out of space: %+v", r)
	}
	overlay := filepath.Join(n.sandboxDir(s.ID), overlayName)
	info, err := storage.Info(ctx, overlay)
	if err != nil {
		t.Fatal(err)
	}
	st, err := os.Stat(overlay)
	if err != nil {
		t.Fatal(err)
	}
	used := st.Sys().(*syscall.Stat_t).Blocks * 512
	t.Logf("guest disk %d MiB; host overlay after filling it: %d MiB allocated", info.VirtualSize>>20, used>>20)
	if used > info.VirtualSize+info.VirtualSize/20 {
		t.Fatalf("overlay uses %d bytes for a %d-byte disk", used, info.VirtualSize)
	}
}
