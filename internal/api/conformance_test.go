package api

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/agentenv/agentenv/internal/orchestrator"
)

// TestResponsesMatchTheDocument sends requests to the API (a fake node
// with sandboxes, snapshots and logs; real volumes where the host runs
// them) and checks every JSON answer against the response schema the
// OpenAPI document gives for that operation and status: its status is
// documented, required fields are there, types and enums hold, and no
// field is sent that the document does not describe (unless the schema
// allows any). It fails when a handler and the document disagree.
func TestResponsesMatchTheDocument(t *testing.T) {
	var doc map[string]any
	if err := yaml.Unmarshal(OpenAPISpec, &doc); err != nil {
		t.Fatal(err)
	}
	a := newVolumeAPIOrPlain(t)
	a.node.snaps = append(a.node.snaps, &orchestrator.NamedSnapshot{Name: "snap-1", SandboxID: "s1", TemplateID: "base", VCPUs: 2, MemoryMiB: 512, CreatedAt: time.Now()})
	sb := a.create(`{"templateID":"base","metadata":{"k":"v"},"network":{"allowOut":["1.2.3.4"],"denyOut":["0.0.0.0/0"]},"autoPause":true}`)
	id := sb["sandboxID"].(string)
	a.node.logs[id] = []byte("line one\nline two\n")
	v1 := a.create(`{"templateID":"base"}`)["sandboxID"].(string)
	reqs := []struct{ method, path, body string }{
		{"POST", "/sandboxes", `{"templateID":"base"}`},
		{"POST", "/sandboxes", `{"templateID":"missing"}`},
		{"POST", "/v2/sandboxes", `{"templateID":"base","timeout":60}`},
		{"POST", "/v2/sandboxes", `{"templateID":3}`},
		{"GET", "/sandboxes", ""},
		{"GET", "/v2/sandboxes?state=running,paused&limit=1", ""},
		{"GET", "/v2/sandboxes?limit=-1", ""},
		{"GET", "/sandboxes/" + id, ""},
		{"GET", "/sandboxes/nosuchsandbox", ""},
		{"POST", "/sandboxes/" + id + "/timeout", `{"timeout":120}`},
		{"POST", "/sandboxes/" + id + "/refreshes", `{"duration":60}`},
		{"GET", "/sandboxes/" + id + "/logs", ""},
		{"GET", "/v2/sandboxes/" + id + "/logs?limit=1", ""},
		{"POST", "/sandboxes/" + v1 + "/pause", ""},
		{"POST", "/sandboxes/" + v1 + "/pause", ""},
		{"POST", "/v2/sandboxes/" + v1 + "/connect", `{"timeout":60}`},
		{"POST", "/sandboxes/" + id + "/fork", `{"count":2}`},
		{"POST", "/sandboxes/" + id + "/snapshots", `{"name":"nope"}`},
		{"GET", "/snapshots", ""},
		{"GET", "/snapshots?sandboxID=s1&limit=1", ""},
		{"PUT", "/sandboxes/" + id + "/network", `{"allowOut":["5.6.7.8"]}`},
		{"GET", "/sandboxes/" + id, ""},
		{"GET", "/sandboxes/metrics?sandbox_ids=" + id, ""},
		{"GET", "/templates", ""},
		{"GET", "/nosuchroute", ""},
		{"POST", "/v2/sandboxes", `{"templateID":"base","lease":{"id":"conf","ttl":60}}`},
		{"GET", "/v2/sandboxes", ""},
		{"GET", "/leases", ""},
		{"GET", "/leases/conf", ""},
		{"GET", "/leases/nosuch", ""},
		{"POST", "/leases/conf/keepalive", `{"ttl":30}`},
		{"POST", "/leases/conf/keepalive", `{"ttl":3}`},
		{"DELETE", "/leases/conf", ""},
		{"DELETE", "/sandboxes/" + v1, ""},
	}
	if a.srv.cfg.Volumes != nil {
		reqs = append(reqs,
			struct{ method, path, body string }{"POST", "/volumes", `{"name":"conf"}`},
			struct{ method, path, body string }{"POST", "/volumes", `{"name":"conf"}`},
			struct{ method, path, body string }{"GET", "/volumes", ""},
			struct{ method, path, body string }{"GET", "/volumes/nosuchvolume", ""})
	}
	for _, r := range reqs {
		rec := a.do(r.method, r.path, r.body)
		checkAnswer(t, doc, r.method, r.path, rec)
	}
	if a.srv.cfg.Volumes != nil {
		l, _ := a.srv.cfg.Volumes.List(t.Context())
		v, _ := a.srv.cfg.Volumes.Get(t.Context(), l[0].ID)
		base := "/volumecontent/" + v.ID
		for _, r := range []struct{ method, path, body string }{
			{"PUT", base + "/file?path=/a/f", "x"},
			{"GET", base + "/path?path=/a/f", ""},
			{"GET", base + "/dir?path=/&depth=2", ""},
			{"POST", base + "/dir?path=/d", ""},
			{"PATCH", base + "/path?path=/d", `{"mode":448}`},
			{"GET", base + "/path?path=/nothing", ""},
			{"DELETE", base + "/path?path=/d", ""},
		} {
			checkAnswer(t, doc, r.method, r.path, a.content(r.method, r.path, v.Token, r.body))
		}
		checkAnswer(t, doc, "GET", base+"/path?path=/", a.content("GET", base+"/path?path=/", "wrong", ""))
	}
}

