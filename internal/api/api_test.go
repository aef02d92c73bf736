package api

import (
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/agentenv/agentenv/internal/builds"
	"github.com/agentenv/agentenv/internal/diskspace"
	"github.com/agentenv/agentenv/internal/orchestrator"
	"github.com/agentenv/agentenv/internal/proxy"
	"github.com/agentenv/agentenv/internal/sandboxes"
)

const testKey = "e2b_0123456789abcdef"

type testAPI struct {
	t    *testing.T
	node *fakeNode
	srv  *Server
	// volumesDir holds the volumes of a test API made by newVolumeAPI.
	volumesDir string
}

func newTestAPI(t *testing.T) *testAPI {
	t.Helper()
	node := newFakeNode()
	srv, err := New(node, Config{APIKey: testKey, Domain: "sandbox.test", SandboxProxy: http.NotFoundHandler()})
	if err != nil {
		t.Fatal(err)
	}
	return &testAPI{t: t, node: node, srv: srv}
}

// do sends a request with the API key; body is sent verbatim.
func (a *testAPI) do(method, path, body string) *httptest.ResponseRecorder {
	a.t.Helper()
	req := httptest.NewRequest(method, path, strings.NewReader(body))
	req.Header.Set("X-API-Key", testKey)
	req.Header.Set("Content-Type", "application/json")
	rec := httptest.NewRecorder()
	a.srv.ServeHTTP(rec, req)
	return rec
}

func (a *testAPI) create(body string) map[string]any {
	a.t.Helper()
	rec := a.do("POST", "/v2/sandboxes", body)
	if rec.Code != http.StatusCreated {
		a.t.Fatalf("create %s: %d %s", body, rec.Code, rec.Body)
	}
	var out map[string]any
	if err := json.Unmarshal(rec.Body.Bytes(), &out); err != nil {
		a.t.Fatal(err)
	}
	return out
}

// assertError checks a {code,message} JSON error with the given status.
func assertError(t *testing.T, rec *httptest.ResponseRecorder, status int) {
	t.Helper()
	if rec.Code != status {
		t.Fatalf("status %d, want %d: %s", rec.Code, status, rec.Body)
	}
	if ct := rec.Header().Get("Content-Type"); ct != "application/json" {
		t.Fatalf("content type %q", ct)
	}
	var e map[string]any
	if err := json.Unmarshal(rec.Body.Bytes(), &e); err != nil {
		t.Fatalf("error body %q: %v", rec.Body, err)
	}
	if len(e) != 2 || e["code"] != float64(status) || e["message"] == "" {
		t.Fatalf("error body %s is not {code:%d,message}", rec.Body, status)
	}
}

func TestAuth(t *testing.T) {
	a := newTestAPI(t)
	for _, tc := range []struct {
		name   string
		header string
		value  string
		status int
	}{
		{"no key", "", "", 401},
		{"wrong key", "X-API-Key", "e2b_ffff", 401},
		{"key prefix only", "X-API-Key", testKey[:10], 401},
		{"right key", "X-API-Key", testKey, 200},
		{"bearer", "Authorization", "Bearer " + testKey, 200},
		{"wrong bearer", "Authorization", "Bearer e2b_00", 401},
	} {
		t.Run(tc.name, func(t *testing.T) {
			req := httptest.NewRequest("GET", "/v2/sandboxes", nil)
			if tc.header != "" {
				req.Header.Set(tc.header, tc.value)
			}
			rec := httptest.NewRecorder()
			a.srv.ServeHTTP(rec, req)
			if tc.status != 200 {
				assertError(t, rec, tc.status)
			} else if rec.Code != 200 {
				t.Fatalf("%d %s", rec.Code, rec.Body)
			}
		})
	}
}

func TestCreateFieldsAndDefaults(t *testing.T) {
	for _, tc := range []struct {
		name       string
		path       string
		body       string
		wantSecure bool
		check      func(t *testing.T, req orchestrator.CreateRequest)
	}{
		{"v2 is secure by default", "/v2/sandboxes", `{"templateID":"base"}`, true, nil},
		{"v2 secure false", "/v2/sandboxes", `{"templateID":"base","secure":false}`, false, nil},
		{"v1 is not secure by default", "/sandboxes", `{"templateID":"base"}`, false, nil},
		{"v1 secure true", "/sandboxes", `{"templateID":"base","secure":true}`, true, nil},
		{"timeout metadata envVars", "/v2/sandboxes", `{"templateID":"base","timeout":42,"metadata":{"a":"b"},"envVars":{"FOO":"bar"}}`, true,
			func(t *testing.T, req orchestrator.CreateRequest) {
				if req.Timeout != 42*time.Second || req.Metadata["a"] != "b" || req.EnvVars["FOO"] != "bar" {
					t.Fatalf("%+v", req)
				}
			}},
		{"mcp is left to the SDK (issue 40, gap 6)", "/v2/sandboxes", `{"templateID":"base","mcp":{"github":{"githubPersonalAccessToken":"x"}}}`, true, nil},
		{"maskRequestHost (issue 40, gap 7)", "/v2/sandboxes", `{"templateID":"base","network":{"maskRequestHost":"app.internal:${PORT}"}}`, true,
			func(t *testing.T, req orchestrator.CreateRequest) {
				if req.MaskRequestHost != "app.internal:${PORT}" {
					t.Fatalf("%+v", req)
				}
			}},
		{"internet off", "/v2/sandboxes", `{"templateID":"base","allow_internet_access":false}`, true,
			func(t *testing.T, req orchestrator.CreateRequest) {
				if req.AllowInternet == nil || *req.AllowInternet {
					t.Fatalf("%+v", req)
				}
			}},
		{"denyOut all is internet off", "/v2/sandboxes", `{"templateID":"base","network":{"denyOut":["0.0.0.0/0"]}}`, true,
			func(t *testing.T, req orchestrator.CreateRequest) {
				if req.AllowInternet == nil || *req.AllowInternet {
					t.Fatalf("%+v", req)
				}
			}},
		// As E2B applies it (issue 40, gap 5): the SDKs send
		// allow_internet_access true by default.
		{"denyOut all with internet access true", "/v2/sandboxes", `{"templateID":"base","allow_internet_access":true,"network":{"denyOut":["0.0.0.0/0"],"allowOut":["10.1.0.0/16"]}}`, true,
			func(t *testing.T, req orchestrator.CreateRequest) {
				if req.AllowInternet == nil || *req.AllowInternet || req.Egress == nil || fmt.Sprint(req.Egress.Allow) != "[10.1.0.0/16]" {
					t.Fatalf("%+v", req)
				}
			}},
		{"SDK extras that are off are accepted", "/v2/sandboxes",
			`{"templateID":"base","autoPause":false,"autoResume":{"enabled":false},"mcp":null,"network":{"allowPublicTraffic":true},"volumeMounts":[],"unknownField":[1,2]}`, true,
			func(t *testing.T, req orchestrator.CreateRequest) {
				if req.AutoPause {
					t.Fatalf("%+v", req)
				}
			}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a := newTestAPI(t)
			rec := a.do("POST", tc.path, tc.body)
			if rec.Code != 201 {
				t.Fatalf("%d %s", rec.Code, rec.Body)
			}
			var out map[string]any
			_ = json.Unmarshal(rec.Body.Bytes(), &out)
			for _, k := range []string{"templateID", "sandboxID", "clientID", "envdVersion", "domain"} {
				if _, ok := out[k]; !ok {
					t.Fatalf("response lacks %q: %s", k, rec.Body)
				}
			}
			if _, ok := out["trafficAccessToken"]; ok {
				t.Fatalf("trafficAccessToken for a sandbox with public traffic: %s", rec.Body)
			}
			if _, ok := out["envdAccessToken"]; ok != tc.wantSecure {
				t.Fatalf("envdAccessToken present=%v, want %v: %s", ok, tc.wantSecure, rec.Body)
			}
			if out["domain"] != "sandbox.test" || out["envdVersion"] != fakeEnvdVersion {
				t.Fatalf("%s", rec.Body)
			}
			if len(a.node.creates) != 1 || a.node.creates[0].Secure != tc.wantSecure {
				t.Fatalf("creates %+v", a.node.creates)
			}
			if tc.check != nil {
				tc.check(t, a.node.creates[0])
			}
		})
	}
}

