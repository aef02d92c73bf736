package api

import (
	"encoding/base64"
	"fmt"
	"net/http"
	"net/url"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/agentenv/agentenv/internal/envd"
	"github.com/agentenv/agentenv/internal/orchestrator"
)

var sandboxIDPattern = regexp.MustCompile(`^[a-z0-9]{1,64}$`)

// Limits on user-supplied maps.
const (
	maxMetadataEntries = 64
	maxMetadataBytes   = 16 << 10
	maxEnvEntries      = 256
	maxEnvBytes        = 128 << 10
	maxTimeoutSeconds  = 24 * 60 * 60
	envdVersion        = envd.DefaultVersion
)

type createSandboxRequest struct {
	TemplateID          string            `json:"templateID"`
	Timeout             *int64            `json:"timeout"`
	AutoPause           *bool             `json:"autoPause"`
	Secure              *bool             `json:"secure"`
	AllowInternetAccess *bool             `json:"allow_internet_access"`
	Metadata            map[string]string `json:"metadata"`
	EnvVars             map[string]string `json:"envVars"`
	CPUCount            *int              `json:"cpuCount"`
	MemoryMB            *int              `json:"memoryMB"`
}

// sandboxJSON is the Sandbox object of E2B's REST API.
type sandboxJSON struct {
	TemplateID         string  `json:"templateID"`
	SandboxID          string  `json:"sandboxID"`
	Alias              *string `json:"alias,omitempty"`
	ClientID           string  `json:"clientID"`
	EnvdVersion        string  `json:"envdVersion"`
	EnvdAccessToken    *string `json:"envdAccessToken,omitempty"`
	TrafficAccessToken *string `json:"trafficAccessToken,omitempty"`
	Domain             *string `json:"domain,omitempty"`
}

// sandboxDetailJSON is E2B's SandboxDetail / ListedSandbox.
type sandboxDetailJSON struct {
	TemplateID      string            `json:"templateID"`
	SandboxID       string            `json:"sandboxID"`
	Alias           *string           `json:"alias,omitempty"`
	ClientID        string            `json:"clientID"`
	StartedAt       time.Time         `json:"startedAt"`
	EndAt           time.Time         `json:"endAt"`
	CPUCount        int               `json:"cpuCount"`
	MemoryMB        int               `json:"memoryMB"`
	DiskSizeMB      int               `json:"diskSizeMB"`
	EnvdVersion     string            `json:"envdVersion"`
	EnvdAccessToken *string           `json:"envdAccessToken,omitempty"`
	Domain          *string           `json:"domain,omitempty"`
	State           string            `json:"state"`
	Metadata        map[string]string `json:"metadata"`
}

func (s *Server) domainPtr() *string {
	if s.cfg.Domain == "" {
		return nil
	}
	d := s.cfg.Domain
	return &d
}

func (s *Server) sandboxBody(sb *orchestrator.Sandbox) sandboxJSON {
	out := sandboxJSON{
		TemplateID:  sb.TemplateID,
		SandboxID:   sb.ID,
		ClientID:    "aenv",
		EnvdVersion: envdVersion,
		Domain:      s.domainPtr(),
	}
	if sb.AccessToken != "" {
		t := sb.AccessToken
		out.EnvdAccessToken = &t
	}
	if sb.TrafficToken != "" {
		t := sb.TrafficToken
		out.TrafficAccessToken = &t
	}
	return out
}

func (s *Server) detailBody(sb *orchestrator.Sandbox) sandboxDetailJSON {
	state := string(sb.State)
	if sb.State != orchestrator.StatePaused {
		state = "running"
	}
	out := sandboxDetailJSON{
		TemplateID:  sb.TemplateID,
		SandboxID:   sb.ID,
		ClientID:    "aenv",
		StartedAt:   sb.StartedAt,
		EndAt:       sb.EndAt,
		CPUCount:    sb.VCPUs,
		MemoryMB:    sb.MemoryMiB,
		DiskSizeMB:  sb.DiskMiB,
		EnvdVersion: envdVersion,
		Domain:      s.domainPtr(),
		State:       state,
		Metadata:    sb.Metadata,
	}
	if out.Metadata == nil {
		out.Metadata = map[string]string{}
	}
	if sb.AccessToken != "" {
		t := sb.AccessToken
		out.EnvdAccessToken = &t
	}
	return out
}

