// Package gateway owns a cluster's single endpoint: the E2B REST surface
// and the sandbox proxy of a node, in front of many nodes. New sandboxes go
// where the scheduler places them; requests for a sandbox go to the node
// that holds it (asked of the scheduler, remembered for a while); lists are
// gathered from every node and paginated as one. When the scheduler is
// down, routing goes on from what the gateway remembers and by asking the
// nodes it knows.
package gateway

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httputil"
	"net/url"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"connectrpc.com/connect"

	"github.com/agentenv/agentenv/internal/api"
	"github.com/agentenv/agentenv/internal/apispec"
	"github.com/agentenv/agentenv/internal/httperr"
	"github.com/agentenv/agentenv/internal/idempotency"
	"github.com/agentenv/agentenv/internal/proxy"
	pb "github.com/agentenv/agentenv/internal/scheduler/gen/schedulerpb"
	"github.com/agentenv/agentenv/internal/scheduler/gen/schedulerpb/schedulerpbconnect"
)

// Config configures a gateway.
type Config struct {
	Scheduler schedulerpbconnect.SchedulerClient
	// APIKey is the cluster's client key: clients present it to the
	// gateway. NodeToken is the cluster's node credential: the gateway
	// presents it to the nodes (never the client's key).
	APIKey    string
	NodeToken string
	// Keys are named client keys accepted besides APIKey (nil: none), such
	// as an apikeys.File.
	Keys api.KeyChecker
	// Domain is the sandbox domain of `{port}-{id}.{domain}` hosts (empty:
	// any).
	Domain string
	// RouteTTL is how long a sandbox's node is trusted without asking the
	// scheduler again (default 10 s).
	RouteTTL time.Duration
	Logger   *slog.Logger
}

// Gateway is the cluster endpoint's HTTP handler.
type Gateway struct {
	cfg     Config
	log     *slog.Logger
	client  *http.Client
	proxy   *httputil.ReverseProxy
	mux     *http.ServeMux
	handler http.Handler // serve, with request ids

	mu     sync.Mutex
	routes map[string]route
	nodes  []*pb.Node // the scheduler's last list

	// idempotent are the nodes of creates sent with an Idempotency-Key.
	idempotent *pins
}

// route is where a sandbox was last seen.
type route struct {
	nodeID, url string
	at          time.Time
}

type targetKey struct{}

// New returns a gateway.
func New(cfg Config) *Gateway {
	if cfg.RouteTTL <= 0 {
		cfg.RouteTTL = 10 * time.Second
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	g := &Gateway{cfg: cfg, log: cfg.Logger, routes: map[string]route{}, mux: http.NewServeMux(), idempotent: newPins(24*time.Hour, 100000),
		client: &http.Client{Timeout: 5 * time.Minute, Transport: &http.Transport{MaxIdleConnsPerHost: 32, IdleConnTimeout: 30 * time.Second}}}
	g.proxy = &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.SetURL(pr.In.Context().Value(targetKey{}).(*url.URL))
			pr.Out.Host = pr.In.Host // sandbox hosts ({port}-{id}.{domain}) route on the node too
			pr.SetXForwarded()
			_, sandbox := proxy.ParseTarget(pr.In, g.cfg.Domain)
			if !sandbox && !isVolumeContent(pr.In) {
				g.asGateway(pr.Out.Header, api.ClientOf(pr.In)) // REST: the node sees the gateway, not the client's key
			}
		},
		FlushInterval: -1, // streams (Connect, SSE) pass through at once
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			httperr.Internal(w, g.log, http.StatusBadGateway, "the sandbox's node did not answer", err)
		},
	}
	g.registerRoutes()
	g.handler = httperr.WithIDs(http.HandlerFunc(g.serve))
	return g
}

