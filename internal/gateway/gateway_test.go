package gateway

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"

	"github.com/agentenv/agentenv/internal/api"
	"github.com/agentenv/agentenv/internal/apikeys"
	"github.com/agentenv/agentenv/internal/apispec"
	"github.com/agentenv/agentenv/internal/httperr"
	"github.com/agentenv/agentenv/internal/proxy/proxytest"
	"github.com/agentenv/agentenv/internal/scheduler"
	pb "github.com/agentenv/agentenv/internal/scheduler/gen/schedulerpb"
)

// The gateway against a real scheduler and small stand-in nodes that serve
// GET /v2/sandboxes and GET /sandboxes/{id} from fixed lists, with the
// nodes' cursor ("<startedAt ns>|<id>", newest first). The whole surface
// against real nodes is tests/e2e's TestCluster.

const key = "e2b_00000000000000000000000000000000000000aa"

type listedSandbox struct {
	SandboxID string    `json:"sandboxID"`
	StartedAt time.Time `json:"startedAt"`
}

const testNodeToken = "gateway-test-node-token-0123456789abcdef"

func standInNode(t *testing.T, sandboxes []listedSandbox, failing *bool) *httptest.Server {
	t.Helper()
	sort.Slice(sandboxes, func(i, j int) bool {
		if !sandboxes[i].StartedAt.Equal(sandboxes[j].StartedAt) {
			return sandboxes[i].StartedAt.After(sandboxes[j].StartedAt)
		}
		return sandboxes[i].SandboxID < sandboxes[j].SandboxID
	})
	mux := http.NewServeMux()
	mux.HandleFunc("GET /v2/sandboxes", func(w http.ResponseWriter, r *http.Request) {
		if failing != nil && *failing {
			httperr.Write(w, http.StatusInternalServerError, "disk on fire")
			return
		}
		// Nodes see the gateway's node credential, never the client's key.
		if r.Header.Get(api.HeaderNodeToken) != testNodeToken || r.Header.Get("X-API-Key") != "" {
			httperr.Write(w, http.StatusUnauthorized, "key")
			return
		}
		limit, _ := strconv.Atoi(r.URL.Query().Get("limit"))
		if limit == 0 {
			limit = 100
		}
		if limit < 0 || limit > 1000 {
			httperr.Write(w, http.StatusBadRequest, "limit must be an integer between 1 and 1000")
			return
		}
		var afterNS int64 = 1<<63 - 1
		afterID := ""
		if tok := r.URL.Query().Get("nextToken"); tok != "" {
			b, _ := base64.RawURLEncoding.DecodeString(tok)
			ns, id, _ := strings.Cut(string(b), "|")
			afterNS, _ = strconv.ParseInt(ns, 10, 64)
			afterID = id
		}
		out := []listedSandbox{}
		for _, sb := range sandboxes {
			n := sb.StartedAt.UnixNano()
			if !(n < afterNS || (n == afterNS && sb.SandboxID > afterID)) {
				continue
			}
			if len(out) == limit {
				last := out[len(out)-1]
				w.Header().Set("X-Next-Token", api.ListCursor(last.StartedAt, last.SandboxID, false))
				break
			}
			out = append(out, sb)
		}
		json.NewEncoder(w).Encode(out)
	})
	mux.HandleFunc("GET /sandboxes/{id}", func(w http.ResponseWriter, r *http.Request) {
		for _, sb := range sandboxes {
			if sb.SandboxID == r.PathValue("id") {
				json.NewEncoder(w).Encode(sb)
				return
			}
		}
		httperr.Write(w, http.StatusNotFound, "not found")
	})
	// A create answers a new sandbox named after the node's first one.
	mux.HandleFunc("POST /v2/sandboxes", func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusCreated)
		json.NewEncoder(w).Encode(map[string]string{"sandboxID": "new" + sandboxes[0].SandboxID, "clientID": "aenv"})
	})
	// Volumes: the REST routes see the node credential; the content routes
	// the client's own bearer token (the volume's), and no node credential.
	mux.HandleFunc("GET /volumes", func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get(api.HeaderNodeToken) != testNodeToken || r.Header.Get("Authorization") != "" {
			httperr.Write(w, http.StatusUnauthorized, "key")
			return
		}
		json.NewEncoder(w).Encode([]map[string]string{{"volumeID": "v1", "name": "data"}})
	})
	mux.HandleFunc("GET /volumecontent/{id}/path", func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Authorization") != "Bearer vol_token" || r.Header.Get(api.HeaderNodeToken) != "" {
			httperr.Write(w, http.StatusUnauthorized, "token")
			return
		}
		json.NewEncoder(w).Encode(map[string]string{"path": r.URL.Query().Get("path")})
	})
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return srv
}

