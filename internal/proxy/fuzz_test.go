package proxy

import (
	"net/http/httptest"
	"testing"
	"time"

	"github.com/agentenv/agentenv/internal/signedurl"
)

// FuzzParseTarget feeds arbitrary Host values and routing headers to the
// target parser: it must not panic, and whatever it accepts must name a
// well-formed sandbox id (host form) and a port in 1..65535 (or 0, which the
// proxy refuses as invalid).
func FuzzParseTarget(f *testing.F) {
	for _, s := range [][3]string{
		{"49983-abcdefghij0123456789.e2b.app", "", ""},
		{"8080-abc-client.example.com:443", "", ""},
		{"127.0.0.1:8000", "abc", "49983"},
		{"x", "abc", "-1"},
		{"99999-abc.d", "", ""},
		{"[::1]:80", "", ""},
		{"1-.d", "", ""},
	} {
		f.Add(s[0], s[1], s[2])
	}
	f.Fuzz(func(t *testing.T, host, id, port string) {
		r := httptest.NewRequest("GET", "/", nil)
		r.Host = host
		if id != "" {
			r.Header.Set(HeaderSandboxID, id)
			r.Header.Set(HeaderSandboxPort, port)
		}
		tg, ok := ParseTarget(r, "")
		if !ok {
			return
		}
		if tg.Port < 0 || tg.Port > 65535 {
			t.Fatalf("port %d from %q/%q/%q", tg.Port, host, id, port)
		}
		if r.Header.Get(HeaderSandboxID) == "" && !validSandboxID(tg.SandboxID) {
			t.Fatalf("host %q gave sandbox id %q", host, tg.SandboxID)
		}
	})
}

// FuzzSignedFileRequest: arbitrary query strings never authorize without
// the token's signature.
func FuzzSignedFileRequest(f *testing.F) {
	f.Add("path=/a&signature=v1_x")
	f.Add("path=/home/user/a.txt&signature=" + signedurl.Sign("/home/user/a.txt", "read", "", "tok", ""))
	f.Add("signature_expiration=1&signature=v1_")
	f.Fuzz(func(t *testing.T, q string) {
		r := httptest.NewRequest("GET", "/files", nil)
		r.URL.RawQuery = q
		if FileSignatureError(r, "tok", time.Now()) != nil {
			return
		}
		v := r.URL.Query()
		if v.Get("signature") != signedurl.Sign(v.Get("path"), "read", v.Get("username"), "tok", v.Get("signature_expiration")) {
			t.Fatalf("accepted %q", q)
		}
	})
}
