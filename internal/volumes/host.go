package volumes

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/agentenv/agentenv/internal/mountinfo"
	"github.com/agentenv/agentenv/internal/storage"
	"golang.org/x/sys/unix"
)

// Tools are the programs the host runs on volumes.
type Tools struct {
	QEMUImg       string // qemu-img
	StorageDaemon string // qemu-storage-daemon
	FUSE2FS       string // fuse2fs
	MkfsExt4      string // mkfs.ext4
	E2fsck        string // e2fsck
}

func (t Tools) withDefaults() Tools {
	set := func(p *string, name string) {
		if *p == "" {
			*p = name
		}
	}
	set(&t.QEMUImg, "qemu-img")
	set(&t.StorageDaemon, "qemu-storage-daemon")
	set(&t.FUSE2FS, "fuse2fs")
	set(&t.MkfsExt4, "mkfs.ext4")
	set(&t.E2fsck, "e2fsck")
	return t
}

// The files of a volume's directory.
const (
	diskName   = "disk.qcow2"
	exportName = "export.raw" // the disk as a raw file (storage daemon's FUSE export)
	mountName  = "mnt"        // the filesystem in it (fuse2fs)
	pidName    = "qsd.pid"
)

// makeDisk makes a volume's disk in dir: an empty ext4 filesystem of size
// bytes whose root uid:gid own, in a qcow2 image (written to a temporary
// name, renamed once complete).
func makeDisk(ctx context.Context, t Tools, dir string, size int64, uid, gid int) error {
	raw := filepath.Join(dir, "new.raw")
	tmp := filepath.Join(dir, "new.qcow2")
	defer os.Remove(raw)
	defer os.Remove(tmp)
	if err := os.WriteFile(raw, nil, 0o600); err != nil {
		return err
	}
	if err := os.Truncate(raw, size); err != nil {
		return err
	}
	// 4 KiB blocks whatever the size (mke2fs gives small filesystems 1 KiB
	// ones, four times the work per byte for fuse2fs).
	if err := run(ctx, t.MkfsExt4, "-q", "-F", "-b", "4096", "-L", "aenv-volume", "-E", fmt.Sprintf("root_owner=%d:%d", uid, gid), raw); err != nil {
		return err
	}
	if err := run(ctx, t.QEMUImg, "convert", "-O", "qcow2", raw, tmp); err != nil {
		return err
	}
	if err := storage.SyncFile(tmp); err != nil {
		return err
	}
	if err := os.Rename(tmp, filepath.Join(dir, diskName)); err != nil {
		return err
	}
	return storage.SyncDir(dir)
}

// run runs a tool; its failure carries the last of its output.
func run(ctx context.Context, name string, args ...string) error {
	out, err := exec.CommandContext(ctx, name, args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s: %w: %s", filepath.Base(name), err, tail(out))
	}
	return nil
}

// daemonize runs a tool that forks a daemon and exits once it is ready.
// The daemon keeps its output, so that goes to the file logPath rather
// than to a pipe (whose end the daemon would hold open).
func daemonize(ctx context.Context, logPath, name string, args ...string) error {
	log, err := os.OpenFile(logPath, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return err
	}
	defer log.Close()
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Stdout, cmd.Stderr = log, log
	if err := cmd.Run(); err != nil {
		out, _ := os.ReadFile(logPath)
		return fmt.Errorf("%s: %w: %s", filepath.Base(name), err, tail(out))
	}
	return nil
}

func tail(b []byte) string {
	b = bytes.TrimSpace(b)
	if len(b) > 400 {
		b = b[len(b)-400:]
	}
	return string(b)
}

// hostMount is a volume open on the host: the storage daemon exporting its
// disk as a raw file, fuse2fs serving the filesystem in that file, and the
// filesystem's root.
type hostMount struct {
	dir  string
	qsd  int // the storage daemon's pid
	fuse *exec.Cmd
	// fuseDone is closed once fuse2fs has exited (and been reaped).
	fuseDone chan struct{}
	root     *os.Root
}