type harness struct {
	gw, sched *httptest.Server
	all       []listedSandbox
}

func newHarness(t *testing.T, perNode int, failing *bool) *harness {
	t.Helper()
	h := &harness{}
	sched := scheduler.New(scheduler.Config{Token: key, Logger: slog.New(slog.DiscardHandler)})
	mux := http.NewServeMux()
	mux.Handle(sched.Handler())
	h.sched = httptest.NewServer(mux)
	t.Cleanup(h.sched.Close)
	client := scheduler.NewClient(h.sched.Client(), h.sched.URL, key)
	base := time.Date(2026, 12, 1, 0, 0, 0, 0, time.UTC)
	for n := 0; n < 3; n++ {
		var sbs []listedSandbox
		for i := 0; i < perNode; i++ {
			// Some start times shared across nodes: ties sort by id.
			sbs = append(sbs, listedSandbox{SandboxID: fmt.Sprintf("n%ds%02d", n, i), StartedAt: base.Add(time.Duration(i%4) * time.Second)})
		}
		var f *bool
		if n == 2 {
			f = failing
		}
		node := standInNode(t, sbs, f)
		h.all = append(h.all, sbs...)
		rep := &pb.NodeReport{NodeId: fmt.Sprintf("n%d", n), Url: node.URL, Cpus: 2, MemoryTotalBytes: 8 << 30, MemoryAvailableBytes: 8 << 30}
		for _, sb := range sbs {
			rep.Sandboxes = append(rep.Sandboxes, &pb.SandboxReport{SandboxId: sb.SandboxID, State: "running"})
		}
		if _, err := client.Heartbeat(context.Background(), connect.NewRequest(&pb.HeartbeatRequest{Node: rep})); err != nil {
			t.Fatal(err)
		}
	}
	g := New(Config{Scheduler: client, APIKey: key, NodeToken: testNodeToken, Logger: slog.New(slog.DiscardHandler)})
	h.gw = httptest.NewServer(g)
	t.Cleanup(h.gw.Close)
	return h
}

func get(t *testing.T, url string) (*http.Response, []byte) {
	t.Helper()
	req, _ := http.NewRequest("GET", url, nil)
	req.Header.Set("X-API-Key", key)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp, b
}

// TestPaginationAcrossNodes walks GET /v2/sandboxes page by page for
// several limits: every sandbox of every node once, in the nodes' order.
func TestPaginationAcrossNodes(t *testing.T) {
	h := newHarness(t, 9, nil)
	want := append([]listedSandbox{}, h.all...)
	sort.Slice(want, func(i, j int) bool {
		if !want[i].StartedAt.Equal(want[j].StartedAt) {
			return want[i].StartedAt.After(want[j].StartedAt)
		}
		return want[i].SandboxID < want[j].SandboxID
	})
	for _, limit := range []int{1, 2, 5, 7, 26, 27, 100} {
		t.Run(fmt.Sprint("limit ", limit), func(t *testing.T) {
			var got []listedSandbox
			token := ""
			for pages := 0; ; pages++ {
				if pages > 30 {
					t.Fatal("pagination does not end")
				}
				url := fmt.Sprintf("%s/v2/sandboxes?limit=%d", h.gw.URL, limit)
				if token != "" {
					url += "&nextToken=" + token
				}
				resp, body := get(t, url)
				if resp.StatusCode != 200 {
					t.Fatalf("%d %s", resp.StatusCode, body)
				}
				var page []listedSandbox
				if err := json.Unmarshal(body, &page); err != nil || len(page) > limit {
					t.Fatalf("page of %d (limit %d): %v", len(page), limit, err)
				}
				got = append(got, page...)
				if token = resp.Header.Get("X-Next-Token"); token == "" {
					break
				}
			}
			if len(got) != len(want) {
				t.Fatalf("listed %d sandboxes, want %d", len(got), len(want))
			}
			for i := range want {
				if got[i].SandboxID != want[i].SandboxID {
					t.Fatalf("position %d: %s, want %s", i, got[i].SandboxID, want[i].SandboxID)
				}
			}
		})
	}
}

