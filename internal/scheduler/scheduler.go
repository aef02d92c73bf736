// Package scheduler owns cluster placement: nodes report their capacity,
// templates and sandboxes in heartbeats; the scheduler places new sandboxes
// (template already on the node first, then free capacity; fork children
// next to their parent), tells the gateway which node holds a sandbox, and
// marks nodes that stop reporting as lost. It keeps nothing but the latest
// reports, in memory: a restarted scheduler knows everything again one
// heartbeat interval later. It speaks Connect (gRPC-compatible) on HTTP.
package scheduler

import (
	"context"
	"crypto/subtle"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/url"
	"regexp"
	"sort"
	"strings"
	"sync"
	"time"

	"connectrpc.com/connect"

	pb "github.com/agentenv/agentenv/internal/scheduler/gen/schedulerpb"
	"github.com/agentenv/agentenv/internal/scheduler/gen/schedulerpb/schedulerpbconnect"
)

// Node statuses.
const (
	StatusReady = "ready"
	StatusLost  = "lost"
)

// Config configures a scheduler.
type Config struct {
	// Token is the secret nodes and gateways present (the cluster's API
	// key), as "Authorization: Bearer <token>".
	Token string
	// Interval is how often nodes are asked to report (default 2 s).
	Interval time.Duration
	// LostAfter is how long a node may stay silent before it is lost
	// (default 5 intervals).
	LostAfter time.Duration
	// ForgetAfter drops a lost node from the list (default 1 h).
	ForgetAfter time.Duration
	// MemoryOvercommit is how much guest RAM a node may promise per byte
	// of host RAM (default 1.5: idle guests return freed memory through
	// the balloon and share template pages).
	MemoryOvercommit float64
	Logger           *slog.Logger
	// Now is the clock (tests).
	Now func() time.Time
}

// Scheduler holds the latest report of every node.
type Scheduler struct {
	cfg Config
	log *slog.Logger

	mu    sync.Mutex
	nodes map[string]*nodeState
}

type nodeState struct {
	report   *pb.NodeReport
	lastSeen time.Time
	// reservations are placements made since the node last reported them.
	reservations []reservation
}

type reservation struct {
	memory int64
	at     time.Time
}