// Bad input is refused with a 4xx JSON error and changes nothing.
func TestBadInputChangesNothing(t *testing.T) {
	bigMeta := map[string]string{}
	for i := range 100 {
		bigMeta[fmt.Sprint("k", i)] = "v"
	}
	bigMetaJSON, _ := json.Marshal(map[string]any{"templateID": "base", "metadata": bigMeta})
	longValue, _ := json.Marshal(map[string]any{"templateID": "base", "metadata": map[string]string{"k": strings.Repeat("x", 20000)}})
	for _, tc := range []struct {
		name   string
		method string
		path   string
		body   string
		status int
	}{
		{"malformed JSON", "POST", "/v2/sandboxes", `{"templateID":`, 400},
		{"not an object", "POST", "/v2/sandboxes", `["base"]`, 400},
		{"trailing garbage", "POST", "/v2/sandboxes", `{"templateID":"base"} x`, 400},
		{"missing template", "POST", "/v2/sandboxes", `{}`, 400},
		{"template wrong type", "POST", "/v2/sandboxes", `{"templateID":5}`, 400},
		{"template traversal", "POST", "/v2/sandboxes", `{"templateID":"../../etc"}`, 400},
		{"timeout string", "POST", "/v2/sandboxes", `{"templateID":"base","timeout":"10"}`, 400},
		{"timeout negative", "POST", "/v2/sandboxes", `{"templateID":"base","timeout":-1}`, 400},
		{"timeout fractional", "POST", "/v2/sandboxes", `{"templateID":"base","timeout":1.5}`, 400},
		{"timeout huge", "POST", "/v2/sandboxes", `{"templateID":"base","timeout":100000000}`, 400},
		{"timeout overflow", "POST", "/v2/sandboxes", `{"templateID":"base","timeout":1e30}`, 400},
		{"metadata wrong type", "POST", "/v2/sandboxes", `{"templateID":"base","metadata":{"a":1}}`, 400},
		{"metadata too many", "POST", "/v2/sandboxes", string(bigMetaJSON), 400},
		{"metadata too large", "POST", "/v2/sandboxes", string(longValue), 400},
		{"body over 1 MiB", "POST", "/v2/sandboxes", `{"templateID":"base","envVars":{"A":"` + strings.Repeat("x", 1<<20) + `"}}`, 400},
		{"envVars bad name", "POST", "/v2/sandboxes", `{"templateID":"base","envVars":{"A=B":"x"}}`, 400},
		{"secure wrong type", "POST", "/v2/sandboxes", `{"templateID":"base","secure":"yes"}`, 400},
		{"network wrong type", "POST", "/v2/sandboxes", `{"templateID":"base","network":"open"}`, 400},
		{"autoResume wrong type", "POST", "/v2/sandboxes", `{"templateID":"base","autoResume":true}`, 400},
		{"denyOut domain", "POST", "/v2/sandboxes", `{"templateID":"base","network":{"denyOut":["*.example.com"]}}`, 400},
		{"maskRequestHost with a path", "POST", "/v2/sandboxes", `{"templateID":"base","network":{"maskRequestHost":"a.example/x"}}`, 400},
		{"maskRequestHost bad port", "POST", "/v2/sandboxes", `{"templateID":"base","network":{"maskRequestHost":"a.example:99999"}}`, 400},
		{"maskRequestHost empty", "POST", "/v2/sandboxes", `{"templateID":"base","network":{"maskRequestHost":""}}`, 400},
		{"maskRequestHost not a name", "POST", "/v2/sandboxes", `{"templateID":"base","network":{"maskRequestHost":"a..b"}}`, 400},
		{"allowOut malformed domain", "POST", "/v2/sandboxes", `{"templateID":"base","network":{"allowOut":["*.exa_mple.com"]}}`, 400},
		{"allowOut bare wildcard", "POST", "/v2/sandboxes", `{"templateID":"base","network":{"allowOut":["*"]}}`, 400},
		{"dnsServers not an address", "POST", "/v2/sandboxes", `{"templateID":"base","network":{"allowOut":["a.example.com"],"dnsServers":["dns.example.com"]}}`, 400},
		{"dnsServers too many", "POST", "/v2/sandboxes", `{"templateID":"base","network":{"dnsServers":[` + strings.Repeat(`"1.1.1.1",`, 10) + `"1.1.1.1"]}}`, 400},
		{"network update domain in denyOut", "PUT", "/sandboxes/sbx1/network", `{"denyOut":["example.com"]}`, 400},
		{"denyOut malformed CIDR", "POST", "/v2/sandboxes", `{"templateID":"base","network":{"denyOut":["10.0.0.0/33"]}}`, 400},
		{"network rules", "POST", "/v2/sandboxes", `{"templateID":"base","network":{"rules":{"api.example.com":[{}]}}}`, 400},
		{"network update malformed", "PUT", "/sandboxes/sbx1/network", `{"allowOut":"1.1.1.1"}`, 400},
		{"network update bad CIDR", "PUT", "/sandboxes/sbx1/network", `{"denyOut":["1.2.3.0/99"]}`, 400},
		{"network update IPv6", "PUT", "/sandboxes/sbx1/network", `{"allowOut":["fd00::/8"]}`, 400},
		{"network update too many", "PUT", "/sandboxes/sbx1/network", `{"allowOut":[` + strings.Repeat(`"1.2.3.4",`, 64) + `"1.2.3.4"]}`, 400},
		{"network update unknown", "PUT", "/sandboxes/nope/network", `{"allowOut":["1.2.3.4"]}`, 404},
		{"volume mounts unknown volume", "POST", "/v2/sandboxes", `{"templateID":"base","volumeMounts":[{"name":"v","path":"/v"}]}`, 400},
		{"volume mounts bad name", "POST", "/v2/sandboxes", `{"templateID":"base","volumeMounts":[{"name":"../v","path":"/v"}]}`, 400},
		{"volume mounts no path", "POST", "/v2/sandboxes", `{"templateID":"base","volumeMounts":[{"name":"v"}]}`, 400},
		{"volume mounts not a list", "POST", "/v2/sandboxes", `{"templateID":"base","volumeMounts":{"name":"v"}}`, 400},
		{"cpu zero", "POST", "/v2/sandboxes", `{"templateID":"base","cpuCount":0}`, 400},
		{"unknown template", "POST", "/v2/sandboxes", `{"templateID":"missing"}`, 404},
		{"no capacity", "POST", "/v2/sandboxes", `{"templateID":"full"}`, 429},
		{"get invalid id", "GET", "/sandboxes/BAD_ID", ``, 400},
		{"get unknown id", "GET", "/sandboxes/abc123", ``, 404},
		{"delete invalid id", "DELETE", "/sandboxes/..%2F..", ``, 400},
		{"delete unknown", "DELETE", "/sandboxes/abc123", ``, 404},
		{"timeout missing", "POST", "/sandboxes/sbx1/timeout", `{}`, 400},
		{"timeout wrong type", "POST", "/sandboxes/sbx1/timeout", `{"timeout":"60"}`, 400},
		{"timeout negative", "POST", "/sandboxes/sbx1/timeout", `{"timeout":-5}`, 400},
		{"timeout too long", "POST", "/sandboxes/sbx1/timeout", `{"timeout":86401}`, 400},
		{"timeout malformed", "POST", "/sandboxes/sbx1/timeout", `{"timeout":`, 400},
		{"timeout unknown sandbox", "POST", "/sandboxes/nope/timeout", `{"timeout":60}`, 404},
		{"refresh too long", "POST", "/sandboxes/sbx1/refreshes", `{"duration":3601}`, 400},
		{"refresh wrong type", "POST", "/sandboxes/sbx1/refreshes", `{"duration":true}`, 400},
		{"connect malformed", "POST", "/v2/sandboxes/sbx1/connect", `{"timeout":[]}`, 400},
		{"connect unknown", "POST", "/v2/sandboxes/nope/connect", `{"timeout":10}`, 404},
		{"list bad state", "GET", "/v2/sandboxes?state=zombie", ``, 400},
		{"list bad limit", "GET", "/v2/sandboxes?limit=0", ``, 400},
		{"list huge limit", "GET", "/v2/sandboxes?limit=99999999999", ``, 400},
		{"list bad token", "GET", "/v2/sandboxes?nextToken=%%%", ``, 400},
		{"list forged token", "GET", "/v2/sandboxes?nextToken=" + base64.RawURLEncoding.EncodeToString([]byte("x|../")), ``, 400},
		{"list bad metadata", "GET", "/v2/sandboxes?metadata=" + url.QueryEscape("a=%zz"), ``, 400},
		{"metrics bad start", "GET", "/sandboxes/sbx1/metrics?start=abc", ``, 400},
		{"logs bad limit", "GET", "/sandboxes/sbx1/logs?limit=-1", ``, 400},
		{"pause malformed", "POST", "/sandboxes/sbx1/pause", `{"memory":"yes"}`, 400},
		{"connect memory malformed", "POST", "/sandboxes/sbx1/connect", `{"memory":"no"}`, 400},
		{"metrics of no sandboxes", "GET", "/sandboxes/metrics", ``, 400},
		{"metrics of a bad id", "GET", "/sandboxes/metrics?sandbox_ids=sbx1,../x", ``, 400},
		{"metrics of too many", "GET", "/sandboxes/metrics?sandbox_ids=" + strings.TrimSuffix(strings.Repeat("a,", 101), ","), ``, 400},
		{"template visibility", "PATCH", "/templates/base", `{"public":true}`, 404},
		{"build logs bad direction", "GET", "/templates/base/builds/b1/logs?direction=sideways", ``, 400},
		{"build logs bad level", "GET", "/templates/base/builds/b1/logs?level=loud", ``, 400},
		{"template detail bad limit", "GET", "/templates/base?limit=0", ``, 400},
		{"resume memory malformed", "POST", "/sandboxes/sbx1/resume", `{"memory":1}`, 400},
		{"pause unknown", "POST", "/sandboxes/nope/pause", ``, 404},
		{"resume running", "POST", "/sandboxes/sbx1/resume", `{}`, 409},
		{"resume bad timeout", "POST", "/sandboxes/sbx1/resume", `{"timeout":-1}`, 400},
		{"fork count zero", "POST", "/sandboxes/sbx1/fork", `{"count":0}`, 400},
		{"fork count huge", "POST", "/sandboxes/sbx1/fork", `{"count":17}`, 400},
		{"fork count string", "POST", "/sandboxes/sbx1/fork", `{"count":"2"}`, 400},
		{"fork negative timeout", "POST", "/sandboxes/sbx1/fork", `{"count":1,"timeout":-1}`, 400},
		{"fork unknown", "POST", "/sandboxes/nope/fork", `{"count":1}`, 404},
		{"snapshot the fake refuses", "POST", "/sandboxes/sbx1/snapshots", `{}`, 409},
		{"pause invalid id", "POST", "/sandboxes/BAD!/pause", ``, 400},
		{"unknown route", "GET", "/nope", ``, 404},
		{"unsigned files without sandbox", "GET", "/files?path=/etc/passwd", ``, 404},
		{"forged signed files", "GET", "/files?path=/etc/passwd&signature=v1_x", ``, 401},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a := newTestAPI(t)
			a.node.add(&sandboxes.Sandbox{ID: "sbx1", TemplateID: "base", StartedAt: time.Now(), EndAt: time.Now().Add(time.Minute), AccessToken: "tok"})
			before, _ := a.node.Get(t.Context(), "sbx1")
			rec := a.do(tc.method, tc.path, tc.body)
			assertError(t, rec, tc.status)
			if n := a.node.mutationCount(); n != 0 {
				t.Fatalf("%d node mutations after a refused request", n)
			}
			after, _ := a.node.Get(t.Context(), "sbx1")
			if !after.EndAt.Equal(before.EndAt) {
				t.Fatal("end time changed")
			}
		})
	}
}