// newVolumeAPIOrPlain is the test API with volumes where the host runs
// them (newVolumeAPI's rules), without where it does not and CI is off.
func newVolumeAPIOrPlain(t *testing.T) *testAPI {
	if volumesRunHere() {
		return newVolumeAPI(t)
	}
	return newTestAPI(t)
}

// checkAnswer checks one answer against the document.
func checkAnswer(t *testing.T, doc map[string]any, method, path string, rec *httptest.ResponseRecorder) {
	t.Helper()
	what := fmt.Sprintf("%s %s → %d", method, path, rec.Code)
	op := findOperation(doc, method, strings.SplitN(path, "?", 2)[0])
	if op == nil {
		// Only unknown routes answer without an operation: an Error body.
		if rec.Code != http.StatusNotFound {
			t.Errorf("%s: no documented operation", what)
		}
		op = map[string]any{"responses": map[string]any{"404": map[string]any{"$ref": "#/components/responses/404"}}}
	}
	responses, _ := op["responses"].(map[string]any)
	resp, ok := responses[strconv.Itoa(rec.Code)].(map[string]any)
	if !ok {
		t.Errorf("%s: status not documented", what)
		return
	}
	resp = resolveRef(doc, resp)
	content, _ := resp["content"].(map[string]any)
	if len(content) == 0 {
		if rec.Body.Len() > 0 {
			t.Errorf("%s: a body the document does not describe: %s", what, rec.Body)
		}
		return
	}
	ct := rec.Header().Get("Content-Type")
	media, ok := content[strings.TrimSpace(strings.SplitN(ct, ";", 2)[0])].(map[string]any)
	if !ok {
		t.Errorf("%s: content type %q not documented", what, ct)
		return
	}
	if ct != "application/json" {
		return
	}
	var body any
	if err := json.Unmarshal(rec.Body.Bytes(), &body); err != nil {
		t.Errorf("%s: not JSON: %v", what, err)
		return
	}
	schema, _ := media["schema"].(map[string]any)
	for _, e := range validate(doc, schema, body, "body") {
		t.Errorf("%s: %s\n%s", what, e, rec.Body)
	}
}

// findOperation is the operation of the document that path (with its
// parameters filled in) and method name.
func findOperation(doc map[string]any, method, path string) map[string]any {
	paths, _ := doc["paths"].(map[string]any)
	// Literal segments win over parameters (/sandboxes/metrics over
	// /sandboxes/{sandboxID}): try the patterns with most literals first.
	patterns := make([]string, 0, len(paths))
	for p := range paths {
		patterns = append(patterns, p)
	}
	literals := func(p string) int { return strings.Count(p, "/") - strings.Count(p, "{") }
	sort.Slice(patterns, func(i, j int) bool { return literals(patterns[i]) > literals(patterns[j]) })
	for _, p := range patterns {
		segs := strings.Split(p, "/")
		for i, seg := range segs {
			if strings.HasPrefix(seg, "{") {
				segs[i] = "[^/]+"
			} else {
				segs[i] = regexp.QuoteMeta(seg)
			}
		}
		if !regexp.MustCompile("^" + strings.Join(segs, "/") + "$").MatchString(path) {
			continue
		}
		ops, _ := paths[p].(map[string]any)
		if op, ok := ops[strings.ToLower(method)].(map[string]any); ok {
			return op
		}
	}
	return nil
}

