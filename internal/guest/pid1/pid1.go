// Package pid1 is the guest's PID 1: the init that the kernel runs from the
// initramfs built by package guest.
//
// The same static binary serves as init and as envd. The contract with
// cmd/envd is:
//
//	func main() {
//		if pid1.IsInit() {
//			pid1.Main() // never returns
//		}
//		if len(os.Args) > 1 && os.Args[1] == "serve" {
//			// run envd
//		}
//	}
//
// Main mounts /dev, /proc and /sys, loads the kernel modules listed in
// /lib/aenv/modules.order, mounts the root disk (aenv.root=, default
// /dev/vda) and switches into it, sets the hostname, configures lo and eth0
// from aenv.* kernel parameters, then runs `/proc/self/exe serve` (envd) as a
// supervised child, restarting it with backoff, reaping every orphan, and
// powering the machine off cleanly on SIGTERM, SIGINT, SIGPWR, Ctrl-Alt-Del
// or the ACPI power button.
package pid1

import (
	"fmt"
	"os"
	"os/signal"
	"runtime/debug"
	"strconv"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Paths inside the initramfs (written by guest.BuildInitramfs).
const (
	moduleOrderFile = "/lib/aenv/modules.order"
	moduleDir       = "/lib/aenv/modules"
	newRoot         = "/newroot"
)

// IsInit reports whether this process is PID 1, i.e. should run Main.
func IsInit() bool { return os.Getpid() == 1 }

// Main runs init. It never returns: it ends by powering the machine off.
func Main() {
	defer func() {
		if r := recover(); r != nil {
			fatal(fmt.Errorf("panic: %v\n%s", r, debug.Stack()))
		}
	}()
	// Until /dev is mounted, the kernel-provided stdio (/dev/console) is used.
	console = os.Stderr
	sigs := make(chan os.Signal, 32)
	signal.Notify(sigs, unix.SIGCHLD, unix.SIGTERM, unix.SIGINT, unix.SIGPWR, unix.SIGHUP)
	// Ctrl-Alt-Del sends SIGINT to init instead of rebooting at once.
	_ = unix.Reboot(unix.LINUX_REBOOT_CMD_CAD_OFF)
	logf("starting (pid %d)", os.Getpid())

	if err := earlyMounts(); err != nil {
		fatal(err)
	}
	openConsole()
	loadModules()

	raw, err := os.ReadFile("/proc/cmdline")
	if err != nil {
		fatal(fmt.Errorf("read /proc/cmdline: %w", err))
	}
	cfg, err := ParseCmdline(string(raw))
	if err != nil {
		logf("kernel command line: %v", err)
	}
	if err := mountRoot(cfg); err != nil {
		fatal(err)
	}
	if err := switchRoot(); err != nil {
		fatal(err)
	}
	setHostname(cfg)
	raiseNoFile()
	// envd binds the wildcard address, so it can start while eth0 is being
	// configured; under TCG this overlaps two ~100 ms steps.
	goSafe("network", func() {
		if err := setupNetwork(cfg); err != nil {
			logf("network: %v", err)
		}
	})
	power := make(chan string, 1)
	goSafe("power button", func() { watchPowerButton(power) })
	supervise(cfg, sigs, power)
}

// goSafe runs fn in a goroutine; a panic there is logged instead of
// killing PID 1 (which would panic the kernel).
func goSafe(name string, fn func()) {
	go func() {
		defer func() {
			if r := recover(); r != nil {
				logf("%s: panic: %v\n%s", name, r, debug.Stack())
			}
		}()
		fn()
	}()
}

// supervise runs envd, restarts it when it exits, reaps zombies and handles
// shutdown requests. It never returns.
func supervise(cfg Config, sigs <-chan os.Signal, power <-chan string) {
	const minBackoff, maxBackoff = 200 * time.Millisecond, 5 * time.Second
	backoff := minBackoff
	envdPid := 0
	var started time.Time
	restart := time.NewTimer(0)
	start := func() {
		pid, err := startEnvd(cfg)
		if err != nil {
			logf("start envd: %v (retrying in %s)", err, backoff)
			restart.Reset(backoff)
			backoff = min(2*backoff, maxBackoff)
			return
		}
		envdPid, started = pid, time.Now()
		logf("envd started (pid %d, port %d)", pid, cfg.EnvdPort)
	}
	for {
		select {
		case <-restart.C:
			if envdPid == 0 {
				start()
			}
		case reason := <-power:
			shutdown(reason)
		case s := <-sigs:
			switch s {
			case unix.SIGCHLD:
				for _, r := range reap() {
					if r.pid != envdPid {
						continue
					}
					envdPid = 0
					if time.Since(started) > 30*time.Second {
						backoff = minBackoff
					}
					logf("envd (pid %d) %s; restarting in %s", r.pid, describeWait(r.ws), backoff)
					restart.Reset(backoff)
					backoff = min(2*backoff, maxBackoff)
				}
			case unix.SIGHUP:
				// ignored (sent to init by the kernel on some console events)
			default:
				shutdown("signal " + s.String())
			}
		}
	}
}

type reaped struct {
	pid int
	ws  unix.WaitStatus
}

// reap collects every exited child without blocking.
func reap() []reaped {
	var out []reaped
	for {
		var ws unix.WaitStatus
		pid, err := unix.Wait4(-1, &ws, unix.WNOHANG, nil)
		if err == unix.EINTR {
			continue
		}
		if err != nil || pid <= 0 {
			return out
		}
		out = append(out, reaped{pid, ws})
	}
}

func describeWait(ws unix.WaitStatus) string {
	switch {
	case ws.Exited():
		return "exited with status " + strconv.Itoa(ws.ExitStatus())
	case ws.Signaled():
		return "killed by " + unix.SignalName(ws.Signal())
	}
	return fmt.Sprintf("ended (wait status %#x)", uint32(ws))
}

func startEnvd(cfg Config) (int, error) {
	null, err := os.OpenFile("/dev/null", os.O_RDWR, 0)
	if err != nil {
		return 0, fmt.Errorf("open /dev/null: %w", err)
	}
	defer null.Close()
	out := console
	if out == nil {
		out = null
	}
	env := []string{
		"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
		"HOME=/root",
		"LANG=C.UTF-8",
		"AENV_ENVD_PORT=" + strconv.Itoa(cfg.EnvdPort),
	}
	pid, err := syscall.ForkExec("/proc/self/exe", []string{"envd", "serve"}, &syscall.ProcAttr{
		Dir:   "/",
		Env:   env,
		Files: []uintptr{null.Fd(), out.Fd(), out.Fd()},
		Sys:   &syscall.SysProcAttr{Setsid: true},
	})
	if err != nil {
		return 0, fmt.Errorf("exec /proc/self/exe serve: %w", err)
	}
	return pid, nil
}

func raiseNoFile() {
	lim := unix.Rlimit{Cur: 1 << 20, Max: 1 << 20}
	if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &lim); err != nil {
		logf("raise RLIMIT_NOFILE: %v", err)
	}
}

