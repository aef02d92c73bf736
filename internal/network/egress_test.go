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
		{[]string{"*.example.com"}, nil, "allowed in allowOut only"},                    //
		{[]string{"example.com"}, nil, "allowed in allowOut only"},                      //
		{[]string{"10.0.0.0/33"}, nil, "not an IPv4 address or CIDR"},                   //
		{[]string{"fd00::/8"}, nil, "IPv6"},                                             //
		{[]string{"300.1.1.1"}, nil, "not an IPv4 address or CIDR"},                     //
		{[]string{"; drop table"}, nil, "not an IPv4 address or CIDR"},                  //
		{many, nil, fmt.Sprintf("at most %d", MaxEgressRules)},                          //
	} {
		got, _, err := ParseRules("denyOut", tc.in, false)
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

func TestParseAllowOutDomains(t *testing.T) {
	ps, names, err := ParseRules("allowOut", []string{"*.Example.com", "api.example.com.", "1.2.3.4", "*.com", "api.example.com"}, true)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(Strings(ps), []string{"1.2.3.4"}) || !slices.Equal(names, []string{"*.com", "*.example.com", "api.example.com"}) {
		t.Fatalf("%v %v", Strings(ps), names)
	}
	for _, bad := range []string{"*", "*.", "a..b.com", "-a.com", "a-.com", "foo_bar.com", "exa mple.com", "*.*.com", "com", strings.Repeat("a", 64) + ".com"} {
		if _, _, err := ParseRules("allowOut", []string{bad}, true); !errors.Is(err, ErrBadRule) {
			t.Errorf("%q: %v, want a refusal", bad, err)
		}
	}
	if _, err := ParseDNSServers("dnsServers", []string{"1.1.1.1", "fd00::1"}); !errors.Is(err, ErrBadRule) {
		t.Fatalf("IPv6 DNS server: %v", err)
	}
	if _, err := ParseDNSServers("dnsServers", slices.Repeat([]string{"1.1.1.1"}, MaxDNSServers+1)); !errors.Is(err, ErrBadRule) {
		t.Fatalf("too many DNS servers: %v", err)
	}
}

// lab is a sandbox namespace with a stand-in guest (a namespace on the
// sandbox's tap link, with the guest's address) and a test host at a
// private address in a namespace of its own ("the world"), all made by the
// test. Every destination the tests use is one of them or the node's own.
type lab struct {
	t              *testing.T
	m              *Manager
	ep             *Endpoint
	guestNS        string
	worldNS        string
	world, worldGW string
}

func newLab(t *testing.T, name string, resolvers []netip.AddrPort, open []netip.Prefix) *lab {
	if os.Geteuid() != 0 {
		t.Skip("needs root to create network namespaces")
	}
	m, err := NewManager("10.219.0.0/24", "a"+name)
	if err != nil {
		t.Fatal(err)
	}
	m.SetGuestServices(GuestServices{Resolvers: resolvers, Open: open})
	ctx := context.Background()
	if err := m.EnsureHost(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { exec.Command("nft", "delete", "table", "inet", m.hostTable()).Run() })
	ep, err := m.Endpoint(name, 5, true, Egress{})
	if err != nil {
		t.Fatal(err)
	}
	if err := m.Setup(ctx, ep); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Teardown(ep) })
	l := &lab{t: t, m: m, ep: ep, guestNS: "a" + name + "-guest", world: "10.219.2.2", worldGW: "10.219.2.1"}
	worldNS, worldIf := "a"+name+"-world", "a"+name+"w0"
	cleanup := func() {
		exec.Command("ip", "netns", "del", l.guestNS).Run()
		exec.Command("ip", "netns", "del", worldNS).Run()
		exec.Command("ip", "link", "del", worldIf).Run()
	}
	cleanup()
	t.Cleanup(cleanup)
	// The stand-in guest: its eth0 is the other end of the sandbox's tap0.
	l.sh("ip", "netns", "add", l.guestNS)
	l.sh("ip", "-n", ep.Namespace, "link", "add", TapName, "type", "veth", "peer", "name", "eth0", "netns", l.guestNS)
	l.sh("ip", "-n", ep.Namespace, "addr", "add", fmt.Sprintf("%s/%d", TapIP, tapPrefix), "dev", TapName)
	l.sh("ip", "-n", ep.Namespace, "link", "set", TapName, "up")
	l.sh("ip", "-n", l.guestNS, "addr", "add", fmt.Sprintf("%s/%d", GuestIP, tapPrefix), "dev", "eth0")
	l.sh("ip", "-n", l.guestNS, "link", "set", "eth0", "up")
	l.sh("ip", "-n", l.guestNS, "link", "set", "lo", "up")
	l.sh("ip", "-n", l.guestNS, "route", "add", "default", "via", TapIP.String())
	// A host at a private address, beyond the node.
	l.sh("ip", "netns", "add", worldNS)
	l.sh("ip", "link", "add", worldIf, "type", "veth", "peer", "name", "eth0", "netns", worldNS)
	l.sh("ip", "addr", "add", l.worldGW+"/30", "dev", worldIf)
	l.sh("ip", "link", "set", worldIf, "up")
	l.sh("ip", "-n", worldNS, "addr", "add", l.world+"/30", "dev", "eth0")
	l.sh("ip", "-n", worldNS, "link", "set", "eth0", "up")
	l.sh("ip", "-n", worldNS, "link", "set", "lo", "up")
	l.sh("ip", "-n", worldNS, "route", "add", "default", "via", l.worldGW)
	l.worldNS = worldNS
	return l
}