func (g *Gateway) registerRoutes() {
	clients := api.ClientKeys{Named: g.cfg.Keys, Log: g.log}
	if g.cfg.APIKey != "" {
		clients.Shared = sha256.Sum256([]byte(g.cfg.APIKey))
	}
	key := clients.Require
	g.mux.HandleFunc("GET /health", func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusOK) })
	g.mux.HandleFunc("GET /openapi.yml", api.ServeOpenAPI)
	g.mux.Handle("GET /nodes", key(g.listNodes))
	g.mux.Handle("POST /sandboxes", key(g.create))
	g.mux.Handle("POST /v2/sandboxes", key(g.create))
	g.mux.Handle("POST /sandboxes-cold", key(g.create))
	g.mux.Handle("GET /sandboxes", key(g.listV1))
	g.mux.Handle("GET /v2/sandboxes", key(g.listV2))
	g.mux.Handle("/sandboxes/{id}", key(g.toSandboxNode))
	g.mux.Handle("/sandboxes/{id}/{rest...}", key(g.toSandboxNode))
	g.mux.Handle("/v2/sandboxes/{id}/{rest...}", key(g.toSandboxNode))
	g.mux.Handle("GET /leases", key(g.listLeases))
	g.mux.Handle("GET /leases/{leaseID}", key(g.leaseOnNodes))
	g.mux.Handle("POST /leases/{leaseID}/keepalive", key(g.leaseOnNodes))
	g.mux.Handle("DELETE /leases/{leaseID}", key(g.deleteLease))
	g.mux.Handle("GET /events/webhooks", key(g.listWebhooks))
	g.mux.Handle("POST /events/webhooks", key(g.createWebhook))
	for _, m := range []string{"GET", "PATCH", "DELETE"} {
		g.mux.Handle(m+" /events/webhooks/{webhookID}", key(g.webhookOnNodes))
	}
	g.mux.Handle("GET /events/webhooks/{webhookID}/deliveries", key(g.webhookDeliveries))
	g.mux.Handle("GET /snapshots", key(g.listSnapshots))
	g.mux.Handle("DELETE /snapshots/{name}", key(g.deleteSnapshot))
	for _, p := range []string{"/templates", "/v2/templates", "/v3/templates"} {
		g.mux.Handle(p, key(g.toFirstNode))
		g.mux.Handle(p+"/", key(g.toFirstNode))
	}
	// A build-file upload is authorised by its signed link, which the
	// node checks; the SDKs send it without the API key.
	g.mux.HandleFunc("PUT /templates/{templateID}/files/{hash}/upload", g.toFirstNode)
	// Volumes live on the first node, like templates' builds. Their
	// content routes carry the volume's own token, which the node checks.
	g.mux.Handle("/volumes", key(g.toFirstNode))
	g.mux.Handle("/volumes/", key(g.toFirstNode))
	g.mux.HandleFunc("/volumecontent/", g.toFirstNode)
	g.mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		httperr.Write(w, http.StatusNotFound, fmt.Sprintf("no route for %s %s", r.Method, r.URL.Path))
	})
}

// isVolumeContent reports whether r is a request of the volume content
// API, which passes to the node with the client's bearer token.
func isVolumeContent(r *http.Request) bool { return strings.HasPrefix(r.URL.Path, "/volumecontent/") }

// ServeHTTP sends sandbox traffic to the sandbox's node and the REST API to
// its handlers.
func (g *Gateway) ServeHTTP(w http.ResponseWriter, r *http.Request) { g.handler.ServeHTTP(w, r) }

func (g *Gateway) serve(w http.ResponseWriter, r *http.Request) {
	r.Header.Del(api.HeaderRevision) // the gateway's own, never a client's
	if t, ok := proxy.ParseTarget(r, g.cfg.Domain); ok {
		// Answered as a node's proxy answers: 400 for a malformed target,
		// 502 for a sandbox no node holds.
		switch {
		case !proxy.ValidSandboxID(t.SandboxID):
			httperr.Write(w, http.StatusBadRequest, "invalid sandbox id in "+proxy.HeaderSandboxID)
		case t.Port == 0:
			httperr.Write(w, http.StatusBadRequest, "invalid "+proxy.HeaderSandboxPort+" header")
		default:
			rt, err := g.locate(r.Context(), t.SandboxID)
			if errors.Is(err, errUnknownSandbox) {
				httperr.Write(w, http.StatusBadGateway, fmt.Sprintf("sandbox %q not found", t.SandboxID))
				return
			}
			if err != nil {
				g.writeLocateError(w, t.SandboxID, err)
				return
			}
			g.proxyTo(w, r, rt.url)
		}
		return
	}
	g.mux.ServeHTTP(w, r)
}

