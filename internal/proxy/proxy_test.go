package proxy

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/agentenv/agentenv/internal/errkind"
	"github.com/agentenv/agentenv/internal/httperr"
	"github.com/agentenv/agentenv/internal/proxy/proxytest"
	"github.com/agentenv/agentenv/internal/signedurl"
)

// These unit tests check the proxy's routing and token rules against a
// local HTTP server standing in for the guest port; tests/e2e runs the proxy
// against real guests (streaming, h2c, WebSocket, 502s).

type stubResolver map[string]Route

func (s stubResolver) Route(ctx context.Context, id string) (Route, error) {
	r, ok := s[id]
	if !ok {
		return Route{}, ErrUnknownSandbox
	}
	return r, nil
}

func TestTokensAndRouting(t *testing.T) {
	backend := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get(HeaderTrafficToken) != "" || r.Header.Get(HeaderSandboxID) != "" {
			http.Error(w, "routing headers leaked to the guest", 500)
			return
		}
		_, _ = io.WriteString(w, "guest:"+r.URL.Path)
	}))
	defer backend.Close()
	host, portStr, _ := net.SplitHostPort(strings.TrimPrefix(backend.URL, "http://"))
	port, _ := strconv.Atoi(portStr)
	// The stand-in guest listens on one port: use it as "envd" for the
	// secure sandbox and as an app port for the traffic-token one.
	envd := New(stubResolver{
		"secure": {Addr: host, Running: true, AccessToken: "tok"},
		"open":   {Addr: host, Running: true},
		"paused": {Addr: host, Running: false},
	}, "", port, nil)
	app := New(stubResolver{
		"private": {Addr: host, Running: true, AccessToken: "tok", TrafficToken: "traffic"},
	}, "", 49983, nil)
	sig := url.QueryEscape(signedurl.Sign("/a", "read", "", "tok", ""))
	expired := strconv.FormatInt(time.Now().Add(-time.Minute).Unix(), 10)
	future := strconv.FormatInt(time.Now().Add(time.Minute).Unix(), 10)
	for _, tc := range []struct {
		name    string
		p       *Proxy
		id      string
		method  string
		path    string
		headers map[string]string
		status  int
	}{
		{"secure without token", envd, "secure", "GET", "/envs", nil, 401},
		{"secure with token", envd, "secure", "GET", "/envs", map[string]string{"X-Access-Token": "tok"}, 200},
		{"secure wrong token", envd, "secure", "GET", "/envs", map[string]string{"X-Access-Token": "tok2"}, 401},
		{"secure health", envd, "secure", "GET", "/health", nil, 200},
		{"secure health POST", envd, "secure", "POST", "/health", nil, 401},
		{"signed files", envd, "secure", "GET", "/files?path=/a&signature=" + sig, nil, 200},
		{"signed files wrong op", envd, "secure", "POST", "/files?path=/a&signature=" + sig, nil, 401},
		{"signed files other path", envd, "secure", "GET", "/files?path=/b&signature=" + sig, nil, 401},
		{"signed files expired", envd, "secure", "GET", "/files?path=/a&signature_expiration=" + expired +
			"&signature=" + url.QueryEscape(signedurl.Sign("/a", "read", "", "tok", expired)), nil, 401},
		{"signed files not expired", envd, "secure", "GET", "/files?path=/a&signature_expiration=" + future +
			"&signature=" + url.QueryEscape(signedurl.Sign("/a", "read", "", "tok", future)), nil, 200},
		{"open sandbox needs no token", envd, "open", "GET", "/envs", nil, 200},
		{"paused", envd, "paused", "GET", "/health", nil, 502},
		{"unknown", envd, "nope", "GET", "/health", nil, 502},
		{"traffic token missing", app, "private", "GET", "/app", nil, 403},
		{"traffic token wrong", app, "private", "GET", "/app", map[string]string{HeaderTrafficToken: "x"}, 403},
		{"traffic token right", app, "private", "GET", "/app", map[string]string{HeaderTrafficToken: "traffic"}, 200},
		{"envd token is not a traffic token", app, "private", "GET", "/app", map[string]string{"X-Access-Token": "tok"}, 403},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := httptest.NewRequest(tc.method, tc.path, nil)
			r.Header.Set(HeaderSandboxID, tc.id)
			r.Header.Set(HeaderSandboxPort, strconv.Itoa(port))
			for k, v := range tc.headers {
				r.Header.Set(k, v)
			}
			rec := httptest.NewRecorder()
			tc.p.ServeHTTP(rec, r)
			if rec.Code != tc.status {
				t.Fatalf("status %d, want %d: %s", rec.Code, tc.status, rec.Body)
			}
			if tc.status != 200 {
				var e struct {
					Code    int    `json:"code"`
					Message string `json:"message"`
				}
				if err := json.Unmarshal(rec.Body.Bytes(), &e); err != nil || e.Code != tc.status || e.Message == "" {
					t.Fatalf("error body %q", rec.Body)
				}
			}
		})
	}
}