func TestListErrors(t *testing.T) {
	failing := false
	h := newHarness(t, 2, &failing)
	// A 4xx is the same on every node: passed on as it is.
	resp, body := get(t, h.gw.URL+"/v2/sandboxes?limit=5000")
	if resp.StatusCode != 400 || !strings.Contains(string(body), "limit") {
		t.Fatalf("bad limit: %d %s", resp.StatusCode, body)
	}
	// A failing node fails the list (a partial list would look complete).
	failing = true
	resp, body = get(t, h.gw.URL+"/v2/sandboxes")
	if resp.StatusCode != 502 || !strings.Contains(string(body), "n2") {
		t.Fatalf("failing node: %d %s", resp.StatusCode, body)
	}
	req, _ := http.NewRequest("GET", h.gw.URL+"/v2/sandboxes", nil)
	if resp, err := http.DefaultClient.Do(req); err != nil || resp.StatusCode != 401 {
		t.Fatalf("no key: %v %v", resp, err)
	}
}

// TestRoutingWithoutScheduler: with the scheduler gone, sandboxes are found
// from the gateway's memory or by asking the known nodes; unknown ones are
// 404 and creates 503.
func TestRoutingWithoutScheduler(t *testing.T) {
	h := newHarness(t, 2, nil)
	// The gateway learns the node list (and one route) while the
	// scheduler is up.
	if resp, body := get(t, h.gw.URL+"/nodes"); resp.StatusCode != 200 || !strings.Contains(string(body), `"nodeID":"n1"`) {
		t.Fatalf("nodes: %d %s", resp.StatusCode, body)
	}
	if resp, _ := get(t, h.gw.URL+"/sandboxes/n0s00"); resp.StatusCode != 200 {
		t.Fatalf("routed GET: %d", resp.StatusCode)
	}
	h.sched.Close()
	for _, id := range []string{"n0s00", "n1s01", "n2s00"} {
		if resp, body := get(t, h.gw.URL+"/sandboxes/"+id); resp.StatusCode != 200 || !strings.Contains(string(body), id) {
			t.Fatalf("GET %s without a scheduler: %d %s", id, resp.StatusCode, body)
		}
	}
	if resp, _ := get(t, h.gw.URL+"/sandboxes/nosuch"); resp.StatusCode != 404 {
		t.Fatalf("unknown sandbox without a scheduler: %d", resp.StatusCode)
	}
	if resp, _ := get(t, h.gw.URL+"/v2/sandboxes"); resp.StatusCode != 200 {
		t.Fatalf("list without a scheduler: %d", resp.StatusCode)
	}
	req, _ := http.NewRequest("POST", h.gw.URL+"/sandboxes", strings.NewReader(`{"templateID":"base"}`))
	req.Header.Set("X-API-Key", key)
	resp, err := http.DefaultClient.Do(req)
	if err != nil || resp.StatusCode != 503 {
		t.Fatalf("create without a scheduler: %v %v", resp, err)
	}
	// Sandbox traffic for an unknown sandbox is 502, as on a node.
	req, _ = http.NewRequest("GET", h.gw.URL+"/health", nil)
	req.Header.Set("E2b-Sandbox-Id", "nosuch")
	req.Header.Set("E2b-Sandbox-Port", "49983")
	if resp, err := http.DefaultClient.Do(req); err != nil || resp.StatusCode != 502 {
		t.Fatalf("proxy to an unknown sandbox: %v %v", resp, err)
	}
}