// nodeList returns the scheduler's nodes, or the last list when the
// scheduler does not answer.
func (g *Gateway) nodeList(ctx context.Context) ([]*pb.Node, error) {
	ctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	resp, err := g.cfg.Scheduler.ListNodes(ctx, connect.NewRequest(&pb.ListNodesRequest{}))
	g.mu.Lock()
	defer g.mu.Unlock()
	if err != nil {
		if g.nodes == nil {
			return nil, fmt.Errorf("the scheduler does not answer and no node is known yet: %w", err)
		}
		g.log.Warn("scheduler unreachable; using the last node list", "err", err)
		return g.nodes, nil
	}
	g.nodes = resp.Msg.Nodes
	return g.nodes, nil
}

// readyNodes are the nodes that report.
func (g *Gateway) readyNodes(ctx context.Context) ([]*pb.Node, error) {
	all, err := g.nodeList(ctx)
	if err != nil {
		return nil, err
	}
	var out []*pb.Node
	for _, n := range all {
		if n.Status == "ready" {
			out = append(out, n)
		}
	}
	return out, nil
}

// errUnknownSandbox: no node holds the sandbox.
var errUnknownSandbox = errors.New("sandbox not found")

// errNodeLost: the sandbox's node stopped reporting. A paused sandbox
// whose state is in shared storage (shared) can move to another node.
type errNodeLost struct {
	node, state, template string
	shared                bool
}

func (e errNodeLost) Error() string {
	if e.shared {
		return fmt.Sprintf("the sandbox's node %s is lost; the sandbox is paused in shared storage: resume or connect to move it to another node", e.node)
	}
	return fmt.Sprintf("the sandbox's node %s is lost (the sandbox was %s there)", e.node, e.state)
}

// locate finds the node holding sandbox id.
func (g *Gateway) locate(ctx context.Context, id string) (route, error) {
	g.mu.Lock()
	cached, ok := g.routes[id]
	g.mu.Unlock()
	if ok && time.Since(cached.at) < g.cfg.RouteTTL {
		return cached, nil
	}
	lctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	resp, err := g.cfg.Scheduler.Locate(lctx, connect.NewRequest(&pb.LocateRequest{SandboxId: id}))
	cancel()
	switch {
	case err == nil:
		n := resp.Msg.Node
		if n.Status != "ready" {
			return route{}, errNodeLost{node: n.NodeId, state: resp.Msg.State, template: resp.Msg.TemplateId, shared: resp.Msg.Shared}
		}
		r := route{nodeID: n.NodeId, url: n.Url, at: time.Now()}
		g.remember(id, r)
		return r, nil
	case connect.CodeOf(err) == connect.CodeNotFound || connect.CodeOf(err) == connect.CodeInvalidArgument:
		// Not reported (yet): a sandbox created or resumed since the
		// node's last report is still where the gateway saw it.
		if ok && g.holds(ctx, cached.url, id) {
			g.remember(id, route{cached.nodeID, cached.url, time.Now()})
			return cached, nil
		}
		g.forget(id)
		return route{}, errUnknownSandbox
	}
	// The scheduler is down: what the gateway remembers, else the nodes it
	// knows, asked one by one.
	if ok {
		return cached, nil
	}
	g.mu.Lock()
	nodes := g.nodes
	g.mu.Unlock()
	for _, n := range nodes {
		if g.holds(ctx, n.Url, id) {
			r := route{nodeID: n.NodeId, url: n.Url, at: time.Now()}
			g.remember(id, r)
			return r, nil
		}
	}
	return route{}, fmt.Errorf("the scheduler does not answer (%v) and no known node holds the sandbox: %w", err, errUnknownSandbox)
}

// holds asks a node whether it has a sandbox.
func (g *Gateway) holds(ctx context.Context, nodeURL, id string) bool {
	ctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, nodeURL+"/sandboxes/"+url.PathEscape(id), nil)
	if err != nil {
		return false
	}
	g.asGateway(req.Header, "")
	resp, err := g.client.Do(req)
	if err != nil {
		return false
	}
	resp.Body.Close()
	return resp.StatusCode == http.StatusOK
}

func (g *Gateway) remember(id string, r route) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.routes[id] = r
	if len(g.routes) > 200000 { // bound the cache: drop the stale half
		for k, v := range g.routes {
			if time.Since(v.at) > g.cfg.RouteTTL {
				delete(g.routes, k)
			}
		}
	}
}

func (g *Gateway) forget(id string) {
	g.mu.Lock()
	defer g.mu.Unlock()
	delete(g.routes, id)
}

