package egressproxy

import (
	"crypto/tls"
	"encoding/binary"
	"net"
	"net/netip"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/net/dns/dnsmessage"
)

func TestAllowsName(t *testing.T) {
	p := Policy{Domains: []string{"example.com", "*.allowed.test"}}
	for _, tc := range []struct {
		name string
		want bool
	}{
		{"example.com", true},
		{"EXAMPLE.com.", true},
		{"www.example.com", false},
		{"a.allowed.test", true},
		{"a.b.allowed.test", true},
		{"allowed.test", false}, // a wildcard is for subdomains only
		{"notallowed.test", false},
		{"xallowed.test", false},
		{"", false},
	} {
		if got := p.AllowsName(tc.name); got != tc.want {
			t.Errorf("AllowsName(%q) = %v, want %v", tc.name, got, tc.want)
		}
	}
}

func TestServerNameAndHost(t *testing.T) {
	// A real ClientHello, as crypto/tls writes it.
	cli, srv := net.Pipe()
	go func() {
		c := tls.Client(cli, &tls.Config{ServerName: "api.allowed.test", InsecureSkipVerify: true})
		_ = c.Handshake()
	}()
	if got := serverName(srv); got != "api.allowed.test" {
		t.Fatalf("server name %q", got)
	}
	cli.Close()
	for _, tc := range []struct{ req, want string }{
		{"GET / HTTP/1.1\r\nHost: www.allowed.test:8080\r\n\r\n", "www.allowed.test"},
		{"GET / HTTP/1.1\r\nHost: allowed.test\r\n\r\n", "allowed.test"},
		{"GET http://abs.test/x HTTP/1.1\r\nHost: other.test\r\n\r\n", "abs.test"},
		{"not http at all\r\n\r\n", ""},
	} {
		if got := httpHost(strings.NewReader(tc.req)); got != tc.want {
			t.Errorf("%q: host %q, want %q", tc.req, got, tc.want)
		}
	}
	if got := serverName(strings.NewReader("\x16\x03\x01garbage")); got != "" {
		t.Fatalf("garbage hello: %q", got)
	}
}

// upstream is a test resolver on loopback answering A queries with 192.0.2.1.
func upstream(t *testing.T) (netip.AddrPort, *atomic.Int32) {
	t.Helper()
	pc, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pc.Close() })
	count := new(atomic.Int32)
	go func() {
		buf := make([]byte, 512)
		for {
			n, from, err := pc.ReadFrom(buf)
			if err != nil {
				return
			}
			count.Add(1)
			var p dnsmessage.Parser
			h, _ := p.Start(buf[:n])
			q, _ := p.Question()
			b := dnsmessage.NewBuilder(nil, dnsmessage.Header{ID: h.ID, Response: true})
			b.StartQuestions()
			b.Question(q)
			b.StartAnswers()
			b.AResource(dnsmessage.ResourceHeader{Name: q.Name, Class: dnsmessage.ClassINET, TTL: 60}, dnsmessage.AResource{A: [4]byte{192, 0, 2, 1}})
			out, _ := b.Finish()
			pc.WriteTo(out, from)
		}
	}()
	return netip.MustParseAddrPort(pc.LocalAddr().String()), count
}

func query(name string) []byte {
	b := dnsmessage.NewBuilder(nil, dnsmessage.Header{ID: 0x4242, RecursionDesired: true})
	b.StartQuestions()
	b.Question(dnsmessage.Question{Name: dnsmessage.MustNewName(name), Type: dnsmessage.TypeA, Class: dnsmessage.ClassINET})
	out, _ := b.Finish()
	return out
}

func rcodeOf(t *testing.T, msg []byte) (dnsmessage.RCode, int) {
	t.Helper()
	var p dnsmessage.Parser
	h, err := p.Start(msg)
	if err != nil {
		t.Fatal(err)
	}
	if h.ID != 0x4242 || !h.Response {
		t.Fatalf("header %+v", h)
	}
	p.SkipAllQuestions()
	answers, _ := p.AllAnswers()
	return h.RCode, len(answers)
}

