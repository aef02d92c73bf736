package e2e

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha1"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"
)

const guestHTTPPort = 8080

// startGuestServer uploads testdata/guestserver.py into sb and runs it on
// guestHTTPPort; the Start stream stays open until the test ends.
func startGuestServer(t *testing.T, s *server, sb *sandbox) {
	t.Helper()
	src, err := os.ReadFile("testdata/guestserver.py")
	if err != nil {
		t.Fatal(err)
	}
	s.upload(t, sb, "/tmp/guestserver.py", src)
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	s.startProcess(ctx, t, http1Client, sb, "python3", "/tmp/guestserver.py", fmt.Sprint(guestHTTPPort))
	s.waitHTTP(t, sb, guestHTTPPort, "/hello")
}

// assertJSONError checks a proxy/API error answer: status and a JSON body
// {code: status, message: non-empty}.
func assertJSONError(t *testing.T, resp *http.Response, status int) {
	t.Helper()
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != status {
		t.Fatalf("status %d, want %d: %s", resp.StatusCode, status, b)
	}
	var e struct {
		Code    int    `json:"code"`
		Message string `json:"message"`
	}
	if err := json.Unmarshal(b, &e); err != nil || e.Code != status || e.Message == "" {
		t.Fatalf("body %q is not {code:%d,message}: %v", b, status, err)
	}
}

