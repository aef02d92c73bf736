package orchestrator

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/agentenv/agentenv/internal/faults"
	"github.com/agentenv/agentenv/internal/sandboxes"
	"github.com/agentenv/agentenv/internal/storage"
	"github.com/agentenv/agentenv/internal/vmm"
	"github.com/agentenv/agentenv/internal/warmpool"
)

// The fork pool keeps QEMUs started ahead for the children of the next
// fork of a sandbox that was forked before. A forked sandbox runs on, and
// every later fork of it captures incrementally against, the RAM image of
// its first fork (its memory base): the children of each such fork map
// that same image, copy-on-write, over a disk whose chain ends in the
// base's disk. So a machine can be started before the fork is asked for:
// recorded as a pooled sandbox, an overlay on the base's disk, its network
// up and a QEMU waiting for its state with the base's RAM image mapped.
// A fork takes up to one per child, stacks the fork's newer disk images
// under the machine's overlay (vmm.Machine.Restack, the images passed as
// descriptors), points the overlay's header at them and loads the fork's
// state: what a child saves is the QEMU start, its network set-up and
// overlay, at the cost of the restack (which opens the fork's images, up
// to the sealed chain's bound). Under TCG the guests' own CPU after the
// restore dominates a wide fork and the pool does not shorten it beyond
// noise (docs/PERFORMANCE.md, session 22), so it is off unless
// --fork-pool-size is given. The pool is keyed by the
// template and the memory base, filled after each fork of a sandbox (in
// the background, one machine at a time, its QEMU under SCHED_IDLE until a
// child claims it, so the refill takes no CPU from the children that just
// forked), and drained once no running
// sandbox has that memory base; only the most recently forked bases keep
// machines (forkPoolBases), so a node forking many sandboxes does not
// keep sixteen idle QEMUs for each.

// forkRebaseFault is the fault point between a pre-started machine's
// restack and its overlay's new header.
const forkRebaseFault = "fork/rebase-child-overlay"

// forkPoolBases is how many memory bases keep pre-started machines.
const forkPoolBases = 2

// forkShape is what a pre-started fork machine must match beyond its key
// (template and memory base): the size, disk and volume slots of the
// sandbox whose forks it serves.
type forkShape struct {
	vcpus       int
	memoryMiB   int
	diskMiB     int
	volumeSlots int
	defaultUser string
	workdir     string
	registered  time.Time
}

// forkShapes are the shapes the fork pool fills, by key, newest last.
type forkShapes struct {
	mu     sync.Mutex
	shapes map[warmpool.Key]forkShape
}

// add records the shape of a forked sandbox and returns the keys that no
// longer keep machines (beyond forkPoolBases).
func (f *forkShapes) add(key warmpool.Key, s forkShape) []warmpool.Key {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.shapes == nil {
		f.shapes = map[warmpool.Key]forkShape{}
	}
	s.registered = time.Now()
	f.shapes[key] = s
	var dropped []warmpool.Key
	for len(f.shapes) > forkPoolBases {
		var oldest warmpool.Key
		first := true
		for k, v := range f.shapes {
			if first || v.registered.Before(f.shapes[oldest].registered) {
				oldest, first = k, false
			}
		}
		delete(f.shapes, oldest)
		dropped = append(dropped, oldest)
	}
	return dropped
}

func (f *forkShapes) get(key warmpool.Key) (forkShape, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	s, ok := f.shapes[key]
	return s, ok
}

func (f *forkShapes) forget(key warmpool.Key) {
	f.mu.Lock()
	defer f.mu.Unlock()
	delete(f.shapes, key)
}

// forkPoolKey names the pre-started machines for forks of sandboxes of a
// template running on memory base memBase.
func forkPoolKey(templateID, memBase string) warmpool.Key {
	return warmpool.Key{Template: templateID, Snapshot: memBase}
}

// forkStarter makes and tears down the fork pool's machines.
type forkStarter struct{ n *Node }

