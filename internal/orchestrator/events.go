package orchestrator

import (
	"context"
	"errors"
	"time"

	"github.com/agentenv/agentenv/internal/errkind"
	"github.com/agentenv/agentenv/internal/events"
	"github.com/agentenv/agentenv/internal/sandboxes"
)

// The node's lifecycle events (package events) are emitted here, around
// the operations that make them; the node's own sandboxes (builds,
// template snapshots) emit none.

// emit sends an event about s to the configured sink.
func (n *Node) emit(t events.Type, s *sandboxes.Sandbox, detail map[string]string) {
	if n.cfg.Events == nil || s == nil || s.Internal() {
		return
	}
	ev := events.New(t, s.ID, s.TemplateID, s.Metadata)
	ev.Detail = detail
	if t == events.Killed || t == events.Paused {
		ev.Execution = &events.Execution{StartedAt: s.StartedAt, VCPUs: s.VCPUs, MemoryMiB: s.MemoryMiB,
			Duration: time.Since(s.StartedAt)}
	}
	n.cfg.Events.Emit(ev)
}

// refusal reports whether err is a refusal of the request (bad input,
// nothing there, a conflict, no capacity, a client that went) rather than
// a failure of the node: only failures are "failed" events.
func refusal(err error) bool {
	for _, kind := range []error{errkind.ErrInvalid, errkind.ErrNotFound, errkind.ErrConflict, errkind.ErrCapacity,
		errkind.ErrTooLarge, context.Canceled} {
		if errors.Is(err, kind) {
			return true
		}
	}
	return false
}

// emitFailure sends a failed event for what (a create, a resume, a fork
// child) of s, when err is the node's failure.
func (n *Node) emitFailure(what string, s *sandboxes.Sandbox, err error, detail map[string]string) {
	if err == nil || refusal(err) {
		return
	}
	d := map[string]string{"operation": what, "error": err.Error()}
	for k, v := range detail {
		d[k] = v
	}
	n.emit(events.Failed, s, d)
}

// Create makes a sandbox (see create) and says so: created, or failed.
func (n *Node) Create(ctx context.Context, req CreateRequest) (*sandboxes.Sandbox, error) {
	s, err := n.create(ctx, req)
	if err != nil {
		n.emitFailure("create", &sandboxes.Sandbox{TemplateID: req.TemplateID, Metadata: req.Metadata}, err, nil)
		return nil, err
	}
	n.emit(events.Created, s, nil)
	return s, nil
}

// Kill ends a sandbox (see kill) and says so.
func (n *Node) Kill(ctx context.Context, id string) error {
	s, _ := n.records.Get(ctx, id)
	if err := n.kill(ctx, id); err != nil {
		return err
	}
	n.emit(events.Killed, s, nil)
	return nil
}

// Pause stops a running sandbox and keeps it on disk: the guest's vCPUs are
// stopped, its device state is saved beside its RAM file (guest memory is a
// shared file mapping, so only devices need writing), and QEMU exits, freeing
// its memory and CPU. Resume brings it back where it stopped. The pause
// runs to its end whatever the caller does; when it fails the sandbox runs
// on as before.
// It says so (a paused event).
func (n *Node) Pause(ctx context.Context, id string) (*sandboxes.Sandbox, error) {
	s, err := n.pause(ctx, id, true)
	if err == nil {
		n.emit(events.Paused, s, map[string]string{"mode": "full"})
	}
	return s, err
}

// PauseFilesystem pauses a running sandbox keeping only its file system
// (E2B's memory: false): the guest's writes are synced to its disk, its
// vCPUs stop (QEMU flushes the disk), QEMU exits and the RAM is not kept.
// Resume boots the sandbox again on that disk: running processes are gone,
// the template's start command runs again. A failure leaves the sandbox
// running as before.
// It says so (a paused event).
func (n *Node) PauseFilesystem(ctx context.Context, id string) (*sandboxes.Sandbox, error) {
	s, err := n.pause(ctx, id, false)
	if err == nil {
		n.emit(events.Paused, s, map[string]string{"mode": "filesystem"})
	}
	return s, err
}

// ResumeWith resumes a paused sandbox (see resumeWith) and says so:
// resumed, or failed.
func (n *Node) ResumeWith(ctx context.Context, id string, opts ResumeOptions) (*sandboxes.Sandbox, error) {
	s, err := n.resumeWith(ctx, id, opts)
	if err != nil {
		if rec, gerr := n.records.Get(context.WithoutCancel(ctx), id); gerr == nil {
			n.emitFailure("resume", rec, err, nil)
		}
		return nil, err
	}
	n.emit(events.Resumed, s, nil)
	return s, nil
}

// Fork clones a running sandbox (see fork) and says so for each child:
// forked, or failed.
func (n *Node) Fork(ctx context.Context, id string, count int, timeout time.Duration) ([]ForkResult, error) {
	kids, err := n.fork(ctx, id, count, timeout)
	parent, _ := n.records.Get(context.WithoutCancel(ctx), id)
	for _, k := range kids {
		if k.Err == nil {
			n.emit(events.Forked, k.Sandbox, map[string]string{"parent": id})
		} else if parent != nil {
			n.emitFailure("fork child", parent, k.Err, map[string]string{"parent": id})
		}
	}
	return kids, err
}

// Snapshot captures a running sandbox under name. The sandbox is paused for
// the capture and then runs on. The capture runs to its end whatever the
// caller does; when the sandbox cannot run on afterwards, the snapshot is
// kept and the sandbox rests paused at it.
// It says so (a checkpointed event).
func (n *Node) Snapshot(ctx context.Context, id, name string) (*NamedSnapshot, error) {
	ns, err := n.snapshot(ctx, id, name, true)
	if err == nil {
		n.emitSnapshot(ctx, id, ns, "full")
	}
	return ns, err
}

// SnapshotFilesystem snapshots only a running sandbox's filesystem under
// name (E2B's snapshot mode "filesystem"): its guest syncs, its vCPUs stop
// while its disk and volumes are copied, and it runs on. Sandboxes made
// from the snapshot boot from that disk, of any size.
// It says so (a checkpointed event).
func (n *Node) SnapshotFilesystem(ctx context.Context, id, name string) (*NamedSnapshot, error) {
	ns, err := n.snapshot(ctx, id, name, false)
	if err == nil {
		n.emitSnapshot(ctx, id, ns, "filesystem")
	}
	return ns, err
}

func (n *Node) emitSnapshot(ctx context.Context, id string, ns *NamedSnapshot, mode string) {
	if s, err := n.records.Get(context.WithoutCancel(ctx), id); err == nil {
		n.emit(events.Snapshot, s, map[string]string{"snapshotID": ns.Name, "mode": mode})
	}
}
