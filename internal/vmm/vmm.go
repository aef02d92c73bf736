// Package vmm owns the virtual machine monitor processes behind sandboxes: it
// builds QEMU `microvm` command lines, starts and re-adopts QEMU processes,
// and drives them over QMP (pause, resume, power-down, kill, events). Guest
// RAM is always a file-backed mapping so that later snapshot and fork work
// can reuse it.
package vmm

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Config describes one virtual machine.
type Config struct {
	// QEMU is the qemu-system-x86_64 binary; empty means look it up in PATH.
	QEMU  string
	Accel Accel
	VCPUs int
	// MemoryMiB is the guest RAM size.
	MemoryMiB int
	Kernel    string
	Initrd    string
	Cmdline   string
	// RootDisk is the sandbox's writable qcow2 overlay.
	RootDisk string
	// MemFile backs guest RAM (memory-backend-file, share=on).
	MemFile string
	// Tap, when set, is an open tap device handed to QEMU as the guest NIC.
	Tap *os.File
	MAC string
	// RunDir holds the QMP socket, console log, QEMU log and pid file.
	RunDir string
	// LogCap bounds the console and QEMU logs in RunDir while the machine
	// runs (0: DefaultLogCap); see logring.go.
	LogCap int64
	// TBSizeMiB bounds TCG's translation cache (0: QEMU's default).
	TBSizeMiB int
	// Incoming starts QEMU waiting for a saved device state (LoadState)
	// instead of booting the kernel; the guest stays paused until Resume.
	Incoming bool
	// Idle starts QEMU under SCHED_IDLE (sched.go), for a machine started
	// ahead of need; Machine.Prioritize ends it.
	Idle bool
	// PrivateMemory maps MemFile copy-on-write (MAP_PRIVATE): the guest's
	// writes stay in this process and the file is never modified, so many
	// machines can restore from one frozen memory image.
	PrivateMemory bool
	// NoFreePageReporting turns off the balloon's free page reporting, by
	// which the guest hands pages it frees back to the host (on by
	// default). Saved state only loads into a machine with the same setting.
	NoFreePageReporting bool
	// User, when set, is the unprivileged user QEMU switches to once it
	// has opened its files and devices (-runas): a user name, or
	// "uid:gid" (ids no user need have, as Firecracker's jailer takes).
	User string
	// RunWithUser drops privileges with -run-with user= (QEMU 9.1 and
	// later, see QEMUInfo.RunWithUser) instead of -runas.
	RunWithUser bool
	// NetNS, when set, is the network namespace (a file such as
	// /run/netns/<name>) QEMU is started in: the sandbox's own, so that
	// QEMU itself reaches nothing of the host's network (not even the
	// node's API on the host's loopback). Its tap is handed in open.
	NetNS string
	// Cgroup, when set, names a cgroup of its own the QEMU process is put
	// in at start, bounded by Limits (see PlaceInCgroup).
	Cgroup string
	Limits Limits
	// Jail, when Jail.Hide is set, starts QEMU in a mount namespace of its
	// own that shows only Jail.Keep of Jail.Hide.
	Jail Jail

	// VolumeSlots is the number of disk slots for volumes the machine has
	// beside its root disk: virtio-blk devices with serial VolumeSerial(i),
	// each holding Volumes[i] or, when that is empty or missing, nothing:
	// SlotCapacity bytes that read as zeros and drop what is written (no
	// host file a guest could fill). A guest sees a slot's capacity as
	// it was when it booted, so a volume fits a slot that booted empty;
	// the number is part of the machine's layout (saved state loads only
	// into a machine with as many slots).
	VolumeSlots int
	// Volumes are the qcow2 disks of the filled slots, by slot.
	Volumes []string

	// Set by Start: the descriptors the disks are inherited as (see User):
	// the root disk's read-write and read-only one, in fdset rootFdset.
	rootDiskFDs [2]int
	slotFDs     []int
}

// SlotCapacity is the size of an empty volume slot: a volume's filesystem
// may be at most this large.
const SlotCapacity = 1 << 40

