package orchestrator

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"sort"

	"github.com/agentenv/agentenv/internal/envd"
	"github.com/agentenv/agentenv/internal/storage"
)

// Template is a bootable image sandboxes are created from: a read-only root
// disk layer plus the defaults of sandboxes made from it.
type Template struct {
	Name        string `json:"name"`
	RootDisk    string `json:"-"`
	VCPUs       int    `json:"vcpus"`
	MemoryMiB   int    `json:"memoryMiB"`
	DiskMiB     int    `json:"diskMiB"`
	DefaultUser string `json:"defaultUser"`
	// EnvdVersion is the envd version inside sandboxes of this template.
	EnvdVersion string `json:"envdVersion"`
	// EnvVars are set in every sandbox of the template (a create's own
	// take precedence).
	EnvVars map[string]string `json:"envVars,omitempty"`
	// Image is the OCI image the template was imported from, if any.
	Image string `json:"image,omitempty"`
	// StartCmd is started (in the background, as StartUser in StartCwd)
	// when the template is booted for its snapshot, which is taken once
	// ReadyCmd exits 0; sandboxes resume with it running.
	StartCmd  string `json:"startCmd,omitempty"`
	ReadyCmd  string `json:"readyCmd,omitempty"`
	StartUser string `json:"startUser,omitempty"`
	StartCwd  string `json:"startCwd,omitempty"`
	// LazyLayers are the repository layers (bottom first) a template loaded
	// lazily boots from, served by the node's NBD server.
	LazyLayers []string `json:"lazyLayers,omitempty"`
}

var templateNameRE = regexp.MustCompile(`^[a-z0-9][a-z0-9._-]{0,62}$`)

const (
	templateFile   = "template.json"
	rootLayerName  = "rootfs.qcow2"
	templatesDir   = "templates"
	defaultVCPUs   = 2
	defaultMemMiB  = 512
	defaultEnvdVer = envd.DefaultVersion
)

// TemplateDir is where a template's files live under a data dir.
func TemplateDir(dataDir, name string) string { return filepath.Join(dataDir, templatesDir, name) }

// TemplateRootLayer is the path of a template's root disk layer.
func TemplateRootLayer(dataDir, name string) string {
	return filepath.Join(TemplateDir(dataDir, name), rootLayerName)
}

// installTemplateLayer gives template name a root layer that is a thin,
// read-only qcow2 overlay on layer (shared layers of imports and builds),
// put in place atomically.
func installTemplateLayer(ctx context.Context, dataDir, name, layer string) error {
	dir := TemplateDir(dataDir, name)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	tmp := filepath.Join(dir, ".rootfs.qcow2.tmp")
	_ = os.Remove(tmp)
	if err := storage.CreateOverlay(ctx, layer, tmp, 0); err != nil {
		return err
	}
	if err := os.Chmod(tmp, 0o444); err != nil {
		return err
	}
	return os.Rename(tmp, TemplateRootLayer(dataDir, name))
}

// RegisterTemplate records a template whose root layer is already in place
// (see TemplateRootLayer). The record is written atomically and last, so a
// template is listed only once it is complete.
func RegisterTemplate(dataDir string, t Template) error {
	if !templateNameRE.MatchString(t.Name) {
		return fmt.Errorf("%w: template name %q must match %s", ErrInvalid, t.Name, templateNameRE)
	}
	if _, err := os.Stat(TemplateRootLayer(dataDir, t.Name)); err != nil {
		return fmt.Errorf("template %s root layer: %w", t.Name, err)
	}
	if t.VCPUs == 0 {
		t.VCPUs = defaultVCPUs
	}
	if t.MemoryMiB == 0 {
		t.MemoryMiB = defaultMemMiB
	}
	if t.EnvdVersion == "" {
		t.EnvdVersion = defaultEnvdVer
	}
	b, err := json.MarshalIndent(t, "", "  ")
	if err != nil {
		return err
	}
	return storage.WriteFileAtomic(filepath.Join(TemplateDir(dataDir, t.Name), templateFile), append(b, '\n'), 0o644)
}

// Template looks a template up by name.
func (n *Node) Template(name string) (*Template, error) {
	return LoadTemplate(n.cfg.DataDir, name)
}

// LoadTemplate reads a registered template.
func LoadTemplate(dataDir, name string) (*Template, error) {
	if name == "" {
		return nil, fmt.Errorf("%w: templateID is required", ErrInvalid)
	}
	if !templateNameRE.MatchString(name) {
		return nil, fmt.Errorf("%w: template %q", ErrNotFound, name)
	}
	b, err := os.ReadFile(filepath.Join(TemplateDir(dataDir, name), templateFile))
	if errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("%w: template %q (build it with `aenv setup` or `aenv template build`)", ErrNotFound, name)
	}
	if err != nil {
		return nil, fmt.Errorf("read template %s: %w", name, err)
	}
	var t Template
	if err := json.Unmarshal(b, &t); err != nil {
		return nil, fmt.Errorf("template %s record is corrupt: %w", name, err)
	}
	t.Name = name
	t.RootDisk = TemplateRootLayer(dataDir, name)
	if _, err := os.Stat(t.RootDisk); err != nil {
		return nil, fmt.Errorf("template %s root layer missing: %w", name, err)
	}
	return &t, nil
}

// Templates lists the registered templates by name.
func (n *Node) Templates() ([]*Template, error) {
	ents, err := os.ReadDir(filepath.Join(n.cfg.DataDir, templatesDir))
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var out []*Template
	for _, e := range ents {
		if t, err := LoadTemplate(n.cfg.DataDir, e.Name()); err == nil {
			out = append(out, t)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out, nil
}

// DeleteTemplate removes a template: its layer files, its template snapshot
// and the sandboxes pre-started from it. A template that running or paused
// sandboxes (or named snapshots) still use is refused (ErrConflict): their
// disks stack on its layer.
func (n *Node) DeleteTemplate(ctx context.Context, name string) error {
	t, err := n.Template(name)
	if err != nil {
		return err
	}
	all, err := n.List(ctx)
	if err != nil {
		return err
	}
	for _, s := range all {
		if s.TemplateID == name {
			return fmt.Errorf("%w: template %s is used by sandbox %s (%s)", ErrConflict, name, s.ID, s.State)
		}
	}
	if named, err := n.Snapshots(); err == nil {
		for _, ns := range named {
			if ns.TemplateID == name {
				return fmt.Errorf("%w: template %s is used by snapshot %s", ErrConflict, name, ns.Name)
			}
		}
	}
	if ts, err := n.currentTemplateSnapshot(t); err == nil {
		n.mu.Lock()
		pooled := n.pool[ts.SnapshotID]
		delete(n.pool, ts.SnapshotID)
		n.mu.Unlock()
		for _, p := range pooled {
			n.destroy(ctx, p.s)
		}
	}
	if err := os.Remove(n.templateSnapshotRef(name)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	dir := TemplateDir(n.cfg.DataDir, name)
	gone := filepath.Join(filepath.Dir(dir), "."+name+".deleted")
	os.RemoveAll(gone)
	if err := os.Rename(dir, gone); err != nil {
		return err
	}
	if err := os.RemoveAll(gone); err != nil {
		n.log.Warn("remove a deleted template's files", "template", name, "err", err)
	}
	n.gcSnapshots(ctx)
	n.log.Info("template deleted", "template", name)
	return nil
}