// TestResolver: names the policy allows are forwarded (UDP and TCP); other
// names are refused without a query leaving; with no resolvers, SERVFAIL.
func TestResolver(t *testing.T) {
	up, count := upstream(t)
	pc, _ := net.ListenPacket("udp", "127.0.0.1:0")
	ln, _ := net.Listen("tcp", "127.0.0.1:0")
	s := Serve(Config{DNSPacket: pc, DNSStream: ln, Resolvers: []netip.AddrPort{up}}, Policy{Domains: []string{"*.allowed.test"}})
	defer s.Close()
	ask := func(name string) []byte {
		c, err := net.Dial("udp", pc.LocalAddr().String())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(5 * time.Second))
		c.Write(query(name))
		buf := make([]byte, 4096)
		n, err := c.Read(buf)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		return buf[:n]
	}
	if code, n := rcodeOf(t, ask("www.allowed.test.")); code != dnsmessage.RCodeSuccess || n != 1 {
		t.Fatalf("allowed name: %v, %d answers", code, n)
	}
	if code, n := rcodeOf(t, ask("exfiltrate.example.com.")); code != dnsmessage.RCodeRefused || n != 0 {
		t.Fatalf("other name: %v, %d answers", code, n)
	}
	if count.Load() != 1 {
		t.Fatalf("%d queries reached the resolver, want 1 (the refused one must not)", count.Load())
	}
	// TCP: the same rules (the test resolver speaks UDP only, so the
	// forwarded query fails over to SERVFAIL; the refusal is local).
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	q := query("exfiltrate.example.com.")
	c.Write(append(binary.BigEndian.AppendUint16(nil, uint16(len(q))), q...))
	var size [2]byte
	if _, err := c.Read(size[:]); err != nil {
		t.Fatal(err)
	}
	a := make([]byte, binary.BigEndian.Uint16(size[:]))
	if _, err := c.Read(a); err != nil {
		t.Fatal(err)
	}
	if code, _ := rcodeOf(t, a); code != dnsmessage.RCodeRefused {
		t.Fatalf("over TCP: %v", code)
	}
	// Internet access on: every name.
	s.SetPolicy(Policy{AnyName: true})
	if code, n := rcodeOf(t, ask("anything.example.com.")); code != dnsmessage.RCodeSuccess || n != 1 {
		t.Fatalf("any name: %v, %d answers", code, n)
	}
	// Garbage gets no answer and stops nothing.
	g, _ := net.Dial("udp", pc.LocalAddr().String())
	g.Write([]byte("nonsense"))
	g.Close()
	if code, _ := rcodeOf(t, ask("again.allowed.test.")); code != dnsmessage.RCodeSuccess {
		t.Fatalf("after garbage: %v", code)
	}
}

func TestResolverWithoutUpstreams(t *testing.T) {
	pc, _ := net.ListenPacket("udp", "127.0.0.1:0")
	s := Serve(Config{DNSPacket: pc}, Policy{AnyName: true})
	defer s.Close()
	c, _ := net.Dial("udp", pc.LocalAddr().String())
	defer c.Close()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	c.Write(query("a.example.com."))
	buf := make([]byte, 512)
	n, err := c.Read(buf)
	if err != nil {
		t.Fatal(err)
	}
	if code, _ := rcodeOf(t, buf[:n]); code != dnsmessage.RCodeServerFailure {
		t.Fatalf("rcode %v", code)
	}
}

// TestCloseEndsEverything: Close returns with connections still open.
func TestCloseEndsEverything(t *testing.T) {
	ln, _ := net.Listen("tcp", "127.0.0.1:0")
	pc, _ := net.ListenPacket("udp", "127.0.0.1:0")
	s := Serve(Config{DNSStream: ln, DNSPacket: pc, Proxy: nil}, Policy{})
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	time.Sleep(50 * time.Millisecond)
	done := make(chan struct{})
	go func() { s.Close(); close(done) }()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("Close hangs on an open connection")
	}
	c.SetReadDeadline(time.Now().Add(2 * time.Second))
	if n, _ := c.Read(make([]byte, 1)); n != 0 {
		t.Fatal("connection still served")
	}
}
