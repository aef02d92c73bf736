package builds

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/agentenv/agentenv/internal/buildfiles"
	"github.com/agentenv/agentenv/internal/errkind"
	"github.com/agentenv/agentenv/internal/storage"
	"github.com/agentenv/agentenv/internal/storage/image"
	"github.com/agentenv/agentenv/internal/store"
	"github.com/agentenv/agentenv/internal/templates"
)

// Build records: the E2B template API creates a build (POST /v3/templates),
// starts it with its steps, and polls its status and logs. Each build is a
// record in <data>/builds/<template>/<build>.json, rewritten atomically as
// the build goes on; a build a restart interrupts is recorded as failed.

const buildsDir = "builds"

// Build states, as the E2B API names them.
const (
	Waiting  = "waiting"
	Building = "building"
	Ready    = "ready"
	Failed   = "error"
)

// LogEntry is one line of a build's log.
type LogEntry struct {
	Timestamp time.Time `json:"timestamp"`
	Level     string    `json:"level"`
	Message   string    `json:"message"`
	Step      string    `json:"step,omitempty"`
}

// Record is a template build.
type Record struct {
	TemplateID string `json:"templateID"`
	BuildID    string `json:"buildID"`
	Status     string `json:"status"`
	VCPUs      int    `json:"cpuCount"`
	MemoryMiB  int    `json:"memoryMB"`
	// Tags are pointed at the build once it is ready (it also becomes the
	// template's current build, tag default).
	Tags []string   `json:"tags,omitempty"`
	Logs []LogEntry `json:"logs"`
	// Reason says why a build failed, and at which step.
	Reason     string    `json:"reason,omitempty"`
	ReasonStep string    `json:"reasonStep,omitempty"`
	CreatedAt  time.Time `json:"createdAt"`
	FinishedAt time.Time `json:"finishedAt,omitempty"`
}

// maxBuildLogs bounds a build's recorded log.
const maxBuildLogs = 20000

// Config is what a node's builds work with.
type Config struct {
	DataDir string
	// Files are the COPY archives uploaded for builds.
	Files   *buildfiles.Store
	Store   *store.Store
	Catalog *templates.Catalog
	// Host boots builder sandboxes and snapshots templates.
	Host Host
	Log  *slog.Logger
	// Limits of a build's sandbox.
	MaxVCPUs, MaxMemoryMiB int
	// Images says which registries a build's base image (fromImage) may
	// come from: the node's policy for images users name.
	Images image.Policy
}

// Builds is the template builds of one node.
type Builds struct {
	dataDir string
	files   *buildfiles.Store
	st      *store.Store
	cat     *templates.Catalog
	host    Host
	log     *slog.Logger
	images  image.Policy
	// Limits of a build's sandbox.
	maxVCPUs, maxMemMiB int

	mu   sync.Mutex
	live map[string]*Record // templateID/buildID of running builds; guarded by mu
}

// New returns the builds of a node.
func New(cfg Config) *Builds {
	log := cfg.Log
	if log == nil {
		log = slog.Default()
	}
	return &Builds{dataDir: cfg.DataDir, files: cfg.Files, st: cfg.Store, cat: cfg.Catalog, host: cfg.Host, log: log,
		images: cfg.Images, maxVCPUs: cfg.MaxVCPUs, maxMemMiB: cfg.MaxMemoryMiB, live: map[string]*Record{}}
}

func (bs *Builds) path(templateID, buildID string) string {
	return filepath.Join(bs.dataDir, buildsDir, templateID, buildID+".json")
}

func (bs *Builds) save(b *Record) error {
	if err := os.MkdirAll(filepath.Dir(bs.path(b.TemplateID, b.BuildID)), 0o755); err != nil {
		return err
	}
	return storage.WriteJSONAtomic(bs.path(b.TemplateID, b.BuildID), b, 0o600)
}

// newID is a fresh build id (20 hex digits).
// newID makes a build id: a random (version 4) UUID, the form E2B's SDKs
// parse build ids in.
func newID() string {
	b := make([]byte, 16)
	if _, err := rand.Read(b); err != nil {
		panic(err)
	}
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	h := hex.EncodeToString(b)
	return h[:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:]
}

