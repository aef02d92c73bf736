// Package api owns the node's E2B-compatible HTTP surface: the REST API for
// sandboxes (JSON, `X-API-Key` auth, `{code,message}` errors) and the routing
// of sandbox traffic (requests carrying E2b-Sandbox-Id/E2b-Sandbox-Port
// headers, or addressed to `{port}-{sandboxID}.{domain}` hosts) to the proxy.
package api

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/agentenv/agentenv/internal/admission"
	"github.com/agentenv/agentenv/internal/apikeys"
	"github.com/agentenv/agentenv/internal/buildfiles"
	"github.com/agentenv/agentenv/internal/builds"
	"github.com/agentenv/agentenv/internal/diskspace"
	"github.com/agentenv/agentenv/internal/httperr"
	"github.com/agentenv/agentenv/internal/idempotency"
	"github.com/agentenv/agentenv/internal/network"
	"github.com/agentenv/agentenv/internal/orchestrator"
	"github.com/agentenv/agentenv/internal/proxy"
	"github.com/agentenv/agentenv/internal/sandboxes"
	"github.com/agentenv/agentenv/internal/signedurl"
	"github.com/agentenv/agentenv/internal/storage/lazy"
	"github.com/agentenv/agentenv/internal/templates"
	"github.com/agentenv/agentenv/internal/volumes"
	"github.com/agentenv/agentenv/internal/webhooks"
)

// Node is what the API needs from the orchestrator: the sandboxes, their
// lifecycle, named snapshots, templates and builds, and what the node
// reports (console logs, memory, layer cache). orchestrator.Node is the
// one implementation; errors wrap the kinds of package errkind, which
// decide the status code.
type Node interface {
	Create(ctx context.Context, req orchestrator.CreateRequest) (*sandboxes.Sandbox, error)
	// CreateFromImage makes a sandbox straight from an OCI image reference.
	CreateFromImage(ctx context.Context, image string, req orchestrator.CreateRequest) (*sandboxes.Sandbox, error)
	Get(ctx context.Context, id string) (*sandboxes.Sandbox, error)
	List(ctx context.Context) ([]*sandboxes.Sandbox, error)
	// SandboxesOf lists the made sandboxes whose record names the
	// idempotent request id (idempotency.WithRequest on the create's or
	// fork's context), oldest first.
	SandboxesOf(ctx context.Context, request string) ([]*sandboxes.Sandbox, error)
	Kill(ctx context.Context, id string) error
	SetTimeout(ctx context.Context, id string, d time.Duration) (*sandboxes.Sandbox, error)
	// Pause stops a running sandbox and keeps it on disk (PauseFilesystem:
	// its disk only); ResumeWith brings it back.
	Pause(ctx context.Context, id string) (*sandboxes.Sandbox, error)
	PauseFilesystem(ctx context.Context, id string) (*sandboxes.Sandbox, error)
	ResumeWith(ctx context.Context, id string, opts orchestrator.ResumeOptions) (*sandboxes.Sandbox, error)
	// Fork clones a running sandbox into count children (timeout 0: the
	// node default).
	Fork(ctx context.Context, id string, count int, timeout time.Duration) ([]orchestrator.ForkResult, error)
	// SetNetwork replaces what a sandbox's guest may reach.
	SetNetwork(ctx context.Context, id string, internet bool, egress network.Egress) (*sandboxes.Sandbox, error)
	Snapshot(ctx context.Context, id, name string) (*orchestrator.NamedSnapshot, error)
	// SnapshotFilesystem snapshots a running sandbox's filesystem alone.
	SnapshotFilesystem(ctx context.Context, id, name string) (*orchestrator.NamedSnapshot, error)
	Snapshots() ([]*orchestrator.NamedSnapshot, error)
	DeleteSnapshot(ctx context.Context, name string) error
	// ConsoleLog returns at most the last maxBytes of a sandbox's guest
	// console (kernel, init and envd output).
	ConsoleLog(ctx context.Context, id string, maxBytes int64) ([]byte, error)
	// The E2B template API: POST /v3/templates, file uploads, POST
	// /v2/templates/{id}/builds/{build}, status polling, deletion.
	RequestBuild(name string, tags []string, vcpus, memMiB int) (*builds.Record, error)
	StartBuild(templateID, buildID string, spec builds.Spec) error
	Build(templateID, buildID string) (*builds.Record, error)
	// TemplateBuilds lists a template's builds, newest first.
	TemplateBuilds(templateID string) ([]*builds.Record, error)
	Template(name string) (*orchestrator.Template, error)
	Templates() ([]*orchestrator.Template, error)
	DeleteTemplate(ctx context.Context, name string) error
	// Catalog is the node's templates, whose tags the template tag routes
	// read and change.
	Catalog() *templates.Catalog
	DataDir() string
	BuildFiles() *buildfiles.Store
	// DiskRoom refuses what (e.g. "an upload") while the node's disk is
	// below its floor of free space (an errkind.ErrNoSpace).
	DiskRoom(what string) error
	Memory(ctx context.Context) (*orchestrator.NodeMemory, error)
	// Client leases: the node's, one, renewed, ended (its sandboxes killed).
	Leases(ctx context.Context) ([]*orchestrator.LeaseInfo, error)
	Lease(ctx context.Context, id string) (*orchestrator.LeaseInfo, error)
	RenewLease(ctx context.Context, id string, ttl time.Duration) (*orchestrator.LeaseInfo, error)
	EndLease(ctx context.Context, id string) ([]string, error)
	LayerCacheStats() lazy.CacheStats
}