func TestGetDetailFields(t *testing.T) {
	a := newTestAPI(t)
	sb := a.create(`{"templateID":"base","timeout":120,"metadata":{"team":"x"}}`)
	rec := a.do("GET", "/sandboxes/"+sb["sandboxID"].(string), "")
	if rec.Code != 200 {
		t.Fatalf("%d %s", rec.Code, rec.Body)
	}
	var d map[string]any
	_ = json.Unmarshal(rec.Body.Bytes(), &d)
	for _, k := range []string{"templateID", "sandboxID", "clientID", "startedAt", "endAt", "cpuCount", "memoryMB", "diskSizeMB", "envdVersion", "envdAccessToken", "state", "metadata", "domain"} {
		if _, ok := d[k]; !ok {
			t.Errorf("detail lacks %q", k)
		}
	}
	end, err := time.Parse(time.RFC3339Nano, d["endAt"].(string))
	if err != nil || time.Until(end) < 110*time.Second || time.Until(end) > 120*time.Second {
		t.Fatalf("endAt %v (%v)", d["endAt"], err)
	}
	if d["state"] != "running" || d["metadata"].(map[string]any)["team"] != "x" {
		t.Fatalf("%s", rec.Body)
	}
	// A "<id>-<clientID>" form is accepted too.
	if rec := a.do("GET", "/sandboxes/"+sb["sandboxID"].(string)+"-aenv", ""); rec.Code != 200 {
		t.Fatalf("id with client suffix: %d", rec.Code)
	}
	// A malformed suffix is not stripped and acted on (schemathesis, given
	// a real id, snapshotted the sandbox through "<id>-<junk>").
	for _, bad := range []string{"-", "-AENV", "-a-b", "-a%20b", "-%C3%A9", "-"} {
		for _, req := range [][2]string{{"GET", ""}, {"POST", "/snapshots"}, {"POST", "/pause"}, {"DELETE", ""}} {
			if rec := a.do(req[0], "/sandboxes/"+sb["sandboxID"].(string)+bad+req[1], ""); rec.Code != 400 {
				t.Errorf("%s /sandboxes/<id>%s%s: %d %s", req[0], bad, req[1], rec.Code, rec.Body)
			}
		}
	}
	if rec := a.do("GET", "/sandboxes/"+sb["sandboxID"].(string), ""); rec.Code != 200 || !strings.Contains(rec.Body.String(), `"running"`) {
		t.Fatalf("after the refused requests: %d %s", rec.Code, rec.Body)
	}
}

