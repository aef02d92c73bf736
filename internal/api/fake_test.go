package api

import (
	"context"
	"fmt"
	"os"
	"sort"
	"sync"
	"time"

	"github.com/agentenv/agentenv/internal/buildfiles"
	"github.com/agentenv/agentenv/internal/builds"
	"github.com/agentenv/agentenv/internal/diskspace"
	"github.com/agentenv/agentenv/internal/idempotency"
	"github.com/agentenv/agentenv/internal/leases"
	"github.com/agentenv/agentenv/internal/network"
	"github.com/agentenv/agentenv/internal/orchestrator"
	"github.com/agentenv/agentenv/internal/sandboxes"
	"github.com/agentenv/agentenv/internal/storage/lazy"
	"github.com/agentenv/agentenv/internal/templates"
)

// fakeNode is an in-memory Node for testing the API layer alone.
type fakeNode struct {
	mu        sync.Mutex
	sandboxes map[string]*sandboxes.Sandbox
	creates   []orchestrator.CreateRequest
	mutations int // successful Create/Kill/SetTimeout calls
	seq       int
	logs      map[string][]byte
	// pauseErr, when set, is what Pause answers.
	pauseErr error
	// files is made on first use (BuildFiles), in a temporary directory.
	files *buildfiles.Store
	snaps []*orchestrator.NamedSnapshot // oldest first
	// createGate, when set, holds every Create until it is closed (as a
	// real create runs on, detached from its client); each held Create
	// sends on createHeld first.
	createGate chan struct{}
	createHeld chan struct{}
	// leases is made on first use (leaseStore).
	leases *leases.Store
	// floor is the free space DiskRoom keeps (none unless a test sets it).
	floor diskspace.Floor
	// builds are the template builds TemplateBuilds lists.
	builds []*builds.Record
}

func newFakeNode() *fakeNode {
	return &fakeNode{sandboxes: map[string]*sandboxes.Sandbox{}, logs: map[string][]byte{}}
}

func (f *fakeNode) add(sb *sandboxes.Sandbox) *sandboxes.Sandbox {
	f.mu.Lock()
	defer f.mu.Unlock()
	if sb.State == "" {
		sb.State = sandboxes.Running
	}
	if sb.EnvdVersion == "" {
		sb.EnvdVersion = fakeEnvdVersion
	}
	f.sandboxes[sb.ID] = sb
	return sb
}

// CreateFromImage: the fake makes a sandbox whose template is the image
// reference (a real node converts the image; package orchestrator).
func (f *fakeNode) CreateFromImage(ctx context.Context, ref string, req orchestrator.CreateRequest) (*sandboxes.Sandbox, error) {
	if _, err := orchestrator.ParseImageRef(ref); err != nil {
		return nil, err
	}
	req.TemplateID = ref
	return f.Create(ctx, req)
}

func (f *fakeNode) Create(ctx context.Context, req orchestrator.CreateRequest) (*sandboxes.Sandbox, error) {
	if f.createGate != nil {
		f.createHeld <- struct{}{}
		<-f.createGate
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.creates = append(f.creates, req)
	if req.TemplateID == "missing" {
		return nil, fmt.Errorf("%w: template %q", orchestrator.ErrNotFound, req.TemplateID)
	}
	if req.TemplateID == "full" {
		return nil, fmt.Errorf("%w: all slots taken", orchestrator.ErrCapacity)
	}
	f.seq++
	f.mutations++
	if req.Lease != nil {
		f.mu.Unlock()
		_, err := f.leaseStore().Take(ctx, req.Lease.ID, req.Lease.TTL)
		f.mu.Lock()
		if err != nil {
			return nil, err
		}
	}
	timeout := req.Timeout
	if timeout == 0 {
		timeout = 5 * time.Minute
	}
	now := time.Now().UTC()
	sb := &sandboxes.Sandbox{
		ID: fmt.Sprintf("sbx%017d", f.seq), TemplateID: req.TemplateID, State: sandboxes.Running,
		VCPUs: 2, MemoryMiB: 512, DiskMiB: 1024, Secure: req.Secure, AutoPause: req.AutoPause,
		AllowInternet: req.AllowInternet == nil || *req.AllowInternet,
		Metadata:      req.Metadata, EnvVars: req.EnvVars, StartedAt: now, CreatedAt: now, EndAt: now.Add(timeout),
		TrafficToken: "traffic", PublicTraffic: !req.PrivateTraffic, AutoResume: req.AutoResume, EnvdVersion: fakeEnvdVersion,
		Request: idempotency.RequestOf(ctx),
	}
	if req.Lease != nil {
		sb.Lease = req.Lease.ID
	}
	if req.Secure {
		sb.AccessToken = "envd-token-" + sb.ID
	}
	if req.Egress != nil {
		sb.Egress = *req.Egress
	}
	f.sandboxes[sb.ID] = sb
	cp := *sb
	return &cp, nil
}

func (f *fakeNode) Get(ctx context.Context, id string) (*sandboxes.Sandbox, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	sb, ok := f.sandboxes[id]
	if !ok {
		return nil, fmt.Errorf("%w: sandbox %s", orchestrator.ErrNotFound, id)
	}
	cp := *sb
	return &cp, nil
}

func (f *fakeNode) List(ctx context.Context) ([]*sandboxes.Sandbox, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []*sandboxes.Sandbox
	for _, sb := range f.sandboxes {
		cp := *sb
		out = append(out, &cp)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].CreatedAt.Before(out[j].CreatedAt) })
	return out, nil
}

