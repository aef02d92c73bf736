package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"
)

// TestSchemathesis runs schemathesis (the pinned release scripts/test
// installs from PyPI; SCHEMATHESIS names its binary) against the server's
// own GET /openapi.yml, bounded in examples and time:
//   - negative mode (every request breaks the schema): no 5xx, every answer
//     a 4xx in the {code,message} shape, and nothing on the node changed;
//   - positive mode on the read-only operations: no 5xx, errors in shape,
//     and every answer's status, content type and body as documented.
func TestSchemathesis(t *testing.T) {
	bin := os.Getenv("SCHEMATHESIS")
	if bin == "" {
		if os.Getenv("CI") == "true" {
			t.Fatal("SCHEMATHESIS is not set: scripts/test installs schemathesis and sets it")
		}
		t.Skip("SCHEMATHESIS is not set (scripts/test installs schemathesis)")
	}
	s := needServer(t)
	hooks, err := filepath.Abs("testdata/schemathesis")
	if err != nil {
		t.Fatal(err)
	}
	state := func() map[string]any {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		out := map[string]any{}
		for _, path := range []string{"/v2/sandboxes?state=running,paused", "/snapshots", "/templates", "/volumes"} {
			var v any
			if err := s.rest(ctx, "GET", path, nil, &v); err != nil {
				t.Fatalf("GET %s: %v", path, err)
			}
			b, _ := json.Marshal(v)
			var norm any
			json.Unmarshal(b, &norm)
			stripVolatile(norm)
			out[path] = norm
		}
		return out
	}
	run := func(name, checks string, args ...string) {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
		defer cancel()
		all := append([]string{"run", s.url + "/openapi.yml",
			"--checks", checks,
			"--header", "X-API-Key: " + apiKey,
			"--max-examples", "12", "--generation-deterministic", "--request-timeout", "60",
			"--max-failures", "20", "--no-color", "--suppress-health-check", "all",
			// The key is given (--header): generated security headers cannot
			// make a request invalid, only noise that passes for one.
			"--generation-with-security-parameters", "false",
		}, args...)
		cmd := exec.CommandContext(ctx, bin, all...)
		cmd.Env = append(os.Environ(), "SCHEMATHESIS_HOOKS=aenv_checks", "PYTHONPATH="+hooks)
		out, err := cmd.CombinedOutput()
		tail := string(out)
		if i := strings.Index(tail, "FAILURES"); i >= 0 {
			tail = tail[i:]
		} else if len(tail) > 4000 {
			tail = tail[len(tail)-4000:]
		}
		if err != nil {
			t.Fatalf("schemathesis (%s): %v\n%s\nserver log:\n%s", name, err, tail, s.log())
		}
		t.Logf("schemathesis (%s):\n%s", name, tail)
	}
	before := state()
	// Webhook registrations are left out: one the node took would make it
	// send events to whatever URL was generated, and tests send traffic to
	// this machine only (TestWebhookRoutes and TestLifecycleWebhooks cover
	// their bad input).
	har := filepath.Join(t.TempDir(), "negative.har")
	run("negative", "not_a_server_error,error_body_shape,negative_data_rejection",
		"--mode", "negative", "--phases", "examples,coverage,fuzzing", "--exclude-path-regex", "^/events/webhooks",
		"--report", "har", "--report-har-path", har)
	// Schemathesis learns ids from the answers (a sandbox another test
	// left, listed by GET /v2/sandboxes) and sends requests it cannot make
	// invalid (an empty body, a path of real ids): the node accepts those,
	// and negative_data_rejection agrees they were valid. What they named
	// may change; nothing else may.
	touched, accepted := acceptedTargets(t, har)
	if len(accepted) > 0 {
		t.Logf("the negative run sent %d valid requests that changed state, left out of the comparison:\n%s", len(accepted), strings.Join(accepted, "\n"))
	}
	before, after := withoutTouchedAll(before, touched), withoutTouchedAll(state(), touched)
	if !reflect.DeepEqual(before, after) {
		t.Fatalf("refused requests changed the node:\nbefore %v\nafter  %v", before, after)
	}
	// The answers of the read-only operations must match the document:
	// their status codes are documented and their bodies fit its schemas.
	run("positive, read-only", "not_a_server_error,error_body_shape,status_code_conformance,response_schema_conformance,content_type_conformance",
		"--mode", "positive", "--include-method", "GET", "--phases", "examples,coverage,fuzzing")
}

// stripVolatile drops the fields of a listing that change on their own
// (end times move with refreshes, envd versions are constant anyway).
func stripVolatile(v any) {
	switch v := v.(type) {
	case []any:
		for _, e := range v {
			stripVolatile(e)
		}
	case map[string]any:
		delete(v, "endAt")
		for _, e := range v {
			stripVolatile(e)
		}
	}
}

// acceptedTargets reads a schemathesis HAR report: the requests that
// changed state (any method but GET, HEAD, OPTIONS) and were accepted
// (below 400), and every path segment they named.
func acceptedTargets(t *testing.T, harPath string) (map[string]bool, []string) {
	t.Helper()
	b, err := os.ReadFile(harPath)
	if err != nil {
		t.Fatalf("schemathesis wrote no report: %v", err)
	}
	var har struct {
		Log struct {
			Entries []struct {
				Request struct {
					Method string `json:"method"`
					URL    string `json:"url"`
				} `json:"request"`
				Response struct {
					Status int `json:"status"`
				} `json:"response"`
			} `json:"entries"`
		} `json:"log"`
	}
	if err := json.Unmarshal(b, &har); err != nil {
		t.Fatalf("schemathesis report: %v", err)
	}
	if len(har.Log.Entries) == 0 {
		t.Fatal("schemathesis report lists no requests")
	}
	touched := map[string]bool{}
	var accepted []string
	for _, e := range har.Log.Entries {
		switch e.Request.Method {
		case "GET", "HEAD", "OPTIONS":
			continue
		}
		if e.Response.Status >= 400 {
			continue
		}
		u, err := url.Parse(e.Request.URL)
		if err != nil {
			t.Fatalf("report URL %q: %v", e.Request.URL, err)
		}
		accepted = append(accepted, fmt.Sprintf("%d %s %s", e.Response.Status, e.Request.Method, u.Path))
		for _, seg := range strings.Split(u.Path, "/") {
			if seg != "" {
				touched[seg] = true
			}
		}
	}
	return touched, accepted
}

// withoutTouched drops from a listing the records an accepted request
// named: by their own id or by the sandbox they came from.
func withoutTouched(v any, touched map[string]bool) any {
	list, ok := v.([]any)
	if !ok || len(touched) == 0 {
		return v
	}
	out := []any{}
	for _, e := range list {
		m, _ := e.(map[string]any)
		named := false
		for _, k := range []string{"sandboxID", "snapshotID", "volumeID"} {
			if id, _ := m[k].(string); id != "" && touched[id] {
				named = true
			}
		}
		if !named {
			out = append(out, e)
		}
	}
	return out
}

func withoutTouchedAll(st map[string]any, touched map[string]bool) map[string]any {
	out := map[string]any{}
	for k, v := range st {
		out[k] = withoutTouched(v, touched)
	}
	return out
}