func TestTimeoutsAndRefreshes(t *testing.T) {
	a := newTestAPI(t)
	id := a.create(`{"templateID":"base","timeout":300}`)["sandboxID"].(string)
	endIn := func() time.Duration {
		sb, _ := a.node.Get(t.Context(), id)
		return time.Until(sb.EndAt)
	}
	for _, tc := range []struct {
		name     string
		path     string
		body     string
		min, max time.Duration
	}{
		{"setTimeout shortens", "/timeout", `{"timeout":60}`, 55 * time.Second, 60 * time.Second},
		{"setTimeout lengthens", "/timeout", `{"timeout":900}`, 895 * time.Second, 900 * time.Second},
		{"refresh never shortens", "/refreshes", `{"duration":10}`, 895 * time.Second, 900 * time.Second},
		{"setTimeout again", "/timeout", `{"timeout":30}`, 25 * time.Second, 30 * time.Second},
		{"refresh extends", "/refreshes", `{"duration":120}`, 115 * time.Second, 120 * time.Second},
		{"refresh without body", "/refreshes", ``, 115 * time.Second, 120 * time.Second},
		{"timeout zero is one second", "/timeout", `{"timeout":0}`, 0, time.Second},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rec := a.do("POST", "/sandboxes/"+id+tc.path, tc.body)
			if rec.Code != 204 {
				t.Fatalf("%d %s", rec.Code, rec.Body)
			}
			if d := endIn(); d < tc.min || d > tc.max {
				t.Fatalf("ends in %v, want %v..%v", d, tc.min, tc.max)
			}
		})
	}
}

func TestPauseResumeConnect(t *testing.T) {
	a := newTestAPI(t)
	id := a.create(`{"templateID":"base","timeout":60}`)["sandboxID"].(string)
	state := func() string {
		sb, _ := a.node.Get(t.Context(), id)
		return string(sb.State)
	}
	steps := []struct {
		name   string
		path   string
		body   string
		status int
		state  string
		// mode is the detail's pauseMode ("": absent).
		mode string
	}{
		{"pause", "/sandboxes/" + id + "/pause", `{"memory":true}`, 204, "paused", "full"},
		{"pause again conflicts", "/sandboxes/" + id + "/pause", ``, 409, "paused", "full"},
		{"timeout of a paused sandbox conflicts", "/sandboxes/" + id + "/timeout", `{"timeout":10}`, 409, "paused", "full"},
		{"connect resumes", "/v2/sandboxes/" + id + "/connect", `{"timeout":500}`, 201, "running", ""},
		{"connect running", "/v2/sandboxes/" + id + "/connect", `{}`, 200, "running", ""},
		{"pause without memory", "/sandboxes/" + id + "/pause", `{"memory":false}`, 204, "paused", "filesystem"},
		{"connect boots it", "/v2/sandboxes/" + id + "/connect", `{"timeout":500}`, 201, "running", ""},
		{"pause for resume", "/sandboxes/" + id + "/pause", ``, 204, "paused", "full"},
		{"resume", "/sandboxes/" + id + "/resume", `{"timeout":30}`, 201, "running", ""},
		{"resume running conflicts", "/sandboxes/" + id + "/resume", `{}`, 409, "running", ""},
	}
	for _, st := range steps {
		t.Run(st.name, func(t *testing.T) {
			rec := a.do("POST", st.path, st.body)
			if st.status >= 400 {
				assertError(t, rec, st.status)
			} else if rec.Code != st.status {
				t.Fatalf("%d %s", rec.Code, rec.Body)
			}
			if st.status == 201 || st.status == 200 {
				var out map[string]any
				_ = json.Unmarshal(rec.Body.Bytes(), &out)
				if out["sandboxID"] != id || out["envdAccessToken"] == nil {
					t.Fatalf("%s", rec.Body)
				}
			}
			if got := state(); got != st.state {
				t.Fatalf("state %s, want %s", got, st.state)
			}
			var detail map[string]any
			_ = json.Unmarshal(a.do("GET", "/sandboxes/"+id, "").Body.Bytes(), &detail)
			if mode, _ := detail["pauseMode"].(string); mode != st.mode {
				t.Fatalf("pauseMode %q, want %q", mode, st.mode)
			}
		})
	}
	sb, _ := a.node.Get(t.Context(), id)
	if d := time.Until(sb.EndAt); d > 30*time.Second || d < 25*time.Second {
		t.Fatalf("resume with timeout 30 left %v", d)
	}
}

func TestConnect(t *testing.T) {
	a := newTestAPI(t)
	id := a.create(`{"templateID":"base","timeout":60}`)["sandboxID"].(string)
	a.node.add(&sandboxes.Sandbox{ID: "creating1", State: sandboxes.Creating, StartedAt: time.Now()})
	for _, tc := range []struct {
		name   string
		path   string
		body   string
		status int
	}{
		{"running v2", "/v2/sandboxes/" + id + "/connect", `{"timeout":600}`, 200},
		{"running v1 no body", "/sandboxes/" + id + "/connect", ``, 200},
		{"paused conflicts if not resumable", "/v2/sandboxes/creating1/connect", `{}`, 409},
		{"unknown", "/v2/sandboxes/zzz/connect", `{}`, 404},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rec := a.do("POST", tc.path, tc.body)
			if tc.status != 200 {
				assertError(t, rec, tc.status)
				return
			}
			if rec.Code != 200 {
				t.Fatalf("%d %s", rec.Code, rec.Body)
			}
			var out map[string]any
			_ = json.Unmarshal(rec.Body.Bytes(), &out)
			if out["sandboxID"] != id || out["envdAccessToken"] == nil {
				t.Fatalf("%s", rec.Body)
			}
		})
	}
	sb, _ := a.node.Get(t.Context(), id)
	if d := time.Until(sb.EndAt); d < 590*time.Second {
		t.Fatalf("connect with timeout 600 left %v", d)
	}
}