// VolumeSerial is the serial number a guest reads from the disk in volume
// slot i (/sys/block/vdX/serial).
func VolumeSerial(i int) string { return "aenv-vol" + strconv.Itoa(i) }

// volume is the disk in volume slot i ("": none).
func (c *Config) volume(i int) string {
	if i < len(c.Volumes) {
		return c.Volumes[i]
	}
	return ""
}

// Paths inside RunDir.
const (
	QMPSocketName = "qmp.sock"
	ConsoleName   = "console.log"
	QEMULogName   = "qemu.log"
	PIDFileName   = "qemu.pid"
)

func (c *Config) validate() error {
	var missing []string
	for name, p := range map[string]string{"kernel": c.Kernel, "initrd": c.Initrd, "root disk": c.RootDisk} {
		if p == "" {
			missing = append(missing, name+" (not set)")
			continue
		}
		if _, err := os.Stat(p); err != nil {
			missing = append(missing, fmt.Sprintf("%s %s", name, p))
		}
	}
	if len(missing) > 0 {
		return fmt.Errorf("vm files missing: %s", strings.Join(missing, ", "))
	}
	if len(c.Volumes) > c.VolumeSlots {
		return fmt.Errorf("%d volumes for %d volume slots", len(c.Volumes), c.VolumeSlots)
	}
	if c.VCPUs < 1 || c.MemoryMiB < 64 {
		return fmt.Errorf("invalid vm size: %d vCPUs, %d MiB", c.VCPUs, c.MemoryMiB)
	}
	if c.RunDir == "" || c.MemFile == "" {
		return errors.New("vm run dir and memory file must be set")
	}
	return nil
}

// FindQEMU returns the path of qemu-system-x86_64 or an error saying how to
// install it.
func FindQEMU(explicit string) (string, error) {
	name := explicit
	if name == "" {
		name = "qemu-system-x86_64"
	}
	p, err := exec.LookPath(name)
	if err != nil {
		return "", fmt.Errorf("QEMU not found (%s): install it with `apt-get install qemu-system-x86 qemu-utils` or run scripts/setup", name)
	}
	return p, nil
}

// Args returns QEMU's command line arguments (without the binary). The tap
// file, when present, is passed as file descriptor 3.
func (c *Config) Args() []string {
	accel := string(c.Accel)
	if c.Accel == AccelTCG {
		accel = "tcg,thread=multi"
		if c.TBSizeMiB > 0 {
			accel += ",tb-size=" + strconv.Itoa(c.TBSizeMiB)
		}
	}
	cpu := "max"
	if c.Accel == AccelKVM {
		cpu = "host"
	}
	mem := strconv.Itoa(c.MemoryMiB) + "M"
	args := []string{
		"-name", namePrefix + filepath.Base(c.RunDir),
		"-M", "microvm,x-option-roms=off,isa-serial=on,rtc=on,memory-backend=mem",
		"-accel", accel,
		"-cpu", cpu,
		"-smp", strconv.Itoa(c.VCPUs),
		"-m", mem,
		"-object", "memory-backend-file,id=mem,size=" + mem + ",mem-path=" + c.MemFile + ",share=" + onOff(!c.PrivateMemory),
		"-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
		// QEMU's seccomp filter: no obsolete syscalls, no fork/exec, no
		// scheduler or NUMA control from a compromised QEMU, and no
		// privilege changes (but the one drop to User, after which there is
		// nothing to regain).
		"-sandbox", "on,obsolete=deny,elevateprivileges=" + c.privilegeChanges() + ",spawn=deny,resourcecontrol=deny",
		"-kernel", c.Kernel,
		"-initrd", c.Initrd,
		"-append", c.Cmdline,
		"-chardev", "file,id=console,append=on,path=" + filepath.Join(c.RunDir, ConsoleName),
		"-serial", "chardev:console",
	}
	args = append(args, c.rootDiskArgs()...)
	args = append(args,
		"-device", "virtio-blk-device,drive="+rootDriveID,
		"-object", "rng-random,id=rng,filename=/dev/urandom",
		"-device", "virtio-rng-device,rng=rng",
		"-device", "virtio-balloon-device,free-page-reporting="+onOff(!c.NoFreePageReporting),
		"-qmp", "unix:"+filepath.Join(c.RunDir, QMPSocketName)+",server=on,wait=off",
		"-pidfile", filepath.Join(c.RunDir, PIDFileName),
	)
	switch {
	case c.User != "" && c.RunWithUser:
		args = append(args, "-run-with", "user="+c.User)
	case c.User != "":
		args = append(args, "-runas", c.User)
	}
	if c.Incoming {
		args = append(args, "-S", "-incoming", "defer")
	}
	if c.Tap != nil {
		nic := "virtio-net-device,netdev=net0"
		if c.MAC != "" {
			nic += ",mac=" + c.MAC
		}
		args = append(args, "-netdev", "tap,id=net0,fd=3", "-device", nic)
	}
	// The slots come last, so a machine without any has the layout
	// machines had before slots existed.
	for i := 0; i < c.VolumeSlots; i++ {
		id := "vol" + strconv.Itoa(i)
		disk := "driver=null-co,size=" + strconv.FormatInt(SlotCapacity, 10) + ",read-zeroes=on"
		if f := c.volume(i); f != "" {
			if i < len(c.slotFDs) && c.slotFDs[i] > 0 {
				f = "/proc/self/fd/" + strconv.Itoa(c.slotFDs[i])
			}
			disk = "file=" + f + ",format=qcow2"
		}
		args = append(args,
			"-drive", "id="+id+","+disk+",if=none,cache=writeback,discard=unmap",
			"-device", "virtio-blk-device,drive="+id+",serial="+VolumeSerial(i))
	}
	return args
}