// Start pre-starts a machine for the key's forks while a running sandbox
// still has its memory base.
func (f forkStarter) Start(ctx context.Context, key warmpool.Key) (*pooledSandbox, error) {
	shape, ok := f.n.forkShapes.get(key)
	if !ok || !f.n.forkBaseInUse(ctx, key) {
		f.n.forkShapes.forget(key)
		return nil, warmpool.ErrStale
	}
	return f.n.prestartFork(ctx, key, shape)
}

// Discard kills a pre-started fork machine and forgets it, and with it
// the memory base when nothing else needs that.
func (f forkStarter) Discard(ctx context.Context, e *pooledSandbox) {
	f.n.destroy(ctx, e.s)
	f.n.gc(ctx)
}

// forkBaseInUse reports whether a sandbox of the key's template that may
// fork runs on the key's memory base: running, or in an operation (a fork
// in progress shows its parent forking and its children creating).
// Pooled, paused and dying ones do not count.
func (n *Node) forkBaseInUse(ctx context.Context, key warmpool.Key) bool {
	image := filepath.Join(n.snapshotDir(key.Snapshot), snapMemName)
	list, err := n.records.List(ctx, "state NOT IN (?, ?, ?) AND template_id = ? AND mem_file = ? AND mem_private = 1",
		sandboxes.Pooled, sandboxes.Paused, sandboxes.Killing, key.Template, image)
	return err == nil && len(list) > 0
}

// drainForkPool discards the fork pool's machines of memory bases that no
// running sandbox has, or that are no longer among the newest.
func (n *Node) drainForkPool(ctx context.Context) {
	n.forkPool.DrainStale(ctx, func(k warmpool.Key) bool {
		if _, ok := n.forkShapes.get(k); !ok {
			return false
		}
		if !n.forkBaseInUse(ctx, k) {
			n.forkShapes.forget(k)
			return false
		}
		return true
	})
}

// prestartFork starts a machine for forks of sandboxes of shape: recorded
// as pooled, over an overlay on the memory base's disk, mapping its RAM
// image, and waiting for a state.
func (n *Node) prestartFork(ctx context.Context, key warmpool.Key, shape forkShape) (*pooledSandbox, error) {
	memBase := key.Snapshot
	now := time.Now().UTC().Truncate(time.Millisecond)
	s := &sandboxes.Sandbox{
		ID: NewSandboxID(), TemplateID: key.Template, State: sandboxes.Pooled, VCPUs: shape.vcpus, MemoryMiB: shape.memoryMiB,
		DiskMiB: shape.diskMiB, AllowInternet: true, PublicTraffic: true, DefaultUser: shape.defaultUser, DefaultWorkdir: shape.workdir,
		SnapshotID: memBase, MemFile: filepath.Join(n.snapshotDir(memBase), snapMemName), MemPrivate: true,
		VolumeSlots: shape.volumeSlots, CreatedAt: now, StartedAt: now, EndAt: now,
	}
	return n.startPooled(ctx, s, func() (*vmm.Machine, error) { return n.startIncoming(ctx, s, memBase, true) })
}

// forkStack is how the children of a fork can use pre-started machines:
// the disk images of the fork's snapshot above its memory base's disk
// (highest first), which each machine's overlay is put on.
type forkStack struct {
	key     warmpool.Key
	memBase string
	layers  []string
}