func (g *Gateway) writeLocateError(w http.ResponseWriter, id string, err error) {
	var lost errNodeLost
	switch {
	case errors.As(err, &lost):
		// The gateway's own words (which node, what to do), not internals.
		httperr.Write(w, http.StatusServiceUnavailable, fmt.Sprintf("sandbox %s: %v", id, err))
	case errors.Is(err, errUnknownSandbox):
		httperr.Write(w, http.StatusNotFound, fmt.Sprintf("sandbox %q not found", id))
	default:
		httperr.Internal(w, g.log, http.StatusBadGateway, "locating the sandbox failed", err)
	}
}

func (g *Gateway) proxyTo(w http.ResponseWriter, r *http.Request, nodeURL string) {
	u, err := url.Parse(nodeURL)
	if err != nil {
		httperr.Internal(w, g.log, http.StatusBadGateway, "the sandbox's node has a malformed address", err)
		return
	}
	// The node may answer (and the proxy flush its answer) before the
	// request body has all arrived: without full duplex Go's HTTP/1 server
	// would close the request body at that first flush, and the transport
	// would abort the node's connection mid-stream. (HTTP/2 is always full
	// duplex and reports ErrNotSupported, which is fine.)
	_ = http.NewResponseController(w).EnableFullDuplex()
	g.proxy.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), targetKey{}, u)))
}

// toSandboxNode proxies a REST call about one sandbox. Answers that name
// sandboxes (resume, connect, fork) teach the gateway where they are.
func (g *Gateway) toSandboxNode(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	rt, err := g.locate(r.Context(), id)
	if err != nil {
		// A paused sandbox no ready node holds may be in shared storage
		// (its node may have died before reporting it so): resuming,
		// connecting or killing it works from any node.
		var lost errNodeLost
		if (errors.As(err, &lost) || errors.Is(err, errUnknownSandbox)) && takesShared(r) {
			g.onAnyNode(w, r, lost.template, err)
			return
		}
		g.writeLocateError(w, id, err)
		return
	}
	if r.Method == http.MethodPost {
		body, err := readBody(r)
		if err != nil {
			httperr.Write(w, http.StatusRequestEntityTooLarge, err.Error())
			return
		}
		status, hdr, resp, err := g.call(r, rt.url, body)
		if err != nil {
			httperr.Internal(w, g.log, http.StatusBadGateway, fmt.Sprintf("node %s did not answer", rt.nodeID), err)
			return
		}
		if status/100 == 2 {
			g.learn(resp, rt)
		}
		copyResponse(w, status, hdr, resp)
		return
	}
	if r.Method == http.MethodDelete {
		defer g.forget(id)
	}
	g.proxyTo(w, r, rt.url)
}

// takesShared: the request can take a paused sandbox from shared storage.
func takesShared(r *http.Request) bool {
	if r.Method == http.MethodDelete {
		return r.PathValue("rest") == ""
	}
	rest := r.PathValue("rest")
	return r.Method == http.MethodPost && (rest == "resume" || rest == "connect")
}

// onAnyNode sends a request about a sandbox no ready node holds to a node
// the scheduler places it on, which takes it from shared storage or answers
// 404 (then locateErr, why no node held it, is the answer).
func (g *Gateway) onAnyNode(w http.ResponseWriter, r *http.Request, template string, locateErr error) {
	body, err := readBody(r)
	if err != nil {
		httperr.Write(w, http.StatusRequestEntityTooLarge, err.Error())
		return
	}
	pctx, cancel := context.WithTimeout(r.Context(), 3*time.Second)
	resp, err := g.cfg.Scheduler.Place(pctx, connect.NewRequest(&pb.PlaceRequest{TemplateId: template, MemoryBytes: 512 << 20}))
	cancel()
	if err != nil {
		httperr.Internal(w, g.log, http.StatusServiceUnavailable, "no node can take the sandbox now", err)
		return
	}
	n := resp.Msg.Node
	status, hdr, out, err := g.call(r, n.Url, body)
	if err != nil {
		httperr.Internal(w, g.log, http.StatusBadGateway, fmt.Sprintf("node %s did not answer", n.NodeId), err)
		return
	}
	if status/100 == 2 {
		rt := route{nodeID: n.NodeId, url: n.Url, at: time.Now()}
		g.remember(r.PathValue("id"), rt)
		g.learn(out, rt)
	}
	if r.Method == http.MethodDelete {
		g.forget(r.PathValue("id"))
	}
	if status == http.StatusNotFound {
		g.writeLocateError(w, r.PathValue("id"), locateErr)
		return
	}
	copyResponse(w, status, hdr, out)
}

