package orchestrator

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/agentenv/agentenv/internal/storage"
	"github.com/agentenv/agentenv/internal/storage/lazy"
	"github.com/agentenv/agentenv/internal/storage/repository"
	"github.com/agentenv/agentenv/internal/store"
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
	a := testNode(t, func(c *Config) { c.Repository = repo })
	// A template of two layers: base's root layer and an overlay on it.
	base, _ := a.Template("base")
	overlayTemplate(t, a, base, Template{Name: "lazy-base", DefaultUser: "user", EnvVars: map[string]string{"FROM_REPO": "yes"}})
	start := time.Now()
	if err := a.PushTemplate(ctx, "lazy-base"); err != nil {
		t.Fatal(err)
	}
	t.Logf("pushed a %d MiB template in %s", 300, time.Since(start).Round(time.Millisecond))

	// Peer exchange later: node c asks b (over loopback HTTP) before the
	// repository; b holds the chunks its last boot read.
	const token = "peer-token-for-the-test"
	b := testNode(t, func(c *Config) { c.Repository, c.LayerCacheMiB, c.PeerToken = repo, 32, token })
	start = time.Now()
	s := create(t, b, CreateRequest{TemplateID: "lazy-base"})
	t.Logf("cold boot from lazily loaded layers: %s", time.Since(start).Round(time.Millisecond))
	out, err := newEnvdClient(s).run(ctx, "", "bash", "-c", "python3 -c 'print(6*7)'; echo $FROM_REPO; head -c 100 /etc/os-release | head -1")
	if err != nil || out.exit != 0 || out.stdout[:3] != "42\n" {
		t.Fatalf("sandbox of a lazily loaded template: %+v %v", out, err)
	}
	st := b.LayerCacheStats()
	t.Logf("chunk cache: %+v (layers: 300 MB)", st)
	if st.UsedBytes > 32<<20 || st.FetchedBytes == 0 || st.FetchedBytes > 250<<20 {
		t.Fatalf("lazy loading: %+v", st)
	}

	mux := http.NewServeMux()
	mux.Handle("GET "+lazy.PeerChunkPath, b.PeerChunks())
	peer := httptest.NewServer(mux)
	defer peer.Close()
	c := testNode(t, func(c *Config) {
		c.Repository, c.LayerCacheMiB, c.Peers, c.PeerToken = repo, 64, []string{peer.URL}, token
	})
	s = create(t, c, CreateRequest{TemplateID: "lazy-base"})
	if out, err := newEnvdClient(s).run(ctx, "", "bash", "-c", "echo $FROM_REPO"); err != nil || out.stdout != "yes\n" {
		t.Fatalf("sandbox on the third node: %+v %v", out, err)
	}
	cst, bst := c.LayerCacheStats(), b.LayerCacheStats()
	t.Logf("third node's chunk cache: %+v; served by its neighbour: %d bytes", cst, bst.PeerServedBytes)
	if cst.PeerBytes == 0 || bst.PeerServedBytes != cst.PeerBytes {
		t.Fatalf("peer exchange: node c %+v, node b %+v", cst, bst)
	}
}

// BenchmarkLazyCreate creates sandboxes of a 300 MB template run lazily
// from the repository, with the chunk cache emptied before each create
// (cold) and kept (warm), and reports bytes fetched per create and the hit
// rate. Baseline in the same run: creates of the same template from local
// disk. All are cold boots (no template snapshot), so the difference is
// what lazy loading adds.
func BenchmarkLazyCreate(b *testing.B) {
	ctx := context.Background()
	repo, err := repository.OpenPosixFS(filepath.Join(b.TempDir(), "repo"))
	if err != nil {
		b.Fatal(err)
	}
	a := testNode(b, func(c *Config) { c.Repository = repo })
	base, _ := a.Template("base")
	overlayTemplate(b, a, base, Template{Name: "lazy-base", DefaultUser: "user"})
	if err := a.PushTemplate(ctx, "lazy-base"); err != nil {
		b.Fatal(err)
	}
	n := testNode(b, func(c *Config) { c.Repository, c.LayerCacheMiB = repo, 1024 })
	timed := func(tpl string) time.Duration {
		start := time.Now()
		s, err := n.Create(ctx, CreateRequest{TemplateID: tpl, noSnapshot: true})
		if err != nil {
			b.Fatal(err)
		}
		d := time.Since(start)
		n.Kill(ctx, s.ID)
		return d
	}
	timed("lazy-base") // loads the template record
	var local, cold, warm []time.Duration
	var coldBytes, warmBytes int64
	var hits, misses int64
	for i := 0; i < b.N; i++ {
		local = append(local, timed("base"))
		n.remote.Cache().Purge()
		before := n.remote.Cache().Stats()
		cold = append(cold, timed("lazy-base"))
		mid := n.remote.Cache().Stats()
		warm = append(warm, timed("lazy-base"))
		after := n.remote.Cache().Stats()
		coldBytes += mid.FetchedBytes - before.FetchedBytes
		warmBytes += after.FetchedBytes - mid.FetchedBytes
		hits += after.Hits - mid.Hits
		misses += after.Misses - mid.Misses
	}
	fmt.Fprintf(os.Stderr, "create (cold boot), n=%d p50: local disk %s, lazy cold cache %s (%.1f MB fetched each), lazy warm cache %s (%.1f MB fetched each, hit rate %.0f%%)\n",
		b.N, percentile(local, 50).Round(time.Millisecond), percentile(cold, 50).Round(time.Millisecond), float64(coldBytes)/float64(b.N)/1e6,
		percentile(warm, 50).Round(time.Millisecond), float64(warmBytes)/float64(b.N)/1e6, 100*float64(hits)/float64(max(1, hits+misses)))
	reportPercentiles(b, cold)
}

// overlayTemplate installs template t on node n as an empty layer over
// base's root layer.
func overlayTemplate(tb testing.TB, n *Node, base *Template, t Template) *Template {
	tb.Helper()
	ctx := context.Background()
	tmp := filepath.Join(n.cfg.DataDir, store.LayersDir, ".test-"+t.Name+".qcow2")
	if err := storage.CreateOverlay(ctx, base.RootDisk, tmp, 0); err != nil {
		tb.Fatal(err)
	}
	got, err := n.templates.InstallFile(ctx, t, tmp, base.Layer)
	if err != nil {
		tb.Fatal(err)
	}
	return got
}
