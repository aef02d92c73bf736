package orchestrator

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/agentenv/agentenv/internal/faults"
	"github.com/agentenv/agentenv/internal/vmm"
)

// subject is a sandbox the integrity tests check after every step: a file
// with known content and a background process.
type subject struct {
	s   *Sandbox
	pid string
}

func newSubject(t *testing.T, n *Node) *subject {
	t.Helper()
	s := create(t, n, CreateRequest{TemplateID: "minimal", Secure: true})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	r, err := newEnvdClient(s).run(ctx, "", "/bin/sh", "-c", "echo precious-"+s.ID+" > /home/user/marker; sleep 100000 >/dev/null 2>&1 & echo $!")
	if err != nil || r.exit != 0 {
		t.Fatalf("prepare subject: %+v %v", r, err)
	}
	return &subject{s: s, pid: strings.TrimSpace(r.stdout)}
}

// check asserts the subject rests, running or paused; a paused subject is
// resumed. Then its file and process are checked.
func (sub *subject) check(t *testing.T, n *Node) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	s, err := n.Get(ctx, sub.s.ID)
	if err != nil {
		t.Fatalf("subject lost: %v", err)
	}
	switch s.State {
	case StateRunning:
	case StatePaused:
		if s, err = n.Resume(ctx, s.ID, time.Minute); err != nil {
			t.Fatalf("resume the subject: %v", err)
		}
	default:
		t.Fatalf("subject rests in %s", s.State)
	}
	r, err := newEnvdClient(s).run(ctx, "", "/bin/sh", "-c", "cat /home/user/marker; kill -0 "+sub.pid+" && echo alive")
	if err != nil || r.stdout != "precious-"+s.ID+"\nalive\n" {
		t.Fatalf("subject's files and processes: %+v %v", r, err)
	}
	sub.s = s
}

// assertNoLeaks checks that what exists on the host is exactly what the
// node's records own: a QEMU per running sandbox, a network namespace and
// veth per sandbox, a directory per sandbox, no lease left, every store
// object's files present and no snapshot directory the store does not know.
func assertNoLeaks(t *testing.T, n *Node) {
	t.Helper()
	ctx := context.Background()
	all, err := n.loadSandboxes(ctx, "")
	if err != nil {
		t.Fatal(err)
	}
	ids, running := map[string]bool{}, map[string]bool{}
	for _, s := range all {
		ids[s.ID] = true
		if s.State == StateRunning || s.State == StatePooled {
			running[s.ID] = true
		}
		if !s.State.Resting() {
			t.Errorf("sandbox %s left in %s", s.ID, s.State)
		}
	}
	for pid, id := range vmm.Running(n.sandboxDir("")) {
		if !running[id] {
			t.Errorf("QEMU %d of %s runs, but the sandbox is not running", pid, id)
		}
	}
	nss, _ := n.net.Namespaces()
	for _, ns := range nss {
		if !ids[n.net.NamespaceOwner(ns)] {
			t.Errorf("network namespace %s has no sandbox", ns)
		}
	}
	veths, _ := n.net.HostVeths()
	if len(veths) > len(all) {
		t.Errorf("%d veths for %d sandboxes: %v", len(veths), len(all), veths)
	}
	for _, name := range vmm.CgroupNames() {
		if id, ok := strings.CutPrefix(name, n.net.Instance()+"-"); ok && !ids[id] {
			t.Errorf("cgroup %s has no sandbox", name)
		}
	}
	ents, _ := os.ReadDir(filepath.Join(n.cfg.DataDir, "sandboxes"))
	for _, e := range ents {
		if !ids[e.Name()] {
			t.Errorf("sandbox directory %s has no record", e.Name())
		}
	}
	var leases int
	if err := n.db.QueryRowContext(ctx, `SELECT COUNT(*) FROM leases`).Scan(&leases); err != nil || leases != 0 {
		t.Errorf("%d leases left (%v)", leases, err)
	}
	if _, err := n.store.GC(ctx); err != nil {
		t.Fatal(err)
	}
	objs, _ := n.store.Objects(ctx)
	known := map[string]bool{}
	for _, o := range objs {
		known[o.ID] = true
		if _, err := os.Stat(n.store.Abs(o.Path)); err != nil {
			t.Errorf("object %s has no files: %v", o.ID, err)
		}
	}
	snaps, _ := os.ReadDir(filepath.Join(n.cfg.DataDir, snapshotsDir))
	for _, e := range snaps {
		if !known[e.Name()] {
			t.Errorf("snapshot directory %s is no object of the store", e.Name())
		}
	}
}