// rootDiskFile is the name QEMU opens the root disk by.
func (c *Config) rootDiskFile() string {
	if c.rootDiskFDs[0] > 0 {
		return "/dev/fdset/" + strconv.Itoa(rootFdset)
	}
	return c.RootDisk
}

// rootDiskArgs are the root disk's drive and, when it is inherited, the
// fdset it opens.
func (c *Config) rootDiskArgs() []string {
	var args []string
	if c.rootDiskFDs[0] > 0 {
		for i, opaque := range []string{fdRW, fdRO} {
			args = append(args, "-add-fd", "fd="+strconv.Itoa(c.rootDiskFDs[i])+",set="+strconv.Itoa(rootFdset)+",opaque="+opaque)
		}
	}
	return append(args, "-drive", "id="+rootDriveID+",node-name="+rootImageNode+",file.node-name="+rootFileNode+
		",file="+c.rootDiskFile()+c.rootDiskLocking()+",format=qcow2,if=none,cache=writeback,discard=unmap")
}

// rootDiskLocking turns QEMU's image locking off for an inherited root
// disk: QEMU takes its locks on open file descriptions, and those of an
// fdset outlive the duplicates QEMU closes, so the read-write lock of the
// set's first open would stand against its own reopen after a migration
// ("Failed to get write lock" on cont after a migration). Nothing but the
// sandbox's QEMU writes its overlay while it runs (the node only reads it
// then, with qemu-img's force-share, and copies it).
func (c *Config) rootDiskLocking() string {
	if c.rootDiskFDs[0] > 0 {
		return ",file.locking=off"
	}
	return ""
}

// rootFdset is the fdset the root disk is inherited in; the opaque labels
// say which descriptor of a set is writable.
const (
	rootFdset = 1
	fdRW      = "rw"
	fdRO      = "ro"
)

func (c *Config) privilegeChanges() string {
	if c.User != "" {
		return "allow"
	}
	return "deny"
}

// rootDriveID names the root disk's drive in QEMU.
const rootDriveID = "root"

// Machine is a running QEMU process.
type Machine struct {
	pid    int
	runDir string
	qmp    *QMP
	// uid and gid QEMU runs as (-1: root): the migration sockets are
	// handed to them.
	uid, gid int
	// CgroupErr says why the machine runs without its cgroup limits;
	// CgroupBeforeGuest that it was in its cgroup before the guest ran an
	// instruction (see Start).
	CgroupErr         error
	CgroupBeforeGuest bool

	exited  chan struct{}
	exitMu  sync.Mutex
	exitErr error
}