// TestNamedKeys: the gateway accepts the named keys of its keys file
// besides the cluster's key, and refuses a revoked one within seconds; a
// gateway with named keys only refuses the shared key.
func TestNamedKeys(t *testing.T) {
	h := newHarness(t, 1, nil)
	ctx := context.Background()
	keys := apikeys.OpenFile(filepath.Join(t.TempDir(), "gateway-keys"))
	named, err := keys.Create(ctx, "trainer-1")
	if err != nil {
		t.Fatal(err)
	}
	client := scheduler.NewClient(h.sched.Client(), h.sched.URL, key)
	status := func(gw *httptest.Server, k string) int {
		t.Helper()
		req, _ := http.NewRequest("GET", gw.URL+"/v2/sandboxes", nil)
		req.Header.Set("X-API-Key", k)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	both := httptest.NewServer(New(Config{Scheduler: client, APIKey: key, Keys: keys, NodeToken: testNodeToken, Logger: slog.New(slog.DiscardHandler)}))
	defer both.Close()
	namedOnly := httptest.NewServer(New(Config{Scheduler: client, Keys: keys, NodeToken: testNodeToken, Logger: slog.New(slog.DiscardHandler)}))
	defer namedOnly.Close()
	for _, tc := range []struct {
		gw   *httptest.Server
		k    string
		want int
	}{
		{both, key, 200}, {both, named, 200}, {both, "e2b_0123", 401}, {both, testNodeToken, 401},
		{namedOnly, named, 200}, {namedOnly, key, 401}, {namedOnly, "", 401},
	} {
		if got := status(tc.gw, tc.k); got != tc.want {
			t.Errorf("key %q: %d, want %d", tc.k, got, tc.want)
		}
	}
	// Revoked by another process (`aenv key revoke --file`): refused soon.
	if err := apikeys.OpenFile(keys.Path()).Revoke(ctx, "trainer-1"); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(3 * time.Second)
	for status(both, named) != 401 {
		if time.Now().After(deadline) {
			t.Fatal("a revoked key is still accepted")
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// A create with volume mounts goes to the node with the volumes' disks
// (the first), whichever node the scheduler would choose.
func TestCreateWithVolumesOnFirstNode(t *testing.T) {
	h := newHarness(t, 1, nil)
	for i := 0; i < 4; i++ {
		req, _ := http.NewRequest("POST", h.gw.URL+"/v2/sandboxes", strings.NewReader(`{"templateID":"base","volumeMounts":[{"name":"data","path":"/mnt/data"}]}`))
		req.Header.Set("X-API-Key", key)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 201 || !strings.Contains(string(body), `"newn0s00"`) {
			t.Fatalf("create with volumes: %d %s, want it made on n0", resp.StatusCode, body)
		}
	}
}

// The volume routes go to the first node: /volumes with the client's API
// key checked by the gateway, the content routes with the volume's bearer
// token passed through for the node to check.
func TestVolumeRoutes(t *testing.T) {
	h := newHarness(t, 1, nil)
	if resp, body := get(t, h.gw.URL+"/volumes"); resp.StatusCode != 200 || !strings.Contains(string(body), `"v1"`) {
		t.Fatalf("GET /volumes: %d %s", resp.StatusCode, body)
	}
	resp, err := http.Get(h.gw.URL + "/volumes")
	if err != nil || resp.StatusCode != 401 {
		t.Fatalf("GET /volumes without a key: %v %v", resp, err)
	}
	req, _ := http.NewRequest("GET", h.gw.URL+"/volumecontent/v1/path?path=/x", nil)
	req.Header.Set("Authorization", "Bearer vol_token")
	resp, err = http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || !strings.Contains(string(body), `"/x"`) {
		t.Fatalf("volume content through the gateway: %d %s", resp.StatusCode, body)
	}
}

// TestDocumentedRoutesThroughTheGateway: every operation of the node's
// OpenAPI document reaches a handler through the gateway (never its own
// "no route" answer), behind the check the document asks for: an
// operation that requires the API key is refused without it at the
// gateway, an open one (the signed build-file upload) passes without it.
func TestDocumentedRoutesThroughTheGateway(t *testing.T) {
	h := newHarness(t, 1, nil)
	ops, err := api.Operations()
	if err != nil {
		t.Fatal(err)
	}
	fill := regexp.MustCompile(`\{[^}]+\}`)
	for op, o := range ops {
		if o.ServedBy == "peers" || o.ServedBy == "nodes" || o.ServedBy == "cluster" {
			continue // between nodes, each node's own (its metrics), or the gateway's to its nodes
		}
		method, path, _ := strings.Cut(op, " ")
		url := h.gw.URL + fill.ReplaceAllString(path, "n0s00")
		for _, withKey := range []bool{false, true} {
			req, _ := http.NewRequest(method, url, strings.NewReader("{}"))
			if withKey {
				req.Header.Set("X-API-Key", key)
			}
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			keyed := slices.Contains(o.Security, "ApiKeyAuth")
			switch {
			case strings.Contains(string(body), "no route for"):
				t.Errorf("%s (key %v): the gateway has no route: %s", op, withKey, body)
			case !withKey && keyed && resp.StatusCode != http.StatusUnauthorized:
				t.Errorf("%s without a key: %d, want 401: %s", op, resp.StatusCode, body)
			case !keyed && resp.StatusCode == http.StatusUnauthorized && strings.Contains(string(body), "API key"):
				t.Errorf("%s is open in the document, the gateway asked for a key: %s", op, body)
			}
		}
	}
}

// gatewayOver runs a gateway whose scheduler knows the given nodes
// (n0, n1, … in that order, each with room for a sandbox).
func gatewayOver(t *testing.T, nodes ...*httptest.Server) *httptest.Server {
	t.Helper()
	var reports []*pb.NodeReport
	for i, n := range nodes {
		reports = append(reports, &pb.NodeReport{NodeId: fmt.Sprintf("n%d", i), Url: n.URL, Cpus: 2, MemoryTotalBytes: 8 << 30, MemoryAvailableBytes: 8 << 30})
	}
	return gatewayWith(t, reports...)
}

// gatewayWith runs a gateway whose scheduler has had these nodes' reports.
func gatewayWith(t *testing.T, reports ...*pb.NodeReport) *httptest.Server {
	t.Helper()
	sched := scheduler.New(scheduler.Config{Token: key, Logger: slog.New(slog.DiscardHandler)})
	mux := http.NewServeMux()
	mux.Handle(sched.Handler())
	ss := httptest.NewServer(mux)
	t.Cleanup(ss.Close)
	client := scheduler.NewClient(ss.Client(), ss.URL, key)
	for _, rep := range reports {
		if _, err := client.Heartbeat(context.Background(), connect.NewRequest(&pb.HeartbeatRequest{Node: rep})); err != nil {
			t.Fatal(err)
		}
	}
	gw := httptest.NewServer(New(Config{Scheduler: client, APIKey: key, NodeToken: testNodeToken, Logger: slog.New(slog.DiscardHandler)}))
	t.Cleanup(gw.Close)
	return gw
}

// A node at its limit (429) sends the create to another node; when every
// node is, the client gets a 429 with the soonest Retry-After and the
// limit named, never a 5xx.
func TestCreateAroundFullNodes(t *testing.T) {
	var creates atomic.Int64
	node := func(full bool, retryAfter string) *httptest.Server {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.Method != "POST" || r.URL.Path != "/v2/sandboxes" {
				httperr.Write(w, http.StatusNotFound, "no")
				return
			}
			creates.Add(1)
			if full {
				w.Header().Set("Retry-After", retryAfter)
				httperr.Write(w, http.StatusTooManyRequests, "the node is starting 4 sandboxes, its limit (--max-starting)")
				return
			}
			w.WriteHeader(http.StatusCreated)
			json.NewEncoder(w).Encode(map[string]string{"sandboxID": "made", "clientID": "aenv"})
		}))
		t.Cleanup(srv.Close)
		return srv
	}
	post := func(gw *httptest.Server) (*http.Response, string) {
		req, _ := http.NewRequest("POST", gw.URL+"/v2/sandboxes", strings.NewReader(`{"templateID":"base"}`))
		req.Header.Set("X-API-Key", key)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		return resp, string(body)
	}
	// One full node, one with room: made on the second.
	resp, body := post(gatewayOver(t, node(true, "7"), node(false, "")))
	if resp.StatusCode != http.StatusCreated || !strings.Contains(body, "made") {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	// Both full: 429, the soonest Retry-After, the limit named.
	creates.Store(0)
	resp, body = post(gatewayOver(t, node(true, "9"), node(true, "3")))
	if resp.StatusCode != http.StatusTooManyRequests || resp.Header.Get("Retry-After") != "3" ||
		!strings.Contains(body, "--max-starting") || creates.Load() != 2 {
		t.Fatalf("%d Retry-After %q, %d creates: %s", resp.StatusCode, resp.Header.Get("Retry-After"), creates.Load(), body)
	}
}

// A create retried with its Idempotency-Key goes to the node that made
// the first, with the key and the client (the hash of its API key, never
// the key) passed on; another key is placed anew. A gateway without the
// key's pin (restarted, or another gateway of the cluster) asks every node
// for the key and sends the retry to the one holding it.
func TestIdempotentCreateStaysOnItsNode(t *testing.T) {
	var mu sync.Mutex
	creates := map[string][]string{} // node → keys of the creates it ran
	node := func(name string) *httptest.Server {
		held := map[string]string{} // key → answer
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.Header.Get("X-API-Key") != "" || r.Header.Get(api.HeaderClient) != api.ClientOf(&http.Request{Header: http.Header{"X-Api-Key": {key}}}) {
				httperr.Write(w, http.StatusUnauthorized, "client")
				return
			}
			k := r.Header.Get("Idempotency-Key")
			mu.Lock()
			defer mu.Unlock()
			if a, ok := held[k]; ok {
				w.WriteHeader(http.StatusCreated)
				io.WriteString(w, a)
				return
			}
			if strings.HasPrefix(r.URL.Path, api.FindOnlyPrefix+"/") {
				httperr.Write(w, http.StatusNotFound, "unknown key")
				return
			}
			creates[name] = append(creates[name], k)
			b, _ := json.Marshal(map[string]string{"sandboxID": fmt.Sprintf("on%s-%d", name, len(creates[name])), "clientID": "aenv"})
			held[k] = string(b)
			w.WriteHeader(http.StatusCreated)
			w.Write(b)
		}))
		t.Cleanup(srv.Close)
		return srv
	}
	a, b := node("a"), node("b")
	gw := gatewayOver(t, a, b)
	post := func(gw *httptest.Server, idemKey string) string {
		req, _ := http.NewRequest("POST", gw.URL+"/v2/sandboxes", strings.NewReader(`{"templateID":"base"}`))
		req.Header.Set("X-API-Key", key)
		req.Header.Set("Idempotency-Key", idemKey)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != http.StatusCreated {
			t.Fatalf("%d %s", resp.StatusCode, b)
		}
		return string(b)
	}
	first := post(gw, "e1")
	for range 5 {
		if again := post(gw, "e1"); again != first {
			t.Fatalf("retry answered %s, first %s", again, first)
		}
	}
	// Gateways that never saw e1 (a restarted one, another of the
	// cluster), whose schedulers know the nodes in either order, so that
	// some would place the retry on the other node.
	for i := range 4 {
		other := gatewayOver(t, a, b)
		if i%2 == 1 {
			other = gatewayOver(t, b, a)
		}
		if again := post(other, "e1"); again != first {
			t.Fatalf("retry through another gateway answered %s, first %s", again, first)
		}
	}
	if other := post(gw, "e2"); other == first {
		t.Fatal("another key got the first sandbox")
	}
	mu.Lock()
	defer mu.Unlock()
	if n := len(creates["a"]) + len(creates["b"]); n != 2 {
		t.Fatalf("%d creates for two keys: %v", n, creates)
	}
}