// Request registers a new build of template name ("name:tag" adds tag to
// tags).
func (bs *Builds) Request(name string, tags []string, vcpus, memMiB int) (*Record, error) {
	if base, tag, ok := strings.Cut(name, ":"); ok {
		name, tags = base, append([]string{tag}, tags...)
	}
	if err := templates.CheckTags(tags); err != nil {
		return nil, err
	}
	var keep []string
	for _, t := range tags {
		if t != templates.DefaultTag && !slices.Contains(keep, t) {
			keep = append(keep, t)
		}
	}
	tags = keep
	if !templates.NameRE.MatchString(name) {
		return nil, fmt.Errorf("%w: template name %q must match %s", errkind.ErrInvalid, name, templates.NameRE)
	}
	if vcpus < 0 || vcpus > bs.maxVCPUs {
		return nil, fmt.Errorf("%w: cpuCount %d is outside 1..%d", errkind.ErrInvalid, vcpus, bs.maxVCPUs)
	}
	if memMiB != 0 && (memMiB < 128 || memMiB > bs.maxMemMiB) {
		return nil, fmt.Errorf("%w: memoryMB %d is outside 128..%d", errkind.ErrInvalid, memMiB, bs.maxMemMiB)
	}
	if bs.host.SnapshotExists(name) {
		return nil, fmt.Errorf("%w: %q is a snapshot's name", errkind.ErrConflict, name)
	}
	b := &Record{TemplateID: name, BuildID: newID(), Status: Waiting, VCPUs: vcpus, MemoryMiB: memMiB,
		Tags: tags, Logs: []LogEntry{}, CreatedAt: time.Now().UTC()}
	return b, bs.save(b)
}

// Get reads a build's record (with its log so far).
func (bs *Builds) Get(templateID, buildID string) (*Record, error) {
	if !templates.NameRE.MatchString(templateID) || !templates.NameRE.MatchString(buildID) {
		return nil, fmt.Errorf("%w: build %s/%s", errkind.ErrNotFound, templateID, buildID)
	}
	bs.mu.Lock()
	if b := bs.live[templateID+"/"+buildID]; b != nil {
		cp := copyRecord(b)
		bs.mu.Unlock()
		return cp, nil
	}
	bs.mu.Unlock()
	var b Record
	if err := storage.ReadJSON(bs.path(templateID, buildID), &b); err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil, fmt.Errorf("%w: build %s of template %s", errkind.ErrNotFound, buildID, templateID)
		}
		return nil, err
	}
	return &b, nil
}

// copyRecord copies a live build's record (its log too), under bs.mu.
func copyRecord(b *Record) *Record {
	cp := *b
	cp.Logs = append([]LogEntry(nil), b.Logs...)
	return &cp
}

// Start runs a requested build in the background.
func (bs *Builds) Start(templateID, buildID string, spec Spec) error {
	b, err := bs.Get(templateID, buildID)
	if err != nil {
		return err
	}
	if b.Status != Waiting {
		return fmt.Errorf("%w: build %s is %s", errkind.ErrConflict, buildID, b.Status)
	}
	spec.Template, spec.BuildID, spec.Tags = templateID, buildID, b.Tags
	if spec.VCPUs == 0 {
		spec.VCPUs = b.VCPUs
	}
	if spec.MemoryMiB == 0 {
		spec.MemoryMiB = b.MemoryMiB
	}
	if spec.FromImage == "" {
		if _, err := bs.cat.Get(context.Background(), spec.FromTemplate); err != nil {
			return fmt.Errorf("%w: base template %q: %v", errkind.ErrInvalid, spec.FromTemplate, err)
		}
	}
	if err := bs.admit(&spec); err != nil {
		return err
	}
	key := templateID + "/" + buildID
	bs.mu.Lock()
	for k, other := range bs.live {
		if strings.HasPrefix(k, templateID+"/") && other.Status == Building {
			bs.mu.Unlock()
			return fmt.Errorf("%w: template %s is being built (build %s)", errkind.ErrConflict, templateID, other.BuildID)
		}
	}
	b.Status = Building
	bs.live[key] = b
	bs.mu.Unlock()
	if err := bs.save(b); err != nil {
		return err
	}
	bs.host.Go(func(ctx context.Context) {
		lastSave := time.Now()
		logf := func(level, step, msg string) {
			bs.mu.Lock()
			if len(b.Logs) < maxBuildLogs {
				b.Logs = append(b.Logs, LogEntry{Timestamp: time.Now().UTC(), Level: level, Message: msg, Step: step})
			}
			save := time.Since(lastSave) > time.Second
			bs.mu.Unlock()
			if save {
				lastSave = time.Now()
				bs.mu.Lock()
				cp := *b
				cp.Logs = append([]LogEntry(nil), b.Logs...)
				bs.mu.Unlock()
				_ = bs.save(&cp)
			}
		}
		err := bs.Run(ctx, spec, logf)
		bs.mu.Lock()
		b.FinishedAt = time.Now().UTC()
		if err != nil {
			b.Status, b.Reason = Failed, err.Error()
			var se *stepError
			if errors.As(err, &se) {
				b.ReasonStep = fmt.Sprint(se.index)
			}
			b.Logs = append(b.Logs, LogEntry{Timestamp: b.FinishedAt, Level: "error", Message: "build failed: " + err.Error()})
		} else {
			b.Status = Ready
		}
		delete(bs.live, key)
		bs.mu.Unlock()
		if err := bs.save(b); err != nil {
			bs.log.Error("save build record", "template", templateID, "build", buildID, "err", err)
		}
		if b.Status == Failed && !bs.wanted(ctx, templateID) {
			// The template never came: its uploads and private
			// archives go (the checked, shared ones stay for a
			// retry, see buildfiles.Store.Sweep).
			if err := bs.files.RemoveTemplate(templateID); err != nil {
				bs.log.Error("remove the build files of a template that never came", "template", templateID, "err", err)
			}
		}
	})
	return nil
}