func TestListV2(t *testing.T) {
	a := newTestAPI(t)
	base := time.Now().Add(-time.Hour)
	for i := range 5 {
		a.node.add(&sandboxes.Sandbox{
			ID: fmt.Sprintf("s%d", i), TemplateID: "base", StartedAt: base.Add(time.Duration(i) * time.Second),
			EndAt: base.Add(2 * time.Hour), Metadata: map[string]string{"team": []string{"a", "b"}[i%2], "n": fmt.Sprint(i)},
		})
	}
	a.node.sandboxes["s1"].Metadata["odd"] = "a b/c&d=e%"
	a.node.add(&sandboxes.Sandbox{ID: "p0", State: sandboxes.Paused, StartedAt: base.Add(-time.Second), Metadata: map[string]string{"team": "a"}})
	// The node's own sandboxes (a template snapshot's boot) are no user's.
	a.node.add(&sandboxes.Sandbox{ID: "i0", TemplateID: "base", StartedAt: base, EndAt: base.Add(2 * time.Hour),
		Metadata: map[string]string{sandboxes.MetaInternal: "template snapshot", "team": "a"}})
	if rec := a.do("GET", "/sandboxes", ""); strings.Contains(rec.Body.String(), `"i0"`) {
		t.Errorf("GET /sandboxes lists the node's own sandbox: %s", rec.Body)
	}
	if rec := a.do("POST", "/sandboxes", `{"templateID":"base","metadata":{"aenv.internal":"x"}}`); rec.Code != 400 {
		t.Errorf("create with the reserved metadata key: %d %s", rec.Code, rec.Body)
	}
	list := func(q string) ([]string, string) {
		rec := a.do("GET", "/v2/sandboxes?"+q, "")
		if rec.Code != 200 {
			t.Fatalf("%s: %d %s", q, rec.Code, rec.Body)
		}
		var out []map[string]any
		_ = json.Unmarshal(rec.Body.Bytes(), &out)
		var ids []string
		for _, s := range out {
			ids = append(ids, s["sandboxID"].(string))
		}
		return ids, rec.Header().Get("X-Next-Token")
	}
	for _, tc := range []struct {
		name string
		q    string
		want string
	}{
		{"all newest first", "", "s4 s3 s2 s1 s0 p0"},
		{"running", "state=running", "s4 s3 s2 s1 s0"},
		{"paused", "state=paused", "p0"},
		{"both comma", "state=running,paused", "s4 s3 s2 s1 s0 p0"},
		{"metadata", "metadata=" + url.QueryEscape("team=a"), "s4 s2 s0 p0"},
		{"metadata two keys", "metadata=" + url.QueryEscape("team=a&n=2"), "s2"},
		{"metadata no match", "metadata=" + url.QueryEscape("team=c"), ""},
		// What the SDK sends for {odd: "a b/c&d=e%"}: encodeURIComponent on
		// key and value, then form encoding, then query encoding.
		{"metadata with special characters", "metadata=" + url.QueryEscape(url.Values{"odd": {url.PathEscape("a b/c&d=e%")}}.Encode()), "s1"},
		// As E2B's (issue 40): oldest first on order=asc; startedAfter is
		// "at or after".
		{"oldest first", "order=asc", "p0 s0 s1 s2 s3 s4"},
		{"newest first asked for", "order=desc", "s4 s3 s2 s1 s0 p0"},
		{"started at or after", "startedAfter=" + url.QueryEscape(base.Add(2*time.Second).Format(time.RFC3339Nano)), "s4 s3 s2"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ids, next := list(tc.q)
			if strings.Join(ids, " ") != tc.want || next != "" {
				t.Fatalf("got %v next %q, want %q", ids, next, tc.want)
			}
		})
	}
	// pages follows the tokens of query's pages of two; each token is
	// also tried in the other order, which refuses it.
	pages := func(t *testing.T, query, otherOrder string) string {
		var all []string
		q := query
		for page := 0; ; page++ {
			ids, next := list(q)
			all = append(all, ids...)
			if next == "" {
				return strings.Join(all, " ")
			}
			if page > 5 {
				t.Fatal("paging does not end")
			}
			if rec := a.do("GET", "/v2/sandboxes?limit=2&"+otherOrder+"&nextToken="+url.QueryEscape(next), ""); rec.Code != 400 {
				t.Fatalf("a token in a query of the other order: %d %s", rec.Code, rec.Body)
			}
			q = query + "&nextToken=" + url.QueryEscape(next)
		}
	}
	t.Run("paging", func(t *testing.T) {
		if got := pages(t, "limit=2&state=running", "order=asc"); got != "s4 s3 s2 s1 s0" {
			t.Fatalf("pages gave %v", got)
		}
	})
	t.Run("paging oldest first", func(t *testing.T) {
		if got := pages(t, "limit=2&order=asc", "order=desc"); got != "p0 s0 s1 s2 s3 s4" {
			t.Fatalf("pages gave %v", got)
		}
	})
	t.Run("v1 list is running only", func(t *testing.T) {
		rec := a.do("GET", "/sandboxes", "")
		var out []map[string]any
		_ = json.Unmarshal(rec.Body.Bytes(), &out)
		if len(out) != 5 {
			t.Fatalf("%d sandboxes", len(out))
		}
	})
}

func TestMetricsFromEnvd(t *testing.T) {
	envd := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/metrics" || r.Header.Get("X-Access-Token") != "tok" {
			http.Error(w, "no", http.StatusUnauthorized)
			return
		}
		_, _ = io.WriteString(w, `{"ts":1700000000,"cpu_count":2,"cpu_used_pct":12.5,"mem_total":1000,"mem_used":400,"mem_cache":7,"disk_used":5,"disk_total":50}`)
	}))
	defer envd.Close()
	a := newTestAPI(t)
	a.node.add(&sandboxes.Sandbox{ID: "m1", AccessToken: "tok", EnvdAddr: strings.TrimPrefix(envd.URL, "http://"), StartedAt: time.Now()})
	a.node.add(&sandboxes.Sandbox{ID: "m2", AccessToken: "wrong", EnvdAddr: strings.TrimPrefix(envd.URL, "http://"), StartedAt: time.Now()})
	rec := a.do("GET", "/sandboxes/m1/metrics", "")
	if rec.Code != 200 {
		t.Fatalf("%d %s", rec.Code, rec.Body)
	}
	var m []map[string]any
	_ = json.Unmarshal(rec.Body.Bytes(), &m)
	if len(m) != 1 || m[0]["cpuCount"] != 2.0 || m[0]["cpuUsedPct"] != 12.5 || m[0]["memTotal"] != 1000.0 ||
		m[0]["diskTotal"] != 50.0 || m[0]["timestamp"] != "2023-11-14T22:13:20Z" || m[0]["timestampUnix"] != 1700000000.0 {
		t.Fatalf("%s", rec.Body)
	}
	assertError(t, a.do("GET", "/sandboxes/m2/metrics", ""), 502)
	assertError(t, a.do("GET", "/sandboxes/zz/metrics", ""), 404)
	if rec := a.do("GET", "/sandboxes/m1/metrics?start=1&end=2", ""); rec.Code != 200 || strings.TrimSpace(rec.Body.String()) != "[]" {
		t.Fatalf("past window: %d %s", rec.Code, rec.Body)
	}
}

func TestLogs(t *testing.T) {
	a := newTestAPI(t)
	started := time.Now().Add(-time.Minute).UTC()
	a.node.add(&sandboxes.Sandbox{ID: "l1", StartedAt: started})
	a.node.logs["l1"] = []byte("[    0.1] kernel line\r\n\ninit: started envd\nbad \xff byte\n")
	for _, tc := range []struct {
		name  string
		q     string
		lines []string
	}{
		{"all", "", []string{"[    0.1] kernel line", "init: started envd", "bad \uFFFD byte"}},
		{"limit", "?limit=1", []string{"[    0.1] kernel line"}},
		{"start after", fmt.Sprintf("?start=%d", started.UnixMilli()+1), nil},
		{"start before", fmt.Sprintf("?start=%d", started.UnixMilli()-1), []string{"[    0.1] kernel line", "init: started envd", "bad \uFFFD byte"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rec := a.do("GET", "/sandboxes/l1/logs"+tc.q, "")
			if rec.Code != 200 {
				t.Fatalf("%d %s", rec.Code, rec.Body)
			}
			var out struct {
				Logs []struct {
					Timestamp time.Time `json:"timestamp"`
					Line      string    `json:"line"`
				} `json:"logs"`
				LogEntries []struct {
					Message string `json:"message"`
					Level   string `json:"level"`
				} `json:"logEntries"`
			}
			if err := json.Unmarshal(rec.Body.Bytes(), &out); err != nil {
				t.Fatal(err)
			}
			var got []string
			for i, l := range out.Logs {
				got = append(got, l.Line)
				if out.LogEntries[i].Message != l.Line || !l.Timestamp.Equal(started) {
					t.Fatalf("entry %d: %+v", i, out)
				}
			}
			if strings.Join(got, "|") != strings.Join(tc.lines, "|") || out.Logs == nil || out.LogEntries == nil {
				t.Fatalf("lines %q, want %q (%s)", got, tc.lines, rec.Body)
			}
		})
	}
	assertError(t, a.do("GET", "/sandboxes/zz/logs", ""), 404)

	// The v2 form: entries only, with direction, cursor, level and search.
	for _, tc := range []struct {
		name, q string
		lines   []string
	}{
		{"all", "", []string{"[    0.1] kernel line", "init: started envd", "bad \uFFFD byte"}},
		{"backward, one", "?direction=backward&limit=1", []string{"bad \uFFFD byte"}},
		{"search", "?search=envd", []string{"init: started envd"}},
		{"cursor after the start", fmt.Sprintf("?cursor=%d", started.UnixMilli()+1), nil},
		{"backward to before the start", fmt.Sprintf("?direction=backward&cursor=%d", started.UnixMilli()-1), nil},
		{"level above info", "?level=warn", nil},
	} {
		t.Run("v2 "+tc.name, func(t *testing.T) {
			rec := a.do("GET", "/v2/sandboxes/l1/logs"+tc.q, "")
			var out struct {
				Logs []struct {
					Timestamp time.Time `json:"timestamp"`
					Message   string    `json:"message"`
					Level     string    `json:"level"`
				} `json:"logs"`
			}
			if rec.Code != 200 || json.Unmarshal(rec.Body.Bytes(), &out) != nil || out.Logs == nil {
				t.Fatalf("%d %s", rec.Code, rec.Body)
			}
			var got []string
			for _, l := range out.Logs {
				if l.Level != "info" || !l.Timestamp.Equal(started) {
					t.Fatalf("entry %+v", l)
				}
				got = append(got, l.Message)
			}
			if strings.Join(got, "|") != strings.Join(tc.lines, "|") {
				t.Fatalf("lines %q, want %q", got, tc.lines)
			}
		})
	}
	for _, q := range []string{"?direction=up", "?level=loud", "?limit=-1", "?cursor=x"} {
		assertError(t, a.do("GET", "/v2/sandboxes/l1/logs"+q, ""), 400)
	}
	assertError(t, a.do("GET", "/v2/sandboxes/zz/logs", ""), 404)
}

