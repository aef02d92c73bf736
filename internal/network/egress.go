package network

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"
)

// Egress is what a sandbox's guest may reach beyond the rules every guest
// has (never the host, another sandbox, loopback or multicast). With
// internet access on, a guest reaches public addresses but not the private,
// shared and link-local ranges (DefaultDenied) nor Deny; with it off,
// nothing. Allow opens its ranges either way, and wins over Deny and
// DefaultDenied (E2B's allowOut over denyOut).
type Egress struct {
	Allow []netip.Prefix `json:"allow,omitempty"`
	Deny  []netip.Prefix `json:"deny,omitempty"`
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

// ErrBadRule: a rule that is not an IPv4 address or CIDR.
var ErrBadRule = errors.New("invalid egress rule")

// ParseRules reads a list of E2B egress rules: IPv4 addresses and CIDRs.
// Domain names and IPv6 ranges are refused with a message saying so
// (guests have no IPv6 route, and domain rules need the egress proxy this
// node does not run yet).
func ParseRules(field string, rules []string) ([]netip.Prefix, error) {
	if len(rules) > MaxEgressRules {
		return nil, fmt.Errorf("%w: %s has %d entries, at most %d are allowed", ErrBadRule, field, len(rules), MaxEgressRules)
	}
	out := make([]netip.Prefix, 0, len(rules))
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
		case err != nil && looksLikeDomain(r):
			return nil, fmt.Errorf("%w: %s entry %q: domain names are not supported by this node yet; give IPv4 addresses or CIDRs", ErrBadRule, field, r)
		case err != nil:
			return nil, fmt.Errorf("%w: %s entry %q is not an IPv4 address or CIDR", ErrBadRule, field, r)
		case !p.Addr().Is4():
			return nil, fmt.Errorf("%w: %s entry %q: guests have no IPv6 egress, so IPv6 rules cannot apply", ErrBadRule, field, r)
		}
		out = append(out, p.Masked())
	}
	return normalize(out), nil
}

// looksLikeDomain reports whether s has the form of a host name (or a
// *.wildcard of one): dot-separated labels of letters, digits and hyphens,
// the last one (a top-level domain) with a letter.
func looksLikeDomain(s string) bool {
	labels := strings.Split(strings.TrimPrefix(s, "*."), ".")
	if len(labels) < 2 {
		return false
	}
	for _, l := range labels {
		if l == "" || strings.IndexFunc(l, func(c rune) bool {
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

// forwardRules are the set elements of a sandbox's egress rules, in the
// order they are applied: never, then allowed, then denied.
func (m *Manager) forwardRules(e Egress) (never, allow, deny string) {
	never = nftSet(normalize(append(slices.Clone(neverReached), m.cidr)))
	allow = nftSet(normalize(e.Allow))
	deny = nftSet(normalize(append(slices.Clone(DefaultDenied), e.Deny...)))
	return never, allow, deny
}
