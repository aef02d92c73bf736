package api

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/agentenv/agentenv/internal/httperr"
	"github.com/agentenv/agentenv/internal/orchestrator"
	"github.com/agentenv/agentenv/internal/sandboxes"
)

// Failures of the node's own answer with a request id and a short message;
// what went wrong (host paths, QEMU's output) is in the log under that id
// only. Refusals say why, without the data dir's path.
func TestErrorBodiesKeepInternalsOut(t *testing.T) {
	qemuTail := "qemu-system-x86_64: -drive file=" + fakeDataDir + "/sandboxes/x/overlay.qcow2: Permission denied"
	for _, tc := range []struct {
		name    string
		err     error
		status  int
		inLog   bool
		message string // a part the body must have
	}{
		{"internal", fmt.Errorf("pause: save-state: %s", qemuTail), 500, true, "internal error"},
		{"corrupt", fmt.Errorf("%w: state file %s/sandboxes/x/state: checksum", orchestrator.ErrCorrupt, fakeDataDir), 500, true, "internal error"},
		{"timeout", fmt.Errorf("pause: %w", context.DeadlineExceeded), 504, true, "did not finish in time"},
		{"conflict", fmt.Errorf("%w: sandbox x is forking", orchestrator.ErrConflict), 409, false, "sandbox x is forking"},
		{"not found naming a path", fmt.Errorf("%w: template snapshot %s/snapshots/s1 missing", orchestrator.ErrNotFound, fakeDataDir), 404, false, "<data dir>/snapshots/s1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var logs bytes.Buffer
			node := newFakeNode()
			srv, err := New(node, Config{APIKey: testKey, Domain: "sandbox.test", Logger: slog.New(slog.NewJSONHandler(&logs, nil))})
			if err != nil {
				t.Fatal(err)
			}
			node.add(&sandboxes.Sandbox{ID: "x", TemplateID: "base"})
			node.pauseErr = tc.err
			req := httptest.NewRequest("POST", "/sandboxes/x/pause", nil)
			req.Header.Set("X-API-Key", testKey)
			rec := httptest.NewRecorder()
			srv.ServeHTTP(rec, req)
			assertError(t, rec, tc.status)
			body := rec.Body.String()
			id := rec.Header().Get(httperr.Header)
			if id == "" {
				t.Fatal("no request id in the answer")
			}
			if strings.Contains(body, fakeDataDir) || strings.Contains(body, "qemu-system") || strings.Contains(body, "checksum") && tc.status >= 500 {
				t.Fatalf("the answer shows internals: %s", body)
			}
			if !strings.Contains(body, tc.message) {
				t.Fatalf("the answer %s does not say %q", body, tc.message)
			}
			if tc.status >= 500 {
				if !strings.Contains(body, id) {
					t.Fatalf("a 5xx answer without its request id %s: %s", id, body)
				}
				var entry map[string]any
				found := false
				for _, line := range strings.Split(strings.TrimSpace(logs.String()), "\n") {
					if json.Unmarshal([]byte(line), &entry) == nil && entry["request"] == id {
						found = strings.Contains(fmt.Sprint(entry["err"]), strings.SplitN(tc.err.Error(), ":", 2)[0])
					}
				}
				if !found {
					t.Fatalf("the log has no entry with the error under request %s:\n%s", id, logs.String())
				}
			}
		})
	}
}

// A caller's well-formed request id (a gateway's) is kept; a malformed one
// is replaced.
func TestRequestIDs(t *testing.T) {
	a := newTestAPI(t)
	for _, tc := range []struct {
		sent string
		keep bool
	}{
		{"gw-0123456789abcdef", true},
		{"", false},
		{"bad id with spaces", false},
		{strings.Repeat("x", 200), false},
	} {
		req := httptest.NewRequest("GET", "/sandboxes", nil)
		req.Header.Set("X-API-Key", testKey)
		if tc.sent != "" {
			req.Header.Set(httperr.Header, tc.sent)
		}
		rec := httptest.NewRecorder()
		a.srv.ServeHTTP(rec, req)
		got := rec.Header().Get(httperr.Header)
		if rec.Code != http.StatusOK || got == "" || (got == tc.sent) != tc.keep {
			t.Errorf("sent %q: status %d, id %q", tc.sent, rec.Code, got)
		}
	}
}

// A fork child that failed on the node's side is reported inside the 201
// answer by the same rules: kind and request id, no internals.
func TestForkChildErrorsKeepInternalsOut(t *testing.T) {
	a := newTestAPI(t)
	a.node.add(&sandboxes.Sandbox{ID: "parent1", TemplateID: "brokenchild"})
	rec := a.do("POST", "/sandboxes/parent1/fork", `{"count":2}`)
	if rec.Code != http.StatusCreated {
		t.Fatalf("fork: %d %s", rec.Code, rec.Body)
	}
	body := rec.Body.String()
	id := rec.Header().Get(httperr.Header)
	if strings.Contains(body, fakeDataDir) || strings.Contains(body, "permission denied") || !strings.Contains(body, id) ||
		!strings.Contains(body, `"code":500`) {
		t.Fatalf("fork answer shows internals or lacks the request id %s: %s", id, body)
	}
}
