package orchestrator

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/agentenv/agentenv/internal/sandboxes"
	"github.com/agentenv/agentenv/internal/sharing"
	"github.com/agentenv/agentenv/internal/storage"
	"github.com/agentenv/agentenv/internal/store"
	"github.com/agentenv/agentenv/internal/templates"
)

// Paused sandboxes in shared storage (Config.SharePaused): after a pause the
// node uploads the sandbox (its record, saved state, disk as one layer over
// the template, and its RAM or the RAM image it is relative to) to the
// repository, through package sharing, whose claims settle which node owns
// it. Any node of the cluster asked to resume (or kill) a sandbox it does
// not hold takes it from there. A node that finds its paused copy claimed by
// another drops it.

// ramSnapshotPrefix names the local snapshot dirs that hold RAM images
// fetched from the repository.
const ramSnapshotPrefix = "ram-"

func (n *Node) sharesPaused() bool { return n.shelf != nil }

// notHere is the error for a sandbox this node does not have.
func (n *Node) notHere(err error) error {
	if n.shareErr != nil && errors.Is(err, ErrNotFound) {
		return fmt.Errorf("%w (it may be paused on another node: %v)", err, n.shareErr)
	}
	return err
}

// sharePausedLater uploads a paused sandbox in the background, holding its
// operation lock (a resume waits for the upload).
func (n *Node) sharePausedLater(id string) {
	n.wg.Add(1)
	go func() {
		defer n.wg.Done()
		ctx, cancel := n.stopContext()
		defer cancel()
		unlock := n.lockOp(id)
		defer unlock()
		s, err := n.records.Get(ctx, id)
		if err != nil || s.State != sandboxes.Paused {
			return
		}
		if len(s.Volumes) > 0 {
			n.log.Info("a paused sandbox with volumes stays on this node (their disks are this node's)", "sandbox", id)
			return
		}
		start := time.Now()
		if err := n.sharePaused(ctx, s); err != nil {
			n.log.Error("upload of a paused sandbox failed; it resumes only on this node", "sandbox", id, "err", err)
			return
		}
		n.log.Info("paused sandbox in shared storage", "sandbox", id, "took", time.Since(start).Round(time.Millisecond))
	}()
}

// baseTemplate is the template a sandbox's disk stacks on (for a sandbox of
// a named snapshot: the snapshot's template).
func (n *Node) baseTemplate(ctx context.Context, s *sandboxes.Sandbox) (*Template, error) {
	t, err := n.Template(s.TemplateID)
	if err == nil || !errors.Is(err, ErrNotFound) {
		return t, err
	}
	ns, nerr := n.lookupSnapshot(ctx, s.TemplateID)
	if nerr != nil {
		return nil, err
	}
	return n.Template(ns.TemplateID)
}

// ramID is the repository id of the RAM image a copy-on-write sandbox maps.
func (n *Node) ramID(s *sandboxes.Sandbox) (string, error) {
	base := n.memoryBaseOf(s)
	if base == "" {
		return "", fmt.Errorf("sandbox %s maps RAM image %s, which is no snapshot of this node", s.ID, s.MemFile)
	}
	return strings.TrimPrefix(base, ramSnapshotPrefix), nil
}

