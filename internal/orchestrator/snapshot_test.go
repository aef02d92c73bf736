package orchestrator

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/agentenv/agentenv/internal/sandboxes"
	"github.com/agentenv/agentenv/internal/storage"
	"github.com/agentenv/agentenv/internal/storage/repository"
	"github.com/agentenv/agentenv/internal/vmm"
)

func TestNamedSnapshotAsTemplate(t *testing.T) {
	n := testNode(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	src := create(t, n, CreateRequest{TemplateID: "base", Secure: true})
	r, err := newEnvdClient(src).run(ctx, "", "bash", "-c", "nohup sleep 1000 >/dev/null 2>&1 & echo $!; echo prepared > /home/user/state")
	if err != nil || r.exit != 0 {
		t.Fatalf("prepare: %+v %v", r, err)
	}
	sleeper := strings.TrimSpace(r.stdout)

	for _, bad := range []string{"", "../x", "Upper", "base"} {
		if _, err := n.Snapshot(ctx, src.ID, bad); !errors.Is(err, ErrInvalid) && !errors.Is(err, ErrConflict) {
			t.Errorf("snapshot name %q: %v", bad, err)
		}
	}
	ns, err := n.Snapshot(ctx, src.ID, "prepared-env")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := n.Snapshot(ctx, src.ID, "prepared-env"); !errors.Is(err, ErrConflict) {
		t.Fatalf("duplicate snapshot name: %v", err)
	}
	if got, _ := n.Get(ctx, src.ID); got.State != sandboxes.Running {
		t.Fatalf("source after snapshot: %+v", got)
	}
	list, _ := n.Snapshots()
	if len(list) != 1 || list[0].Name != "prepared-env" || list[0].SandboxID != src.ID {
		t.Fatalf("snapshots: %+v", list)
	}
	for i := 0; i < 2; i++ {
		s := create(t, n, CreateRequest{TemplateID: ns.Name, Secure: true, EnvVars: map[string]string{"I": "x"}})
		if s.TemplateID != ns.Name || s.AccessToken == src.AccessToken {
			t.Fatalf("sandbox from snapshot: %+v", s)
		}
		out, err := newEnvdClient(s).run(ctx, "", "bash", "-c", "kill -0 "+sleeper+" && cat /home/user/state && echo $I && whoami")
		if err != nil || out.stdout != "prepared\nx\nuser\n" {
			t.Fatalf("sandbox from snapshot: %+v %v", out, err)
		}
	}
	if _, err := n.Create(ctx, CreateRequest{TemplateID: ns.Name, MemoryMiB: 1024}); !errors.Is(err, ErrInvalid) {
		t.Fatalf("resized create from snapshot: %v", err)
	}
	if err := n.DeleteSnapshot(ctx, ns.Name); err != nil {
		t.Fatal(err)
	}
	if _, err := n.Create(ctx, CreateRequest{TemplateID: ns.Name}); !errors.Is(err, ErrNotFound) {
		t.Fatalf("create from deleted snapshot: %v", err)
	}
	all, _ := n.List(ctx)
	for _, s := range all {
		if err := n.Kill(ctx, s.ID); err != nil {
			t.Fatal(err)
		}
	}
	if snaps, _ := os.ReadDir(filepath.Join(n.cfg.DataDir, snapshotsDir)); len(snaps) != 0 {
		t.Fatalf("snapshot files left: %v", snaps)
	}
}

// TestSnapshotRepository commits a named snapshot to a posix_fs repository,
// loses the node's local copy, and creates a sandbox from the repository's.
func TestSnapshotRepository(t *testing.T) {
	repoRoot := filepath.Join(t.TempDir(), "repo")
	repo, err := repository.OpenPosixFS(repoRoot)
	if err != nil {
		t.Fatal(err)
	}
	n := testNode(t, func(c *Config) { c.Repository = repo })
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	src := create(t, n, CreateRequest{TemplateID: "minimal", Secure: true})
	if r, err := newEnvdClient(src).run(ctx, "", "/bin/sh", "-c", "echo durable > /home/user/f"); err != nil || r.exit != 0 {
		t.Fatalf("prepare: %+v %v", r, err)
	}
	start := time.Now()
	ns, err := n.Snapshot(ctx, src.ID, "durable")
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("snapshot + commit took %s", time.Since(start))
	m, err := repo.Stat(ctx, repoKindSnapshot, "durable")
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("repository artifact: %d files", len(m.Files))
	// The envd token the snapshot's guest holds is sealed there, never in
	// plaintext.
	if rec, err := os.ReadFile(filepath.Join(repoRoot, repoKindSnapshot, "durable", exportRecordName)); err != nil ||
		src.AccessToken == "" || strings.Contains(string(rec), src.AccessToken) {
		t.Fatalf("the repository's record holds the envd token in plaintext (or is unreadable: %v)", err)
	}
	// Lose the local copy: the source sandbox (which depends on it), the
	// record and the files.
	if err := n.Kill(ctx, src.ID); err != nil {
		t.Fatal(err)
	}
	os.RemoveAll(filepath.Join(n.cfg.DataDir, snapshotsDir, ns.SnapshotID))
	s := create(t, n, CreateRequest{TemplateID: "durable"})
	// The copy says which tap MAC its guest knows: no ARP through it.
	if !guestIsPermanentNeighbour(t, n, s) {
		t.Error("a sandbox from the repository copy is asked for its MAC: the copy lost its gateway MAC")
	}
	r, err := newEnvdClient(s).run(ctx, "", "/bin/sh", "-c", "cat /home/user/f")
	if err != nil || r.stdout != "durable\n" {
		t.Fatalf("sandbox from the repository copy: %+v %v", r, err)
	}
	n.Kill(ctx, s.ID)
	// A corrupted repository copy is refused with a clear error, nothing half-made.
	if err := os.RemoveAll(filepath.Join(n.cfg.DataDir, snapshotsDir)); err != nil {
		t.Fatal(err)
	}
	n.forgetSnapshotName(ctx, "durable")
	var state string
	filepath.WalkDir(filepath.Join(filepath.Dir(n.cfg.DataDir)), func(p string, d os.DirEntry, err error) error {
		if err == nil && d.Name() == snapStateName && strings.Contains(p, "repo") {
			state = p
		}
		return nil
	})
	if state == "" {
		t.Fatal("state file not found in the repository")
	}
	os.Chmod(state, 0o600)
	if err := os.WriteFile(state, []byte("garbage"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := n.Create(ctx, CreateRequest{TemplateID: "durable"}); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("create from a corrupt repository copy: %v", err)
	}
	if all, _ := n.List(ctx); len(all) != 0 {
		t.Fatalf("sandboxes left after a failed import: %d", len(all))
	}
}

// TestIncrementalSnapshot takes a second snapshot of a sandbox that runs on
// its first: only the pages changed since then are written, the first
// snapshot's RAM image is kept for as long as the second needs it, a
// sandbox made from the second has the state of both, and a corrupted
// state file is refused with a clear error.
func TestIncrementalSnapshot(t *testing.T) {
	// Both ways of finding the changed RAM (the probed QEMU picks one).
	for _, how := range []vmm.DiffCapture{vmm.CapturePrivatePages, vmm.CaptureMigration} {
		t.Run(string(how), func(t *testing.T) { testIncrementalSnapshot(t, how) })
	}
}

func testIncrementalSnapshot(t *testing.T, how vmm.DiffCapture) {
	n := testNode(t, func(c *Config) { c.DiffCapture = how })
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	src := create(t, n, CreateRequest{TemplateID: "minimal", Secure: true})
	c := newEnvdClient(src)
	r, err := c.run(ctx, "", "/bin/sh", "-c", "echo one > /home/user/one; sleep 1000 >/dev/null 2>&1 & echo $!")
	if err != nil || r.exit != 0 {
		t.Fatalf("prepare: %+v %v", r, err)
	}
	sleeper := strings.TrimSpace(r.stdout)
	first, err := n.Snapshot(ctx, src.ID, "first")
	if err != nil {
		t.Fatal(err)
	}
	// The source now runs copy-on-write on the first snapshot's RAM image.
	cur, _ := n.Get(ctx, src.ID)
	if !cur.MemPrivate || cur.State != sandboxes.Running {
		t.Fatalf("source after the first snapshot: %+v", cur)
	}
	c = newEnvdClient(cur)
	// 4 MiB of new data in guest memory (tmpfs) and a file on disk.
	r, err = c.run(ctx, "", "/bin/sh", "-c", "mkdir -p /dev/shm && mount -t tmpfs tmpfs /dev/shm 2>/dev/null; head -c 4194304 /dev/urandom > /dev/shm/blob && md5sum /dev/shm/blob | cut -c1-32; echo two > /home/user/two")
	if err != nil || r.exit != 0 {
		t.Fatalf("write: %+v %v", r, err)
	}
	sum := strings.TrimSpace(r.stdout)
	second, err := n.Snapshot(ctx, src.ID, "second")
	if err != nil {
		t.Fatal(err)
	}
	var man snapshotManifest
	sdir := filepath.Join(n.cfg.DataDir, snapshotsDir, second.SnapshotID)
	if err := storage.ReadJSON(filepath.Join(sdir, snapManifestName), &man); err != nil {
		t.Fatal(err)
	}
	total := int64(src.MemoryMiB) << 20 / 4096
	if man.MemoryBase != first.SnapshotID || man.DiffPages < 1024 || man.DiffPages > total/4 {
		t.Fatalf("second snapshot is not incremental over the first: %+v (of %d pages)", man, total)
	}
	if _, err := os.Stat(filepath.Join(sdir, snapMemName)); !os.IsNotExist(err) {
		t.Fatalf("incremental snapshot has a RAM image of its own: %v", err)
	}
	st, _ := os.Stat(filepath.Join(sdir, snapStateName))
	t.Logf("incremental snapshot: %d changed pages of %d, state %d bytes", man.DiffPages, total, st.Size())

	// The first snapshot's name can go; its image stays for the second.
	if err := n.DeleteSnapshot(ctx, "first"); err != nil {
		t.Fatal(err)
	}
	s := create(t, n, CreateRequest{TemplateID: "second", Secure: true})
	out, err := newEnvdClient(s).run(ctx, "", "/bin/sh", "-c", "kill -0 "+sleeper+" && cat /home/user/one /home/user/two && md5sum /dev/shm/blob | cut -c1-32")
	if err != nil || out.stdout != "one\ntwo\n"+sum+"\n" {
		t.Fatalf("sandbox from the incremental snapshot: %+v %v (want blob %s)", out, err, sum)
	}
	// A sandbox made from an incremental snapshot pauses and resumes.
	if _, err := n.Pause(ctx, s.ID); err != nil {
		t.Fatal(err)
	}
	rs, err := n.Resume(ctx, s.ID, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	out, err = newEnvdClient(rs).run(ctx, "", "/bin/sh", "-c", "kill -0 "+sleeper+" && md5sum /dev/shm/blob | cut -c1-32")
	if err != nil || out.stdout != sum+"\n" {
		t.Fatalf("after pause and resume: %+v %v", out, err)
	}

	// A corrupted state: a clear error, nothing created, nothing deleted.
	state := filepath.Join(sdir, snapStateName)
	if err := os.Chmod(state, 0o600); err != nil {
		t.Fatal(err)
	}
	f, err := os.OpenFile(state, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	f.WriteAt([]byte("garbage"), 100)
	f.Close()
	before, _ := n.List(ctx)
	if _, err := n.Create(ctx, CreateRequest{TemplateID: "second"}); !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), "checksum") {
		t.Fatalf("create from a corrupted snapshot: %v", err)
	}
	after, _ := n.List(ctx)
	if len(after) != len(before) {
		t.Fatalf("a failed create left sandboxes: %d -> %d", len(before), len(after))
	}
	if _, err := os.Stat(state); err != nil {
		t.Fatalf("corrupted snapshot was deleted: %v", err)
	}
}

// TestIncrementalSnapshotThroughRepository commits a snapshot whose disk and
// memory sit on an earlier snapshot (two disk layers over the template, RAM
// as changed pages over the first image) to the repository, loses every
// local copy, and creates a sandbox from the repository's: files of both
// layers and the memory contents are there.
func TestIncrementalSnapshotThroughRepository(t *testing.T) {
	repo, err := repository.OpenPosixFS(filepath.Join(t.TempDir(), "repo"))
	if err != nil {
		t.Fatal(err)
	}
	n := testNode(t, func(c *Config) { c.Repository = repo })
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	src := create(t, n, CreateRequest{TemplateID: "minimal"})
	if r, err := newEnvdClient(src).run(ctx, "", "/bin/sh", "-c", "echo one > /home/user/one; sync"); err != nil || r.exit != 0 {
		t.Fatalf("prepare: %+v %v", r, err)
	}
	if _, err := n.Snapshot(ctx, src.ID, "layer-one"); err != nil {
		t.Fatal(err)
	}
	cur, _ := n.Get(ctx, src.ID)
	r, err := newEnvdClient(cur).run(ctx, "", "/bin/sh", "-c", "echo two > /home/user/two; mkdir -p /dev/shm && mount -t tmpfs tmpfs /dev/shm 2>/dev/null; head -c 1048576 /dev/urandom > /dev/shm/blob; md5sum /dev/shm/blob | cut -c1-32")
	if err != nil || r.exit != 0 {
		t.Fatalf("write: %+v %v", r, err)
	}
	sum := strings.TrimSpace(r.stdout)
	two, err := n.Snapshot(ctx, src.ID, "layer-two")
	if err != nil {
		t.Fatal(err)
	}
	var man snapshotManifest
	storage.ReadJSON(filepath.Join(n.cfg.DataDir, snapshotsDir, two.SnapshotID, snapManifestName), &man)
	if man.MemoryBase == "" {
		t.Fatalf("second snapshot is not incremental: %+v", man)
	}
	// Lose everything local.
	all, _ := n.List(ctx)
	for _, s := range all {
		n.Kill(ctx, s.ID)
	}
	os.RemoveAll(filepath.Join(n.cfg.DataDir, snapshotsDir))
	s := create(t, n, CreateRequest{TemplateID: "layer-two"})
	out, err := newEnvdClient(s).run(ctx, "", "/bin/sh", "-c", "cat /home/user/one /home/user/two; md5sum /dev/shm/blob | cut -c1-32")
	if err != nil || out.stdout != "one\ntwo\n"+sum+"\n" {
		t.Fatalf("sandbox from the repository copy of an incremental snapshot: %+v %v", out, err)
	}
}
