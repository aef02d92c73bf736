package network

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"
)

func TestParseRules(t *testing.T) {
	many := make([]string, MaxEgressRules+1)
	for i := range many {
		many[i] = fmt.Sprintf("203.0.113.%d", i)
	}
	for _, tc := range []struct {
		in   []string
		want []string // nil: refused
		msg  string   // part of the refusal
	}{
		{[]string{"1.2.3.4", "10.0.0.0/8"}, []string{"1.2.3.4", "10.0.0.0/8"}, ""},
		{[]string{"10.1.2.3/8"}, []string{"10.0.0.0/8"}, ""},                            // masked
		{[]string{"10.1.0.0/16", "10.0.0.0/8", "10.2.3.4"}, []string{"10.0.0.0/8"}, ""}, // nested ones merged
		{[]string{"0.0.0.0/0", "8.8.8.8"}, []string{"0.0.0.0/0"}, ""},                   //
		{[]string{"*.example.com"}, nil, "domain names are not supported"},              //
		{[]string{"example.com"}, nil, "domain names are not supported"},                //
		{[]string{"10.0.0.0/33"}, nil, "not an IPv4 address or CIDR"},                   //
		{[]string{"fd00::/8"}, nil, "IPv6"},                                             //
		{[]string{"300.1.1.1"}, nil, "not an IPv4 address or CIDR"},                     //
		{[]string{"; drop table"}, nil, "not an IPv4 address or CIDR"},                  //
		{many, nil, fmt.Sprintf("at most %d", MaxEgressRules)},                          //
	} {
		got, err := ParseRules("allowOut", tc.in)
		if tc.want == nil {
			if !errors.Is(err, ErrBadRule) || !strings.Contains(err.Error(), tc.msg) {
				t.Errorf("%v: %v, want a refusal saying %q", tc.in, err, tc.msg)
			}
			continue
		}
		if err != nil || !slices.Equal(Strings(got), tc.want) {
			t.Errorf("%v: %v, %v; want %v", tc.in, Strings(got), err, tc.want)
		}
	}
}

// TestEgressRules loads a sandbox namespace's rules and sends traffic
// through them from a stand-in guest (a namespace on the sandbox's tap
// link, with the guest's address) to test hosts this test creates: a host
// at a private address in a namespace of its own, the sandbox's host veth
// and another of the node's addresses. Every destination is one of them.
func TestEgressRules(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to create network namespaces")
	}
	m, err := NewManager("10.219.0.0/24", "aegres")
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if err := m.EnsureHost(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { exec.Command("nft", "delete", "table", "inet", m.hostTable()).Run() })
	ep, err := m.Endpoint("egress", 5, true, Egress{})
	if err != nil {
		t.Fatal(err)
	}
	if err := m.Setup(ctx, ep); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Teardown(ep) })

	const guestNS, worldNS, worldIf = "aegress-guest", "aegress-world", "aegressw0"
	sh := func(args ...string) {
		t.Helper()
		if out, err := exec.Command(args[0], args[1:]...).CombinedOutput(); err != nil {
			t.Fatalf("%v: %v %s", args, err, out)
		}
	}
	cleanup := func() {
		exec.Command("ip", "netns", "del", guestNS).Run()
		exec.Command("ip", "netns", "del", worldNS).Run()
		exec.Command("ip", "link", "del", worldIf).Run()
	}
	cleanup()
	t.Cleanup(cleanup)
	// The stand-in guest: its eth0 is the other end of the sandbox's tap0.
	sh("ip", "netns", "add", guestNS)
	sh("ip", "-n", ep.Namespace, "link", "add", TapName, "type", "veth", "peer", "name", "eth0", "netns", guestNS)
	sh("ip", "-n", ep.Namespace, "addr", "add", fmt.Sprintf("%s/%d", TapIP, tapPrefix), "dev", TapName)
	sh("ip", "-n", ep.Namespace, "link", "set", TapName, "up")
	sh("ip", "-n", guestNS, "addr", "add", fmt.Sprintf("%s/%d", GuestIP, tapPrefix), "dev", "eth0")
	sh("ip", "-n", guestNS, "link", "set", "eth0", "up")
	sh("ip", "-n", guestNS, "link", "set", "lo", "up")
	sh("ip", "-n", guestNS, "route", "add", "default", "via", TapIP.String())
	// A host at a private address, beyond the node.
	sh("ip", "netns", "add", worldNS)
	sh("ip", "link", "add", worldIf, "type", "veth", "peer", "name", "eth0", "netns", worldNS)
	sh("ip", "addr", "add", "10.219.2.1/30", "dev", worldIf)
	sh("ip", "link", "set", worldIf, "up")
	sh("ip", "-n", worldNS, "addr", "add", "10.219.2.2/30", "dev", "eth0")
	sh("ip", "-n", worldNS, "link", "set", "eth0", "up")
	sh("ip", "-n", worldNS, "route", "add", "default", "via", "10.219.2.1")
	listen := func(ns, addr string) {
		args := []string{"python3", "-c", `
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 18090)); s.listen(16)
while True:
    c, a = s.accept(); c.sendall(b"hi from " + sys.argv[1].encode() + b"\n"); c.close()
`, addr}
		if ns != "" {
			args = append([]string{"ip", "netns", "exec", ns}, args...)
		}
		cmd := exec.Command(args[0], args[1:]...)
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	}
	world, hostVeth, nodeAddr := "10.219.2.2", ep.HostIP.String(), "10.219.2.1"
	listen(worldNS, world)
	listen("", hostVeth)
	listen("", nodeAddr)
	time.Sleep(300 * time.Millisecond)
	reach := func(addr string) bool {
		out, _ := exec.Command("ip", "netns", "exec", guestNS, "python3", "-c", `
import socket, sys
try:
    print(socket.create_connection((sys.argv[1], 18090), timeout=1).recv(100).decode().strip())
except Exception as e:
    print("unreachable", e)
`, addr).CombinedOutput()
		return strings.HasPrefix(string(out), "hi from")
	}
	p := func(s ...string) []netip.Prefix {
		ps, err := ParseRules("test", s)
		if err != nil {
			t.Fatal(err)
		}
		return ps
	}
	for _, tc := range []struct {
		name     string
		internet bool
		egress   Egress
		reaches  map[string]bool
	}{
		{"default: private ranges closed", true, Egress{},
			map[string]bool{world: false, hostVeth: false, nodeAddr: false}},
		{"allowOut opens a private host", true, Egress{Allow: p(world)},
			map[string]bool{world: true, hostVeth: false}},
		{"allowOut wins over denyOut", true, Egress{Allow: p("10.219.2.0/30"), Deny: p(world)},
			map[string]bool{world: true}},
		{"denyOut alone", true, Egress{Deny: p("10.219.2.0/24")},
			map[string]bool{world: false}},
		{"internet off", false, Egress{},
			map[string]bool{world: false}},
		{"internet off, one host allowed", false, Egress{Allow: p(world)},
			map[string]bool{world: true}},
		{"the node itself is never opened", true, Egress{Allow: p(hostVeth, nodeAddr, "10.219.0.0/24")},
			map[string]bool{hostVeth: false, nodeAddr: false}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if err := m.SetEgress(ctx, ep, tc.internet, tc.egress); err != nil {
				t.Fatal(err)
			}
			for addr, want := range tc.reaches {
				if got := reach(addr); got != want {
					t.Errorf("%s reachable = %v, want %v", addr, got, want)
				}
			}
		})
	}
}
