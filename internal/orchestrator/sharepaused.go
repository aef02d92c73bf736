package orchestrator

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/agentenv/agentenv/internal/storage"
	"github.com/agentenv/agentenv/internal/storage/repository"
	"github.com/agentenv/agentenv/internal/store"
	"github.com/agentenv/agentenv/internal/templates"
)

// Paused sandboxes in shared storage (Config.SharePaused): after a pause the
// node uploads the sandbox (its record, saved state, disk as one layer over
// the template, and its RAM or the RAM image it is relative to) to the
// repository. Any node of the cluster asked to resume (or kill) a sandbox it
// does not hold takes it from there. Who owns a shared sandbox is settled by
// the repository's atomic Put: resuming a shared sandbox, here or elsewhere,
// first puts a claim named after the sandbox and the generation of its
// upload; of two nodes racing, one gets ErrExists and backs off. A node
// that finds its paused copy claimed by another drops it.

const (
	repoKindPaused   = "paused"
	repoKindRAM      = "ram"
	repoKindClaim    = "claim"
	sharedRecordFile = "sandbox.json"
	sharedMarkName   = "shared.json"
	claimFileName    = "claim"
	// ramSnapshotPrefix names the local snapshot dirs that hold RAM images
	// fetched from the repository.
	ramSnapshotPrefix = "ram-"
)

// sharedPaused is a paused sandbox as stored in the repository.
type sharedPaused struct {
	Sandbox Sandbox     `json:"sandbox"`
	Pause   pauseRecord `json:"pause"`
	// Generation names this upload; claims name it.
	Generation string `json:"generation"`
	// Template is the template whose root layer the disk layer stacks on,
	// and TemplateIdentity that layer chain's content.
	Template         string `json:"template"`
	TemplateIdentity string `json:"templateIdentity"`
	// RAM is the repository id of the RAM image the state is relative to
	// ("": the RAM file is in the upload).
	RAM      string    `json:"ram,omitempty"`
	SharedAt time.Time `json:"sharedAt"`
	Node     string    `json:"node"`
}

// sharedMark, in a sandbox dir, says the paused sandbox is in the
// repository as generation Generation.
type sharedMark struct {
	Generation string    `json:"generation"`
	SharedAt   time.Time `json:"sharedAt"`
}

func (n *Node) sharesPaused() bool {
	return n.cfg.SharePaused && n.cfg.Repository != nil && n.shareErr == nil
}

// checkSharing decides at start whether paused sandboxes can be shared:
// claims need a repository that refuses concurrent puts atomically
// (probed once); without it sharing is off and asking for a sandbox of
// another node says why.
func (n *Node) checkSharing(ctx context.Context) {
	if !n.cfg.SharePaused || n.cfg.Repository == nil {
		return
	}
	if err := repository.CheckAtomicPut(ctx, n.cfg.Repository); err != nil {
		n.shareErr = fmt.Errorf("%w: paused sandboxes are not shared between nodes: %v", ErrSetup, err)
		n.log.Error("cluster resume is off", "err", err)
	}
}

// notHere is the error for a sandbox this node does not have.
func (n *Node) notHere(err error) error {
	if n.shareErr != nil && errors.Is(err, ErrNotFound) {
		return fmt.Errorf("%w (it may be paused on another node: %v)", err, n.shareErr)
	}
	return err
}

