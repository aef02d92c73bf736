package orchestrator

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/agentenv/agentenv/internal/guestexec"
	"github.com/agentenv/agentenv/internal/operation"
	"github.com/agentenv/agentenv/internal/sandboxes"
	"github.com/agentenv/agentenv/internal/store"
)

// A template snapshot is a sandbox of the template booted once, stopped the
// moment envd answered, and frozen like a fork snapshot (RAM image, disk
// layer, device state). Creating a sandbox whose size matches restores it
// instead of cold-booting: the new sandbox gets a copy of the RAM image (a
// reflink on XFS/btrfs), an overlay on the disk layer, and its identity,
// env vars and clock through envd's /init.

// templateSnapshotLabel is the store label kind that points, per template,
// at its current template snapshot on this node (data: templateSnapshot).
const templateSnapshotLabel = store.LabelTemplateSnapshot

type templateSnapshot struct {
	SnapshotID string `json:"snapshotID"`
	VCPUs      int    `json:"vcpus"`
	MemoryMiB  int    `json:"memoryMiB"`
	// Initrd and Kernel identify the boot files; a snapshot of other ones
	// is stale (its envd is not the current one).
	Initrd string `json:"initrdSHA256"`
	Kernel string `json:"kernel"`
	// Layer is the template's root layer the snapshot's disk stacks on; a
	// rebuilt template (its label moved to another layer) makes the
	// snapshot stale.
	Layer string `json:"layer"`
	// VolumeSlots is the frozen machine's number of volume slots; one
	// with another number than new machines have is stale.
	VolumeSlots int `json:"volumeSlots,omitempty"`
}

func (n *Node) currentTemplateSnapshot(t *Template) (*templateSnapshot, error) {
	l, err := n.store.Label(context.Background(), templateSnapshotLabel, t.Name)
	if err != nil {
		return nil, err
	}
	var ts templateSnapshot
	if err := json.Unmarshal([]byte(l.Data), &ts); err != nil {
		return nil, fmt.Errorf("%w: template %s snapshot record: %v", ErrCorrupt, t.Name, err)
	}
	ts.SnapshotID = l.Object
	if ts.Initrd != n.initrdSum || ts.Kernel != n.cfg.Kernel || ts.Layer != t.Layer || ts.VolumeSlots != VolumeSlots {
		return nil, fmt.Errorf("template %s snapshot is stale (built with other boot files or another build)", t.Name)
	}
	sdir := n.snapshotDir(ts.SnapshotID)
	for _, f := range []string{snapMemName, snapDiskName, snapStateName, snapManifestName} {
		if _, err := os.Stat(filepath.Join(sdir, f)); err != nil {
			return nil, fmt.Errorf("%w: template %s snapshot: %v", ErrCorrupt, t.Name, err)
		}
	}
	return &ts, nil
}

// PrepareTemplateSnapshot boots a template once and freezes it, so that
// later creates restore instead of cold-booting. It replaces a stale
// snapshot (the pooled sandboxes of the old one go); an up-to-date one is
// kept.
func (n *Node) PrepareTemplateSnapshot(ctx context.Context, name string) error {
	t, err := n.Template(name)
	if err != nil {
		return err
	}
	if _, err := n.currentTemplateSnapshot(t); err == nil {
		return nil
	}
	done, first := n.preparing.begin(name)
	if !first {
		// Another call prepares it: its result is this one's.
		select {
		case <-done:
		case <-ctx.Done():
			return ctx.Err()
		}
		_, err := n.currentTemplateSnapshot(t)
		return err
	}
	defer n.preparing.end(name)
	return n.prepareTemplateSnapshot(ctx, t)
}

// prepareTemplateSnapshot boots template t and freezes it (its
// preparation registered in n.preparing by the caller).
func (n *Node) prepareTemplateSnapshot(ctx context.Context, t *Template) error {
	name := t.Name
	start := time.Now()
	s, err := n.Create(ctx, CreateRequest{TemplateID: name, Timeout: 10 * time.Minute, noSnapshot: true,
		Metadata: map[string]string{sandboxes.MetaInternal: "template snapshot"}})
	if err != nil {
		return fmt.Errorf("boot template %s for its snapshot: %w", name, err)
	}
	// The boot sandbox has served its purpose either way.
	defer n.destroy(context.WithoutCancel(ctx), s)
	if t.StartCmd != "" {
		if err := n.startAndWaitReady(ctx, s, t); err != nil {
			return fmt.Errorf("template %s: %w", name, err)
		}
	}
	unlock := n.lockOp(s.ID)
	defer unlock()
	o := operation.Start(ctx, "template-snapshot", n.cfg.OperationTimeout, n.log)
	if err := n.records.Move(o.Context(), s.ID, sandboxes.Running, sandboxes.Snapshotting, ""); err != nil {
		return o.Finish(err)
	}
	snapID, lease, err := n.freeze(o, s, sandboxes.Snapshotting)
	if err != nil {
		return o.Finish(fmt.Errorf("freeze template %s: %w", name, err))
	}
	defer lease.Drop(context.WithoutCancel(ctx))
	ref := templateSnapshot{VCPUs: s.VCPUs, MemoryMiB: s.MemoryMiB, Initrd: n.initrdSum, Kernel: n.cfg.Kernel, Layer: t.Layer,
		VolumeSlots: s.VolumeSlots}
	b, _ := json.Marshal(ref)
	if err := n.store.Tx(o.Context(), func(tx *sql.Tx) error {
		return store.SetLabel(tx, templateSnapshotLabel, name, snapID, string(b))
	}); err != nil {
		return o.Finish(err)
	}
	o.Finish(nil)
	n.drainStalePool(ctx)
	n.log.Info("template snapshot ready", "template", name, "snapshot", snapID, "took", time.Since(start).Round(time.Millisecond))
	return nil
}