// openHost opens the volume whose directory is dir: the disk is exported,
// checked (e2fsck -p replays a journal a guest left and repairs what it
// can), and mounted.
func openHost(ctx context.Context, t Tools, dir string) (m *hostMount, err error) {
	disk := filepath.Join(dir, diskName)
	if _, err := os.Stat(disk); err != nil {
		return nil, fmt.Errorf("volume disk: %w", err)
	}
	if err := closeStale(ctx, dir, t); err != nil {
		return nil, err
	}
	export, mnt := filepath.Join(dir, exportName), filepath.Join(dir, mountName)
	if err := os.WriteFile(export, nil, 0o600); err != nil {
		return nil, err
	}
	if err := os.MkdirAll(mnt, 0o700); err != nil {
		return nil, err
	}
	m = &hostMount{dir: dir}
	defer func() {
		if err != nil {
			if cerr := m.close(context.WithoutCancel(ctx)); cerr != nil {
				err = errors.Join(err, cerr)
			}
		}
	}()
	pidFile := filepath.Join(dir, pidName)
	if err := daemonize(ctx, filepath.Join(dir, "qsd.log"), t.StorageDaemon,
		"--blockdev", "driver=file,node-name=file,filename="+disk,
		"--blockdev", "driver=qcow2,node-name=disk,file=file",
		"--export", "type=fuse,id=export,node-name=disk,mountpoint="+export+",writable=on",
		"--pidfile", pidFile, "--daemonize"); err != nil {
		return m, err
	}
	pid, err := readPid(pidFile)
	if err != nil {
		return m, err
	}
	m.qsd = pid
	// Exit status 1 is "errors corrected": the filesystem is fine now.
	if err := run(ctx, t.E2fsck, "-p", export); err != nil {
		var ee *exec.ExitError
		if !errors.As(err, &ee) || ee.ExitCode() != 1 {
			return m, fmt.Errorf("the volume's filesystem is damaged beyond what e2fsck -p repairs: %w", err)
		}
	}
	// hard_remove: a removed file goes at once, not renamed to a
	// .fuse_hidden file while a handle (being released) is open.
	// nodev, nosuid, noexec: what a guest left in the volume is data to
	// the host (a device node there cannot be opened, a setuid file gives
	// no rights).
	m.fuse = exec.Command(t.FUSE2FS, "-f", export, mnt, "-o", "rw,hard_remove,nodev,nosuid,noexec")
	var stderr bytes.Buffer
	m.fuse.Stderr = &stderr
	if err := m.fuse.Start(); err != nil {
		return m, fmt.Errorf("fuse2fs: %w", err)
	}
	m.fuseDone = make(chan struct{})
	var waitErr error
	go func() { waitErr = m.fuse.Wait(); close(m.fuseDone) }()
	for !mounted(mnt) {
		select {
		case <-m.fuseDone:
			return m, fmt.Errorf("fuse2fs exited: %v: %s", waitErr, tail(stderr.Bytes()))
		case <-ctx.Done():
			return m, ctx.Err()
		case <-time.After(10 * time.Millisecond):
		}
	}
	root, err := os.OpenRoot(mnt)
	if err != nil {
		return m, err
	}
	m.root = root
	if err := root.RemoveAll(uploadDir); err != nil {
		return m, fmt.Errorf("clear the volume's unfinished writes: %w", err)
	}
	if err := root.Mkdir(uploadDir, 0o700); err != nil {
		return m, fmt.Errorf("make the volume's upload directory: %w", err)
	}
	return m, nil
}

// close unmounts the filesystem (fuse2fs writes what it holds and exits),
// then stops the storage daemon (it flushes the disk).
func (m *hostMount) close(ctx context.Context) error {
	if m.root != nil {
		m.root.Close()
		m.root = nil
	}
	var errs []error
	mnt := filepath.Join(m.dir, mountName)
	if mounted(mnt) {
		errs = append(errs, unmount(ctx, mnt))
	}
	if m.fuse != nil {
		select {
		case <-m.fuseDone:
		case <-time.After(30 * time.Second):
			_ = m.fuse.Process.Kill()
			<-m.fuseDone
			errs = append(errs, errors.New("fuse2fs did not exit after the unmount (killed)"))
		}
		m.fuse = nil
	}
	if m.qsd != 0 {
		errs = append(errs, stopDaemon(ctx, m.qsd))
		m.qsd = 0
	}
	os.Remove(filepath.Join(m.dir, pidName))
	return errors.Join(errs...)
}

