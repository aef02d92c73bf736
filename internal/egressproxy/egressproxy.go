// Package egressproxy owns the node's userspace side of a guest's egress:
// each sandbox's DNS resolver (the guest's only nameserver, which forwards
// to the node's resolvers the names the sandbox may reach) and the
// transparent proxy that lets a guest whose egress is otherwise closed
// reach the domains its rules allow over HTTP and TLS, matched on the
// request's Host header or the TLS ClientHello's server name, as E2B does.
//
// It serves sockets it is given (package network opens them inside the
// sandbox's network namespace) and dials through a function it is given, so
// it knows nothing of namespaces or firewalls; the firewall decides which
// connections reach it.
package egressproxy

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Policy is what one sandbox's guest may reach by name.
type Policy struct {
	// Domains are the allowed names: "example.com" (that name only) or
	// "*.example.com" (its subdomains at any depth, not the name itself).
	Domains []string
	// AnyName makes the resolver answer every name (internet access on);
	// otherwise it answers only names Domains allow.
	AnyName bool
	// MayDial reports whether the proxy may connect to a destination for
	// an allowed name (never the node, other sandboxes or the ranges the
	// node keeps closed).
	MayDial func(netip.Addr) bool
}

// AllowsName reports whether a name (any case, trailing dot or not) is one
// of p's domains.
func (p *Policy) AllowsName(name string) bool {
	name = strings.ToLower(strings.TrimSuffix(name, "."))
	if name == "" {
		return false
	}
	for _, d := range p.Domains {
		if suffix, ok := strings.CutPrefix(d, "*."); ok {
			if strings.HasSuffix(name, "."+suffix) {
				return true
			}
		} else if name == d {
			return true
		}
	}
	return false
}

// Config is one sandbox's sockets and the node's resolvers.
type Config struct {
	// DNSPacket and DNSStream are the resolver's UDP socket and TCP
	// listener; Proxy is the listener the firewall redirects the guest's
	// HTTP and TLS connections to. Each may be nil.
	DNSPacket net.PacketConn
	DNSStream net.Listener
	Proxy     net.Listener
	// Dial connects to a destination on the guest's behalf.
	Dial func(ctx context.Context, dst netip.AddrPort) (net.Conn, error)
	// Resolvers are the node's nameservers; with none, every query is
	// refused.
	Resolvers []netip.AddrPort
	Log       *slog.Logger
}

// Sandbox is the running services of one sandbox.
type Sandbox struct {
	cfg    Config
	policy atomic.Pointer[Policy]
	wg     sync.WaitGroup
	ctx    context.Context
	cancel context.CancelFunc
	// queries bounds the DNS queries in flight.
	queries chan struct{}

	mu    sync.Mutex
	conns map[net.Conn]struct{} // open proxied and DNS stream connections; guarded by mu
}

// Timeouts and bounds of the services.
const (
	helloTimeout    = 10 * time.Second // the guest's first bytes (TLS hello or HTTP head)
	maxHello        = 64 << 10
	dialTimeout     = 15 * time.Second
	resolverTimeout = 4 * time.Second
	maxQueries      = 64
	// maxConns bounds a sandbox's open proxied and DNS stream connections
	// (each holds sockets and goroutines on the node); more are closed.
	maxConns = 512
)

// Serve starts the services of one sandbox under policy p.
func Serve(cfg Config, p Policy) *Sandbox {
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	s := &Sandbox{cfg: cfg, queries: make(chan struct{}, maxQueries), conns: map[net.Conn]struct{}{}}
	s.ctx, s.cancel = context.WithCancel(context.Background())
	s.SetPolicy(p)
	if cfg.DNSPacket != nil {
		s.wg.Add(1)
		go s.servePackets()
	}
	if cfg.DNSStream != nil {
		s.wg.Add(1)
		go s.accept(cfg.DNSStream, s.serveDNSStream)
	}
	if cfg.Proxy != nil {
		s.wg.Add(1)
		go s.accept(cfg.Proxy, s.proxy)
	}
	return s
}

