package vmm

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/agentenv/agentenv/internal/mountinfo"
)

// QEMU is not started directly: the process that becomes QEMU is first this
// program again (any binary linking this package), which sets up the jail
// and then replaces itself with QEMU (same pid), as Firecracker's jailer
// does for Firecracker. Unless the process was made in the sandbox's cgroup
// (cgroup v2) or is moved there before its guest can run (Start, for a
// restore on cgroup v1), the jail step joins it, so QEMU runs its first
// instruction already bounded; and, in the mount namespace
// of its own it was started in, hides the node's data dir behind an empty
// tmpfs with only this sandbox's files bound back, and mounts a /proc that
// shows a process only its own user's. Its network namespace was chosen at
// fork (startIn), its ids drop with -runas.

// jailEnv carries the jail step's instructions to the re-executed program.
const jailEnv = "AENV_VMM_JAIL"

type jailSpec struct {
	QEMU string `json:"qemu"`
	// CgroupProcs are the cgroup.procs files to write the process's pid to
	// (best effort: a host with read-only cgroups still runs sandboxes, and
	// the starter sees the process outside its cgroup).
	CgroupProcs []string `json:"cgroupProcs,omitempty"`
	// Hide, when set, is a directory covered with an empty tmpfs in QEMU's
	// mount namespace, with only Keep (paths inside it) bound back.
	Hide string   `json:"hide,omitempty"`
	Keep []string `json:"keep,omitempty"`
	// Drop are directories whose mounts are detached (see dropCopies).
	Drop []string `json:"drop,omitempty"`
	// Need are the files outside Hide QEMU opens (its binary, kernel and
	// initrd): the mounts on their way stay.
	Need []string `json:"need,omitempty"`
}

func init() {
	spec := os.Getenv(jailEnv)
	if spec == "" {
		return
	}
	os.Unsetenv(jailEnv)
	var js jailSpec
	if err := json.Unmarshal([]byte(spec), &js); err != nil || js.QEMU == "" {
		fmt.Fprintf(os.Stderr, "aenv jail: bad instructions %q\n", spec)
		os.Exit(125)
	}
	pid := []byte(strconv.Itoa(os.Getpid()))
	for _, f := range js.CgroupProcs {
		if err := os.WriteFile(f, pid, 0o644); err != nil {
			fmt.Fprintf(os.Stderr, "aenv jail: join cgroup: %v\n", err)
			break
		}
	}
	if js.Hide != "" {
		if err := js.mountNamespace(); err != nil {
			fmt.Fprintf(os.Stderr, "aenv jail: mount namespace: %v\n", err)
			os.Exit(125)
		}
	}
	err := syscall.Exec(js.QEMU, append([]string{js.QEMU}, os.Args[1:]...), os.Environ())
	fmt.Fprintf(os.Stderr, "aenv jail: exec %s: %v\n", js.QEMU, err)
	os.Exit(126)
}

// mountNamespace fills the mount namespace the jail step was started in
// (a copy of the host's, with every mount private to it): js.Hide becomes
// an empty tmpfs with js.Keep bound back where they were, and /proc shows
// only the processes of QEMU's own user.
func (js *jailSpec) mountNamespace() error {
	hide := filepath.Clean(js.Hide)
	type kept struct {
		fd  int
		rel string
	}
	var keep []kept
	for _, k := range js.Keep {
		rel, err := filepath.Rel(hide, filepath.Clean(k))
		if err != nil || rel == "." || strings.HasPrefix(rel, "..") {
			return fmt.Errorf("%s is not inside %s", k, hide)
		}
		// Opened before the tmpfs hides it; bound back from the descriptor.
		fd, err := unix.Open(k, unix.O_PATH|unix.O_CLOEXEC, 0)
		if errors.Is(err, unix.ENOENT) {
			continue
		}
		if err != nil {
			return fmt.Errorf("open %s: %w", k, err)
		}
		keep = append(keep, kept{fd, rel})
	}
	if err := js.dropCopies(hide); err != nil {
		return err
	}
	if err := unix.Mount("tmpfs", hide, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, "mode=0700,size=64k"); err != nil {
		return fmt.Errorf("cover %s: %w", hide, err)
	}
	for _, k := range keep {
		target := filepath.Join(hide, k.rel)
		var st unix.Stat_t
		if err := unix.Fstat(k.fd, &st); err != nil {
			return err
		}
		if err := os.MkdirAll(filepath.Dir(target), 0o700); err != nil {
			return err
		}
		var err error
		if st.Mode&unix.S_IFMT == unix.S_IFDIR {
			err = os.Mkdir(target, 0o700)
		} else {
			err = os.WriteFile(target, nil, 0o600)
		}
		if err != nil {
			return err
		}
		if err := unix.Mount(fmt.Sprintf("/proc/self/fd/%d", k.fd), target, "", unix.MS_BIND|unix.MS_REC, ""); err != nil {
			return fmt.Errorf("bind %s back: %w", target, err)
		}
		unix.Close(k.fd)
	}
	if err := unix.Mount("proc", "/proc", "proc", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, "hidepid=2"); err != nil {
		return fmt.Errorf("mount /proc: %w", err)
	}
	return nil
}

