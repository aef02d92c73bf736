package pid1

import (
	"fmt"
	"net"
	"os"
	"strings"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

func setHostname(cfg Config) {
	if cfg.Hostname == "" {
		return
	}
	if err := unix.Sethostname([]byte(cfg.Hostname)); err != nil {
		logf("set hostname %q: %v", cfg.Hostname, err)
		return
	}
	// Make the name resolvable locally, as most distributions do.
	hosts, _ := os.ReadFile("/etc/hosts")
	for _, l := range strings.Split(string(hosts), "\n") {
		f := strings.Fields(l)
		for _, name := range f[min(1, len(f)):] {
			if name == cfg.Hostname {
				return
			}
		}
	}
	if len(hosts) == 0 {
		hosts = []byte("127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n")
	}
	if len(hosts) > 0 && hosts[len(hosts)-1] != '\n' {
		hosts = append(hosts, '\n')
	}
	hosts = append(hosts, fmt.Sprintf("127.0.1.1\t%s\n", cfg.Hostname)...)
	if err := os.WriteFile("/etc/hosts", hosts, 0o644); err != nil {
		logf("write /etc/hosts: %v", err)
	}
}

// setupNetwork brings lo up and, when aenv.ip= is given, configures eth0
// with that address, a default route via aenv.gw= and /etc/resolv.conf
// from aenv.dns=.
func setupNetwork(cfg Config) error {
	lo, err := netlink.LinkByName("lo")
	if err != nil {
		return fmt.Errorf("find lo: %w", err)
	}
	if err := netlink.LinkSetUp(lo); err != nil {
		return fmt.Errorf("bring lo up: %w", err)
	}
	if !cfg.Network() {
		logf("no aenv.ip= on the kernel command line: loopback only")
		return nil
	}
	var eth netlink.Link
	deadline := time.Now().Add(10 * time.Second)
	for {
		if eth, err = netlink.LinkByName("eth0"); err == nil {
			break
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("eth0 did not appear (is virtio_net loaded and a NIC attached?): %w", err)
		}
		time.Sleep(10 * time.Millisecond)
	}
	ip := cfg.IP
	addr := &netlink.Addr{IPNet: &net.IPNet{IP: ip.Addr().AsSlice(), Mask: net.CIDRMask(ip.Bits(), ip.Addr().BitLen())}}
	if err := netlink.AddrReplace(eth, addr); err != nil {
		return fmt.Errorf("add %s to eth0: %w", ip, err)
	}
	if err := netlink.LinkSetUp(eth); err != nil {
		return fmt.Errorf("bring eth0 up: %w", err)
	}
	if cfg.Gateway.IsValid() {
		gw := cfg.Gateway
		route := &netlink.Route{
			LinkIndex: eth.Attrs().Index,
			Dst:       &net.IPNet{IP: net.IPv4zero, Mask: net.CIDRMask(0, 32)},
			Gw:        gw.AsSlice(),
		}
		if gw.Is6() {
			route.Dst = &net.IPNet{IP: net.IPv6zero, Mask: net.CIDRMask(0, 128)}
		}
		if !ip.Masked().Contains(gw) {
			route.Flags = int(netlink.FLAG_ONLINK)
		}
		if err := netlink.RouteReplace(route); err != nil {
			return fmt.Errorf("default route via %s: %w", gw, err)
		}
	}
	if len(cfg.DNS) > 0 {
		var b strings.Builder
		b.WriteString("# written by aenv-init from aenv.dns=\n")
		for _, d := range cfg.DNS {
			fmt.Fprintf(&b, "nameserver %s\n", d)
		}
		_ = os.Remove("/etc/resolv.conf") // may be a dangling symlink
		if err := os.WriteFile("/etc/resolv.conf", []byte(b.String()), 0o644); err != nil {
			return fmt.Errorf("write /etc/resolv.conf: %w", err)
		}
	}
	logf("eth0 %s gw %v dns %v", ip, cfg.Gateway, cfg.DNS)
	return nil
}
