package e2e

import (
	"context"
	"encoding/json"
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
	run("negative", "not_a_server_error,error_body_shape,negative_data_rejection",
		"--mode", "negative", "--phases", "examples,coverage,fuzzing", "--exclude-path-regex", "^/events/webhooks")
	if after := state(); !reflect.DeepEqual(before, after) {
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