// dropCopies detaches every mount of QEMU's namespace that is not its own
// to use. Its namespace starts as a copy of the host's, and a copy keeps
// its filesystem mounted after the host unmounts it: a volume's fuse2fs
// (this node's, or another node's on the same host) would never see its
// unmount and flush its last writes, and a killed sandbox's network
// namespace would live on while this QEMU runs. What stays: the mounts on
// the way to the hidden data dir and inside its kept paths, the system's
// (the root, /usr, /etc, the libraries, /dev, /proc, /sys) and those on
// the way to the files QEMU opens (Need). Everything else goes, and every
// mount of Drop (the network namespaces' bindings) whatever it is below.
func (js *jailSpec) dropCopies(hide string) error {
	points, err := mountinfo.Own()
	if err != nil {
		return err
	}
	var drop []string
	for _, mp := range points {
		if !js.uses(mp, hide) || js.dropped(mp) {
			drop = append(drop, mp)
		}
	}
	// Outermost first: detaching a mount takes the ones below it along.
	sort.Slice(drop, func(i, j int) bool { return len(drop[i]) < len(drop[j]) })
	var done []string
next:
	for _, mp := range drop {
		for _, d := range done {
			if within(mp, d) {
				continue next
			}
		}
		if err := unix.Unmount(mp, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
			return fmt.Errorf("detach %s: %w", mp, err)
		}
		done = append(done, mp)
	}
	return nil
}

// systemDirs are the host's directories QEMU runs from: their mounts, and
// the mounts below them, stay in its namespace.
var systemDirs = []string{"/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/dev", "/proc", "/sys"}

// uses reports whether QEMU's namespace keeps the mount point mp (see
// dropCopies).
func (js *jailSpec) uses(mp, hide string) bool {
	if within(mp, hide) {
		return js.kept(mp)
	}
	if within(hide, mp) {
		return true
	}
	for _, d := range systemDirs {
		if within(mp, d) || within(d, mp) {
			return true
		}
	}
	for _, f := range js.Need {
		if f != "" && within(filepath.Clean(f), mp) {
			return true
		}
	}
	return false
}

// dropped reports whether the mount point mp is below a directory of Drop.
func (js *jailSpec) dropped(mp string) bool {
	for _, d := range js.Drop {
		if within(mp, filepath.Clean(d)) {
			return true
		}
	}
	return false
}

// kept reports whether the mount point mp is inside a kept path or on the
// way to one.
func (js *jailSpec) kept(mp string) bool {
	for _, k := range js.Keep {
		k = filepath.Clean(k)
		if within(mp, k) || within(k, mp) {
			return true
		}
	}
	return false
}

// within reports whether path is dir or below it.
func within(path, dir string) bool {
	return path == dir || strings.HasPrefix(path, strings.TrimSuffix(dir, "/")+"/")
}

// Jail is what the jail step hides from QEMU's view of the file system:
// Hide (the node's data dir) is covered, and only Keep (paths inside it:
// the sandbox's own directory and the shared, read-only stores QEMU opens
// its disk chain and RAM image from) are seen through.
type Jail struct {
	Hide string
	Keep []string
	// Drop are directories outside Hide whose mounts QEMU's namespace
	// does without (the network namespaces' bindings): detached there so
	// it holds none of them alive. (Every other mount QEMU has no use for
	// goes too, see dropCopies.)
	Drop []string
	// Need are files outside Hide that QEMU opens (Start adds its binary,
	// kernel, initrd and the temporary directory its migration sockets are
	// made in): the mounts on their way stay.
	Need []string
}

// jailCommand is the command that starts QEMU bin with args through the
// jail step, joining cg first (nil: no cgroup) and, with fs.Hide set,
// in a mount namespace of its own.
func jailCommand(bin string, args []string, cg *Cgroup, fs Jail) (*exec.Cmd, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, fmt.Errorf("find this program for the jail step: %w", err)
	}
	js := jailSpec{QEMU: bin, Hide: fs.Hide, Keep: fs.Keep, Drop: fs.Drop, Need: append(slices.Clip(fs.Need), bin)}
	if cg != nil {
		js.CgroupProcs = cg.procsFiles()
	}
	b, err := json.Marshal(js)
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(self, args...)
	cmd.Env = append(os.Environ(), jailEnv+"="+string(b))
	return cmd, nil
}