func resolveRef(doc map[string]any, v map[string]any) map[string]any {
	for v != nil {
		ref, ok := v["$ref"].(string)
		if !ok {
			return v
		}
		var cur any = doc
		for _, part := range strings.Split(strings.TrimPrefix(ref, "#/"), "/") {
			m, _ := cur.(map[string]any)
			cur = m[part]
		}
		v, _ = cur.(map[string]any)
	}
	return v
}

// validate checks v against schema (the subset of OpenAPI 3.0 the
// document uses) and lists what does not hold.
func validate(doc map[string]any, schema map[string]any, v any, at string) []string {
	schema = resolveRef(doc, schema)
	if schema == nil {
		return nil
	}
	if parts, ok := schema["allOf"].([]any); ok {
		merged := map[string]any{"type": "object", "properties": map[string]any{}}
		var required []any
		for _, p := range parts {
			ps := resolveRef(doc, p.(map[string]any))
			for k, pv := range ps["properties"].(map[string]any) {
				merged["properties"].(map[string]any)[k] = pv
			}
			if r, ok := ps["required"].([]any); ok {
				required = append(required, r...)
			}
		}
		merged["required"] = required
		schema = merged
	}
	if v == nil {
		if n, _ := schema["nullable"].(bool); n {
			return nil
		}
		return []string{at + " is null"}
	}
	var errs []string
	if enum, ok := schema["enum"].([]any); ok {
		found := false
		for _, e := range enum {
			if fmt.Sprint(e) == fmt.Sprint(v) {
				found = true
			}
		}
		if !found {
			errs = append(errs, fmt.Sprintf("%s = %v, not one of %v", at, v, enum))
		}
	}
	switch typ, _ := schema["type"].(string); typ {
	case "object", "":
		m, ok := v.(map[string]any)
		if !ok {
			if typ == "object" {
				errs = append(errs, at+" is not an object")
			}
			return errs
		}
		props, _ := schema["properties"].(map[string]any)
		if req, ok := schema["required"].([]any); ok {
			for _, r := range req {
				if _, ok := m[r.(string)]; !ok {
					errs = append(errs, fmt.Sprintf("%s lacks required field %q", at, r))
				}
			}
		}
		extra, _ := schema["additionalProperties"].(map[string]any)
		for k, fv := range m {
			if ps, ok := props[k].(map[string]any); ok {
				errs = append(errs, validate(doc, ps, fv, at+"."+k)...)
			} else if extra != nil {
				errs = append(errs, validate(doc, extra, fv, at+"."+k)...)
			} else if props != nil || typ == "object" {
				errs = append(errs, fmt.Sprintf("%s has field %q, which the document does not describe", at, k))
			}
		}
	case "array":
		l, ok := v.([]any)
		if !ok {
			return append(errs, at+" is not an array")
		}
		items, _ := schema["items"].(map[string]any)
		for i, e := range l {
			errs = append(errs, validate(doc, items, e, fmt.Sprintf("%s[%d]", at, i))...)
		}
	case "string":
		s, ok := v.(string)
		if !ok {
			return append(errs, at+" is not a string")
		}
		if f, _ := schema["format"].(string); f == "date-time" {
			if _, err := time.Parse(time.RFC3339Nano, s); err != nil {
				errs = append(errs, fmt.Sprintf("%s = %q is not a date-time", at, s))
			}
		}
	case "integer":
		f, ok := v.(float64)
		if !ok || f != float64(int64(f)) {
			errs = append(errs, at+" is not an integer")
		}
	case "number":
		if _, ok := v.(float64); !ok {
			errs = append(errs, at+" is not a number")
		}
	case "boolean":
		if _, ok := v.(bool); !ok {
			errs = append(errs, at+" is not a boolean")
		}
	}
	return errs
}