// Start launches QEMU for cfg and connects to its QMP socket. QEMU runs in its
// own session so that it survives a restart of the calling process; the
// caller re-adopts it with Attach.
func Start(ctx context.Context, cfg Config) (*Machine, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	bin, err := FindQEMU(cfg.QEMU)
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(cfg.RunDir, 0o700); err != nil {
		return nil, fmt.Errorf("create run dir: %w", err)
	}
	_ = os.Remove(filepath.Join(cfg.RunDir, QMPSocketName))
	logf, err := os.OpenFile(filepath.Join(cfg.RunDir, QEMULogName), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return nil, fmt.Errorf("open qemu log: %w", err)
	}
	defer logf.Close()
	var extra []*os.File
	if cfg.Tap != nil {
		extra = append(extra, cfg.Tap)
	}
	uid, gid := -1, -1
	if cfg.User != "" {
		if uid, gid, err = lookupUser(cfg.User); err != nil {
			return nil, err
		}
		// QEMU reopens its disk when a migration ends (read-only, then
		// read-write again), by then as its user, who may not walk the
		// root-only directories to it: it inherits the disk as an fdset
		// of two descriptors, one per access mode, and each open of
		// /dev/fdset/N duplicates the one that matches. It owns no file,
		// and a seal can take the writable one away (ReleaseSealed).
		rw, err := os.OpenFile(cfg.RootDisk, os.O_RDWR, 0)
		if err != nil {
			return nil, err
		}
		defer rw.Close()
		ro, err := os.Open(cfg.RootDisk)
		if err != nil {
			return nil, err
		}
		defer ro.Close()
		cfg.rootDiskFDs = [2]int{3 + len(extra), 4 + len(extra)}
		extra = append(extra, rw, ro)
	}
	// Volumes' disks live outside what a jailed QEMU sees: it inherits
	// them too (owning them while it runs, when it drops to a user).
	cfg.slotFDs = make([]int, len(cfg.Volumes))
	for i, p := range cfg.Volumes {
		if p == "" {
			continue
		}
		disk, err := os.OpenFile(p, os.O_RDWR, 0)
		if err != nil {
			return nil, fmt.Errorf("volume slot %d: %w", i, err)
		}
		defer disk.Close()
		if uid >= 0 {
			if err := disk.Chown(uid, gid); err != nil {
				return nil, fmt.Errorf("volume slot %d: %w", i, err)
			}
		}
		cfg.slotFDs[i] = 3 + len(extra)
		extra = append(extra, disk)
	}
	// The cgroup exists, with its limits, before QEMU does: QEMU is made
	// in it, or the jail step joins it and only then becomes QEMU, or (a
	// machine waiting for its state, cgroup v1) it is moved in before the
	// guest can run.
	var cg *Cgroup
	var cgErr error
	if cfg.Cgroup != "" {
		// Limits are best effort: a host whose cgroups are read-only
		// (an unprivileged container) still runs sandboxes.
		cg, cgErr = PrepareCgroup(cfg.Cgroup, cfg.Limits)
	}
	// How the process gets into its cgroup: on cgroup v2 it is made in it
	// (clone3 with CLONE_INTO_CGROUP), no migration of a running process,
	// which cgroup v1 pays for in the jail step or, below, in Start.
	const (
		jailJoins = iota
		madeInto
		movedIn
	)
	command := func(how int) (*exec.Cmd, func(), error) {
		joins := cg
		if how != jailJoins {
			joins = nil
		}
		jail := cfg.Jail
		// QEMU opens its kernel and initrd, and its migration sockets
		// and device-state files in the temporary directory (state.go).
		jail.Need = append(slices.Clip(jail.Need), cfg.Kernel, cfg.Initrd, os.TempDir())
		cmd, err := jailCommand(bin, cfg.Args(), joins, jail)
		if err != nil {
			return nil, nil, err
		}
		cmd.Stdout = logf
		cmd.Stderr = logf
		cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
		if cfg.Jail.Hide != "" {
			// A mount namespace of its own, every mount in it private (Go's
			// fork makes / recursively private), for the jail step to fill.
			cmd.SysProcAttr.Unshareflags = syscall.CLONE_NEWNS
		}
		cmd.ExtraFiles = extra
		if how != madeInto {
			return cmd, func() {}, nil
		}
		done, err := cloneInto(cmd, cg.Dirs[0])
		return cmd, done, err
	}
	into := cg != nil && cgroupV2()
	// On cgroup v1 a process joins by migrating, and the kernel makes the
	// first migration into a hierarchy wait for an RCU grace period
	// (7-15 ms measured here), which the jail step would pay before QEMU
	// began. A machine that waits for its state runs no guest instruction
	// until LoadState, after Start: its QEMU is moved in here, while it
	// initialises, and is in its cgroup before Start returns. A boot
	// starts its guest at once, so its jail step joins first.
	how := jailJoins
	switch {
	case into:
		how = madeInto
	case cg != nil && cfg.Incoming:
		how = movedIn
	}
	cmd, done, err := command(how)
	if err == nil {
		err = startIn(cfg.NetNS, cfg.Idle, cmd)
		done()
	}
	if err != nil && into {
		// A kernel without CLONE_INTO_CGROUP (before 5.7): the jail step
		// joins the cgroup instead.
		if cmd, done, err = command(jailJoins); err == nil {
			err = startIn(cfg.NetNS, cfg.Idle, cmd)
			done()
		}
	}
	if err != nil {
		if cg != nil {
			cg.Remove()
		}
		return nil, fmt.Errorf("start qemu: %w", err)
	}
	m := &Machine{pid: cmd.Process.Pid, runDir: cfg.RunDir, exited: make(chan struct{}), uid: uid, gid: gid}
	go func() {
		err := cmd.Wait()
		m.setExited(err)
	}()
	joined := make(chan error, 1)
	if how == movedIn {
		go func() { joined <- cg.Join(m.pid) }()
	} else {
		joined <- nil
	}
	err = m.connect(ctx, qmpWait(cfg.Idle))
	joinErr := <-joined
	if err != nil {
		_ = m.Kill()
		<-m.exited
		if cg != nil {
			cg.Remove()
		}
		return nil, fmt.Errorf("%w%s", err, m.logTail())
	}
	// QMP answers, so QEMU runs and the jail step is behind it: it either
	// joined the cgroup before QEMU began (or was made in it, or was moved
	// in above), or could not (read-only cgroups; the jail step's reason
	// is in QEMU's log).
	switch {
	case cgErr != nil:
		m.CgroupErr = cgErr
	case joinErr != nil:
		m.CgroupErr = joinErr
	case cg != nil && !cg.Holds(m.pid):
		m.CgroupErr = fmt.Errorf("QEMU did not join its cgroup before starting%s", m.logTail())
	case cg != nil:
		m.CgroupBeforeGuest = true
	}
	m.boundLogs(cfg.LogCap)
	return m, nil
}