func TestProxyRealGuest(t *testing.T) {
	s := needServer(t)
	sb := s.createSandbox(t, map[string]any{"metadata": map[string]string{"suite": "proxy"}})
	startGuestServer(t, s, sb)
	ctx := context.Background()

	t.Run("routing", func(t *testing.T) {
		for _, tc := range []struct {
			name string
			req  func() *http.Request
		}{
			{"headers", func() *http.Request {
				return s.sandboxRequest(ctx, sb, guestHTTPPort, "GET", "/hello", nil, false)
			}},
			{"host form", func() *http.Request {
				req, _ := http.NewRequest("GET", s.url+"/hello", nil)
				req.Host = fmt.Sprintf("%d-%s.e2e.test", guestHTTPPort, sb.SandboxID)
				return req
			}},
			{"host form with client id", func() *http.Request {
				req, _ := http.NewRequest("GET", s.url+"/hello", nil)
				req.Host = fmt.Sprintf("%d-%s-someclient.e2e.test:443", guestHTTPPort, sb.SandboxID)
				return req
			}},
		} {
			for cname, client := range map[string]*http.Client{"http1": http1Client, "h2c": h2cClient} {
				t.Run(tc.name+"/"+cname, func(t *testing.T) {
					resp, err := client.Do(tc.req())
					if err != nil {
						t.Fatal(err)
					}
					defer resp.Body.Close()
					b, _ := io.ReadAll(resp.Body)
					if resp.StatusCode != 200 || string(b) != "hello from the guest" {
						t.Fatalf("%d %q", resp.StatusCode, b)
					}
					if want := map[string]int{"http1": 1, "h2c": 2}[cname]; resp.ProtoMajor != want {
						t.Fatalf("served over HTTP/%d, want %d", resp.ProtoMajor, want)
					}
				})
			}
		}
	})

	t.Run("large request and response bodies", func(t *testing.T) {
		body := make([]byte, 3<<20)
		_, _ = rand.Read(body)
		for cname, client := range map[string]*http.Client{"http1": http1Client, "h2c": h2cClient} {
			t.Run(cname, func(t *testing.T) {
				resp, err := client.Do(s.sandboxRequest(ctx, sb, guestHTTPPort, "POST", "/echo", bytes.NewReader(body), false))
				if err != nil {
					t.Fatal(err)
				}
				defer resp.Body.Close()
				got, _ := io.ReadAll(resp.Body)
				if resp.StatusCode != 200 || !bytes.Equal(got, body) {
					t.Fatalf("%d, %d bytes back of %d", resp.StatusCode, len(got), len(body))
				}
			})
		}
	})

	// The guest writes a chunk every 300 ms; an unbuffered proxy hands the
	// first one over long before the last is written.
	t.Run("HTTP streaming is unbuffered", func(t *testing.T) {
		for cname, client := range map[string]*http.Client{"http1": http1Client, "h2c": h2cClient} {
			t.Run(cname, func(t *testing.T) {
				resp, err := client.Do(s.sandboxRequest(ctx, sb, guestHTTPPort, "GET", "/stream?n=6", nil, false))
				if err != nil {
					t.Fatal(err)
				}
				defer resp.Body.Close()
				br := bufio.NewReader(resp.Body)
				var at []time.Duration
				start := time.Now()
				for {
					line, err := br.ReadString('\n')
					if err != nil {
						break
					}
					if line != fmt.Sprintf("tick %d\n", len(at)) {
						t.Fatalf("line %d: %q", len(at), line)
					}
					at = append(at, time.Since(start))
				}
				if len(at) != 6 {
					t.Fatalf("%d ticks, want 6", len(at))
				}
				if spread := at[5] - at[0]; spread < time.Second {
					t.Fatalf("ticks arrived %v apart in total (%v): the proxy buffered the stream", spread, at)
				}
			})
		}
	})

	// A Connect server stream (envd's process.Process/Start) through the
	// proxy delivers each output line as the guest writes it.
	t.Run("Connect server stream is unbuffered", func(t *testing.T) {
		for cname, client := range map[string]*http.Client{"http1": http1Client, "h2c": h2cClient} {
			t.Run(cname, func(t *testing.T) {
				cctx, cancel := context.WithTimeout(ctx, time.Minute)
				defer cancel()
				events, resp := s.startProcess(cctx, t, client, sb, "/bin/sh", "-c", "for i in 1 2 3 4; do echo $i; sleep 0.4; done")
				if want := map[string]int{"http1": 1, "h2c": 2}[cname]; resp.ProtoMajor != want {
					t.Fatalf("served over HTTP/%d, want %d", resp.ProtoMajor, want)
				}
				var data []time.Time
				var out string
				var end time.Time
				for ev := range events {
					if ev.Event.Data != nil && len(ev.Event.Data.Stdout) > 0 {
						data = append(data, ev.at)
						out += string(ev.Event.Data.Stdout)
					}
					if ev.Event.End != nil {
						end = ev.at
						if ev.Event.End.ExitCode != 0 {
							t.Fatalf("exit %d", ev.Event.End.ExitCode)
						}
					}
				}
				if out != "1\n2\n3\n4\n" || end.IsZero() {
					t.Fatalf("stdout %q, end %v", out, end)
				}
				if gap := end.Sub(data[0]); gap < time.Second {
					t.Fatalf("first output only %v before the end: the stream was buffered", gap)
				}
			})
		}
	})

	t.Run("WebSocket echo", func(t *testing.T) {
		conn, br := websocketDial(t, s, sb, guestHTTPPort, "/ws")
		defer conn.Close()
		big := bytes.Repeat([]byte("0123456789"), 7000) // > 64 KiB: 8-byte length form
		for _, msg := range []struct {
			op   byte
			data []byte
		}{{1, []byte("hello over ws")}, {2, []byte{0, 1, 2, 255}}, {1, big}} {
			if err := wsWrite(conn, msg.op, msg.data); err != nil {
				t.Fatal(err)
			}
			_ = conn.SetReadDeadline(time.Now().Add(20 * time.Second))
			op, data, err := wsRead(br)
			if err != nil {
				t.Fatal(err)
			}
			if op != msg.op || !bytes.Equal(data, msg.data) {
				t.Fatalf("echo: op %d (%d bytes), want op %d (%d bytes)", op, len(data), msg.op, len(msg.data))
			}
		}
		if err := wsWrite(conn, 8, nil); err != nil {
			t.Fatal(err)
		}
		if op, _, err := wsRead(br); err != nil || op != 8 {
			t.Fatalf("close: op %d, %v", op, err)
		}
	})

	t.Run("envd access token", func(t *testing.T) {
		if sb.EnvdAccessToken == "" {
			t.Fatal("POST /v2/sandboxes did not create a secure sandbox")
		}
		wrong := &sandbox{SandboxID: sb.SandboxID, EnvdAccessToken: "not-the-token"}
		for _, tc := range []struct {
			name     string
			sb       *sandbox
			token    bool
			method   string
			path     string
			ctype    string
			body     string
			status   int
			bodyHas  string
			wantJSON bool
		}{
			{"plain HTTP without token", sb, false, "GET", "/envs", "", "", 401, "", true},
			{"plain HTTP with wrong token", wrong, true, "GET", "/envs", "", "", 401, "", true},
			{"plain HTTP with token", sb, true, "GET", "/envs", "", "", 200, "", false},
			{"Connect without token", sb, false, "POST", "/process.Process/List", "application/json", "{}", 401, `"unauthenticated"`, false},
			{"Connect with token", sb, true, "POST", "/process.Process/List", "application/json", "{}", 200, "", false},
			{"health needs no token", sb, false, "GET", "/health", "", "", 204, "", false},
			{"unsigned files URL", sb, false, "GET", "/files?path=/etc/hostname", "", "", 401, "", true},
			{"badly signed files URL", sb, false, "GET", "/files?path=/etc/hostname&signature=v1_AAAA", "", "", 401, "", true},
			{"init needs the token", sb, false, "POST", "/init", "application/json", `{"accessToken":"mine"}`, 401, "", true},
		} {
			t.Run(tc.name, func(t *testing.T) {
				var body io.Reader
				if tc.body != "" {
					body = strings.NewReader(tc.body)
				}
				req := s.sandboxRequest(ctx, tc.sb, envdPort, tc.method, tc.path, body, tc.token)
				if tc.ctype != "" {
					req.Header.Set("Content-Type", tc.ctype)
				}
				resp, err := http1Client.Do(req)
				if err != nil {
					t.Fatal(err)
				}
				if tc.wantJSON {
					assertJSONError(t, resp, tc.status)
					return
				}
				defer resp.Body.Close()
				b, _ := io.ReadAll(resp.Body)
				if resp.StatusCode != tc.status || !strings.Contains(string(b), tc.bodyHas) {
					t.Fatalf("%d %s, want %d containing %q", resp.StatusCode, b, tc.status, tc.bodyHas)
				}
			})
		}
		// The sandbox still works with its token (no re-init took effect).
		if out, code := s.run(t, sb, "/bin/echo", "still mine"); out != "still mine\n" || code != 0 {
			t.Fatalf("after auth checks: %q %d", out, code)
		}
	})

	t.Run("errors", func(t *testing.T) {
		for _, tc := range []struct {
			name   string
			id     string
			port   string
			status int
		}{
			{"nothing listening on the port", sb.SandboxID, "8099", 502},
			{"unknown sandbox", "abcdefghij0123456789", "49983", 502},
			{"invalid sandbox id", "../../etc", "49983", 400},
			{"invalid port", sb.SandboxID, "70000", 400},
			{"non-numeric port", sb.SandboxID, "http", 400},
		} {
			t.Run(tc.name, func(t *testing.T) {
				req, _ := http.NewRequest("GET", s.url+"/health", nil)
				req.Header.Set("E2b-Sandbox-Id", tc.id)
				req.Header.Set("E2b-Sandbox-Port", tc.port)
				resp, err := http1Client.Do(req)
				if err != nil {
					t.Fatal(err)
				}
				assertJSONError(t, resp, tc.status)
			})
		}
	})
}

