package vmm

import (
	"context"
	"fmt"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"time"
)

// QEMUVersion is a QEMU release, e.g. 7.2.19.
type QEMUVersion struct{ Major, Minor, Micro int }

func (v QEMUVersion) String() string { return fmt.Sprintf("%d.%d.%d", v.Major, v.Minor, v.Micro) }

// AtLeast reports whether v is o or newer.
func (v QEMUVersion) AtLeast(o QEMUVersion) bool {
	if v.Major != o.Major {
		return v.Major > o.Major
	}
	if v.Minor != o.Minor {
		return v.Minor > o.Minor
	}
	return v.Micro >= o.Micro
}

// MinimumQEMU is the oldest QEMU the node runs: `-M microvm` with the
// devices and migration behaviour it relies on, and the migration stream
// format the RAM diffs read (ramdiff.go) were written against 7.2.
var MinimumQEMU = QEMUVersion{7, 2, 0}

// runWithSince is the first QEMU with `-run-with user=` (9.1), which
// replaces `-runas` (deprecated there, removed later).
var runWithSince = QEMUVersion{9, 1, 0}

// QEMUInfo is what a probe of the QEMU binary found.
type QEMUInfo struct {
	Path    string
	Version QEMUVersion
}

// RunWithUser reports whether this QEMU drops privileges with
// `-run-with user=` rather than `-runas`.
func (q QEMUInfo) RunWithUser() bool { return q.Version.AtLeast(runWithSince) }

var qemuVersionRE = regexp.MustCompile(`QEMU emulator version (\d+)\.(\d+)(?:\.(\d+))?`)

// ParseQEMUVersion reads the first line of `qemu-system-x86_64 --version`.
func ParseQEMUVersion(out string) (QEMUVersion, error) {
	m := qemuVersionRE.FindStringSubmatch(out)
	if m == nil {
		line, _, _ := strings.Cut(strings.TrimSpace(out), "\n")
		return QEMUVersion{}, fmt.Errorf("not a QEMU version: %q", line)
	}
	var v QEMUVersion
	v.Major, _ = strconv.Atoi(m[1])
	v.Minor, _ = strconv.Atoi(m[2])
	if m[3] != "" {
		v.Micro, _ = strconv.Atoi(m[3])
	}
	return v, nil
}

// ProbeQEMU finds the QEMU binary (explicit, or qemu-system-x86_64 in
// PATH), asks its version and refuses one older than MinimumQEMU, saying
// what to install.
func ProbeQEMU(ctx context.Context, explicit string) (QEMUInfo, error) {
	path, err := FindQEMU(explicit)
	if err != nil {
		return QEMUInfo{}, err
	}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, path, "--version").Output()
	if err != nil {
		return QEMUInfo{}, fmt.Errorf("%s --version: %v: is it a qemu-system-x86_64?", path, err)
	}
	v, err := ParseQEMUVersion(string(out))
	if err != nil {
		return QEMUInfo{}, fmt.Errorf("%s: %w", path, err)
	}
	if !v.AtLeast(MinimumQEMU) {
		return QEMUInfo{}, fmt.Errorf("%s is QEMU %s; AgentENV needs QEMU %d.%d or newer: install Debian 12's qemu-system-x86 (7.2) or a newer one, or name another binary with --qemu",
			path, v, MinimumQEMU.Major, MinimumQEMU.Minor)
	}
	return QEMUInfo{Path: path, Version: v}, nil
}
