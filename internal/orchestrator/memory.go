package orchestrator

import (
	"context"
	"os"
	"strconv"
	"strings"

	"github.com/agentenv/agentenv/internal/procstat"
	"github.com/agentenv/agentenv/internal/sandboxes"
)

// SandboxMemory is what one running sandbox costs the host.
type SandboxMemory struct {
	ID, TemplateID string
	// GuestBytes is the sandbox's RAM size as the guest sees it.
	GuestBytes int64
	procstat.Memory
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
		pm, err := procstat.ReadMemory(s.PID)
		if err != nil {
			continue // exited meanwhile
		}
		cpu, _ := procstat.CPUSeconds(s.PID)
		out.Sandboxes = append(out.Sandboxes, SandboxMemory{ID: s.ID, TemplateID: s.TemplateID,
			GuestBytes: int64(s.MemoryMiB) << 20, Memory: pm, CPUSeconds: cpu})
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