func TestProxyKilledSandboxAnswers502(t *testing.T) {
	s := needServer(t)
	sb := s.createSandbox(t, map[string]any{"templateID": "minimal"})
	resp, err := http1Client.Do(s.sandboxRequest(context.Background(), sb, envdPort, "GET", "/health", nil, false))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 204 {
		t.Fatalf("health of a live sandbox: %d", resp.StatusCode)
	}
	// A stream in flight ends promptly when the sandbox is killed.
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	events, _ := s.startProcess(ctx, t, h2cClient, sb, "/bin/sh", "-c", "while true; do echo x; sleep 0.2; done")
	if ev := <-events; ev.Event.Start == nil {
		t.Fatalf("first event %+v", ev)
	}
	if err := s.rest(context.Background(), "DELETE", "/sandboxes/"+sb.SandboxID, nil, nil); err != nil {
		t.Fatal(err)
	}
	killed := time.Now()
	for range events {
	}
	d := time.Since(killed)
	t.Logf("stream ended %v after the kill request", d.Round(time.Millisecond))
	if d > 10*time.Second {
		t.Fatalf("the stream outlived its sandbox by %v", d)
	}
	for _, client := range []*http.Client{http1Client, h2cClient} {
		resp, err := client.Do(s.sandboxRequest(context.Background(), sb, envdPort, "GET", "/health", nil, false))
		if err != nil {
			t.Fatal(err)
		}
		assertJSONError(t, resp, 502)
	}
}

