package orchestrator

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"time"
)

// Build records: the E2B template API creates a build (POST /v3/templates),
// starts it with its steps, and polls its status and logs. Each build is a
// record in <data>/builds/<template>/<build>.json, rewritten atomically as
// the build goes on; a build a restart interrupts is recorded as failed.

const buildsDir = "builds"

// Build states, as the E2B API names them.
const (
	BuildWaiting  = "waiting"
	BuildBuilding = "building"
	BuildReady    = "ready"
	BuildError    = "error"
)

// BuildLogEntry is one line of a build's log.
type BuildLogEntry struct {
	Timestamp time.Time `json:"timestamp"`
	Level     string    `json:"level"`
	Message   string    `json:"message"`
	Step      string    `json:"step,omitempty"`
}

// BuildRecord is a template build.
type BuildRecord struct {
	TemplateID string          `json:"templateID"`
	BuildID    string          `json:"buildID"`
	Status     string          `json:"status"`
	VCPUs      int             `json:"cpuCount"`
	MemoryMiB  int             `json:"memoryMB"`
	Logs       []BuildLogEntry `json:"logs"`
	// Reason says why a build failed, and at which step.
	Reason     string    `json:"reason,omitempty"`
	ReasonStep string    `json:"reasonStep,omitempty"`
	CreatedAt  time.Time `json:"createdAt"`
	FinishedAt time.Time `json:"finishedAt,omitempty"`
}

// maxBuildLogs bounds a build's recorded log.
const maxBuildLogs = 20000

type buildRegistry struct {
	mu   sync.Mutex
	live map[string]*BuildRecord // templateID/buildID of running builds
}

func (n *Node) buildPath(templateID, buildID string) string {
	return filepath.Join(n.cfg.DataDir, buildsDir, templateID, buildID+".json")
}

func (n *Node) saveBuild(b *BuildRecord) error {
	if err := os.MkdirAll(filepath.Dir(n.buildPath(b.TemplateID, b.BuildID)), 0o755); err != nil {
		return err
	}
	return writeJSONAtomic(n.buildPath(b.TemplateID, b.BuildID), b)
}

// RequestBuild registers a new build of template name.
func (n *Node) RequestBuild(name string, vcpus, memMiB int) (*BuildRecord, error) {
	if !templateNameRE.MatchString(name) {
		return nil, fmt.Errorf("%w: template name %q must match %s", ErrInvalid, name, templateNameRE)
	}
	if vcpus < 0 || vcpus > n.cfg.MaxVCPUs {
		return nil, fmt.Errorf("%w: cpuCount %d is outside 1..%d", ErrInvalid, vcpus, n.cfg.MaxVCPUs)
	}
	if memMiB != 0 && (memMiB < 128 || memMiB > n.cfg.MaxMemoryMiB) {
		return nil, fmt.Errorf("%w: memoryMB %d is outside 128..%d", ErrInvalid, memMiB, n.cfg.MaxMemoryMiB)
	}
	if _, err := n.namedSnapshot(name); err == nil {
		return nil, fmt.Errorf("%w: %q is a snapshot's name", ErrConflict, name)
	}
	b := &BuildRecord{TemplateID: name, BuildID: NewSandboxID(), Status: BuildWaiting, VCPUs: vcpus, MemoryMiB: memMiB,
		Logs: []BuildLogEntry{}, CreatedAt: time.Now().UTC()}
	return b, n.saveBuild(b)
}

// Build reads a build's record (with its log so far).
func (n *Node) Build(templateID, buildID string) (*BuildRecord, error) {
	if !templateNameRE.MatchString(templateID) || !templateNameRE.MatchString(buildID) {
		return nil, fmt.Errorf("%w: build %s/%s", ErrNotFound, templateID, buildID)
	}
	n.builds.mu.Lock()
	if b := n.builds.live[templateID+"/"+buildID]; b != nil {
		cp := *b
		cp.Logs = append([]BuildLogEntry(nil), b.Logs...)
		n.builds.mu.Unlock()
		return &cp, nil
	}
	n.builds.mu.Unlock()
	var b BuildRecord
	if err := readJSON(n.buildPath(templateID, buildID), &b); err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil, fmt.Errorf("%w: build %s of template %s", ErrNotFound, buildID, templateID)
		}
		return nil, err
	}
	return &b, nil
}

