// Package network owns sandbox networking on a node: one network namespace
// per sandbox holding the guest's tap device, a veth pair linking it to the
// host, NAT so every guest can use the same address, and nftables rules that
// keep guests away from the host, from each other and (when asked) from the
// internet.
package network

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"regexp"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"text/template"
	"time"
	"unsafe"

	"github.com/agentenv/agentenv/internal/egressproxy"
	"github.com/agentenv/agentenv/internal/mountinfo"
	"github.com/agentenv/agentenv/internal/nsthread"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// Fixed addresses inside every sandbox namespace. Clones of one sandbox must
// keep the guest's address and MAC, so they are the same everywhere.
var (
	GuestIP   = netip.MustParseAddr("169.254.0.21")
	TapIP     = netip.MustParseAddr("169.254.0.22")
	tapPrefix = 30
)

const (
	// GuestMAC is the MAC address of every guest NIC.
	GuestMAC = "02:ae:00:00:00:01"
	// TapMAC is the MAC address of every tap, the guest's gateway: the
	// same for every QEMU a guest runs in, so the gateway a restored guest
	// has in its neighbour table is still right.
	TapMAC = "02:ae:00:00:00:02"
	// TapName is the tap device inside each sandbox namespace.
	TapName = "tap0"
	// nsVethName is the namespace end of the veth pair.
	nsVethName = "veth0"
	// DefaultInstance prefixes the names of everything a node creates on the
	// host, so nodes (or test nodes) sharing a host never touch each other's.
	DefaultInstance = "aenv"
	// DefaultCIDR is the host-side range sandboxes' veth pairs are numbered from.
	DefaultCIDR = "10.213.0.0/16"
)

// Manager creates and removes sandbox networks on this host.
type Manager struct {
	cidr     netip.Prefix
	instance string
	// Set once before use (SetGuestServices).
	resolvers []netip.AddrPort
	open      []netip.Prefix
	log       *slog.Logger

	mu       sync.Mutex
	services map[string]*egressproxy.Sandbox // by namespace; guarded by mu
}

var tapMAC, guestMAC = mustMAC(TapMAC), mustMAC(GuestMAC)

func mustMAC(s string) net.HardwareAddr {
	mac, err := net.ParseMAC(s)
	if err != nil {
		panic(err)
	}
	return mac
}

var instanceRE = regexp.MustCompile(`^[a-z][a-z0-9]{0,5}$`)

// NewManager returns a manager numbering veth pairs from cidr (an IPv4 range
// of /8 to /28, e.g. DefaultCIDR) and naming host objects after instance
// (e.g. DefaultInstance: namespaces "aenv-<id>", veths "aenv-h<slot>").
func NewManager(cidr, instance string) (*Manager, error) {
	p, err := netip.ParsePrefix(cidr)
	if err != nil || !p.Addr().Is4() || p.Bits() > 28 || p.Bits() < 8 {
		return nil, fmt.Errorf("sandbox network range %q must be an IPv4 prefix between /8 and /28", cidr)
	}
	if !instanceRE.MatchString(instance) {
		return nil, fmt.Errorf("network instance name %q must match %s", instance, instanceRE)
	}
	return &Manager{cidr: p.Masked(), instance: instance, services: map[string]*egressproxy.Sandbox{}}, nil
}

// GuestServices configures what a node's sandbox networks give guests
// besides the firewall.
type GuestServices struct {
	// Resolvers are the nameservers the guests' DNS queries are forwarded
	// to (none: every query is refused).
	Resolvers []netip.AddrPort
	// Open are default-denied ranges this node opens to its guests as if
	// they were public (an internal package mirror, say).
	Open []netip.Prefix
	Log  *slog.Logger
}

// SetGuestServices configures the guest services; call it before any
// sandbox network is set up.
func (m *Manager) SetGuestServices(g GuestServices) {
	m.resolvers = slices.Clone(g.Resolvers)
	m.open = normalize(g.Open)
	m.log = g.Log
}

// Instance is the prefix of the manager's host objects.
func (m *Manager) Instance() string { return m.instance }

