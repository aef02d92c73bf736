package api

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/agentenv/agentenv/internal/sandboxes"
)

// Seed corpora live in testdata/fuzz/<FuzzName>; run e.g.
//   go test ./internal/api -run '^$' -fuzz FuzzCreateRequest -fuzztime 1m

func FuzzCreateRequest(f *testing.F) {
	for _, s := range []string{
		`{"templateID":"base"}`,
		`{"templateID":"base","timeout":300,"secure":true,"metadata":{"a":"b"},"envVars":{"K":"v"}}`,
		`{"templateID":"base","network":{"denyOut":["0.0.0.0/0"],"allowPublicTraffic":true},"autoResume":{"enabled":false}}`,
		`{"templateID":"base","timeout":-1}`,
		`{"templateID":1e400}`,
		`null`, `[]`, `{"templateID":"base"}{}`, ``,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		r := httptest.NewRequest("POST", "/v2/sandboxes", strings.NewReader(string(body)))
		var req createSandboxRequest
		if err := decodeBody(r, &req); err != nil {
			return
		}
		cr, err := req.toCreateRequest(true)
		if err != nil {
			return
		}
		if cr.TemplateID == "" || cr.Timeout < 0 || cr.Timeout > maxTimeoutSeconds*time.Second ||
			cr.VCPUs < 0 || cr.MemoryMiB < 0 {
			t.Fatalf("accepted invalid request %+v from %q", cr, body)
		}
		if checkMap("metadata", cr.Metadata, maxMetadataEntries, maxMetadataBytes) != nil ||
			checkMap("envVars", cr.EnvVars, maxEnvEntries, maxEnvBytes) != nil {
			t.Fatalf("accepted oversized maps from %q", body)
		}
		for k := range cr.EnvVars {
			if !envNamePattern.MatchString(k) {
				t.Fatalf("accepted env name %q", k)
			}
		}
	})
}

func FuzzSecondsBody(f *testing.F) {
	for _, s := range []string{`{"timeout":60}`, `{"timeout":"60"}`, `{"timeout":-1}`, `{"timeout":1.5}`,
		`{"timeout":1e3}`, `{"timeout":null}`, `{}`, ``, `{"timeout":99999999999999999999}`, `[1]`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		r := httptest.NewRequest("POST", "/x", strings.NewReader(string(body)))
		v, present, err := decodeSeconds(r, "timeout", maxTimeoutSeconds)
		if err != nil {
			return
		}
		if present && (v < 0 || v > maxTimeoutSeconds) {
			t.Fatalf("accepted %d from %q", v, body)
		}
		if !present && v != 0 {
			t.Fatalf("absent but %d", v)
		}
	})
}

// FuzzListQuery drives GET /v2/sandboxes with arbitrary query strings: the
// answer is 200 with a JSON array or a 400 JSON error, and any X-Next-Token
// handed out is accepted back.
func FuzzListQuery(f *testing.F) {
	for _, s := range []string{
		"", "state=running,paused", "limit=1", "limit=0", "metadata=" + url.QueryEscape("a=b&c=d"),
		"nextToken=%%", "state=zombie", "limit=2&nextToken=MDAwMDAwMDAwMDAwMDAwMDAwMDB8YQ",
		"startedAfter=2020-01-01T00:00:00Z&template=base&order=desc",
	} {
		f.Add(s)
	}
	node := newFakeNode()
	base := time.Unix(1_700_000_000, 0)
	for i, id := range []string{"a", "b", "c", "d"} {
		node.add(&sandboxes.Sandbox{ID: id, TemplateID: "base", StartedAt: base.Add(time.Duration(i%2) * time.Second),
			Metadata: map[string]string{"a": "b", "i": id}})
	}
	srv, err := New(node, Config{APIKey: testKey})
	if err != nil {
		f.Fatal(err)
	}
	get := func(t *testing.T, q string) *httptest.ResponseRecorder {
		req := httptest.NewRequest("GET", "/v2/sandboxes", nil)
		req.URL.RawQuery = q
		req.Header.Set("X-API-Key", testKey)
		rec := httptest.NewRecorder()
		srv.ServeHTTP(rec, req)
		return rec
	}
	f.Fuzz(func(t *testing.T, q string) {
		rec := get(t, q)
		switch rec.Code {
		case http.StatusOK:
			var out []map[string]any
			if err := json.Unmarshal(rec.Body.Bytes(), &out); err != nil {
				t.Fatalf("200 with body %q", rec.Body)
			}
			if next := rec.Header().Get("X-Next-Token"); next != "" {
				if rec2 := get(t, "nextToken="+url.QueryEscape(next)); rec2.Code != 200 {
					t.Fatalf("own token %q refused: %s", next, rec2.Body)
				}
			}
		case http.StatusBadRequest:
			var e Error
			if err := json.Unmarshal(rec.Body.Bytes(), &e); err != nil || e.Code != 400 || e.Message == "" {
				t.Fatalf("400 with body %q", rec.Body)
			}
		default:
			t.Fatalf("status %d for %q", rec.Code, q)
		}
		if node.mutationCount() != 0 {
			t.Fatal("a list changed the node")
		}
	})
}

// fuzzRoutes are the POST endpoints whose bodies FuzzPostBodies drives.
var fuzzRoutes = []string{
	"/v2/sandboxes", "/sandboxes", "/sandboxes/sbx1/timeout", "/sandboxes/sbx1/refreshes",
	"/v2/sandboxes/sbx1/connect", "/sandboxes/sbx1/connect", "/sandboxes/sbx1/pause",
	"/sandboxes/sbx1/resume", "/sandboxes/sbx1/fork", "/sandboxes/sbx1/snapshots",
}

// FuzzPostBodies sends arbitrary bodies to every POST endpoint of a fresh
// API over the fake node: nothing answers 5xx, every error is a
// {code,message} JSON matching the status, and a refused request changes
// nothing.
func FuzzPostBodies(f *testing.F) {
	for i, s := range []string{`{"templateID":"base"}`, `{"timeout":30}`, `{"duration":10}`, `{"timeout":5}`,
		`{}`, `{"memory":true}`, `{"timeout":1}`, `{"count":2,"timeout":60}`, `{"name":"x"}`, `null`} {
		f.Add(uint8(i), []byte(s))
	}
	f.Fuzz(func(t *testing.T, route uint8, body []byte) {
		node := newFakeNode()
		node.add(&sandboxes.Sandbox{ID: "sbx1", TemplateID: "base", StartedAt: time.Unix(1, 0), EndAt: time.Now().Add(time.Hour)})
		srv, err := New(node, Config{APIKey: testKey})
		if err != nil {
			t.Fatal(err)
		}
		req := httptest.NewRequest("POST", fuzzRoutes[int(route)%len(fuzzRoutes)], strings.NewReader(string(body)))
		req.Header.Set("X-API-Key", testKey)
		rec := httptest.NewRecorder()
		srv.ServeHTTP(rec, req)
		if rec.Code >= 500 && rec.Code != http.StatusNotImplemented {
			t.Fatalf("%s %q: %d %s", req.URL.Path, body, rec.Code, rec.Body)
		}
		if rec.Code >= 400 {
			var e Error
			if err := json.Unmarshal(rec.Body.Bytes(), &e); err != nil || e.Code != rec.Code || e.Message == "" {
				t.Fatalf("error body %q", rec.Body)
			}
			if node.mutationCount() != 0 {
				t.Fatalf("%s %q refused with %d but changed the node", req.URL.Path, body, rec.Code)
			}
		}
	})
}
