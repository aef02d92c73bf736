package guest

import (
	"fmt"
	"net/netip"
	"strconv"
	"strings"
)

// BootParams are the guest's boot-time settings, passed to its init on the
// kernel command line as aenv.* parameters (parsed by pid1.ParseCmdline).
type BootParams struct {
	Root     string       // root block device, default /dev/vda
	Hostname string       // optional
	IP       netip.Prefix // eth0 address with prefix length; zero: loopback only
	Gateway  netip.Addr   // default route; optional
	DNS      []netip.Addr // nameservers for /etc/resolv.conf; optional
	EnvdPort int          // default 49983
	// Console is the kernel console, default "ttyS0"; "none" leaves it out.
	Console string
	// Extra kernel parameters, appended as given.
	Extra []string
}

// KernelCmdline renders p as a kernel command line for the guest kernel:
// the console, options that suit a short-lived micro-VM (quiet, reboot
// rather than hang on panic), and the aenv.* parameters.
func (p BootParams) KernelCmdline() (string, error) {
	var a []string
	switch p.Console {
	case "":
		a = append(a, "console=ttyS0")
	case "none":
	default:
		a = append(a, "console="+p.Console)
	}
	// panic=-1: a kernel panic ends the VM at once instead of hanging.
	// pci=off: microvm has no PCI bus; skip probing for one.
	a = append(a, "quiet", "panic=-1", "pci=off")
	if p.Root != "" {
		if err := checkParam("aenv.root", p.Root); err != nil {
			return "", err
		}
		a = append(a, "aenv.root="+p.Root)
	}
	if p.Hostname != "" {
		if err := checkParam("aenv.hostname", p.Hostname); err != nil {
			return "", err
		}
		a = append(a, "aenv.hostname="+p.Hostname)
	}
	if p.IP.IsValid() {
		a = append(a, "aenv.ip="+p.IP.String())
	}
	if p.Gateway.IsValid() {
		if !p.IP.IsValid() {
			return "", fmt.Errorf("kernel cmdline: gateway %s without an address", p.Gateway)
		}
		a = append(a, "aenv.gw="+p.Gateway.String())
	}
	if len(p.DNS) > 0 {
		var ds []string
		for _, d := range p.DNS {
			ds = append(ds, d.String())
		}
		a = append(a, "aenv.dns="+strings.Join(ds, ","))
	}
	if p.EnvdPort != 0 {
		if p.EnvdPort < 0 || p.EnvdPort > 65535 {
			return "", fmt.Errorf("kernel cmdline: bad envd port %d", p.EnvdPort)
		}
		a = append(a, "aenv.envd_port="+strconv.Itoa(p.EnvdPort))
	}
	a = append(a, p.Extra...)
	return strings.Join(a, " "), nil
}

func checkParam(k, v string) error {
	if strings.ContainsAny(v, " \t\n\"") {
		return fmt.Errorf("kernel cmdline: %s=%q: must not contain spaces or quotes", k, v)
	}
	return nil
}