// Attach re-adopts a QEMU process started earlier (by this or a previous
// process) from its run directory, holding its logs to logCap (0:
// DefaultLogCap).
func Attach(ctx context.Context, runDir string, logCap int64) (*Machine, error) {
	b, err := os.ReadFile(filepath.Join(runDir, PIDFileName))
	if err != nil {
		return nil, fmt.Errorf("read qemu pid file: %w", err)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		return nil, fmt.Errorf("parse qemu pid file: %w", err)
	}
	if !isQEMU(pid, runDir) {
		return nil, fmt.Errorf("process %d is not the QEMU of %s", pid, runDir)
	}
	pidfd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		return nil, fmt.Errorf("open pidfd for qemu %d: %w", pid, err)
	}
	m := &Machine{pid: pid, runDir: runDir, exited: make(chan struct{}), uid: -1, gid: -1}
	if uid, gid, err := processOwner(pid); err == nil && uid != 0 {
		m.uid, m.gid = uid, gid
	}
	go func() {
		defer unix.Close(pidfd)
		fds := []unix.PollFd{{Fd: int32(pidfd), Events: unix.POLLIN}}
		for {
			if _, err := unix.Poll(fds, -1); err != nil && err != unix.EINTR {
				break
			}
			if fds[0].Revents != 0 {
				break
			}
		}
		m.setExited(errors.New("qemu exited"))
	}()
	if err := m.connect(ctx, qmpWait(false)); err != nil {
		return nil, err
	}
	m.boundLogs(logCap)
	return m, nil
}