func (m *Manager) nsPrefix() string       { return m.instance + "-" }
func (m *Manager) hostVethPrefix() string { return m.instance + "-h" }
func (m *Manager) hostTable() string      { return m.instance + "_host" }

// NamespaceOwner returns the sandbox id of a namespace this manager names,
// or "" when the namespace is not one of its own.
func (m *Manager) NamespaceOwner(ns string) string {
	if id, ok := strings.CutPrefix(ns, m.nsPrefix()); ok {
		return id
	}
	return ""
}

// VethSlot returns the slot of a host veth this manager names, or -1.
func (m *Manager) VethSlot(name string) int {
	rest, ok := strings.CutPrefix(name, m.hostVethPrefix())
	if !ok {
		return -1
	}
	n, err := strconv.Atoi(rest)
	if err != nil || n < 0 {
		return -1
	}
	return n
}

// Slots is how many sandboxes the range can number.
func (m *Manager) Slots() int { return 1 << (32 - m.cidr.Bits() - 2) }

// Endpoint is one sandbox's network.
type Endpoint struct {
	Namespace string
	Slot      int
	// HostIP is the host end of the veth pair; NSIP the namespace end, which
	// the host uses to reach the guest (DNAT to GuestIP).
	HostIP   netip.Addr
	NSIP     netip.Addr
	HostVeth string
	// Internet and Egress are what the guest may reach (see Egress).
	Internet bool
	Egress   Egress
}

// GuestAddr returns the host-reachable address of a port in the guest.
func (e *Endpoint) GuestAddr(port int) string {
	return net.JoinHostPort(e.NSIP.String(), fmt.Sprint(port))
}

// Endpoint returns the addressing of a slot without creating anything.
func (m *Manager) Endpoint(id string, slot int, internet bool, egress Egress) (*Endpoint, error) {
	if slot < 0 || slot >= m.Slots() {
		return nil, fmt.Errorf("network slot %d out of range 0..%d", slot, m.Slots()-1)
	}
	base := m.cidr.Addr().As4()
	n := uint32(base[0])<<24 | uint32(base[1])<<16 | uint32(base[2])<<8 | uint32(base[3])
	n += uint32(slot) * 4
	ip := func(v uint32) netip.Addr {
		return netip.AddrFrom4([4]byte{byte(v >> 24), byte(v >> 16), byte(v >> 8), byte(v)})
	}
	return &Endpoint{
		Namespace: m.nsPrefix() + id,
		Slot:      slot,
		HostIP:    ip(n + 1),
		NSIP:      ip(n + 2),
		HostVeth:  fmt.Sprintf("%s%d", m.hostVethPrefix(), slot),
		Internet:  internet,
		Egress:    egress,
	}, nil
}

// EnsureHost prepares the host once per start: IP forwarding and the host
// firewall table that stops guests from reaching host services or each other
// and masquerades their internet traffic.
func (m *Manager) EnsureHost(ctx context.Context) error {
	if err := os.WriteFile("/proc/sys/net/ipv4/ip_forward", []byte("1\n"), 0o644); err != nil {
		return fmt.Errorf("enable ip forwarding: %w", err)
	}
	var buf bytes.Buffer
	if err := hostRules.Execute(&buf, map[string]string{"Table": m.hostTable(), "CIDR": m.cidr.String(), "Veth": m.hostVethPrefix() + "*"}); err != nil {
		return err
	}
	return nft(ctx, "", buf.String())
}

var hostRules = template.Must(template.New("host").Parse(`
table inet {{.Table}}
delete table inet {{.Table}}
table inet {{.Table}} {
	chain input {
		type filter hook input priority filter - 10; policy accept;
		iifname "{{.Veth}}" ct state established,related accept
		iifname "{{.Veth}}" drop
	}
	chain forward {
		type filter hook forward priority filter - 10; policy accept;
		iifname "{{.Veth}}" oifname "{{.Veth}}" drop
		oifname "{{.Veth}}" ct state established,related accept
		oifname "{{.Veth}}" drop
	}
	chain postrouting {
		type nat hook postrouting priority srcnat; policy accept;
		ip saddr {{.CIDR}} oifname != "{{.Veth}}" masquerade
	}
}
`))