// TestIdempotentFindRunsNothingOnOlderNodes: a gateway without a key's pin
// asks every node for it. Nodes of an earlier version know no find-only
// request and would run it as a create; asked on a path of its own, they
// answer 404 and run nothing, so each retry makes exactly one sandbox
// (asked with the header, both nodes would make one).
func TestIdempotentFindRunsNothingOnOlderNodes(t *testing.T) {
	var mu sync.Mutex
	creates := 0
	older := func() *httptest.Server {
		mux := http.NewServeMux()
		mux.HandleFunc("POST /v2/sandboxes", func(w http.ResponseWriter, r *http.Request) {
			mu.Lock()
			creates++
			n := creates
			mu.Unlock()
			w.WriteHeader(http.StatusCreated)
			fmt.Fprintf(w, `{"sandboxID":"s%d","clientID":"aenv"}`, n)
		})
		srv := httptest.NewServer(mux)
		t.Cleanup(srv.Close)
		return srv
	}
	a, b := older(), older()
	for i := range 3 {
		gw := gatewayOver(t, a, b) // a fresh gateway each time: no pin
		req, _ := http.NewRequest("POST", gw.URL+"/v2/sandboxes", strings.NewReader(`{"templateID":"base"}`))
		req.Header.Set("X-API-Key", key)
		req.Header.Set("Idempotency-Key", "k")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		mu.Lock()
		got := creates
		mu.Unlock()
		if resp.StatusCode != http.StatusCreated || got != i+1 {
			t.Fatalf("request %d: %d, %d creates on the older nodes (want %d)", i, resp.StatusCode, got, i+1)
		}
	}
}

