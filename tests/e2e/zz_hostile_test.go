package e2e

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"
)

// These run last in the package (file order): they read the whole server
// log the other tests produced.

// TestSlowClientsAreCut: a client that sends its request headers a byte at
// a time (slowloris) is disconnected once the server's header timeout
// (10 s) has passed, and the server keeps answering others meanwhile.
func TestSlowClientsAreCut(t *testing.T) {
	s := needServer(t)
	conn, err := net.Dial("tcp", strings.TrimPrefix(s.url, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	start := time.Now()
	fmt.Fprint(conn, "GET /health HTTP/1.1\r\nHost: x\r\n")
	cut := make(chan time.Duration, 1)
	go func() {
		buf := make([]byte, 1)
		for {
			if _, err := conn.Write([]byte("X")); err != nil {
				cut <- time.Since(start)
				return
			}
			conn.SetReadDeadline(time.Now().Add(time.Second))
			if _, err := conn.Read(buf); err != nil && !isTimeout(err) {
				cut <- time.Since(start)
				return
			}
			if time.Since(start) > 30*time.Second {
				cut <- 0
				return
			}
		}
	}()
	// Others are served meanwhile.
	if resp, err := http.Get(s.url + "/health"); err != nil || resp.StatusCode != 200 {
		t.Fatalf("health while a slow client hangs on: %v %v", resp, err)
	}
	d := <-cut
	if d == 0 || d < 9*time.Second {
		t.Fatalf("slow client cut after %s (want about 10 s)", d)
	}
	t.Logf("slowloris client cut after %s", d.Round(time.Millisecond))
}

func isTimeout(err error) bool {
	ne, ok := err.(net.Error)
	return ok && ne.Timeout()
}

// TestSecretsStayOutOfLogs: the API key, a secure sandbox's access token
// and its traffic token never appear in the server's log (debug level),
// after a create, requests through the proxy and a kill.
func TestSecretsStayOutOfLogs(t *testing.T) {
	s := needServer(t)
	var sb struct {
		SandboxID          string `json:"sandboxID"`
		EnvdAccessToken    string `json:"envdAccessToken"`
		TrafficAccessToken string `json:"trafficAccessToken"`
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if err := s.rest(ctx, "POST", "/sandboxes", map[string]any{"templateID": "minimal", "secure": true}, &sb); err != nil {
		t.Fatal(err)
	}
	if sb.EnvdAccessToken == "" {
		t.Fatal("a secure sandbox without an access token")
	}
	box := &sandbox{SandboxID: sb.SandboxID, EnvdAccessToken: sb.EnvdAccessToken}
	if out, code := s.run(t, box, "/bin/sh", "-c", "echo hi"); code != 0 || out != "hi\n" {
		t.Fatalf("exec: %q %d", out, code)
	}
	// A wrong token too: refusals must not echo what was sent.
	req := s.sandboxRequest(ctx, &sandbox{SandboxID: sb.SandboxID, EnvdAccessToken: "wrong-" + sb.EnvdAccessToken}, envdPort, "GET", "/files?path=/etc/hostname", nil, true)
	if resp, err := http1Client.Do(req); err == nil {
		resp.Body.Close()
	}
	if err := s.rest(ctx, "DELETE", "/sandboxes/"+sb.SandboxID, nil, nil); err != nil {
		t.Fatal(err)
	}
	time.Sleep(200 * time.Millisecond)
	f, err := os.Open(s.logPath)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	secrets := map[string]string{"API key": apiKey, "envd access token": sb.EnvdAccessToken}
	if sb.TrafficAccessToken != "" {
		secrets["traffic token"] = sb.TrafficAccessToken
	}
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	lines := 0
	for sc.Scan() {
		lines++
		for what, secret := range secrets {
			if strings.Contains(sc.Text(), secret) {
				t.Errorf("the server logged the %s: %.300s", what, sc.Text())
			}
		}
	}
	if lines == 0 {
		t.Fatal("empty server log")
	}
	t.Logf("checked %d log lines", lines)
}
