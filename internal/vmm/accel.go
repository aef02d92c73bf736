package vmm

import (
	"fmt"
	"os"
	"strings"
)

// Accel is a QEMU accelerator.
type Accel string

const (
	AccelKVM Accel = "kvm"
	AccelTCG Accel = "tcg"
)

// ProbeResult says which accelerator to use and why.
type ProbeResult struct {
	Accel  Accel
	Reason string
}

// Warning returns a non-empty message when the chosen accelerator is only fit
// for development.
func (p ProbeResult) Warning() string {
	if p.Accel == AccelTCG {
		return "using QEMU TCG software emulation (" + p.Reason + "): sandboxes run 10-20x slower than on KVM; fine for development and tests, not for production"
	}
	return ""
}

// hostFacts are the inputs of the accelerator decision, separated so the
// decision can be table-tested.
type hostFacts struct {
	override    string // AENV_ACCEL
	cpuFlags    string // the "flags" line of /proc/cpuinfo
	kvmDevice   bool   // /dev/kvm exists
	kvmModules  []string
	modulesRead bool
}

// ProbeAccel decides between KVM and TCG. KVM is chosen only when /dev/kvm
// exists, the CPU advertises vmx or svm, and kvm_intel or kvm_amd is loaded:
// some hosts expose a /dev/kvm backed by a paravirtual implementation (for
// example kvm_pvm) under which ordinary guest kernels are fully emulated and
// far slower than TCG. AENV_ACCEL=kvm|tcg overrides the probe.
func ProbeAccel() ProbeResult {
	f := hostFacts{override: os.Getenv("AENV_ACCEL")}
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if strings.HasPrefix(line, "flags") {
				f.cpuFlags = line
				break
			}
		}
	}
	if _, err := os.Stat("/dev/kvm"); err == nil {
		f.kvmDevice = true
	}
	for _, m := range []string{"kvm_intel", "kvm_amd", "kvm_pvm"} {
		if _, err := os.Stat("/sys/module/" + m); err == nil {
			f.kvmModules = append(f.kvmModules, m)
		}
	}
	f.modulesRead = true
	return decideAccel(f)
}

func decideAccel(f hostFacts) ProbeResult {
	switch Accel(f.override) {
	case AccelKVM:
		return ProbeResult{AccelKVM, "forced by AENV_ACCEL=kvm"}
	case AccelTCG:
		return ProbeResult{AccelTCG, "forced by AENV_ACCEL=tcg"}
	}
	if !f.kvmDevice {
		return ProbeResult{AccelTCG, "/dev/kvm is missing"}
	}
	fields := strings.Fields(f.cpuFlags)
	hw := false
	for _, fl := range fields {
		if fl == "vmx" || fl == "svm" {
			hw = true
		}
	}
	if !hw {
		return ProbeResult{AccelTCG, "the CPU has no vmx/svm flag, so /dev/kvm cannot run ordinary guests at native speed" + moduleNote(f.kvmModules)}
	}
	for _, m := range f.kvmModules {
		if m == "kvm_intel" || m == "kvm_amd" {
			return ProbeResult{AccelKVM, "hardware virtualization via " + m}
		}
	}
	return ProbeResult{AccelTCG, "neither kvm_intel nor kvm_amd is loaded" + moduleNote(f.kvmModules)}
}

func moduleNote(mods []string) string {
	if len(mods) == 0 {
		return ""
	}
	return fmt.Sprintf(" (loaded: %s)", strings.Join(mods, ", "))
}