// nsRules is a sandbox namespace's firewall. The guest's DNS goes to the
// node's resolver for it (package egressproxy) on the tap's address; with
// domain rules, the guest's HTTP and TLS connections that its rules would
// otherwise drop are redirected to the egress proxy, which connects them
// only for the names the rules allow. Nothing but the node itself (uid 0)
// sends from the namespace: not QEMU, which lives there too.
var nsRules = template.Must(template.New("ns").Parse(`
table ip aenv
delete table ip aenv
table ip aenv {
	chain prerouting {
		type nat hook prerouting priority dstnat; policy accept;
		iifname "{{.Veth}}" ip daddr {{.NSIP}} dnat to {{.Guest}}
{{- if .Domains}}
		iifname "{{.Tap}}" ip daddr {{.TapIP}} accept
{{- if .Allow}}
		iifname "{{.Tap}}" ip daddr { {{.Allow}} } accept
{{- end}}
{{- if .Internet}}
{{- if .Deny}}
		iifname "{{.Tap}}" tcp dport { 80, 443 } ip daddr { {{.Deny}} } redirect to :{{.ProxyPort}}
{{- end}}
{{- else}}
		iifname "{{.Tap}}" tcp dport { 80, 443 } redirect to :{{.ProxyPort}}
{{- end}}
{{- end}}
	}
	chain postrouting {
		type nat hook postrouting priority srcnat; policy accept;
		oifname "{{.Veth}}" ip saddr {{.Guest}} masquerade
	}
	chain input {
		type filter hook input priority filter; policy drop;
		iif "lo" accept
		ct state established,related accept
		iifname "{{.Tap}}" ip daddr {{.TapIP}} meta l4proto { tcp, udp } th dport 53 accept
{{- if .Domains}}
		iifname "{{.Tap}}" tcp dport {{.ProxyPort}} ct status dnat accept
{{- end}}
	}
	chain output {
		type filter hook output priority filter; policy accept;
		oif "lo" accept
		meta skuid != 0 drop
		oifname "{{.Veth}}" ip daddr { {{.Never}} } drop
{{- if .Open}}
		oifname "{{.Veth}}" ip daddr { {{.Open}} } accept
{{- end}}
		oifname "{{.Veth}}" ip daddr { {{.Defaults}} } drop
	}
	chain forward {
		type filter hook forward priority filter; policy drop;
		ct state established,related accept
		iifname "{{.Veth}}" oifname "{{.Tap}}" ip daddr {{.Guest}} accept
		iifname "{{.Tap}}" oifname "{{.Veth}}" ip daddr { {{.Never}} } drop
{{- if .Allow}}
		iifname "{{.Tap}}" oifname "{{.Veth}}" ip daddr { {{.Allow}} } accept
{{- end}}
{{- if .Internet}}
{{- if .Deny}}
		iifname "{{.Tap}}" oifname "{{.Veth}}" ip daddr { {{.Deny}} } drop
{{- end}}
{{- if .Open}}
		iifname "{{.Tap}}" oifname "{{.Veth}}" ip daddr { {{.Open}} } accept
{{- end}}
		iifname "{{.Tap}}" oifname "{{.Veth}}" ip daddr { {{.Defaults}} } drop
		iifname "{{.Tap}}" oifname "{{.Veth}}" accept
{{- end}}
	}
}
`))

