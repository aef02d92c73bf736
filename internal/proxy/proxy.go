// Package proxy owns the forwarding of sandbox traffic: it parses which
// sandbox and guest port a request is for (E2b-Sandbox-Id/E2b-Sandbox-Port
// headers, or a `{port}-{sandboxID}.{domain}` host) and streams the request
// to that port inside the guest, unbuffered, including Connect server
// streams and WebSocket upgrades.
package proxy

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/httputil"
	"strconv"
	"strings"
	"time"

	"github.com/agentenv/agentenv/internal/errkind"
	"github.com/agentenv/agentenv/internal/httperr"
)

// Header names the SDKs use to address a sandbox.
const (
	HeaderSandboxID   = "E2b-Sandbox-Id"
	HeaderSandboxPort = "E2b-Sandbox-Port"
	// HeaderTrafficToken carries a sandbox's trafficAccessToken to
	// non-envd ports when its public traffic is off.
	HeaderTrafficToken = "E2b-Traffic-Access-Token"
	// HeaderAccessToken carries the envdAccessToken of secure sandboxes.
	HeaderAccessToken = "X-Access-Token"
)

// Target is the sandbox port a request is addressed to.
type Target struct {
	SandboxID string
	Port      int
}

// ParseTarget extracts the target from the routing headers or, failing that,
// from a `{port}-{sandboxID}.{domain}` host. domain may be empty, in which
// case any domain is accepted for the host form.
func ParseTarget(r *http.Request, domain string) (Target, bool) {
	if id := r.Header.Get(HeaderSandboxID); id != "" {
		port, err := strconv.Atoi(r.Header.Get(HeaderSandboxPort))
		if err != nil || port < 1 || port > 65535 {
			return Target{SandboxID: id}, true // invalid port: reported by the proxy
		}
		return Target{SandboxID: id, Port: port}, true
	}
	return parseHost(r.Host, domain)
}

func parseHost(host, domain string) (Target, bool) {
	if h, _, err := net.SplitHostPort(host); err == nil {
		host = h
	}
	host = strings.ToLower(host)
	label, rest, ok := strings.Cut(host, ".")
	if !ok || rest == "" {
		return Target{}, false
	}
	if domain != "" && rest != strings.ToLower(domain) {
		return Target{}, false
	}
	portStr, id, ok := strings.Cut(label, "-")
	if !ok || id == "" {
		return Target{}, false
	}
	port, err := strconv.Atoi(portStr)
	if err != nil || port < 1 || port > 65535 {
		return Target{}, false
	}
	// The SDK may append "-<clientID>" to the sandbox id.
	if i := strings.IndexByte(id, '-'); i > 0 {
		id = id[:i]
	}
	for _, c := range id {
		if (c < 'a' || c > 'z') && (c < '0' || c > '9') {
			return Target{}, false
		}
	}
	return Target{SandboxID: id, Port: port}, true
}

// Route is where a sandbox's traffic goes.
type Route struct {
	// Addr is the host-reachable address of the guest (host, no port).
	Addr string
	// Running is false for sandboxes that exist but cannot take traffic.
	Running bool
	// AutoResume marks a paused sandbox that traffic should resume (the
	// resolver must implement Resumer).
	AutoResume bool
	// AccessToken, when set (secure sandboxes), is required in
	// X-Access-Token on envd's port, except for GET /health and validly
	// signed /files URLs (envd checks it as well).
	AccessToken string
	// TrafficToken, when set (sandboxes without public traffic), is
	// required in e2b-traffic-access-token on every other port.
	TrafficToken string
	// MaskRequestHost, when set, is the Host header requests to ports
	// other than envd's carry to the guest ("${PORT}" replaced by the
	// port); the client's goes in X-Forwarded-Host.
	MaskRequestHost string
}

// Resolver finds a sandbox's route.
type Resolver interface {
	Route(ctx context.Context, sandboxID string) (Route, error)
}

// Resumer is implemented by resolvers that can resume a paused sandbox for
// incoming traffic; Resume returns the sandbox's route once it runs (also
// when another request resumed it first).
type Resumer interface {
	Resume(ctx context.Context, sandboxID string) (Route, error)
}