// SetPolicy replaces the policy; connections proxied already go on.
func (s *Sandbox) SetPolicy(p Policy) {
	p.Domains = append([]string(nil), p.Domains...)
	for i, d := range p.Domains {
		p.Domains[i] = strings.ToLower(d)
	}
	if p.MayDial == nil {
		p.MayDial = func(netip.Addr) bool { return false }
	}
	s.policy.Store(&p)
}

// Close stops the services and closes their sockets and connections.
func (s *Sandbox) Close() error {
	s.cancel()
	var errs []error
	for _, c := range []io.Closer{s.cfg.DNSPacket, s.cfg.DNSStream, s.cfg.Proxy} {
		if c != nil && !isNil(c) {
			errs = append(errs, c.Close())
		}
	}
	s.mu.Lock()
	for c := range s.conns {
		c.Close()
	}
	s.mu.Unlock()
	s.wg.Wait()
	return errors.Join(errs...)
}

func isNil(c io.Closer) bool {
	switch v := c.(type) {
	case net.PacketConn:
		return v == nil
	case net.Listener:
		return v == nil
	}
	return false
}

func (s *Sandbox) track(c net.Conn, on bool) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if on {
		if s.ctx.Err() != nil || len(s.conns) >= maxConns {
			return false
		}
		s.conns[c] = struct{}{}
	} else {
		delete(s.conns, c)
	}
	return true
}

func (s *Sandbox) accept(ln net.Listener, handle func(net.Conn)) {
	defer s.wg.Done()
	for {
		c, err := ln.Accept()
		if err != nil {
			if s.ctx.Err() == nil && !errors.Is(err, net.ErrClosed) {
				s.cfg.Log.Warn("egress proxy accept", "err", err)
			}
			return
		}
		if !s.track(c, true) {
			c.Close()
			if s.ctx.Err() != nil {
				return
			}
			continue // over maxConns: this one is refused
		}
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			defer s.track(c, false)
			defer c.Close()
			handle(c)
		}()
	}
}