// waitingTTL is how long a requested build may wait for its start.
const waitingTTL = 24 * time.Hour

// sweepEvery is how often Collect sweeps.
const sweepEvery = time.Hour

// Collect sweeps (see Sweep) now and then every hour until ctx ends.
func (bs *Builds) Collect(ctx context.Context) {
	t := time.NewTicker(sweepEvery)
	defer t.Stop()
	for {
		bs.Sweep(ctx, time.Now())
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// Sweep ends the builds that waited past waitingTTL for their start
// (recorded as failed), then collects the build files no build will use
// (buildfiles.Store.Sweep): among them the uploads and private archives of
// templates that never came.
func (bs *Builds) Sweep(ctx context.Context, now time.Time) {
	for _, b := range bs.allRecords() {
		if b.Status == Waiting && now.Sub(b.CreatedAt) > waitingTTL {
			b.Status, b.Reason, b.FinishedAt = Failed, fmt.Sprintf("never started: a build waits %s for its start", waitingTTL), now.UTC()
			if err := bs.save(b); err != nil {
				bs.log.Error("save build record", "template", b.TemplateID, "build", b.BuildID, "err", err)
			}
		}
	}
	bs.files.Sweep(now, func(template string) bool { return bs.wanted(ctx, template) })
}

// wanted reports whether a template's build files may still be used: it
// exists, or a build of it waits or runs.
func (bs *Builds) wanted(ctx context.Context, template string) bool {
	if _, err := bs.cat.Get(ctx, template); !errors.Is(err, errkind.ErrNotFound) {
		return true
	}
	return bs.Pending(template)
}

// Pending reports whether a build of template waits for its start or
// runs: while one does, uploads for it are taken.
func (bs *Builds) Pending(template string) bool {
	rs, _ := bs.List(template)
	return WaitsOrRuns(rs)
}

// WaitsOrRuns reports whether one of a template's builds waits for its
// start or runs.
func WaitsOrRuns(rs []*Record) bool {
	for _, b := range rs {
		if b.Status == Waiting || b.Status == Building {
			return true
		}
	}
	return false
}

// records reads the build records of a template as they are on disk
// (those it can).
func (bs *Builds) records(template string) ([]*Record, error) {
	if !templates.NameRE.MatchString(template) {
		return nil, nil
	}
	dir := filepath.Join(bs.dataDir, buildsDir, template)
	files, err := os.ReadDir(dir)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, err
	}
	var out []*Record
	for _, f := range files {
		var b Record
		if strings.HasSuffix(f.Name(), ".json") && storage.ReadJSON(filepath.Join(dir, f.Name()), &b) == nil {
			out = append(out, &b)
		}
	}
	return out, nil
}

// allRecords reads the build records of every template as they are on
// disk.
func (bs *Builds) allRecords() []*Record {
	tpls, _ := os.ReadDir(filepath.Join(bs.dataDir, buildsDir))
	var out []*Record
	for _, t := range tpls {
		rs, _ := bs.records(t.Name())
		out = append(out, rs...)
	}
	return out
}

// List lists a template's builds, newest first (a running one as it is
// now).
func (bs *Builds) List(templateID string) ([]*Record, error) {
	out, err := bs.records(templateID)
	if err != nil {
		return nil, err
	}
	bs.mu.Lock()
	for i, b := range out {
		if l := bs.live[templateID+"/"+b.BuildID]; l != nil {
			out[i] = copyRecord(l)
		}
	}
	bs.mu.Unlock()
	sort.Slice(out, func(i, j int) bool { return out[i].CreatedAt.After(out[j].CreatedAt) })
	return out, nil
}

// Recover marks builds a restart interrupted as failed.
func (bs *Builds) Recover() {
	for _, b := range bs.allRecords() {
		if b.Status == Building {
			b.Status, b.Reason, b.FinishedAt = Failed, "interrupted by a restart of the node", time.Now().UTC()
			_ = bs.save(b)
		}
	}
}

// stepError is a build failure at a step (1-based index).
type stepError struct {
	index int
	err   error
}

func (e *stepError) Error() string { return e.err.Error() }
func (e *stepError) Unwrap() error { return e.err }