// namePrefix starts the QEMU -name of every machine, followed by the base
// name of its run dir; it is how processes are recognised after a restart.
const namePrefix = "aenv:"

// isQEMU reports whether pid is a live QEMU process whose command line names
// runDir, so that a recycled pid is never mistaken for ours.
func isQEMU(pid int, runDir string) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	if err != nil {
		return false
	}
	cmdline := string(b)
	return strings.Contains(cmdline, "qemu-system") && strings.Contains(cmdline, namePrefix+filepath.Base(runDir))
}

// Running maps the pids of live QEMU processes started by this package with
// run dirs directly under runRoot to the base names of those run dirs.
func Running(runRoot string) map[int]string {
	out := map[int]string{}
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile("/proc/" + e.Name() + "/cmdline")
		if err != nil {
			continue
		}
		args := bytes.Split(b, []byte{0})
		if len(args) == 0 || !strings.Contains(string(args[0]), "qemu-system") || !bytes.Contains(b, []byte(runRoot+"/")) {
			continue
		}
		for i := 0; i+1 < len(args); i++ {
			if string(args[i]) == "-name" && bytes.HasPrefix(args[i+1], []byte(namePrefix)) {
				out[pid] = string(args[i+1][len(namePrefix):])
			}
		}
	}
	return out
}