// StartBuild runs a requested build in the background.
func (n *Node) StartBuild(templateID, buildID string, spec BuildSpec) error {
	b, err := n.Build(templateID, buildID)
	if err != nil {
		return err
	}
	if b.Status != BuildWaiting {
		return fmt.Errorf("%w: build %s is %s", ErrConflict, buildID, b.Status)
	}
	spec.Template = templateID
	if spec.VCPUs == 0 {
		spec.VCPUs = b.VCPUs
	}
	if spec.MemoryMiB == 0 {
		spec.MemoryMiB = b.MemoryMiB
	}
	if spec.FromImage == "" {
		if _, err := n.Template(spec.FromTemplate); err != nil {
			return fmt.Errorf("%w: base template %q: %v", ErrInvalid, spec.FromTemplate, err)
		}
	}
	for i, st := range spec.Steps {
		if err := checkStep(n.cfg.DataDir, st); err != nil {
			return fmt.Errorf("%w: step %d: %v", ErrInvalid, i+1, err)
		}
	}
	key := templateID + "/" + buildID
	n.builds.mu.Lock()
	for k, other := range n.builds.live {
		if strings.HasPrefix(k, templateID+"/") && other.Status == BuildBuilding {
			n.builds.mu.Unlock()
			return fmt.Errorf("%w: template %s is being built (build %s)", ErrConflict, templateID, other.BuildID)
		}
	}
	b.Status = BuildBuilding
	n.builds.live[key] = b
	n.builds.mu.Unlock()
	if err := n.saveBuild(b); err != nil {
		return err
	}
	n.wg.Add(1)
	go func() {
		defer n.wg.Done()
		ctx, cancel := n.stopContext()
		defer cancel()
		lastSave := time.Now()
		logf := func(level, step, msg string) {
			n.builds.mu.Lock()
			if len(b.Logs) < maxBuildLogs {
				b.Logs = append(b.Logs, BuildLogEntry{Timestamp: time.Now().UTC(), Level: level, Message: msg, Step: step})
			}
			save := time.Since(lastSave) > time.Second
			n.builds.mu.Unlock()
			if save {
				lastSave = time.Now()
				n.builds.mu.Lock()
				cp := *b
				cp.Logs = append([]BuildLogEntry(nil), b.Logs...)
				n.builds.mu.Unlock()
				_ = n.saveBuild(&cp)
			}
		}
		err := n.BuildTemplate(ctx, spec, logf)
		n.builds.mu.Lock()
		b.FinishedAt = time.Now().UTC()
		if err != nil {
			b.Status, b.Reason = BuildError, err.Error()
			var se *stepError
			if errors.As(err, &se) {
				b.ReasonStep = fmt.Sprint(se.index)
			}
			b.Logs = append(b.Logs, BuildLogEntry{Timestamp: b.FinishedAt, Level: "error", Message: "build failed: " + err.Error()})
		} else {
			b.Status = BuildReady
		}
		delete(n.builds.live, key)
		n.builds.mu.Unlock()
		if err := n.saveBuild(b); err != nil {
			n.log.Error("save build record", "template", templateID, "build", buildID, "err", err)
		}
	}()
	return nil
}

// Builds lists a template's builds, newest first.
func (n *Node) Builds(templateID string) ([]*BuildRecord, error) {
	ents, err := os.ReadDir(filepath.Join(n.cfg.DataDir, buildsDir, templateID))
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, err
	}
	var out []*BuildRecord
	for _, e := range ents {
		if id, ok := strings.CutSuffix(e.Name(), ".json"); ok {
			if b, err := n.Build(templateID, id); err == nil {
				out = append(out, b)
			}
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].CreatedAt.After(out[j].CreatedAt) })
	return out, nil
}

// recoverBuilds marks builds a restart interrupted as failed.
func (n *Node) recoverBuilds() {
	root := filepath.Join(n.cfg.DataDir, buildsDir)
	tpls, _ := os.ReadDir(root)
	for _, t := range tpls {
		files, _ := os.ReadDir(filepath.Join(root, t.Name()))
		for _, f := range files {
			var b BuildRecord
			if !strings.HasSuffix(f.Name(), ".json") || readJSON(filepath.Join(root, t.Name(), f.Name()), &b) != nil {
				continue
			}
			if b.Status == BuildBuilding {
				b.Status, b.Reason, b.FinishedAt = BuildError, "interrupted by a restart of the node", time.Now().UTC()
				_ = n.saveBuild(&b)
			}
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

// DataDir is the node's data directory.
func (n *Node) DataDir() string { return n.cfg.DataDir }
