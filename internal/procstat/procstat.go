// Package procstat reads from /proc what a host process costs: its memory
// (RSS, anonymous, PSS) and the CPU time it has used, alone or with its
// descendants.
package procstat

import (
	"bufio"
	"fmt"
	"os"
	"strconv"
	"strings"
)

// Memory is the host memory of one process, from
// /proc/<pid>/smaps_rollup: RSS, its anonymous part, and PSS, which splits
// each shared page among the processes mapping it (so PSS sums to what a
// group of processes really costs the host).
type Memory struct {
	RSSBytes, AnonBytes, PSSBytes int64
}

// ReadMemory reads a process's memory figures.
func ReadMemory(pid int) (Memory, error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/smaps_rollup", pid))
	if err != nil {
		return Memory{}, err
	}
	defer f.Close()
	var m Memory
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

// CPUSeconds reads the user and system CPU time a process has
// used from /proc/<pid>/stat (fields 14 and 15, counted after the command
// name, which may hold spaces and parentheses).
func CPUSeconds(pid int) (float64, error) {
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

// WalkTree calls fn for a process and each of its descendants (at most
// 4096), from /proc's children lists.
func WalkTree(pid int, fn func(pid int)) {
	seen := map[int]bool{}
	var walk func(p int)
	walk = func(p int) {
		if seen[p] || len(seen) > 4096 {
			return
		}
		seen[p] = true
		fn(p)
		if b, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%d/children", p, p)); err == nil {
			for _, c := range strings.Fields(string(b)) {
				if child, err := strconv.Atoi(c); err == nil {
					walk(child)
				}
			}
		}
	}
	walk(pid)
}

// TreePSS is the PSS of a process and its descendants (0 for what cannot
// be read).
func TreePSS(pid int) int64 {
	var total int64
	WalkTree(pid, func(p int) {
		if m, err := ReadMemory(p); err == nil {
			total += m.PSSBytes
		}
	})
	return total
}

// TreeCPUSeconds is the CPU time a process and its descendants have used.
func TreeCPUSeconds(pid int) float64 {
	var total float64
	WalkTree(pid, func(p int) {
		if s, err := CPUSeconds(p); err == nil {
			total += s
		}
	})
	return total
}