// KillStray kills a QEMU no Machine handle is held for (found by Running,
// or a pid recorded earlier), after checking the pid still belongs to the
// machine of runDir, and waits for it to disappear.
func KillStray(pid int, runDir string) {
	if !isQEMU(pid, runDir) {
		return
	}
	_ = unix.Kill(pid, unix.SIGKILL)
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		if err := unix.Kill(pid, 0); err == unix.ESRCH {
			return
		}
		// A zombie child of ours: reap it.
		var ws unix.WaitStatus
		if wpid, _ := unix.Wait4(pid, &ws, unix.WNOHANG, nil); wpid == pid {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func (m *Machine) connect(ctx context.Context, wait time.Duration) error {
	cctx, cancel := context.WithTimeout(ctx, wait)
	defer cancel()
	type res struct {
		q   *QMP
		err error
	}
	ch := make(chan res, 1)
	go func() {
		q, err := DialQMP(cctx, filepath.Join(m.runDir, QMPSocketName))
		ch <- res{q, err}
	}()
	select {
	case r := <-ch:
		if r.err != nil {
			return r.err
		}
		m.qmp = r.q
		return nil
	case <-m.exited:
		cancel()
		return fmt.Errorf("qemu exited during start: %v", m.ExitErr())
	}
}

func (m *Machine) setExited(err error) {
	m.exitMu.Lock()
	m.exitErr = err
	m.exitMu.Unlock()
	close(m.exited)
}

func (m *Machine) logTail() string {
	b, err := ReadLogTail(filepath.Join(m.runDir, QEMULogName), 2000)
	if err != nil || len(b) == 0 {
		return ""
	}
	return ": qemu said: " + strings.TrimSpace(string(b))
}

// PID is the QEMU process id.
func (m *Machine) PID() int { return m.pid }

// Owner is the uid and gid QEMU runs as (-1, -1: root, it kept them).
func (m *Machine) Owner() (uid, gid int) { return m.uid, m.gid }

// RunDir is the directory holding the machine's sockets and logs.
func (m *Machine) RunDir() string { return m.runDir }

// Exited is closed when the QEMU process has exited.
func (m *Machine) Exited() <-chan struct{} { return m.exited }

// ExitErr is the QEMU process's exit status once Exited is closed.
func (m *Machine) ExitErr() error {
	m.exitMu.Lock()
	defer m.exitMu.Unlock()
	return m.exitErr
}

// QMP returns the machine's QMP connection.
func (m *Machine) QMP() *QMP { return m.qmp }

// Events returns QMP events (STOP, RESUME, SHUTDOWN, ...).
func (m *Machine) Events() <-chan Event { return m.qmp.Events() }

// Pause stops the guest's vCPUs.
func (m *Machine) Pause(ctx context.Context) error {
	_, err := m.qmp.Execute(ctx, "stop", nil)
	return err
}

// Resume continues the guest's vCPUs.
func (m *Machine) Resume(ctx context.Context) error {
	_, err := m.qmp.Execute(ctx, "cont", nil)
	return err
}

// CancelMigration stops a migration QEMU is running (its state going out).
func (m *Machine) CancelMigration(ctx context.Context) error {
	_, err := m.qmp.Execute(ctx, "migrate_cancel", nil)
	return err
}

// Status returns QEMU's run state ("running", "paused", ...).
func (m *Machine) Status(ctx context.Context) (string, error) {
	raw, err := m.qmp.Execute(ctx, "query-status", nil)
	if err != nil {
		return "", err
	}
	var st struct {
		Status string `json:"status"`
	}
	if err := json.Unmarshal(raw, &st); err != nil {
		return "", err
	}
	return st.Status, nil
}

// Shutdown asks the guest to power off (ACPI power button) and waits up to
// grace for QEMU to exit, then kills it.
func (m *Machine) Shutdown(ctx context.Context, grace time.Duration) error {
	if m.qmp != nil {
		_, _ = m.qmp.Execute(ctx, "system_powerdown", nil)
	}
	select {
	case <-m.exited:
		return nil
	case <-time.After(grace):
	case <-ctx.Done():
	}
	return m.Kill()
}

// Kill ends QEMU immediately and waits for it to exit.
func (m *Machine) Kill() error {
	select {
	case <-m.exited:
		return nil
	default:
	}
	if err := unix.Kill(m.pid, unix.SIGKILL); err != nil && err != unix.ESRCH {
		return fmt.Errorf("kill qemu %d: %w", m.pid, err)
	}
	select {
	case <-m.exited:
	case <-time.After(10 * time.Second):
		return fmt.Errorf("qemu %d did not exit after SIGKILL", m.pid)
	}
	if m.qmp != nil {
		_ = m.qmp.Close()
	}
	return nil
}

func onOff(b bool) string {
	if b {
		return "on"
	}
	return "off"
}

// lookupUser returns the uid and gid of a user name or of "uid:gid".
func lookupUser(name string) (int, int, error) {
	if us, gs, ok := strings.Cut(name, ":"); ok {
		uid, err1 := strconv.Atoi(us)
		gid, err2 := strconv.Atoi(gs)
		if err1 != nil || err2 != nil || uid <= 0 || gid <= 0 {
			return 0, 0, fmt.Errorf("QEMU user %q: want a name or uid:gid above 0", name)
		}
		return uid, gid, nil
	}
	u, err := user.Lookup(name)
	if err != nil {
		return 0, 0, fmt.Errorf("QEMU user %q: %w", name, err)
	}
	uid, err1 := strconv.Atoi(u.Uid)
	gid, err2 := strconv.Atoi(u.Gid)
	if err1 != nil || err2 != nil {
		return 0, 0, fmt.Errorf("QEMU user %q has no numeric ids", name)
	}
	return uid, gid, nil
}

// processOwner reads a process's real uid and gid.
func processOwner(pid int) (int, int, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		return 0, 0, err
	}
	uid, gid := -1, -1
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) >= 2 && f[0] == "Uid:" {
			uid, _ = strconv.Atoi(f[1])
		}
		if len(f) >= 2 && f[0] == "Gid:" {
			gid, _ = strconv.Atoi(f[1])
		}
	}
	if uid < 0 || gid < 0 {
		return 0, 0, fmt.Errorf("no Uid/Gid in /proc/%d/status", pid)
	}
	return uid, gid, nil
}