// Config configures the API server.
type Config struct {
	// Keys checks the keys clients present (the node's named keys,
	// package apikeys). APIKey, or APIKeySHA256 its SHA-256, is one more
	// key accepted besides (a cluster's shared key, AENV_API_KEY). At
	// least one of them is required.
	Keys         KeyChecker
	APIKey       string
	APIKeySHA256 [32]byte
	// NodeToken, when set, is the cluster's node credential: a request
	// presenting it in HeaderNodeToken (the gateway's) needs no API key.
	NodeToken string
	// Domain is the sandbox domain reported to SDKs and matched in
	// `{port}-{id}.{domain}` hosts.
	Domain string
	// SandboxProxy serves sandbox traffic; requests are routed to it by the
	// sandbox headers or host form.
	SandboxProxy http.Handler
	// PeerChunks, when set, serves cached layer chunks to neighbour nodes
	// (GET /v1/chunks/{sum}; it checks the peer token itself).
	PeerChunks http.Handler
	// Volumes, when set, are the node's volumes (the /volumes and
	// /volumecontent routes; without it they answer 404).
	Volumes *volumes.Store
	// Idempotency, when set, keeps the answers of creates and forks sent
	// with an Idempotency-Key (without it the header is ignored).
	Idempotency *idempotency.Store
	// Webhooks, when set, are the node's webhooks for lifecycle events
	// (without it the /events/webhooks routes answer 404).
	Webhooks *webhooks.Store
	Logger   *slog.Logger
}

// Server is the HTTP handler of a node's API.
type Server struct {
	cfg      Config
	node     Node
	mux      *http.ServeMux
	patterns []string // the patterns registered on mux (Routes)
	log      *slog.Logger
	handler  http.Handler // serve, with request ids
	metrics  http.Handler // GET /metrics: the node's Prometheus registry
	// uploadKey signs build-file upload links (valid while this process
	// runs).
	uploadKey []byte
}

// Routes are the patterns the server serves, "METHOD /path/{param}".
func (s *Server) Routes() []string { return slices.Clone(s.patterns) }

// HeaderNodeToken carries the cluster's node credential (gateway → node).
const HeaderNodeToken = "X-Aenv-Node-Token"

// HeaderRevision carries the revision the gateway gives a change of a
// webhook it makes on every node (webhooks.Record); a node takes it only
// with its node token.
const HeaderRevision = "X-Aenv-Revision"

// KeyChecker says whether a key a client presents is one of the node's
// (and which: its name).
type KeyChecker interface {
	Check(ctx context.Context, key string) (name string, ok bool, err error)
}

