package api

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"golang.org/x/net/idna"

	"github.com/agentenv/agentenv/internal/apispec"
	"github.com/agentenv/agentenv/internal/errkind"
	"github.com/agentenv/agentenv/internal/leases"
	"github.com/agentenv/agentenv/internal/network"
	"github.com/agentenv/agentenv/internal/orchestrator"
	"github.com/agentenv/agentenv/internal/sandboxes"
	"github.com/agentenv/agentenv/internal/volumes"
)

var (
	sandboxIDPattern = regexp.MustCompile(`^[a-z0-9]{1,64}$`)
	// sandboxPathPattern is a sandbox id in a path, as the document has it.
	sandboxPathPattern = regexp.MustCompile(`^[a-z0-9]{1,64}(-[a-z0-9]+)?$`)
	templateIDPattern  = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._:/-]*$`)
	envNamePattern     = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)
)

// Limits on user-supplied maps.
const (
	maxMetadataEntries = 64
	maxMetadataBytes   = 16 << 10
	maxEnvEntries      = 256
	maxEnvBytes        = 128 << 10
	maxTimeoutSeconds  = 24 * 60 * 60
	maxRefreshSeconds  = 60 * 60
	// defaultRefreshSeconds applies to a refresh without a duration.
	defaultRefreshSeconds = 60
)

// createSandboxRequest is E2B's NewSandbox. Fields we do not act on are
// still typed, so a value of the wrong type is rejected rather than ignored.
type createSandboxRequest struct {
	TemplateID          string            `json:"templateID"`
	Timeout             *int64            `json:"timeout"`
	AutoPause           *bool             `json:"autoPause"`
	AutoPauseMemory     *bool             `json:"autoPauseMemory"`
	AutoResume          *autoResumeJSON   `json:"autoResume"`
	Secure              *bool             `json:"secure"`
	AllowInternetAccess *bool             `json:"allow_internet_access"`
	Network             *networkJSON      `json:"network"`
	Metadata            map[string]string `json:"metadata"`
	EnvVars             map[string]string `json:"envVars"`
	MCP                 map[string]any    `json:"mcp"`
	IAM                 *iamJSON          `json:"iam"`
	VolumeMounts        []volumeMountJSON `json:"volumeMounts"`
	CPUCount            *int              `json:"cpuCount"`
	MemoryMB            *int              `json:"memoryMB"`
	Lease               *leaseJSON        `json:"lease"`
}

// leaseJSON binds a create to a client lease (AgentENV's).
type leaseJSON struct {
	ID  string `json:"id"`
	TTL *int64 `json:"ttl"`
}

type autoResumeJSON struct {
	Enabled bool `json:"enabled"`
}

// networkJSON is E2B's SandboxNetworkConfig.
type networkJSON struct {
	AllowOut           []string        `json:"allowOut"`
	DenyOut            []string        `json:"denyOut"`
	DNSServers         []string        `json:"dnsServers"`
	AllowPublicTraffic *bool           `json:"allowPublicTraffic"`
	MaskRequestHost    *string         `json:"maskRequestHost"`
	HTTPSPorts         []int           `json:"httpsPorts"`
	Rules              map[string]any  `json:"rules"`
	EgressProxy        *map[string]any `json:"egressProxy"`
}

type iamJSON struct {
	Tokens map[string]map[string]any `json:"tokens"`
}

type volumeMountJSON struct {
	Name string `json:"name"`
	Path string `json:"path"`
}

func (s *Server) domainPtr() *string {
	if s.cfg.Domain == "" {
		return nil
	}
	d := s.cfg.Domain
	return &d
}

func (s *Server) sandboxBody(sb *sandboxes.Sandbox) apispec.Sandbox {
	out := apispec.Sandbox{
		TemplateID:  sb.TemplateID,
		SandboxID:   sb.ID,
		ClientID:    "aenv",
		EnvdVersion: sb.EnvdVersion,
		Domain:      s.domainPtr(),
	}
	if sb.AccessToken != "" {
		t := sb.AccessToken
		out.EnvdAccessToken = &t
	}
	// trafficAccessToken is handed out (and enforced by the proxy) only for
	// sandboxes without public traffic: see routeOf.
	if !sb.PublicTraffic && sb.TrafficToken != "" {
		t := sb.TrafficToken
		out.TrafficAccessToken = &t
	}
	return out
}

// listedBody is a sandbox as the listings describe it.
func listedBody(sb *sandboxes.Sandbox) apispec.ListedSandbox {
	state := apispec.ListedSandboxState(sb.State)
	if sb.State != sandboxes.Paused {
		state = "running"
	}
	out := apispec.ListedSandbox{
		TemplateID:  sb.TemplateID,
		SandboxID:   sb.ID,
		ClientID:    "aenv",
		StartedAt:   sb.StartedAt,
		EndAt:       sb.EndAt,
		CpuCount:    sb.VCPUs,
		MemoryMB:    sb.MemoryMiB,
		DiskSizeMB:  sb.DiskMiB,
		EnvdVersion: sb.EnvdVersion,
		State:       state,
		Metadata:    sb.Metadata,
		Network:     networkBody(sb),
		Lifecycle:   &apispec.SandboxLifecycle{OnTimeout: "kill", AutoResume: sb.AutoResume},
	}
	if out.Metadata == nil {
		out.Metadata = map[string]string{}
	}
	internet := sb.AllowInternet
	out.AllowInternetAccess = &internet
	if sb.AutoPause {
		out.Lifecycle.OnTimeout = "pause"
	}
	if len(sb.Volumes) > 0 {
		mounts := make([]apispec.SandboxVolumeMount, len(sb.Volumes))
		for i, v := range sb.Volumes {
			mounts[i] = apispec.SandboxVolumeMount{Name: v.Name, Path: v.Path}
		}
		out.VolumeMounts = &mounts
	}
	return out
}

// detailBody is a sandbox as GET /sandboxes/{id} describes it: as listed,
// with its envd token and domain.
func (s *Server) detailBody(sb *sandboxes.Sandbox) apispec.SandboxDetail {
	l := listedBody(sb)
	out := apispec.SandboxDetail{
		TemplateID: l.TemplateID, SandboxID: l.SandboxID, Alias: l.Alias, ClientID: l.ClientID,
		StartedAt: l.StartedAt, EndAt: l.EndAt, CpuCount: l.CpuCount, MemoryMB: l.MemoryMB, DiskSizeMB: l.DiskSizeMB,
		EnvdVersion: l.EnvdVersion, State: apispec.SandboxDetailState(l.State), Metadata: l.Metadata,
		AllowInternetAccess: l.AllowInternetAccess, Network: l.Network, Lifecycle: l.Lifecycle,
		VolumeMounts: l.VolumeMounts, Domain: s.domainPtr(),
	}
	if sb.AccessToken != "" {
		t := sb.AccessToken
		out.EnvdAccessToken = &t
	}
	if sb.State == sandboxes.Paused && sb.PauseMode != "" {
		m := apispec.SandboxDetailPauseMode(sb.PauseMode)
		out.PauseMode = &m
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

// toCreateRequest validates a decoded NewSandbox and turns it into the
// orchestrator's request. secureDefault applies when "secure" is absent.
func (req *createSandboxRequest) toCreateRequest(secureDefault bool) (orchestrator.CreateRequest, error) {
	var cr orchestrator.CreateRequest
	if req.TemplateID == "" {
		return cr, errors.New("templateID is required")
	}
	if len(req.TemplateID) > 128 || !templateIDPattern.MatchString(req.TemplateID) {
		return cr, fmt.Errorf("invalid templateID %q", truncate(req.TemplateID, 64))
	}
	if _, ok := req.Metadata[sandboxes.MetaInternal]; ok {
		return cr, fmt.Errorf("metadata key %q is reserved for the node's own sandboxes", sandboxes.MetaInternal)
	}
	if err := checkMap("metadata", req.Metadata, maxMetadataEntries, maxMetadataBytes); err != nil {
		return cr, err
	}
	if err := checkMap("envVars", req.EnvVars, maxEnvEntries, maxEnvBytes); err != nil {
		return cr, err
	}
	for k := range req.EnvVars {
		if !envNamePattern.MatchString(k) {
			return cr, fmt.Errorf("envVars key %q is not a valid environment variable name", truncate(k, 64))
		}
	}
	// mcp is taken and left to the SDK, as E2B's API does: the SDK starts
	// the template's mcp-gateway in the sandbox after the create (and
	// kills the sandbox with an error when the template has none).
	for i, m := range req.VolumeMounts {
		if err := volumes.ValidName(m.Name); err != nil {
			return cr, fmt.Errorf("volumeMounts[%d].name: %v", i, err)
		}
		if m.Path == "" {
			return cr, fmt.Errorf("volumeMounts[%d].path is required", i)
		}
	}
	if req.IAM != nil && len(req.IAM.Tokens) > 0 {
		return cr, errors.New("iam tokens are not supported on this node")
	}
	fsPause := req.AutoPauseMemory != nil && !*req.AutoPauseMemory
	if fsPause && req.AutoResume != nil && req.AutoResume.Enabled {
		return cr, errors.New("autoPauseMemory false (lifecycle mode filesystem) cannot be combined with autoResume: traffic does not reboot a sandbox")
	}
	cr = orchestrator.CreateRequest{
		TemplateID:          req.TemplateID,
		AutoPause:           req.AutoPause == nil || *req.AutoPause,
		AutoPauseFilesystem: fsPause,
		Secure:              secureDefault,
		AllowInternet:       req.AllowInternetAccess,
		Metadata:            req.Metadata,
		EnvVars:             req.EnvVars,
		AutoResume:          req.AutoResume != nil && req.AutoResume.Enabled,
	}
	if req.Secure != nil {
		cr.Secure = *req.Secure
	}
	if l := req.Lease; l != nil {
		ttl := time.Duration(deref(l.TTL)) * time.Second
		if _, err := leases.Check(l.ID, ttl); err != nil {
			return cr, err
		}
		cr.Lease = &orchestrator.LeaseRequest{ID: l.ID, TTL: ttl}
	}
	if n := req.Network; n != nil {
		internet, egress, err := n.egress(req.AllowInternetAccess)
		if err != nil {
			return cr, err
		}
		cr.AllowInternet, cr.Egress = internet, egress
		if n.AllowPublicTraffic != nil && !*n.AllowPublicTraffic {
			cr.PrivateTraffic = true
		}
		if len(n.HTTPSPorts) > 0 || len(n.Rules) > 0 || (n.EgressProxy != nil && *n.EgressProxy != nil) {
			return cr, errors.New("network.httpsPorts, rules and egressProxy are not supported on this node")
		}
		if n.MaskRequestHost != nil {
			mask, err := maskRequestHost(*n.MaskRequestHost)
			if err != nil {
				return cr, err
			}
			cr.MaskRequestHost = mask
		}
	}
	if req.Timeout != nil {
		if *req.Timeout < 0 || *req.Timeout > maxTimeoutSeconds {
			return cr, fmt.Errorf("timeout must be between 0 and %d seconds", maxTimeoutSeconds)
		}
		cr.Timeout = time.Duration(*req.Timeout) * time.Second
	}
	if req.CPUCount != nil {
		if *req.CPUCount < 1 || *req.CPUCount > 64 {
			return cr, errors.New("cpuCount must be between 1 and 64")
		}
		cr.VCPUs = *req.CPUCount
	}
	if req.MemoryMB != nil {
		if *req.MemoryMB < 1 || *req.MemoryMB > 1<<20 {
			return cr, errors.New("memoryMB must be between 1 and 1048576")
		}
		cr.MemoryMiB = *req.MemoryMB
	}
	return cr, nil
}

// egress reads E2B's allowOut and denyOut lists. Denying everything
// (ALL_TRAFFIC, 0.0.0.0/0) is internet access off (but for allowOut),
// whatever allow_internet_access says, as E2B applies it (the SDKs send
// allow_internet_access true unless told otherwise); nil results mean the
// request gave none.
func (n *networkJSON) egress(allowInternet *bool) (*bool, *network.Egress, error) {
	if n.AllowOut == nil && n.DenyOut == nil && n.DNSServers == nil {
		return allowInternet, nil, nil
	}
	allow, domains, err := network.ParseRules("network.allowOut", n.AllowOut, true)
	if err != nil {
		return nil, nil, err
	}
	deny, _, err := network.ParseRules("network.denyOut", n.DenyOut, false)
	if err != nil {
		return nil, nil, err
	}
	dns, err := network.ParseDNSServers("network.dnsServers", n.DNSServers)
	if err != nil {
		return nil, nil, err
	}
	internet := allowInternet
	all := netip.MustParsePrefix(network.AllTraffic)
	if i := slices.Index(deny, all); i >= 0 {
		off := false
		internet, deny = &off, slices.Delete(deny, i, i+1)
	}
	return internet, &network.Egress{Allow: allow, Deny: deny, Domains: domains, DNSServers: dns}, nil
}

// hostNames converts host names as a resolver looks them up, refusing
// empty labels and names too long for DNS.
var hostNames = idna.New(idna.MapForLookup(), idna.BidiRule(), idna.VerifyDNSLength(true), idna.StrictDomainName(true))

// maskRequestHost checks E2B's network.maskRequestHost: a host name or
// address, ASCII once converted from an internationalised name, with an
// optional port, where "${PORT}" stands for the port a request is for.
func maskRequestHost(v string) (string, error) {
	bad := func(why string) error {
		return fmt.Errorf("network.maskRequestHost %q is not a valid host[:port]: %s", truncate(v, 100), why)
	}
	if v == "" || len(v) > 300 {
		return "", bad("empty or too long")
	}
	probe := strings.ReplaceAll(v, "${PORT}", "1")
	if strings.ContainsAny(probe, "/?#@ \t\r\n\\") {
		return "", bad("it holds a character a host cannot")
	}
	host, port := probe, ""
	if h, p, err := net.SplitHostPort(probe); err == nil {
		host, port = h, p
	}
	if port != "" {
		if n, err := strconv.Atoi(port); err != nil || n < 1 || n > 65535 {
			return "", bad("the port is not 1..65535")
		}
	}
	if _, err := netip.ParseAddr(host); err == nil {
		return v, nil
	}
	ascii, err := hostNames.ToASCII(host)
	if err != nil || ascii == "" {
		return "", bad("the host is not a domain name")
	}
	return v, nil
}

// networkBody is the network part of a sandbox's description.
func networkBody(sb *sandboxes.Sandbox) *apispec.SandboxNetwork {
	out := &apispec.SandboxNetwork{AllowOut: append(network.Strings(sb.Egress.Allow), sb.Egress.Domains...),
		DenyOut: network.Strings(sb.Egress.Deny)}
	if dns := network.Strings(sb.Egress.DNSServers); len(dns) > 0 {
		out.DnsServers = &dns
	}
	if out.AllowOut == nil {
		out.AllowOut = []string{}
	}
	if out.DenyOut == nil {
		out.DenyOut = []string{}
	}
	if !sb.AllowInternet {
		out.DenyOut = append(out.DenyOut, network.AllTraffic)
	}
	if sb.MaskRequestHost != "" {
		out.MaskRequestHost = &sb.MaskRequestHost
	}
	return out
}

// networkUpdateJSON is the body of PUT /sandboxes/{id}/network.
type networkUpdateJSON struct {
	AllowOut            []string        `json:"allowOut"`
	DenyOut             []string        `json:"denyOut"`
	DNSServers          []string        `json:"dnsServers"`
	AllowInternetAccess *bool           `json:"allow_internet_access"`
	Rules               map[string]any  `json:"rules"`
	EgressProxy         *map[string]any `json:"egressProxy"`
}

// UpdateSandboxNetwork replaces a sandbox's egress rules: the lists given become
// its lists (absent ones empty), and its internet access is on unless
// allow_internet_access is false or denyOut denies everything.
func (s *Server) UpdateSandboxNetwork(w http.ResponseWriter, r *http.Request, sandboxID apispec.SandboxID) {
	id, ok := s.sandboxID(w, sandboxID)
	if !ok {
		return
	}
	var body networkUpdateJSON
	if err := decodeBody(r, &body); err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	if len(body.Rules) > 0 || (body.EgressProxy != nil && *body.EgressProxy != nil) {
		writeError(w, http.StatusBadRequest, "network rules and egressProxy are not supported on this node")
		return
	}
	nj := networkJSON{AllowOut: body.AllowOut, DenyOut: body.DenyOut, DNSServers: body.DNSServers}
	if nj.AllowOut == nil {
		nj.AllowOut = []string{}
	}
	internet, egress, err := nj.egress(body.AllowInternetAccess)
	if err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	on := internet == nil || *internet
	if _, err := s.node.SetNetwork(r.Context(), id, on, *egress); err != nil {
		s.writeNodeError(w, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

func truncate(s string, n int) string {
	if len(s) > n {
		return s[:n] + "..."
	}
	return s
}

// CreateSandboxV1 is E2B's older create: secure only when asked.
func (s *Server) CreateSandboxV1(w http.ResponseWriter, r *http.Request, params apispec.CreateSandboxV1Params) {
	s.idempotent(w, r, "POST /sandboxes", params.IdempotencyKey, s.oneSandbox, func(w http.ResponseWriter, r *http.Request) { s.create(w, r, false) })
}

// CreateSandbox, used by current SDKs, creates secure sandboxes unless
// "secure": false is sent.
func (s *Server) CreateSandbox(w http.ResponseWriter, r *http.Request, params apispec.CreateSandboxParams) {
	s.idempotent(w, r, "POST /v2/sandboxes", params.IdempotencyKey, s.oneSandbox, func(w http.ResponseWriter, r *http.Request) { s.create(w, r, true) })
}

func (s *Server) create(w http.ResponseWriter, r *http.Request, secureDefault bool) {
	var req createSandboxRequest
	if err := decodeBody(r, &req); err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	cr, err := req.toCreateRequest(secureDefault)
	if err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	if cr.Volumes, err = s.volumeMounts(r.Context(), req.VolumeMounts); err != nil {
		s.writeNodeError(w, err)
		return
	}
	sb, err := s.node.Create(r.Context(), cr)
	if err != nil {
		s.writeNodeError(w, err)
		return
	}
	writeJSON(w, http.StatusCreated, s.sandboxBody(sb))
}

// volumeMounts names the volumes a create mounts by their ids.
func (s *Server) volumeMounts(ctx context.Context, mounts []volumeMountJSON) ([]orchestrator.VolumeMount, error) {
	if len(mounts) == 0 {
		return nil, nil
	}
	if s.cfg.Volumes == nil {
		return nil, fmt.Errorf("%w: volumeMounts: this server has no volumes", errkind.ErrInvalid)
	}
	out := make([]orchestrator.VolumeMount, 0, len(mounts))
	for i, m := range mounts {
		v, err := s.cfg.Volumes.ByName(ctx, m.Name)
		if errors.Is(err, errkind.ErrNotFound) {
			return nil, fmt.Errorf("%w: volumeMounts[%d]: there is no volume %q", errkind.ErrInvalid, i, m.Name)
		}
		if err != nil {
			return nil, err
		}
		out = append(out, orchestrator.VolumeMount{VolumeID: v.ID, Name: v.Name, Path: m.Path})
	}
	return out, nil
}

// sandboxID is the sandbox a path names (400 when it cannot be one).
func (s *Server) sandboxID(w http.ResponseWriter, raw apispec.SandboxID) (string, bool) {
	// The SDKs may send "<sandboxID>-<clientID>"; the sandbox id is the
	// first part. The whole is checked: a malformed suffix is no sandbox
	// id, not one to strip and act on.
	if !sandboxPathPattern.MatchString(raw) {
		writeError(w, http.StatusBadRequest, fmt.Sprintf("invalid sandbox id %q: want 1-64 of [a-z0-9], optionally \"-<clientID>\" of [a-z0-9]", raw))
		return "", false
	}
	id, _, _ := strings.Cut(raw, "-")
	return id, true
}

func (s *Server) GetSandbox(w http.ResponseWriter, r *http.Request, sandboxID apispec.SandboxID) {
	id, ok := s.sandboxID(w, sandboxID)
	if !ok {
		return
	}
	sb, err := s.node.Get(r.Context(), id)
	if err != nil {
		s.writeNodeError(w, err)
		return
	}
	d := s.detailBody(sb)
	if sb.Lease != "" {
		view, err := s.leaseView(r.Context())
		if err != nil {
			s.writeNodeError(w, err)
			return
		}
		d.Lease = view(sb)
	}
	writeJSON(w, http.StatusOK, d)
}

func (s *Server) KillSandbox(w http.ResponseWriter, r *http.Request, sandboxID apispec.SandboxID) {
	id, ok := s.sandboxID(w, sandboxID)
	if !ok {
		return
	}
	if err := s.node.Kill(r.Context(), id); err != nil {
		s.writeNodeError(w, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// SetSandboxTimeout sets the end time to now + timeout (shorter or longer).
func (s *Server) SetSandboxTimeout(w http.ResponseWriter, r *http.Request, sandboxID apispec.SandboxID) {
	s.extend(w, r, sandboxID, "timeout", maxTimeoutSeconds, true, true)
}

// RefreshSandbox keeps the sandbox alive for at least duration more
// seconds; it never shortens its life. E2B caps refreshes at one hour.
func (s *Server) RefreshSandbox(w http.ResponseWriter, r *http.Request, sandboxID apispec.SandboxID) {
	s.extend(w, r, sandboxID, "duration", maxRefreshSeconds, false, false)
}

// decodeSeconds reads {field: <integer seconds>} from body. An absent field
// (or empty body) is reported with present=false.
func decodeSeconds(r *http.Request, field string, maxSecs int64) (secs int64, present bool, err error) {
	var body map[string]json.RawMessage
	if err := decodeBody(r, &body); err != nil {
		return 0, false, err
	}
	return secondsField(body, field, maxSecs)
}

// secondsField reads field of a decoded body as whole seconds.
func secondsField(body map[string]json.RawMessage, field string, maxSecs int64) (secs int64, present bool, err error) {
	raw, ok := body[field]
	if !ok || string(raw) == "null" {
		return 0, false, nil
	}
	var n json.Number
	if len(raw) == 0 || (raw[0] != '-' && (raw[0] < '0' || raw[0] > '9')) || json.Unmarshal(raw, &n) != nil {
		return 0, false, fmt.Errorf("%s must be a number of seconds", field)
	}
	v, err := n.Int64()
	if err != nil || v < 0 || v > maxSecs {
		return 0, false, fmt.Errorf("%s must be an integer number of seconds between 0 and %d", field, maxSecs)
	}
	return v, true, nil
}

func (s *Server) extend(w http.ResponseWriter, r *http.Request, sandboxID apispec.SandboxID, field string, maxSecs int64, required, allowShorter bool) {
	id, ok := s.sandboxID(w, sandboxID)
	if !ok {
		return
	}
	secs, present, err := decodeSeconds(r, field, maxSecs)
	if err == nil && required && !present {
		err = fmt.Errorf("%s is required", field)
	}
	if err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	if !present {
		secs = defaultRefreshSeconds
	}
	if err := s.keepAlive(r.Context(), id, time.Duration(max(secs, 1))*time.Second, allowShorter); err != nil {
		s.writeNodeError(w, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// keepAlive sets the sandbox's end to now + d; unless allowShorter, an end
// that is already later is kept.
func (s *Server) keepAlive(ctx context.Context, id string, d time.Duration, allowShorter bool) error {
	sb, err := s.node.Get(ctx, id)
	if err != nil {
		return err
	}
	if sb.State != sandboxes.Running {
		return fmt.Errorf("%w: sandbox %s is %s", orchestrator.ErrConflict, id, sb.State)
	}
	if !allowShorter && !sb.EndAt.Before(time.Now().Add(d)) {
		return nil
	}
	_, err = s.node.SetTimeout(ctx, id, d)
	return err
}

// deref is *p, or the zero value for nil (a parameter not given).
func deref[T any](p *T) T {
	if p == nil {
		var zero T
		return zero
	}
	return *p
}

// intParam is an integer parameter within [lo, hi], def when not given.
func intParam[T int | int64](name string, p *T, lo, hi, def T) (T, error) {
	if p == nil {
		return def, nil
	}
	if *p < lo || *p > hi {
		return 0, fmt.Errorf("parameter %q must be an integer between %d and %d", name, lo, hi)
	}
	return *p, nil
}

// ListSandboxesV1 lists the running sandboxes, filtered by metadata.
func (s *Server) ListSandboxesV1(w http.ResponseWriter, r *http.Request, params apispec.ListSandboxesV1Params) {
	filter, err := parseMetadataFilter(deref(params.Metadata))
	if err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	all, err := s.node.List(r.Context())
	if err != nil {
		s.writeNodeError(w, err)
		return
	}
	leased, err := s.leaseView(r.Context())
	if err != nil {
		s.writeNodeError(w, err)
		return
	}
	out := []apispec.ListedSandbox{}
	for _, sb := range all {
		if sb.State == sandboxes.Running && !sb.Internal() && matchMetadata(sb.Metadata, filter) {
			d := listedBody(sb)
			d.Lease = leased(sb)
			out = append(out, d)
		}
	}
	writeJSON(w, http.StatusOK, out)
}

// ListSandboxes implements GET /v2/sandboxes with state and metadata
// filters and cursor pagination (the cursor is returned in X-Next-Token).
func (s *Server) ListSandboxes(w http.ResponseWriter, r *http.Request, params apispec.ListSandboxesParams) {
	filter, err := parseMetadataFilter(deref(params.Metadata))
	if err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	states := map[string]bool{}
	for _, v := range deref(params.State) {
		if strings.Trim(string(v), ", ") == "" {
			writeError(w, http.StatusBadRequest, "state must name running, paused or both")
			return
		}
		for _, st := range strings.Split(string(v), ",") {
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
	// The generated parsing takes an empty value for none; here it is
	// not a time, an order or a number.
	q := r.URL.Query()
	for _, name := range []string{"startedAfter", "order", "limit"} {
		if q.Has(name) && q.Get(name) == "" {
			writeError(w, http.StatusBadRequest, fmt.Sprintf("parameter %q is empty", name))
			return
		}
	}
	template := deref(params.Template)
	// "At or after", both times to the microsecond, as E2B compares them.
	startedAfter := deref(params.StartedAfter).Truncate(time.Microsecond)
	asc := false
	if params.Order != nil {
		switch *params.Order {
		case apispec.Asc:
			asc = true
		case apispec.Desc:
		default:
			writeError(w, http.StatusBadRequest, fmt.Sprintf("order %q: want asc or desc", *params.Order))
			return
		}
	}
	limit, err := intParam("limit", params.Limit, 1, 1000, 100)
	if err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	var after *listCursor
	if tok := deref(params.NextToken); tok != "" {
		c, err := parseListCursor(tok)
		if err != nil || c.asc != asc {
			writeError(w, http.StatusBadRequest, "invalid nextToken (a token is good for the order it was made in)")
			return
		}
		after = &c
	}
	all, err := s.node.List(r.Context())
	if err != nil {
		s.writeNodeError(w, err)
		return
	}
	leased, err := s.leaseView(r.Context())
	if err != nil {
		s.writeNodeError(w, err)
		return
	}
	sort.Slice(all, func(i, j int) bool {
		return ListBefore(all[i].StartedAt, all[i].ID, all[j].StartedAt, all[j].ID, asc)
	})
	out := []apispec.ListedSandbox{}
	var last *sandboxes.Sandbox
	more := false
	for _, sb := range all {
		d := listedBody(sb)
		d.Lease = leased(sb)
		if sb.Internal() || !states[string(d.State)] || !matchMetadata(sb.Metadata, filter) ||
			(template != "" && sb.TemplateID != template) ||
			(!startedAfter.IsZero() && sb.StartedAt.Truncate(time.Microsecond).Before(startedAfter)) {
			continue
		}
		if after != nil && !ListBefore(after.startedAt, after.id, sb.StartedAt, sb.ID, asc) {
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
		w.Header().Set("X-Next-Token", ListCursor(last.StartedAt, last.ID, asc))
	}
	writeJSON(w, http.StatusOK, out)
}

// ListBefore orders GET /v2/sandboxes as E2B does: newest first, ties by
// id; or, asc (order=asc), the exact reverse.
func ListBefore(aStarted time.Time, aID string, bStarted time.Time, bID string, asc bool) bool {
	if !aStarted.Equal(bStarted) {
		return aStarted.After(bStarted) != asc
	}
	if aID == bID {
		return false
	}
	return (aID < bID) != asc
}

// ListCursor is the nextToken of a GET /v2/sandboxes page in the order asc
// says whose last sandbox started at startedAt and has id: the same on
// every node, so a gateway merging the nodes' pages hands out tokens the
// nodes accept. A token is good for the order it was made in only.
func ListCursor(startedAt time.Time, id string, asc bool) string {
	c := fmt.Sprintf("%020d|%s", startedAt.UnixNano(), id)
	if asc {
		c += "|asc"
	}
	return base64.RawURLEncoding.EncodeToString([]byte(c))
}

// listCursor is a parsed ListCursor.
type listCursor struct {
	startedAt time.Time
	id        string
	asc       bool
}

func parseListCursor(tok string) (listCursor, error) {
	b, err := base64.RawURLEncoding.DecodeString(tok)
	if err != nil {
		return listCursor{}, err
	}
	parts := strings.Split(string(b), "|")
	if len(parts) < 2 || len(parts) > 3 || !sandboxIDPattern.MatchString(parts[1]) || (len(parts) == 3 && parts[2] != "asc") {
		return listCursor{}, errors.New("malformed")
	}
	ns, err := strconv.ParseInt(parts[0], 10, 64)
	if err != nil {
		return listCursor{}, err
	}
	return listCursor{startedAt: time.Unix(0, ns), id: parts[1], asc: len(parts) == 3}, nil
}

// parseMetadataFilter parses the SDKs' metadata query: "k=v&k2=v2" in which
// every key and value was encoded with encodeURIComponent before the pairs
// were form-encoded (so they arrive encoded twice; one layer is removed by
// the query string, one by ParseQuery, the last here).
func parseMetadataFilter(raw string) (map[string]string, error) {
	if raw == "" {
		return nil, nil
	}
	vals, err := url.ParseQuery(raw)
	if err != nil {
		return nil, fmt.Errorf("metadata filter %q is not k=v pairs: %v", truncate(raw, 100), err)
	}
	out := map[string]string{}
	for k, v := range vals {
		if len(v) == 0 {
			continue
		}
		key, err1 := url.PathUnescape(k)
		val, err2 := url.PathUnescape(v[len(v)-1])
		if err1 != nil || err2 != nil {
			return nil, fmt.Errorf("metadata filter %q: keys and values must be URI-component encoded", truncate(raw, 100))
		}
		out[key] = val
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