// Setup creates the sandbox's namespace, veth pair, addresses, routes and
// firewall. On error everything it created is removed.
func (m *Manager) Setup(ctx context.Context, ep *Endpoint) (err error) {
	defer func() {
		if err != nil {
			_ = m.Teardown(ep)
		}
	}()
	ns, err := newNamedNS(ep.Namespace)
	if err != nil {
		return fmt.Errorf("create netns %s: %w", ep.Namespace, err)
	}
	defer ns.Close()
	nh, err := netlink.NewHandleAt(ns)
	if err != nil {
		return fmt.Errorf("netlink in %s: %w", ep.Namespace, err)
	}
	defer nh.Close()

	veth := &netlink.Veth{
		LinkAttrs:     netlink.LinkAttrs{Name: ep.HostVeth},
		PeerName:      nsVethName,
		PeerNamespace: netlink.NsFd(int(ns)),
	}
	_ = netlink.LinkDel(veth) // a leftover from a crash would block the name
	if err := netlink.LinkAdd(veth); err != nil {
		return fmt.Errorf("create veth %s: %w", ep.HostVeth, err)
	}
	host, err := netlink.LinkByName(ep.HostVeth)
	if err != nil {
		return fmt.Errorf("find veth %s: %w", ep.HostVeth, err)
	}
	if err := netlink.AddrAdd(host, addr(ep.HostIP, 30)); err != nil {
		return fmt.Errorf("address host veth: %w", err)
	}
	if err := netlink.LinkSetUp(host); err != nil {
		return fmt.Errorf("bring up host veth: %w", err)
	}
	lo, err := nh.LinkByName("lo")
	if err != nil {
		return fmt.Errorf("find lo in %s: %w", ep.Namespace, err)
	}
	if err := nh.LinkSetUp(lo); err != nil {
		return fmt.Errorf("bring up lo in %s: %w", ep.Namespace, err)
	}
	peer, err := nh.LinkByName(nsVethName)
	if err != nil {
		return fmt.Errorf("find %s in %s: %w", nsVethName, ep.Namespace, err)
	}
	if err := nh.AddrAdd(peer, addr(ep.NSIP, 30)); err != nil {
		return fmt.Errorf("address %s: %w", nsVethName, err)
	}
	if err := nh.LinkSetUp(peer); err != nil {
		return fmt.Errorf("bring up %s: %w", nsVethName, err)
	}
	gw := net.IP(ep.HostIP.AsSlice())
	if err := nh.RouteAdd(&netlink.Route{LinkIndex: peer.Attrs().Index, Gw: gw}); err != nil {
		return fmt.Errorf("default route in %s: %w", ep.Namespace, err)
	}
	if err := nsthread.Run(ns, func() error {
		return os.WriteFile("/proc/sys/net/ipv4/ip_forward", []byte("1\n"), 0o644)
	}); err != nil {
		return fmt.Errorf("enable forwarding in %s: %w", ep.Namespace, err)
	}
	if err := m.applyRules(ctx, ep); err != nil {
		return err
	}
	return m.serve(ns, ep)
}

// Attach starts the node's services for a sandbox network that exists
// already (a node restarting with its sandboxes): they live in the node.
func (m *Manager) Attach(ep *Endpoint) error {
	m.mu.Lock()
	running := m.services[ep.Namespace] != nil
	m.mu.Unlock()
	if running {
		return nil
	}
	ns, err := netns.GetFromName(ep.Namespace)
	if err != nil {
		return fmt.Errorf("open netns %s: %w", ep.Namespace, err)
	}
	defer ns.Close()
	return m.serve(ns, ep)
}

// Close stops every sandbox's resolver and egress proxy (the node is
// stopping; its sandboxes' namespaces and firewalls stay).
func (m *Manager) Close() {
	m.mu.Lock()
	all := m.services
	m.services = map[string]*egressproxy.Sandbox{}
	m.mu.Unlock()
	for _, svc := range all {
		svc.Close()
	}
}