func (n *Node) readSharedMark(id string) (*sharedMark, bool) {
	var m sharedMark
	if err := storage.ReadJSON(filepath.Join(n.sandboxDir(id), sharedMarkName), &m); err != nil || m.Generation == "" {
		return nil, false
	}
	return &m, true
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
		s, err := n.loadSandbox(ctx, id)
		if err != nil || s.State != StatePaused {
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
func (n *Node) baseTemplate(ctx context.Context, s *Sandbox) (*Template, error) {
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

// templateIdentity names the content of a template's layer chain (see
// templates.Identity).
func (n *Node) templateIdentity(ctx context.Context, t *Template) (string, error) {
	return templates.Identity(ctx, t)
}

// ramID is the repository id of the RAM image a copy-on-write sandbox maps.
func (n *Node) ramID(s *Sandbox) (string, error) {
	base := n.memoryBaseOf(s)
	if base == "" {
		return "", fmt.Errorf("sandbox %s maps RAM image %s, which is no snapshot of this node", s.ID, s.MemFile)
	}
	return strings.TrimPrefix(base, ramSnapshotPrefix), nil
}

// sharePaused uploads a paused sandbox (its op lock held).
func (n *Node) sharePaused(ctx context.Context, s *Sandbox) error {
	repo := n.cfg.Repository
	dir := n.sandboxDir(s.ID)
	rec, err := readPauseRecord(dir)
	if err != nil {
		return err
	}
	t, err := n.baseTemplate(ctx, s)
	if err != nil {
		return err
	}
	ident, err := n.templateIdentity(ctx, t)
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
	if err := os.Link(filepath.Join(dir, stateFileName), filepath.Join(stage, stateFileName)); err != nil {
		return err
	}
	up := sharedPaused{Sandbox: *s, Pause: *rec, Generation: randomHex(8), Template: t.Name, TemplateIdentity: ident,
		SharedAt: time.Now().UTC(), Node: n.cfg.Instance}
	up.Sandbox.Phases = nil
	if s.MemPrivate {
		// The state holds the pages that differ from an image: that image
		// goes to the repository once, for every sandbox relative to it.
		if up.RAM, err = n.ramID(s); err != nil {
			return err
		}
		if _, err := repo.Stat(ctx, repoKindRAM, up.RAM); err != nil {
			rdir := filepath.Join(stage, "ram")
			if err := os.Mkdir(rdir, 0o700); err != nil {
				return err
			}
			if err := os.Link(s.MemFile, filepath.Join(rdir, snapMemName)); err != nil {
				return err
			}
			if _, err := repo.Put(ctx, repoKindRAM, up.RAM, rdir); err != nil && !errors.Is(err, repository.ErrExists) {
				return fmt.Errorf("upload RAM image: %w", err)
			}
			os.RemoveAll(rdir)
		}
	} else if err := os.Link(filepath.Join(dir, memFileName), filepath.Join(stage, memFileName)); err != nil {
		return err
	}
	if err := storage.WriteJSONAtomic(filepath.Join(stage, sharedRecordFile), up, 0o600); err != nil {
		return err
	}
	// The mark first: a local copy that may be in the repository claims it
	// before it resumes (a claim of a generation never uploaded is just
	// won).
	if err := storage.WriteJSONAtomic(filepath.Join(dir, sharedMarkName), sharedMark{Generation: up.Generation, SharedAt: up.SharedAt}, 0o600); err != nil {
		return err
	}
	if err := repo.Delete(ctx, repoKindPaused, s.ID); err != nil && !errors.Is(err, repository.ErrNotFound) {
		return err
	}
	_, err = repo.Put(ctx, repoKindPaused, s.ID, stage)
	return err
}

// claim takes ownership of generation gen of a shared sandbox; ErrConflict
// when another node (or this one, earlier) has it.
func (n *Node) claim(ctx context.Context, id, gen string) error {
	dir, err := os.MkdirTemp("", "aenv-claim-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	if err := os.WriteFile(filepath.Join(dir, claimFileName), []byte(n.cfg.Instance+"\n"), 0o600); err != nil {
		return err
	}
	_, err = n.cfg.Repository.Put(ctx, repoKindClaim, id+"-"+gen, dir)
	if errors.Is(err, repository.ErrExists) {
		return fmt.Errorf("%w: sandbox %s was taken by another node", ErrConflict, id)
	}
	return err
}

// claimed reports whether generation gen of a shared sandbox has an owner.
func (n *Node) claimed(ctx context.Context, id, gen string) (bool, error) {
	_, err := n.cfg.Repository.Stat(ctx, repoKindClaim, id+"-"+gen)
	if errors.Is(err, repository.ErrNotFound) {
		return false, nil
	}
	return err == nil, err
}

// takeBackShared makes a shared paused sandbox of this node local again
// before it resumes here; ErrNotFound (after dropping the local copy) when
// another node took it meanwhile.
func (n *Node) takeBackShared(ctx context.Context, s *Sandbox) error {
	m, ok := n.readSharedMark(s.ID)
	if !ok {
		return nil
	}
	if err := n.claim(ctx, s.ID, m.Generation); err != nil {
		if errors.Is(err, ErrConflict) {
			n.log.Warn("a paused sandbox moved to another node; dropping this node's copy", "sandbox", s.ID)
			n.destroy(context.WithoutCancel(ctx), s)
			return fmt.Errorf("%w: sandbox %s runs on another node now", ErrNotFound, s.ID)
		}
		return err
	}
	os.Remove(filepath.Join(n.sandboxDir(s.ID), sharedMarkName))
	if err := n.cfg.Repository.Delete(ctx, repoKindPaused, s.ID); err != nil && !errors.Is(err, repository.ErrNotFound) {
		n.log.Warn("remove a resumed sandbox from shared storage", "sandbox", s.ID, "err", err)
	}
	return nil
}

// adoptShared copies a paused sandbox another node left in the repository
// and records it here as a shared paused sandbox (its op lock held); the
// resume that asked for it claims it next.
func (n *Node) adoptShared(ctx context.Context, id string) (*Sandbox, error) {
	if !n.sharesPaused() || !validSandboxID(id) {
		return nil, fmt.Errorf("%w: sandbox %q", ErrNotFound, id)
	}
	repo := n.cfg.Repository
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
	if _, err := repo.Get(ctx, repoKindPaused, id, stage); err != nil {
		if errors.Is(err, repository.ErrNotFound) {
			return nil, fmt.Errorf("%w: sandbox %q", ErrNotFound, id)
		}
		return nil, fmt.Errorf("fetch paused sandbox %s: %w", id, err)
	}
	var up sharedPaused
	if err := storage.ReadJSON(filepath.Join(stage, sharedRecordFile), &up); err != nil || up.Sandbox.ID != id || up.Generation == "" {
		return nil, fmt.Errorf("%w: shared paused sandbox %s record", ErrCorrupt, id)
	}
	t, err := n.Template(up.Template)
	if errors.Is(err, ErrNotFound) {
		t, err = n.remote.Pull(ctx, up.Template)
	}
	if err != nil {
		return nil, fmt.Errorf("sandbox %s needs template %s: %w", id, up.Template, err)
	}
	ident, err := n.templateIdentity(ctx, t)
	if err != nil {
		return nil, err
	}
	if ident != up.TemplateIdentity {
		return nil, fmt.Errorf("%w: sandbox %s was paused over another build of template %s than this node has", ErrConflict, id, up.Template)
	}
	s := up.Sandbox
	s.State, s.PID, s.SnapshotID, s.MemFile, s.MemPrivate, s.BaseLayer = StatePaused, 0, "", "", false, t.Layer
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
	os.Remove(filepath.Join(stage, sharedRecordFile))
	if err := storage.WriteJSONAtomic(filepath.Join(stage, pauseRecordName), up.Pause, 0o600); err != nil {
		return nil, err
	}
	// Everything is here: record it as a shared paused sandbox of this
	// node (marked with the generation), and only then claim it (the
	// caller's resume does, as for any shared paused sandbox): a claim is
	// never made for a copy this node could lose, and a copy that loses
	// the claim is dropped.
	if err := storage.WriteJSONAtomic(filepath.Join(stage, sharedMarkName), sharedMark{Generation: up.Generation, SharedAt: up.SharedAt}, 0o600); err != nil {
		return nil, err
	}
	dir := n.sandboxDir(id)
	os.RemoveAll(dir)
	if err := os.Rename(stage, dir); err != nil {
		return nil, err
	}
	if err := n.recordNew(ctx, &s); err != nil {
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
	if _, err := n.cfg.Repository.Get(ctx, repoKindRAM, ramID, stage); err != nil {
		return fail(fmt.Errorf("fetch RAM image %s: %w", ramID, err))
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

// forgetShared removes a shared sandbox that is killed: no node may adopt
// it afterwards.
func (n *Node) forgetShared(ctx context.Context, id, gen string) {
	if err := n.claim(ctx, id, gen); err != nil && !errors.Is(err, ErrConflict) {
		n.log.Warn("claim a killed shared sandbox", "sandbox", id, "err", err)
	}
	if err := n.cfg.Repository.Delete(ctx, repoKindPaused, id); err != nil && !errors.Is(err, repository.ErrNotFound) {
		n.log.Warn("remove a killed sandbox from shared storage", "sandbox", id, "err", err)
	}
}

// killShared kills a paused sandbox this node does not hold but the
// repository does.
func (n *Node) killShared(ctx context.Context, id string) error {
	if !n.sharesPaused() || !validSandboxID(id) {
		return fmt.Errorf("%w: sandbox %q", ErrNotFound, id)
	}
	stage, err := os.MkdirTemp("", "aenv-kill-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(stage)
	// Only the record is needed, but a Get is all-or-nothing; its size is
	// the state and disk layer, which a kill of a moved sandbox can afford.
	if _, err := n.cfg.Repository.Get(ctx, repoKindPaused, id, stage); err != nil {
		if errors.Is(err, repository.ErrNotFound) {
			return fmt.Errorf("%w: sandbox %q", ErrNotFound, id)
		}
		return err
	}
	var up sharedPaused
	if err := storage.ReadJSON(filepath.Join(stage, sharedRecordFile), &up); err != nil {
		return fmt.Errorf("%w: shared paused sandbox %s record", ErrCorrupt, id)
	}
	if err := n.claim(ctx, id, up.Generation); err != nil {
		return err
	}
	n.forgetShared(ctx, id, up.Generation)
	n.log.Info("killed a paused sandbox of another node from shared storage", "sandbox", id)
	return nil
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
	all, err := n.loadSandboxes(ctx, "state = ?", StatePaused)
	if err != nil {
		return
	}
	for _, s := range all {
		m, ok := n.readSharedMark(s.ID)
		if !ok {
			continue
		}
		if taken, err := n.claimed(ctx, s.ID, m.Generation); err != nil || !taken {
			continue
		}
		unlock := n.lockOp(s.ID)
		if cur, err := n.loadSandbox(ctx, s.ID); err == nil && cur.State == StatePaused {
			if m2, ok := n.readSharedMark(s.ID); ok && m2.Generation == m.Generation {
				n.log.Info("a paused sandbox was resumed on another node; dropping this node's copy", "sandbox", s.ID)
				n.destroy(ctx, cur)
			}
		}
		unlock()
	}
}
