package orchestrator

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/agentenv/agentenv/internal/operation"
	"github.com/agentenv/agentenv/internal/sandboxes"
	"github.com/agentenv/agentenv/internal/storage"
	"github.com/agentenv/agentenv/internal/store"
)

// A filesystem snapshot is a running sandbox's disk (and its volumes'),
// without its memory: the guest syncs its filesystems, its vCPUs stop
// (QEMU writes out what it holds of the disks), the disk overlay and the
// volumes' disks are copied (reflinked where the filesystem can), and the
// vCPUs go on. The snapshot's disk stands on the sandbox's own chain (its
// template's layer or the snapshot it runs on), which the snapshot needs.

// captureFilesystem snapshots running sandbox id's filesystem into a new
// snapshot, held by the returned lease. On failure nothing of the snapshot
// stays and the sandbox runs on.
func (n *Node) captureFilesystem(ctx context.Context, id string) (string, *store.Lease, error) {
	s, err := n.records.Get(ctx, id)
	if err != nil {
		return "", nil, err
	}
	if !s.State.Resting() {
		return "", nil, sandboxes.Busy(s)
	}
	if s.State != sandboxes.Running {
		return "", nil, fmt.Errorf("%w: sandbox %s is %s; only running sandboxes can be snapshotted (resume it first)", ErrConflict, id, s.State)
	}
	unlock := n.lockOp(id)
	defer unlock()
	o := operation.Start(ctx, "filesystem snapshot", n.cfg.OperationTimeout, n.log)
	octx := o.Context()
	if s, err = n.records.Get(octx, id); err != nil {
		return "", nil, o.Finish(err)
	}
	if err := n.records.Move(octx, id, sandboxes.Running, sandboxes.Snapshotting, ""); err != nil {
		return "", nil, o.Finish(err)
	}
	n.resumeOnFailure(o, s, sandboxes.Snapshotting)
	m := n.machines.get(id)
	if !alive(m) {
		return "", nil, o.Finish(errors.New("no running machine"))
	}
	phase := s.PhaseTimer()
	var snapID string
	var lease *store.Lease
	if err := o.Do("record-snapshot", func(ctx context.Context) error {
		var err error
		snapID, lease, err = n.newSnapshot(ctx, "filesystem snapshot of "+id, n.storeRefs(s)...)
		return err
	}); err != nil {
		return "", nil, o.Finish(err)
	}
	stage := filepath.Join(n.cfg.DataDir, snapshotsDir, ".stage-"+snapID)
	n.forgetStageOnFailure(o, stage, lease)
	overlay := filepath.Join(n.sandboxDir(id), overlayName)
	info, err := storage.Info(octx, overlay)
	if err != nil {
		return "", nil, o.Finish(err)
	}
	if err := os.MkdirAll(stage, 0o700); err != nil {
		return "", nil, o.Finish(err)
	}
	if err := o.Do("guest-sync", func(ctx context.Context) error {
		if err := n.guestSync(ctx, s, guestSyncTimeout); err != nil {
			return fmt.Errorf("%w: the guest's envd did not sync its file systems (%v); a filesystem snapshot needs it to, a snapshot with memory does not", ErrConflict, err)
		}
		return nil
	}); err != nil {
		return "", nil, o.Finish(err)
	}
	phase("guest sync")
	if err := o.Do("stop-vcpus", func(ctx context.Context) error { return m.Pause(ctx) }); err != nil {
		return "", nil, o.Finish(err)
	}
	if err := o.Do("copy-disks", func(context.Context) error {
		if _, err := storage.CloneFile(overlay, filepath.Join(stage, snapDiskName)); err != nil {
			return err
		}
		return n.copyVolumes(s, stage)
	}); err != nil {
		return "", nil, o.Finish(err)
	}
	if err := o.Do("resume-vcpus", func(ctx context.Context) error { return m.Resume(ctx) }); err != nil {
		return "", nil, o.Finish(err)
	}
	phase("copy disks")
	man := snapshotManifest{ID: snapID, SandboxID: id, TemplateID: s.TemplateID, ParentLayer: info.BackingFilename,
		MemoryMiB: s.MemoryMiB, CreatedAt: time.Now().UTC(), FilesystemOnly: true}
	if err := o.Do("commit", func(context.Context) error { return commitStage(stage, n.snapshotDir(snapID), man) }); err != nil {
		return "", nil, o.Finish(err)
	}
	if err := o.Do("running", func(ctx context.Context) error {
		return n.records.Move(ctx, id, sandboxes.Snapshotting, sandboxes.Running, "")
	}); err != nil {
		return "", nil, o.Finish(err)
	}
	o.Finish(nil)
	n.log.Info("filesystem snapshot", "sandbox", id, "snapshot", snapID, "phases", s.Phases)
	return snapID, lease, nil
}