// restoreTemplate creates s from a template snapshot, on a RAM file of its
// own (a copy of the snapshot's image); authToken is the token that
// snapshot's envd holds.
func (n *Node) restoreTemplate(ctx context.Context, s *sandboxes.Sandbox, ts *templateSnapshot, authToken string) error {
	if err := os.MkdirAll(n.sandboxDir(s.ID), 0o700); err != nil {
		return err
	}
	phase := s.PhaseTimer()
	if err := n.copySnapshotRAM(ts.SnapshotID, s.ID); err != nil {
		return err
	}
	phase("copy RAM image")
	if err := n.restoreFromSnapshot(ctx, s, ts.SnapshotID, authToken, true); err != nil {
		return err
	}
	phase("restore")
	return nil
}

// prepareTemplateSnapshots builds missing or stale template snapshots in
// the background after the node starts.
func (n *Node) prepareTemplateSnapshots() {
	defer n.wg.Done()
	ts, err := n.Templates()
	if err != nil {
		n.log.Error("list templates", "err", err)
		return
	}
	ctx, cancel := n.stopContext()
	defer cancel()
	// Every template whose snapshot is missing is registered as being
	// prepared before the first is: a create of a template with a start
	// command waits for its snapshot rather than cold-booting beside it.
	var todo []*Template
	for _, t := range ts {
		if snap, err := n.currentTemplateSnapshot(t); err == nil {
			n.pool.Fill(ctx, poolKey(t, snap))
			continue
		}
		if _, first := n.preparing.begin(t.Name); first {
			todo = append(todo, t)
		}
	}
	for _, t := range todo {
		err := n.prepareTemplateSnapshot(ctx, t)
		n.preparing.end(t.Name)
		if err != nil && !errors.Is(err, context.Canceled) {
			n.log.Error("template snapshot", "template", t.Name, "err", err)
			continue
		}
		if snap, err := n.currentTemplateSnapshot(t); err == nil {
			n.pool.Fill(ctx, poolKey(t, snap))
		}
	}
}

// readyTimeout bounds how long a template's ready command may keep
// failing. The code-interpreter template's (Jupyter's kernel with numpy,
// pandas and matplotlib imported) took more than 5 minutes under TCG on a
// busy 2-core host.
const readyTimeout = 15 * time.Minute

// startAndWaitReady starts a template's start command in the background of
// its boot sandbox and polls its ready command until it exits 0.
func (n *Node) startAndWaitReady(ctx context.Context, s *sandboxes.Sandbox, t *Template) error {
	// Detached from envd's pipes, so the command outlives the shell
	// (nohup is not in every image; there is no terminal to hang up anyway).
	script := "/bin/sh -c " + guestexec.Quote(t.StartCmd) + " </dev/null >/tmp/.aenv-start.log 2>&1 &"
	g := guestexec.Target{Addr: s.EnvdAddr, Token: s.AccessToken}
	if code, err := guestexec.Run(ctx, g, guestexec.Command{User: t.StartUser, Cwd: t.StartCwd, Env: t.EnvVars, Script: script}); err != nil || code != 0 {
		return fmt.Errorf("start command: exit %d: %v", code, err)
	}
	if t.ReadyCmd == "" {
		return nil
	}
	deadline := time.Now().Add(readyTimeout)
	for {
		code, err := guestexec.Run(ctx, g, guestexec.Command{User: t.StartUser, Cwd: t.StartCwd, Env: t.EnvVars, Script: t.ReadyCmd})
		if err == nil && code == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("ready command %q did not succeed within %s (last exit %d, %v)", t.ReadyCmd, readyTimeout, code, err)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(500 * time.Millisecond):
		}
	}
}

// refillTemplatePool fills the pool of a template whose snapshot is new.
func (n *Node) refillTemplatePool(name string) {
	t, err := n.Template(name)
	if err != nil {
		return
	}
	if ts, err := n.currentTemplateSnapshot(t); err == nil {
		n.pool.Refill(poolKey(t, ts))
	}
}

// templatePreps are the template snapshots being prepared, each with a
// channel closed when its preparation ends.
type templatePreps struct {
	mu sync.Mutex
	by map[string]chan struct{}
}

// begin registers a preparation of template name; first is false when one
// is already under way (done is then its channel).
func (p *templatePreps) begin(name string) (done <-chan struct{}, first bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if ch, ok := p.by[name]; ok {
		return ch, false
	}
	if p.by == nil {
		p.by = map[string]chan struct{}{}
	}
	ch := make(chan struct{})
	p.by[name] = ch
	return ch, true
}

func (p *templatePreps) end(name string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if ch, ok := p.by[name]; ok {
		close(ch)
		delete(p.by, name)
	}
}

// underWay is the channel of a preparation of template name under way
// (nil: none).
func (p *templatePreps) underWay(name string) <-chan struct{} {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.by[name]
}