func TestConnectCallsGetConnectErrors(t *testing.T) {
	p := New(stubResolver{"secure": {Addr: "127.0.0.1", Running: true, AccessToken: "tok"}}, "", 49983, nil)
	r := httptest.NewRequest("POST", "/process.Process/List", strings.NewReader("{}"))
	r.Header.Set("Content-Type", "application/json")
	r.Header.Set(HeaderSandboxID, "secure")
	r.Header.Set(HeaderSandboxPort, "49983")
	rec := httptest.NewRecorder()
	p.ServeHTTP(rec, r)
	if rec.Code != 401 || !strings.Contains(rec.Body.String(), `"code":"unauthenticated"`) {
		t.Fatalf("%d %s", rec.Code, rec.Body)
	}
}

func TestParseTarget(t *testing.T) {
	for _, tc := range []struct {
		host, domain, id, port string
		want                   Target
		ok                     bool
	}{
		{host: "49983-abc123.e2b.app", want: Target{"abc123", 49983}, ok: true},
		{host: "8080-abc123-client.e2b.app:443", want: Target{"abc123", 8080}, ok: true},
		{host: "8080-abc123.other.app", domain: "e2b.app"},
		{host: "8080-abc123.e2b.app", domain: "E2B.app", want: Target{"abc123", 8080}, ok: true},
		{host: "127.0.0.1:8000"},
		{host: "localhost"},
		{host: "0-abc.d"},
		{host: "70000-abc.d"},
		{host: "80-ABC_x.d"},
		{host: "x", id: "abc", port: "49983", want: Target{"abc", 49983}, ok: true},
		{host: "x", id: "abc", port: "nope", want: Target{"abc", 0}, ok: true},
	} {
		r := httptest.NewRequest("GET", "/", nil)
		r.Host = tc.host
		if tc.id != "" {
			r.Header.Set(HeaderSandboxID, tc.id)
			r.Header.Set(HeaderSandboxPort, tc.port)
		}
		got, ok := ParseTarget(r, tc.domain)
		if ok != tc.ok || got != tc.want {
			t.Errorf("%q/%q: got %+v %v, want %+v %v", tc.host, tc.id, got, ok, tc.want, tc.ok)
		}
	}
}

type switchResolver struct {
	mu    sync.Mutex
	route Route
	err   error
}

func (s *switchResolver) Route(ctx context.Context, id string) (Route, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.route, s.err
}

func (s *switchResolver) set(running bool, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.route.Running, s.err = running, err
}

