// Package envd is AgentENV's in-guest daemon. It owns the wire protocol that
// the official E2B SDKs speak to a sandbox on port 49983: the Connect services
// process.Process and filesystem.Filesystem (JSON and binary codecs, HTTP/1.1
// and h2c on one listener) and the plain HTTP endpoints /health, /metrics,
// /init, /envs and /files. It also owns the guest-side state those endpoints
// manage: the access token, the default user and working directory, the
// environment variables injected by the host, running processes and
// filesystem watchers.
package envd

import (
	"context"
	"crypto/subtle"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/agentenv/agentenv/internal/envd/gen/filesystempb/filesystempbconnect"
	"github.com/agentenv/agentenv/internal/envd/gen/processpb/processpbconnect"
	"github.com/agentenv/agentenv/internal/signedurl"
)

// DefaultPort is the port E2B SDKs expect envd on.
const DefaultPort = 49983

// DefaultVersion is the envd version reported when Config.Version is empty.
const DefaultVersion = "0.6.4"

// Config configures a Server.
type Config struct {
	Port        int    // default 49983
	Version     string // reported envd version, default DefaultVersion
	AccessToken string // optional initial token
	DefaultUser string // default "root" until /init says otherwise
	Logger      *slog.Logger
	// ProtectFromOOM runs envd with oom_score_adj -1000 and the processes
	// it starts at the default (see oom.go): for envd in a guest, never
	// for one inside a host's test.
	ProtectFromOOM bool
}

// Server is one envd instance. Create it with NewServer.
type Server struct {
	cfg Config
	log *slog.Logger
	// oom starts processes so they do not inherit envd's protection from
	// the OOM killer.
	oom oomGuard

	mu             sync.RWMutex
	accessToken    string
	defaultUser    string
	defaultWorkdir string
	envVars        map[string]string

	procs    *processManager
	watchers *watcherManager
	handler  http.Handler
}

// NewServer validates cfg, fills in defaults and builds the route table.
func NewServer(cfg Config) (*Server, error) {
	if cfg.Port == 0 {
		cfg.Port = DefaultPort
	}
	if cfg.Port < 0 || cfg.Port > 65535 {
		return nil, fmt.Errorf("envd: invalid port %d", cfg.Port)
	}
	if cfg.Version == "" {
		cfg.Version = DefaultVersion
	}
	if cfg.DefaultUser == "" {
		cfg.DefaultUser = "root"
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	s := &Server{
		cfg:         cfg,
		log:         cfg.Logger,
		accessToken: cfg.AccessToken,
		defaultUser: cfg.DefaultUser,
		envVars:     map[string]string{},
	}
	if cfg.ProtectFromOOM {
		g, err := protectFromOOM()
		if err != nil {
			cfg.Logger.Warn("envd runs without protection from the OOM killer", "err", err)
		}
		s.oom = g
	}
	s.procs = newProcessManager(s)
	s.watchers = newWatcherManager()

	mux := http.NewServeMux()
	procPath, procHandler := processpbconnect.NewProcessHandler(&processService{s: s})
	fsPath, fsHandler := filesystempbconnect.NewFilesystemHandler(&filesystemService{s: s})
	mux.Handle(procPath, procHandler)
	mux.Handle(fsPath, fsHandler)
	mux.HandleFunc("/health", s.handleHealth)
	mux.HandleFunc("/metrics", s.handleMetrics)
	mux.HandleFunc("/init", s.handleInit)
	mux.HandleFunc("/envs", s.handleEnvs)
	mux.HandleFunc("/files", s.handleFiles)
	mux.HandleFunc("/files/compose", s.handleCompose)
	mux.HandleFunc("/aenv/mounts", s.handleMounts)
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		writeJSONError(w, http.StatusNotFound, "not found: "+r.URL.Path)
	})

	s.handler = withCORS(s.authMiddleware(mux))
	return s, nil
}

// Version is the envd version this server reports.
func (s *Server) Version() string { return s.cfg.Version }

// Port is the configured port.
func (s *Server) Port() int { return s.cfg.Port }

// Handler returns all routes; it accepts HTTP/1.1 and cleartext HTTP/2.
func (s *Server) Handler() http.Handler { return s.handler }