// serve starts the sandbox's resolver and egress proxy on sockets opened in
// its namespace (they keep it alive until closed: Teardown closes them).
func (m *Manager) serve(ns netns.NsHandle, ep *Endpoint) error {
	var cfg egressproxy.Config
	err := nsthread.Run(ns, func() error {
		var err error
		if cfg.DNSPacket, err = net.ListenPacket("udp4", ":53"); err != nil {
			return err
		}
		if cfg.DNSStream, err = net.Listen("tcp4", ":53"); err != nil {
			cfg.DNSPacket.Close()
			return err
		}
		if cfg.Proxy, err = net.Listen("tcp4", fmt.Sprintf(":%d", ProxyPort)); err != nil {
			cfg.DNSPacket.Close()
			cfg.DNSStream.Close()
			return err
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("guest resolver and egress proxy in %s: %w", ep.Namespace, err)
	}
	name := ep.Namespace
	cfg.Resolvers = m.resolvers
	if m.log != nil {
		cfg.Log = m.log.With("sandbox", m.NamespaceOwner(name))
	}
	cfg.Dial = func(ctx context.Context, dst netip.AddrPort) (net.Conn, error) { return m.dialFrom(ctx, name, dst) }
	svc := egressproxy.Serve(cfg, m.policy(ep))
	m.mu.Lock()
	old := m.services[name]
	m.services[name] = svc
	m.mu.Unlock()
	if old != nil {
		old.Close()
	}
	return nil
}

// policy is what the resolver and proxy of ep allow.
func (m *Manager) policy(ep *Endpoint) egressproxy.Policy {
	e := ep.Egress
	return egressproxy.Policy{Domains: e.Domains, AnyName: ep.Internet,
		MayDial: func(dst netip.Addr) bool { return m.mayDial(e, dst) }}
}

// dialFrom connects from inside a sandbox's namespace, so the connection
// meets the namespace's firewall and the host's rules for sandboxes.
func (m *Manager) dialFrom(ctx context.Context, namespace string, dst netip.AddrPort) (net.Conn, error) {
	ns, err := netns.GetFromName(namespace)
	if err != nil {
		return nil, err
	}
	defer ns.Close()
	var c net.Conn
	err = nsthread.Run(ns, func() error {
		var d net.Dialer
		var err error
		c, err = d.DialContext(ctx, "tcp4", dst.String())
		return err
	})
	return c, err
}

// NamespacePath is the file of sandbox id's network namespace.
func (m *Manager) NamespacePath(id string) string {
	return "/run/netns/" + m.nsPrefix() + id
}

// Exists reports whether a sandbox's namespace is there (it goes with a
// host reboot; Setup makes it again).
func (m *Manager) Exists(ep *Endpoint) bool {
	h, err := netns.GetFromName(ep.Namespace)
	if err != nil {
		return false
	}
	h.Close()
	return true
}

// SetEgress replaces, atomically (one nftables transaction), what a
// sandbox's guest may reach.
func (m *Manager) SetEgress(ctx context.Context, ep *Endpoint, internet bool, egress Egress) error {
	ep.Internet, ep.Egress = internet, egress
	if err := m.applyRules(ctx, ep); err != nil {
		return err
	}
	m.mu.Lock()
	svc := m.services[ep.Namespace]
	m.mu.Unlock()
	if svc != nil {
		svc.SetPolicy(m.policy(ep))
	}
	return nil
}

func (m *Manager) applyRules(ctx context.Context, ep *Endpoint) error {
	never, allow, deny, open, defaults := m.forwardRules(ep.Egress)
	var buf bytes.Buffer
	if err := nsRules.Execute(&buf, map[string]any{
		"Veth": nsVethName, "Tap": TapName, "NSIP": ep.NSIP, "Guest": GuestIP, "TapIP": TapIP,
		"Internet": ep.Internet, "Never": never, "Allow": allow, "Deny": deny, "Open": open, "Defaults": defaults,
		"Domains": len(ep.Egress.Domains) > 0, "ProxyPort": ProxyPort,
	}); err != nil {
		return err
	}
	return nft(ctx, ep.Namespace, buf.String())
}

// TapMode says what the guest of a new tap knows of it.
type TapMode int

const (
	// GuestAsks: the guest may hold another gateway MAC than TapMAC (a
	// state saved before taps had a fixed MAC); the namespace asks the
	// guest's MAC (ARP) before its first packet to it, and the guest
	// learns the tap's from that request.
	GuestAsks TapMode = iota
	// GuestKnows: the guest has TapMAC as its gateway's, or none (a boot);
	// the namespace has the guest's MAC as a permanent neighbour and sends
	// at once, no ARP round trip through the guest first (11-30 ms of a
	// restore under TCG).
	GuestKnows
)

// OpenTap creates the namespace's tap device (if QEMU's previous one is gone)
// and returns an open queue for QEMU. The device lives as long as some
// process holds the file. Its MAC is TapMAC; mode says whether the guest's
// neighbour entry is set.
func (m *Manager) OpenTap(ep *Endpoint, mode TapMode) (*os.File, error) {
	ns, err := netns.GetFromName(ep.Namespace)
	if err != nil {
		return nil, fmt.Errorf("open netns %s: %w", ep.Namespace, err)
	}
	defer ns.Close()
	var f *os.File
	err = nsthread.Run(ns, func() error {
		var err error
		f, err = openTap(TapName)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("create tap in %s: %w", ep.Namespace, err)
	}
	nh, err := netlink.NewHandleAt(ns)
	if err != nil {
		f.Close()
		return nil, err
	}
	defer nh.Close()
	tap, err := nh.LinkByName(TapName)
	if err == nil {
		err = nh.LinkSetHardwareAddr(tap, tapMAC)
	}
	if err == nil {
		err = nh.AddrReplace(tap, addr(TapIP, tapPrefix))
	}
	if err == nil {
		err = nh.LinkSetUp(tap)
	}
	if err == nil && mode == GuestKnows {
		err = nh.NeighSet(&netlink.Neigh{LinkIndex: tap.Attrs().Index, Family: netlink.FAMILY_V4,
			State: netlink.NUD_PERMANENT, IP: GuestIP.AsSlice(), HardwareAddr: guestMAC})
	}
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("configure tap in %s: %w", ep.Namespace, err)
	}
	return f, nil
}

// TapMAC is the MAC of the namespace's tap now (its QEMU's), the gateway
// MAC its guest holds once they have talked: what a state saved from that
// guest records, so that a restore knows whether the guest has TapMAC.
func (m *Manager) TapMAC(ep *Endpoint) (string, error) {
	ns, err := netns.GetFromName(ep.Namespace)
	if err != nil {
		return "", err
	}
	defer ns.Close()
	nh, err := netlink.NewHandleAt(ns)
	if err != nil {
		return "", err
	}
	defer nh.Close()
	tap, err := nh.LinkByName(TapName)
	if err != nil {
		return "", err
	}
	return tap.Attrs().HardwareAddr.String(), nil
}

// Teardown removes the sandbox's namespace and veth pair. Missing pieces are
// not an error, so it can run after a partial setup or a crash.
func (m *Manager) Teardown(ep *Endpoint) error {
	var errs []error
	m.mu.Lock()
	svc := m.services[ep.Namespace]
	delete(m.services, ep.Namespace)
	m.mu.Unlock()
	if svc != nil {
		svc.Close()
	}
	if l, err := netlink.LinkByName(ep.HostVeth); err == nil {
		if err := netlink.LinkDel(l); err != nil {
			errs = append(errs, fmt.Errorf("delete veth %s: %w", ep.HostVeth, err))
		}
	}
	if err := netns.DeleteNamed(ep.Namespace); err != nil && !errors.Is(err, os.ErrNotExist) {
		errs = append(errs, fmt.Errorf("delete netns %s: %w", ep.Namespace, err))
	}
	return errors.Join(errs...)
}

// Namespaces lists this manager's sandbox namespaces present on the host
// (for recovery and leak checks).
func (m *Manager) Namespaces() ([]string, error) {
	ents, err := os.ReadDir("/run/netns")
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var out []string
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), m.nsPrefix()) {
			out = append(out, e.Name())
		}
	}
	return out, nil
}