// proxy serves one redirected guest connection: it reads the name the
// guest asks for, and if the policy allows it connects to the address the
// guest was connecting to and relays both ways.
func (s *Sandbox) proxy(c net.Conn) {
	dst, err := originalDst(c)
	if err != nil || dst.Addr() == addrOf(c.LocalAddr()) {
		return // not redirected: someone connected to the proxy itself
	}
	_ = c.SetReadDeadline(time.Now().Add(helloTimeout))
	var head bytes.Buffer
	r := io.TeeReader(io.LimitReader(c, maxHello), &head)
	first := make([]byte, 1)
	if _, err := io.ReadFull(r, first); err != nil {
		return
	}
	var name string
	tlsConn := first[0] == 0x16 // a TLS handshake record
	if tlsConn {
		name = serverName(io.MultiReader(bytes.NewReader(first), r))
	} else {
		name = httpHost(io.MultiReader(bytes.NewReader(first), r))
	}
	_ = c.SetReadDeadline(time.Time{})
	p := s.policy.Load()
	if !p.AllowsName(name) || !p.MayDial(dst.Addr()) {
		s.cfg.Log.Info("egress refused", "name", name, "dst", dst)
		if !tlsConn {
			msg := "the sandbox's network rules do not allow this host\n"
			fmt.Fprintf(c, "HTTP/1.1 403 Forbidden\r\nContent-Type: text/plain\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s", len(msg), msg)
		}
		return
	}
	ctx, cancel := context.WithTimeout(s.ctx, dialTimeout)
	up, err := s.cfg.Dial(ctx, dst)
	cancel()
	if err != nil {
		s.cfg.Log.Warn("egress proxy dial", "name", name, "dst", dst, "err", err)
		if !tlsConn {
			fmt.Fprint(c, "HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
		}
		return
	}
	if !s.track(up, true) {
		up.Close()
		return
	}
	defer s.track(up, false)
	defer up.Close()
	if _, err := up.Write(head.Bytes()); err != nil {
		return
	}
	relay(c, up)
}

// relay copies both ways until both directions end.
func relay(a, b net.Conn) {
	done := make(chan struct{})
	go func() {
		_, _ = io.Copy(b, a)
		closeWrite(b)
		close(done)
	}()
	_, _ = io.Copy(a, b)
	closeWrite(a)
	<-done
}

func closeWrite(c net.Conn) {
	if cw, ok := c.(interface{ CloseWrite() error }); ok {
		_ = cw.CloseWrite()
	} else {
		c.Close()
	}
}

func addrOf(a net.Addr) netip.Addr {
	if ta, ok := a.(*net.TCPAddr); ok {
		ip, _ := netip.AddrFromSlice(ta.IP)
		return ip.Unmap()
	}
	return netip.Addr{}
}

// originalDst is where a connection the firewall redirected was going.
func originalDst(c net.Conn) (netip.AddrPort, error) {
	sc, ok := c.(syscall.Conn)
	if !ok {
		return netip.AddrPort{}, errors.New("not a socket")
	}
	raw, err := sc.SyscallConn()
	if err != nil {
		return netip.AddrPort{}, err
	}
	var sa unix.RawSockaddrInet4
	var serr error
	err = raw.Control(func(fd uintptr) {
		size := uint32(unsafe.Sizeof(sa))
		_, _, e := unix.Syscall6(unix.SYS_GETSOCKOPT, fd, unix.SOL_IP, unix.SO_ORIGINAL_DST,
			uintptr(unsafe.Pointer(&sa)), uintptr(unsafe.Pointer(&size)), 0)
		if e != 0 {
			serr = e
		}
	})
	if err == nil {
		err = serr
	}
	if err != nil {
		return netip.AddrPort{}, fmt.Errorf("original destination: %w", err)
	}
	port := uint16(sa.Port>>8) | uint16(sa.Port<<8) // network byte order
	return netip.AddrPortFrom(netip.AddrFrom4(sa.Addr), port), nil
}

// errGotHello stops a handshake once the ClientHello is read.
var errGotHello = errors.New("got the client hello")

// serverName reads a TLS ClientHello and returns its server name ("" when
// there is none or it is not a ClientHello). crypto/tls parses it; the
// handshake goes no further.
func serverName(r io.Reader) string {
	var name string
	conn := tls.Server(readOnlyConn{r}, &tls.Config{
		GetConfigForClient: func(h *tls.ClientHelloInfo) (*tls.Config, error) {
			name = h.ServerName
			return nil, errGotHello
		},
	})
	_ = conn.Handshake()
	return name
}

// httpHost reads an HTTP request's head and returns its host, without port.
func httpHost(r io.Reader) string {
	req, err := http.ReadRequest(bufio.NewReader(r))
	if err != nil {
		return ""
	}
	host := req.Host
	if h, _, err := net.SplitHostPort(host); err == nil {
		host = h
	}
	return host
}

// readOnlyConn is a net.Conn over a reader that refuses writes (the
// handshake's alert goes nowhere).
type readOnlyConn struct{ r io.Reader }

func (c readOnlyConn) Read(p []byte) (int, error)       { return c.r.Read(p) }
func (readOnlyConn) Write(p []byte) (int, error)        { return 0, io.ErrClosedPipe }
func (readOnlyConn) Close() error                       { return nil }
func (readOnlyConn) LocalAddr() net.Addr                { return &net.TCPAddr{} }
func (readOnlyConn) RemoteAddr() net.Addr               { return &net.TCPAddr{} }
func (readOnlyConn) SetDeadline(t time.Time) error      { return nil }
func (readOnlyConn) SetReadDeadline(t time.Time) error  { return nil }
func (readOnlyConn) SetWriteDeadline(t time.Time) error { return nil }