// toFirstNode sends the template and volume APIs to one node (the first
// ready one by id), so a template's build, files and status, and a
// volume's record and disk, live in one place.
func (g *Gateway) toFirstNode(w http.ResponseWriter, r *http.Request) {
	if n := g.firstNode(w, r, "the template and volume API"); n != nil {
		g.proxyTo(w, r, n.Url)
	}
}

// firstNode is the first ready node by id, or nil with a 503 written for
// what needed it.
func (g *Gateway) firstNode(w http.ResponseWriter, r *http.Request, what string) *pb.Node {
	nodes, err := g.readyNodes(r.Context())
	if err != nil || len(nodes) == 0 {
		httperr.Internal(w, g.log, http.StatusServiceUnavailable, "no ready node for "+what, err)
		return nil
	}
	return nodes[0]
}

// createOnFirstNode sends a create to the node that holds the volumes.
func (g *Gateway) createOnFirstNode(w http.ResponseWriter, r *http.Request, body []byte) {
	n := g.firstNode(w, r, "a sandbox with volumes")
	if n == nil {
		return
	}
	status, hdr, out, err := g.call(r, n.Url, body)
	if err != nil {
		httperr.Internal(w, g.log, http.StatusBadGateway, "the node holding the volumes did not answer", err)
		return
	}
	if status/100 == 2 {
		g.learn(out, route{nodeID: n.NodeId, url: n.Url})
	}
	copyResponse(w, status, hdr, out)
}

// maxBody bounds the request bodies the gateway reads itself.
const maxBody = 1 << 20

func readBody(r *http.Request) ([]byte, error) {
	b, err := io.ReadAll(io.LimitReader(r.Body, maxBody+1))
	if err != nil {
		return nil, err
	}
	if len(b) > maxBody {
		return nil, fmt.Errorf("request body larger than %d bytes", maxBody)
	}
	return b, nil
}

// call sends r (with body) to a node and reads the whole answer.
func (g *Gateway) call(r *http.Request, nodeURL string, body []byte) (int, http.Header, []byte, error) {
	req, err := http.NewRequestWithContext(r.Context(), r.Method, nodeURL+r.URL.RequestURI(), bytes.NewReader(body))
	if err != nil {
		return 0, nil, nil, err
	}
	for _, h := range []string{"Content-Type", "User-Agent", httperr.Header, "Idempotency-Key", api.HeaderFindOnly, api.HeaderRevision} {
		if v := r.Header.Get(h); v != "" {
			req.Header.Set(h, v)
		}
	}
	g.asGateway(req.Header, api.ClientOf(r))
	return g.do(req, -1)
}

// do sends a request to a node and reads its answer (at most limit bytes;
// negative: all).
func (g *Gateway) do(req *http.Request, limit int64) (int, http.Header, []byte, error) {
	resp, err := g.client.Do(req)
	if err != nil {
		return 0, nil, nil, err
	}
	defer resp.Body.Close()
	var body io.Reader = resp.Body
	if limit >= 0 {
		body = io.LimitReader(resp.Body, limit)
	}
	b, err := io.ReadAll(body)
	if err != nil {
		return 0, nil, nil, err
	}
	return resp.StatusCode, resp.Header, b, nil
}

// asGateway makes a request to a node carry the node credential instead of
// the client's API key, and who the client is (api.ClientOf; "": none).
func (g *Gateway) asGateway(h http.Header, client string) {
	h.Del("X-API-Key")
	h.Del("Authorization")
	h.Del(api.HeaderClient)
	h.Set(api.HeaderNodeToken, g.cfg.NodeToken)
	if client != "" {
		h.Set(api.HeaderClient, client)
	}
}

func copyResponse(w http.ResponseWriter, status int, hdr http.Header, body []byte) {
	for _, h := range []string{"Content-Type", "X-Next-Token", "Retry-After", idempotency.ReplayedHeader} {
		if v := hdr.Get(h); v != "" {
			w.Header().Set(h, v)
		}
	}
	w.WriteHeader(status)
	w.Write(body)
}

// learn remembers the node of every sandbox an answer names.
func (g *Gateway) learn(body []byte, rt route) {
	var v any
	if json.Unmarshal(body, &v) != nil {
		return
	}
	var walk func(any)
	walk = func(v any) {
		switch x := v.(type) {
		case map[string]any:
			if id, ok := x["sandboxID"].(string); ok && id != "" {
				g.remember(id, route{rt.nodeID, rt.url, time.Now()})
			}
			for _, e := range x {
				walk(e)
			}
		case []any:
			for _, e := range x {
				walk(e)
			}
		}
	}
	walk(v)
}

