package vmm

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"syscall"
)

// QEMU is not started directly: the process that becomes QEMU is first this
// program again (any binary linking this package), which sets up the jail
// and then replaces itself with QEMU (same pid), as Firecracker's jailer
// does for Firecracker. Today the jail step joins the sandbox's cgroup, so
// QEMU runs its first instruction already bounded; its network namespace
// was chosen at fork (startIn), its ids drop with -runas.

// jailEnv carries the jail step's instructions to the re-executed program.
const jailEnv = "AENV_VMM_JAIL"

type jailSpec struct {
	QEMU string `json:"qemu"`
	// CgroupProcs are the cgroup.procs files to write the process's pid to
	// (best effort: a host with read-only cgroups still runs sandboxes, and
	// the starter sees the process outside its cgroup).
	CgroupProcs []string `json:"cgroupProcs,omitempty"`
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
	err := syscall.Exec(js.QEMU, append([]string{js.QEMU}, os.Args[1:]...), os.Environ())
	fmt.Fprintf(os.Stderr, "aenv jail: exec %s: %v\n", js.QEMU, err)
	os.Exit(126)
}

// jailCommand is the command that starts QEMU bin with args through the
// jail step, joining cg first (nil: no cgroup).
func jailCommand(bin string, args []string, cg *Cgroup) (*exec.Cmd, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, fmt.Errorf("find this program for the jail step: %w", err)
	}
	js := jailSpec{QEMU: bin}
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