// A stream to a sandbox that stops taking traffic (paused, killed) is cut
// instead of hanging; a failing lookup alone does not cut it.
func TestStreamsEndWhenTheSandboxStops(t *testing.T) {
	backend := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		for {
			if _, err := io.WriteString(w, "tick\n"); err != nil {
				return
			}
			w.(http.Flusher).Flush()
			select {
			case <-r.Context().Done():
				return
			case <-time.After(50 * time.Millisecond):
			}
		}
	}))
	defer backend.Close()
	host, portStr, _ := net.SplitHostPort(strings.TrimPrefix(backend.URL, "http://"))
	for _, tc := range []struct {
		name    string
		running bool
		err     error
		cut     bool
	}{
		{"paused", false, nil, true},
		{"killed", false, ErrUnknownSandbox, true},
		{"lookup error", false, errors.New("database is locked"), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			res := &switchResolver{route: Route{Addr: host, Running: true}}
			front := httptest.NewServer(New(res, "", 49983, nil))
			defer front.Close()
			ctx, cancel := context.WithTimeout(context.Background(), 4*watchInterval)
			defer cancel()
			req, _ := http.NewRequestWithContext(ctx, "GET", front.URL+"/stream", nil)
			req.Header.Set(HeaderSandboxID, "sbx")
			req.Header.Set(HeaderSandboxPort, portStr)
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			buf := make([]byte, 5)
			if _, err := io.ReadFull(resp.Body, buf); err != nil || string(buf) != "tick\n" {
				t.Fatalf("%q %v", buf, err)
			}
			res.set(tc.running, tc.err)
			_, _ = io.Copy(io.Discard, resp.Body)
			if cut := ctx.Err() == nil; cut != tc.cut {
				t.Fatalf("stream cut: %v, want %v", cut, tc.cut)
			}
		})
	}
}

type resumingResolver struct {
	switchResolver
	resumes int
	fail    error
}

func (r *resumingResolver) Resume(ctx context.Context, id string) (Route, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.resumes++
	if r.fail != nil {
		return Route{}, r.fail
	}
	r.route.Running = true
	return r.route, nil
}

// retryLater is a capacity refusal that says when to try again (as the
// node's admission refusals do).
type retryLater struct{}

func (retryLater) Error() string {
	return "the node is starting 4 sandboxes, its limit (--max-starting)"
}
func (retryLater) Unwrap() error          { return errkind.ErrCapacity }
func (retryLater) RetryAfterSeconds() int { return 7 }

func TestAutoResumeOnTraffic(t *testing.T) {
	backend := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.WriteString(w, "ok")
	}))
	defer backend.Close()
	host, portStr, _ := net.SplitHostPort(strings.TrimPrefix(backend.URL, "http://"))
	for _, tc := range []struct {
		name        string
		autoResume  bool
		fail        error
		status      int
		wantResumes int
	}{
		{"paused with autoResume is resumed", true, nil, 200, 1},
		{"paused without autoResume answers 502", false, nil, 502, 0},
		{"failed resume answers 502", true, errors.New("disk on fire"), 502, 1},
		{"a resume the node's limits refuse answers 429", true, retryLater{}, 429, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			res := &resumingResolver{fail: tc.fail}
			res.route = Route{Addr: host, AutoResume: tc.autoResume}
			r := httptest.NewRequest("GET", "/", nil)
			r.Header.Set(HeaderSandboxID, "sbx")
			r.Header.Set(HeaderSandboxPort, portStr)
			rec := httptest.NewRecorder()
			New(res, "", 49983, nil).ServeHTTP(rec, r)
			if rec.Code != tc.status || res.resumes != tc.wantResumes {
				t.Fatalf("status %d resumes %d, want %d and %d: %s", rec.Code, res.resumes, tc.status, tc.wantResumes, rec.Body)
			}
			if tc.status == 429 && rec.Header().Get("Retry-After") != "7" {
				t.Fatalf("Retry-After %q", rec.Header().Get("Retry-After"))
			}
		})
	}
}

