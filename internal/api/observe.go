package api

import (
	"bufio"
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/agentenv/agentenv/internal/apispec"
	"github.com/agentenv/agentenv/internal/httperr"
	"github.com/agentenv/agentenv/internal/orchestrator"
	"github.com/agentenv/agentenv/internal/proxy"
	"github.com/agentenv/agentenv/internal/sandboxes"
)

// ConnectSandboxV1 is the older path of ConnectSandbox.
func (s *Server) ConnectSandboxV1(w http.ResponseWriter, r *http.Request, sandboxID apispec.SandboxID) {
	s.ConnectSandbox(w, r, sandboxID)
}

// ConnectSandbox implements POST /v2/sandboxes/{id}/connect:
// a running sandbox answers 200 with its Sandbox object (its timeout is
// extended, never shortened, when one is given); a paused one is resumed
// (with that timeout, or the node default) and answers 201.
func (s *Server) ConnectSandbox(w http.ResponseWriter, r *http.Request, sandboxID apispec.SandboxID) {
	id, ok := s.sandboxID(w, sandboxID)
	if !ok {
		return
	}
	secs, present, memory, err := decodeResume(r)
	if err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	opts := orchestrator.ResumeOptions{Timeout: time.Duration(secs) * time.Second, Reboot: !memory}
	sb, err := s.node.Get(r.Context(), id)
	if errors.Is(err, orchestrator.ErrNotFound) {
		// Not on this node: in a cluster it may be paused in shared
		// storage by a node that died, which resume adopts (404 if not).
		s.resume(w, r, id, opts)
		return
	}
	if err != nil {
		s.writeNodeError(w, err)
		return
	}
	switch sb.State {
	case sandboxes.Running:
	case sandboxes.Paused:
		s.resume(w, r, id, opts)
		return
	default:
		writeError(w, http.StatusConflict, fmt.Sprintf("sandbox %s is %s", id, sb.State))
		return
	}
	if present {
		if err := s.keepAlive(r.Context(), id, time.Duration(max(secs, 1))*time.Second, false); err != nil {
			s.writeNodeError(w, err)
			return
		}
	}
	writeJSON(w, http.StatusOK, s.sandboxBody(sb))
}

