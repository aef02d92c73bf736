package orchestrator

import (
	"context"
	"errors"
	"fmt"
	"math/rand"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/agentenv/agentenv/internal/builds"
	"github.com/agentenv/agentenv/internal/network"
	"github.com/agentenv/agentenv/internal/sandboxes"
	"github.com/agentenv/agentenv/internal/warmpool"

	"github.com/agentenv/agentenv/internal/faults"
	"github.com/agentenv/agentenv/internal/storage/repository"
	"github.com/agentenv/agentenv/internal/vmm"
)

// subject is a sandbox the integrity tests check after every step: a file
// with known content and a background process.
type subject struct {
	s      *sandboxes.Sandbox
	pid    string
	marker string
	// rebootable: an operation on it may boot it again from its disk
	// (its memory dropped, as asked), so its process need not survive.
	rebootable bool
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
	return &subject{s: s, pid: strings.TrimSpace(r.stdout), marker: "precious-" + s.ID}
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
	rebooted := sub.rebootable
	switch s.State {
	case sandboxes.Running:
	case sandboxes.Paused:
		if rec, err := readPauseRecord(n.sandboxDir(s.ID)); err == nil && rec.FilesystemOnly {
			rebooted = true // paused without memory: its processes went, as asked
		}
		if s, err = n.Resume(ctx, s.ID, time.Minute); err != nil {
			t.Fatalf("resume the subject: %v", err)
		}
	default:
		t.Fatalf("subject rests in %s", s.State)
	}
	r, err := newEnvdClient(s).run(ctx, "", "/bin/sh", "-c", "cat /home/user/marker; kill -0 "+sub.pid+" && echo alive")
	if rebooted && err == nil && r.stdout == sub.marker+"\n" {
		r.stdout += "alive\n" // booted again: the file is what must be kept
	}
	if err != nil || r.stdout != sub.marker+"\nalive\n" {
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
	all, err := n.records.List(ctx, "")
	if err != nil {
		t.Fatal(err)
	}
	ids, running := map[string]bool{}, map[string]bool{}
	for _, s := range all {
		ids[s.ID] = true
		// A paused sandbox may keep its QEMU stopped (a hot copy).
		if s.State == sandboxes.Running || s.State == sandboxes.Pooled || (s.State == sandboxes.Paused && n.hot.has(s.ID)) {
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
	run func(ctx context.Context, n *Node, sub *subject) (new []*sandboxes.Sandbox, err error)
	// verify, if set, checks what else a failed run must have left as it was.
	verify func(t *testing.T, n *Node, before string)
	// state is what verify compares (taken before the run).
	state func(n *Node) string
	// absorbs: a failure at one of its steps is absorbed by design (the
	// operation around it goes on another way), so the run must succeed.
	absorbs bool
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

// pausedSubject is paused on disk only (its hot copy dropped): its resume
// is a cold one.
func pausedSubject(t *testing.T, n *Node) *subject {
	sub := newSubject(t, n)
	if _, err := n.Pause(context.Background(), sub.s.ID); err != nil {
		t.Fatal(err)
	}
	n.dropHot(sub.s.ID)
	return sub
}

// hotPausedSubject is paused with its QEMU kept stopped (a hot copy).
func hotPausedSubject(t *testing.T, n *Node) *subject {
	sub := newSubject(t, n)
	if _, err := n.Pause(context.Background(), sub.s.ID); err != nil {
		t.Fatal(err)
	}
	if !n.hot.has(sub.s.ID) {
		t.Fatal("the pause kept no hot copy")
	}
	return sub
}

// rebootableSubject is paused with memory, its marker synced to its disk,
// for a resume that boots it again.
func rebootableSubject(t *testing.T, n *Node) *subject {
	sub := newSubject(t, n)
	if _, err := newEnvdClient(sub.s).run(context.Background(), "", "/bin/sh", "-c", "sync"); err != nil {
		t.Fatal(err)
	}
	if _, err := n.Pause(context.Background(), sub.s.ID); err != nil {
		t.Fatal(err)
	}
	sub.rebootable = true
	return sub
}

func forkRun(ctx context.Context, n *Node, sub *subject) ([]*sandboxes.Sandbox, error) {
	res, err := n.Fork(ctx, sub.s.ID, 2, time.Minute)
	var made []*sandboxes.Sandbox
	for _, r := range res {
		if r.Sandbox != nil {
			made = append(made, r.Sandbox)
		} else if err == nil {
			err = r.Err
		}
	}
	return made, err
}

func snapshotRun(name string) func(ctx context.Context, n *Node, sub *subject) ([]*sandboxes.Sandbox, error) {
	return snapshotRunWith(name, (*Node).Snapshot)
}

// snapshotRunWith takes snapshots named name-1, name-2... with take.
func snapshotRunWith(name string, take func(*Node, context.Context, string, string) (*NamedSnapshot, error)) func(ctx context.Context, n *Node, sub *subject) ([]*sandboxes.Sandbox, error) {
	i := 0
	return func(ctx context.Context, n *Node, sub *subject) ([]*sandboxes.Sandbox, error) {
		i++
		_, err := take(n, ctx, sub.s.ID, fmt.Sprintf("%s-%d", name, i))
		return nil, err
	}
}

var injectedOps = []injectedOp{
	{"create", "cold", nil, func(ctx context.Context, n *Node, _ *subject) ([]*sandboxes.Sandbox, error) {
		s, err := n.Create(ctx, CreateRequest{TemplateID: "minimal"})
		if s != nil {
			return []*sandboxes.Sandbox{s}, err
		}
		return nil, err
	}, nil, nil, false},
	{"pause", "", runningSubject, func(ctx context.Context, n *Node, sub *subject) ([]*sandboxes.Sandbox, error) {
		_, err := n.Pause(ctx, sub.s.ID)
		return nil, err
	}, nil, nil, false},
	{"resume", "", pausedSubject, func(ctx context.Context, n *Node, sub *subject) ([]*sandboxes.Sandbox, error) {
		_, err := n.Resume(ctx, sub.s.ID, time.Minute)
		return nil, err
	}, nil, nil, false},
	{"snapshot", "frozen", runningSubject, snapshotRun("frozen"), nil, nil, false},
	{"snapshot", "live", cowSubject, snapshotRun("live"), nil, nil, false},
	{"fork", "frozen", runningSubject, forkRun, nil, nil, false},
	{"fork", "live", cowSubject, forkRun, nil, nil, false},
	{"kill", "", runningSubject, func(ctx context.Context, n *Node, sub *subject) ([]*sandboxes.Sandbox, error) {
		return nil, n.Kill(ctx, sub.s.ID)
	}, nil, nil, false},
	{"network", "", runningSubject, func(ctx context.Context, n *Node, sub *subject) ([]*sandboxes.Sandbox, error) {
		_, err := n.SetNetwork(ctx, sub.s.ID, false, network.Egress{Domains: []string{"*.example.com"},
			Allow: []netip.Prefix{netip.MustParsePrefix("192.0.2.0/24")}})
		return nil, err
	}, func(t *testing.T, n *Node, before string) {
		if got := netState(n); got != before {
			t.Errorf("a failed network update changed the rules:\n%s\nwere\n%s", got, before)
		}
	}, netState, false},
	{"build", "", nil, func(ctx context.Context, n *Node, _ *subject) ([]*sandboxes.Sandbox, error) {
		return nil, n.builds.Run(ctx, builds.Spec{Template: "inj-build", FromTemplate: "minimal", Force: true,
			Steps: []builds.Step{{Type: "RUN", Args: []string{"date +%s%N > /etc/built"}}}}, func(string, string, string) {})
	}, func(t *testing.T, n *Node, before string) {
		if got := injBuildState(n); got != before {
			t.Errorf("a failed build changed the template: %s, was %s", got, before)
		}
	}, injBuildState, false},
	{"filesystem snapshot", "", runningSubject, snapshotRunWith("fs", (*Node).SnapshotFilesystem), nil, nil, false},
	{"pause", "filesystem", runningSubject, func(ctx context.Context, n *Node, sub *subject) ([]*sandboxes.Sandbox, error) {
		_, err := n.PauseFilesystem(ctx, sub.s.ID)
		return nil, err
	}, nil, nil, false},
	{"resume", "reboot", rebootableSubject, rebootRun, nil, nil, false},
	// A reboot first restores the memory to sync the guest's disks; when
	// that fails, it boots from the disk as it is.
	{"resume-sync", "reboot", rebootableSubject, rebootRun, nil, nil, true},
	// A hot resume continues the stopped QEMU; failing, the sandbox stays
	// paused on disk (or is paused again) and resumes cold after.
	{"resume", "hot", hotPausedSubject, func(ctx context.Context, n *Node, sub *subject) ([]*sandboxes.Sandbox, error) {
		_, err := n.Resume(ctx, sub.s.ID, time.Minute)
		return nil, err
	}, nil, nil, false},
}

func rebootRun(ctx context.Context, n *Node, sub *subject) ([]*sandboxes.Sandbox, error) {
	_, err := n.ResumeWith(ctx, sub.s.ID, ResumeOptions{Timeout: time.Minute, Reboot: true})
	return nil, err
}

// netState is every sandbox's recorded egress rules and the firewall
// loaded in its namespace.
func netState(n *Node) string {
	all, _ := n.List(context.Background())
	var b strings.Builder
	for _, s := range all {
		rules, _ := exec.Command("nsenter", "--net="+n.net.NamespacePath(s.ID), "nft", "list", "table", "ip", "aenv").CombinedOutput()
		fmt.Fprintf(&b, "%s internet=%v egress=%+v\n%s\n", s.ID, s.AllowInternet, s.Egress, rules)
	}
	return b.String()
}

// injBuildState is the layer and template snapshot of the template "inj-build".
func injBuildState(n *Node) string {
	t, err := n.Template("inj-build")
	if err != nil {
		return err.Error()
	}
	ts, err := n.currentTemplateSnapshot(t)
	if err != nil {
		return t.Layer + " " + err.Error()
	}
	return t.Layer + " " + ts.SnapshotID
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
					var state string
					if op.state != nil {
						state = op.state(n)
					}
					ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
					defer cancel()
					made, err := op.run(faults.With(ctx, faults.NewInjector(p)), n, sub)
					if op.absorbs && err != nil {
						t.Fatalf("%s failing at %s should have gone on, answered %v", op.name, p, err)
					}
					if !op.absorbs && !errors.Is(err, faults.ErrInjected) {
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
					if op.verify != nil {
						op.verify(t, n, state)
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
	// Pause, resume, snapshot and fork, the pause and resume without
	// memory (the last three but one: resume-sync is the reboot's first
	// part, which the reboot covers), and the filesystem snapshot.
	ops := slices.Clip(injectedOps[1:7])
	for _, op := range injectedOps { // and the filesystem snapshot
		if op.name == "filesystem snapshot" || (op.name == "pause" && op.kind == "filesystem") ||
			(op.name == "resume" && (op.kind == "reboot" || op.kind == "hot")) {
			ops = append(ops, op)
		}
	}
	for _, op := range ops {
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

// fingerprint is what a sandbox of the rebuild test holds on its disk.
func fingerprint(t *testing.T, s *sandboxes.Sandbox) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	// Caches dropped: the files are read from the disk layers again.
	r, err := newEnvdClient(s).run(ctx, "root", "/bin/sh", "-c",
		"sync; echo 3 > /proc/sys/vm/drop_caches; cat /opt/v; md5sum /opt/blob | cut -c1-32; dmesg | grep -ci -e 'ext4-fs error' -e 'structure needs cleaning' -e 'i/o error' || true")
	if err != nil || r.exit != 0 {
		t.Fatalf("read sandbox %s: %+v %v", s.ID, r, err)
	}
	if !strings.HasSuffix(r.stdout, "\n0\n") {
		t.Fatalf("sandbox %s reports file system errors: %q", s.ID, r.stdout)
	}
	return strings.TrimSuffix(r.stdout, "0\n")
}

// TestTemplateRebuildKeepsDisks rebuilds a template, then re-imports it
// from an image, while sandboxes of the first build run, rest paused, wait
// in the pool and live on in a named snapshot: each keeps exactly its disk
// (file checksums, no file system error), new sandboxes get the new build,
// the pool holds only the new build, a template in use cannot be deleted
// (409 naming the user), and the old build's snapshot goes once nothing
// uses it.
func TestTemplateRebuildKeepsDisks(t *testing.T) {
	n := testNode(t)
	n.pool.SetSize(1)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	var l buildLog
	build := func(v string) {
		t.Helper()
		spec := builds.Spec{Template: "app", FromTemplate: "minimal", Steps: []builds.Step{{Type: "RUN",
			Args: []string{"mkdir -p /opt && echo " + v + " > /opt/v && dd if=/dev/urandom of=/opt/blob bs=64k count=16 2>/dev/null"}}}}
		if err := n.builds.Run(ctx, spec, l.log(t)); err != nil {
			t.Fatal(err)
		}
	}
	build("v1")
	v1, _ := n.Template("app")
	ts1, err := n.currentTemplateSnapshot(v1)
	if err != nil {
		t.Fatal(err)
	}
	waitPool := func(key warmpool.Key) {
		t.Helper()
		deadline := time.Now().Add(2 * time.Minute)
		for n.pool.Len(key) < 1 {
			if time.Now().After(deadline) {
				t.Fatal("the pool was not filled")
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	waitPool(poolKey(v1, ts1))

	running := create(t, n, CreateRequest{TemplateID: "app"})                 // from the pool
	cold := create(t, n, CreateRequest{TemplateID: "app", MemoryMiB: 320})    // cold boot on the layer
	paused := create(t, n, CreateRequest{TemplateID: "app"})                  // template snapshot
	snapSrc := create(t, n, CreateRequest{TemplateID: "app", MemoryMiB: 288}) // named snapshot source
	want := map[string]string{}
	for _, s := range []*sandboxes.Sandbox{running, cold, paused, snapSrc} {
		want[s.ID] = fingerprint(t, s)
		if !strings.HasPrefix(want[s.ID], "v1\n") {
			t.Fatalf("sandbox %s of the first build: %q", s.ID, want[s.ID])
		}
	}
	if _, err := n.Pause(ctx, paused.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := n.Snapshot(ctx, snapSrc.ID, "app-snap"); err != nil {
		t.Fatal(err)
	}
	waitPool(poolKey(v1, ts1))
	pooledV1 := n.pool.Entries(poolKey(v1, ts1))[0].s.ID

	build("v2")
	v2, _ := n.Template("app")
	if v2.Layer == v1.Layer {
		t.Fatal("the rebuild did not make a new layer")
	}
	if err := n.PrepareTemplateSnapshot(ctx, "app"); err != nil {
		t.Fatal(err)
	}
	ts2, _ := n.currentTemplateSnapshot(v2)
	if n.pool.Len(poolKey(v1, ts1)) != 0 {
		t.Fatal("the pool still holds sandboxes of the old build")
	}
	if _, err := n.records.Get(ctx, pooledV1); !errors.Is(err, ErrNotFound) {
		t.Fatalf("a pooled sandbox of the old build is still recorded: %v", err)
	}
	fresh := create(t, n, CreateRequest{TemplateID: "app"})
	if got := fingerprint(t, fresh); !strings.HasPrefix(got, "v2\n") {
		t.Fatalf("a new sandbox after the rebuild reads %q", got)
	}
	n.Kill(ctx, fresh.ID)
	_ = ts2

	// Re-import the name from an image: the label moves again.
	archive := filepath.Join(t.TempDir(), "img.tar")
	writeBusyboxArchive(t, archive)
	if _, err := n.templates.ImportImage(ctx, "app", imageSource(archive), 256, t.Logf); err != nil {
		t.Fatal(err)
	}
	imported := create(t, n, CreateRequest{TemplateID: "app", VCPUs: 1, MemoryMiB: 256})
	r, err := newEnvdClient(imported).run(ctx, "", "/bin/sh", "-c", "cat /data/hello; test -e /opt/v || echo no-v")
	if err != nil || r.stdout != "hello from an OCI layer\nno-v\n" {
		t.Fatalf("sandbox of the re-imported template: %+v %v", r, err)
	}
	n.Kill(ctx, imported.ID)

	// Every sandbox of the first build kept exactly its disk.
	for _, s := range []*sandboxes.Sandbox{running, cold, snapSrc} {
		cur, _ := n.Get(ctx, s.ID)
		if got := fingerprint(t, cur); got != want[s.ID] {
			t.Errorf("sandbox %s reads %q after the rebuild, had %q", s.ID, got, want[s.ID])
		}
	}
	resumed, err := n.Resume(ctx, paused.ID, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if got := fingerprint(t, resumed); got != want[paused.ID] {
		t.Errorf("paused sandbox reads %q after the rebuild, had %q", got, want[paused.ID])
	}
	fromSnap := create(t, n, CreateRequest{TemplateID: "app-snap"})
	if got := fingerprint(t, fromSnap); got != want[snapSrc.ID] {
		t.Errorf("sandbox of the named snapshot reads %q, had %q", got, want[snapSrc.ID])
	}

	// In use: deleting the template is refused, naming a user.
	if err := n.DeleteTemplate(ctx, "app"); !errors.Is(err, ErrConflict) || !strings.Contains(err.Error(), "sandbox ") {
		t.Fatalf("delete of a template in use: %v", err)
	}
	// The first build's template snapshot lives while sandboxes need it,
	// and goes with the last of them.
	if _, err := n.store.Get(ctx, ts1.SnapshotID); err != nil {
		t.Fatalf("the old template snapshot went while in use: %v", err)
	}
	for _, s := range []*sandboxes.Sandbox{running, cold, resumed, snapSrc, fromSnap} {
		if err := n.Kill(ctx, s.ID); err != nil {
			t.Fatal(err)
		}
	}
	if err := n.DeleteSnapshot(ctx, "app-snap"); err != nil {
		t.Fatal(err)
	}
	if _, err := n.store.Get(ctx, ts1.SnapshotID); !errors.Is(err, ErrNotFound) {
		t.Fatalf("the old template snapshot outlived its last user: %v", err)
	}
	if _, err := os.Stat(n.snapshotDir(ts1.SnapshotID)); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("its files are still there: %v", err)
	}
	// What is left of the first build's layer is the build cache's.
	if h, _ := n.store.Holders(ctx, v1.Layer); !slices.Equal(h, []string{builds.CacheHolder}) {
		t.Fatalf("holders of the first build's layer: %v", h)
	}
	if err := n.DeleteTemplate(ctx, "app"); err != nil {
		t.Fatal(err)
	}
	assertNoLeaks(t, n)
}

// TestPooledQEMUDies kills a pooled sandbox's QEMU: the pool drops it,
// cleans up after it and starts another, and a create still gets one.
func TestPooledQEMUDies(t *testing.T) {
	n := testNode(t)
	n.pool.SetSize(1)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	if err := n.PrepareTemplateSnapshot(ctx, "minimal"); err != nil {
		t.Fatal(err)
	}
	tpl, _ := n.Template("minimal")
	ts, err := n.currentTemplateSnapshot(tpl)
	if err != nil {
		t.Fatal(err)
	}
	n.pool.Refill(poolKey(tpl, ts))
	pooled := func() *pooledSandbox {
		deadline := time.Now().Add(2 * time.Minute)
		for {
			var e *pooledSandbox
			if l := n.pool.Entries(poolKey(tpl, ts)); len(l) > 0 {
				e = l[0]
			}
			if e != nil {
				return e
			}
			if time.Now().After(deadline) {
				t.Fatal("the pool was not filled")
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	first := pooled()
	if err := syscall.Kill(first.m.PID(), syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(2 * time.Minute)
	for {
		if e := pooled(); e.s.ID != first.s.ID && alive(e.m) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the pool did not replace its dead sandbox")
		}
		time.Sleep(100 * time.Millisecond)
	}
	if _, err := n.records.Get(ctx, first.s.ID); !errors.Is(err, ErrNotFound) {
		t.Fatalf("the dead pooled sandbox is still recorded: %v", err)
	}
	s := create(t, n, CreateRequest{TemplateID: "minimal"})
	if r, err := newEnvdClient(s).run(ctx, "", "/bin/sh", "-c", "echo ok"); err != nil || r.stdout != "ok\n" {
		t.Fatalf("sandbox from the refilled pool: %+v %v", r, err)
	}
	n.Kill(ctx, s.ID)
	assertNoLeaks(t, n)
}

// TestGCRacesForksAndSnapshots runs garbage collection without pause while
// sandboxes are forked, snapshotted, created from snapshots and killed:
// nothing in use is ever collected, and in the end nothing is left over.
func TestGCRacesForksAndSnapshots(t *testing.T) {
	n := testNode(t)
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	stop := make(chan struct{})
	done := make(chan int)
	go func() {
		runs := 0
		defer func() { done <- runs }()
		for {
			select {
			case <-stop:
				return
			default:
			}
			if _, err := n.store.GC(ctx); err != nil {
				if ctx.Err() == nil {
					t.Error(err)
				}
				return
			}
			runs++
		}
	}()
	parent := newSubject(t, n)
	for i := 0; i < 4; i++ {
		res, err := n.Fork(ctx, parent.s.ID, 2, time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		for _, r := range res {
			if r.Err != nil {
				t.Fatalf("round %d: child: %v", i, r.Err)
			}
		}
		child := &subject{s: res[0].Sandbox, pid: parent.pid, marker: parent.marker}
		child.check(t, n)
		name := fmt.Sprintf("race-%d", i)
		if _, err := n.Snapshot(ctx, child.s.ID, name); err != nil {
			t.Fatalf("round %d: snapshot: %v", i, err)
		}
		grand := &subject{s: create(t, n, CreateRequest{TemplateID: name}), pid: parent.pid, marker: parent.marker}
		n.Kill(ctx, res[1].Sandbox.ID)
		n.Kill(ctx, child.s.ID)
		if err := n.DeleteSnapshot(ctx, name); err != nil {
			t.Fatal(err)
		}
		// The sandbox of the deleted snapshot still has everything.
		ctx2, cancel2 := context.WithTimeout(ctx, time.Minute)
		r, err := newEnvdClient(grand.s).run(ctx2, "", "/bin/sh", "-c", "cat /home/user/marker; kill -0 "+parent.pid+" && echo alive")
		cancel2()
		if err != nil || !strings.HasSuffix(r.stdout, "alive\n") {
			t.Fatalf("round %d: sandbox of a deleted snapshot: %+v %v", i, r, err)
		}
		n.Kill(ctx, grand.s.ID)
		parent.check(t, n)
	}
	close(stop)
	t.Logf("%d garbage collections ran meanwhile", <-done)
	n.Kill(ctx, parent.s.ID)
	assertNoLeaks(t, n)
}

// TestSoak drives a few sandboxes through random creates, pauses, resumes,
// snapshots, forks, kills, template rebuilds and callers that give up, for
// a bounded time (AENV_SOAK, default 2m), checking after every step that
// every sandbox rests and holds what was written to it; at the end nothing
// is left behind.
func TestSoak(t *testing.T) {
	d := 2 * time.Minute
	if v := os.Getenv("AENV_SOAK"); v != "" {
		var err error
		if d, err = time.ParseDuration(v); err != nil {
			t.Fatal(err)
		}
	}
	n := testNode(t)
	seed := time.Now().UnixNano()
	t.Logf("seed %d, for %s", seed, d)
	rnd := rand.New(rand.NewSource(seed))
	ctx := context.Background()
	build := func(v int) {
		spec := builds.Spec{Template: "soak", FromTemplate: "minimal", Steps: []builds.Step{{Type: "RUN",
			Args: []string{fmt.Sprintf("mkdir -p /opt && echo build-%d > /opt/v", v)}}}}
		if err := n.builds.Run(ctx, spec, func(string, string, string) {}); err != nil {
			t.Fatalf("build %d: %v", v, err)
		}
	}
	builds := 1
	build(builds)
	type model struct {
		marker, pid string
		state       sandboxes.State
	}
	live := map[string]*model{}
	var snaps []string
	snapSource := map[string]model{}
	pick := func(state sandboxes.State) string {
		var ids []string
		for id, m := range live {
			if m.state == state {
				ids = append(ids, id)
			}
		}
		slices.Sort(ids)
		if len(ids) == 0 {
			return ""
		}
		return ids[rnd.Intn(len(ids))]
	}
	// opCtx is a caller that, one time in four, gives up after a while.
	opCtx := func() (context.Context, context.CancelFunc) {
		if rnd.Intn(4) == 0 {
			return context.WithTimeout(ctx, time.Duration(1+rnd.Intn(400))*time.Millisecond)
		}
		return context.WithTimeout(ctx, 3*time.Minute)
	}
	check := func(step string) {
		t.Helper()
		all, _ := n.records.List(ctx, "")
		for _, s := range all {
			if !s.State.Resting() {
				t.Fatalf("after %s: sandbox %s is %s", step, s.ID, s.State)
			}
			if s.State != sandboxes.Pooled && live[s.ID] == nil {
				t.Fatalf("after %s: sandbox %s (%s) is not one the test made", step, s.ID, s.State)
			}
		}
		for id, m := range live {
			s, err := n.Get(ctx, id)
			if err != nil {
				t.Fatalf("after %s: sandbox %s lost: %v", step, id, err)
			}
			m.state = s.State
			if s.State != sandboxes.Running {
				continue
			}
			cctx, cancel := context.WithTimeout(ctx, time.Minute)
			r, err := newEnvdClient(s).run(cctx, "", "/bin/sh", "-c", "cat /home/user/marker; kill -0 "+m.pid+" && echo alive")
			cancel()
			if err != nil || r.stdout != m.marker+"\nalive\n" {
				t.Fatalf("after %s: sandbox %s holds %+v (%v), want %q", step, id, r, err, m.marker)
			}
		}
	}
	adopt := func(s *sandboxes.Sandbox, m model) { m.state = s.State; live[s.ID] = &m }
	steps := 0
	for end := time.Now().Add(d); time.Now().Before(end); steps++ {
		var step string
		cctx, cancel := opCtx()
		// A caller that gave up before the operation began: nothing changed.
		gaveUp := func(err error) bool {
			return cctx.Err() != nil && (errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded))
		}
		switch k := rnd.Intn(10); {
		case k == 0 && len(live) < 4 || len(live) == 0:
			tpl := []string{"minimal", "soak"}[rnd.Intn(2)]
			if len(snaps) > 0 && rnd.Intn(2) == 0 {
				tpl = snaps[rnd.Intn(len(snaps))]
			}
			step = "create from " + tpl
			s, err := n.Create(cctx, CreateRequest{TemplateID: tpl})
			if gaveUp(err) {
				break
			}
			if err != nil {
				t.Fatalf("%s: %v", step, err)
			}
			if strings.HasPrefix(tpl, "soak-") { // a named snapshot: what it holds
				src := snapSource[tpl]
				adopt(s, src)
				break
			}
			r, err := newEnvdClient(s).run(ctx, "", "/bin/sh", "-c", "echo m-"+s.ID+" > /home/user/marker; sleep 100000 >/dev/null 2>&1 & echo $!")
			if err != nil || r.exit != 0 {
				t.Fatalf("prepare %s: %+v %v", s.ID, r, err)
			}
			adopt(s, model{marker: "m-" + s.ID, pid: strings.TrimSpace(r.stdout)})
		case k <= 2:
			if id := pick(sandboxes.Running); id != "" {
				step = "pause " + id
				_, err := n.Pause(cctx, id)
				if err != nil && !gaveUp(err) {
					t.Fatalf("%s: %v", step, err)
				}
			}
		case k <= 4:
			if id := pick(sandboxes.Paused); id != "" {
				step = "resume " + id
				if _, err := n.Resume(cctx, id, time.Minute); err != nil && !gaveUp(err) {
					t.Fatalf("%s: %v", step, err)
				}
			}
		case k == 5:
			if id := pick(sandboxes.Running); id != "" {
				name := fmt.Sprintf("soak-%d", steps)
				step = "snapshot " + id + " as " + name
				if _, err := n.Snapshot(cctx, id, name); err != nil {
					if gaveUp(err) {
						break
					}
					t.Fatalf("%s: %v", step, err)
				}
				snaps = append(snaps, name)
				snapSource[name] = *live[id]
				if len(snaps) > 3 {
					if err := n.DeleteSnapshot(ctx, snaps[0]); err != nil {
						t.Fatal(err)
					}
					snaps = snaps[1:]
				}
			}
		case k == 6:
			if id := pick(sandboxes.Running); id != "" && len(live) < 6 {
				step = "fork " + id
				res, err := n.Fork(cctx, id, 1+rnd.Intn(2), time.Minute)
				if gaveUp(err) {
					break
				}
				if err != nil {
					t.Fatalf("%s: %v", step, err)
				}
				for _, r := range res {
					if r.Err != nil {
						t.Fatalf("%s: child: %v", step, r.Err)
					}
					adopt(r.Sandbox, *live[id])
				}
			}
		case k <= 8:
			id := pick(sandboxes.Running)
			if id == "" {
				id = pick(sandboxes.Paused)
			}
			if id != "" && len(live) > 1 {
				step = "kill " + id
				if err := n.Kill(cctx, id); err != nil {
					if gaveUp(err) {
						break
					}
					t.Fatalf("%s: %v", step, err)
				}
				delete(live, id)
			}
		default:
			if steps%3 == 0 {
				builds++
				step = fmt.Sprintf("rebuild soak (%d)", builds)
				build(builds)
			}
		}
		cancel()
		if step != "" {
			check(step)
		}
	}
	t.Logf("%d steps, %d builds", steps, builds)
	for id := range live {
		n.Kill(ctx, id)
	}
	dropSnapshots(n)
	if err := n.DeleteTemplate(ctx, "soak"); err != nil {
		t.Fatal(err)
	}
	assertNoLeaks(t, n)
}

// unsureRepo is a repository whose puts this node cannot know to be
// atomic (a real posix_fs repository behind a type CheckAtomicPut does not
// vouch for, as an S3 server that ignores conditional writes would be).
type unsureRepo struct{ repository.Repository }

// TestSharingNeedsAtomicPuts: on a repository without atomic puts a node
// asked to share paused sandboxes does not (claims could have two
// winners), and a sandbox it does not have is refused saying why.
func TestSharingNeedsAtomicPuts(t *testing.T) {
	repo, err := repository.OpenPosixFS(filepath.Join(t.TempDir(), "repo"))
	if err != nil {
		t.Fatal(err)
	}
	slot := takeTestSlot()
	defer releaseTestSlot(slot)
	n := openTestNodeIn(t, newTestDataDir(t), slot, func(c *Config) {
		c.SharePaused, c.Repository = true, unsureRepo{repo}
	})
	if n.sharesPaused() {
		t.Fatal("the node shares paused sandboxes over a repository without atomic puts")
	}
	_, err = n.Resume(context.Background(), "elsewhere00000000000", time.Minute)
	if !errors.Is(err, ErrNotFound) || !strings.Contains(err.Error(), "not shared between nodes") {
		t.Fatalf("resume of a sandbox of another node: %v", err)
	}
	n.Close()
	// The same repository, vouched for: sharing is on.
	m := openTestNodeIn(t, newTestDataDir(t), slot, func(c *Config) {
		c.SharePaused, c.Repository = true, repo
	})
	defer m.Close()
	if !m.sharesPaused() {
		t.Fatalf("a posix_fs repository: sharing off (%v)", m.shareErr)
	}
}

// TestBusySandboxRefusesOperations: while one operation is in the middle
// of a sandbox (seen from inside it, at one of its steps), every other
// operation on it is refused at once with ErrConflict and changes nothing;
// a paused sandbox cannot be forked or snapshotted (resume it first).
func TestBusySandboxRefusesOperations(t *testing.T) {
	n := testNode(t)
	sub := newSubject(t, n)
	ctx := context.Background()
	var refusals []error
	inj := faults.NewInjector()
	inj.Hook = func(point string) {
		if point != "pause/save-state" {
			return
		}
		_, e1 := n.Pause(ctx, sub.s.ID)
		_, e2 := n.Resume(ctx, sub.s.ID, time.Minute)
		_, e3 := n.Fork(ctx, sub.s.ID, 1, time.Minute)
		_, e4 := n.Snapshot(ctx, sub.s.ID, "busy")
		e5 := n.Kill(ctx, sub.s.ID)
		refusals = []error{e1, e2, e3, e4, e5}
	}
	if _, err := n.Pause(faults.With(ctx, inj), sub.s.ID); err != nil {
		t.Fatal(err)
	}
	if len(refusals) != 5 {
		t.Fatal("the hook did not run")
	}
	for i, err := range refusals {
		if !errors.Is(err, ErrConflict) || !strings.Contains(err.Error(), "pausing") {
			t.Errorf("operation %d on a pausing sandbox: %v", i, err)
		}
	}
	if _, err := n.Fork(ctx, sub.s.ID, 1, time.Minute); !errors.Is(err, ErrConflict) || !strings.Contains(err.Error(), "resume it first") {
		t.Errorf("fork of a paused sandbox: %v", err)
	}
	if _, err := n.Snapshot(ctx, sub.s.ID, "of-paused"); !errors.Is(err, ErrConflict) {
		t.Errorf("snapshot of a paused sandbox: %v", err)
	}
	if all, _ := n.Snapshots(); len(all) != 0 {
		t.Errorf("refused snapshots were made: %v", all)
	}
	sub.check(t, n)
	// Template and snapshot names are one namespace.
	if _, err := n.Snapshot(ctx, sub.s.ID, "minimal"); !errors.Is(err, ErrConflict) {
		t.Errorf("snapshot named like a template: %v", err)
	}
	if _, err := n.Snapshot(ctx, sub.s.ID, "taken"); err != nil {
		t.Fatal(err)
	}
	if _, err := n.RequestBuild("taken", nil, 0, 0); !errors.Is(err, ErrConflict) {
		t.Errorf("build named like a snapshot: %v", err)
	}
	if err := n.templates.Install(ctx, Template{Name: "taken", Layer: "whatever"}); !errors.Is(err, ErrConflict) {
		t.Errorf("template named like a snapshot: %v", err)
	}
	dropSnapshots(n)
	sub.check(t, n)
	assertNoLeaks(t, n)
}

// TestSnapshotNamesAreClusterWide: two nodes sharing a repository never
// hold different snapshots under one name. A name the repository has is
// refused before anything is captured; a node that loses the race for a
// name (the other committed it while this one was capturing) withdraws
// its snapshot and answers 409; either way its sandbox runs on.
func TestSnapshotNamesAreClusterWide(t *testing.T) {
	repo, err := repository.OpenPosixFS(filepath.Join(t.TempDir(), "repo"))
	if err != nil {
		t.Fatal(err)
	}
	// The nodes of a cluster share the repository and the secret that
	// seals the tokens written there.
	withRepo := func(c *Config) {
		c.Repository, c.RepositorySecret = repo, []byte("the test cluster's node token, 32+ bytes")
	}
	slotA, slotB := takeTestSlot(), takeTestSlot()
	defer releaseTestSlot(slotA)
	defer releaseTestSlot(slotB)
	a := openTestNodeIn(t, newTestDataDir(t), slotA, withRepo)
	b := openTestNodeIn(t, newTestDataDir(t), slotB, withRepo)
	ctx := context.Background()
	defer func() {
		for _, n := range []*Node{a, b} {
			all, _ := n.List(ctx)
			for _, s := range all {
				n.Kill(ctx, s.ID)
			}
			dropSnapshots(n)
			n.Close()
		}
	}()
	sa, sb := newSubject(t, a), newSubject(t, b)
	if _, err := a.Snapshot(ctx, sa.s.ID, "taken-early"); err != nil {
		t.Fatal(err)
	}
	if _, err := b.Snapshot(ctx, sb.s.ID, "taken-early"); !errors.Is(err, ErrConflict) {
		t.Fatalf("a name the repository has: %v", err)
	}
	// The race: A commits the name while B is capturing under it.
	inj := faults.NewInjector()
	inj.Hook = func(point string) {
		if point == "snapshot/stop-vcpus" {
			if _, err := a.Snapshot(ctx, sa.s.ID, "raced"); err != nil {
				t.Errorf("the other node's snapshot: %v", err)
			}
		}
	}
	if _, err := b.Snapshot(faults.With(ctx, inj), sb.s.ID, "raced"); !errors.Is(err, ErrConflict) {
		t.Fatalf("the node that lost the race: %v", err)
	}
	if _, err := b.namedSnapshot("raced"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("the loser kept its snapshot: %v", err)
	}
	m, err := repo.Stat(ctx, repoKindSnapshot, "raced")
	if err != nil {
		t.Fatal(err)
	}
	_ = m
	// Sandboxes made from the name anywhere get the winner's.
	fromB := &subject{s: create(t, b, CreateRequest{TemplateID: "raced"}), pid: sa.pid, marker: sa.marker}
	fromB.check(t, b)
	b.Kill(ctx, fromB.s.ID)
	sb.check(t, b)
	sa.check(t, a)
	assertNoLeaks(t, b)
}

// TestQEMUDiesMidPause kills a sandbox's QEMU in the middle of its pause,
// before its state is saved: the pause answers an error, and the sandbox,
// whose machine is gone with nothing saved, is removed as a crashed one is
// (not left "running" without a machine for the expiry loop to retry).
func TestQEMUDiesMidPause(t *testing.T) {
	n := testNode(t)
	sub := newSubject(t, n)
	ctx := context.Background()
	inj := faults.NewInjector()
	inj.Hook = func(point string) {
		if point == "pause/save-state" {
			m := n.machines.get(sub.s.ID)
			syscall.Kill(m.PID(), syscall.SIGKILL)
			<-m.Exited()
		}
	}
	if _, err := n.Pause(faults.With(ctx, inj), sub.s.ID); err == nil {
		t.Fatal("a pause whose QEMU died succeeded")
	}
	if _, err := n.Get(ctx, sub.s.ID); !errors.Is(err, ErrNotFound) {
		t.Fatalf("the sandbox without a machine is still listed: %v", err)
	}
	assertNoLeaks(t, n)
}

// TestFreezeFailingTwiceKeepsTheSandbox: a freeze fails after the state
// was saved (moving the files) and completing it as paused fails too: the
// sandbox and its snapshot are kept as they are, and the node's next start
// completes the freeze, the sandbox resuming with its files and processes.
func TestFreezeFailingTwiceKeepsTheSandbox(t *testing.T) {
	dir := newTestDataDir(t)
	slot := takeTestSlot()
	defer releaseTestSlot(slot)
	n := openTestNodeIn(t, dir, slot)
	sub := newSubject(t, n)
	ctx := context.Background()
	inj := faults.NewInjector("fork/move-files", "rest-on-snapshot")
	if _, err := n.Fork(faults.With(ctx, inj), sub.s.ID, 1, time.Minute); !errors.Is(err, faults.ErrInjected) {
		t.Fatalf("fork failing twice: %v", err)
	}
	s, err := n.records.Get(ctx, sub.s.ID)
	if err != nil || s.State != sandboxes.Forking {
		t.Fatalf("after the double failure: %+v %v (want it kept, forking)", s, err)
	}
	n.Close()
	n = openTestNodeIn(t, dir, slot)
	defer func() {
		n.Kill(ctx, sub.s.ID)
		n.Close()
	}()
	sub.check(t, n)
	assertNoLeaks(t, n)
}

// TestRestartMidSecondPause: a sandbox paused and resumed once, then cut
// short by a crash in the middle of its next pause (QEMU still running):
// the first pause's record and state are gone with the resume, so recovery
// runs the sandbox on as it is, never back at the first pause.
func TestRestartMidSecondPause(t *testing.T) {
	dir := newTestDataDir(t)
	slot := takeTestSlot()
	defer releaseTestSlot(slot)
	n := openTestNodeIn(t, dir, slot)
	ctx := context.Background()
	sub := newSubject(t, n)
	if _, err := n.Pause(ctx, sub.s.ID); err != nil {
		t.Fatal(err)
	}
	s, err := n.Resume(ctx, sub.s.ID, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if r, err := newEnvdClient(s).run(ctx, "", "/bin/sh", "-c", "echo after-resume > /home/user/marker"); err != nil || r.exit != 0 {
		t.Fatalf("write after the resume: %+v %v", r, err)
	}
	sub.marker = "after-resume"
	// The second pause is cut short before it saved anything.
	if err := n.records.Move(ctx, s.ID, sandboxes.Running, sandboxes.Pausing, ""); err != nil {
		t.Fatal(err)
	}
	n.Close()
	n = openTestNodeIn(t, dir, slot)
	defer func() {
		n.Kill(ctx, sub.s.ID)
		n.Close()
	}()
	got, err := n.Get(ctx, sub.s.ID)
	if err != nil || got.State != sandboxes.Running {
		t.Fatalf("after the restart: %+v %v (want it running on)", got, err)
	}
	sub.check(t, n)
}

// TestRestartMidLiveCaptureWithoutQEMU: a copy-on-write sandbox whose live
// capture was cut short and whose QEMU is gone has nothing saved: it is
// removed, never rolled back to the snapshot it was restored from.
func TestRestartMidLiveCaptureWithoutQEMU(t *testing.T) {
	dir := newTestDataDir(t)
	slot := takeTestSlot()
	defer releaseTestSlot(slot)
	n := openTestNodeIn(t, dir, slot)
	ctx := context.Background()
	sub := cowSubject(t, n)
	if err := n.records.Move(ctx, sub.s.ID, sandboxes.Running, sandboxes.Snapshotting, ""); err != nil {
		t.Fatal(err)
	}
	m := n.machines.get(sub.s.ID)
	n.Close()
	syscall.Kill(m.PID(), syscall.SIGKILL)
	<-m.Exited()
	n = openTestNodeIn(t, dir, slot)
	defer n.Close()
	if s, err := n.Get(ctx, sub.s.ID); !errors.Is(err, ErrNotFound) {
		t.Fatalf("a capture without QEMU or saved state came back as %+v (%v)", s, err)
	}
	assertNoLeaks(t, n)
}
