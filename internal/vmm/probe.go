package vmm

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
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

// QEMUInfo is what a probe of the QEMU binary found.
type QEMUInfo struct {
	Path    string
	Version QEMUVersion
	// Accels are the accelerators built in (`-accel help`).
	Accels []string
	// RunWith is whether the binary has the -run-with option (user=
	// replaces -runas since 9.1).
	RunWith bool
	// DevicesState is whether QMP has xen-save-devices-state.
	DevicesState bool
	// Seals is whether QMP has what Machine.Seal and ReleaseSealed use.
	Seals bool
	// Restacks is whether QMP has what Machine.Restack uses.
	Restacks bool
}

// SealsDisks reports whether live snapshots of this QEMU seal the disk's
// top in place (Machine.Seal) instead of copying it.
func (q QEMUInfo) SealsDisks() bool { return q.Seals }

// RestacksDisks reports whether a QEMU of this binary waiting for its
// state can have its root disk put on other images (Machine.Restack).
func (q QEMUInfo) RestacksDisks() bool { return q.Restacks }

// RunWithUser reports whether this QEMU drops privileges with
// `-run-with user=` rather than `-runas`.
func (q QEMUInfo) RunWithUser() bool { return q.RunWith }

// DiffCapture is how incremental snapshots of this QEMU find the changed
// pages of guest RAM: from the mapping's private pages when the binary can
// save its device state alone (xen-save-devices-state, in every QEMU
// build here since it is not tied to Xen), else by filtering a full
// migration.
func (q QEMUInfo) DiffCapture() DiffCapture {
	if q.DevicesState {
		return CapturePrivatePages
	}
	return CaptureMigration
}

// Supports says whether the binary can run guests on accel, and if not,
// what to do.
func (q QEMUInfo) Supports(accel Accel) error {
	if slices.Contains(q.Accels, string(accel)) {
		return nil
	}
	return fmt.Errorf("%s (QEMU %s) has no %s accelerator (it has %s): use a full qemu-system-x86_64 build (not the -microvm one, which has no TCG) or set AENV_ACCEL",
		q.Path, q.Version, accel, strings.Join(q.Accels, ", "))
}

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

// What the node needs of a QEMU beyond its version: the machine, the
// devices and the QMP commands and migration capability vmm uses.
var (
	neededMachines = []string{"microvm"}
	neededDevices  = []string{"virtio-blk-device", "virtio-net-device", "virtio-rng-device", "virtio-balloon-device"}
	neededCommands = []string{"stop", "cont", "query-status", "system_powerdown", "quit", "migrate", "migrate-incoming",
		"migrate-set-capabilities", "migrate-set-parameters", "query-migrate"}
	neededMigrationCaps = []string{"x-ignore-shared"}
	// sealCommands are what sealing a disk needs (without them live
	// snapshots copy the disk's top).
	sealCommands = []string{"add-fd", "remove-fd", "query-fdsets", "blockdev-add", "blockdev-del", "blockdev-snapshot", "query-block"}
	// restackCommands are what Machine.Restack needs.
	restackCommands = []string{"add-fd", "remove-fd", "blockdev-add", "blockdev-del", "blockdev-reopen", "query-block", "query-named-block-nodes"}
)

// probeCache keeps probes by binary (path, size, modification time): a
// node's tests open many nodes on one QEMU.
var probeCache = struct {
	sync.Mutex
	m map[string]QEMUInfo
}{m: map[string]QEMUInfo{}}

// ProbeQEMU finds the QEMU binary (explicit, or qemu-system-x86_64 in
// PATH), asks its version and refuses one older than MinimumQEMU, saying
// what to install. It then lists the binary's accelerators and asks it
// through QMP (started with `-M none`, so no guest runs) for its machines,
// virtio devices, QMP commands, migration capabilities and command-line
// options, and refuses a binary that lacks what the node uses, naming all
// of it.
func ProbeQEMU(ctx context.Context, explicit string) (QEMUInfo, error) {
	path, err := FindQEMU(explicit)
	if err != nil {
		return QEMUInfo{}, err
	}
	key := path
	if st, err := os.Stat(path); err == nil {
		key = fmt.Sprintf("%s|%d|%d", path, st.Size(), st.ModTime().UnixNano())
	}
	probeCache.Lock()
	info, ok := probeCache.m[key]
	probeCache.Unlock()
	if ok {
		return info, nil
	}
	ctx, cancel := context.WithTimeout(ctx, 20*time.Second)
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
	info = QEMUInfo{Path: path, Version: v}
	out, err = exec.CommandContext(ctx, path, "-accel", "help").Output()
	if err != nil {
		return QEMUInfo{}, fmt.Errorf("%s -accel help: %v", path, err)
	}
	info.Accels = ParseAccelHelp(string(out))
	if len(info.Accels) == 0 {
		return QEMUInfo{}, fmt.Errorf("%s -accel help lists no accelerator", path)
	}
	accel := info.Accels[0]
	if slices.Contains(info.Accels, string(AccelTCG)) {
		accel = string(AccelTCG)
	}
	cmd := exec.CommandContext(ctx, path, "-M", "none", "-accel", accel, "-nodefaults", "-no-user-config",
		"-display", "none", "-S", "-qmp", "stdio")
	cmd.Stdin = strings.NewReader(probeQMPInput)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err = cmd.Output()
	if err != nil {
		return QEMUInfo{}, fmt.Errorf("%s: asking it through QMP: %v: %s", path, err, lastLine(stderr.String()))
	}
	probe, err := ParseQMPProbe(out)
	if err != nil {
		return QEMUInfo{}, fmt.Errorf("%s: %w", path, err)
	}
	if missing := probe.Missing; len(missing) > 0 {
		return QEMUInfo{}, fmt.Errorf("%s (QEMU %s) lacks what sandboxes need: %s; install Debian's qemu-system-x86 or name another binary with --qemu",
			path, v, strings.Join(missing, ", "))
	}
	info.RunWith, info.DevicesState, info.Seals, info.Restacks = probe.RunWith, probe.DevicesState, probe.Seals, probe.Restacks
	probeCache.Lock()
	probeCache.m[key] = info
	probeCache.Unlock()
	return info, nil
}