// forkStackOf tells whether the children of a fork of s into snapshot
// snapID can take pre-started machines, and how (nil: they cannot).
func (n *Node) forkStackOf(ctx context.Context, s *sandboxes.Sandbox, snapID string) *forkStack {
	if !n.qemu.RestacksDisks() || len(s.Volumes) > 0 {
		return nil
	}
	var man, base snapshotManifest
	if err := storage.ReadJSON(filepath.Join(n.snapshotDir(snapID), snapManifestName), &man); err != nil || man.MemoryBase == "" {
		return nil
	}
	if err := storage.ReadJSON(filepath.Join(n.snapshotDir(man.MemoryBase), snapManifestName), &base); err != nil {
		return nil
	}
	// The machines' network was made for the base's guest.
	if tapModeFor(man.GatewayMAC) != tapModeFor(base.GatewayMAC) {
		return nil
	}
	chain, err := storage.BackingChain(ctx, filepath.Join(n.snapshotDir(snapID), snapDiskName))
	if err != nil {
		return nil
	}
	baseDisk := filepath.Join(n.snapshotDir(man.MemoryBase), snapDiskName)
	for i, img := range chain {
		if img.Filename != baseDisk {
			continue
		}
		if i == 0 || img.VirtualSize != chain[0].VirtualSize {
			return nil
		}
		st := &forkStack{key: forkPoolKey(s.TemplateID, man.MemoryBase), memBase: man.MemoryBase}
		for _, l := range chain[:i] {
			st.layers = append(st.layers, l.Filename)
		}
		return st
	}
	return nil
}

// registerFork makes the fork pool keep machines for the next forks of s,
// which now runs on memory base memBase, and tops them up.
func (n *Node) registerFork(ctx context.Context, s *sandboxes.Sandbox) {
	memBase := n.memoryBaseOf(s)
	if n.cfg.ForkPoolSize == 0 || memBase == "" || !n.qemu.RestacksDisks() || len(s.Volumes) > 0 {
		return
	}
	key := forkPoolKey(s.TemplateID, memBase)
	dropped := n.forkShapes.add(key, forkShape{vcpus: s.VCPUs, memoryMiB: s.MemoryMiB,
		diskMiB: s.DiskMiB, volumeSlots: s.VolumeSlots, defaultUser: s.DefaultUser, workdir: s.DefaultWorkdir})
	if len(dropped) > 0 {
		n.drainForkPool(ctx)
	}
	n.forkPool.Refill(key)
}

// takeForkMachines takes up to count pre-started machines for the
// children of a fork of s along st.
func (n *Node) takeForkMachines(s *sandboxes.Sandbox, st *forkStack, count int) []*pooledSandbox {
	var out []*pooledSandbox
	for len(out) < count {
		e, ok := n.forkPool.Take(st.key, s.VCPUs, s.MemoryMiB)
		if !ok {
			break
		}
		if e.s.VolumeSlots != s.VolumeSlots || e.s.DiskMiB != s.DiskMiB {
			forkStarter{n}.Discard(context.Background(), e)
			continue
		}
		out = append(out, e)
	}
	return out
}

// claimForkMachine makes the pre-started machine of child c (already
// recorded as c) the fork's child: the fork's images under its overlay,
// the overlay's header naming them, the child's egress rules, then the
// fork's state loaded and envd initialised. Its QEMU gets the normal
// scheduling policy back first.
func (n *Node) claimForkMachine(ctx context.Context, c *sandboxes.Sandbox, e *pooledSandbox, st *forkStack, snapID, authToken string) error {
	phase := c.PhaseTimer()
	if err := e.m.Prioritize(); err != nil {
		return err
	}
	dir := n.sandboxDir(c.ID)
	if err := os.Remove(filepath.Join(dir, PooledMarker)); err != nil {
		return err
	}
	if err := n.applyEgress(ctx, c); err != nil {
		return err
	}
	phase("claim pre-started machine")
	if err := e.m.Restack(ctx, st.layers); err != nil {
		return err
	}
	phase("restack the fork's images")
	if err := faults.Check(ctx, forkRebaseFault); err != nil {
		return err
	}
	if err := storage.RebaseEmptyOverlay(ctx, filepath.Join(dir, overlayName),
		filepath.Join(n.snapshotDir(st.memBase), snapDiskName), st.layers[0]); err != nil {
		return fmt.Errorf("put the child's disk on the fork's: %w", err)
	}
	phase("rewrite overlay header")
	if err := n.verifySnapshotState(snapID); err != nil {
		return err
	}
	return n.finishRestore(ctx, c, e.m, snapID, authToken, true)
}