// shutdown stops every process, unmounts and powers off. It never returns.
func shutdown(reason string) {
	logf("shutting down: %s", reason)
	_ = unix.Kill(-1, unix.SIGTERM)
	if !waitAllChildren(3 * time.Second) {
		logf("processes still running after SIGTERM; sending SIGKILL")
		_ = unix.Kill(-1, unix.SIGKILL)
		waitAllChildren(2 * time.Second)
	}
	powerOff()
}

// waitAllChildren reaps until init has no children left or d passes.
func waitAllChildren(d time.Duration) bool {
	deadline := time.Now().Add(d)
	for {
		reap()
		var ws unix.WaitStatus
		if _, err := unix.Wait4(-1, &ws, unix.WNOHANG, nil); err == unix.ECHILD {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func powerOff() {
	unix.Sync()
	unmountAll()
	unix.Sync()
	logf("power off")
	err := unix.Reboot(unix.LINUX_REBOOT_CMD_POWER_OFF)
	logf("power off failed: %v; halting", err)
	_ = unix.Reboot(unix.LINUX_REBOOT_CMD_HALT)
	// Exiting PID 1 makes the kernel panic with a visible message: better
	// than hanging silently.
	os.Exit(1)
}

// fatal reports an error that leaves the guest unusable and powers off.
func fatal(err error) {
	logf("FATAL: %v", err)
	for _, r := range reap() {
		_ = r
	}
	_ = unix.Kill(-1, unix.SIGKILL)
	powerOff()
}