// injectedOp is one operation of the failure table.
type injectedOp struct {
	name, kind string
	// prepare makes the sandbox the operation works on (nil: none).
	prepare func(t *testing.T, n *Node) *subject
	// run performs the operation; new are sandboxes it made.
	run func(ctx context.Context, n *Node, sub *subject) (new []*Sandbox, err error)
}

func runningSubject(t *testing.T, n *Node) *subject { return newSubject(t, n) }

// cowSubject runs copy-on-write on a snapshot (it was forked once), so it is
// captured live.
func cowSubject(t *testing.T, n *Node) *subject {
	sub := newSubject(t, n)
	res, err := n.Fork(context.Background(), sub.s.ID, 1, time.Minute)
	if err != nil || res[0].Err != nil {
		t.Fatalf("fork to make a copy-on-write subject: %v %+v", err, res)
	}
	n.Kill(context.Background(), res[0].Sandbox.ID)
	sub.s, _ = n.Get(context.Background(), sub.s.ID)
	if !n.canSnapshotLive(sub.s) {
		t.Fatal("subject is not copy-on-write")
	}
	return sub
}

func pausedSubject(t *testing.T, n *Node) *subject {
	sub := newSubject(t, n)
	if _, err := n.Pause(context.Background(), sub.s.ID); err != nil {
		t.Fatal(err)
	}
	return sub
}

func forkRun(ctx context.Context, n *Node, sub *subject) ([]*Sandbox, error) {
	res, err := n.Fork(ctx, sub.s.ID, 2, time.Minute)
	var made []*Sandbox
	for _, r := range res {
		if r.Sandbox != nil {
			made = append(made, r.Sandbox)
		} else if err == nil {
			err = r.Err
		}
	}
	return made, err
}

func snapshotRun(name string) func(ctx context.Context, n *Node, sub *subject) ([]*Sandbox, error) {
	i := 0
	return func(ctx context.Context, n *Node, sub *subject) ([]*Sandbox, error) {
		i++
		_, err := n.Snapshot(ctx, sub.s.ID, fmt.Sprintf("%s-%d", name, i))
		return nil, err
	}
}

var injectedOps = []injectedOp{
	{"create", "cold", nil, func(ctx context.Context, n *Node, _ *subject) ([]*Sandbox, error) {
		s, err := n.Create(ctx, CreateRequest{TemplateID: "minimal"})
		if s != nil {
			return []*Sandbox{s}, err
		}
		return nil, err
	}},
	{"pause", "", runningSubject, func(ctx context.Context, n *Node, sub *subject) ([]*Sandbox, error) {
		_, err := n.Pause(ctx, sub.s.ID)
		return nil, err
	}},
	{"resume", "", pausedSubject, func(ctx context.Context, n *Node, sub *subject) ([]*Sandbox, error) {
		_, err := n.Resume(ctx, sub.s.ID, time.Minute)
		return nil, err
	}},
	{"snapshot", "frozen", runningSubject, snapshotRun("frozen")},
	{"snapshot", "live", cowSubject, snapshotRun("live")},
	{"fork", "frozen", runningSubject, forkRun},
	{"fork", "live", cowSubject, forkRun},
	{"kill", "", runningSubject, func(ctx context.Context, n *Node, sub *subject) ([]*Sandbox, error) {
		return nil, n.Kill(ctx, sub.s.ID)
	}},
}

// distinct keeps the first occurrence of each point of op.
func distinct(points []string, op string) []string {
	var out []string
	for _, p := range points {
		if strings.HasPrefix(p, op+"/") && !slices.Contains(out, p) {
			out = append(out, p)
		}
	}
	return out
}