func checkMap(name string, m map[string]string, maxEntries, maxBytes int) error {
	if len(m) > maxEntries {
		return fmt.Errorf("%s has %d entries; at most %d are allowed", name, len(m), maxEntries)
	}
	size := 0
	for k, v := range m {
		if k == "" {
			return fmt.Errorf("%s has an empty key", name)
		}
		size += len(k) + len(v)
	}
	if size > maxBytes {
		return fmt.Errorf("%s is %d bytes; at most %d are allowed", name, size, maxBytes)
	}
	return nil
}

func (s *Server) createSandbox(w http.ResponseWriter, r *http.Request) {
	var req createSandboxRequest
	if err := decodeBody(r, &req); err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	if req.TemplateID == "" {
		writeError(w, http.StatusBadRequest, "templateID is required")
		return
	}
	if err := checkMap("metadata", req.Metadata, maxMetadataEntries, maxMetadataBytes); err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	if err := checkMap("envVars", req.EnvVars, maxEnvEntries, maxEnvBytes); err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	cr := orchestrator.CreateRequest{
		TemplateID:    req.TemplateID,
		AutoPause:     req.AutoPause == nil || *req.AutoPause,
		Secure:        req.Secure != nil && *req.Secure,
		AllowInternet: req.AllowInternetAccess,
		Metadata:      req.Metadata,
		EnvVars:       req.EnvVars,
	}
	if req.Timeout != nil {
		if *req.Timeout < 0 || *req.Timeout > maxTimeoutSeconds {
			writeError(w, http.StatusBadRequest, fmt.Sprintf("timeout must be between 0 and %d seconds", maxTimeoutSeconds))
			return
		}
		cr.Timeout = time.Duration(*req.Timeout) * time.Second
	}
	if req.CPUCount != nil {
		if *req.CPUCount < 1 {
			writeError(w, http.StatusBadRequest, "cpuCount must be at least 1")
			return
		}
		cr.VCPUs = *req.CPUCount
	}
	if req.MemoryMB != nil {
		if *req.MemoryMB < 1 {
			writeError(w, http.StatusBadRequest, "memoryMB must be positive")
			return
		}
		cr.MemoryMiB = *req.MemoryMB
	}
	sb, err := s.node.Create(r.Context(), cr)
	if err != nil {
		s.writeNodeError(w, err)
		return
	}
	writeJSON(w, http.StatusCreated, s.sandboxBody(sb))
}

func (s *Server) sandboxID(w http.ResponseWriter, r *http.Request) (string, bool) {
	id := r.PathValue("id")
	// The SDKs may send "<sandboxID>-<clientID>"; the sandbox id is the first part.
	if i := strings.IndexByte(id, '-'); i > 0 {
		id = id[:i]
	}
	if !sandboxIDPattern.MatchString(id) {
		writeError(w, http.StatusBadRequest, fmt.Sprintf("invalid sandbox id %q", r.PathValue("id")))
		return "", false
	}
	return id, true
}

func (s *Server) getSandbox(w http.ResponseWriter, r *http.Request) {
	id, ok := s.sandboxID(w, r)
	if !ok {
		return
	}
	sb, err := s.node.Get(r.Context(), id)
	if err != nil {
		s.writeNodeError(w, err)
		return
	}
	writeJSON(w, http.StatusOK, s.detailBody(sb))
}

