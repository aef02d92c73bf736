// Package proxytest holds what the tests of the sandbox proxies (a node's
// and the gateway's) share: an upstream that echoes a request body as it
// arrives, and the check that a proxy in front of it streams both ways at
// once over HTTP/1.1.
package proxytest

import (
	"context"
	"io"
	"net/http"
	"testing"
	"time"
)

// Echo answers at once (its headers flushed before it reads anything) and
// writes back each piece of the request body as it arrives.
func Echo(w http.ResponseWriter, r *http.Request) {
	_ = http.NewResponseController(w).EnableFullDuplex()
	w.WriteHeader(http.StatusOK)
	w.(http.Flusher).Flush()
	buf := make([]byte, 64)
	for {
		n, err := r.Body.Read(buf)
		if n > 0 {
			_, _ = w.Write(buf[:n])
			w.(http.Flusher).Flush()
		}
		if err != nil {
			return
		}
	}
}

// CheckFullDuplex posts a body to url, through a proxy to Echo, in pieces,
// each sent only once the previous one's echo came back, and then expects
// the answer to end with the body. A proxy that is not full duplex hangs
// until the deadline or breaks the stream.
func CheckFullDuplex(t testing.TB, url string, header http.Header) {
	t.Helper()
	pr, pw := io.Pipe()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	go func() { <-ctx.Done(); pw.CloseWithError(ctx.Err()) }()
	req, _ := http.NewRequestWithContext(ctx, "POST", url, pr)
	for k, vs := range header {
		req.Header[k] = vs
	}
	resp, err := (&http.Client{Transport: &http.Transport{}}).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	for _, msg := range []string{"one", "two", "three"} {
		if _, err := io.WriteString(pw, msg); err != nil {
			t.Fatal(err)
		}
		got := make([]byte, len(msg))
		if _, err := io.ReadFull(resp.Body, got); err != nil || string(got) != msg {
			t.Fatalf("echo of %q: %q %v", msg, got, err)
		}
	}
	pw.Close()
	if rest, err := io.ReadAll(resp.Body); err != nil || len(rest) != 0 {
		t.Fatalf("after close: %q %v", rest, err)
	}
}