// PauseSandbox implements POST /sandboxes/{id}/pause {memory}: 204 when
// paused, 409 when it already is.
func (s *Server) PauseSandbox(w http.ResponseWriter, r *http.Request, sandboxID apispec.SandboxID) {
	id, ok := s.sandboxID(w, sandboxID)
	if !ok {
		return
	}
	var body struct {
		Memory *bool `json:"memory"`
		// requireHealthyGuest: a pause with memory does not ask envd;
		// one without it always needs envd to answer (it syncs the
		// guest's disks first), as E2B's does.
		RequireHealthyGuest *bool `json:"requireHealthyGuest"`
	}
	if err := decodeBody(r, &body); err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	pause := s.node.Pause
	if body.Memory != nil && !*body.Memory {
		pause = s.node.PauseFilesystem
	}
	if _, err := pause(r.Context(), id); err != nil {
		s.writeNodeError(w, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// ResumeSandbox implements E2B's older POST /sandboxes/{id}/resume
// {timeout}: 201 with the Sandbox, 409 when it is already running.
func (s *Server) ResumeSandbox(w http.ResponseWriter, r *http.Request, sandboxID apispec.SandboxID) {
	id, ok := s.sandboxID(w, sandboxID)
	if !ok {
		return
	}
	secs, _, memory, err := decodeResume(r)
	if err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	s.resume(w, r, id, orchestrator.ResumeOptions{Timeout: time.Duration(secs) * time.Second, Reboot: !memory})
}

// decodeResume reads a connect or resume body: {timeout, memory} (memory
// false: boot again from the disk, E2B's on_resume "reboot").
func decodeResume(r *http.Request) (secs int64, present, memory bool, err error) {
	var body map[string]json.RawMessage
	if err := decodeBody(r, &body); err != nil {
		return 0, false, false, err
	}
	secs, present, err = secondsField(body, "timeout", maxTimeoutSeconds)
	if err != nil {
		return 0, false, false, err
	}
	memory = true
	if raw, ok := body["memory"]; ok && string(raw) != "null" {
		if err := json.Unmarshal(raw, &memory); err != nil {
			return 0, false, false, errors.New("memory must be a boolean")
		}
	}
	return secs, present, memory, nil
}

// resume resumes a paused sandbox and answers 201 with its Sandbox object.
func (s *Server) resume(w http.ResponseWriter, r *http.Request, id string, opts orchestrator.ResumeOptions) {
	sb, err := s.node.ResumeWith(r.Context(), id, opts)
	if err != nil {
		s.writeNodeError(w, err)
		return
	}
	writeJSON(w, http.StatusCreated, s.sandboxBody(sb))
}

// forkResultJSON is one entry of E2B's fork answer: the child, or why it
// could not be made.
type forkResultJSON struct {
	Sandbox *apispec.Sandbox `json:"sandbox,omitempty"`
	Error   *Error           `json:"error,omitempty"`
}

// maxForkCount bounds one fork request (orchestrator.MaxForkChildren).
const maxForkCount = orchestrator.MaxForkChildren

// ForkSandbox implements POST /sandboxes/{id}/fork {count, timeout}: 201
// with one entry per requested child.
func (s *Server) ForkSandbox(w http.ResponseWriter, r *http.Request, sandboxID apispec.SandboxID, params apispec.ForkSandboxParams) {
	id, ok := s.sandboxID(w, sandboxID)
	if !ok {
		return
	}
	s.idempotent(w, r, "POST /sandboxes/"+id+"/fork", params.IdempotencyKey, s.forkChildren, func(w http.ResponseWriter, r *http.Request) { s.fork(w, r, id) })
}

func (s *Server) fork(w http.ResponseWriter, r *http.Request, id string) {
	var body struct {
		Count   *int64 `json:"count"`
		Timeout *int64 `json:"timeout"`
	}
	if err := decodeBody(r, &body); err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	count := int64(1)
	if body.Count != nil {
		count = *body.Count
	}
	if count < 1 || count > maxForkCount {
		writeError(w, http.StatusBadRequest, fmt.Sprintf("count must be between 1 and %d", maxForkCount))
		return
	}
	var timeout time.Duration
	if body.Timeout != nil {
		if *body.Timeout < 0 || *body.Timeout > maxTimeoutSeconds {
			writeError(w, http.StatusBadRequest, fmt.Sprintf("timeout must be between 0 and %d seconds", maxTimeoutSeconds))
			return
		}
		timeout = time.Duration(*body.Timeout) * time.Second
	}
	results, err := s.node.Fork(r.Context(), id, int(count), timeout)
	if err != nil {
		s.writeNodeError(w, err)
		return
	}
	out := make([]forkResultJSON, 0, len(results))
	for _, res := range results {
		if res.Err != nil || res.Sandbox == nil {
			e := res.Err
			if e == nil {
				e = errors.New("the child sandbox was not created")
			}
			out = append(out, forkResultJSON{Error: s.errorBody(w, e)})
			continue
		}
		b := s.sandboxBody(res.Sandbox)
		out = append(out, forkResultJSON{Sandbox: &b})
	}
	writeJSON(w, http.StatusCreated, out)
}

// forkChildren is a fork's madeAnswer: the children made, and an error for
// each the request asked for that was not.
func (s *Server) forkChildren(w http.ResponseWriter, body []byte, made []*sandboxes.Sandbox) any {
	var req struct {
		Count *int `json:"count"`
	}
	count := 1
	if json.Unmarshal(body, &req) == nil && req.Count != nil {
		count = *req.Count
	}
	out := make([]forkResultJSON, 0, max(count, len(made)))
	for _, c := range made {
		b := s.sandboxBody(c)
		out = append(out, forkResultJSON{Sandbox: &b})
	}
	for len(out) < count {
		out = append(out, forkResultJSON{Error: s.errorBody(w, errors.New("the node stopped before this child was made"))})
	}
	return out
}

// snapshotBody describes a named snapshot.
func snapshotBody(ns *orchestrator.NamedSnapshot) apispec.Snapshot {
	return apispec.Snapshot{SnapshotID: ns.Name, Names: []string{ns.Name}, SandboxID: ns.SandboxID,
		TemplateID: ns.TemplateID, CpuCount: ns.VCPUs, MemoryMB: ns.MemoryMiB, CreatedAt: ns.CreatedAt}
}

// SnapshotSandbox implements POST /sandboxes/{id}/snapshots {name}: the
// running sandbox is captured (paused briefly) and the name becomes a
// templateID for POST /sandboxes. Without a name one is generated.
func (s *Server) SnapshotSandbox(w http.ResponseWriter, r *http.Request, sandboxID apispec.SandboxID) {
	id, ok := s.sandboxID(w, sandboxID)
	if !ok {
		return
	}
	var body struct {
		Name   *string `json:"name"`
		Memory *bool   `json:"memory"`
	}
	if err := decodeBody(r, &body); err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	name := "snap-" + id
	if body.Name != nil {
		name = *body.Name
	} else {
		name += "-" + strconv.FormatInt(time.Now().UnixMilli(), 36)
	}
	snapshot := s.node.Snapshot
	if body.Memory != nil && !*body.Memory { // E2B's mode "filesystem"
		snapshot = s.node.SnapshotFilesystem
	}
	began := time.Now()
	ns, err := snapshot(r.Context(), id, name)
	if err != nil {
		s.writeNodeError(w, err)
		return
	}
	// How long the guest was stopped, apart from the whole call (which
	// ends once the snapshot is durable).
	if ns.GuestStopped > 0 {
		w.Header().Set("Server-Timing", fmt.Sprintf("guest-stopped;dur=%.1f, snapshot;dur=%.1f",
			float64(ns.GuestStopped.Microseconds())/1000, float64(time.Since(began).Microseconds())/1000))
	}
	writeJSON(w, http.StatusCreated, snapshotBody(ns))
}

// ListSnapshots implements GET /snapshots: oldest first, filtered by
// sandboxID (the source sandbox) and name, in pages of limit (default 100)
// with the next page's token in X-Next-Token.
func (s *Server) ListSnapshots(w http.ResponseWriter, r *http.Request, params apispec.ListSnapshotsParams) {
	limit, err := intParam("limit", params.Limit, 1, 1000, 100)
	if err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	var after *snapshotCursor
	if tok := deref(params.NextToken); tok != "" {
		c, ok := parseSnapshotCursor(tok)
		if !ok {
			writeError(w, http.StatusBadRequest, "invalid nextToken")
			return
		}
		after = &c
	}
	sandboxID, name := deref(params.SandboxID), deref(params.Name)
	all, err := s.node.Snapshots()
	if err != nil {
		s.writeNodeError(w, err)
		return
	}
	out := []apispec.Snapshot{}
	var last *orchestrator.NamedSnapshot
	for _, ns := range all {
		if sandboxID != "" && ns.SandboxID != sandboxID || name != "" && ns.Name != name && ns.Name+":latest" != name {
			continue
		}
		if after != nil && !after.before(ns) {
			continue
		}
		if len(out) == limit {
			w.Header().Set("X-Next-Token", snapshotCursor{last.CreatedAt.UnixNano(), last.Name}.String())
			break
		}
		out = append(out, snapshotBody(ns))
		last = ns
	}
	writeJSON(w, http.StatusOK, out)
}

// snapshotCursor is where a page of snapshots ended: the last one's
// creation time and name (the list's order).
type snapshotCursor struct {
	createdNS int64
	name      string
}

func (c snapshotCursor) String() string {
	return base64.RawURLEncoding.EncodeToString(fmt.Appendf(nil, "%d|%s", c.createdNS, c.name))
}

func parseSnapshotCursor(tok string) (snapshotCursor, bool) {
	b, err := base64.RawURLEncoding.DecodeString(tok)
	if err != nil {
		return snapshotCursor{}, false
	}
	ns, name, ok := strings.Cut(string(b), "|")
	n, err := strconv.ParseInt(ns, 10, 64)
	if !ok || err != nil || name == "" {
		return snapshotCursor{}, false
	}
	return snapshotCursor{n, name}, true
}

// before reports whether the cursor sorts before ns (ns is on a later page).
func (c snapshotCursor) before(ns *orchestrator.NamedSnapshot) bool {
	n := ns.CreatedAt.UnixNano()
	return n > c.createdNS || n == c.createdNS && ns.Name > c.name
}

// DeleteSnapshot implements DELETE /snapshots/{name}.
func (s *Server) DeleteSnapshot(w http.ResponseWriter, r *http.Request, name string) {
	if err := s.node.DeleteSnapshot(r.Context(), name); err != nil {
		s.writeNodeError(w, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// metricJSON is E2B's SandboxMetric.
type metricJSON struct {
	Timestamp     time.Time `json:"timestamp"`
	TimestampUnix int64     `json:"timestampUnix"`
	CPUCount      int       `json:"cpuCount"`
	CPUUsedPct    float64   `json:"cpuUsedPct"`
	MemUsed       uint64    `json:"memUsed"`
	MemTotal      uint64    `json:"memTotal"`
	MemCache      uint64    `json:"memCache"`
	DiskUsed      uint64    `json:"diskUsed"`
	DiskTotal     uint64    `json:"diskTotal"`
}

// envdMetrics is the body of envd's GET /metrics.
type envdMetrics struct {
	Timestamp  int64   `json:"ts"`
	CPUCount   int     `json:"cpu_count"`
	CPUUsedPct float64 `json:"cpu_used_pct"`
	MemTotal   uint64  `json:"mem_total"`
	MemUsed    uint64  `json:"mem_used"`
	MemCache   uint64  `json:"mem_cache"`
	DiskUsed   uint64  `json:"disk_used"`
	DiskTotal  uint64  `json:"disk_total"`
}

// GetSandboxMetrics implements GET /sandboxes/{id}/metrics?start=&end= (unix
// seconds). The node keeps no history: the answer is one sample read from
// the guest's envd now, or nothing when it falls outside [start, end].
func (s *Server) GetSandboxMetrics(w http.ResponseWriter, r *http.Request, sandboxID apispec.SandboxID, params apispec.GetSandboxMetricsParams) {
	id, ok := s.sandboxID(w, sandboxID)
	if !ok {
		return
	}
	start, err := intParam("start", params.Start, 0, 1<<40, -1)
	if err == nil {
		var end int64
		end, err = intParam("end", params.End, 0, 1<<40, -1)
		if err == nil && end >= 0 && start > end {
			err = errors.New("start must not be after end")
		}
		if err == nil && end >= 0 && end < time.Now().Unix() {
			writeJSON(w, http.StatusOK, []metricJSON{})
			return
		}
	}
	if err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	sb, err := s.node.Get(r.Context(), id)
	if err != nil {
		s.writeNodeError(w, err)
		return
	}
	if sb.State != sandboxes.Running {
		writeJSON(w, http.StatusOK, []metricJSON{})
		return
	}
	m, err := fetchEnvdMetrics(r.Context(), sb)
	if err != nil {
		httperr.Internal(w, s.log, http.StatusBadGateway, "reading metrics from the sandbox failed", err)
		return
	}
	ts := time.Unix(m.Timestamp, 0).UTC()
	if m.Timestamp == 0 {
		ts = time.Now().UTC().Truncate(time.Second)
	}
	writeJSON(w, http.StatusOK, []metricJSON{{
		Timestamp:     ts,
		TimestampUnix: ts.Unix(),
		CPUCount:      m.CPUCount,
		CPUUsedPct:    m.CPUUsedPct,
		MemUsed:       m.MemUsed,
		MemTotal:      m.MemTotal,
		MemCache:      m.MemCache,
		DiskUsed:      m.DiskUsed,
		DiskTotal:     m.DiskTotal,
	}})
}

// maxMetricsSandboxes bounds GET /sandboxes/metrics (as E2B's).
const maxMetricsSandboxes = 100

// GetSandboxesMetrics implements GET /sandboxes/metrics?sandbox_ids=a,b: the
// latest sample of each running sandbox named (read from its envd now);
// sandboxes that are not running, or not this node's, are left out.
func (s *Server) GetSandboxesMetrics(w http.ResponseWriter, r *http.Request, params apispec.GetSandboxesMetricsParams) {
	ids := params.SandboxIds
	if len(ids) == 0 || slices.Contains(ids, "") && len(ids) == 1 {
		writeError(w, http.StatusBadRequest, "sandbox_ids is required (comma-separated)")
		return
	}
	if len(ids) > maxMetricsSandboxes {
		writeError(w, http.StatusBadRequest, fmt.Sprintf("at most %d sandbox_ids", maxMetricsSandboxes))
		return
	}
	for _, id := range ids {
		if !proxy.ValidSandboxID(id) {
			writeError(w, http.StatusBadRequest, fmt.Sprintf("sandbox_ids: %q is not a sandbox id", truncate(id, 64)))
			return
		}
	}
	out := map[string]metricJSON{}
	for _, id := range ids {
		sb, err := s.node.Get(r.Context(), id)
		if err != nil || sb.State != sandboxes.Running {
			continue
		}
		m, err := fetchEnvdMetrics(r.Context(), sb)
		if err != nil {
			s.log.Warn("metrics of a sandbox", "sandbox", id, "err", err)
			continue
		}
		ts := time.Unix(m.Timestamp, 0).UTC()
		if m.Timestamp == 0 {
			ts = time.Now().UTC().Truncate(time.Second)
		}
		out[id] = metricJSON{Timestamp: ts, TimestampUnix: ts.Unix(), CPUCount: m.CPUCount, CPUUsedPct: m.CPUUsedPct,
			MemUsed: m.MemUsed, MemTotal: m.MemTotal, MemCache: m.MemCache, DiskUsed: m.DiskUsed, DiskTotal: m.DiskTotal}
	}
	writeJSON(w, http.StatusOK, map[string]any{"sandboxes": out})
}

// envdClient keeps no idle connections: a guest that is killed or paused
// never closes them, and they would hold goroutines and files.
var envdClient = &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}

func fetchEnvdMetrics(ctx context.Context, sb *sandboxes.Sandbox) (*envdMetrics, error) {
	if sb.EnvdAddr == "" {
		return nil, errors.New("sandbox has no address")
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+sb.EnvdAddr+"/metrics", nil)
	if err != nil {
		return nil, err
	}
	if sb.AccessToken != "" {
		req.Header.Set("X-Access-Token", sb.AccessToken)
	}
	resp, err := envdClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil {
		return nil, err
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("envd answered %d: %s", resp.StatusCode, truncate(string(bytes.TrimSpace(body)), 200))
	}
	var m envdMetrics
	if err := json.Unmarshal(body, &m); err != nil {
		return nil, fmt.Errorf("envd metrics: %w", err)
	}
	return &m, nil
}

// logsJSON is E2B's SandboxLogs.
type logsJSON struct {
	Logs       []logLineJSON  `json:"logs"`
	LogEntries []logEntryJSON `json:"logEntries"`
}

type logLineJSON struct {
	Timestamp time.Time `json:"timestamp"`
	Line      string    `json:"line"`
}

type logEntryJSON struct {
	Timestamp time.Time         `json:"timestamp"`
	Level     string            `json:"level"`
	Message   string            `json:"message"`
	Fields    map[string]string `json:"fields"`
}

const (
	maxLogBytes      = 4 << 20
	defaultLogLimit  = 1000
	maxLogLimitLines = 10000
)

// GetSandboxLogs implements GET /sandboxes/{id}/logs?start=<unix ms>&limit=:
// the guest console (kernel, init and envd output), oldest line first. The
// console has no per-line clock, so every line carries the sandbox's start
// time, and start only filters out everything when it is later than that.
func (s *Server) GetSandboxLogs(w http.ResponseWriter, r *http.Request, sandboxID apispec.SandboxID, params apispec.GetSandboxLogsParams) {
	id, ok := s.sandboxID(w, sandboxID)
	if !ok {
		return
	}
	start, err := intParam("start", params.Start, 0, 1<<53, -1)
	if err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	limit, err := intParam("limit", params.Limit, 0, maxLogLimitLines, defaultLogLimit)
	if err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	lines, ts, err := s.consoleLines(r.Context(), id)
	if err != nil {
		s.writeNodeError(w, err)
		return
	}
	out := logsJSON{Logs: []logLineJSON{}, LogEntries: []logEntryJSON{}}
	if start >= 0 && ts.UnixMilli() < start {
		writeJSON(w, http.StatusOK, out)
		return
	}
	for _, line := range lines {
		if len(out.Logs) == limit {
			break
		}
		out.Logs = append(out.Logs, logLineJSON{Timestamp: ts, Line: line})
		out.LogEntries = append(out.LogEntries, logEntryJSON{
			Timestamp: ts, Level: "info", Message: line,
			Fields: map[string]string{"source": "console"},
		})
	}
	writeJSON(w, http.StatusOK, out)
}

// consoleLines are the non-empty lines of a sandbox's guest console (at
// most maxLogBytes of it, made valid UTF-8), stamped with the sandbox's
// start (the console carries no times).
func (s *Server) consoleLines(ctx context.Context, id string) ([]string, time.Time, error) {
	sb, err := s.node.Get(ctx, id)
	if err != nil {
		return nil, time.Time{}, err
	}
	raw, err := s.node.ConsoleLog(ctx, id, maxLogBytes)
	if err != nil {
		return nil, time.Time{}, err
	}
	var lines []string
	sc := bufio.NewScanner(bytes.NewReader(raw))
	sc.Buffer(make([]byte, 64<<10), maxLogBytes)
	for sc.Scan() {
		if line := string(bytes.TrimRight(sc.Bytes(), "\r")); line != "" {
			lines = append(lines, toValidUTF8(line))
		}
	}
	return lines, sb.StartedAt.UTC(), nil
}

// GetSandboxLogsV2 implements GET /v2/sandboxes/{id}/logs: the guest
// console's lines as log entries (level info, stamped with the sandbox's
// start: the console carries no times), from cursor (Unix ms) forward or
// backward, at most limit, at level and above, containing search.
func (s *Server) GetSandboxLogsV2(w http.ResponseWriter, r *http.Request, sandboxID apispec.SandboxID, params apispec.GetSandboxLogsV2Params) {
	id, ok := s.sandboxID(w, sandboxID)
	if !ok {
		return
	}
	cursor, err := intParam("cursor", params.Cursor, 0, 1<<53, -1)
	var limit int
	if err == nil {
		limit, err = intParam("limit", params.Limit, 0, maxLogLimitLines, defaultLogLimit)
	}
	if err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	direction, minLevel, err := logQuery(string(deref(params.Direction)), string(deref(params.Level)))
	if err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	search := deref(params.Search)
	all, ts, err := s.consoleLines(r.Context(), id)
	if err != nil {
		s.writeNodeError(w, err)
		return
	}
	var lines []string
	if minLevel <= logLevels["info"] &&
		(cursor < 0 || (direction == "backward" && ts.UnixMilli() <= int64(cursor)) || (direction != "backward" && ts.UnixMilli() >= int64(cursor))) {
		for _, line := range all {
			if strings.Contains(line, search) {
				lines = append(lines, line)
			}
		}
	}
	if direction == "backward" {
		slices.Reverse(lines)
	}
	out := []logEntryJSON{}
	for _, line := range lines {
		if len(out) == limit {
			break
		}
		out = append(out, logEntryJSON{Timestamp: ts, Level: "info", Message: line, Fields: map[string]string{"source": "console"}})
	}
	writeJSON(w, http.StatusOK, map[string]any{"logs": out})
}

func toValidUTF8(s string) string {
	return string(bytes.ToValidUTF8([]byte(s), []byte("\uFFFD")))
}