// New returns a scheduler with no nodes.
func New(cfg Config) *Scheduler {
	if cfg.Interval <= 0 {
		cfg.Interval = 2 * time.Second
	}
	if cfg.LostAfter <= 0 {
		cfg.LostAfter = 5 * cfg.Interval
	}
	if cfg.ForgetAfter <= 0 {
		cfg.ForgetAfter = time.Hour
	}
	if cfg.MemoryOvercommit <= 0 {
		cfg.MemoryOvercommit = 1.5
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	return &Scheduler{cfg: cfg, log: cfg.Logger, nodes: map[string]*nodeState{}}
}

// Handler returns the Connect route and handler of the scheduler service,
// requiring the token.
func (s *Scheduler) Handler() (string, http.Handler) {
	return schedulerpbconnect.NewSchedulerHandler(s, connect.WithInterceptors(TokenInterceptor(s.cfg.Token, false)))
}

var (
	nodeIDRE    = regexp.MustCompile(`^[a-z0-9][a-z0-9._-]{0,62}$`)
	sandboxIDRE = regexp.MustCompile(`^[a-z0-9]{1,64}$`)
	templateRE  = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$`)
)

// maxReportedSandboxes bounds one report.
const maxReportedSandboxes = 100000

// validate refuses a report that cannot be a node's.
func validate(r *pb.NodeReport) error {
	if r == nil {
		return errors.New("no node report")
	}
	if !nodeIDRE.MatchString(r.NodeId) {
		return fmt.Errorf("node_id %q: want 1-63 lower-case letters, digits, '.', '_' or '-'", r.NodeId)
	}
	u, err := url.Parse(r.Url)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" || u.RawQuery != "" || u.Fragment != "" {
		return fmt.Errorf("url %q: want http(s)://host:port of the node's API", r.Url)
	}
	for name, v := range map[string]int64{
		"cpus": int64(r.Cpus), "memory_total_bytes": r.MemoryTotalBytes, "memory_available_bytes": r.MemoryAvailableBytes,
		"sandbox_memory_bytes": r.SandboxMemoryBytes, "disk_free_bytes": r.DiskFreeBytes, "running": int64(r.Running),
		"paused": int64(r.Paused), "max_sandboxes": int64(r.MaxSandboxes),
	} {
		if v < 0 {
			return fmt.Errorf("%s is negative (%d)", name, v)
		}
	}
	if r.Cpus == 0 || r.MemoryTotalBytes == 0 {
		return errors.New("a node reports its cpus and memory_total_bytes")
	}
	if r.MemoryAvailableBytes > r.MemoryTotalBytes {
		return errors.New("memory_available_bytes exceeds memory_total_bytes")
	}
	if len(r.Sandboxes) > maxReportedSandboxes || len(r.SharedPaused) > maxReportedSandboxes || len(r.Templates) > 10000 {
		return errors.New("report too large")
	}
	for _, sb := range r.Sandboxes {
		if !sandboxIDRE.MatchString(sb.SandboxId) {
			return fmt.Errorf("sandbox id %q", sb.SandboxId)
		}
		if sb.State != "running" && sb.State != "paused" {
			return fmt.Errorf("sandbox %s: state %q (want running or paused)", sb.SandboxId, sb.State)
		}
	}
	for _, id := range r.SharedPaused {
		if !sandboxIDRE.MatchString(id) {
			return fmt.Errorf("shared paused sandbox id %q", id)
		}
	}
	for _, t := range r.Templates {
		if !templateRE.MatchString(t) {
			return fmt.Errorf("template name %q", t)
		}
	}
	return nil
}

// Heartbeat records a node's report.
func (s *Scheduler) Heartbeat(_ context.Context, req *connect.Request[pb.HeartbeatRequest]) (*connect.Response[pb.HeartbeatResponse], error) {
	r := req.Msg.Node
	if err := validate(r); err != nil {
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("bad node report: %w", err))
	}
	now := s.cfg.Now()
	s.mu.Lock()
	n, ok := s.nodes[r.NodeId]
	if !ok {
		n = &nodeState{}
		s.nodes[r.NodeId] = n
	}
	wasLost := ok && now.Sub(n.lastSeen) > s.cfg.LostAfter
	n.report, n.lastSeen = r, now
	// Placements older than one report interval (plus slack for a slow
	// create) are in this report.
	keep := n.reservations[:0]
	for _, res := range n.reservations {
		if now.Sub(res.at) < 2*s.cfg.Interval+10*time.Second {
			keep = append(keep, res)
		}
	}
	n.reservations = keep
	s.mu.Unlock()
	switch {
	case !ok:
		s.log.Info("node joined", "node", r.NodeId, "url", r.Url, "cpus", r.Cpus, "memory_mib", r.MemoryTotalBytes>>20)
	case wasLost:
		s.log.Info("node is back", "node", r.NodeId)
	}
	return connect.NewResponse(&pb.HeartbeatResponse{IntervalMs: int32(s.cfg.Interval / time.Millisecond)}), nil
}

// status of a node now. Called with mu held.
func (s *Scheduler) status(n *nodeState, now time.Time) string {
	if now.Sub(n.lastSeen) > s.cfg.LostAfter {
		return StatusLost
	}
	return StatusReady
}

func (s *Scheduler) nodeMsg(n *nodeState, now time.Time) *pb.Node {
	return &pb.Node{NodeId: n.report.NodeId, Url: n.report.Url, Status: s.status(n, now),
		LastSeenUnixMs: n.lastSeen.UnixMilli(), Report: n.report}
}

// forget drops nodes lost for longer than ForgetAfter. Called with mu held.
func (s *Scheduler) forget(now time.Time) {
	for id, n := range s.nodes {
		if now.Sub(n.lastSeen) > s.cfg.ForgetAfter {
			s.log.Info("forgetting a lost node", "node", id)
			delete(s.nodes, id)
		}
	}
}

// ErrNoCapacity is the reason a placement found no node.
var ErrNoCapacity = errors.New("no node can take the sandbox")

// Place picks a node for a new sandbox and reserves its memory there until
// the node's reports include it.
func (s *Scheduler) Place(_ context.Context, req *connect.Request[pb.PlaceRequest]) (*connect.Response[pb.PlaceResponse], error) {
	m := req.Msg
	if m.Cpus < 0 || m.MemoryBytes < 0 {
		return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("cpus and memory_bytes must not be negative"))
	}
	if m.ParentSandboxId != "" && !sandboxIDRE.MatchString(m.ParentSandboxId) {
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("parent sandbox id %q", m.ParentSandboxId))
	}
	now := s.cfg.Now()
	s.mu.Lock()
	defer s.mu.Unlock()
	s.forget(now)
	excluded := map[string]bool{}
	for _, id := range m.ExcludeNodes {
		excluded[id] = true
	}
	if m.ParentSandboxId != "" {
		n, _, _ := s.locate(m.ParentSandboxId, now)
		if n == nil {
			return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("sandbox %s is on no node", m.ParentSandboxId))
		}
		if s.status(n, now) != StatusReady {
			return nil, connect.NewError(connect.CodeUnavailable, fmt.Errorf("sandbox %s's node %s is lost", m.ParentSandboxId, n.report.NodeId))
		}
		n.reservations = append(n.reservations, reservation{m.MemoryBytes, now})
		return connect.NewResponse(&pb.PlaceResponse{Node: s.nodeMsg(n, now)}), nil
	}
	var best *nodeState
	bestScore := -1.0
	var reasons []string
	ids := make([]string, 0, len(s.nodes))
	for id := range s.nodes {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	for _, id := range ids {
		n := s.nodes[id]
		if excluded[id] || s.status(n, now) != StatusReady {
			continue
		}
		score, why := s.score(n, m)
		if score < 0 {
			reasons = append(reasons, id+": "+why)
			continue
		}
		if score > bestScore {
			best, bestScore = n, score
		}
	}
	if best == nil {
		msg := "no ready node"
		if len(reasons) > 0 {
			msg = strings.Join(reasons, "; ")
		}
		return nil, connect.NewError(connect.CodeResourceExhausted, fmt.Errorf("%w: %s", ErrNoCapacity, msg))
	}
	best.reservations = append(best.reservations, reservation{m.MemoryBytes, now})
	return connect.NewResponse(&pb.PlaceResponse{Node: s.nodeMsg(best, now)}), nil
}

// score rates a node for a placement (higher is better; negative: the
// node cannot take it, and why). Called with mu held.
func (s *Scheduler) score(n *nodeState, m *pb.PlaceRequest) (float64, string) {
	r := n.report
	var reserved int64
	for _, res := range n.reservations {
		reserved += res.memory
	}
	running := int64(r.Running) + int64(len(n.reservations))
	if r.MaxSandboxes > 0 && running >= int64(r.MaxSandboxes) {
		return -1, fmt.Sprintf("at its limit of %d sandboxes", r.MaxSandboxes)
	}
	capacity := int64(float64(r.MemoryTotalBytes) * s.cfg.MemoryOvercommit)
	free := capacity - r.SandboxMemoryBytes - reserved
	if free < m.MemoryBytes {
		return -1, fmt.Sprintf("%d MiB of guest memory free, %d MiB asked", max(free, 0)>>20, m.MemoryBytes>>20)
	}
	if r.MemoryAvailableBytes-reserved < min(m.MemoryBytes, 256<<20) {
		return -1, "host memory nearly exhausted"
	}
	score := 100 * float64(free) / float64(max(capacity, 1))
	score += 10 / float64(1+running) // spread equal nodes
	for _, t := range r.Templates {
		if t == m.TemplateId {
			score += 1000
			break
		}
	}
	return score, ""
}

// locate finds the node holding a sandbox: a ready node before a lost one,
// a running sandbox before a paused record of it. Called with mu held.
func (s *Scheduler) locate(id string, now time.Time) (*nodeState, *pb.SandboxReport, bool) {
	var best *nodeState
	var bestSB *pb.SandboxReport
	var bestState string
	var bestShared bool
	rank := func(n *nodeState, state string) int {
		r := 0
		if s.status(n, now) == StatusReady {
			r += 2
		}
		if state == "running" {
			r++
		}
		return r
	}
	for _, n := range s.nodes {
		for _, sb := range n.report.Sandboxes {
			if sb.SandboxId != id {
				continue
			}
			if best == nil || rank(n, sb.State) > rank(best, bestState) {
				best, bestState, bestSB = n, sb.State, sb
				bestShared = false
				for _, p := range n.report.SharedPaused {
					if p == id {
						bestShared = true
					}
				}
			}
		}
	}
	return best, bestSB, bestShared
}

// Locate tells which node holds a sandbox.
func (s *Scheduler) Locate(_ context.Context, req *connect.Request[pb.LocateRequest]) (*connect.Response[pb.LocateResponse], error) {
	id := req.Msg.SandboxId
	if !sandboxIDRE.MatchString(id) {
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("sandbox id %q", id))
	}
	now := s.cfg.Now()
	s.mu.Lock()
	defer s.mu.Unlock()
	n, sb, shared := s.locate(id, now)
	if n == nil {
		return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("sandbox %s is on no node", id))
	}
	return connect.NewResponse(&pb.LocateResponse{Node: s.nodeMsg(n, now), State: sb.State, Shared: shared, TemplateId: sb.TemplateId}), nil
}

// ListNodes lists the nodes by id.
func (s *Scheduler) ListNodes(_ context.Context, _ *connect.Request[pb.ListNodesRequest]) (*connect.Response[pb.ListNodesResponse], error) {
	now := s.cfg.Now()
	s.mu.Lock()
	defer s.mu.Unlock()
	s.forget(now)
	out := &pb.ListNodesResponse{}
	for _, n := range s.nodes {
		out.Nodes = append(out.Nodes, s.nodeMsg(n, now))
	}
	sort.Slice(out.Nodes, func(i, j int) bool { return out.Nodes[i].NodeId < out.Nodes[j].NodeId })
	return connect.NewResponse(out), nil
}

// TokenInterceptor checks (server side) or adds (client side) the bearer
// token of every call.
func TokenInterceptor(token string, client bool) connect.Interceptor {
	return connect.UnaryInterceptorFunc(func(next connect.UnaryFunc) connect.UnaryFunc {
		return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
			if client {
				req.Header().Set("Authorization", "Bearer "+token)
				return next(ctx, req)
			}
			got, ok := strings.CutPrefix(req.Header().Get("Authorization"), "Bearer ")
			if !ok || token == "" || subtle.ConstantTimeCompare([]byte(got), []byte(token)) != 1 {
				return nil, connect.NewError(connect.CodeUnauthenticated, errors.New("missing or wrong cluster token"))
			}
			return next(ctx, req)
		}
	})
}

// NewClient returns a client of the scheduler at baseURL.
func NewClient(httpClient connect.HTTPClient, baseURL, token string) schedulerpbconnect.SchedulerClient {
	return schedulerpbconnect.NewSchedulerClient(httpClient, strings.TrimRight(baseURL, "/"), connect.WithInterceptors(TokenInterceptor(token, true)))
}
