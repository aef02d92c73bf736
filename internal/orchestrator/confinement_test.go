package orchestrator

import (
	"context"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/agentenv/agentenv/internal/sandboxes"
	"github.com/agentenv/agentenv/internal/storage"
	"github.com/agentenv/agentenv/internal/vmm"
	"github.com/vishvananda/netns"
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
	id := strconv.Itoa(n.cfg.QEMUUIDBase + s.Slot)
	if !strings.Contains(string(status), "Uid:\t"+id+"\t"+id+"\t"+id) || !strings.Contains(string(status), "Gid:\t"+id+"\t"+id+"\t"+id) {
		t.Fatalf("QEMU does not run as its slot's ids %s:\n%s", id, status)
	}
	if m := n.machines.get(s.ID); m == nil || m.CgroupErr != nil {
		t.Skipf("skipped: this host's cgroups are not writable (%v)", m.CgroupErr)
	} else if !m.CgroupBeforeGuest {
		t.Fatal("QEMU was not in its cgroup before its guest could run")
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
	// A QEMU that restores saved state (here a cold resume; on cgroup v1
	// it is moved into its cgroup while it initialises) is in its cgroup
	// before the state loads.
	ctx := context.Background()
	if _, err := n.Pause(ctx, s.ID); err != nil {
		t.Fatal(err)
	}
	n.dropHot(s.ID)
	r, err := n.Resume(ctx, s.ID, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	if m := n.machines.get(s.ID); m == nil || m.CgroupErr != nil || !m.CgroupBeforeGuest {
		t.Fatalf("the resumed QEMU was not in its cgroup before its guest could run: %+v", m)
	}
	// In every hierarchy the created one was in (cgroup v1: cpu, memory, pids).
	if again, err := os.ReadFile("/proc/" + strconv.Itoa(r.PID) + "/cgroup"); err != nil || strings.Count(string(again), "/aenv/"+name) != strings.Count(string(cg), "/aenv/"+name) {
		t.Fatalf("the resumed QEMU is not in its cgroup %s: %s (created: %s) %v", name, again, cg, err)
	}
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

// TestQEMUHasNoHostNetwork: every QEMU (cold boot, resume, fork child) is
// born in its sandbox's network namespace, so the node's API on the host's
// loopback is out of its reach.
func TestQEMUHasNoHostNetwork(t *testing.T) {
	n := testNode(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	}()
	check := func(what string, s *sandboxes.Sandbox) {
		t.Helper()
		var qemuNS, sandboxNS syscall.Stat_t
		if err := syscall.Stat("/proc/"+strconv.Itoa(s.PID)+"/ns/net", &qemuNS); err != nil {
			t.Fatal(err)
		}
		if err := syscall.Stat(n.net.NamespacePath(s.ID), &sandboxNS); err != nil {
			t.Fatal(err)
		}
		if qemuNS.Ino != sandboxNS.Ino || qemuNS.Dev != sandboxNS.Dev {
			t.Fatalf("%s: QEMU %d is not in its sandbox's network namespace", what, s.PID)
		}
		// From QEMU's namespace, the host loopback listener is not there.
		reached, err := dialFrom("/proc/"+strconv.Itoa(s.PID)+"/ns/net", ln.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		if reached {
			t.Fatalf("%s: QEMU's namespace reaches the host's loopback at %s", what, ln.Addr())
		}
	}
	if ok, err := dialFrom("", ln.Addr().String()); err != nil || !ok {
		t.Fatalf("control: the host does not reach its own listener: %v", err)
	}
	ctx := context.Background()
	s := create(t, n, CreateRequest{TemplateID: "minimal"})
	check("cold boot", s)
	if _, err := n.Pause(ctx, s.ID); err != nil {
		t.Fatal(err)
	}
	if s, err = n.Resume(ctx, s.ID, 0); err != nil {
		t.Fatal(err)
	}
	check("resume", s)
	kids, err := n.Fork(ctx, s.ID, 1, 0)
	if err != nil || kids[0].Err != nil {
		t.Fatalf("fork: %v %v", err, kids)
	}
	t.Cleanup(func() { n.Kill(context.Background(), kids[0].Sandbox.ID) })
	check("fork child", kids[0].Sandbox)
}

// dialFrom reports whether a TCP connection to addr succeeds from the
// network namespace at nsPath ("": this process's).
func dialFrom(nsPath, addr string) (bool, error) {
	type result struct {
		ok  bool
		err error
	}
	done := make(chan result, 1)
	go func() {
		runtime.LockOSThread()
		if nsPath != "" {
			orig, err := netns.Get()
			if err != nil {
				done <- result{err: err}
				return
			}
			target, err := netns.GetFromPath(nsPath)
			if err != nil {
				done <- result{err: err}
				return
			}
			defer target.Close()
			if err := netns.Set(target); err != nil {
				done <- result{err: err}
				return
			}
			defer func() {
				if netns.Set(orig) == nil {
					runtime.UnlockOSThread()
				}
				orig.Close()
			}()
		} else {
			defer runtime.UnlockOSThread()
		}
		c, err := net.DialTimeout("tcp", addr, 2*time.Second)
		if err == nil {
			c.Close()
		}
		done <- result{ok: err == nil}
	}()
	r := <-done
	return r.ok, r.err
}

// TestQEMUsCannotReachEachOther: two sandboxes' QEMUs run under ids of
// their own, and from one's ids the other's process and files are out of
// reach.
func TestQEMUsCannotReachEachOther(t *testing.T) {
	n := testNode(t)
	a := create(t, n, CreateRequest{TemplateID: "minimal"})
	b := create(t, n, CreateRequest{TemplateID: "minimal"})
	ua, gb := n.cfg.QEMUUIDBase+a.Slot, n.cfg.QEMUUIDBase+b.Slot
	if ua == gb {
		t.Fatalf("two sandboxes share QEMU ids %d", ua)
	}
	// A process with a's QEMU's ids (not QEMU itself: it cannot be made to
	// run our code) tries b's QEMU and b's disk.
	probe := exec.Command("/bin/sh", "-c", `kill -0 "$1" 2>/dev/null && echo signalled; cat "$2" >/dev/null 2>&1 && echo read; ls "$3" >/dev/null 2>&1 && echo listed; echo done`,
		"probe", strconv.Itoa(b.PID), filepath.Join(n.sandboxDir(b.ID), overlayName), n.sandboxDir(b.ID))
	probe.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uint32(ua), Gid: uint32(ua)}}
	out, err := probe.CombinedOutput()
	if err != nil || strings.TrimSpace(string(out)) != "done" {
		t.Fatalf("from sandbox %s's QEMU ids, sandbox %s's QEMU or files were reachable: %q %v", a.ID, b.ID, out, err)
	}
	// a's QEMU's mount namespace, looked at as root: the data dir holds
	// only a's own directory and the shared stores; the database, the
	// secrets and b's directory are not there. As a's ids, /proc shows
	// no process of another user (b's QEMU, the node, init).
	look := func(uid int, script string, args ...string) string {
		t.Helper()
		argv := []string{"--target", strconv.Itoa(a.PID), "--mount"}
		if uid > 0 {
			argv = append(argv, "--setuid", strconv.Itoa(uid), "--setgid", strconv.Itoa(uid))
		}
		argv = append(append(argv, "--", "/bin/sh", "-c", script, "probe"), args...)
		out, err := exec.Command("nsenter", argv...).CombinedOutput()
		if err != nil {
			t.Fatalf("probe in a's mount namespace: %v %s", err, out)
		}
		return strings.Join(strings.Fields(string(out)), " ")
	}
	seen := look(0, `ls -A "$1"; echo /; ls -A "$1/sandboxes"; for p in "$1/aenv.db" "$1/repository.secret" "$1/admin.sock" "$2"; do test -e "$p" && echo "sees $p"; done; echo done`,
		n.cfg.DataDir, n.sandboxDir(b.ID))
	if !strings.HasSuffix(seen, "/ "+a.ID+" done") || strings.Contains(seen, "sees") || strings.Contains(seen, "aenv.db") {
		t.Fatalf("a's QEMU sees more of the data dir than its own files: %q", seen)
	}
	t.Logf("a's QEMU sees in the data dir: %s", seen)
	// (Not even a's QEMU: having changed ids, it is not dumpable, so its
	// /proc entry is root's; QEMU itself still reaches its own /proc/self.)
	procs := look(ua, `for p in "$1" 1 "$2"; do test -e /proc/"$p" && echo "sees $p"; done; test -r /proc/self/status && echo "sees itself"; echo done`,
		strconv.Itoa(b.PID), strconv.Itoa(a.PID))
	if procs != "sees itself done" {
		t.Fatalf("a's /proc shows other users' processes: %q", procs)
	}
	// Control: the same probe with b's own ids reaches b's QEMU (so the
	// probe can tell), but not b's files: QEMU owns none, it holds its
	// disk by the descriptors it inherited.
	probe = exec.Command(probe.Args[0], probe.Args[1:]...)
	probe.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uint32(gb), Gid: uint32(gb)}}
	if out, err := probe.CombinedOutput(); err != nil || strings.TrimSpace(string(out)) != "signalled\ndone" {
		t.Fatalf("from sandbox %s's own QEMU ids: %q %v, want it signalled and no file reached", b.ID, out, err)
	}
	disk := filepath.Join(n.sandboxDir(b.ID), overlayName)
	var st syscall.Stat_t
	if err := syscall.Stat(disk, &st); err != nil || st.Uid != 0 {
		t.Fatalf("b's disk is owned by %d, want root (%v)", st.Uid, err)
	}
	if held, err := vmm.WritableDescriptors(b.PID, disk); err != nil || held == 0 {
		t.Fatalf("b's QEMU holds %d writable descriptors of its disk (%v), want its own", held, err)
	}
}