// HostVeths lists the host ends of this manager's veth pairs present on the host.
func (m *Manager) HostVeths() ([]string, error) {
	links, err := linkList()
	if err != nil {
		return nil, err
	}
	var out []string
	for _, l := range links {
		if m.VethSlot(l.Attrs().Name) >= 0 {
			out = append(out, l.Attrs().Name)
		}
	}
	return out, nil
}

// linkList lists the host's links. A dump the kernel interrupted because
// links changed meanwhile (other sandboxes' namespaces going away) is
// incomplete: it is taken again.
func linkList() ([]netlink.Link, error) {
	var err error
	for try := 0; try < 10; try++ {
		var links []netlink.Link
		if links, err = netlink.LinkList(); !errors.Is(err, netlink.ErrDumpInterrupted) {
			return links, err
		}
		time.Sleep(time.Duration(try+1) * 10 * time.Millisecond)
	}
	return nil, fmt.Errorf("list network links: %w", err)
}

func addr(ip netip.Addr, bits int) *netlink.Addr {
	return &netlink.Addr{IPNet: &net.IPNet{IP: net.IP(ip.AsSlice()), Mask: net.CIDRMask(bits, 32)}}
}

// NetnsDir is where named network namespaces are bound (iproute2's): a
// sandbox's QEMU holds no copy of these bindings (see vmm.Jail.Drop).
const NetnsDir = "/run/netns"

