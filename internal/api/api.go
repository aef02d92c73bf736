// Package api owns the node's E2B-compatible HTTP surface: the REST API for
// sandboxes (JSON, `X-API-Key` auth, `{code,message}` errors) and the routing
// of sandbox traffic (requests carrying E2b-Sandbox-Id/E2b-Sandbox-Port
// headers, or addressed to `{port}-{sandboxID}.{domain}` hosts) to the proxy.
package api

import (
	"context"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"regexp"
	"strings"
	"time"

	"github.com/agentenv/agentenv/internal/orchestrator"
	"github.com/agentenv/agentenv/internal/proxy"
)

// APIKeyPattern is the form of API keys the E2B SDKs accept.
var APIKeyPattern = regexp.MustCompile(`^e2b_[0-9a-f]+$`)

// Node is what the API needs from the orchestrator.
type Node interface {
	Create(ctx context.Context, req orchestrator.CreateRequest) (*orchestrator.Sandbox, error)
	Get(ctx context.Context, id string) (*orchestrator.Sandbox, error)
	List(ctx context.Context) ([]*orchestrator.Sandbox, error)
	Kill(ctx context.Context, id string) error
	SetTimeout(ctx context.Context, id string, d time.Duration) (*orchestrator.Sandbox, error)
}

// Config configures the API server.
type Config struct {
	APIKey string
	// Domain is the sandbox domain reported to SDKs and matched in
	// `{port}-{id}.{domain}` hosts.
	Domain string
	// SandboxProxy serves sandbox traffic; requests are routed to it by the
	// sandbox headers or host form.
	SandboxProxy http.Handler
	Logger       *slog.Logger
}

// Server is the HTTP handler of a node's API.
type Server struct {
	cfg  Config
	node Node
	mux  *http.ServeMux
	log  *slog.Logger
}

// New builds the API handler.
func New(node Node, cfg Config) (*Server, error) {
	if !APIKeyPattern.MatchString(cfg.APIKey) {
		return nil, errors.New("api key must match e2b_<hex>")
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	s := &Server{cfg: cfg, node: node, mux: http.NewServeMux(), log: cfg.Logger}
	s.routes()
	return s, nil
}

func (s *Server) routes() {
	auth := s.requireKey
	s.mux.HandleFunc("GET /health", func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusOK) })
	s.mux.Handle("POST /sandboxes", auth(s.createSandbox))
	s.mux.Handle("GET /sandboxes", auth(s.listSandboxes))
	s.mux.Handle("GET /v2/sandboxes", auth(s.listSandboxesV2))
	s.mux.Handle("GET /sandboxes/{id}", auth(s.getSandbox))
	s.mux.Handle("DELETE /sandboxes/{id}", auth(s.killSandbox))
	s.mux.Handle("POST /sandboxes/{id}/timeout", auth(s.setTimeout))
	s.mux.Handle("POST /sandboxes/{id}/refreshes", auth(s.refresh))
	for _, p := range []string{"pause", "resume", "connect", "fork", "snapshots"} {
		s.mux.Handle("POST /sandboxes/{id}/"+p, auth(s.notYet(p)))
	}
	s.mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		writeError(w, http.StatusNotFound, fmt.Sprintf("no route for %s %s", r.Method, r.URL.Path))
	})
}

// ServeHTTP routes sandbox traffic to the proxy and everything else to the
// REST API.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if s.cfg.SandboxProxy != nil && IsSandboxRequest(r, s.cfg.Domain) {
		s.cfg.SandboxProxy.ServeHTTP(w, r)
		return
	}
	s.mux.ServeHTTP(w, r)
}

func (s *Server) requireKey(h func(http.ResponseWriter, *http.Request)) http.Handler {
	want := []byte(s.cfg.APIKey)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		got := r.Header.Get("X-API-Key")
		if got == "" {
			if a := r.Header.Get("Authorization"); len(a) > 7 && a[:7] == "Bearer " {
				got = a[7:]
			}
		}
		if got == "" {
			writeError(w, http.StatusUnauthorized, "missing API key: send it in the X-API-Key header")
			return
		}
		if subtle.ConstantTimeCompare([]byte(got), want) != 1 {
			writeError(w, http.StatusUnauthorized, "invalid API key")
			return
		}
		h(w, r)
	})
}

func (s *Server) notYet(op string) func(http.ResponseWriter, *http.Request) {
	return func(w http.ResponseWriter, r *http.Request) {
		writeError(w, http.StatusNotImplemented, op+" is not implemented on this node yet")
	}
}

// Error is the JSON body of every error response.
type Error struct {
	Code    int    `json:"code"`
	Message string `json:"message"`
}

func writeError(w http.ResponseWriter, status int, msg string) {
	writeJSON(w, status, Error{Code: status, Message: msg})
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

// writeNodeError maps orchestrator errors to statuses.
func (s *Server) writeNodeError(w http.ResponseWriter, err error) {
	status := http.StatusInternalServerError
	switch {
	case errors.Is(err, orchestrator.ErrNotFound):
		status = http.StatusNotFound
	case errors.Is(err, orchestrator.ErrInvalid):
		status = http.StatusBadRequest
	case errors.Is(err, orchestrator.ErrConflict):
		status = http.StatusConflict
	case errors.Is(err, orchestrator.ErrCapacity):
		status = http.StatusTooManyRequests
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		status = http.StatusGatewayTimeout
	}
	if status == http.StatusInternalServerError {
		s.log.Error("request failed", "err", err)
	}
	writeError(w, status, err.Error())
}

const maxBodyBytes = 1 << 20

// decodeBody reads a JSON object strictly enough to reject wrong types, and
// reports errors as user-facing messages.
func decodeBody(r *http.Request, v any) error {
	body, err := io.ReadAll(io.LimitReader(r.Body, maxBodyBytes+1))
	if err != nil {
		return fmt.Errorf("read body: %w", err)
	}
	if len(body) > maxBodyBytes {
		return fmt.Errorf("body larger than %d bytes", maxBodyBytes)
	}
	if len(body) == 0 {
		return nil
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
	host, _, _ := strings.Cut(sb.EnvdAddr, ":")
	return proxy.Route{Addr: host, Running: sb.State == orchestrator.StateRunning}, nil
}