// create places a new sandbox and sends the request there; a node that
// fails it for lack of room (or does not answer) is skipped and the next
// placement tried.
func (g *Gateway) create(w http.ResponseWriter, r *http.Request) {
	body, err := readBody(r)
	if err != nil {
		httperr.Write(w, http.StatusRequestEntityTooLarge, err.Error())
		return
	}
	var req struct {
		TemplateID   string            `json:"templateID"`
		CPUCount     int32             `json:"cpuCount"`
		MemoryMB     int64             `json:"memoryMB"`
		VolumeMounts []json.RawMessage `json:"volumeMounts"`
	}
	if err := json.Unmarshal(body, &req); err != nil {
		httperr.Write(w, http.StatusBadRequest, "invalid JSON body: "+err.Error())
		return
	}
	if r.URL.Path == "/sandboxes-cold" {
		// From an image: any node can convert it (placed by size alone).
		var cold struct {
			Image string `json:"image"`
		}
		if json.Unmarshal(body, &cold) != nil || cold.Image == "" {
			httperr.Write(w, http.StatusBadRequest, `field "image" is required`)
			return
		}
	} else if req.TemplateID == "" {
		httperr.Write(w, http.StatusBadRequest, "templateID is required")
		return
	}
	if len(req.VolumeMounts) > 0 {
		// The volumes' disks are the first node's (see toFirstNode): a
		// sandbox mounting them runs there.
		g.createOnFirstNode(w, r, body)
		return
	}
	// A retry of a create sent with an Idempotency-Key goes to the node
	// that made (or is making) its sandbox, which answers it from its
	// record.
	pinKey := ""
	if key := r.Header.Get("Idempotency-Key"); key != "" {
		pinKey = r.Method + " " + r.URL.Path + "\x00" + api.ClientOf(r) + "\x00" + key
		if n, ok := g.idempotent.get(pinKey); ok {
			status, hdr, out, err := g.call(r, n.url, body)
			if err == nil {
				copyResponse(w, status, hdr, out)
				return
			}
			g.log.Warn("the node of an idempotent create did not answer; placing it again", "node", n.nodeID, "err", err)
		} else if found, ok := g.findIdempotent(r, body); ok {
			if found.status/100 == 2 {
				g.idempotent.put(pinKey, route{nodeID: found.node.NodeId, url: found.node.Url})
			}
			copyResponse(w, found.status, found.hdr, found.body)
			return
		}
	}
	mem := req.MemoryMB << 20
	if mem <= 0 {
		mem = 512 << 20 // the usual template's; nodes apply the real default
	}
	var excluded []string
	var lastErr string
	// Nodes at a limit (429) send the create elsewhere; when all of them
	// were, the client gets a 429 with the soonest Retry-After.
	limited, retryAfter, limitMsg := 0, 0, ""
	for attempt := 0; attempt < 3; attempt++ {
		pctx, cancel := context.WithTimeout(r.Context(), 3*time.Second)
		resp, err := g.cfg.Scheduler.Place(pctx, connect.NewRequest(&pb.PlaceRequest{TemplateId: req.TemplateID,
			Cpus: req.CPUCount, MemoryBytes: mem, ExcludeNodes: excluded}))
		cancel()
		if err != nil {
			if attempt > 0 {
				break
			}
			status := http.StatusServiceUnavailable
			if connect.CodeOf(err) == connect.CodeResourceExhausted {
				status = http.StatusTooManyRequests
			}
			if status == http.StatusTooManyRequests {
				w.Header().Set("Retry-After", "5")
				httperr.Write(w, status, "no node can take the sandbox now: every node is full")
			} else {
				httperr.Internal(w, g.log, status, "no node can take the sandbox now", err)
			}
			return
		}
		n := resp.Msg.Node
		if pinKey != "" {
			g.idempotent.put(pinKey, route{nodeID: n.NodeId, url: n.Url})
		}
		status, hdr, out, err := g.call(r, n.Url, body)
		if err == nil && status != http.StatusServiceUnavailable && status != http.StatusInsufficientStorage &&
			status != http.StatusTooManyRequests && status < 500 {
			if status/100 == 2 {
				g.learn(out, route{nodeID: n.NodeId, url: n.Url})
			}
			copyResponse(w, status, hdr, out)
			return
		}
		if err == nil && status == http.StatusTooManyRequests {
			limited++
			if ra, perr := strconv.Atoi(hdr.Get("Retry-After")); perr == nil && ra > 0 && (retryAfter == 0 || ra < retryAfter) {
				retryAfter = ra
			}
			var e httperr.Body
			if json.Unmarshal(out, &e) == nil && e.Message != "" {
				limitMsg = fmt.Sprintf("node %s: %s", n.NodeId, e.Message)
			}
		}
		if err != nil {
			lastErr = fmt.Sprintf("node %s: %v", n.NodeId, err)
		} else {
			lastErr = fmt.Sprintf("node %s: %d %s", n.NodeId, status, bytes.TrimSpace(out))
		}
		g.log.Warn("create failed on a node; trying another", "node", n.NodeId, "err", lastErr)
		excluded = append(excluded, n.NodeId)
	}
	if limited == len(excluded) && limited > 0 {
		w.Header().Set("Retry-After", strconv.Itoa(max(retryAfter, 1)))
		httperr.Write(w, http.StatusTooManyRequests, "every node that could take the sandbox is at a limit; "+limitMsg)
		return
	}
	httperr.Internal(w, g.log, http.StatusServiceUnavailable, "the sandbox could not be created on any node", errors.New(lastErr))
}