// ValidSandboxID reports whether id can name a sandbox.
func ValidSandboxID(id string) bool { return validSandboxID(id) }

// ErrUnknownSandbox is returned by resolvers for ids they do not know.
var ErrUnknownSandbox = errors.New("unknown sandbox")

// Proxy forwards sandbox traffic.
type Proxy struct {
	resolver Resolver
	domain   string
	envdPort int
	rp       *httputil.ReverseProxy
	log      *slog.Logger
	inflight inflight
}

type ctxKey struct{}

// New returns a proxy resolving sandboxes with r.
func New(r Resolver, domain string, envdPort int, log *slog.Logger) *Proxy {
	if log == nil {
		log = slog.Default()
	}
	p := &Proxy{resolver: r, domain: domain, envdPort: envdPort, log: log}
	dialer := &net.Dialer{Timeout: 5 * time.Second, KeepAlive: 30 * time.Second}
	transport := &http.Transport{
		// Every guest of a slot gets the same address, so connections are
		// pooled per sandbox (the dial address names it, see upstreamHost):
		// a kept-alive connection to a killed sandbox is never reused for
		// the next sandbox in its slot.
		DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			real, err := dialAddr(addr)
			if err != nil {
				return nil, err
			}
			return dialer.DialContext(ctx, network, real)
		},
		MaxIdleConnsPerHost: 64,
		// Short: connections to a guest that is killed or paused are
		// never closed by it and would hold goroutines until then.
		IdleConnTimeout:       15 * time.Second,
		ResponseHeaderTimeout: 0, // long-polls and streams may wait
		DisableCompression:    true,
	}
	p.rp = &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			up := pr.In.Context().Value(ctxKey{}).(upstream)
			pr.Out.URL.Scheme = "http"
			pr.Out.URL.Host = upstreamHost(up.sandboxID, up.addr)
			pr.Out.Host = up.addr
			if up.host != "" {
				pr.Out.Host = up.host
			}
			pr.Out.Header.Del(HeaderSandboxID)
			pr.Out.Header.Del(HeaderSandboxPort)
			pr.Out.Header.Del(HeaderTrafficToken)
			pr.SetXForwarded() // X-Forwarded-Host: the Host the client sent
		},
		Transport:     transport,
		FlushInterval: -1, // stream every write through immediately
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			up := r.Context().Value(ctxKey{}).(upstream)
			p.writeSandboxError(w, up.sandboxID, up.port, portNotOpen, err)
		},
	}
	return p
}

// ServeHTTP forwards the request to its sandbox.
func (p *Proxy) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	t, ok := ParseTarget(r, p.domain)
	if !ok {
		writeError(w, http.StatusBadRequest, "request does not name a sandbox")
		return
	}
	if !validSandboxID(t.SandboxID) {
		writeError(w, http.StatusBadRequest, "invalid sandbox id in "+HeaderSandboxID)
		return
	}
	if t.Port == 0 {
		writeError(w, http.StatusBadRequest, "invalid "+HeaderSandboxPort+" header")
		return
	}
	route, err := p.resolver.Route(r.Context(), t.SandboxID)
	if err != nil {
		if !errors.Is(err, ErrUnknownSandbox) {
			httperr.Internal(w, p.log, http.StatusBadGateway, "looking the sandbox up failed", err)
			return
		}
		p.writeSandboxError(w, t.SandboxID, 0, sandboxNotFound, nil)
		return
	}
	if !route.Running && route.AutoResume {
		if res, ok := p.resolver.(Resumer); ok {
			route, err = res.Resume(r.Context(), t.SandboxID)
			var later interface{ RetryAfterSeconds() int }
			switch {
			case errors.Is(err, errkind.ErrCapacity):
				// The node is at a limit: the client may try again.
				if errors.As(err, &later) {
					w.Header().Set("Retry-After", strconv.Itoa(later.RetryAfterSeconds()))
				}
				writeError(w, http.StatusTooManyRequests, fmt.Sprintf("sandbox %q is paused and the node cannot resume it now: %v", t.SandboxID, err))
				return
			case err != nil:
				httperr.Internal(w, p.log, http.StatusBadGateway, fmt.Sprintf("sandbox %q is paused and resuming it failed", t.SandboxID), err)
				return
			}
		}
	}
	if !route.Running {
		p.writeSandboxError(w, t.SandboxID, 0, sandboxNotFound+" (it is paused: resume it, or create it with auto-resume)", nil)
		return
	}
	if t.Port == p.envdPort {
		if route.AccessToken != "" && !envdAuthorized(r, route.AccessToken) {
			writeUnauthenticated(w, r)
			return
		}
	} else if route.TrafficToken != "" && !tokenEqual(r.Header.Get(HeaderTrafficToken), route.TrafficToken) {
		writeError(w, http.StatusForbidden, "missing or invalid "+HeaderTrafficToken+" header")
		return
	}
	up := upstream{sandboxID: t.SandboxID, port: t.Port, addr: net.JoinHostPort(route.Addr, strconv.Itoa(t.Port))}
	if route.MaskRequestHost != "" && t.Port != p.envdPort {
		up.host = strings.ReplaceAll(route.MaskRequestHost, "${PORT}", strconv.Itoa(t.Port))
	}
	// The response (headers flushed at once) may start before the request
	// body has been forwarded; without full duplex Go's HTTP/1 server would
	// close the request body at the first flush and the transport would
	// abort the upstream connection mid-stream. (HTTP/2 is always full
	// duplex and reports ErrNotSupported, which is fine.)
	_ = http.NewResponseController(w).EnableFullDuplex()
	ctx, done := p.track(r.Context(), t.SandboxID)
	defer done()
	p.rp.ServeHTTP(w, r.WithContext(context.WithValue(ctx, ctxKey{}, up)))
}

