package orchestrator

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/agentenv/agentenv/internal/vmm"
)

// recover reconciles the database with what exists on the host after a
// restart: running sandboxes whose QEMU is still alive are re-adopted,
// sandboxes caught mid-operation are cleaned up, and anything on the host
// that no record owns (QEMU processes, namespaces, veths, directories) is
// removed.
func (n *Node) recover(ctx context.Context) error {
	all, err := n.loadSandboxes(ctx, "")
	if err != nil {
		return err
	}
	known := map[string]bool{}
	slots := map[string]bool{}
	for _, s := range all {
		switch s.State {
		case StateRunning:
			m, err := vmm.Attach(ctx, n.sandboxDir(s.ID))
			if err == nil {
				n.adopt(s.ID, m)
				known[s.ID] = true
				slots[fmt.Sprint(s.Slot)] = true
				n.log.Info("re-adopted running sandbox", "sandbox", s.ID, "pid", m.PID())
				continue
			}
			n.log.Warn("running sandbox lost its QEMU; removing it", "sandbox", s.ID, "err", err)
		case StatePaused:
			known[s.ID] = true
			slots[fmt.Sprint(s.Slot)] = true
			continue
		case StatePausing, StateResuming, StateForking, StateSnapshotting:
			// Interrupted in the middle of an operation: keep the sandbox in
			// the last state it can be trusted in.
			if to := n.recoverInterrupted(ctx, s); to != "" {
				known[s.ID] = true
				slots[fmt.Sprint(s.Slot)] = true
				n.log.Warn("sandbox was mid-operation at restart; recovered", "sandbox", s.ID, "was", s.State, "now", to)
				continue
			}
			n.log.Warn("sandbox was mid-operation at restart and cannot be recovered; removing it", "sandbox", s.ID, "state", s.State)
		default:
			n.log.Warn("sandbox was mid-operation at restart; removing it", "sandbox", s.ID, "state", s.State)
		}
		n.destroy(ctx, s)
	}

	for pid, id := range qemuProcesses(n.sandboxDir("") + "/") {
		if !known[id] {
			n.log.Warn("killing orphaned QEMU", "pid", pid, "sandbox", id)
			killStray(pid, n.sandboxDir(id))
		}
	}
	nss, err := n.net.Namespaces()
	if err != nil {
		return err
	}
	for _, ns := range nss {
		if id := n.net.NamespaceOwner(ns); !known[id] {
			n.log.Warn("removing orphaned network namespace", "netns", ns)
			if err := netns.DeleteNamed(ns); err != nil {
				n.log.Error("remove netns", "netns", ns, "err", err)
			}
		}
	}
	veths, err := n.net.HostVeths()
	if err != nil {
		return err
	}
	for _, v := range veths {
		if !slots[fmt.Sprint(n.net.VethSlot(v))] {
			if l, err := netlink.LinkByName(v); err == nil {
				n.log.Warn("removing orphaned veth", "veth", v)
				_ = netlink.LinkDel(l)
			}
		}
	}
	n.gcSnapshots(ctx)
	ents, err := os.ReadDir(filepath.Join(n.cfg.DataDir, "sandboxes"))
	if err != nil {
		return err
	}
	for _, e := range ents {
		if !known[e.Name()] {
			n.log.Warn("removing orphaned sandbox files", "dir", e.Name())
			_ = os.RemoveAll(filepath.Join(n.cfg.DataDir, "sandboxes", e.Name()))
		}
	}
	return nil
}

// qemuProcesses maps the pids of QEMU processes started by this node (named
// "aenv:<sandbox id>", with files under sandboxesDir) to their sandbox ids.
func qemuProcesses(sandboxesDir string) map[int]string {
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
		if len(args) == 0 || !strings.Contains(string(args[0]), "qemu-system") || !bytes.Contains(b, []byte(sandboxesDir)) {
			continue
		}
		for i := 0; i+1 < len(args); i++ {
			if string(args[i]) == "-name" && bytes.HasPrefix(args[i+1], []byte("aenv:")) {
				out[pid] = string(args[i+1][len("aenv:"):])
			}
		}
	}
	return out
}

// killStray kills a QEMU we do not hold a handle for, after checking that the
// pid still belongs to it, and waits for it to disappear.
func killStray(pid int, dir string) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	if err != nil || !strings.Contains(string(b), "aenv:"+filepath.Base(dir)) {
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

// recoverInterrupted brings a sandbox whose operation was cut short by a
// crash back to a stable state and returns it ("" when nothing can be
// trusted): a paused sandbox if its saved state is complete, else a running
// one if its QEMU is still alive (vCPUs continued, envd re-initialised).
func (n *Node) recoverInterrupted(ctx context.Context, s *Sandbox) State {
	dir := n.sandboxDir(s.ID)
	if s.State == StatePausing || s.State == StateResuming {
		if rec, err := readPauseRecord(dir); err == nil {
			if sum, err := fileSHA256(filepath.Join(dir, stateFileName)); err == nil && sum == rec.StateSHA256 {
				m, aerr := vmm.Attach(ctx, dir)
				if aerr == nil && s.State == StateResuming {
					// The resume got as far as a live QEMU: finish it.
					if n.finishInterruptedResume(ctx, s, m) {
						return StateRunning
					}
				} else if aerr == nil {
					_ = m.Kill()
				}
				if n.setFields(ctx, s.ID, "state = ?, pid = 0", StatePaused) == nil {
					return StatePaused
				}
				return ""
			}
		}
	}
	if m, err := vmm.Attach(ctx, dir); err == nil {
		if n.finishInterruptedResume(ctx, s, m) {
			return StateRunning
		}
	}
	if (s.State == StateForking || s.State == StateSnapshotting) && n.recoverFreeze(ctx, s) {
		return StatePaused
	}
	return ""
}

// finishInterruptedResume continues a live machine and re-initialises envd.
func (n *Node) finishInterruptedResume(ctx context.Context, s *Sandbox, m *vmm.Machine) bool {
	if st, err := m.Status(ctx); err != nil || (st != "running" && st != "paused") {
		_ = m.Kill()
		return false
	}
	if err := m.Resume(ctx); err != nil {
		_ = m.Kill()
		return false
	}
	n.adopt(s.ID, m)
	ep, err := n.endpoint(s)
	if err == nil {
		ictx, cancel := context.WithTimeout(ctx, 30*time.Second)
		err = initEnvd(ictx, ep.GuestAddr(EnvdPort), s)
		cancel()
	}
	if err != nil {
		n.mu.Lock()
		delete(n.machines, s.ID)
		n.mu.Unlock()
		_ = m.Kill()
		return false
	}
	return n.setFields(ctx, s.ID, "state = ?, pid = ?", StateRunning, m.PID()) == nil
}