// closeStale stops what a server that ended without closing a volume
// left of it: its filesystem's mount (fuse2fs exits once unmounted) and
// its storage daemon, by the pid file, if that process is still the
// volume's daemon.
func closeStale(ctx context.Context, dir string, t Tools) error {
	mnt := filepath.Join(dir, mountName)
	if mounted(mnt) {
		if err := unmount(ctx, mnt); err != nil {
			return err
		}
		for _, pid := range pidsWith(filepath.Base(t.FUSE2FS), mnt) {
			if err := waitGone(ctx, pid, 30*time.Second); err != nil {
				return err
			}
		}
	}
	pidFile := filepath.Join(dir, pidName)
	if pid, err := readPid(pidFile); err == nil && cmdlineHas(pid, filepath.Join(dir, diskName)) {
		if err := stopDaemon(ctx, pid); err != nil {
			return err
		}
	}
	os.Remove(pidFile)
	if export := filepath.Join(dir, exportName); mounted(export) {
		if err := unix.Unmount(export, unix.MNT_DETACH); err != nil {
			return fmt.Errorf("unmount a stale export: %w", err)
		}
	}
	return nil
}

// unmount unmounts a FUSE filesystem, retrying while it is busy; one
// still busy after 5 s is detached (it goes, and its server exits, once
// the last file open in it is closed).
func unmount(ctx context.Context, path string) error {
	busySince := time.Now()
	for {
		err := unix.Unmount(path, 0)
		if err == nil || errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOENT) {
			return nil
		}
		if !errors.Is(err, unix.EBUSY) {
			return fmt.Errorf("unmount %s: %w", filepath.Base(path), err)
		}
		if time.Since(busySince) > 5*time.Second {
			if err := unix.Unmount(path, unix.MNT_DETACH); err != nil {
				return fmt.Errorf("detach %s: %w", filepath.Base(path), err)
			}
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("unmount %s: busy: %w", filepath.Base(path), ctx.Err())
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// stopDaemon ends the storage daemon pid (SIGTERM: it flushes the disk
// and exits), killing it if it has not gone in 30 s.
func stopDaemon(ctx context.Context, pid int) error {
	if err := syscall.Kill(pid, syscall.SIGTERM); err != nil {
		if errors.Is(err, syscall.ESRCH) {
			return nil
		}
		return err
	}
	if err := waitGone(ctx, pid, 30*time.Second); err != nil {
		_ = syscall.Kill(pid, syscall.SIGKILL)
		return fmt.Errorf("the volume's storage daemon did not stop: %w", err)
	}
	return nil
}

// waitGone waits until process pid is gone (reaped by its parent, or a
// zombie of ours).
func waitGone(ctx context.Context, pid int, limit time.Duration) error {
	deadline := time.Now().Add(limit)
	for {
		if !alive(pid) {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("process %d still running after %s", pid, limit)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// alive reports whether pid runs (a zombie does not).
func alive(pid int) bool {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return false
	}
	// The state follows the command name in parentheses.
	i := bytes.LastIndexByte(b, ')')
	return i < 0 || i+2 >= len(b) || b[i+2] != 'Z'
}

func readPid(path string) (int, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, err
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil || pid <= 1 {
		return 0, fmt.Errorf("bad pid file %s", filepath.Base(path))
	}
	return pid, nil
}

func cmdlineHas(pid int, arg string) bool {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/cmdline")
	return err == nil && bytes.Contains(b, []byte(arg))
}

// pidsWith lists the processes named name whose command line holds arg.
func pidsWith(name, arg string) []int {
	entries, _ := os.ReadDir("/proc")
	var out []int
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		comm, _ := os.ReadFile("/proc/" + e.Name() + "/comm")
		if strings.TrimSpace(string(comm)) == name && cmdlineHas(pid, arg) {
			out = append(out, pid)
		}
	}
	return out
}

// mounted reports whether path is a mount point (in this process's mount
// namespace).
func mounted(path string) bool {
	ok, _ := mountinfo.IsMountPoint(path)
	return ok
}
