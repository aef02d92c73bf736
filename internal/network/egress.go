package network

import (
	"errors"
	"fmt"
	"net/netip"
	"os"
	"slices"
	"strings"
)

// Egress is what a sandbox's guest may reach beyond the rules every guest
// has (never the host, another sandbox, loopback or multicast). With
// internet access on, a guest reaches public addresses but not the private,
// shared and link-local ranges (DefaultDenied) nor Deny; with it off,
// nothing. Allow opens its ranges either way, and wins over Deny and
// DefaultDenied (E2B's allowOut over denyOut). Domains open HTTP and TLS
// connections (ports 80 and 443) to the names they match, through the
// node's egress proxy, to any address Deny or internet access off would
// close — not to the ranges DefaultDenied closes; with Domains, DNSServers
// are opened as Allow is (E2B's dnsServers).
type Egress struct {
	Allow      []netip.Prefix `json:"allow,omitempty"`
	Deny       []netip.Prefix `json:"deny,omitempty"`
	Domains    []string       `json:"domains,omitempty"`
	DNSServers []netip.Prefix `json:"dnsServers,omitempty"`
}

// IsZero reports whether e has no rules at all.
func (e Egress) IsZero() bool {
	return len(e.Allow) == 0 && len(e.Deny) == 0 && len(e.Domains) == 0 && len(e.DNSServers) == 0
}

// opened is what the firewall opens as Allow: Allow, and DNSServers when
// there are domain rules.
func (e Egress) opened() []netip.Prefix {
	if len(e.Domains) == 0 {
		return e.Allow
	}
	return normalize(append(slices.Clone(e.Allow), e.DNSServers...))
}

// MaxEgressRules bounds each of a sandbox's Allow and Deny lists.
const MaxEgressRules = 64

// DefaultDenied are the ranges a guest with internet access does not reach
// unless a rule allows them: private (RFC 1918), shared (RFC 6598) and
// link-local addresses, where a cluster's own services live.
var DefaultDenied = []netip.Prefix{
	netip.MustParsePrefix("10.0.0.0/8"),
	netip.MustParsePrefix("172.16.0.0/12"),
	netip.MustParsePrefix("192.168.0.0/16"),
	netip.MustParsePrefix("100.64.0.0/10"),
	netip.MustParsePrefix("169.254.0.0/16"),
}

// neverReached are the ranges no rule opens: this network, loopback,
// multicast, reserved and broadcast (the sandboxes' own range is added).
var neverReached = []netip.Prefix{
	netip.MustParsePrefix("0.0.0.0/8"),
	netip.MustParsePrefix("127.0.0.0/8"),
	netip.MustParsePrefix("224.0.0.0/4"),
	netip.MustParsePrefix("240.0.0.0/4"),
}

// AllTraffic is the rule that stands for every address (E2B's ALL_TRAFFIC).
const AllTraffic = "0.0.0.0/0"

// ErrBadRule: a rule that is not an IPv4 address, CIDR or (where allowed)
// domain name.
var ErrBadRule = errors.New("invalid egress rule")

// MaxDNSServers bounds E2B's dnsServers.
const MaxDNSServers = 10

// ParseRules reads a list of E2B egress rules: IPv4 addresses and CIDRs,
// and, when domains is set (allowOut), domain names ("example.com", or
// "*.example.com" for its subdomains), returned lowercased. IPv6 ranges are
// refused with a message saying so (guests have no IPv6 route).
func ParseRules(field string, rules []string, domains bool) ([]netip.Prefix, []string, error) {
	if len(rules) > MaxEgressRules {
		return nil, nil, fmt.Errorf("%w: %s has %d entries, at most %d are allowed", ErrBadRule, field, len(rules), MaxEgressRules)
	}
	out := make([]netip.Prefix, 0, len(rules))
	var names []string
	for _, r := range rules {
		r = strings.TrimSpace(r)
		var p netip.Prefix
		var err error
		if strings.Contains(r, "/") {
			p, err = netip.ParsePrefix(r)
		} else {
			var a netip.Addr
			if a, err = netip.ParseAddr(r); err == nil {
				p = netip.PrefixFrom(a, a.BitLen())
			}
		}
		switch {
		case err != nil && looksLikeDomain(r) && domains:
			if name := strings.ToLower(strings.TrimSuffix(r, ".")); !slices.Contains(names, name) {
				names = append(names, name)
			}
			continue
		case err != nil && looksLikeDomain(r):
			return nil, nil, fmt.Errorf("%w: %s entry %q: domain names are allowed in allowOut only", ErrBadRule, field, r)
		case err != nil && domains:
			return nil, nil, fmt.Errorf("%w: %s entry %q is not an IPv4 address, CIDR or domain name", ErrBadRule, field, r)
		case err != nil:
			return nil, nil, fmt.Errorf("%w: %s entry %q is not an IPv4 address or CIDR", ErrBadRule, field, r)
		case !p.Addr().Is4():
			return nil, nil, fmt.Errorf("%w: %s entry %q: guests have no IPv6 egress, so IPv6 rules cannot apply", ErrBadRule, field, r)
		}
		out = append(out, p.Masked())
	}
	slices.Sort(names)
	return normalize(out), names, nil
}

