package httperr

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"syscall"
	"testing"

	"github.com/agentenv/agentenv/internal/errkind"
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

// TestStatusOf: each kind's status; the node's disk being full is a 507
// however it was reported (a kind, an errno wrapped anywhere, or a tool's
// words), even inside an error of another kind.
func TestStatusOf(t *testing.T) {
	for _, c := range []struct {
		err  error
		want int
	}{
		{fmt.Errorf("sandbox x: %w", errkind.ErrNotFound), 404},
		{fmt.Errorf("%w: bad", errkind.ErrInvalid), 400},
		{fmt.Errorf("%w: full", errkind.ErrTooLarge), 413},
		{fmt.Errorf("%w: below the floor", errkind.ErrNoSpace), 507},
		{fmt.Errorf("write state: %w", &os.PathError{Op: "write", Path: "/x", Err: syscall.ENOSPC}), 507},
		{fmt.Errorf("%w: upload: write /x: no space left on device", errkind.ErrInvalid), 507},
		{errors.New("qemu-img create overlay /x: exit status 1: qemu-img: /x: Could not write: No space left on device"), 507},
		{fmt.Errorf("copy: %w", syscall.EDQUOT), 507},
		{errors.New("update sandbox x state: database or disk is full (13)"), 507},
		{context.DeadlineExceeded, 504},
		{errors.New("something else"), 500},
	} {
		if got := StatusOf(c.err); got != c.want {
			t.Errorf("StatusOf(%v) = %d, want %d", c.err, got, c.want)
		}
	}
}