// probeQMPInput is the QMP session of a probe; each answer carries its id.
const probeQMPInput = `{"execute":"qmp_capabilities","id":"caps"}
{"execute":"query-commands","id":"commands"}
{"execute":"query-migrate-capabilities","id":"migration"}
{"execute":"query-command-line-options","arguments":{"option":"run-with"},"id":"run-with"}
{"execute":"query-command-line-options","arguments":{"option":"sandbox"},"id":"sandbox"}
{"execute":"query-machines","id":"machines"}
{"execute":"qom-list-types","arguments":{"implements":"virtio-device"},"id":"devices"}
{"execute":"quit","id":"quit"}
`

// ParseAccelHelp reads `-accel help`: a header line, then one name a line.
func ParseAccelHelp(out string) []string {
	var accels []string
	for _, l := range strings.Split(out, "\n") {
		l = strings.TrimSpace(l)
		if l != "" && !strings.Contains(l, " ") && !strings.HasSuffix(l, ":") {
			accels = append(accels, l)
		}
	}
	return accels
}

// QMPProbe is what the probe's QMP session found: what of the node's
// needs is missing, whether -run-with exists, and whether the device state
// can be saved alone (QEMUInfo.DiffCapture) and disks sealed
// (QEMUInfo.SealsDisks).
type QMPProbe struct {
	Missing      []string
	RunWith      bool
	Seals        bool
	Restacks     bool
	DevicesState bool
}

// ParseQMPProbe reads the answers to probeQMPInput.
func ParseQMPProbe(out []byte) (QMPProbe, error) {
	var p QMPProbe
	answers := map[string]json.RawMessage{}
	failed := map[string]bool{}
	for _, line := range strings.Split(string(out), "\n") {
		var m struct {
			ID     string          `json:"id"`
			Return json.RawMessage `json:"return"`
			Error  json.RawMessage `json:"error"`
		}
		if json.Unmarshal([]byte(line), &m) != nil || m.ID == "" {
			continue
		}
		if m.Error != nil {
			failed[m.ID] = true
		}
		answers[m.ID] = m.Return
	}
	names := func(id string) (map[string]bool, error) {
		raw, ok := answers[id]
		if !ok && !failed[id] {
			return nil, fmt.Errorf("QMP gave no answer to %s", id)
		}
		var list []struct {
			Name       string `json:"name"`
			Capability string `json:"capability"`
			Alias      string `json:"alias"`
		}
		set := map[string]bool{}
		if failed[id] {
			return set, nil
		}
		if err := json.Unmarshal(raw, &list); err != nil {
			return nil, fmt.Errorf("QMP answer to %s: %v", id, err)
		}
		for _, e := range list {
			set[e.Name+e.Capability] = true
			if e.Alias != "" {
				set[e.Alias] = true
			}
		}
		return set, nil
	}
	for _, need := range []struct {
		id, what string
		names    []string
	}{
		{"machines", "machine", neededMachines},
		{"devices", "device", neededDevices},
		{"commands", "QMP command", neededCommands},
		{"migration", "migration capability", neededMigrationCaps},
	} {
		have, err := names(need.id)
		if err != nil {
			return QMPProbe{}, err
		}
		for _, n := range need.names {
			if !have[n] {
				p.Missing = append(p.Missing, need.what+" "+n)
			}
		}
		if need.id == "commands" {
			p.DevicesState = have["xen-save-devices-state"]
			p.Seals = true
			for _, c := range sealCommands {
				p.Seals = p.Seals && have[c]
			}
			p.Restacks = true
			for _, c := range restackCommands {
				p.Restacks = p.Restacks && have[c]
			}
		}
	}
	if failed["sandbox"] {
		p.Missing = append(p.Missing, "-sandbox (seccomp)")
	}
	p.RunWith = answers["run-with"] != nil && !failed["run-with"]
	return p, nil
}

func lastLine(s string) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	return lines[len(lines)-1]
}
