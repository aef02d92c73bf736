package e2e

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"testing"
	"time"
)

// Clients for the two transports the proxy must serve: HTTP/1.1 and
// cleartext HTTP/2 with prior knowledge (h2c).
var (
	http1Client = &http.Client{Transport: &http.Transport{DisableCompression: true}}
	h2cClient   = func() *http.Client {
		var p http.Protocols
		p.SetUnencryptedHTTP2(true)
		return &http.Client{Transport: &http.Transport{Protocols: &p, DisableCompression: true}}
	}()
)

// sandboxRequest builds a request for port of sb, routed by the SDK's
// headers, with the envd access token when withToken.
func (s *server) sandboxRequest(ctx context.Context, sb *sandbox, port int, method, path string, body io.Reader, withToken bool) *http.Request {
	req, err := http.NewRequestWithContext(ctx, method, s.url+path, body)
	if err != nil {
		panic(err)
	}
	req.Header.Set("E2b-Sandbox-Id", sb.SandboxID)
	req.Header.Set("E2b-Sandbox-Port", strconv.Itoa(port))
	if withToken && sb.EnvdAccessToken != "" {
		req.Header.Set("X-Access-Token", sb.EnvdAccessToken)
	}
	return req
}

// upload writes content to path in the guest through the proxy.
func (s *server) upload(t *testing.T, sb *sandbox, path string, content []byte) {
	t.Helper()
	req := s.sandboxRequest(context.Background(), sb, envdPort, "POST", "/files?path="+path, bytes.NewReader(content), true)
	req.Header.Set("Content-Type", "application/octet-stream")
	resp, err := http1Client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		b, _ := io.ReadAll(resp.Body)
		t.Fatalf("upload %s: %d %s", path, resp.StatusCode, b)
	}
}

// processEvent is one message of process.Process/Start's stream (protojson).
type processEvent struct {
	Event struct {
		Start *struct {
			Pid int `json:"pid"`
		} `json:"start"`
		Data *struct {
			Stdout []byte `json:"stdout"`
			Stderr []byte `json:"stderr"`
		} `json:"data"`
		End *struct {
			ExitCode int    `json:"exitCode"`
			Exited   bool   `json:"exited"`
			Status   string `json:"status"`
		} `json:"end"`
	} `json:"event"`
	at time.Time
}

// startProcess calls process.Process/Start (a Connect server stream, JSON
// codec) through the proxy with client and returns a channel of its events,
// each stamped with its arrival time; the channel closes with the stream.
func (s *server) startProcess(ctx context.Context, t *testing.T, client *http.Client, sb *sandbox, cmd string, args ...string) (<-chan processEvent, *http.Response) {
	t.Helper()
	ch, resp, err := s.startProcessErr(ctx, client, sb, cmd, args...)
	if err != nil {
		t.Fatal(err)
	}
	return ch, resp
}

// startProcessErr is startProcess for callers that are not the test's
// goroutine.
func (s *server) startProcessErr(ctx context.Context, client *http.Client, sb *sandbox, cmd string, args ...string) (<-chan processEvent, *http.Response, error) {
	msg, _ := json.Marshal(map[string]any{"process": map[string]any{"cmd": cmd, "args": args}})
	var env bytes.Buffer
	env.WriteByte(0)
	_ = binary.Write(&env, binary.BigEndian, uint32(len(msg)))
	env.Write(msg)
	req := s.sandboxRequest(ctx, sb, envdPort, "POST", "/process.Process/Start", &env, true)
	req.Header.Set("Content-Type", "application/connect+json")
	req.Header.Set("Connect-Protocol-Version", "1")
	resp, err := client.Do(req)
	if err != nil {
		return nil, nil, fmt.Errorf("Start %s: %v", cmd, err)
	}
	if resp.StatusCode != 200 {
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		return nil, nil, fmt.Errorf("Start %s: %d %s", cmd, resp.StatusCode, b)
	}
	ch := make(chan processEvent, 64)
	go func() {
		defer close(ch)
		defer resp.Body.Close()
		br := bufio.NewReader(resp.Body)
		for {
			var hdr [5]byte
			if _, err := io.ReadFull(br, hdr[:]); err != nil {
				return
			}
			n := binary.BigEndian.Uint32(hdr[1:])
			if n > 16<<20 {
				return
			}
			body := make([]byte, n)
			if _, err := io.ReadFull(br, body); err != nil {
				return
			}
			if hdr[0]&0x02 != 0 { // end of stream
				return
			}
			var ev processEvent
			if err := json.Unmarshal(body, &ev); err != nil {
				return
			}
			ev.at = time.Now()
			ch <- ev
		}
	}()
	return ch, resp, nil
}

// runQuiet runs a command like run, returning errors instead of failing
// the test (for worker goroutines).
func (s *server) runQuiet(ctx context.Context, sb *sandbox, cmd string, args ...string) (string, int, error) {
	events, _, err := s.startProcessErr(ctx, http1Client, sb, cmd, args...)
	if err != nil {
		return "", 0, err
	}
	var out bytes.Buffer
	for ev := range events {
		if ev.Event.Data != nil {
			out.Write(ev.Event.Data.Stdout)
		}
		if ev.Event.End != nil {
			return out.String(), ev.Event.End.ExitCode, nil
		}
	}
	return out.String(), 0, fmt.Errorf("%s: stream ended without an end event", cmd)
}

// run starts a command and waits for its end event, returning stdout.
func (s *server) run(t *testing.T, sb *sandbox, cmd string, args ...string) (string, int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	events, _ := s.startProcess(ctx, t, http1Client, sb, cmd, args...)
	var out bytes.Buffer
	for ev := range events {
		if ev.Event.Data != nil {
			out.Write(ev.Event.Data.Stdout)
		}
		if ev.Event.End != nil {
			return out.String(), ev.Event.End.ExitCode
		}
	}
	t.Fatalf("%s: stream ended without an end event (stdout %q)", cmd, out.String())
	return "", 0
}

// waitHTTP polls GET path on port until it answers 200.
func (s *server) waitHTTP(t *testing.T, sb *sandbox, port int, path string) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		resp, err := http1Client.Do(s.sandboxRequest(context.Background(), sb, port, "GET", path, nil, false))
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == 200 {
				return
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("port %d in the guest did not answer %s: %v", port, path, fmt.Sprint(err))
		}
		time.Sleep(200 * time.Millisecond)
	}
}