// sharePaused uploads a paused sandbox (its op lock held; one with volumes
// is not offered, see sharePausedLater).
func (n *Node) sharePaused(ctx context.Context, s *sandboxes.Sandbox) error {
	dir := n.sandboxDir(s.ID)
	rec, err := readPauseRecord(dir)
	if err != nil {
		return err
	}
	t, err := n.baseTemplate(ctx, s)
	if err != nil {
		return err
	}
	ident, err := templates.Identity(ctx, t)
	if err != nil {
		return err
	}
	stage, err := os.MkdirTemp(filepath.Dir(dir), ".share-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(stage)
	// The disk: one layer with every block that differs from the template.
	disk := filepath.Join(stage, exportDiskName)
	if _, err := storage.CloneFile(filepath.Join(dir, overlayName), disk); err != nil {
		return err
	}
	if out, err := exec.CommandContext(ctx, "qemu-img", "rebase", "-q", "-f", "qcow2", "-b", t.RootDisk, "-F", "qcow2", disk).CombinedOutput(); err != nil {
		return fmt.Errorf("flatten disk: %v: %s", err, strings.TrimSpace(string(out)))
	}
	if !rec.FilesystemOnly {
		if err := os.Link(filepath.Join(dir, stateFileName), filepath.Join(stage, stateFileName)); err != nil {
			return err
		}
	}
	pause, err := json.Marshal(rec)
	if err != nil {
		return err
	}
	up := &sharing.Record{Sandbox: *s, Pause: pause, Generation: sharing.NewGeneration(), Template: t.Name,
		TemplateIdentity: ident, SharedAt: time.Now().UTC()}
	switch {
	case rec.FilesystemOnly:
		// The disk is all there is.
	case s.MemPrivate:
		// The state holds the pages that differ from an image: that image
		// goes to the repository once, for every sandbox relative to it.
		if up.RAM, err = n.ramID(s); err != nil {
			return err
		}
		if !n.shelf.HasRAM(ctx, up.RAM) {
			rdir := filepath.Join(stage, "ram")
			if err := os.Mkdir(rdir, 0o700); err != nil {
				return err
			}
			if err := os.Link(s.MemFile, filepath.Join(rdir, snapMemName)); err != nil {
				return err
			}
			if err := n.shelf.PutRAM(ctx, up.RAM, rdir); err != nil {
				return err
			}
			os.RemoveAll(rdir)
		}
	default:
		if err := os.Link(filepath.Join(dir, memFileName), filepath.Join(stage, memFileName)); err != nil {
			return err
		}
	}
	// The mark first: a local copy that may be in the repository claims it
	// before it resumes (a claim of a generation never uploaded is just
	// won).
	if err := sharing.WriteMark(dir, up); err != nil {
		return err
	}
	return n.shelf.Put(ctx, stage, up)
}

// takeBackShared makes a shared paused sandbox of this node local again
// before it resumes here; ErrNotFound (after dropping the local copy) when
// another node took it meanwhile.
func (n *Node) takeBackShared(ctx context.Context, s *sandboxes.Sandbox) error {
	m, ok := sharing.ReadMark(n.sandboxDir(s.ID))
	if !ok {
		return nil
	}
	if err := n.shelf.Claim(ctx, s.ID, m.Generation); err != nil {
		if errors.Is(err, ErrConflict) {
			n.log.Warn("a paused sandbox moved to another node; dropping this node's copy", "sandbox", s.ID)
			n.destroy(context.WithoutCancel(ctx), s)
			return fmt.Errorf("%w: sandbox %s runs on another node now", ErrNotFound, s.ID)
		}
		return err
	}
	if err := sharing.RemoveMark(n.sandboxDir(s.ID)); err != nil {
		return err
	}
	if err := n.shelf.Remove(ctx, s.ID); err != nil {
		n.log.Warn("remove a resumed sandbox from shared storage", "sandbox", s.ID, "err", err)
	}
	return nil
}

// adoptShared copies a paused sandbox another node left in the repository
// and records it here as a shared paused sandbox (its op lock held); the
// resume that asked for it claims it next.
func (n *Node) adoptShared(ctx context.Context, id string) (*sandboxes.Sandbox, error) {
	if !n.sharesPaused() || !validSandboxID(id) {
		return nil, fmt.Errorf("%w: sandbox %q", ErrNotFound, id)
	}
	root := filepath.Join(n.cfg.DataDir, "sandboxes")
	if err := os.MkdirAll(root, 0o700); err != nil {
		return nil, err
	}
	stage, err := os.MkdirTemp(root, ".adopt-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(stage)
	start := time.Now()
	up, err := n.shelf.Get(ctx, id, stage)
	if err != nil {
		return nil, err
	}
	var pause pauseRecord
	if err := json.Unmarshal(up.Pause, &pause); err != nil {
		return nil, fmt.Errorf("%w: shared paused sandbox %s pause record: %v", ErrCorrupt, id, err)
	}
	t, err := n.Template(up.Template)
	if errors.Is(err, ErrNotFound) {
		t, err = n.remote.Pull(ctx, up.Template)
	}
	if err != nil {
		return nil, fmt.Errorf("sandbox %s needs template %s: %w", id, up.Template, err)
	}
	ident, err := templates.Identity(ctx, t)
	if err != nil {
		return nil, err
	}
	if ident != up.TemplateIdentity {
		return nil, fmt.Errorf("%w: sandbox %s was paused over another build of template %s than this node has", ErrConflict, id, up.Template)
	}
	s := up.Sandbox
	s.State, s.PID, s.SnapshotID, s.MemFile, s.MemPrivate, s.BaseLayer = sandboxes.Paused, 0, "", "", false, t.Layer
	if up.RAM != "" {
		var lease *store.Lease
		if s.MemFile, lease, err = n.fetchRAM(ctx, up.RAM); err != nil {
			return nil, err
		}
		defer lease.Drop(context.WithoutCancel(ctx)) // once the record holds it
		s.MemPrivate = true
	}
	disk := filepath.Join(stage, exportDiskName)
	if out, err := exec.CommandContext(ctx, "qemu-img", "rebase", "-u", "-b", t.RootDisk, "-F", "qcow2", disk).CombinedOutput(); err != nil {
		return nil, fmt.Errorf("rebase disk: %v: %s", err, strings.TrimSpace(string(out)))
	}
	if err := os.Rename(disk, filepath.Join(stage, overlayName)); err != nil {
		return nil, err
	}
	if err := storage.WriteJSONAtomic(filepath.Join(stage, pauseRecordName), pause, 0o600); err != nil {
		return nil, err
	}
	// Everything is here: record it as a shared paused sandbox of this
	// node (marked with the generation), and only then claim it (the
	// caller's resume does, as for any shared paused sandbox): a claim is
	// never made for a copy this node could lose, and a copy that loses
	// the claim is dropped.
	if err := sharing.WriteMark(stage, up); err != nil {
		return nil, err
	}
	dir := n.sandboxDir(id)
	os.RemoveAll(dir)
	if err := os.Rename(stage, dir); err != nil {
		return nil, err
	}
	if err := n.records.InsertNew(ctx, &s); err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	n.log.Info("adopted a paused sandbox from shared storage", "sandbox", id, "from", up.Node, "took", time.Since(start).Round(time.Millisecond))
	return &s, nil
}

// fetchRAM makes a RAM image of the repository available as a local
// snapshot (kept while sandboxes map it; held by the returned lease until
// a record does) and returns its path.
func (n *Node) fetchRAM(ctx context.Context, ramID string) (string, *store.Lease, error) {
	id := ramSnapshotPrefix + ramID
	final := n.snapshotDir(id)
	path := filepath.Join(final, snapMemName)
	lease, err := n.store.NewLease(ctx, "RAM image "+ramID, n.cfg.OperationTimeout)
	if err != nil {
		return "", nil, err
	}
	// hold records the image (its files in place) under the lease, where
	// garbage collection cannot overlap; false if the files are not there.
	hold := func() (bool, error) {
		there := false
		err := n.store.Reuse(ctx, func(tx *sql.Tx) error {
			if _, err := os.Stat(path); err != nil {
				return nil
			}
			there = true
			if err := n.store.Add(tx, id, store.KindSnapshot, final); err != nil {
				return err
			}
			return lease.Hold(tx, id)
		})
		return there, err
	}
	fail := func(err error) (string, *store.Lease, error) {
		lease.Drop(context.WithoutCancel(ctx))
		return "", nil, err
	}
	if there, err := hold(); err != nil {
		return fail(err)
	} else if there {
		return path, lease, nil
	}
	stage, err := os.MkdirTemp(filepath.Join(n.cfg.DataDir, snapshotsDir), ".ram-")
	if err != nil {
		return fail(err)
	}
	defer os.RemoveAll(stage)
	if err := n.shelf.GetRAM(ctx, ramID, stage); err != nil {
		return fail(err)
	}
	if err := os.Rename(stage, final); err != nil {
		if _, serr := os.Stat(path); serr != nil {
			return fail(err)
		}
		// fetched meanwhile
	}
	if there, err := hold(); err != nil || !there {
		return fail(fmt.Errorf("record RAM image %s: %v", ramID, err))
	}
	return path, lease, nil
}

// reapMovedLoop drops, now and then, the local copies of shared paused
// sandboxes that another node has taken.
func (n *Node) reapMovedLoop() {
	defer n.wg.Done()
	for {
		n.reapMoved()
		select {
		case <-n.stop:
			return
		case <-time.After(10 * time.Second):
		}
	}
}

func (n *Node) reapMoved() {
	ctx, cancel := n.stopContext()
	defer cancel()
	all, err := n.records.List(ctx, "state = ?", sandboxes.Paused)
	if err != nil {
		return
	}
	for _, s := range all {
		m, ok := sharing.ReadMark(n.sandboxDir(s.ID))
		if !ok {
			continue
		}
		if taken, err := n.shelf.Claimed(ctx, s.ID, m.Generation); err != nil || !taken {
			continue
		}
		unlock := n.lockOp(s.ID)
		if cur, err := n.records.Get(ctx, s.ID); err == nil && cur.State == sandboxes.Paused {
			if m2, ok := sharing.ReadMark(n.sandboxDir(s.ID)); ok && m2.Generation == m.Generation {
				n.log.Info("a paused sandbox was resumed on another node; dropping this node's copy", "sandbox", s.ID)
				n.destroy(ctx, cur)
			}
		}
		unlock()
	}
}
