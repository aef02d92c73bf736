package vmm

import (
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/agentenv/agentenv/internal/mountinfo"
)

// TestJailDropsCopiesOfTheNodesMounts: QEMU's mount namespace starts as a
// copy of the host's. A mount below the hidden data dir that QEMU does not
// need (an open volume's filesystem), a mount of another node's (its
// volume), and the mounts of Drop (the network namespaces' bindings) must
// not be in it: a copy would keep a volume's filesystem mounted after its
// node unmounts it, its last writes never flushed, and keep a killed
// sandbox's network namespace alive. A mount inside a kept path, on the
// way to a file QEMU opens, and the system's stay.
func TestJailDropsCopiesOfTheNodesMounts(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (mounts and a mount namespace)")
	}
	sleep, err := exec.LookPath("sleep")
	if err != nil {
		t.Skip(err)
	}
	root := t.TempDir()
	hide := filepath.Join(root, "data")
	volume := filepath.Join(hide, "volumes", "v1", "mnt")
	keptSub := filepath.Join(hide, "cache", "lazy")
	drop := filepath.Join(root, "netns")
	dropSub := filepath.Join(drop, "ns1")
	// Another node's data dir on the same host, with a volume open, and a
	// directory holding a file QEMU opens (its kernel, say).
	otherVolume := filepath.Join(root, "other-node", "volumes", "v2", "mnt")
	needed := filepath.Join(root, "opt")
	mount := func(dir string) {
		t.Helper()
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := syscall.Mount("tmpfs", dir, "tmpfs", 0, "size=64k"); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { syscall.Unmount(dir, syscall.MNT_DETACH) })
	}
	for _, d := range []string{volume, keptSub, drop, dropSub, otherVolume, needed} {
		mount(d)
	}
	cmd, err := jailCommand(sleep, []string{"60"}, nil, Jail{Hide: hide, Keep: []string{filepath.Join(hide, "cache")}, Drop: []string{drop},
		Need: []string{filepath.Join(needed, "vmlinux")}})
	if err != nil {
		t.Fatal(err)
	}
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true, Unshareflags: syscall.CLONE_NEWNS}
	out, _ := os.CreateTemp(t.TempDir(), "jail")
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	// Until the jail step has become sleep.
	proc := "/proc/" + strconv.Itoa(cmd.Process.Pid)
	for deadline := time.Now().Add(10 * time.Second); ; {
		if exe, _ := os.Readlink(proc + "/exe"); exe == sleep {
			break
		}
		if time.Now().After(deadline) {
			b, _ := os.ReadFile(out.Name())
			t.Fatalf("the jail step did not exec %s: %s", sleep, b)
		}
		time.Sleep(10 * time.Millisecond)
	}
	b, err := os.ReadFile(proc + "/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	mps := mountinfo.Points(b)
	for _, gone := range []string{volume, drop, dropSub, otherVolume} {
		if slices.Contains(mps, gone) {
			t.Errorf("QEMU's namespace holds a copy of %s", gone)
		}
	}
	for _, kept := range []string{keptSub, needed, "/", "/proc", "/dev"} {
		if !slices.Contains(mps, kept) {
			t.Errorf("the mount %s is gone: %q", kept, mps)
		}
	}
}
