package httperr

import (
	"bytes"
	"encoding/json"
	"errors"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

func TestInternalLogsUnderTheRequestID(t *testing.T) {
	var logs bytes.Buffer
	log := slog.New(slog.NewTextHandler(&logs, nil))
	h := WithIDs(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get(Header) != ID(w) {
			t.Errorf("request id %q on the request, %q on the answer", r.Header.Get(Header), ID(w))
		}
		Internal(w, log, http.StatusBadGateway, "the sandbox is not reachable", errors.New("dial tcp 10.11.0.2:49983: connection refused"))
	}))
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest("GET", "/", nil))
	id := rec.Header().Get(Header)
	var b Body
	if err := json.Unmarshal(rec.Body.Bytes(), &b); err != nil {
		t.Fatal(err)
	}
	if rec.Code != 502 || b.Code != 502 || !strings.HasPrefix(b.Message, "the sandbox is not reachable") ||
		!strings.Contains(b.Message, id) || strings.Contains(b.Message, "10.11.0.2") {
		t.Fatalf("answer %d %+v (id %s)", rec.Code, b, id)
	}
	if !strings.Contains(logs.String(), "request="+id) || !strings.Contains(logs.String(), "10.11.0.2") {
		t.Fatalf("log: %s", logs.String())
	}
}

func TestWriteKeepsMessagesReadable(t *testing.T) {
	rec := httptest.NewRecorder()
	Write(rec, http.StatusBadRequest, `cidr "10.0.0.0/33" is <invalid> & so on`)
	if got := rec.Body.String(); !strings.Contains(got, `<invalid> & so on`) || rec.Header().Get("Content-Type") != "application/json" {
		t.Fatalf("body %s", got)
	}
}
