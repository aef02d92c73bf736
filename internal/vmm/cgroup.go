package vmm

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Limits bound one QEMU process through a cgroup of its own: CPU time,
// memory (guest RAM plus QEMU's overhead) and the number of tasks.
type Limits struct {
	// CPUs is how many CPUs' worth of time the process may use (0: no
	// bound).
	CPUs float64
	// MemoryBytes bounds the process's memory, page cache it faults in
	// included (0: no bound).
	MemoryBytes int64
	// Pids bounds its threads (0: no bound).
	Pids int
}

// cgroupRoot is where cgroups are mounted; tests may not change it.
const cgroupRoot = "/sys/fs/cgroup"

// cgroupParent is the directory (under each hierarchy) holding the
// sandboxes' cgroups.
const cgroupParent = "aenv"

// Cgroup is a QEMU process's cgroup: one directory under the unified
// hierarchy (cgroup v2), or one per controller (v1).
type Cgroup struct {
	Dirs []string
}

// cgroupV2 reports whether the unified hierarchy is mounted at the root.
func cgroupV2() bool {
	_, err := os.Stat(filepath.Join(cgroupRoot, "cgroup.controllers"))
	return err == nil
}

// CgroupDirs are the directories cgroup name has (or would have).
func CgroupDirs(name string) []string {
	if cgroupV2() {
		return []string{filepath.Join(cgroupRoot, cgroupParent, name)}
	}
	var dirs []string
	for _, c := range []string{"cpu", "memory", "pids"} {
		dirs = append(dirs, filepath.Join(cgroupRoot, c, cgroupParent, name))
	}
	return dirs
}

// PlaceInCgroup creates cgroup name with the limits and moves pid (all its
// threads) into it.
func PlaceInCgroup(name string, pid int, l Limits) (*Cgroup, error) {
	cg, err := PrepareCgroup(name, l)
	if err != nil {
		return nil, err
	}
	if err := cg.Join(pid); err != nil {
		cg.Remove()
		return nil, err
	}
	return cg, nil
}

// PrepareCgroup creates cgroup name with the limits, for a process to join.
func PrepareCgroup(name string, l Limits) (*Cgroup, error) {
	if strings.ContainsAny(name, "/.") || name == "" {
		return nil, fmt.Errorf("cgroup name %q", name)
	}
	cg := &Cgroup{Dirs: CgroupDirs(name)}
	var files [][2]string // file (relative to a dir), value
	if cgroupV2() {
		parent := filepath.Join(cgroupRoot, cgroupParent)
		if err := os.MkdirAll(parent, 0o755); err != nil {
			return nil, err
		}
		for _, dir := range []string{cgroupRoot, parent} {
			if err := os.WriteFile(filepath.Join(dir, "cgroup.subtree_control"), []byte("+cpu +memory +pids"), 0o644); err != nil {
				return nil, fmt.Errorf("enable cgroup controllers in %s: %w", dir, err)
			}
		}
		if l.CPUs > 0 {
			files = append(files, [2]string{"cpu.max", fmt.Sprintf("%d 100000", int64(l.CPUs*100000))})
		}
		if l.MemoryBytes > 0 {
			files = append(files, [2]string{"memory.max", strconv.FormatInt(l.MemoryBytes, 10)})
		}
		if l.Pids > 0 {
			files = append(files, [2]string{"pids.max", strconv.Itoa(l.Pids)})
		}
	} else {
		if l.CPUs > 0 {
			files = append(files, [2]string{"cpu/cpu.cfs_period_us", "100000"}, [2]string{"cpu/cpu.cfs_quota_us", strconv.FormatInt(int64(l.CPUs*100000), 10)})
		}
		if l.MemoryBytes > 0 {
			files = append(files, [2]string{"memory/memory.limit_in_bytes", strconv.FormatInt(l.MemoryBytes, 10)})
		}
		if l.Pids > 0 {
			files = append(files, [2]string{"pids/pids.max", strconv.Itoa(l.Pids)})
		}
	}
	for _, d := range cg.Dirs {
		if err := os.MkdirAll(d, 0o755); err != nil {
			cg.Remove()
			return nil, fmt.Errorf("create cgroup: %w", err)
		}
	}
	for _, f := range files {
		if err := os.WriteFile(cg.file(f[0]), []byte(f[1]), 0o644); err != nil {
			cg.Remove()
			return nil, fmt.Errorf("cgroup limit %s: %w", f[0], err)
		}
	}
	return cg, nil
}