// ParseDNSServers reads E2B's dnsServers: at most MaxDNSServers IPv4 addresses.
func ParseDNSServers(field string, servers []string) ([]netip.Prefix, error) {
	if len(servers) > MaxDNSServers {
		return nil, fmt.Errorf("%w: %s has %d entries, at most %d are allowed", ErrBadRule, field, len(servers), MaxDNSServers)
	}
	var out []netip.Prefix
	for _, s := range servers {
		a, err := netip.ParseAddr(strings.TrimSpace(s))
		if err != nil || !a.Is4() {
			return nil, fmt.Errorf("%w: %s entry %q is not an IPv4 address", ErrBadRule, field, s)
		}
		out = append(out, netip.PrefixFrom(a, 32))
	}
	return normalize(out), nil
}

// looksLikeDomain reports whether s has the form of a host name (or a
// *.wildcard of one): dot-separated labels of 1 to 63 letters, digits and
// hyphens (not at either end), the last one (a top-level domain) with a
// letter, 253 characters at most.
func looksLikeDomain(s string) bool {
	s = strings.TrimSuffix(s, ".")
	rest, wildcard := strings.CutPrefix(s, "*.")
	labels := strings.Split(rest, ".")
	if len(labels) < 2 && !wildcard || len(s) > 253 {
		return false
	}
	for _, l := range labels {
		if l == "" || len(l) > 63 || l[0] == '-' || l[len(l)-1] == '-' || strings.IndexFunc(l, func(c rune) bool {
			return !(c == '-' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9')
		}) >= 0 {
			return false
		}
	}
	return strings.IndexFunc(labels[len(labels)-1], func(c rune) bool { return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' }) >= 0
}

// normalize sorts prefixes and drops those inside another (nftables refuses
// a set with overlapping intervals; two CIDRs overlap only by nesting).
func normalize(ps []netip.Prefix) []netip.Prefix {
	ps = slices.Clone(ps)
	slices.SortFunc(ps, func(a, b netip.Prefix) int {
		if c := a.Addr().Compare(b.Addr()); c != 0 {
			return c
		}
		return a.Bits() - b.Bits()
	})
	var out []netip.Prefix
	for _, p := range ps {
		if n := len(out); n > 0 && out[n-1].Bits() <= p.Bits() && out[n-1].Contains(p.Addr()) {
			continue
		}
		out = append(out, p)
	}
	return out
}

// Strings returns prefixes as strings, as E2B's API shows them.
func Strings(ps []netip.Prefix) []string {
	out := make([]string, len(ps))
	for i, p := range ps {
		if p.IsSingleIP() {
			out[i] = p.Addr().String()
		} else {
			out[i] = p.String()
		}
	}
	return out
}

// nftSet renders prefixes as the elements of an nftables set.
func nftSet(ps []netip.Prefix) string {
	s := make([]string, len(ps))
	for i, p := range ps {
		s[i] = p.String()
	}
	return strings.Join(s, ", ")
}

// ProxyPort is where, inside a sandbox's namespace, the egress proxy
// listens for the HTTP and TLS connections its domain rules redirect.
const ProxyPort = 3129

// forwardRules are the set elements of a sandbox's egress rules: never
// reached, opened (Allow), denied by the sandbox's rules, opened by the
// node (its open ranges), denied by default.
func (m *Manager) forwardRules(e Egress) (never, allow, deny, open, defaults string) {
	never = nftSet(m.never())
	allow = nftSet(normalize(e.opened()))
	deny = nftSet(normalize(e.Deny))
	open = nftSet(m.open)
	defaults = nftSet(normalize(DefaultDenied))
	return
}

func (m *Manager) never() []netip.Prefix {
	return normalize(append(slices.Clone(neverReached), m.cidr))
}

// mayDial reports whether the egress proxy may connect to dst for a name a
// sandbox's domain rules allow: never the node, the sandboxes or the
// ranges no rule opens, and a default-denied range only if the node opens
// it or the sandbox's Allow does.
func (m *Manager) mayDial(e Egress, dst netip.Addr) bool {
	in := func(ps []netip.Prefix) bool {
		return slices.ContainsFunc(ps, func(p netip.Prefix) bool { return p.Contains(dst) })
	}
	switch {
	case !dst.Is4() || in(m.never()):
		return false
	case in(DefaultDenied):
		return in(m.open) || in(e.opened())
	}
	return true
}

// ParseNameserver reads a nameserver: an IP address, with or without a
// port (default 53).
func ParseNameserver(s string) (netip.AddrPort, error) {
	if a, err := netip.ParseAddr(s); err == nil {
		return netip.AddrPortFrom(a, 53), nil
	}
	ap, err := netip.ParseAddrPort(s)
	if err != nil {
		return netip.AddrPort{}, fmt.Errorf("nameserver %q is not an IP address or ip:port", s)
	}
	return ap, nil
}

// ReadResolvConf returns the nameservers a resolv.conf names (none if the
// file is missing).
func ReadResolvConf(path string) ([]netip.AddrPort, error) {
	b, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var out []netip.AddrPort
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) >= 2 && f[0] == "nameserver" {
			if a, err := netip.ParseAddr(strings.SplitN(f[1], "%", 2)[0]); err == nil {
				out = append(out, netip.AddrPortFrom(a, 53))
			}
		}
	}
	return out, nil
}