// fanOut sends a GET to every ready node and returns their answers.
func (g *Gateway) fanOut(w http.ResponseWriter, r *http.Request) ([][]byte, []http.Header, bool) {
	replies, ok := g.toEveryNode(w, r, nil)
	if !ok {
		return nil, nil, false
	}
	bodies := make([][]byte, len(replies))
	hdrs := make([]http.Header, len(replies))
	for i, a := range replies {
		switch {
		case a.status == http.StatusOK:
			bodies[i], hdrs[i] = a.body, a.hdr
		case a.status/100 == 4:
			// A 4xx is the same on every node: pass the first on.
			copyResponse(w, a.status, a.hdr, a.body)
			return nil, nil, false
		default:
			httperr.Internal(w, g.log, http.StatusBadGateway, fmt.Sprintf("node %s did not answer", a.node.NodeId),
				fmt.Errorf("%d %s", a.status, bytes.TrimSpace(a.body)))
			return nil, nil, false
		}
	}
	return bodies, hdrs, true
}

// listed is the part of a listed sandbox the gateway sorts by.
type listed struct {
	raw       json.RawMessage
	SandboxID string    `json:"sandboxID"`
	StartedAt time.Time `json:"startedAt"`
}

func gather(bodies [][]byte) ([]listed, error) {
	var all []listed
	for _, b := range bodies {
		var items []json.RawMessage
		if err := json.Unmarshal(b, &items); err != nil {
			return nil, fmt.Errorf("a node's list: %w", err)
		}
		for _, it := range items {
			l := listed{raw: it}
			if err := json.Unmarshal(it, &l); err != nil {
				return nil, err
			}
			all = append(all, l)
		}
	}
	return all, nil
}

func writeRaw(w http.ResponseWriter, items []listed) {
	out := make([]json.RawMessage, 0, len(items))
	for _, it := range items {
		out = append(out, it.raw)
	}
	w.Header().Set("Content-Type", "application/json")
	json.NewEncoder(w).Encode(out)
}

// gatherSorted sends the request to every node and merges their lists in
// the order of api.ListBefore (newest first, or oldest first when asc).
func (g *Gateway) gatherSorted(w http.ResponseWriter, r *http.Request, asc bool) ([]listed, []http.Header, bool) {
	bodies, hdrs, ok := g.fanOut(w, r)
	if !ok {
		return nil, nil, false
	}
	all, err := gather(bodies)
	if err != nil {
		httperr.Internal(w, g.log, http.StatusBadGateway, "a node's answer was unreadable", err)
		return nil, nil, false
	}
	sort.SliceStable(all, func(i, j int) bool {
		return api.ListBefore(all[i].StartedAt, all[i].SandboxID, all[j].StartedAt, all[j].SandboxID, asc)
	})
	return all, hdrs, true
}

// listV1 gathers GET /sandboxes from every node (oldest first).
func (g *Gateway) listV1(w http.ResponseWriter, r *http.Request) {
	if all, _, ok := g.gatherSorted(w, r, true); ok {
		writeRaw(w, all)
	}
}

