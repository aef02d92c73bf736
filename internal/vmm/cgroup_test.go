package vmm

import (
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// cgroup2Mount is where a cgroup v2 hierarchy is mounted here: the root
// on a v2 host, /sys/fs/cgroup/unified on a hybrid one ("" for none).
func cgroup2Mount() string {
	for _, dir := range []string{cgroupRoot, filepath.Join(cgroupRoot, "unified")} {
		var st unix.Statfs_t
		if unix.Statfs(dir, &st) == nil && st.Type == unix.CGROUP2_SUPER_MAGIC {
			return dir
		}
	}
	return ""
}

// A process started through cloneInto begins in the cgroup: the kernel
// says so for it at once, and the cgroup lists it.
func TestCloneIntoCgroup(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to make a cgroup")
	}
	mnt := cgroup2Mount()
	if mnt == "" {
		t.Skip("no cgroup v2 hierarchy is mounted here")
	}
	dir := filepath.Join(mnt, "aenv-clone-into-test")
	os.Remove(dir)
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	defer os.Remove(dir)
	cmd := exec.Command("sleep", "30")
	done, err := cloneInto(cmd, dir)
	if err != nil {
		t.Fatal(err)
	}
	err = cmd.Start()
	done()
	if err != nil {
		t.Fatal(err)
	}
	defer func() { cmd.Process.Kill(); cmd.Wait() }()
	b, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(cmd.Process.Pid), "cgroup"))
	if err != nil || !strings.Contains(string(b), "0::/aenv-clone-into-test\n") {
		t.Fatalf("the process's cgroups: %q %v", b, err)
	}
	procs, _ := os.ReadFile(filepath.Join(dir, "cgroup.procs"))
	if strings.TrimSpace(string(procs)) != strconv.Itoa(cmd.Process.Pid) {
		t.Fatalf("cgroup.procs: %q", procs)
	}
	if _, err := cloneInto(exec.Command("true"), filepath.Join(mnt, "aenv-no-such-cgroup")); err == nil {
		t.Fatal("a cgroup that is not there was opened")
	}
}
