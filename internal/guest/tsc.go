package guest

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// HostTSCkHz measures the host's time-stamp counter frequency in kHz.
//
// Under QEMU TCG a guest's RDTSC returns the host's TSC, but the guest
// kernel must calibrate its frequency against the emulated PIT, which fails
// now and then on a busy host ("tsc: Unable to calibrate against PIT …
// could not calculate TSC khz"); the guest then hangs early in boot, silently
// with "quiet" (seen in about 1 of 4 boots here while other VMs ran). Passing
// the frequency on the command line (Kernel.TimingParams) avoids that and
// gives the guest the TSC as its clocksource instead of jiffies.
func HostTSCkHz() (int, error) {
	if !haveTSC {
		return 0, errors.New("no TSC on this architecture")
	}
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil && !strings.Contains(string(b), " constant_tsc") {
		return 0, errors.New("host TSC is not constant (no constant_tsc flag)")
	}
	var samples []float64
	for i := 0; i < 3; i++ {
		t0, c0 := time.Now(), rdtsc()
		time.Sleep(40 * time.Millisecond)
		t1, c1 := time.Now(), rdtsc()
		khz := float64(c1-c0) / float64(t1.Sub(t0).Microseconds()) * 1000
		samples = append(samples, khz)
	}
	// The median of three rejects one disturbed sample.
	a, b, c := samples[0], samples[1], samples[2]
	best := max(min(a, b), min(max(a, b), c))
	if best < 100_000 || best > 10_000_000 {
		return 0, fmt.Errorf("implausible TSC frequency %.0f kHz", best)
	}
	return int(best + 0.5), nil
}

// HZ returns the kernel's CONFIG_HZ from its config file (boot/config-<version>
// beside the kernel image), or 250 (Debian's setting) when unknown.
func (k *Kernel) HZ() int {
	f, err := os.Open(filepath.Join(filepath.Dir(k.Vmlinuz), "config-"+k.Version))
	if err != nil {
		return 250
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "CONFIG_HZ="); ok {
			if n, err := strconv.Atoi(v); err == nil && n > 0 {
				return n
			}
		}
	}
	return 250
}

// TimingParams returns kernel parameters that spare a TCG guest its timer
// calibration, given the host TSC frequency (HostTSCkHz): the TSC frequency,
// the TSC as a reliable clocksource (under TCG the guest reads the host's
// constant, synchronised TSC), and loops_per_jiffy. Not for KVM guests,
// which get kvmclock.
func (k *Kernel) TimingParams(tscKHz int) []string {
	if tscKHz <= 0 {
		return nil
	}
	lpj := int64(tscKHz) * 1000 / int64(k.HZ())
	return []string{
		"tsc_early_khz=" + strconv.Itoa(tscKHz),
		"tsc=reliable",
		"lpj=" + strconv.FormatInt(lpj, 10),
	}
}

// BootArgs returns the extra kernel parameters every guest of this kernel
// gets: no PCI probing (microvm has no PCI bus) and, for emulated (TCG)
// guests, the timing parameters that avoid the flaky calibration. A host
// whose TSC cannot be measured boots without them.
func (k *Kernel) BootArgs(emulated bool) []string {
	args := []string{"pci=off"}
	if emulated {
		if khz, err := HostTSCkHz(); err == nil {
			args = append(args, k.TimingParams(khz)...)
		}
	}
	return args
}