// ListenAndServe serves on addr (":<Port>" when empty) until ctx is done,
// then shuts down gracefully and kills the processes it started.
func (s *Server) ListenAndServe(ctx context.Context, addr string) error {
	if addr == "" {
		addr = fmt.Sprintf(":%d", s.cfg.Port)
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	return s.Serve(ctx, ln)
}

// Serve is ListenAndServe on an existing listener.
func (s *Server) Serve(ctx context.Context, ln net.Listener) error {
	srv := &http.Server{
		Handler:           s.handler,
		ReadHeaderTimeout: 10 * time.Second,
		IdleTimeout:       5 * time.Minute,
		// No ReadTimeout/WriteTimeout: process and watch streams are long lived.
		ErrorLog: slog.NewLogLogger(s.log.Handler(), slog.LevelDebug),
	}
	// Serve cleartext HTTP/2 natively so graceful shutdown covers it; the
	// h2c wrapper in Handler still serves h2c when mounted elsewhere.
	srv.Protocols = new(http.Protocols)
	srv.Protocols.SetHTTP1(true)
	srv.Protocols.SetUnencryptedHTTP2(true)
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	s.log.Info("envd listening", "addr", ln.Addr().String(), "version", s.cfg.Version)
	select {
	case err := <-errc:
		s.Close()
		return err
	case <-ctx.Done():
	}
	// Streams would keep Shutdown waiting; end them first.
	s.Close()
	shutCtx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	err := srv.Shutdown(shutCtx)
	if errors.Is(err, context.DeadlineExceeded) {
		err = srv.Close()
	}
	if serr := <-errc; serr != nil && !errors.Is(serr, http.ErrServerClosed) && err == nil {
		err = serr
	}
	return err
}

// Close kills every process started by this server and drops all watchers.
func (s *Server) Close() {
	s.procs.killAll()
	s.watchers.closeAll()
}

func (s *Server) token() string {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.accessToken
}

// withCORS lets browser clients (the JS SDK runs in browsers too) call envd
// from any origin; authentication is by header, never by cookie.
func withCORS(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		origin := r.Header.Get("Origin")
		if origin == "" {
			next.ServeHTTP(w, r)
			return
		}
		h := w.Header()
		h.Set("Access-Control-Allow-Origin", "*")
		h.Set("Access-Control-Expose-Headers", "*")
		if r.Method == http.MethodOptions && r.Header.Get("Access-Control-Request-Method") != "" {
			h.Set("Access-Control-Allow-Methods", "GET, HEAD, POST, PUT, DELETE, OPTIONS")
			if req := r.Header.Get("Access-Control-Request-Headers"); req != "" {
				h.Set("Access-Control-Allow-Headers", req)
			} else {
				h.Set("Access-Control-Allow-Headers", "*")
			}
			h.Set("Access-Control-Max-Age", "7200")
			w.WriteHeader(http.StatusNoContent)
			return
		}
		next.ServeHTTP(w, r)
	})
}

func tokenEqual(a, b string) bool {
	return subtle.ConstantTimeCompare([]byte(a), []byte(b)) == 1
}

// authMiddleware enforces X-Access-Token on everything except /health,
// /init (which checks the token itself) and validly signed /files URLs.
func (s *Server) authMiddleware(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tok := s.token()
		if tok == "" {
			next.ServeHTTP(w, r)
			return
		}
		switch {
		case r.URL.Path == "/health", r.URL.Path == "/init":
			next.ServeHTTP(w, r)
			return
		case tokenEqual(r.Header.Get("X-Access-Token"), tok):
			next.ServeHTTP(w, r)
			return
		case r.URL.Path == "/files" && r.URL.Query().Get("signature") != "":
			if err := signedurl.Check(r, tok, time.Now()); err != nil {
				writeJSONError(w, http.StatusUnauthorized, err.Error())
				return
			}
			next.ServeHTTP(w, r)
			return
		}
		if strings.HasPrefix(r.URL.Path, "/process.") || strings.HasPrefix(r.URL.Path, "/filesystem.") {
			writeConnectUnauthenticated(w, r)
			return
		}
		writeJSONError(w, http.StatusUnauthorized, "missing or invalid access token")
	})
}
