package api

import (
	"net/http"
	"net/http/httptest"
	"regexp"
	"strings"
	"testing"
)

// TestDocumentDecidesAuthentication: every operation is served behind the
// security its document entry requires. Without credentials, an
// operation that requires the API key answers 401, a volume content
// route 401 (or 404 on a node without volumes), the peer chunk route 404
// here (no peer exchange), and an open one anything but 401. A handler
// registered without the check the document asks for fails this test.
func TestDocumentDecidesAuthentication(t *testing.T) {
	a := newTestAPI(t)
	ops, err := Operations()
	if err != nil {
		t.Fatal(err)
	}
	if len(ops) < 40 {
		t.Fatalf("only %d operations read from the document", len(ops))
	}
	fill := regexp.MustCompile(`\{[^}]+\}`)
	for op, o := range ops {
		schemes := o.Security
		method, path, _ := strings.Cut(op, " ")
		path = fill.ReplaceAllString(path, "x1")
		req := httptest.NewRequest(method, path+"?path=/", strings.NewReader("{}"))
		rec := httptest.NewRecorder()
		a.srv.ServeHTTP(rec, req)
		var want []int
		switch strings.Join(schemes, ",") {
		case "":
			if rec.Code == http.StatusUnauthorized {
				t.Errorf("%s is open in the document, answered 401: %s", op, rec.Body)
			}
			continue
		case "ApiKeyAuth,BearerAuth":
			want = []int{http.StatusUnauthorized}
		case "VolumeToken":
			want = []int{http.StatusUnauthorized, http.StatusNotFound}
		case "PeerToken":
			want = []int{http.StatusNotFound}
		case "NodeToken": // 404 on a node in no cluster
			want = []int{http.StatusUnauthorized, http.StatusNotFound}
		default:
			t.Errorf("%s: schemes %v", op, schemes)
			continue
		}
		if rec.Code != want[0] && (len(want) == 1 || rec.Code != want[1]) {
			t.Errorf("%s without credentials: %d, want %v: %s", op, rec.Code, want, rec.Body)
		}
		if !strings.HasPrefix(rec.Header().Get("Content-Type"), "application/json") && rec.Code >= 400 {
			t.Errorf("%s: %d with content type %q", op, rec.Code, rec.Header().Get("Content-Type"))
		}
	}
	// With the key, the API key routes get past the check.
	if rec := a.do("GET", "/v2/sandboxes", ""); rec.Code != http.StatusOK {
		t.Fatalf("with the key: %d %s", rec.Code, rec.Body)
	}
}

// Parameters the document declares are parsed by the generated code: one
// of the wrong type or a missing required one is a 400 naming it, never
// a 500 or a silently dropped filter.
func TestParameterErrorsNameTheParameter(t *testing.T) {
	a := newTestAPI(t)
	id := a.create(`{"templateID":"base"}`)["sandboxID"].(string)
	for _, tc := range []struct{ path, names string }{
		{"/v2/sandboxes?limit=abc", "limit"},
		{"/v2/sandboxes?limit=0", "limit"},
		{"/v2/sandboxes?startedAfter=yesterday", "startedAfter"},
		{"/v2/sandboxes?order=sideways", "order"},
		{"/v2/sandboxes?startedAfter=", "startedAfter"},
		{"/v2/sandboxes?order=", "order"},
		{"/v2/sandboxes?limit=", "limit"},
		{"/v2/sandboxes?state=gone", "state"},
		{"/v2/sandboxes?a=%zz", "malformed query"},
		{"/sandboxes/metrics", "sandbox_ids"},
		{"/sandboxes/" + id + "/logs?start=soon", "start"},
		{"/sandboxes/" + id + "/metrics?end=x", "end"},
		{"/v2/sandboxes/" + id + "/logs?limit=-4", "limit"},
		{"/v2/sandboxes/" + id + "/logs?direction=sideways", "direction"},
		{"/snapshots?limit=1001", "limit"},
		{"/templates/base?limit=many", "limit"},
		{"/templates/base/builds/b1/status?logsOffset=x", "logsOffset"},
	} {
		rec := a.do("GET", tc.path, "")
		assertError(t, rec, http.StatusBadRequest)
		if !strings.Contains(rec.Body.String(), tc.names) {
			t.Errorf("GET %s: %s does not name %s", tc.path, rec.Body, tc.names)
		}
	}
	// The repeated and the comma-separated state both filter.
	for _, q := range []string{"state=running&state=paused", "state=running,paused", "state=paused"} {
		rec := a.do("GET", "/v2/sandboxes?"+q, "")
		if rec.Code != http.StatusOK {
			t.Fatalf("%s: %d %s", q, rec.Code, rec.Body)
		}
		if got := strings.Contains(rec.Body.String(), id); got != strings.Contains(q, "running") {
			t.Errorf("%s: listed %v: %s", q, got, rec.Body)
		}
	}
}

// GET /templates/aliases/{alias} and GET /templates/{templateID}/tags
// overlap: the alias route reaches its handler (the fake node has no
// templates: its 404 names the template), a path that is neither route
// is a 404 that says so. The tags route is TestRouteTableOverlaps' and
// the SDK suites' (the fake has no tag catalog).
func TestOverlappingRoutes(t *testing.T) {
	a := newTestAPI(t)
	rec := a.do("GET", "/templates/aliases/nosuchtemplate", "")
	assertError(t, rec, http.StatusNotFound)
	if !strings.Contains(rec.Body.String(), `template \"nosuchtemplate\"`) {
		t.Fatalf("alias: %s", rec.Body)
	}
	rec = a.do("GET", "/templates/base/other", "")
	assertError(t, rec, http.StatusNotFound)
	if !strings.Contains(rec.Body.String(), "no route") {
		t.Fatalf("%s", rec.Body)
	}
}

// routeTable serves patterns Go's ServeMux refuses side by side, in the
// order they were registered, whatever their wildcard names.
func TestRouteTableOverlaps(t *testing.T) {
	table := &routeTable{mux: http.NewServeMux(), wrap: func(_ string, h http.Handler) (http.Handler, error) { return h, nil }}
	reply := func(what string, names ...string) func(http.ResponseWriter, *http.Request) {
		return func(w http.ResponseWriter, r *http.Request) {
			out := what
			for _, n := range names {
				out += " " + n + "=" + r.PathValue(n)
			}
			_, _ = w.Write([]byte(out))
		}
	}
	table.HandleFunc("GET /a/{x}/tags", reply("tags", "x"))
	table.HandleFunc("GET /a/aliases/{y}", reply("alias", "y"))
	table.HandleFunc("GET /a/{z}/more/{w}", reply("more", "z", "w"))
	table.HandleFunc("GET /a/lit/more/{v}", reply("lit", "v"))
	if table.err != nil {
		t.Fatal(table.err)
	}
	for path, want := range map[string]string{
		"/a/b/tags":       "tags x=b",
		"/a/aliases/b":    "alias y=b",
		"/a/aliases/tags": "tags x=aliases",
		"/a/b/more/c":     "more z=b w=c",
		"/a/lit/more/c":   "lit v=c",
	} {
		rec := httptest.NewRecorder()
		table.ServeHTTP(rec, httptest.NewRequest("GET", path, nil))
		if rec.Body.String() != want {
			t.Errorf("%s: %q, want %q", path, rec.Body, want)
		}
	}
	rec := httptest.NewRecorder()
	table.ServeHTTP(rec, httptest.NewRequest("GET", "/a/b/c", nil))
	if rec.Code != http.StatusNotFound {
		t.Errorf("/a/b/c: %d %s", rec.Code, rec.Body)
	}
}