// Minimal WebSocket client (RFC 6455) so the test needs no extra module.

func websocketDial(t *testing.T, s *server, sb *sandbox, port int, path string) (net.Conn, *bufio.Reader) {
	t.Helper()
	conn, err := net.Dial("tcp", strings.TrimPrefix(s.url, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	keyRaw := make([]byte, 16)
	_, _ = rand.Read(keyRaw)
	key := base64.StdEncoding.EncodeToString(keyRaw)
	fmt.Fprintf(conn, "GET %s HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"+
		"Sec-WebSocket-Key: %s\r\nSec-WebSocket-Version: 13\r\nE2b-Sandbox-Id: %s\r\nE2b-Sandbox-Port: %d\r\n\r\n",
		path, key, sb.SandboxID, port)
	br := bufio.NewReader(conn)
	_ = conn.SetReadDeadline(time.Now().Add(20 * time.Second))
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		conn.Close()
		t.Fatal(err)
	}
	sum := sha1.Sum([]byte(key + "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"))
	if resp.StatusCode != 101 || resp.Header.Get("Sec-WebSocket-Accept") != base64.StdEncoding.EncodeToString(sum[:]) {
		conn.Close()
		t.Fatalf("handshake: %s %v", resp.Status, resp.Header)
	}
	return conn, br
}

func wsWrite(w io.Writer, op byte, data []byte) error {
	var hdr bytes.Buffer
	hdr.WriteByte(0x80 | op)
	switch n := len(data); {
	case n < 126:
		hdr.WriteByte(0x80 | byte(n))
	case n < 65536:
		hdr.WriteByte(0x80 | 126)
		_ = binary.Write(&hdr, binary.BigEndian, uint16(n))
	default:
		hdr.WriteByte(0x80 | 127)
		_ = binary.Write(&hdr, binary.BigEndian, uint64(n))
	}
	mask := make([]byte, 4)
	_, _ = rand.Read(mask)
	hdr.Write(mask)
	masked := make([]byte, len(data))
	for i, b := range data {
		masked[i] = b ^ mask[i%4]
	}
	_, err := w.Write(append(hdr.Bytes(), masked...))
	return err
}

func wsRead(br *bufio.Reader) (byte, []byte, error) {
	var h [2]byte
	if _, err := io.ReadFull(br, h[:]); err != nil {
		return 0, nil, err
	}
	n := uint64(h[1] & 0x7f)
	switch n {
	case 126:
		var v uint16
		if err := binary.Read(br, binary.BigEndian, &v); err != nil {
			return 0, nil, err
		}
		n = uint64(v)
	case 127:
		if err := binary.Read(br, binary.BigEndian, &n); err != nil {
			return 0, nil, err
		}
	}
	if n > 1<<24 {
		return 0, nil, fmt.Errorf("frame of %d bytes", n)
	}
	data := make([]byte, n)
	_, err := io.ReadFull(br, data)
	return h[0] & 0x0f, data, err
}
