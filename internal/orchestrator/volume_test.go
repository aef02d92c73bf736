package orchestrator

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/agentenv/agentenv/internal/guest"
	"github.com/agentenv/agentenv/internal/mountinfo"
	"github.com/agentenv/agentenv/internal/sandboxes"
	"github.com/agentenv/agentenv/internal/statedb"
	"github.com/agentenv/agentenv/internal/storage/repository"
	"github.com/agentenv/agentenv/internal/volumes"
)

// testVolumes is a volume store of its own for a test node.
func testVolumes(t *testing.T) *volumes.Store {
	t.Helper()
	testData(t) // root and the prepared data dir, or skip
	return openVolumes(t, t.TempDir())
}

// openVolumes opens the volume store in dir.
func openVolumes(t testing.TB, dir string) *volumes.Store {
	t.Helper()
	db, err := statedb.Open(filepath.Join(dir, "volumes.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	vols, err := volumes.Open(context.Background(), db, volumes.Config{Dir: filepath.Join(dir, "volumes"), Size: 1 << 30,
		UID: guest.DefaultUID, GID: guest.DefaultUID, Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { vols.Close() })
	return vols
}

func readVolumeFile(t *testing.T, vols *volumes.Store, id, p string) (string, error) {
	t.Helper()
	var b bytes.Buffer
	err := vols.ReadFile(context.Background(), id, p, func(int64) {}, &b)
	return b.String(), err
}

func guestRun(t *testing.T, s *sandboxes.Sandbox, user, script string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	r, err := newEnvdClient(s).run(ctx, user, "/bin/sh", "-c", script)
	if err != nil || r.exit != 0 {
		t.Fatalf("in the guest, %q: %+v %v", script, r, err)
	}
	return r.stdout
}

// TestVolumeInSandbox mounts a volume the host wrote into a sandbox: the
// guest reads and writes it as its default user, the host may not touch it
// (nor delete it, nor lend it to a second sandbox) while the sandbox holds
// it, it stays mounted through a pause, and what the guest wrote is in the
// volume after the kill, for a sandbox of the template snapshot to read.
func TestVolumeInSandbox(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	vols := testVolumes(t)
	n := testNode(t, func(c *Config) { c.Volumes = vols })
	v, err := vols.Create(ctx, "data")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := vols.WriteFile(ctx, v.ID, "/from-host.txt", volumes.Owner{}, false, strings.NewReader("written by the host\n")); err != nil {
		t.Fatal(err)
	}
	mount := []VolumeMount{{VolumeID: v.ID, Name: v.Name, Path: "/mnt/data"}}
	s := create(t, n, CreateRequest{TemplateID: "base", Secure: true, Volumes: mount})
	if got := guestRun(t, s, "", "cat /mnt/data/from-host.txt; stat -c %u /mnt/data; echo guest > /mnt/data/from-guest.txt"); got != "written by the host\n1000\n" {
		t.Fatalf("the guest sees %q in its volume", got)
	}
	got, _ := n.Get(ctx, s.ID)
	if len(got.Volumes) != 1 || got.Volumes[0].Path != "/mnt/data" || got.VolumeSlots != VolumeSlots {
		t.Fatalf("the record holds %+v in %d slots", got.Volumes, got.VolumeSlots)
	}

	// Held: the host's content routes, a deletion and a second sandbox
	// are refused, and the refused create leaves nothing.
	if _, err := readVolumeFile(t, vols, v.ID, "/from-host.txt"); !errors.Is(err, ErrConflict) {
		t.Fatalf("host read of a mounted volume = %v, want conflict", err)
	}
	if err := vols.Delete(ctx, v.ID); !errors.Is(err, ErrConflict) {
		t.Fatalf("deleting a mounted volume = %v, want conflict", err)
	}
	before, _ := n.records.List(ctx, "")
	if _, err := n.Create(ctx, CreateRequest{TemplateID: "base", Volumes: mount}); !errors.Is(err, ErrConflict) || !strings.Contains(err.Error(), s.ID) {
		t.Fatalf("a second sandbox mounting the volume = %v, want a conflict naming %s", err, s.ID)
	}
	if after, _ := n.records.List(ctx, ""); len(after) != len(before) {
		t.Fatalf("the refused create left records: %d, then %d", len(before), len(after))
	}
	// A named snapshot keeps the volume as it was: a sandbox made from it
	// mounts its own copy (and may mount another volume beside it).
	guestRun(t, s, "", "echo snapshotted > /mnt/data/snap.txt")
	if _, err := n.Snapshot(ctx, s.ID, "with-volume"); err != nil {
		t.Fatal(err)
	}
	guestRun(t, s, "", "echo after > /mnt/data/snap.txt")
	other, err := vols.Create(ctx, "other")
	if err != nil {
		t.Fatal(err)
	}
	fromSnap := create(t, n, CreateRequest{TemplateID: "with-volume", Volumes: []VolumeMount{{VolumeID: other.ID, Name: other.Name, Path: "/mnt/other"}}})
	if got := guestRun(t, fromSnap, "", "cat /mnt/data/snap.txt; echo mine > /mnt/data/snap.txt; echo o > /mnt/other/o.txt"); got != "snapshotted\n" {
		t.Fatalf("the sandbox from the snapshot reads %q", got)
	}
	if len(fromSnap.Volumes) != 2 || !fromSnap.Volumes[0].Copy || fromSnap.Volumes[1].Copy || fromSnap.Volumes[1].Slot != 1 {
		t.Fatalf("the snapshot's sandbox has volumes %+v", fromSnap.Volumes)
	}
	if got := guestRun(t, s, "", "cat /mnt/data/snap.txt; rm /mnt/data/snap.txt"); got != "after\n" {
		t.Fatalf("the snapshot's sandbox wrote into the parent's volume: %q", got)
	}
	if err := n.Kill(ctx, fromSnap.ID); err != nil {
		t.Fatal(err)
	}
	if got, err := readVolumeFile(t, vols, other.ID, "/o.txt"); err != nil || got != "o\n" {
		t.Fatalf("the second volume: %q %v", got, err)
	}
	// A fork (this parent has a RAM file of its own: it is frozen and
	// restored): the child has its own copy of the volume as it was.
	forkAndCompare(t, n, s, "/mnt/data")

	// Through a pause with memory, the volume stays mounted and writable.
	if _, err := n.Pause(ctx, s.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := readVolumeFile(t, vols, v.ID, "/from-guest.txt"); !errors.Is(err, ErrConflict) {
		t.Fatalf("host read of a paused sandbox's volume = %v, want conflict", err)
	}
	// (A refused create once tore down the network of the sandbox in
	// slot 0, this one: its resume found no envd.)
	if s, err = n.Resume(ctx, s.ID, time.Minute); err != nil {
		t.Fatal(err)
	}
	guestRun(t, s, "", "cat /mnt/data/from-guest.txt >/dev/null && echo after pause >> /mnt/data/from-guest.txt")
	// Through a pause without memory (the guest boots again and mounts it).
	if _, err := n.PauseFilesystem(ctx, s.ID); err != nil {
		t.Fatal(err)
	}
	if s, err = n.Resume(ctx, s.ID, time.Minute); err != nil {
		t.Fatal(err)
	}
	if got := guestRun(t, s, "", "cat /mnt/data/from-guest.txt"); got != "guest\nafter pause\n" {
		t.Fatalf("after a pause without memory the guest reads %q", got)
	}
	if err := n.Kill(ctx, s.ID); err != nil {
		t.Fatal(err)
	}
	if got, err := readVolumeFile(t, vols, v.ID, "/from-guest.txt"); err != nil || got != "guest\nafter pause\n" {
		t.Fatalf("after the kill the volume has %q, %v", got, err)
	}

	// A create whose mount fails in the guest (the path is a file) fails,
	// leaves nothing and gives the volume back.
	before, _ = n.records.List(ctx, "")
	if _, err := n.Create(ctx, CreateRequest{TemplateID: "base", Volumes: []VolumeMount{{VolumeID: v.ID, Name: v.Name, Path: "/home/user/.bashrc"}}}); err == nil || !strings.Contains(err.Error(), "mount") {
		t.Fatalf("a create mounting over a file = %v", err)
	}
	if after, _ := n.records.List(ctx, ""); len(after) != len(before) {
		t.Fatalf("the failed create left records: %d, then %d", len(before), len(after))
	}
	if _, err := readVolumeFile(t, vols, v.ID, "/from-guest.txt"); err != nil {
		t.Fatalf("the volume after a failed create: %v", err)
	}

	// A sandbox restored from the template snapshot mounts it too.
	if err := n.PrepareTemplateSnapshot(ctx, "base"); err != nil {
		t.Fatal(err)
	}
	s = create(t, n, CreateRequest{TemplateID: "base", Volumes: []VolumeMount{{VolumeID: v.ID, Name: v.Name, Path: "/home/user/vol"}}})
	if s.SnapshotID == "" {
		t.Fatal("the sandbox did not restore the template snapshot")
	}
	if got := guestRun(t, s, "", "cat /home/user/vol/from-guest.txt && rm /home/user/vol/from-host.txt"); got != "guest\nafter pause\n" {
		t.Fatalf("the restored sandbox sees %q", got)
	}
	// A fork of a copy-on-write sandbox (captured without a restart).
	forkAndCompare(t, n, s, "/home/user/vol")
	if err := n.Kill(ctx, s.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := readVolumeFile(t, vols, v.ID, "/from-host.txt"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("a file the guest removed reads %v, want not found", err)
	}
	for _, f := range []string{"/parent.txt", "/child.txt"} {
		got, err := readVolumeFile(t, vols, v.ID, f)
		if f == "/parent.txt" && (err != nil || got != "parent\nparent\n") {
			t.Fatalf("the parents' writes: %q %v", got, err)
		}
		if f == "/child.txt" && !errors.Is(err, ErrNotFound) {
			t.Fatalf("a child's write reached the volume: %q %v", got, err)
		}
	}
	if err := vols.Delete(ctx, v.ID); err != nil {
		t.Fatalf("deleting the volume once no sandbox holds it: %v", err)
	}
}

// forkAndCompare forks s (which mounts a volume at mnt) into one child:
// the child reads what the parent wrote before, and what either writes
// after is its own; the child goes, and the volume stays the parent's.
func forkAndCompare(t *testing.T, n *Node, s *sandboxes.Sandbox, mnt string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	before := guestRun(t, s, "", "echo before > "+mnt+"/before-fork.txt; cat "+mnt+"/parent.txt 2>/dev/null; true")
	res, err := n.Fork(ctx, s.ID, 1, time.Minute)
	if err != nil || len(res) != 1 || res[0].Err != nil {
		t.Fatalf("fork: %v %+v", err, res)
	}
	child := res[0].Sandbox
	if len(child.Volumes) != 1 || !child.Volumes[0].Copy {
		t.Fatalf("the child's volumes: %+v", child.Volumes)
	}
	if got := guestRun(t, child, "", "cat "+mnt+"/before-fork.txt; echo child > "+mnt+"/child.txt"); got != "before\n" {
		t.Fatalf("the child reads %q", got)
	}
	guestRun(t, s, "", "echo parent >> "+mnt+"/parent.txt; rm "+mnt+"/before-fork.txt")
	if got := guestRun(t, s, "", "ls "+mnt); strings.Contains(got, "child.txt") {
		t.Fatalf("the parent sees the child's file: %q", got)
	}
	if got := guestRun(t, child, "", "cat "+mnt+"/before-fork.txt "+mnt+"/parent.txt 2>/dev/null; true"); got != "before\n"+before {
		t.Fatalf("the child sees the parent's changes: %q", got)
	}
	if err := n.Kill(ctx, child.ID); err != nil {
		t.Fatal(err)
	}
	if got := guestRun(t, s, "", "cat "+mnt+"/parent.txt"); !strings.HasSuffix(got, "parent\n") {
		t.Fatalf("the parent, after its child went: %q", got)
	}
}

// TestVolumeSnapshotThroughRepository snapshots a fork's child (whose
// volume is a copy-on-write copy over its fork's) into a repository, loses
// every local copy, and creates a sandbox from the repository's: the
// volume's copy went with the snapshot, whole.
func TestVolumeSnapshotThroughRepository(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 6*time.Minute)
	defer cancel()
	n, vols, v := volumeNodeWithRepository(t)
	parent := create(t, n, CreateRequest{TemplateID: "base", Volumes: []VolumeMount{{VolumeID: v.ID, Name: v.Name, Path: "/mnt/v"}}})
	guestRun(t, parent, "", "echo parent > /mnt/v/p.txt")
	res, err := n.Fork(ctx, parent.ID, 1, time.Minute)
	if err != nil || res[0].Err != nil {
		t.Fatalf("fork: %v %+v", err, res)
	}
	child := res[0].Sandbox
	guestRun(t, child, "", "echo child >> /mnt/v/p.txt")
	ns, err := n.Snapshot(ctx, child.ID, "vol-durable")
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range []*sandboxes.Sandbox{child, parent} {
		if err := n.Kill(ctx, s.ID); err != nil {
			t.Fatal(err)
		}
	}
	n.gc(ctx)
	os.RemoveAll(n.snapshotDir(ns.SnapshotID))
	s := create(t, n, CreateRequest{TemplateID: "vol-durable"})
	if got := guestRun(t, s, "", "cat /mnt/v/p.txt"); got != "parent\nchild\n" {
		t.Fatalf("the sandbox from the repository's snapshot reads %q", got)
	}
	if got, err := readVolumeFile(t, vols, v.ID, "/p.txt"); err != nil || got != "parent\n" {
		t.Fatalf("the volume itself: %q %v", got, err)
	}
}

// TestVolumeHeldAcrossRestart: a node restarted (and its volume store with
// it) while a sandbox has a volume mounted holds it again for the sandbox
// it re-adopts, and gives it back with that sandbox's kill.
func TestVolumeHeldAcrossRestart(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	testData(t)
	vdir, dir := t.TempDir(), newTestDataDir(t)
	slot := takeTestSlot()
	vols := openVolumes(t, vdir)
	n := openTestNodeIn(t, dir, slot, func(c *Config) { c.Volumes = vols })
	// Whatever the test ends with, the node it ends with kills what it has
	// (a failed run left a QEMU behind otherwise).
	t.Cleanup(func() {
		all, _ := n.records.List(context.Background(), "")
		for _, s := range all {
			if err := n.Kill(context.Background(), s.ID); err != nil {
				n.destroy(context.Background(), s)
			}
		}
		n.Close()
		releaseTestSlot(slot)
	})
	v, err := vols.Create(ctx, "data")
	if err != nil {
		t.Fatal(err)
	}
	s := create(t, n, CreateRequest{TemplateID: "minimal", Volumes: []VolumeMount{{VolumeID: v.ID, Name: v.Name, Path: "/mnt/v"}}})
	guestRun(t, s, "", "echo before restart > /mnt/v/f")
	n.Close()
	vols.Close()

	vols = openVolumes(t, vdir)
	n = openTestNodeIn(t, dir, slot, func(c *Config) { c.Volumes = vols })
	if _, err := readVolumeFile(t, vols, v.ID, "/f"); !errors.Is(err, ErrConflict) {
		t.Fatalf("after the restart the host reads the mounted volume: %v", err)
	}
	guestRun(t, s, "", "echo after restart >> /mnt/v/f")
	if err := n.Kill(ctx, s.ID); err != nil {
		t.Fatal(err)
	}
	if got, err := readVolumeFile(t, vols, v.ID, "/f"); err != nil || got != "before restart\nafter restart\n" {
		t.Fatalf("after the kill: %q %v", got, err)
	}
}

// TestFilesystemSnapshot snapshots a running sandbox's filesystem alone
// (with a volume): the sandbox runs on, unchanged; the snapshot has no
// memory; a sandbox of another size made from it boots with the files
// (and a copy of the volume) but none of the processes; and it goes
// through the repository and back.
func TestFilesystemSnapshot(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 6*time.Minute)
	defer cancel()
	n, vols, v := volumeNodeWithRepository(t)
	s := create(t, n, CreateRequest{TemplateID: "base", Secure: true, Volumes: []VolumeMount{{VolumeID: v.ID, Name: v.Name, Path: "/mnt/v"}}})
	bg := strings.TrimSpace(guestRun(t, s, "", "nohup sleep 1000 >/dev/null 2>&1 & echo $!; echo kept > /home/user/f; echo vol > /mnt/v/f"))
	ns, err := n.SnapshotFilesystem(ctx, s.ID, "fs-snap")
	if err != nil {
		t.Fatal(err)
	}
	if !ns.FilesystemOnly || len(ns.Volumes) != 1 {
		t.Fatalf("the snapshot: %+v", ns)
	}
	for _, f := range []string{snapMemName, snapStateName} {
		if _, err := os.Stat(filepath.Join(n.snapshotDir(ns.SnapshotID), f)); !errors.Is(err, os.ErrNotExist) {
			t.Fatalf("a filesystem snapshot has %s: %v", f, err)
		}
	}
	if got, _ := n.Get(ctx, s.ID); got.State != sandboxes.Running {
		t.Fatalf("the source after the snapshot: %s", got.State)
	}
	guestRun(t, s, "", "kill -0 "+bg+" && echo later > /home/user/f && echo later > /mnt/v/f")

	check := func(what string) {
		t.Helper()
		c := create(t, n, CreateRequest{TemplateID: "fs-snap", VCPUs: 1, MemoryMiB: 384})
		if c.VCPUs != 1 || c.MemoryMiB != 384 {
			t.Fatalf("%s: size %d/%d", what, c.VCPUs, c.MemoryMiB)
		}
		if got := guestRun(t, c, "", "cat /home/user/f /mnt/v/f; pgrep -x sleep || echo no sleep; echo mine > /mnt/v/f"); got != "kept\nvol\nno sleep\n" {
			t.Fatalf("%s: the sandbox from the snapshot has %q", what, got)
		}
		if err := n.Kill(ctx, c.ID); err != nil {
			t.Fatal(err)
		}
	}
	check("local")
	if got := guestRun(t, s, "", "cat /mnt/v/f"); got != "later\n" {
		t.Fatalf("the source's volume after its snapshot's sandbox wrote its copy: %q", got)
	}
	if err := n.Kill(ctx, s.ID); err != nil {
		t.Fatal(err)
	}
	if got, err := readVolumeFile(t, vols, v.ID, "/f"); err != nil || got != "later\n" {
		t.Fatalf("the volume after its sandbox went: %q %v", got, err)
	}
	n.gc(ctx)
	os.RemoveAll(n.snapshotDir(ns.SnapshotID))
	check("from the repository")
}

// BenchmarkCreateWithVolume measures creating a sandbox from the base
// template's snapshot with a volume mounted, against the baseline of the
// same create without one (measured in the same run, alternating), and a
// fork of a sandbox with a volume (whose disk the fork copies) against a
// fork of one without. Reports p50 and p90. Run with e.g.
// `-bench CreateWithVolume -benchtime 10x`.
func BenchmarkCreateWithVolume(b *testing.B) {
	ctx := context.Background()
	testData(b)
	vols := openVolumes(b, b.TempDir())
	n := testNode(b, func(c *Config) { c.Volumes = vols })
	if err := n.PrepareTemplateSnapshot(ctx, "base"); err != nil {
		b.Fatal(err)
	}
	v, err := vols.Create(ctx, "bench")
	if err != nil {
		b.Fatal(err)
	}
	// Some data in the volume, as a training set would be.
	if _, err := vols.WriteFile(ctx, v.ID, "/data.bin", volumes.Owner{}, false, bytes.NewReader(make([]byte, 8<<20))); err != nil {
		b.Fatal(err)
	}
	mount := []VolumeMount{{VolumeID: v.ID, Name: v.Name, Path: "/mnt/v"}}
	for _, tc := range []struct {
		name   string
		mounts []VolumeMount
	}{{"baseline-create", nil}, {"create-with-volume", mount}} {
		b.Run(tc.name, func(b *testing.B) {
			var ds []time.Duration
			for i := 0; i < b.N; i++ {
				start := time.Now()
				s, err := n.Create(ctx, CreateRequest{TemplateID: "base", Volumes: tc.mounts})
				if err != nil {
					b.Fatal(err)
				}
				ds = append(ds, time.Since(start))
				b.StopTimer()
				if err := n.Kill(ctx, s.ID); err != nil {
					b.Fatal(err)
				}
				b.StartTimer()
			}
			reportPercentiles(b, ds)
		})
	}
	for _, tc := range []struct {
		name   string
		mounts []VolumeMount
	}{{"baseline-fork", nil}, {"fork-with-volume", mount}} {
		b.Run(tc.name, func(b *testing.B) {
			s, err := n.Create(ctx, CreateRequest{TemplateID: "base", Volumes: tc.mounts})
			if err != nil {
				b.Fatal(err)
			}
			defer n.Kill(ctx, s.ID)
			var ds []time.Duration
			for i := 0; i < b.N; i++ {
				start := time.Now()
				res, err := n.Fork(ctx, s.ID, 1, time.Minute)
				if err != nil || res[0].Err != nil {
					b.Fatalf("fork: %v %+v", err, res)
				}
				ds = append(ds, time.Since(start))
				b.StopTimer()
				if err := n.Kill(ctx, res[0].Sandbox.ID); err != nil {
					b.Fatal(err)
				}
				b.StartTimer()
			}
			reportPercentiles(b, ds)
		})
	}
}

// volumeNodeWithRepository is a test node with a volume store and a
// posix_fs repository of its own, and a volume "data".
func volumeNodeWithRepository(t *testing.T) (*Node, *volumes.Store, *volumes.Volume) {
	t.Helper()
	repo, err := repository.OpenPosixFS(filepath.Join(t.TempDir(), "repo"))
	if err != nil {
		t.Fatal(err)
	}
	vols := testVolumes(t)
	n := testNode(t, func(c *Config) { c.Volumes, c.Repository = vols, repo })
	v, err := vols.Create(context.Background(), "data")
	if err != nil {
		t.Fatal(err)
	}
	return n, vols, v
}

// TestTwoNodesWithVolumes runs two nodes on one host (distinct instances,
// data dirs and volume stores), each with volumes in use. Node B's volume
// is open on the host (its files were just written through the content
// API) when node A's QEMU starts, whose mount namespace begins as a copy
// of the host's: it must hold no copy of that mount, or B's unmount at the
// next lend waits for a fuse2fs that never exits (and kills it, 30 s
// later, risking its writes). B lends its volume at once; both keep
// working; what each guest wrote is in its volume.
func TestTwoNodesWithVolumes(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	testData(t)
	dirB := t.TempDir()
	volsA, volsB := testVolumes(t), openVolumes(t, dirB)
	a := testNode(t, func(c *Config) { c.Volumes = volsA })
	b := testNode(t, func(c *Config) { c.Volumes = volsB })
	if a.net.Instance() == b.net.Instance() {
		t.Fatalf("both nodes are instance %s", a.net.Instance())
	}
	va, err := volsA.Create(ctx, "a")
	if err != nil {
		t.Fatal(err)
	}
	vb, err := volsB.Create(ctx, "b")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := volsB.WriteFile(ctx, vb.ID, "/f", volumes.Owner{}, true, strings.NewReader("from the host\n")); err != nil {
		t.Fatal(err)
	}
	mount := func(v *volumes.Volume) []VolumeMount {
		return []VolumeMount{{VolumeID: v.ID, Name: v.Name, Path: "/mnt/v"}}
	}
	sa := create(t, a, CreateRequest{TemplateID: "minimal", Volumes: mount(va)})
	mi, err := os.ReadFile(fmt.Sprintf("/proc/%d/mountinfo", a.machines.get(sa.ID).PID()))
	if err != nil {
		t.Fatal(err)
	}
	for _, mp := range mountinfo.Points(mi) {
		if strings.HasPrefix(mp, dirB+"/") || strings.HasPrefix(mp, b.cfg.DataDir+"/") {
			t.Errorf("node A's QEMU holds a copy of node B's mount %s", mp)
		}
	}

	start := time.Now()
	sb := create(t, b, CreateRequest{TemplateID: "minimal", Volumes: mount(vb)})
	lent := time.Since(start)
	if got := guestRun(t, sb, "", "cat /mnt/v/f && echo from b >> /mnt/v/f"); got != "from the host\n" {
		t.Fatalf("node B's volume in its sandbox: %q", got)
	}
	guestRun(t, sa, "", "echo from a > /mnt/v/f")
	t.Logf("node B lent its volume (open on the host) in a create of %s while node A's sandbox ran", lent.Round(time.Millisecond))
	for _, c := range []struct {
		n    *Node
		s    *sandboxes.Sandbox
		vols *volumes.Store
		v    *volumes.Volume
		want string
	}{{b, sb, volsB, vb, "from the host\nfrom b\n"}, {a, sa, volsA, va, "from a\n"}} {
		if err := c.n.Kill(ctx, c.s.ID); err != nil {
			t.Fatal(err)
		}
		if got, err := readVolumeFile(t, c.vols, c.v.ID, "/f"); err != nil || got != c.want {
			t.Fatalf("volume %s after its sandbox ended: %q %v", c.v.Name, got, err)
		}
	}
}