func validSandboxID(id string) bool {
	if id == "" || len(id) > 64 {
		return false
	}
	for _, c := range id {
		if (c < 'a' || c > 'z') && (c < '0' || c > '9') {
			return false
		}
	}
	return true
}

type upstream struct {
	sandboxID string
	port      int    // the guest port asked for
	addr      string // guest host:port
	host      string // the Host header the guest sees ("": addr)
}

// upstreamHost is the URL host the transport pools connections by:
// "<sandboxID>.<guest ip>:<port>". dialAddr recovers the guest address.
func upstreamHost(sandboxID, addr string) string {
	host, port, _ := net.SplitHostPort(addr)
	return net.JoinHostPort(sandboxID+"."+host, port)
}

func dialAddr(hostport string) (string, error) {
	host, port, err := net.SplitHostPort(hostport)
	if err != nil {
		return "", err
	}
	_, ip, ok := strings.Cut(host, ".")
	if !ok || net.ParseIP(ip) == nil {
		return "", fmt.Errorf("bad upstream address %q", hostport)
	}
	return net.JoinHostPort(ip, port), nil
}

func writeError(w http.ResponseWriter, status int, msg string) { httperr.Write(w, status, msg) }

// The messages of the proxy's 502s, in E2B's proxy's words: the SDKs map
// "was not found" to their sandbox-not-running error and "port is not
// open" to their sandbox-unreachable one.
const (
	sandboxNotFound = "The sandbox was not found"
	portNotOpen     = "The sandbox is running but port is not open"
)

// sandboxErrorBody is the body of a 502 about a sandbox, as E2B's proxy
// answers it.
type sandboxErrorBody struct {
	SandboxID string `json:"sandboxId"`
	Message   string `json:"message"`
	Port      int    `json:"port,omitempty"`
	Code      int    `json:"code"`
}

// writeSandboxError answers 502 about a sandbox (and port, when one was
// reached for); its message carries the request id, under which err, if
// any, goes to the log.
func (p *Proxy) writeSandboxError(w http.ResponseWriter, sandboxID string, port int, msg string, err error) {
	id := httperr.ID(w)
	if err != nil {
		p.log.Error(msg, "request", id, "sandbox", sandboxID, "port", port, "err", err)
	}
	if id != "" {
		msg += " (request id " + id + ")"
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusBadGateway)
	_ = json.NewEncoder(w).Encode(sandboxErrorBody{SandboxID: sandboxID, Message: msg, Port: port, Code: http.StatusBadGateway})
}