func (l *lab) sh(args ...string) {
	l.t.Helper()
	if out, err := exec.Command(args[0], args[1:]...).CombinedOutput(); err != nil {
		l.t.Fatalf("%v: %v %s", args, err, out)
	}
}

// python runs a Python program in a namespace ("" for the host) in the
// background for the rest of the test.
func (l *lab) python(ns, prog string, args ...string) {
	l.t.Helper()
	argv := append([]string{"python3", "-c", prog}, args...)
	if ns != "" {
		argv = append([]string{"ip", "netns", "exec", ns}, argv...)
	}
	cmd := exec.Command(argv[0], argv[1:]...)
	if err := cmd.Start(); err != nil {
		l.t.Fatal(err)
	}
	l.t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
}

// fromGuest runs a Python program in the stand-in guest and returns its output.
func (l *lab) fromGuest(prog string, args ...string) string {
	out, _ := exec.Command("ip", append([]string{"netns", "exec", l.guestNS, "python3", "-c", prog}, args...)...).CombinedOutput()
	return strings.TrimSpace(string(out))
}

const helloServer = `
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(16)
while True:
    c, a = s.accept(); c.sendall(b"hi from " + sys.argv[1].encode() + b"\n"); c.close()
`

// TestEgressRules loads a sandbox namespace's rules and sends traffic
// through them from the stand-in guest to the lab's test hosts: the world
// host, the sandbox's host veth and another of the node's addresses.
func TestEgressRules(t *testing.T) {
	l := newLab(t, "egres", nil, nil)
	m, ep, ctx := l.m, l.ep, context.Background()
	world, hostVeth, nodeAddr := l.world, ep.HostIP.String(), l.worldGW
	l.python(l.worldNS, helloServer, world, "18090")
	l.python("", helloServer, hostVeth, "18090")
	l.python("", helloServer, nodeAddr, "18090")
	time.Sleep(300 * time.Millisecond)
	reach := func(addr string) bool {
		return strings.HasPrefix(l.fromGuest(`
import socket, sys
try:
    print(socket.create_connection((sys.argv[1], 18090), timeout=1).recv(100).decode().strip())
except Exception as e:
    print("unreachable", e)
`, addr), "hi from")
	}
	p := func(s ...string) []netip.Prefix {
		ps, _, err := ParseRules("test", s, false)
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

// webServer answers HTTP on port 80 with the Host it was asked for, and
// TLS on port 443 (a certificate made on the spot) with the server name.
const webServer = `
import http.server, socketserver, ssl, subprocess, sys, tempfile, threading, os
addr = sys.argv[1]
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = ("host " + self.headers.get("Host", "") + "\n").encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers(); self.wfile.write(body)
    def log_message(self, *a): pass
class S(socketserver.ThreadingMixIn, socketserver.TCPServer):  # no name lookups, unlike HTTPServer
    allow_reuse_address = True
    daemon_threads = True
d = tempfile.mkdtemp()
subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=test", "-days", "1",
    "-keyout", d + "/k.pem", "-out", d + "/c.pem"], check=True, capture_output=True)
plain = S((addr, 80), H)
secure = S((addr, 443), H)
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER); ctx.load_cert_chain(d + "/c.pem", d + "/k.pem")
secure.socket = ctx.wrap_socket(secure.socket, server_side=True)
threading.Thread(target=plain.serve_forever, daemon=True).start()
secure.serve_forever()
`

// fetch asks for http(s)://name/ from the guest, connecting to addr
// whatever name resolves to, and prints the answer or the error.
const fetch = `
import http.client, socket, ssl, sys
scheme, name, addr = sys.argv[1:4]
try:
    c = http.client.HTTPConnection(addr, 443 if scheme == "https" else 80, timeout=3)
    if scheme == "https":
        ctx = ssl.create_default_context(); ctx.check_hostname = False; ctx.verify_mode = ssl.CERT_NONE
        c.sock = ctx.wrap_socket(socket.create_connection((addr, 443), timeout=3), server_hostname=name)
    c.request("GET", "/", headers={"Host": name})
    r = c.getresponse()
    print(r.status, r.read().decode().strip())
except Exception as e:
    print("failed", type(e).__name__, e)
`

// dnsQuery asks the guest's resolver (the tap's address) for a name's A
// record and prints the answer's rcode and first address.
const dnsQuery = `
import socket, struct, sys
name, server = sys.argv[1], sys.argv[2]
q = struct.pack(">HHHHHH", 0x4242, 0x0100, 1, 0, 0, 0)
for label in name.split("."):
    q += bytes([len(label)]) + label.encode()
q += b"\x00" + struct.pack(">HH", 1, 1)
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(3)
try:
    s.sendto(q, (server, 53)); a, _ = s.recvfrom(4096)
except Exception as e:
    print("failed", e); sys.exit()
rcode, ancount = a[3] & 15, struct.unpack(">H", a[6:8])[0]
print("rcode", rcode, "answers", ancount, ".".join(str(b) for b in a[-4:]) if ancount else "")
`

// resolverServer is a test resolver answering every A query with sys.argv[2].
const resolverServer = `
import socket, struct, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind((sys.argv[1], 53))
ip = bytes(int(x) for x in sys.argv[2].split("."))
while True:
    q, a = s.recvfrom(4096)
    end = 12
    while q[end] != 0: end += 1 + q[end]
    question = q[12:end + 5]
    r = q[:2] + struct.pack(">HHHHH", 0x8180, 1, 1, 0, 0) + question + b"\xc0\x0c" + struct.pack(">HHIH", 1, 1, 60, 4) + ip
    s.sendto(r, a)
`

// TestDomainRules: with domain rules, the guest's HTTP and TLS connections
// reach the names allowed (by Host header and by TLS server name), and no
// other; the guest's resolver answers allowed names only while internet
// access is off, every name when it is on; the proxy never connects to the
// node, and a default-denied range only where the node opens it.
func TestDomainRules(t *testing.T) {
	if _, err := exec.LookPath("openssl"); err != nil {
		t.Skip("openssl is not installed")
	}
	resolver := netip.MustParseAddrPort("10.219.2.2:53")
	l := newLab(t, "domns", []netip.AddrPort{resolver}, []netip.Prefix{netip.MustParsePrefix("10.219.2.2/32")})
	m, ep, ctx := l.m, l.ep, context.Background()
	l.python(l.worldNS, webServer, l.world)
	l.python(l.worldNS, resolverServer, l.world, "10.219.2.2")
	l.python("", helloServer, ep.HostIP.String(), "80")
	time.Sleep(1500 * time.Millisecond) // the certificate
	get := func(scheme, name, addr string) string { return l.fromGuest(fetch, scheme, name, addr) }
	dns := func(name string) string { return l.fromGuest(dnsQuery, name, TapIP.String()) }
	set := func(internet bool, e Egress) {
		t.Helper()
		if err := m.SetEgress(ctx, ep, internet, e); err != nil {
			t.Fatal(err)
		}
	}

	_, domains, _ := ParseRules("allowOut", []string{"*.allowed.test", "exact.test"}, true)
	set(false, Egress{Domains: domains})
	for _, tc := range []struct{ scheme, name, want string }{
		{"http", "www.allowed.test", "200 host www.allowed.test"},
		{"http", "exact.test", "200 host exact.test"},
		{"http", "other.test", "403"},
		{"http", "allowed.test", "403"}, // a wildcard is for subdomains
		{"https", "api.allowed.test", "200 host api.allowed.test"},
		{"https", "other.test", "failed"},
	} {
		if got := get(tc.scheme, tc.name, l.world); !strings.HasPrefix(got, tc.want) {
			t.Errorf("%s://%s: %q, want %q", tc.scheme, tc.name, got, tc.want)
		}
	}
	// Other ports stay closed, and an allowed name never reaches the node.
	if got := get("http", "www.allowed.test", ep.HostIP.String()); strings.HasPrefix(got, "200") || strings.Contains(got, "hi from") {
		t.Errorf("an allowed name reached the node: %q", got)
	}
	if got := dns("www.allowed.test"); got != "rcode 0 answers 1 10.219.2.2" {
		t.Errorf("allowed name: %q", got)
	}
	if got := dns("exfiltrate.example.com"); got != "rcode 5 answers 0" {
		t.Errorf("other name with internet off: %q, want REFUSED", got)
	}

	// The node does not open the world any more: the proxy refuses it too.
	m.SetGuestServices(GuestServices{Resolvers: []netip.AddrPort{resolver}})
	set(false, Egress{Domains: domains})
	if got := get("http", "www.allowed.test", l.world); strings.HasPrefix(got, "200") {
		t.Errorf("a default-denied address through an allowed name: %q", got)
	}
	m.SetGuestServices(GuestServices{Resolvers: []netip.AddrPort{resolver}, Open: []netip.Prefix{netip.MustParsePrefix("10.219.2.2/32")}})

	// Internet on, the world denied: allowed names still get through (allowOut wins).
	world := netip.MustParsePrefix("10.219.2.0/30")
	set(true, Egress{Deny: []netip.Prefix{world}, Domains: domains})
	if got := get("http", "www.allowed.test", l.world); !strings.HasPrefix(got, "200") {
		t.Errorf("allowed name to a denied range: %q", got)
	}
	if got := get("http", "other.test", l.world); strings.HasPrefix(got, "200") {
		t.Errorf("other name to a denied range: %q", got)
	}
	if got := dns("anything.example.com"); got != "rcode 0 answers 1 10.219.2.2" {
		t.Errorf("any name with internet on: %q", got)
	}
	// No domain rules: no proxy, the firewall alone.
	set(false, Egress{})
	if got := get("http", "www.allowed.test", l.world); strings.HasPrefix(got, "200") {
		t.Errorf("internet off without domain rules: %q", got)
	}
	// The proxy cannot be reached directly, and QEMU's uid sends nothing.
	set(false, Egress{Domains: domains})
	if got := l.fromGuest(`
import socket, sys
try:
    socket.create_connection((sys.argv[1], 3129), timeout=1); print("connected")
except Exception as e:
    print("refused", e)
`, TapIP.String()); strings.HasPrefix(got, "connected") {
		t.Errorf("the proxy port answers the guest directly")
	}
	// A system python (a per-user install may not be readable by that uid).
	out, _ := exec.Command("ip", "netns", "exec", ep.Namespace, "setpriv", "--reuid=1700000005", "--regid=1700000005", "--clear-groups",
		"/usr/bin/python3", "-c", `
import socket, sys
try:
    socket.create_connection((sys.argv[1], 80), timeout=1); print("connected")
except Exception as e:
    print("blocked", e)
`, l.world).CombinedOutput()
	if !strings.HasPrefix(string(out), "blocked") {
		t.Errorf("a process of QEMU's uid in the namespace: %s", out)
	}
}
