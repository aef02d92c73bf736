package orchestrator

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/agentenv/agentenv/internal/storage"
	"github.com/agentenv/agentenv/internal/storage/repository"
)

// TestLazyTemplateFromRepository: one node pushes a template (two layers,
// 300 MB) to the repository; another node, whose chunk cache is limited to
// 32 MiB, runs sandboxes of it without downloading it: QEMU reads the
// layers over the node's NBD server as the guest needs them.
func TestLazyTemplateFromRepository(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	repo, err := repository.OpenPosixFS(filepath.Join(t.TempDir(), "repo"))
	if err != nil {
		t.Fatal(err)
	}
	a := testNode(t)
	a.cfg.Repository = repo
	// A template of two layers: base's root layer and an overlay on it.
	base, _ := a.Template("base")
	dir := TemplateDir(a.cfg.DataDir, "lazy-base")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := storage.CreateOverlay(ctx, base.RootDisk, filepath.Join(dir, rootLayerName), 0); err != nil {
		t.Fatal(err)
	}
	if err := RegisterTemplate(a.cfg.DataDir, Template{Name: "lazy-base", DefaultUser: "user", EnvVars: map[string]string{"FROM_REPO": "yes"}}); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	if err := a.PushTemplate(ctx, "lazy-base"); err != nil {
		t.Fatal(err)
	}
	t.Logf("pushed a %d MiB template in %s", 300, time.Since(start).Round(time.Millisecond))

	b := testNode(t)
	b.cfg.Repository = repo
	b.cfg.LayerCacheMiB = 32
	start = time.Now()
	s := create(t, b, CreateRequest{TemplateID: "lazy-base"})
	t.Logf("cold boot from lazily loaded layers: %s", time.Since(start).Round(time.Millisecond))
	out, err := newEnvdClient(s).run(ctx, "", "bash", "-c", "python3 -c 'print(6*7)'; echo $FROM_REPO; head -c 100 /etc/os-release | head -1")
	if err != nil || out.exit != 0 || out.stdout[:3] != "42\n" {
		t.Fatalf("sandbox of a lazily loaded template: %+v %v", out, err)
	}
	st := b.lazy.cache.Stats()
	t.Logf("chunk cache: %+v (layers: 300 MB)", st)
	if st.UsedBytes > 32<<20 || st.FetchedBytes == 0 || st.FetchedBytes > 250<<20 {
		t.Fatalf("lazy loading: %+v", st)
	}
}