// TestInjectedFailuresRollBack makes every step of every operation fail in
// turn (the steps are found by running the operation once and recording
// the fault points it passes): each time the operation answers the error,
// the sandbox rests (running, or paused) with its files and processes, and
// nothing is left behind.
func TestInjectedFailuresRollBack(t *testing.T) {
	n := testNode(t)
	for _, op := range injectedOps {
		t.Run(strings.TrimSuffix(op.name+"-"+op.kind, "-"), func(t *testing.T) {
			// The steps, from a run that fails nowhere.
			var sub *subject
			if op.prepare != nil {
				sub = op.prepare(t, n)
			}
			rec := faults.NewInjector()
			made, err := op.run(faults.With(context.Background(), rec), n, sub)
			if err != nil {
				t.Fatalf("%s without faults: %v", op.name, err)
			}
			for _, s := range made {
				n.Kill(context.Background(), s.ID)
			}
			points := distinct(rec.Seen(), op.name)
			if len(points) < 2 {
				t.Fatalf("%s passed only %v", op.name, points)
			}
			t.Logf("%s steps: %v", op.name, points)
			if sub != nil && op.name != "kill" {
				n.Kill(context.Background(), sub.s.ID)
			}
			for _, p := range points {
				t.Run(strings.TrimPrefix(p, op.name+"/"), func(t *testing.T) {
					var sub *subject
					if op.prepare != nil {
						sub = op.prepare(t, n)
					}
					before, _ := n.List(context.Background())
					ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
					defer cancel()
					made, err := op.run(faults.With(ctx, faults.NewInjector(p)), n, sub)
					if !errors.Is(err, faults.ErrInjected) {
						t.Fatalf("%s failing at %s answered %v", op.name, p, err)
					}
					for _, s := range made {
						t.Errorf("a failed %s left sandbox %s", op.name, s.ID)
						n.Kill(context.Background(), s.ID)
					}
					after, _ := n.List(context.Background())
					if len(after) != len(before) {
						t.Errorf("%d sandboxes before, %d after", len(before), len(after))
					}
					if sub != nil {
						sub.check(t, n)
					}
					if sub != nil {
						n.Kill(context.Background(), sub.s.ID)
					}
					dropSnapshots(n)
					assertNoLeaks(t, n)
				})
			}
		})
	}
	assertNoLeaks(t, n)
}

// TestClientGoneAtEveryStep cancels the caller's context as each step of
// pause, resume, snapshot and fork begins (a client that hung up): the
// operation completes regardless, and the subject (a fork's parent
// included) is never lost.
func TestClientGoneAtEveryStep(t *testing.T) {
	n := testNode(t)
	for _, op := range injectedOps[1:7] {
		t.Run(strings.TrimSuffix(op.name+"-"+op.kind, "-"), func(t *testing.T) {
			sub := op.prepare(t, n)
			rec := faults.NewInjector()
			made, err := op.run(faults.With(context.Background(), rec), n, sub)
			if err != nil {
				t.Fatal(err)
			}
			for _, s := range made {
				n.Kill(context.Background(), s.ID)
			}
			n.Kill(context.Background(), sub.s.ID)
			for _, p := range distinct(rec.Seen(), op.name) {
				sub := op.prepare(t, n)
				ctx, cancel := context.WithCancel(context.Background())
				inj := faults.NewInjector()
				inj.Hook = func(name string) {
					if name == p {
						cancel()
					}
				}
				made, err := op.run(faults.With(ctx, inj), n, sub)
				cancel()
				if err != nil {
					t.Errorf("%s with the client gone at %s: %v", op.name, p, err)
				}
				for _, s := range made {
					if _, err := n.Get(context.Background(), s.ID); err != nil {
						t.Errorf("child %s: %v", s.ID, err)
					}
					n.Kill(context.Background(), s.ID)
				}
				sub.check(t, n)
				n.Kill(context.Background(), sub.s.ID)
			}
			assertNoLeaks(t, n)
		})
	}
}

// dropSnapshots deletes every named snapshot.
func dropSnapshots(n *Node) {
	all, _ := n.Snapshots()
	for _, ns := range all {
		n.DeleteSnapshot(context.Background(), ns.Name)
	}
}