func TestKill(t *testing.T) {
	a := newTestAPI(t)
	id := a.create(`{"templateID":"base"}`)["sandboxID"].(string)
	if rec := a.do("DELETE", "/sandboxes/"+id, ""); rec.Code != 204 || rec.Body.Len() != 0 {
		t.Fatalf("%d %s", rec.Code, rec.Body)
	}
	assertError(t, a.do("DELETE", "/sandboxes/"+id, ""), 404)
	assertError(t, a.do("GET", "/sandboxes/"+id, ""), 404)
}

func TestOpenAPIServedAndCoversRoutes(t *testing.T) {
	a := newTestAPI(t)
	req := httptest.NewRequest("GET", "/openapi.yml", nil)
	rec := httptest.NewRecorder()
	a.srv.ServeHTTP(rec, req) // no key needed
	if rec.Code != 200 || !strings.HasPrefix(rec.Body.String(), "openapi: 3.") {
		t.Fatalf("%d %.100s", rec.Code, rec.Body)
	}
	spec := rec.Body.String()
	for _, p := range []string{
		"/sandboxes:", "/v2/sandboxes:", "/sandboxes/{sandboxID}:", "/sandboxes/{sandboxID}/timeout:",
		"/sandboxes/{sandboxID}/refreshes:", "/sandboxes/{sandboxID}/connect:", "/v2/sandboxes/{sandboxID}/connect:",
		"/sandboxes/{sandboxID}/pause:", "/sandboxes/{sandboxID}/resume:", "/sandboxes/{sandboxID}/metrics:",
		"/sandboxes/{sandboxID}/logs:", "/sandboxes/{sandboxID}/fork:", "/sandboxes/{sandboxID}/snapshots:",
		"/snapshots:", "/snapshots/{name}:", "/metrics:", "/openapi.yml:", "/health:",
		"/v3/templates:", "/v2/templates/{templateID}/builds/{buildID}:", "/templates/{templateID}/builds/{buildID}/status:",
		"/templates/{templateID}/files/{hash}:", "/templates:", "/templates/aliases/{alias}:",
	} {
		if !strings.Contains(spec, "\n  "+p+"\n") {
			t.Errorf("openapi.yml does not document %s", strings.TrimSuffix(p, ":"))
		}
	}
}

func TestResolver(t *testing.T) {
	node := newFakeNode()
	node.add(&sandboxes.Sandbox{ID: "run1", EnvdAddr: "10.0.0.2:49983", AccessToken: "tok"})
	node.add(&sandboxes.Sandbox{ID: "pau1", State: sandboxes.Paused, EnvdAddr: "10.0.0.3:49983"})
	res := Resolver{Node: node}
	for _, tc := range []struct {
		id      string
		want    proxy.Route
		unknown bool
	}{
		{id: "run1", want: proxy.Route{Addr: "10.0.0.2", Running: true, AccessToken: "tok"}},
		{id: "pau1", want: proxy.Route{Addr: "10.0.0.3"}},
		{id: "nope", unknown: true},
	} {
		got, err := res.Route(t.Context(), tc.id)
		if tc.unknown != errors.Is(err, proxy.ErrUnknownSandbox) || (!tc.unknown && (err != nil || got != tc.want)) {
			t.Errorf("%s: %+v %v, want %+v", tc.id, got, err, tc.want)
		}
	}
	// Resume for traffic; a second resume (already running) is fine too.
	for range 2 {
		got, err := res.Resume(t.Context(), "pau1")
		if err != nil || !got.Running || got.Addr != "10.0.0.3" {
			t.Fatalf("resume: %+v %v", got, err)
		}
	}
}

func TestFork(t *testing.T) {
	a := newTestAPI(t)
	parent := a.create(`{"templateID":"base","metadata":{"k":"v"}}`)["sandboxID"].(string)
	broken := a.create(`{"templateID":"halfbroken"}`)["sandboxID"].(string)
	for _, tc := range []struct {
		name     string
		id       string
		body     string
		children int
		errors   []int
	}{
		{"default count is one", parent, ``, 1, nil},
		{"three children", parent, `{"count":3,"timeout":60}`, 3, nil},
		{"partial failure", broken, `{"count":3}`, 2, []int{429}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rec := a.do("POST", "/sandboxes/"+tc.id+"/fork", tc.body)
			if rec.Code != 201 {
				t.Fatalf("%d %s", rec.Code, rec.Body)
			}
			var out []struct {
				Sandbox *map[string]any `json:"sandbox"`
				Error   *Error          `json:"error"`
			}
			if err := json.Unmarshal(rec.Body.Bytes(), &out); err != nil {
				t.Fatal(err)
			}
			var children int
			var errs []int
			for _, r := range out {
				switch {
				case r.Sandbox != nil && r.Error == nil:
					children++
					sb := *r.Sandbox
					if sb["sandboxID"] == tc.id || sb["envdAccessToken"] == nil {
						t.Fatalf("child %v", sb)
					}
					if _, err := a.node.Get(t.Context(), sb["sandboxID"].(string)); err != nil {
						t.Fatal(err)
					}
				case r.Error != nil && r.Sandbox == nil:
					errs = append(errs, r.Error.Code)
				default:
					t.Fatalf("entry with both or neither: %s", rec.Body)
				}
			}
			if children != tc.children || fmt.Sprint(errs) != fmt.Sprint(tc.errors) {
				t.Fatalf("children %d errors %v, want %d %v: %s", children, errs, tc.children, tc.errors, rec.Body)
			}
		})
	}
}

