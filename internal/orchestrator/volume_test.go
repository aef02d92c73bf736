package orchestrator

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/agentenv/agentenv/internal/guest"
	"github.com/agentenv/agentenv/internal/sandboxes"
	"github.com/agentenv/agentenv/internal/statedb"
	"github.com/agentenv/agentenv/internal/volumes"
)

// testVolumes is a volume store of its own for a test node.
func testVolumes(t *testing.T) *volumes.Store {
	t.Helper()
	testData(t) // root and the prepared data dir, or skip
	dir := t.TempDir()
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
	if _, err := n.Fork(ctx, s.ID, 1, time.Minute); !errors.Is(err, ErrInvalid) {
		t.Fatalf("fork of a sandbox with volumes = %v, want invalid", err)
	}

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
	if err := n.Kill(ctx, s.ID); err != nil {
		t.Fatal(err)
	}
	if got, err := readVolumeFile(t, vols, v.ID, "/from-guest.txt"); err != nil || got != "guest\nafter pause\n" {
		t.Fatalf("after the kill the volume has %q, %v", got, err)
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
	if err := n.Kill(ctx, s.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := readVolumeFile(t, vols, v.ID, "/from-host.txt"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("a file the guest removed reads %v, want not found", err)
	}
	if err := vols.Delete(ctx, v.ID); err != nil {
		t.Fatalf("deleting the volume once no sandbox holds it: %v", err)
	}
}