// listV2 gathers GET /v2/sandboxes: every node answers the same query
// (filters, order, limit, cursor); the gateway merges the pages in the
// nodes' order and cuts at the limit. The cursor is the nodes' own
// (api.ListCursor), so the next page works the same.
func (g *Gateway) listV2(w http.ResponseWriter, r *http.Request) {
	asc := r.URL.Query().Get("order") == "asc"
	all, hdrs, ok := g.gatherSorted(w, r, asc)
	if !ok {
		return
	}
	limit := 100
	fmt.Sscan(r.URL.Query().Get("limit"), &limit) // validated by the nodes
	more := false
	for _, h := range hdrs {
		if h.Get("X-Next-Token") != "" {
			more = true
		}
	}
	if len(all) > limit {
		all, more = all[:limit], true
	}
	if more && len(all) > 0 {
		last := all[len(all)-1]
		w.Header().Set("X-Next-Token", api.ListCursor(last.StartedAt, last.SandboxID, asc))
	}
	writeRaw(w, all)
}

// listSnapshots gathers the nodes' named snapshots (one entry per name).
func (g *Gateway) listSnapshots(w http.ResponseWriter, r *http.Request) {
	bodies, _, ok := g.fanOut(w, r)
	if !ok {
		return
	}
	seen := map[string]bool{}
	out := []json.RawMessage{}
	for _, b := range bodies {
		var items []json.RawMessage
		if err := json.Unmarshal(b, &items); err != nil {
			httperr.Internal(w, g.log, http.StatusBadGateway, "a node's snapshot list was unreadable", err)
			return
		}
		for _, it := range items {
			var s struct {
				Name string `json:"name"`
			}
			json.Unmarshal(it, &s)
			if s.Name != "" && seen[s.Name] {
				continue
			}
			seen[s.Name] = true
			out = append(out, it)
		}
	}
	w.Header().Set("Content-Type", "application/json")
	json.NewEncoder(w).Encode(out)
}

// deleteSnapshot deletes a named snapshot on every node that has it.
func (g *Gateway) deleteSnapshot(w http.ResponseWriter, r *http.Request) {
	nodes, err := g.readyNodes(r.Context())
	if err != nil {
		httperr.Internal(w, g.log, http.StatusServiceUnavailable, "the cluster's nodes are unavailable", err)
		return
	}
	deleted := false
	var last []byte
	lastStatus := http.StatusNotFound
	for _, n := range nodes {
		status, _, b, err := g.call(r, n.Url, nil)
		if err != nil {
			httperr.Internal(w, g.log, http.StatusBadGateway, fmt.Sprintf("node %s did not answer", n.NodeId), err)
			return
		}
		if status/100 == 2 {
			deleted = true
		} else if status != http.StatusNotFound {
			last, lastStatus = b, status
		}
	}
	switch {
	case deleted:
		w.WriteHeader(http.StatusNoContent)
	case last != nil:
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(lastStatus)
		w.Write(last)
	default:
		httperr.Write(w, http.StatusNotFound, fmt.Sprintf("snapshot %q not found", r.PathValue("name")))
	}
}

// nodeJSON is a node in GET /nodes.
func (g *Gateway) listNodes(w http.ResponseWriter, r *http.Request) {
	nodes, err := g.nodeList(r.Context())
	if err != nil {
		httperr.Internal(w, g.log, http.StatusServiceUnavailable, "the cluster's nodes are unavailable", err)
		return
	}
	out := []apispec.Node{}
	for _, n := range nodes {
		rep := n.Report
		out = append(out, apispec.Node{NodeID: n.NodeId, Url: n.Url, Status: apispec.NodeStatus(n.Status), LastSeen: time.UnixMilli(n.LastSeenUnixMs).UTC(),
			CpuCount: rep.Cpus, MemoryTotalBytes: rep.MemoryTotalBytes, MemoryAvailableBytes: rep.MemoryAvailableBytes,
			SandboxMemoryBytes: rep.SandboxMemoryBytes, DiskFreeBytes: rep.DiskFreeBytes, Running: rep.Running,
			Paused: rep.Paused, Templates: append([]string{}, rep.Templates...), Version: rep.Version})
	}
	w.Header().Set("Content-Type", "application/json")
	json.NewEncoder(w).Encode(out)
}
