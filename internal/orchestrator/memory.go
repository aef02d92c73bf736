package orchestrator

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"

	"github.com/agentenv/agentenv/internal/sandboxes"
)

// ProcessMemory is the host memory of one process, from
// /proc/<pid>/smaps_rollup: RSS, its anonymous part, and PSS, which splits
// each shared page among the processes mapping it (so PSS sums to what a
// group of processes really costs the host).
type ProcessMemory struct {
	RSSBytes, AnonBytes, PSSBytes int64
}

// readProcessMemory reads a process's memory figures.
func readProcessMemory(pid int) (ProcessMemory, error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/smaps_rollup", pid))
	if err != nil {
		return ProcessMemory{}, err
	}
	defer f.Close()
	var m ProcessMemory
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 2 {
			continue
		}
		kb, err := strconv.ParseInt(fields[1], 10, 64)
		if err != nil {
			continue
		}
		switch fields[0] {
		case "Rss:":
			m.RSSBytes = kb << 10
		case "Pss:":
			m.PSSBytes = kb << 10
		case "Anonymous:":
			m.AnonBytes = kb << 10
		}
	}
	return m, sc.Err()
}

// clockTicks is the unit of /proc/<pid>/stat's CPU times (USER_HZ, 100
// on every Linux architecture this runs on).
const clockTicks = 100

// readProcessCPUSeconds reads the user and system CPU time a process has
// used from /proc/<pid>/stat (fields 14 and 15, counted after the command
// name, which may hold spaces and parentheses).
func readProcessCPUSeconds(pid int) (float64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	i := strings.LastIndexByte(string(b), ')')
	if i < 0 {
		return 0, fmt.Errorf("/proc/%d/stat: no command name", pid)
	}
	f := strings.Fields(string(b[i+1:]))
	// f[0] is field 3 (state): utime is field 14, stime 15.
	if len(f) < 13 {
		return 0, fmt.Errorf("/proc/%d/stat: %d fields", pid, len(f)+2)
	}
	utime, err1 := strconv.ParseInt(f[11], 10, 64)
	stime, err2 := strconv.ParseInt(f[12], 10, 64)
	if err1 != nil || err2 != nil {
		return 0, fmt.Errorf("/proc/%d/stat: CPU times %q %q", pid, f[11], f[12])
	}
	return float64(utime+stime) / clockTicks, nil
}

// SandboxMemory is what one running sandbox costs the host.
type SandboxMemory struct {
	ID, TemplateID string
	// GuestBytes is the sandbox's RAM size as the guest sees it.
	GuestBytes int64
	ProcessMemory
	// CPUSeconds is the CPU time (user and system) its QEMU has used.
	CPUSeconds float64
}

// NodeMemory reports the host's memory and each running sandbox's share.
type NodeMemory struct {
	TotalBytes, AvailableBytes int64
	Sandboxes                  []SandboxMemory
	// States counts the node's sandboxes by state.
	States map[sandboxes.State]int
}

// Memory reports the node's memory use.
func (n *Node) Memory(ctx context.Context) (*NodeMemory, error) {
	all, err := n.records.List(ctx, "")
	if err != nil {
		return nil, err
	}
	out := &NodeMemory{States: map[sandboxes.State]int{}}
	if out.TotalBytes, out.AvailableBytes, err = hostMemory(); err != nil {
		return nil, err
	}
	for _, s := range all {
		if s.State == sandboxes.Pooled {
			continue
		}
		out.States[s.State]++
		if s.State != sandboxes.Running || s.PID <= 0 {
			continue
		}
		pm, err := readProcessMemory(s.PID)
		if err != nil {
			continue // exited meanwhile
		}
		cpu, _ := readProcessCPUSeconds(s.PID)
		out.Sandboxes = append(out.Sandboxes, SandboxMemory{ID: s.ID, TemplateID: s.TemplateID,
			GuestBytes: int64(s.MemoryMiB) << 20, ProcessMemory: pm, CPUSeconds: cpu})
	}
	return out, nil
}

// hostMemory reads MemTotal and MemAvailable from /proc/meminfo.
func hostMemory() (total, available int64, err error) {
	b, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		return 0, 0, err
	}
	for _, line := range strings.Split(string(b), "\n") {
		fields := strings.Fields(line)
		if len(fields) < 2 {
			continue
		}
		kb, _ := strconv.ParseInt(fields[1], 10, 64)
		switch fields[0] {
		case "MemTotal:":
			total = kb << 10
		case "MemAvailable:":
			available = kb << 10
		}
	}
	return total, available, nil
}