func (f *fakeNode) SandboxesOf(ctx context.Context, request string) ([]*sandboxes.Sandbox, error) {
	all, _ := f.List(ctx)
	var out []*sandboxes.Sandbox
	for _, sb := range all {
		if request != "" && sb.Request == request {
			out = append(out, sb)
		}
	}
	return out, nil
}

func (f *fakeNode) Kill(ctx context.Context, id string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.sandboxes[id]; !ok {
		return fmt.Errorf("%w: sandbox %s", orchestrator.ErrNotFound, id)
	}
	delete(f.sandboxes, id)
	f.mutations++
	return nil
}

func (f *fakeNode) SetTimeout(ctx context.Context, id string, d time.Duration) (*sandboxes.Sandbox, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	sb, ok := f.sandboxes[id]
	if !ok {
		return nil, fmt.Errorf("%w: sandbox %s", orchestrator.ErrNotFound, id)
	}
	if sb.State != sandboxes.Running {
		return nil, fmt.Errorf("%w: sandbox %s is %s", orchestrator.ErrConflict, id, sb.State)
	}
	sb.EndAt = time.Now().Add(d).UTC()
	f.mutations++
	cp := *sb
	return &cp, nil
}

func (f *fakeNode) Pause(ctx context.Context, id string) (*sandboxes.Sandbox, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.pauseErr != nil {
		return nil, f.pauseErr
	}
	sb, ok := f.sandboxes[id]
	if !ok {
		return nil, fmt.Errorf("%w: sandbox %s", orchestrator.ErrNotFound, id)
	}
	if sb.State != sandboxes.Running {
		return nil, fmt.Errorf("%w: sandbox %s is %s", orchestrator.ErrConflict, id, sb.State)
	}
	sb.State, sb.PauseMode = sandboxes.Paused, sandboxes.PauseFull
	f.mutations++
	cp := *sb
	return &cp, nil
}

// PauseFilesystem pauses as Pause does (the fake keeps no memory anyway)
// but for the mode it reports.
func (f *fakeNode) PauseFilesystem(ctx context.Context, id string) (*sandboxes.Sandbox, error) {
	sb, err := f.Pause(ctx, id)
	if err == nil {
		f.mu.Lock()
		f.sandboxes[id].PauseMode = sandboxes.PauseFilesystem
		sb.PauseMode = sandboxes.PauseFilesystem
		f.mu.Unlock()
	}
	return sb, err
}

func (f *fakeNode) ResumeWith(ctx context.Context, id string, opts orchestrator.ResumeOptions) (*sandboxes.Sandbox, error) {
	timeout := opts.Timeout
	f.mu.Lock()
	defer f.mu.Unlock()
	sb, ok := f.sandboxes[id]
	if !ok {
		return nil, fmt.Errorf("%w: sandbox %s", orchestrator.ErrNotFound, id)
	}
	if sb.State != sandboxes.Paused {
		return nil, fmt.Errorf("%w: sandbox %s is %s", orchestrator.ErrConflict, id, sb.State)
	}
	if timeout == 0 {
		timeout = 5 * time.Minute
	}
	sb.State, sb.PauseMode = sandboxes.Running, ""
	sb.EndAt = time.Now().Add(timeout).UTC()
	f.mutations++
	cp := *sb
	return &cp, nil
}

// Fork makes count children; the template "halfbroken" fails every second.
func (f *fakeNode) Fork(ctx context.Context, id string, count int, timeout time.Duration) ([]orchestrator.ForkResult, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	parent, ok := f.sandboxes[id]
	if !ok {
		return nil, fmt.Errorf("%w: sandbox %s", orchestrator.ErrNotFound, id)
	}
	if parent.State != sandboxes.Running {
		return nil, fmt.Errorf("%w: sandbox %s is %s", orchestrator.ErrConflict, id, parent.State)
	}
	if timeout == 0 {
		timeout = 5 * time.Minute
	}
	var out []orchestrator.ForkResult
	for i := range count {
		if parent.TemplateID == "halfbroken" && i%2 == 1 {
			out = append(out, orchestrator.ForkResult{Err: fmt.Errorf("%w: no slot", orchestrator.ErrCapacity)})
			continue
		}
		if parent.TemplateID == "brokenchild" && i == 1 {
			out = append(out, orchestrator.ForkResult{Err: fmt.Errorf("restore: qemu: open %s/snapshots/s1/memory: permission denied", fakeDataDir)})
			continue
		}
		f.seq++
		f.mutations++
		child := *parent
		child.ID = fmt.Sprintf("child%015d", f.seq)
		child.AccessToken = "tok-" + child.ID
		child.EndAt = time.Now().Add(timeout)
		child.CreatedAt = time.Now().Add(time.Duration(i))
		child.Request = idempotency.RequestOf(ctx)
		f.sandboxes[child.ID] = &child
		cp := child
		out = append(out, orchestrator.ForkResult{Sandbox: &cp})
	}
	return out, nil
}