// New builds the API handler.
func New(node Node, cfg Config) (*Server, error) {
	switch {
	case cfg.APIKey != "":
		if !apikeys.Pattern.MatchString(cfg.APIKey) {
			return nil, errors.New("api key must match e2b_<hex>")
		}
		cfg.APIKeySHA256 = sha256.Sum256([]byte(cfg.APIKey))
		cfg.APIKey = "" // only the hash is kept
	case cfg.APIKeySHA256 == [32]byte{} && cfg.Keys == nil:
		return nil, errors.New("no API key")
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	s := &Server{cfg: cfg, node: node, mux: http.NewServeMux(), log: cfg.Logger, uploadKey: make([]byte, 32)}
	if _, err := rand.Read(s.uploadKey); err != nil {
		return nil, err
	}
	s.metrics = s.nodeMetrics()
	if err := s.routes(); err != nil {
		return nil, err
	}
	s.handler = httperr.WithIDs(http.HandlerFunc(s.serve))
	return s, nil
}

// GetHealth answers GET /health: the API is up.
func (s *Server) GetHealth(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusOK) }

// GetOpenapiYml serves the OpenAPI document.
func (s *Server) GetOpenapiYml(w http.ResponseWriter, r *http.Request) { ServeOpenAPI(w, r) }

// ListNodes answers GET /nodes, which the gateway serves, not a node.
func (s *Server) ListNodes(w http.ResponseWriter, r *http.Request) {
	writeError(w, http.StatusNotFound, "GET /nodes is served by the gateway (aenv gateway), not by a node")
}

// GetPeerChunk serves a cached layer chunk to a neighbour node, when the
// node exchanges chunks with peers (the handler checks the peer token).
func (s *Server) GetPeerChunk(w http.ResponseWriter, r *http.Request, sum string) {
	if s.cfg.PeerChunks == nil {
		writeError(w, http.StatusNotFound, "this node exchanges no layer chunks with peers")
		return
	}
	s.cfg.PeerChunks.ServeHTTP(w, r)
}

// ServeHTTP routes sandbox traffic to the proxy and everything else to the
// REST API.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) { s.handler.ServeHTTP(w, r) }

func (s *Server) serve(w http.ResponseWriter, r *http.Request) {
	if s.cfg.SandboxProxy != nil && IsSandboxRequest(r, s.cfg.Domain) {
		s.cfg.SandboxProxy.ServeHTTP(w, r)
		return
	}
	if s.cfg.SandboxProxy != nil && r.URL.Path == "/files" {
		s.signedFile(w, r)
		return
	}
	if s.findOnly(w, r) {
		return
	}
	s.mux.ServeHTTP(w, r)
}

// signedFile routes a pre-signed /files URL that names no sandbox (the SDK
// builds those from E2B_SANDBOX_URL alone) to the secure sandbox whose
// access token signed it.
func (s *Server) signedFile(w http.ResponseWriter, r *http.Request) {
	if r.URL.Query().Get("signature") == "" {
		writeError(w, http.StatusNotFound, "GET/POST /files is envd's: address a sandbox with the "+
			proxy.HeaderSandboxID+"/"+proxy.HeaderSandboxPort+" headers or a {port}-{sandboxID}.{domain} host, or use a signed URL")
		return
	}
	all, err := s.node.List(r.Context())
	if err != nil {
		s.writeNodeError(w, err)
		return
	}
	now := time.Now()
	for _, sb := range all {
		if sb.State != sandboxes.Running || sb.AccessToken == "" {
			continue
		}
		switch err := proxy.FileSignatureError(r, sb.AccessToken, now); {
		case err == nil:
			r2 := r.Clone(r.Context())
			r2.Header.Set(proxy.HeaderSandboxID, sb.ID)
			r2.Header.Set(proxy.HeaderSandboxPort, fmt.Sprint(orchestrator.EnvdPort))
			s.cfg.SandboxProxy.ServeHTTP(w, r2)
			return
		case errors.Is(err, signedurl.ErrExpired):
			writeError(w, http.StatusUnauthorized, err.Error())
			return
		}
	}
	// Signed by no running sandbox: tampered with, or its sandbox is gone.
	writeError(w, http.StatusUnauthorized, signedurl.ErrInvalid.Error())
}