func (s *Server) killSandbox(w http.ResponseWriter, r *http.Request) {
	id, ok := s.sandboxID(w, r)
	if !ok {
		return
	}
	if err := s.node.Kill(r.Context(), id); err != nil {
		s.writeNodeError(w, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

func (s *Server) setTimeout(w http.ResponseWriter, r *http.Request) {
	s.extend(w, r, "timeout")
}

func (s *Server) refresh(w http.ResponseWriter, r *http.Request) {
	s.extend(w, r, "duration")
}

func (s *Server) extend(w http.ResponseWriter, r *http.Request, field string) {
	id, ok := s.sandboxID(w, r)
	if !ok {
		return
	}
	var body map[string]any
	if err := decodeBody(r, &body); err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	v, present := body[field]
	secs, isNum := v.(float64)
	if !present || !isNum || secs != float64(int64(secs)) || secs < 0 || secs > maxTimeoutSeconds {
		writeError(w, http.StatusBadRequest, fmt.Sprintf("%s must be an integer number of seconds between 0 and %d", field, maxTimeoutSeconds))
		return
	}
	if secs == 0 {
		secs = 1
	}
	if _, err := s.node.SetTimeout(r.Context(), id, time.Duration(secs)*time.Second); err != nil {
		s.writeNodeError(w, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

func (s *Server) listSandboxes(w http.ResponseWriter, r *http.Request) {
	filter, err := parseMetadataFilter(r.URL.Query().Get("metadata"))
	if err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	all, err := s.node.List(r.Context())
	if err != nil {
		s.writeNodeError(w, err)
		return
	}
	out := []sandboxDetailJSON{}
	for _, sb := range all {
		if sb.State == orchestrator.StateRunning && matchMetadata(sb.Metadata, filter) {
			out = append(out, s.detailBody(sb))
		}
	}
	writeJSON(w, http.StatusOK, out)
}

// listSandboxesV2 implements GET /v2/sandboxes with state and metadata
// filters and cursor pagination (the cursor is returned in X-Next-Token).
func (s *Server) listSandboxesV2(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	filter, err := parseMetadataFilter(q.Get("metadata"))
	if err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	states := map[string]bool{}
	for _, v := range q["state"] {
		for _, st := range strings.Split(v, ",") {
			switch st {
			case "running", "paused":
				states[st] = true
			case "":
			default:
				writeError(w, http.StatusBadRequest, fmt.Sprintf("unknown state %q (want running or paused)", st))
				return
			}
		}
	}
	if len(states) == 0 {
		states["running"], states["paused"] = true, true
	}
	limit := 100
	if v := q.Get("limit"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > 1000 {
			writeError(w, http.StatusBadRequest, "limit must be an integer between 1 and 1000")
			return
		}
		limit = n
	}
	after := ""
	if tok := q.Get("nextToken"); tok != "" {
		b, err := base64.RawURLEncoding.DecodeString(tok)
		if err != nil || !validCursor(string(b)) {
			writeError(w, http.StatusBadRequest, "invalid nextToken")
			return
		}
		after = string(b)
	}
	all, err := s.node.List(r.Context())
	if err != nil {
		s.writeNodeError(w, err)
		return
	}
	// Stable order: newest first, ties by id; the cursor is "<startedAt>|<id>".
	sort.Slice(all, func(i, j int) bool {
		if !all[i].StartedAt.Equal(all[j].StartedAt) {
			return all[i].StartedAt.After(all[j].StartedAt)
		}
		return all[i].ID < all[j].ID
	})
	out := []sandboxDetailJSON{}
	var last *orchestrator.Sandbox
	more := false
	for _, sb := range all {
		d := s.detailBody(sb)
		if !states[d.State] || !matchMetadata(sb.Metadata, filter) {
			continue
		}
		if after != "" && !afterCursor(sb, after) {
			continue
		}
		if len(out) == limit {
			more = true
			break
		}
		out = append(out, d)
		last = sb
	}
	if more && last != nil {
		w.Header().Set("X-Next-Token", base64.RawURLEncoding.EncodeToString([]byte(cursorKey(last))))
	}
	writeJSON(w, http.StatusOK, out)
}

func cursorKey(sb *orchestrator.Sandbox) string {
	return fmt.Sprintf("%020d|%s", sb.StartedAt.UnixNano(), sb.ID)
}

func validCursor(c string) bool {
	parts := strings.SplitN(c, "|", 2)
	if len(parts) != 2 || !sandboxIDPattern.MatchString(parts[1]) {
		return false
	}
	_, err := strconv.ParseInt(parts[0], 10, 64)
	return err == nil
}

// afterCursor reports whether sb sorts after the cursor in newest-first order.
func afterCursor(sb *orchestrator.Sandbox, cursor string) bool {
	parts := strings.SplitN(cursor, "|", 2)
	if len(parts) != 2 {
		return false
	}
	ts, err := strconv.ParseInt(parts[0], 10, 64)
	if err != nil {
		return false
	}
	n := sb.StartedAt.UnixNano()
	return n < ts || (n == ts && sb.ID > parts[1])
}

// parseMetadataFilter parses the SDK's metadata query: a URL-encoded
// "k=v&k2=v2" string.
func parseMetadataFilter(raw string) (map[string]string, error) {
	if raw == "" {
		return nil, nil
	}
	vals, err := url.ParseQuery(raw)
	if err != nil {
		return nil, fmt.Errorf("metadata filter %q is not k=v pairs: %v", raw, err)
	}
	out := map[string]string{}
	for k, v := range vals {
		if len(v) > 0 {
			out[k] = v[len(v)-1]
		}
	}
	return out, nil
}

func matchMetadata(have, want map[string]string) bool {
	for k, v := range want {
		if have[k] != v {
			return false
		}
	}
	return true
}