// fakeEnvdVersion is the envd version the fake's sandboxes report.
const fakeEnvdVersion = "0.0.7-fake"

// The real node must keep offering what the API needs.
var _ Node = (*orchestrator.Node)(nil)

// The parts of the node the fake has no use for: nothing there.
func (f *fakeNode) Snapshot(ctx context.Context, id, name string) (*orchestrator.NamedSnapshot, error) {
	return nil, fmt.Errorf("%w: the fake node keeps no snapshots", orchestrator.ErrConflict)
}
func (f *fakeNode) SnapshotFilesystem(ctx context.Context, id, name string) (*orchestrator.NamedSnapshot, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.sandboxes[id]; !ok {
		return nil, fmt.Errorf("%w: sandbox %s", orchestrator.ErrNotFound, id)
	}
	ns := &orchestrator.NamedSnapshot{Name: name, SnapshotID: "snap-fs-" + name, SandboxID: id, FilesystemOnly: true, CreatedAt: time.Now().UTC()}
	f.snaps = append(f.snaps, ns)
	f.mutations++
	return ns, nil
}
func (f *fakeNode) Snapshots() ([]*orchestrator.NamedSnapshot, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]*orchestrator.NamedSnapshot(nil), f.snaps...), nil
}
func (f *fakeNode) DeleteSnapshot(ctx context.Context, name string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	for i, ns := range f.snaps {
		if ns.Name == name {
			f.snaps = append(f.snaps[:i], f.snaps[i+1:]...)
			f.mutations++
			return nil
		}
	}
	return fmt.Errorf("%w: snapshot %q", orchestrator.ErrNotFound, name)
}
func (f *fakeNode) RequestBuild(name string, tags []string, vcpus, memMiB int) (*builds.Record, error) {
	return nil, fmt.Errorf("%w: the fake node builds nothing", orchestrator.ErrConflict)
}
func (f *fakeNode) StartBuild(templateID, buildID string, spec builds.Spec) error {
	return fmt.Errorf("%w: build %s", orchestrator.ErrNotFound, buildID)
}
func (f *fakeNode) Build(templateID, buildID string) (*builds.Record, error) {
	return nil, fmt.Errorf("%w: build %s", orchestrator.ErrNotFound, buildID)
}
func (f *fakeNode) Template(name string) (*orchestrator.Template, error) {
	return nil, fmt.Errorf("%w: template %q", orchestrator.ErrNotFound, name)
}
func (f *fakeNode) Templates() ([]*orchestrator.Template, error) { return nil, nil }
func (f *fakeNode) DeleteTemplate(ctx context.Context, name string) error {
	return fmt.Errorf("%w: template %q", orchestrator.ErrNotFound, name)
}
func (f *fakeNode) DataDir() string { return fakeDataDir }

func (f *fakeNode) TemplateBuilds(templateID string) ([]*builds.Record, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []*builds.Record
	for _, b := range f.builds {
		if b.TemplateID == templateID {
			out = append(out, b)
		}
	}
	return out, nil
}

// Catalog: the fake node has no template store (the tag routes are tested
// on a real node, tests/e2e).
func (f *fakeNode) Catalog() *templates.Catalog { return nil }
func (f *fakeNode) DiskRoom(what string) error  { return f.floor.Check(what) }

func (f *fakeNode) BuildFiles() *buildfiles.Store {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.files == nil {
		dir, err := os.MkdirTemp("", "aenv-api-test-")
		if err == nil {
			f.files, err = buildfiles.Open(dir)
		}
		if err != nil {
			panic(err)
		}
	}
	return f.files
}

const fakeDataDir = "/var/lib/aenv-fake"

func (f *fakeNode) Memory(ctx context.Context) (*orchestrator.NodeMemory, error) {
	return &orchestrator.NodeMemory{States: map[sandboxes.State]int{}}, nil
}
func (f *fakeNode) LayerCacheStats() lazy.CacheStats { return lazy.CacheStats{} }

func (f *fakeNode) ConsoleLog(ctx context.Context, id string, maxBytes int64) ([]byte, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.sandboxes[id]; !ok {
		return nil, fmt.Errorf("%w: sandbox %s", orchestrator.ErrNotFound, id)
	}
	b := f.logs[id]
	if int64(len(b)) > maxBytes {
		b = b[int64(len(b))-maxBytes:]
	}
	return b, nil
}

func (f *fakeNode) mutationCount() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.mutations
}

func (f *fakeNode) SetNetwork(ctx context.Context, id string, internet bool, egress network.Egress) (*sandboxes.Sandbox, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	sb, ok := f.sandboxes[id]
	if !ok {
		return nil, fmt.Errorf("%w: sandbox %s", orchestrator.ErrNotFound, id)
	}
	if !sb.State.Resting() {
		return nil, sandboxes.Busy(sb)
	}
	sb.AllowInternet, sb.Egress = internet, egress
	f.mutations++
	return sb, nil
}
