package orchestrator

import (
	"context"
	"os"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/agentenv/agentenv/internal/sandboxes"
	"github.com/agentenv/agentenv/internal/storage"
	"github.com/agentenv/agentenv/internal/vmm"
)

// TestLiveSnapshotSealsTheDisk: a live snapshot of a copy-on-write sandbox
// seals its overlay in place instead of copying it. The snapshot's disk is
// the very file the sandbox wrote until then (read-only, root's, and no
// descriptor of QEMU can write it), the sandbox stands on the snapshot
// (record, references, overlay header), and what the guest writes
// afterwards reaches neither that snapshot nor sandboxes made from it.
// Two snapshots in a row, a snapshot deleted under a later one, the
// sandbox killed under both, and the node told to copy (the baseline):
// each snapshot still makes sandboxes with exactly its files.
func TestLiveSnapshotSealsTheDisk(t *testing.T) {
	n := testNode(t)
	if !n.qemu.SealsDisks() {
		t.Fatalf("QEMU %s cannot seal disks", n.qemu.Version)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 6*time.Minute)
	defer cancel()
	src := create(t, n, CreateRequest{TemplateID: "minimal", Secure: true})
	run := func(s *sandboxes.Sandbox, script string) string {
		t.Helper()
		r, err := newEnvdClient(s).run(ctx, "", "/bin/sh", "-c", script)
		if err != nil || r.exit != 0 {
			t.Fatalf("%s: %+v %v", script, r, err)
		}
		return r.stdout
	}
	run(src, "echo zero > /home/user/zero && sync")
	if _, err := n.Snapshot(ctx, src.ID, "seal-base"); err != nil { // a freeze: it runs copy-on-write after
		t.Fatal(err)
	}
	defer n.DeleteSnapshot(context.Background(), "seal-base")
	pdir := n.sandboxDir(src.ID)
	inode := func(p string) uint64 {
		t.Helper()
		var st syscall.Stat_t
		if err := syscall.Stat(p, &st); err != nil {
			t.Fatal(err)
		}
		return st.Ino
	}
	for i, name := range []string{"seal-1", "seal-2"} {
		cur, _ := n.Get(ctx, src.ID)
		run(cur, "echo "+name+" > /home/user/"+name+" && sync")
		before := inode(filepath.Join(pdir, overlayName))
		ns, err := n.Snapshot(ctx, src.ID, name)
		if err != nil {
			t.Fatal(err)
		}
		defer n.DeleteSnapshot(context.Background(), name)
		disk := filepath.Join(n.snapshotDir(ns.SnapshotID), snapDiskName)
		if inode(disk) != before {
			t.Fatalf("%s: the snapshot's disk is a copy, not the sealed overlay", name)
		}
		fi, _ := os.Stat(disk)
		if st := fi.Sys().(*syscall.Stat_t); fi.Mode().Perm() != 0o400 || st.Uid != 0 {
			t.Errorf("%s: sealed disk mode %v uid %d", name, fi.Mode().Perm(), st.Uid)
		}
		m := n.machines.get(src.ID)
		if w, err := vmm.WritableDescriptors(m.PID(), disk); err != nil || w != 0 {
			t.Errorf("%s: QEMU holds %d writable descriptors of the sealed disk (%v)", name, w, err)
		}
		info, err := storage.Info(ctx, filepath.Join(pdir, overlayName))
		if err != nil || info.BackingFilename != disk {
			t.Fatalf("%s: the sandbox's overlay stacks on %+v (%v), want %s", name, info, err, disk)
		}
		if _, err := os.Stat(filepath.Join(pdir, nextOverlayName)); !os.IsNotExist(err) {
			t.Errorf("%s: the next overlay is left: %v", name, err)
		}
		cur, _ = n.Get(ctx, src.ID)
		if cur.SnapshotID != ns.SnapshotID || cur.State != sandboxes.Running {
			t.Fatalf("%s: the sandbox's record: snapshot %s state %s", name, cur.SnapshotID, cur.State)
		}
		if ns.GuestStopped <= 0 {
			t.Errorf("%s: no stop time reported", name)
		}
		t.Logf("%s: guest stopped %s, chain of %d images", name, ns.GuestStopped, i+3)
		// Written after the snapshot: only the sandbox has it.
		run(cur, "echo after > /home/user/after-"+strconv.Itoa(i)+" && sync")
	}
	// The sandbox itself runs on over both seals, through a pause.
	if _, err := n.Pause(ctx, src.ID); err != nil {
		t.Fatal(err)
	}
	res, err := n.Resume(ctx, src.ID, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if got := run(res, "cat /home/user/zero /home/user/seal-1 /home/user/seal-2 /home/user/after-0 /home/user/after-1"); got != "zero\nseal-1\nseal-2\nafter\nafter\n" {
		t.Fatalf("the sealed sandbox's files: %q", got)
	}
	// The first seal's name goes, then the sandbox: the second snapshot
	// still has every layer it stands on.
	if err := n.DeleteSnapshot(ctx, "seal-1"); err != nil {
		t.Fatal(err)
	}
	if err := n.Kill(ctx, src.ID); err != nil {
		t.Fatal(err)
	}
	n.gc(ctx)
	child := create(t, n, CreateRequest{TemplateID: "seal-2"})
	// (after-0 was written before the second snapshot, after-1 after it.)
	if got := run(child, "cat /home/user/zero /home/user/seal-1 /home/user/seal-2 /home/user/after-0; test ! -e /home/user/after-1 && echo no-after-1"); got != "zero\nseal-1\nseal-2\nafter\nno-after-1\n" {
		t.Fatalf("a sandbox of the second snapshot: %q", got)
	}
	// Its own live snapshot, with the node told to copy: the baseline
	// path still works on a sealed chain.
	n.cfg.CopyDisk = true
	defer func() { n.cfg.CopyDisk = false }()
	run(child, "echo copied > /home/user/copied && sync")
	if _, err := n.Snapshot(ctx, child.ID, "seal-copy"); err != nil {
		t.Fatal(err)
	}
	defer n.DeleteSnapshot(context.Background(), "seal-copy")
	grand := create(t, n, CreateRequest{TemplateID: "seal-copy"})
	if got := run(grand, "cat /home/user/seal-2 /home/user/copied"); got != "seal-2\ncopied\n" {
		t.Fatalf("a sandbox of a copied snapshot over seals: %q", got)
	}
	// A chain as deep as the bound (four snapshots' disks under grand's
	// overlay) is copied, not sealed further.
	n.cfg.CopyDisk = false
	bound := maxSealedChain
	maxSealedChain = 4
	defer func() { maxSealedChain = bound }()
	top := filepath.Join(n.sandboxDir(grand.ID), overlayName)
	before := inode(top)
	ns, err := n.Snapshot(ctx, grand.ID, "seal-bound")
	if err != nil {
		t.Fatal(err)
	}
	defer n.DeleteSnapshot(context.Background(), "seal-bound")
	if inode(filepath.Join(n.snapshotDir(ns.SnapshotID), snapDiskName)) == before || inode(top) != before {
		t.Fatal("a chain at the bound was sealed further")
	}
}