func TestPrivateTrafficAndAutoResume(t *testing.T) {
	a := newTestAPI(t)
	out := a.create(`{"templateID":"base","autoResume":{"enabled":true},"network":{"allowPublicTraffic":false}}`)
	if out["trafficAccessToken"] != "traffic" {
		t.Fatalf("private-traffic sandbox lacks its traffic token: %v", out)
	}
	req := a.node.creates[len(a.node.creates)-1]
	if !req.AutoResume || !req.PrivateTraffic {
		t.Fatalf("create request %+v", req)
	}
	sb, _ := a.node.Get(context.Background(), out["sandboxID"].(string))
	if r := routeOf(sb); r.TrafficToken != "traffic" || !r.AutoResume {
		t.Fatalf("route %+v", r)
	}
	pub := a.create(`{"templateID":"base"}`)
	if _, ok := pub["trafficAccessToken"]; ok {
		t.Fatalf("public sandbox got a traffic token: %v", pub)
	}
	sb, _ = a.node.Get(context.Background(), pub["sandboxID"].(string))
	if r := routeOf(sb); r.TrafficToken != "" || r.AutoResume {
		t.Fatalf("route %+v", r)
	}
}

// Egress rules given at create and replaced by PUT /sandboxes/{id}/network
// show in the sandbox's details as E2B shows them.
func TestNetworkRules(t *testing.T) {
	a := newTestAPI(t)
	created := a.create(`{"templateID":"base","network":{"allowOut":["10.1.2.3","10.1.0.0/16"],"denyOut":["0.0.0.0/0"]}}`)
	id := created["sandboxID"].(string)
	network := func() (map[string]any, bool) {
		t.Helper()
		rec := a.do("GET", "/sandboxes/"+id, "")
		var out struct {
			Network  map[string]any `json:"network"`
			Internet bool           `json:"allowInternetAccess"`
		}
		if err := json.Unmarshal(rec.Body.Bytes(), &out); err != nil {
			t.Fatal(err)
		}
		return out.Network, out.Internet
	}
	n, internet := network()
	if internet || fmt.Sprint(n["allowOut"]) != "[10.1.0.0/16]" || fmt.Sprint(n["denyOut"]) != "[0.0.0.0/0]" {
		t.Fatalf("after create: internet %v, network %v", internet, n)
	}
	rec := a.do("PUT", "/sandboxes/"+id+"/network", `{"denyOut":["192.0.2.0/24"]}`)
	if rec.Code != http.StatusNoContent {
		t.Fatalf("update: %d %s", rec.Code, rec.Body)
	}
	n, internet = network()
	if !internet || fmt.Sprint(n["allowOut"]) != "[]" || fmt.Sprint(n["denyOut"]) != "[192.0.2.0/24]" {
		t.Fatalf("after update: internet %v, network %v", internet, n)
	}
	// Domains (allowOut only) and dnsServers, as E2B's SDKs send them.
	rec = a.do("PUT", "/sandboxes/"+id+"/network", `{"allowOut":["*.Example.com","1.2.3.4"],"denyOut":["0.0.0.0/0"],"dnsServers":["192.0.2.53"]}`)
	if rec.Code != http.StatusNoContent {
		t.Fatalf("update with domains: %d %s", rec.Code, rec.Body)
	}
	n, internet = network()
	if internet || fmt.Sprint(n["allowOut"]) != "[1.2.3.4 *.example.com]" || fmt.Sprint(n["dnsServers"]) != "[192.0.2.53]" {
		t.Fatalf("after update with domains: internet %v, network %v", internet, n)
	}
	// A sandbox mid-operation refuses; a paused one takes the rules.
	a.node.add(&sandboxes.Sandbox{ID: "busy1", State: sandboxes.Forking})
	assertError(t, a.do("PUT", "/sandboxes/busy1/network", `{"allowOut":["1.2.3.4"]}`), http.StatusConflict)
	a.node.add(&sandboxes.Sandbox{ID: "paused1", State: sandboxes.Paused})
	if rec := a.do("PUT", "/sandboxes/paused1/network", `{"allow_internet_access":false}`); rec.Code != http.StatusNoContent {
		t.Fatalf("update of a paused sandbox: %d %s", rec.Code, rec.Body)
	}
	if sb, _ := a.node.Get(t.Context(), "paused1"); sb.AllowInternet {
		t.Fatal("the paused sandbox kept its internet access")
	}
}

// TestSnapshotListAndDelete: GET /snapshots filters by sandboxID and name
// and pages with X-Next-Token (the SDKs' list_snapshots); DELETE
// /templates/{id} of a snapshot's id deletes the snapshot (the SDKs'
// delete_snapshot), 404 once it is gone.
func TestSnapshotListAndDelete(t *testing.T) {
	a := newTestAPI(t)
	base := time.Date(2026, 12, 1, 0, 0, 0, 0, time.UTC)
	for i, src := range []string{"sbxa", "sbxb", "sbxa", "sbxa"} {
		a.node.snaps = append(a.node.snaps, &orchestrator.NamedSnapshot{Name: fmt.Sprintf("snap-%d", i), SandboxID: src, CreatedAt: base.Add(time.Duration(i) * time.Second)})
	}
	page := func(q string) ([]string, string) {
		t.Helper()
		rec := a.do("GET", "/snapshots?"+q, "")
		if rec.Code != 200 {
			t.Fatalf("%s: %d %s", q, rec.Code, rec.Body)
		}
		var got []struct {
			SnapshotID string `json:"snapshotID"`
		}
		json.Unmarshal(rec.Body.Bytes(), &got)
		var ids []string
		for _, g := range got {
			ids = append(ids, g.SnapshotID)
		}
		return ids, rec.Header().Get("X-Next-Token")
	}
	var all []string
	q := "sandboxID=sbxa&limit=2"
	for pages := 0; ; pages++ {
		ids, next := page(q)
		all = append(all, ids...)
		if next == "" {
			break
		}
		if pages > 3 {
			t.Fatal("pages do not end")
		}
		q = "sandboxID=sbxa&limit=2&nextToken=" + url.QueryEscape(next)
	}
	if strings.Join(all, ",") != "snap-0,snap-2,snap-3" {
		t.Fatalf("sbxa's snapshots in pages of 2: %v", all)
	}
	if ids, _ := page("name=snap-1"); strings.Join(ids, ",") != "snap-1" {
		t.Fatalf("by name: %v", ids)
	}
	assertError(t, a.do("GET", "/snapshots?nextToken=%%%", ""), http.StatusBadRequest)
	if rec := a.do("DELETE", "/templates/snap-2", ""); rec.Code != http.StatusNoContent {
		t.Fatalf("delete a snapshot through /templates: %d %s", rec.Code, rec.Body)
	}
	if ids, _ := page("sandboxID=sbxa"); strings.Join(ids, ",") != "snap-0,snap-3" {
		t.Fatalf("after delete: %v", ids)
	}
	assertError(t, a.do("DELETE", "/templates/snap-2", ""), http.StatusNotFound)
}