// A lease binds sandboxes on several nodes: the gateway's lease routes
// ask every node and merge what those that know the lease answer.
func TestLeasesAcrossNodes(t *testing.T) {
	node := func(sandbox string, known bool) *httptest.Server {
		mux := http.NewServeMux()
		lease := func() apispec.Lease {
			return apispec.Lease{LeaseID: "L", Ttl: 60, ExpiresAt: time.Now().Add(time.Minute), CreatedAt: time.Now(), Sandboxes: []string{sandbox}}
		}
		answer := func(w http.ResponseWriter, v any) {
			if !known {
				httperr.Write(w, http.StatusNotFound, "no lease")
				return
			}
			json.NewEncoder(w).Encode(v)
		}
		mux.HandleFunc("GET /leases", func(w http.ResponseWriter, r *http.Request) {
			if !known {
				json.NewEncoder(w).Encode([]apispec.Lease{})
				return
			}
			json.NewEncoder(w).Encode([]apispec.Lease{lease()})
		})
		mux.HandleFunc("GET /leases/L", func(w http.ResponseWriter, r *http.Request) { answer(w, lease()) })
		mux.HandleFunc("POST /leases/L/keepalive", func(w http.ResponseWriter, r *http.Request) { answer(w, lease()) })
		mux.HandleFunc("DELETE /leases/L", func(w http.ResponseWriter, r *http.Request) {
			answer(w, map[string]any{"leaseID": "L", "killed": []string{sandbox}})
		})
		srv := httptest.NewServer(mux)
		t.Cleanup(srv.Close)
		return srv
	}
	gw := gatewayOver(t, node("s1", true), node("s2", true), node("s3", false))
	do := func(method, path string) (int, string) {
		req, _ := http.NewRequest(method, gw.URL+path, nil)
		req.Header.Set("X-API-Key", key)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	for _, c := range [][2]string{{"GET", "/leases/L"}, {"POST", "/leases/L/keepalive"}, {"GET", "/leases"}} {
		status, body := do(c[0], c[1])
		if status != http.StatusOK || !strings.Contains(body, `"sandboxes":["s1","s2"]`) {
			t.Errorf("%s %s: %d %s", c[0], c[1], status, body)
		}
	}
	if status, body := do("DELETE", "/leases/L"); status != http.StatusOK || !strings.Contains(body, `"killed":["s1","s2"]`) {
		t.Errorf("delete: %d %s", status, body)
	}
	if status, body := do("GET", "/leases/M"); status != http.StatusNotFound {
		t.Errorf("unknown lease: %d %s", status, body)
	}
}

// A webhook registered through the gateway is registered on every node
// under one id; its deliveries are every node's.
func TestWebhooksOnEveryNode(t *testing.T) {
	var mu sync.Mutex
	ids := map[string]string{} // node → id registered
	node := func(name string) *httptest.Server {
		mux := http.NewServeMux()
		mux.HandleFunc("POST /events/webhooks", func(w http.ResponseWriter, r *http.Request) {
			var body struct{ ID string }
			json.NewDecoder(r.Body).Decode(&body)
			mu.Lock()
			ids[name] = body.ID
			mu.Unlock()
			w.WriteHeader(http.StatusCreated)
			json.NewEncoder(w).Encode(apispec.Webhook{Id: body.ID, Url: "http://x", Enabled: true})
		})
		mux.HandleFunc("GET /events/webhooks/{id}/deliveries", func(w http.ResponseWriter, r *http.Request) {
			json.NewEncoder(w).Encode([]apispec.WebhookDelivery{{Id: "d-" + name, WebhookID: r.PathValue("id"), CreatedAt: time.Now()}})
		})
		srv := httptest.NewServer(mux)
		t.Cleanup(srv.Close)
		return srv
	}
	gw := gatewayOver(t, node("a"), node("b"))
	req, _ := http.NewRequest("POST", gw.URL+"/events/webhooks", strings.NewReader(`{"url":"http://x"}`))
	req.Header.Set("X-API-Key", key)
	resp, err := http.DefaultClient.Do(req)
	if err != nil || resp.StatusCode != http.StatusCreated {
		t.Fatalf("%v %v", resp, err)
	}
	var h apispec.Webhook
	json.NewDecoder(resp.Body).Decode(&h)
	resp.Body.Close()
	mu.Lock()
	if h.Id == "" || ids["a"] != h.Id || ids["b"] != h.Id {
		t.Fatalf("registered as %q on the nodes: %v", h.Id, ids)
	}
	mu.Unlock()
	resp2, body := get(t, gw.URL+"/events/webhooks/"+h.Id+"/deliveries")
	if resp2.StatusCode != 200 || !strings.Contains(string(body), "d-a") || !strings.Contains(string(body), "d-b") {
		t.Fatalf("deliveries: %d %s", resp2.StatusCode, body)
	}
}

// Sandbox traffic through the gateway is full duplex over HTTP/1.1, as on
// a node: the node may answer (and the gateway flush the answer) before the
// request body has all arrived, and the body keeps flowing while the
// response streams back. Without it Go's HTTP/1 server closes the request
// body at the gateway's first flush, and the transport aborts the node's
// connection mid-stream (a Connect stream ends "terminated" in the SDK).
func TestSandboxTrafficIsFullDuplex(t *testing.T) {
	node := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("E2b-Sandbox-Id") != "sbx" {
			httperr.Write(w, http.StatusNotFound, "not a sandbox request")
			return
		}
		proxytest.Echo(w, r)
	}))
	t.Cleanup(node.Close)
	gw := gatewayWith(t, &pb.NodeReport{NodeId: "n0", Url: node.URL, Cpus: 2, MemoryTotalBytes: 8 << 30, MemoryAvailableBytes: 8 << 30,
		Sandboxes: []*pb.SandboxReport{{SandboxId: "sbx", State: "running"}}})
	proxytest.CheckFullDuplex(t, gw.URL+"/process.Process/Start", http.Header{"E2b-Sandbox-Id": {"sbx"}, "E2b-Sandbox-Port": {"49983"}})
}