// requireNodeToken wraps h with the check of the node token: 401 without
// it, 404 on a node that has none (it is in no cluster).
func (s *Server) requireNodeToken(h func(http.ResponseWriter, *http.Request)) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch {
		case s.cfg.NodeToken == "":
			writeError(w, http.StatusNotFound, "this node is in no cluster (it has no node token)")
		case !s.fromGateway(r):
			writeError(w, http.StatusUnauthorized, "missing or invalid node token: send the cluster's in the "+HeaderNodeToken+" header")
		default:
			h(w, r)
		}
	})
}

func (s *Server) requireKey(h func(http.ResponseWriter, *http.Request)) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get(HeaderNodeToken) != "" && s.cfg.NodeToken != "" {
			if s.fromGateway(r) {
				h(w, r)
				return
			}
			writeError(w, http.StatusUnauthorized, "invalid node token")
			return
		}
		ClientKeys{Shared: s.cfg.APIKeySHA256, Named: s.cfg.Keys, Log: s.log}.Require(h).ServeHTTP(w, r)
	})
}

// ClientKeys are the keys an endpoint accepts from clients: one shared key
// (by its SHA-256; zero: none) and named keys (nil: none).
type ClientKeys struct {
	Shared [32]byte
	Named  KeyChecker
	Log    *slog.Logger
}

// Require wraps h with the client key check (X-API-Key or a bearer token;
// 401 {code, message} without a known one), in constant time per key.
func (c ClientKeys) Require(h func(http.ResponseWriter, *http.Request)) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		got := presentedKey(r)
		if got == "" {
			writeError(w, http.StatusUnauthorized, "missing API key: send it in the X-API-Key header")
			return
		}
		if c.Shared != ([32]byte{}) {
			sum := sha256.Sum256([]byte(got))
			if subtle.ConstantTimeCompare(sum[:], c.Shared[:]) == 1 {
				h(w, r)
				return
			}
		}
		if c.Named != nil {
			_, ok, err := c.Named.Check(r.Context(), got)
			if err != nil {
				log := c.Log
				if log == nil {
					log = slog.Default()
				}
				httperr.Internal(w, log, http.StatusInternalServerError, "checking the API key failed", err)
				return
			}
			if ok {
				h(w, r)
				return
			}
		}
		writeError(w, http.StatusUnauthorized, "invalid API key")
	})
}

// presentedKey is the API key of a request: X-API-Key, or a bearer token.
func presentedKey(r *http.Request) string {
	if k := r.Header.Get("X-API-Key"); k != "" {
		return k
	}
	if a := r.Header.Get("Authorization"); len(a) > 7 && a[:7] == "Bearer " {
		return a[7:]
	}
	return ""
}

// Error is the JSON body of every error response.
type Error = httperr.Body

func writeError(w http.ResponseWriter, status int, msg string) { httperr.Write(w, status, msg) }

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

// writeNodeError maps orchestrator errors to statuses. A failure of the
// node's own (5xx) is logged under the request id, which is all its answer
// says besides its kind; a refusal (4xx) says why, in words that never name
// the node's data dir.
func (s *Server) writeNodeError(w http.ResponseWriter, err error) {
	switch status := httperr.StatusOf(err); {
	case status == http.StatusGatewayTimeout:
		httperr.Internal(w, s.log, status, "the operation did not finish in time", err)
	case status == http.StatusInsufficientStorage:
		msg := "the node's disk is full; free space on the node or use another node"
		var short *diskspace.Shortage
		if errors.As(err, &short) {
			msg = short.Error()
		}
		httperr.Internal(w, s.log, status, msg, err)
	case status >= 500:
		httperr.Internal(w, s.log, status, "internal error", err)
	default:
		if r, ok := admission.IsRefusal(err); ok {
			w.Header().Set("Retry-After", strconv.Itoa(r.RetryAfterSeconds()))
		}
		writeError(w, status, s.scrub(err.Error()))
	}
}