// TestOpenAPIMatchesTheRoutes: every operation of openapi.yml is a route
// the server serves, with that method, and every route the server serves
// is in the document (path parameters compared by position).
func TestOpenAPIMatchesTheRoutes(t *testing.T) {
	a := newTestAPI(t)
	var doc struct {
		Paths map[string]map[string]yaml.Node `yaml:"paths"`
	}
	if err := yaml.Unmarshal(OpenAPISpec, &doc); err != nil {
		t.Fatal(err)
	}
	norm := func(p string) string { return regexp.MustCompile(`\{[^}]+\}`).ReplaceAllString(p, "{}") }
	documented := map[string]bool{}
	elsewhere := map[string]bool{}
	for path, ops := range doc.Paths {
		for method, node := range ops {
			if method == "parameters" {
				continue
			}
			var op struct {
				ServedBy string `yaml:"x-served-by"` // gateway, peers: not by every node; nodes: by each node, not the gateway
			}
			if err := node.Decode(&op); err != nil {
				t.Fatalf("%s %s: %v", method, path, err)
			}
			key := strings.ToUpper(method) + " " + norm(path)
			if op.ServedBy != "" && op.ServedBy != "nodes" {
				elsewhere[key] = true
			} else {
				documented[key] = true
			}
		}
	}
	served := map[string]bool{}
	for _, r := range a.srv.Routes() {
		method, path, ok := strings.Cut(r, " ")
		if !ok {
			continue // the catch-all answering unknown routes
		}
		path = strings.Replace(path, "{rest...}", "{}", 1)
		served[method+" "+norm(path)] = true
	}
	for op := range documented {
		if !served[op] {
			t.Errorf("openapi.yml documents %s, which the server does not serve", op)
		}
	}
	for op := range served {
		if !documented[op] && !elsewhere[op] {
			t.Errorf("the server serves %s, which openapi.yml does not document", op)
		}
	}
}

// The SDKs' secrets routes are refused with the reason, whatever the method.
func TestSecretsRefused(t *testing.T) {
	a := newTestAPI(t)
	for _, c := range [][2]string{{"GET", "/secrets"}, {"POST", "/secrets"}, {"GET", "/secrets/sec_1"}, {"POST", "/secrets/sec_1"}, {"DELETE", "/secrets/sec_1"}} {
		rec := a.do(c[0], c[1], `{"name":"x","value":"y"}`)
		assertError(t, rec, http.StatusNotFound)
		if !strings.Contains(rec.Body.String(), "secrets are not served") {
			t.Errorf("%s %s: %s", c[0], c[1], rec.Body)
		}
	}
}

// A snapshot with memory: false is of the filesystem only (the node's
// SnapshotFilesystem), never taken with memory as if the field were not
// there.
func TestSnapshotWithoutMemory(t *testing.T) {
	a := newTestAPI(t)
	id := a.create(`{"templateID":"base"}`)["sandboxID"].(string)
	rec := a.do("POST", "/sandboxes/"+id+"/snapshots", `{"name":"fs-only","memory":false}`)
	if rec.Code != http.StatusCreated || !strings.Contains(rec.Body.String(), `"snapshotID":"fs-only"`) {
		t.Fatalf("%d %s", rec.Code, rec.Body)
	}
	if l, _ := a.node.Snapshots(); len(l) != 1 || !l[0].FilesystemOnly {
		t.Fatalf("snapshots %+v", l)
	}
}

// TestUploadBelowDiskFloor: a node below its floor of free disk space
// answers an upload with 507, saying so with the request id, and keeps
// nothing of it.
func TestUploadBelowDiskFloor(t *testing.T) {
	a := newTestAPI(t)
	dir := t.TempDir()
	free, err := diskspace.Free(dir)
	if err != nil {
		t.Fatal(err)
	}
	a.node.floor = diskspace.NewFloor(dir, free+1<<40)
	a.node.builds = []*builds.Record{{TemplateID: "floor-test", BuildID: "b1", Status: builds.Waiting}}
	hash := strings.Repeat("ab", 32)
	rec := a.do("GET", "/templates/floor-test/files/"+hash, "")
	var link struct{ URL string }
	if err := json.Unmarshal(rec.Body.Bytes(), &link); err != nil || rec.Code != http.StatusCreated {
		t.Fatalf("upload link: %d %s", rec.Code, rec.Body)
	}
	u, err := url.Parse(link.URL)
	if err != nil {
		t.Fatal(err)
	}
	rec = a.do("PUT", u.RequestURI(), "tar bytes")
	var body struct {
		Code    int
		Message string
	}
	if err := json.Unmarshal(rec.Body.Bytes(), &body); err != nil || rec.Code != http.StatusInsufficientStorage || body.Code != 507 ||
		!strings.Contains(body.Message, "nearly full") || !strings.Contains(body.Message, rec.Header().Get("X-Request-Id")) {
		t.Fatalf("upload below the floor: %d %s", rec.Code, rec.Body)
	}
	if a.node.BuildFiles().Present("floor-test", hash) {
		t.Fatal("the refused upload is kept")
	}
}

// TestUploadsNeedAWaitingBuild: build files are taken for a template with
// a build waiting for its start (or running), as the SDKs request one
// before they upload; for any other template the link and the upload
// answer 404.
func TestUploadsNeedAWaitingBuild(t *testing.T) {
	a := newTestAPI(t)
	hash := strings.Repeat("cd", 32)
	a.node.builds = []*builds.Record{
		{TemplateID: "waiting", BuildID: "b1", Status: builds.Waiting},
		{TemplateID: "done", BuildID: "b2", Status: builds.Ready},
		{TemplateID: "failed", BuildID: "b3", Status: builds.Failed},
	}
	link := func(tpl string) (int, string) {
		rec := a.do("GET", "/templates/"+tpl+"/files/"+hash, "")
		var l struct{ URL string }
		_ = json.Unmarshal(rec.Body.Bytes(), &l)
		return rec.Code, l.URL
	}
	code, u := link("waiting")
	if code != http.StatusCreated || u == "" {
		t.Fatalf("link for a waiting build: %d", code)
	}
	parsed, _ := url.Parse(u)
	if rec := a.do("PUT", parsed.RequestURI(), "tar bytes"); rec.Code != http.StatusOK {
		t.Fatalf("upload for a waiting build: %d %s", rec.Code, rec.Body)
	}
	for _, tpl := range []string{"done", "failed", "nosuch"} {
		if code, _ := link(tpl); code != http.StatusNotFound {
			t.Errorf("link for %s: %d", tpl, code)
		}
		sig := a.srv.uploadSignature(tpl, hash)
		rec := a.do("PUT", "/templates/"+tpl+"/files/"+hash+"/upload?signature="+sig, "tar bytes")
		if rec.Code != http.StatusNotFound || !strings.Contains(rec.Body.String(), "no build waiting") {
			t.Errorf("upload for %s: %d %s", tpl, rec.Code, rec.Body)
		}
	}
}

// TestSignedFileURLWithoutSandbox: a pre-signed /files URL naming no
// sandbox answers as E2B's envd does when it does not pass: 401 "signature
// is already expired" when a running sandbox's token signed it, "invalid
// signature" when none did.
func TestSignedFileURLWithoutSandbox(t *testing.T) {
	a := newTestAPI(t)
	a.node.add(&sandboxes.Sandbox{ID: "sbx1", TemplateID: "base", StartedAt: time.Now(), EndAt: time.Now().Add(time.Minute), AccessToken: "tok"})
	sign := func(path, token, exp string) string {
		sum := sha256.Sum256([]byte(path + ":read::" + token + ":" + exp))
		return "v1_" + base64.RawStdEncoding.EncodeToString(sum[:])
	}
	past := strconv.FormatInt(time.Now().Add(-time.Minute).Unix(), 10)
	for _, c := range []struct{ name, token, msg string }{
		{"expired", "tok", "signature is already expired"},
		{"signed by no sandbox", "other", "invalid signature"},
	} {
		q := url.Values{"path": {"/home/user/a.txt"}, "signature": {sign("/home/user/a.txt", c.token, past)}, "signature_expiration": {past}}
		rec := a.do("GET", "/files?"+q.Encode(), "")
		var body struct {
			Code    int
			Message string
		}
		if err := json.Unmarshal(rec.Body.Bytes(), &body); err != nil || rec.Code != 401 || body.Message != c.msg {
			t.Errorf("%s: %d %s", c.name, rec.Code, rec.Body)
		}
	}
}
