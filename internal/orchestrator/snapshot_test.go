package orchestrator

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
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
	if got, _ := n.Get(ctx, src.ID); got.State != StateRunning {
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