// The proxy is full duplex over HTTP/1.1: the guest may answer (and the
// proxy flush the answer) before the request body has been forwarded, and
// the body keeps flowing while the response streams back.
func TestFullDuplexHTTP1(t *testing.T) {
	backend := httptest.NewServer(http.HandlerFunc(proxytest.Echo))
	defer backend.Close()
	host, portStr, _ := net.SplitHostPort(strings.TrimPrefix(backend.URL, "http://"))
	front := httptest.NewServer(New(stubResolver{"sbx": {Addr: host, Running: true}}, "", 49983, nil))
	defer front.Close()
	proxytest.CheckFullDuplex(t, front.URL+"/echo", http.Header{HeaderSandboxID: {"sbx"}, HeaderSandboxPort: {portStr}})
}

// TestSandboxErrorsInE2BsWords: the proxy's 502s about a sandbox are E2B's
// bodies, whose messages the SDKs map to their exceptions: "was not found"
// (not running) for an unknown or paused sandbox, "port is not open"
// (unreachable, naming the port) when nothing answers in the guest; each
// carries the request id.
func TestSandboxErrorsInE2BsWords(t *testing.T) {
	closed, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := closed.Addr().(*net.TCPAddr).Port
	closed.Close() // nothing listens there now
	p := httperr.WithIDs(New(stubResolver{
		"running": {Addr: "127.0.0.1", Running: true},
		"paused":  {Addr: "127.0.0.1", Running: false},
	}, "", 49983, nil))
	for _, c := range []struct {
		id, msg string
		port    int
	}{
		{"nope", "The sandbox was not found", 0},
		{"paused", "The sandbox was not found", 0},
		{"running", "The sandbox is running but port is not open", port},
	} {
		r := httptest.NewRequest("GET", "/x", nil)
		r.Header.Set(HeaderSandboxID, c.id)
		r.Header.Set(HeaderSandboxPort, strconv.Itoa(port))
		rec := httptest.NewRecorder()
		p.ServeHTTP(rec, r)
		var body struct {
			SandboxID string `json:"sandboxId"`
			Message   string `json:"message"`
			Port      int    `json:"port"`
			Code      int    `json:"code"`
		}
		if err := json.Unmarshal(rec.Body.Bytes(), &body); err != nil || rec.Code != 502 || body.Code != 502 || body.SandboxID != c.id ||
			!strings.HasPrefix(body.Message, c.msg) || !strings.Contains(body.Message, rec.Header().Get(httperr.Header)) || body.Port != c.port {
			t.Errorf("%s: %d %s", c.id, rec.Code, rec.Body)
		}
	}
}

// TestMaskRequestHost: a sandbox made with network.maskRequestHost has its
// ports other than envd's see that Host ("${PORT}" replaced by the port)
// and the client's in X-Forwarded-Host; envd's port keeps the usual Host.
func TestMaskRequestHost(t *testing.T) {
	seen := make(chan [2]string, 1)
	backend := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		seen <- [2]string{r.Host, r.Header.Get("X-Forwarded-Host")}
	}))
	defer backend.Close()
	host, portStr, _ := net.SplitHostPort(strings.TrimPrefix(backend.URL, "http://"))
	port, _ := strconv.Atoi(portStr)
	route := stubResolver{"masked": {Addr: host, Running: true, MaskRequestHost: "app.internal:${PORT}"}}
	for _, c := range []struct {
		name            string
		envdPort        int
		wantHost, wantX string
	}{
		{"app port", 49983, "app.internal:" + portStr, portStr + "-masked.sandbox.test"},
		{"envd port", port, net.JoinHostPort(host, portStr), portStr + "-masked.sandbox.test"},
	} {
		p := New(route, "sandbox.test", c.envdPort, nil)
		r := httptest.NewRequest("GET", "http://"+portStr+"-masked.sandbox.test/", nil)
		rec := httptest.NewRecorder()
		p.ServeHTTP(rec, r)
		if rec.Code != 200 {
			t.Fatalf("%s: %d %s", c.name, rec.Code, rec.Body)
		}
		if got := <-seen; got[0] != c.wantHost || got[1] != c.wantX {
			t.Errorf("%s: the guest saw Host %q, X-Forwarded-Host %q; want %q, %q", c.name, got[0], got[1], c.wantHost, c.wantX)
		}
	}
}
