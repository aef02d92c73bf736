package orchestrator

import (
	"context"
	"errors"
	"path/filepath"
	"time"

	"github.com/agentenv/agentenv/internal/buildfiles"
	"github.com/agentenv/agentenv/internal/builds"
	"github.com/agentenv/agentenv/internal/guestexec"
	"github.com/agentenv/agentenv/internal/sandboxes"
	"github.com/agentenv/agentenv/internal/templates"
)

// buildHost is what the node gives template builds (builds.Host): builder
// sandboxes, template snapshots, the pool, background work.
type buildHost struct{ n *Node }

func (h buildHost) StartBuilder(ctx context.Context, from *templates.Template, layerPath, layerID string, vcpus, memMiB int, name string) (builds.Builder, error) {
	t := *from
	t.RootDisk, t.Layer = layerPath, layerID
	s, err := h.n.Create(ctx, CreateRequest{TemplateID: name, VCPUs: vcpus, MemoryMiB: memMiB,
		Timeout: time.Hour, noSnapshot: true, template: &t, Metadata: map[string]string{"aenv.build": name, sandboxes.MetaInternal: "template build"}})
	if err != nil {
		return nil, err
	}
	return builderSandbox{n: h.n, s: s}, nil
}

func (h buildHost) PrepareTemplateSnapshot(ctx context.Context, name string) error {
	return h.n.PrepareTemplateSnapshot(ctx, name)
}

func (h buildHost) RefillTemplatePool(name string) { h.n.refillTemplatePool(name) }

func (h buildHost) SnapshotExists(name string) bool {
	_, err := h.n.namedSnapshot(name)
	return err == nil
}

func (h buildHost) Go(fn func(ctx context.Context)) {
	h.n.wg.Add(1)
	go func() {
		defer h.n.wg.Done()
		ctx, cancel := h.n.stopContext()
		defer cancel()
		fn(ctx)
	}()
}

// builderSandbox is a build's sandbox (builds.Builder).
type builderSandbox struct {
	n *Node
	s *sandboxes.Sandbox
}

func (b builderSandbox) Target() guestexec.Target {
	return guestexec.Target{Addr: b.s.EnvdAddr, Token: b.s.AccessToken}
}

func (b builderSandbox) Frozen(ctx context.Context, fn func(overlay string) error) error {
	m := b.n.machines.get(b.s.ID)
	if !alive(m) {
		return errors.New("the builder sandbox is gone")
	}
	if err := m.Pause(ctx); err != nil {
		return err
	}
	ferr := fn(filepath.Join(b.n.sandboxDir(b.s.ID), overlayName))
	if err := m.Resume(ctx); err != nil {
		return err
	}
	return ferr
}

func (b builderSandbox) Close() { _ = b.n.Kill(context.Background(), b.s.ID) }

// The parts of the template API the node serves through its builds.

// RequestBuild registers a new build of template name.
func (n *Node) RequestBuild(name string, tags []string, vcpus, memMiB int) (*builds.Record, error) {
	return n.builds.Request(name, tags, vcpus, memMiB)
}

// StartBuild runs a requested build in the background.
func (n *Node) StartBuild(templateID, buildID string, spec builds.Spec) error {
	if err := n.floor.Check("a template build"); err != nil {
		return err
	}
	return n.builds.Start(templateID, buildID, spec)
}

// Build reads a build's record (with its log so far).
func (n *Node) Build(templateID, buildID string) (*builds.Record, error) {
	return n.builds.Get(templateID, buildID)
}

// TemplateBuilds lists a template's builds, newest first.
func (n *Node) TemplateBuilds(templateID string) ([]*builds.Record, error) {
	return n.builds.List(templateID)
}

// DataDir is the node's data directory.
func (n *Node) DataDir() string { return n.cfg.DataDir }

// BuildFiles is the node's store of COPY archives (uploads and checked files).
func (n *Node) BuildFiles() *buildfiles.Store { return n.files }