// errorBody is the error body for err inside a 2xx answer (a fork child
// that failed), by writeNodeError's rules: a failure of the node's own is
// logged under the request id, which is all the body says besides its kind.
func (s *Server) errorBody(w http.ResponseWriter, err error) *Error {
	status := httperr.StatusOf(err)
	if status < 500 {
		return &Error{Code: status, Message: s.scrub(err.Error())}
	}
	id := httperr.ID(w)
	s.log.Error("internal error", "request", id, "status", status, "err", err)
	return &Error{Code: status, Message: fmt.Sprintf("internal error (request id %s; the server's log has the details)", id)}
}

// scrub replaces the node's data dir in a message shown to a client.
func (s *Server) scrub(msg string) string {
	if dir := s.node.DataDir(); dir != "" && dir != "/" {
		msg = strings.ReplaceAll(msg, strings.TrimSuffix(dir, "/"), "<data dir>")
	}
	return msg
}

const maxBodyBytes = 1 << 20

var errBodyTooLarge = fmt.Errorf("body larger than %d bytes", maxBodyBytes)

// decodeBody reads a JSON object strictly enough to reject wrong types, and
// reports errors as user-facing messages.
func decodeBody(r *http.Request, v any) error {
	body, err := readBody(r)
	if err != nil {
		return fmt.Errorf("read body: %w", err)
	}
	if len(body) == 0 {
		return nil
	}
	if t := bytes.TrimSpace(body); len(t) > 0 && t[0] != '{' {
		// null, a list or a scalar: every body of this API is an object.
		return errors.New("the body must be a JSON object")
	}
	if err := json.Unmarshal(body, v); err != nil {
		var te *json.UnmarshalTypeError
		if errors.As(err, &te) {
			return fmt.Errorf("field %q must be %s, not %s", te.Field, te.Type, te.Value)
		}
		return fmt.Errorf("malformed JSON body: %v", err)
	}
	return nil
}

// IsSandboxRequest reports whether r is sandbox traffic rather than a REST call.
func IsSandboxRequest(r *http.Request, domain string) bool {
	_, ok := proxy.ParseTarget(r, domain)
	return ok
}

// Resolver adapts a Node to the proxy's view of sandboxes.
type Resolver struct{ Node Node }

// Route implements proxy.Resolver.
func (res Resolver) Route(ctx context.Context, id string) (proxy.Route, error) {
	sb, err := res.Node.Get(ctx, id)
	if errors.Is(err, orchestrator.ErrNotFound) {
		return proxy.Route{}, proxy.ErrUnknownSandbox
	}
	if err != nil {
		return proxy.Route{}, err
	}
	return routeOf(sb), nil
}

// routeOf is the proxy's view of a sandbox: the traffic token is enforced
// only for sandboxes created without public traffic.
func routeOf(sb *sandboxes.Sandbox) proxy.Route {
	host, _, _ := strings.Cut(sb.EnvdAddr, ":")
	r := proxy.Route{
		Addr:            host,
		Running:         sb.State == sandboxes.Running,
		AccessToken:     sb.AccessToken,
		AutoResume:      sb.AutoResume,
		MaskRequestHost: sb.MaskRequestHost,
	}
	if !sb.PublicTraffic {
		r.TrafficToken = sb.TrafficToken
	}
	return r
}

// Resume implements proxy.Resumer with the node's Resume (node default
// timeout); a sandbox some other request resumed first is fine.
func (res Resolver) Resume(ctx context.Context, id string) (proxy.Route, error) {
	sb, err := res.Node.ResumeWith(ctx, id, orchestrator.ResumeOptions{Auto: true})
	if errors.Is(err, orchestrator.ErrConflict) {
		sb, err = res.Node.Get(ctx, id)
	}
	if err != nil {
		return proxy.Route{}, err
	}
	return routeOf(sb), nil
}
