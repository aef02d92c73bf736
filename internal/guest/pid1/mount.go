package pid1

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/agentenv/agentenv/internal/mountinfo"
)

type mountSpec struct {
	source, target, fstype string
	flags                  uintptr
	data                   string
}

func mountAll(ms []mountSpec) error {
	for _, m := range ms {
		if err := os.MkdirAll(m.target, 0o755); err != nil {
			return fmt.Errorf("mkdir %s: %w", m.target, err)
		}
		if err := unix.Mount(m.source, m.target, m.fstype, m.flags, m.data); err != nil && !errors.Is(err, unix.EBUSY) {
			return fmt.Errorf("mount %s on %s: %w", m.fstype, m.target, err)
		}
	}
	return nil
}

// earlyMounts mounts /dev, /proc and /sys in the initramfs.
func earlyMounts() error {
	const nsx = unix.MS_NOSUID | unix.MS_NODEV | unix.MS_NOEXEC
	return mountAll([]mountSpec{
		{"devtmpfs", "/dev", "devtmpfs", unix.MS_NOSUID, "mode=0755"},
		{"proc", "/proc", "proc", nsx, ""},
		{"sysfs", "/sys", "sysfs", nsx, ""},
	})
}

// loadModules loads the modules listed in the initramfs' modules.order in
// order, then deletes the files to give their memory back.
func loadModules() {
	start := time.Now()
	f, err := os.Open(moduleOrderFile)
	if err != nil {
		logf("no module list (%v); loading no modules", err)
		return
	}
	defer f.Close()
	n := 0
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		p := strings.TrimSpace(sc.Text())
		if p == "" || strings.HasPrefix(p, "#") {
			continue
		}
		if !filepath.IsAbs(p) {
			p = filepath.Join(moduleDir, p)
		}
		if err := loadModule(p); err != nil {
			logf("module %s: %v", filepath.Base(p), err)
			continue
		}
		n++
		_ = os.Remove(p)
	}
	logf("loaded %d modules in %s", n, time.Since(start).Round(time.Millisecond))
}

func loadModule(path string) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	err = unix.FinitModule(int(f.Fd()), "", 0)
	if errors.Is(err, unix.EEXIST) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("finit_module: %w", err)
	}
	return nil
}

// mountRoot waits for the root disk and mounts it at /newroot.
func mountRoot(cfg Config) error {
	const wait = 10 * time.Second
	start := time.Now()
	for {
		if _, err := os.Stat(cfg.Root); err == nil {
			break
		}
		if time.Since(start) > wait {
			return fmt.Errorf("root device %s did not appear within %s (is virtio_blk loaded and the disk attached?)", cfg.Root, wait)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if err := os.MkdirAll(newRoot, 0o755); err != nil {
		return fmt.Errorf("mkdir %s: %w", newRoot, err)
	}
	if err := unix.Mount(cfg.Root, newRoot, cfg.RootFSType, unix.MS_RELATIME, cfg.RootFlags); err != nil {
		return fmt.Errorf("mount root %s (%s) on %s: %w", cfg.Root, cfg.RootFSType, newRoot, err)
	}
	logf("root %s mounted (%s, waited %s)", cfg.Root, cfg.RootFSType, time.Since(start).Round(time.Millisecond))
	return nil
}

// switchRoot moves /dev, /proc and /sys into the new root, mounts the rest
// of the API filesystems there, then makes it the root (switch_root style:
// the initramfs stays in memory but is no longer reachable).
func switchRoot() error {
	for _, d := range []string{"dev", "proc", "sys"} {
		target := filepath.Join(newRoot, d)
		if err := os.MkdirAll(target, 0o755); err != nil {
			return fmt.Errorf("mkdir %s: %w", target, err)
		}
		if err := unix.Mount("/"+d, target, "", unix.MS_MOVE, ""); err != nil {
			return fmt.Errorf("move /%s to %s: %w", d, target, err)
		}
	}
	const ns = unix.MS_NOSUID | unix.MS_NODEV
	if err := mountAll([]mountSpec{
		{"devpts", newRoot + "/dev/pts", "devpts", unix.MS_NOSUID | unix.MS_NOEXEC, "mode=0620,ptmxmode=0666,gid=5"},
		{"tmpfs", newRoot + "/dev/shm", "tmpfs", ns, "mode=1777"},
		{"tmpfs", newRoot + "/run", "tmpfs", ns, "mode=0755"},
	}); err != nil {
		return err
	}
	// Optional: cgroup v2 for resource accounting inside the guest.
	if err := mountAll([]mountSpec{{"cgroup2", newRoot + "/sys/fs/cgroup", "cgroup2", ns | unix.MS_NOEXEC, ""}}); err != nil {
		logf("cgroup2: %v", err)
	}
	for name, target := range map[string]string{"fd": "/proc/self/fd", "stdin": "/proc/self/fd/0", "stdout": "/proc/self/fd/1", "stderr": "/proc/self/fd/2"} {
		_ = os.Symlink(target, filepath.Join(newRoot, "dev", name))
	}
	tmp := filepath.Join(newRoot, "tmp")
	if err := os.MkdirAll(tmp, 0o1777); err == nil {
		_ = os.Chmod(tmp, 0o1777|os.ModeSticky)
	}
	if err := os.Chdir(newRoot); err != nil {
		return fmt.Errorf("chdir %s: %w", newRoot, err)
	}
	if err := unix.Mount(".", "/", "", unix.MS_MOVE, ""); err != nil {
		return fmt.Errorf("move %s to /: %w", newRoot, err)
	}
	if err := unix.Chroot("."); err != nil {
		return fmt.Errorf("chroot: %w", err)
	}
	if err := os.Chdir("/"); err != nil {
		return fmt.Errorf("chdir /: %w", err)
	}
	logf("switched to the new root")
	return nil
}

// unmountAll unmounts everything but / in reverse mount order, then
// remounts / read-only.
func unmountAll() {
	b, err := os.ReadFile("/proc/self/mounts")
	if err == nil {
		lines := strings.Split(strings.TrimSpace(string(b)), "\n")
		for i := len(lines) - 1; i >= 0; i-- {
			f := strings.Fields(lines[i])
			if len(f) < 2 || f[1] == "/" {
				continue
			}
			target := mountinfo.Unescape(f[1])
			if err := unix.Unmount(target, 0); err != nil {
				_ = unix.Unmount(target, unix.MNT_DETACH)
			}
		}
	}
	if err := unix.Mount("", "/", "", unix.MS_REMOUNT|unix.MS_RDONLY, ""); err != nil {
		logf("remount / read-only: %v", err)
	}
}