// netnsDirOnce makes NetnsDir a shared mount of itself, as `ip netns`
// does on first use: a namespace bound in it before that would be covered
// when ip (or any later first use) mounts it, and could then be neither
// deleted nor made again under its name (seen on a host's second test
// run: "open /run/netns/...: file exists").
var netnsDirOnce = sync.OnceValue(func() error {
	if err := os.MkdirAll(NetnsDir, 0o755); err != nil {
		return err
	}
	mounted, err := mountinfo.IsMountPoint(NetnsDir)
	if err != nil {
		return err
	}
	if !mounted {
		if err := unix.Mount(NetnsDir, NetnsDir, "none", unix.MS_BIND|unix.MS_REC, ""); err != nil {
			return fmt.Errorf("bind %s: %w", NetnsDir, err)
		}
	}
	if err := unix.Mount("", NetnsDir, "none", unix.MS_SHARED|unix.MS_REC, ""); err != nil {
		return fmt.Errorf("make %s shared: %w", NetnsDir, err)
	}
	return nil
})

// newNamedNS creates a named namespace without leaving the calling thread in it.
func newNamedNS(name string) (netns.NsHandle, error) {
	if err := netnsDirOnce(); err != nil {
		return 0, err
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	orig, err := netns.Get()
	if err != nil {
		return 0, err
	}
	defer orig.Close()
	_ = netns.DeleteNamed(name) // leftover from a crash
	ns, err := netns.NewNamed(name)
	if serr := netns.Set(orig); serr != nil {
		// The thread is stuck in the wrong namespace: never reuse it.
		runtime.Goexit()
	}
	return ns, err
}

func openTap(name string) (*os.File, error) {
	fd, err := unix.Open("/dev/net/tun", unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("open /dev/net/tun: %w", err)
	}
	var req [unix.IFNAMSIZ + 64]byte
	copy(req[:unix.IFNAMSIZ-1], name)
	flags := uint16(unix.IFF_TAP | unix.IFF_NO_PI | unix.IFF_VNET_HDR)
	*(*uint16)(unsafe.Pointer(&req[unix.IFNAMSIZ])) = flags
	if _, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), uintptr(unix.TUNSETIFF), uintptr(unsafe.Pointer(&req[0]))); errno != 0 {
		unix.Close(fd)
		return nil, fmt.Errorf("TUNSETIFF %s: %w", name, errno)
	}
	return os.NewFile(uintptr(fd), "/dev/net/tun:"+name), nil
}

// nft loads a ruleset, inside the named namespace when ns is not empty.
func nft(ctx context.Context, ns, rules string) error {
	var cmd *exec.Cmd
	if ns == "" {
		cmd = exec.CommandContext(ctx, "nft", "-f", "-")
	} else {
		cmd = exec.CommandContext(ctx, "ip", "netns", "exec", ns, "nft", "-f", "-")
	}
	cmd.Stdin = strings.NewReader(rules)
	out, err := cmd.CombinedOutput()
	if err != nil {
		if errors.Is(err, exec.ErrNotFound) {
			return fmt.Errorf("nft not found: install it with `apt-get install nftables`")
		}
		return fmt.Errorf("load nftables rules%s: %w: %s", map[bool]string{true: " in " + ns}[ns != ""], err, strings.TrimSpace(string(out)))
	}
	return nil
}