// procsFiles are the files a process writes its pid to to join c.
func (c *Cgroup) procsFiles() []string {
	out := make([]string, len(c.Dirs))
	for i, d := range c.Dirs {
		out[i] = filepath.Join(d, "cgroup.procs")
	}
	return out
}

// Join moves pid (all its threads) into c.
func (c *Cgroup) Join(pid int) error {
	for _, f := range c.procsFiles() {
		if err := os.WriteFile(f, []byte(strconv.Itoa(pid)), 0o644); err != nil {
			return fmt.Errorf("move QEMU into its cgroup: %w", err)
		}
	}
	return nil
}

// Holds reports whether pid is in c (in every hierarchy of it).
func (c *Cgroup) Holds(pid int) bool {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/cgroup")
	if err != nil {
		return false
	}
	for _, d := range c.Dirs {
		if !strings.Contains(string(b), "/"+cgroupParent+"/"+filepath.Base(d)+"\n") {
			return false
		}
	}
	return true
}

// file resolves a limit file: "cpu.max" in the v2 dir, "cpu/cpu.cfs..." in
// the v1 controller's dir.
func (c *Cgroup) file(rel string) string {
	ctrl, name, ok := strings.Cut(rel, "/")
	if !ok {
		return filepath.Join(c.Dirs[0], rel)
	}
	for _, d := range c.Dirs {
		if filepath.Base(filepath.Dir(filepath.Dir(d))) == ctrl {
			return filepath.Join(d, name)
		}
	}
	return filepath.Join(c.Dirs[0], name)
}

// Remove deletes the cgroup once its process has exited (retrying for a
// moment while the kernel finishes the exit).
func (c *Cgroup) Remove() error {
	var errs []error
	for _, d := range c.Dirs {
		var err error
		for i := 0; i < 50; i++ {
			err = syscall.Rmdir(d)
			if err == nil || errors.Is(err, syscall.ENOENT) {
				err = nil
				break
			}
			time.Sleep(20 * time.Millisecond)
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("remove cgroup %s: %w", d, err))
		}
	}
	return errors.Join(errs...)
}

// RemoveCgroup deletes cgroup name (its process gone).
func RemoveCgroup(name string) error { return (&Cgroup{Dirs: CgroupDirs(name)}).Remove() }

// CgroupNames lists the existing sandbox cgroups (for cleaning up those no
// sandbox owns).
func CgroupNames() []string {
	ents, err := os.ReadDir(filepath.Dir(CgroupDirs("x")[0]))
	if err != nil {
		return nil
	}
	var out []string
	for _, e := range ents {
		if e.IsDir() {
			out = append(out, e.Name())
		}
	}
	return out
}

// cloneInto makes cmd start in the cgroup v2 directory dir (clone3 with
// CLONE_INTO_CGROUP): the process begins there. The returned function
// closes the directory once cmd has started (or failed to).
func cloneInto(cmd *exec.Cmd, dir string) (func(), error) {
	fd, err := unix.Open(dir, unix.O_DIRECTORY|unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("open cgroup %s: %w", dir, err)
	}
	if cmd.SysProcAttr == nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{}
	}
	cmd.SysProcAttr.UseCgroupFD, cmd.SysProcAttr.CgroupFD = true, fd
	return func() { unix.Close(fd) }, nil
}
