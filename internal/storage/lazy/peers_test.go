package lazy

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"sync/atomic"
	"testing"

	"github.com/agentenv/agentenv/internal/storage/repository"
)

// countingRepo counts chunk downloads from the repository.
type countingRepo struct {
	repository.Repository
	gets atomic.Int64
}

func (r *countingRepo) Get(ctx context.Context, kind, id, dir string) (*repository.Manifest, error) {
	if kind == repoKindChunk {
		r.gets.Add(1)
	}
	return r.Repository.Get(ctx, kind, id, dir)
}

// pushed stores a fresh layer of random 256 KiB chunks in a new repository.
func pushed(t *testing.T, size int) (*countingRepo, *Layer, []byte) {
	t.Helper()
	data := make([]byte, size)
	rand.Read(data)
	file := filepath.Join(t.TempDir(), "layer.raw")
	if err := os.WriteFile(file, data, 0o600); err != nil {
		t.Fatal(err)
	}
	base, err := repository.OpenPosixFS(filepath.Join(t.TempDir(), "repo"))
	if err != nil {
		t.Fatal(err)
	}
	repo := &countingRepo{Repository: base}
	ctx := context.Background()
	if _, err := PushLayer(ctx, repo, "l", file, 256<<10); err != nil {
		t.Fatal(err)
	}
	l, err := FetchLayer(ctx, repo, "l")
	if err != nil {
		t.Fatal(err)
	}
	return repo, l, data
}

func readAll(t *testing.T, c *Cache, l *Layer, want []byte) {
	t.Helper()
	got := make([]byte, l.Size)
	if err := (&LayerExport{Layer: l, Cache: c}).ReadAt(context.Background(), got, 0); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Fatal("layer bytes differ")
	}
}

func peerServer(t *testing.T, h http.Handler) string {
	t.Helper()
	mux := http.NewServeMux()
	mux.Handle("GET "+PeerChunkPath, h)
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return srv.URL
}

// TestPeersBeforeRepository: node B reads a layer that node A has cached;
// every chunk comes from A over loopback HTTP, none from the repository.
func TestPeersBeforeRepository(t *testing.T) {
	repo, l, data := pushed(t, 4<<20)
	a, err := OpenCache(t.TempDir(), 64<<20, repo, nil)
	if err != nil {
		t.Fatal(err)
	}
	readAll(t, a, l, data)
	fromRepo := repo.gets.Load()
	url := peerServer(t, PeerHandler("secret", func() *Cache { return a }))

	b, err := OpenCache(t.TempDir(), 64<<20, repo, &Peers{URLs: []string{url}, Token: "secret"})
	if err != nil {
		t.Fatal(err)
	}
	readAll(t, b, l, data)
	if n := repo.gets.Load() - fromRepo; n != 0 {
		t.Fatalf("node B fetched %d chunks from the repository", n)
	}
	st := b.Stats()
	if st.PeerBytes != 4<<20 || st.FetchedBytes != st.PeerBytes || a.Stats().PeerServedBytes != 4<<20 {
		t.Fatalf("peer stats: B %+v, A %+v", st, a.Stats())
	}
	t.Logf("B: %+v", st)
}

// TestBadPeersFallBackToRepository: a neighbour that is down, one that
// refuses the token, one that lacks the chunk and one that sends wrong
// bytes only delay the fetch; the chunk comes from the repository, and no
// neighbour's bytes are cached.
func TestBadPeersFallBackToRepository(t *testing.T) {
	repo, l, data := pushed(t, 1<<20)
	down := httptest.NewServer(http.NotFoundHandler())
	down.Close()
	empty, err := OpenCache(t.TempDir(), 64<<20, repo, nil)
	if err != nil {
		t.Fatal(err)
	}
	liar := peerServer(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Write(bytes.Repeat([]byte{1}, 256<<10))
	}))
	peers := &Peers{Token: "secret", URLs: []string{
		down.URL,
		peerServer(t, PeerHandler("other", func() *Cache { return empty })),
		peerServer(t, PeerHandler("secret", func() *Cache { return empty })),
		peerServer(t, PeerHandler("secret", func() *Cache { return nil })),
		liar,
	}}
	b, err := OpenCache(t.TempDir(), 64<<20, repo, peers)
	if err != nil {
		t.Fatal(err)
	}
	readAll(t, b, l, data)
	if st := b.Stats(); st.PeerBytes != 0 || repo.gets.Load() != 4 {
		t.Fatalf("stats %+v, %d repository gets", st, repo.gets.Load())
	}
	if empty.Stats().Misses != 0 {
		t.Fatal("a neighbour fetched a chunk on another node's behalf")
	}
}

func TestPeerHandlerRefusals(t *testing.T) {
	repo, l, data := pushed(t, 256<<10)
	c, _ := OpenCache(t.TempDir(), 64<<20, repo, nil)
	readAll(t, c, l, data)
	on := peerServer(t, PeerHandler("secret", func() *Cache { return c }))
	off := peerServer(t, PeerHandler("", func() *Cache { return c }))
	zeros := "0000000000000000000000000000000000000000000000000000000000000000"
	for _, tc := range []struct {
		name, url, token string
		want             int
	}{
		{"cached chunk", on + "/v1/chunks/" + l.Chunks[0], "secret", 200},
		{"exchange off", off + "/v1/chunks/" + l.Chunks[0], "", 404},
		{"no token", on + "/v1/chunks/" + l.Chunks[0], "", 401},
		{"wrong token", on + "/v1/chunks/" + l.Chunks[0], "secreT", 401},
		{"not a sum", on + "/v1/chunks/..%2f..%2fetc", "secret", 400},
		{"upper-case sum", on + "/v1/chunks/" + "AB" + l.Chunks[0][2:], "secret", 400},
		{"not cached", on + "/v1/chunks/" + zeros, "secret", 404},
	} {
		t.Run(tc.name, func(t *testing.T) {
			req, _ := http.NewRequest("GET", tc.url, nil)
			req.Header.Set(PeerTokenHeader, tc.token)
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			if resp.StatusCode != tc.want {
				t.Fatalf("status %d, want %d", resp.StatusCode, tc.want)
			}
			if tc.want != 200 && resp.Header.Get("Content-Type") != "application/json" {
				t.Fatalf("error content type %q", resp.Header.Get("Content-Type"))
			}
		})
	}
}

// TestCacheOnFullDisk: the cache's limit (64 MiB) is larger than the file
// system under it (3 MiB tmpfs). Reading a 12 MiB layer twice works: cold
// chunks are dropped when the disk is full, and a chunk that still does
// not fit is served without being kept.
func TestCacheOnFullDisk(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("skipped: mounting a small tmpfs needs root")
	}
	dir := t.TempDir()
	if out, err := exec.Command("mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", dir).CombinedOutput(); err != nil {
		t.Skipf("skipped: cannot mount a tmpfs: %v: %s", err, out)
	}
	t.Cleanup(func() { exec.Command("umount", "-l", dir).Run() })
	// Fill most of it with something else, as another tenant of the disk.
	os.WriteFile(filepath.Join(dir, "other"), make([]byte, 1<<20), 0o600)
	repo, l, data := pushed(t, 12<<20)
	c, err := OpenCache(filepath.Join(dir, "chunks"), 64<<20, repo, nil)
	if err != nil {
		t.Fatal(err)
	}
	readAll(t, c, l, data)
	readAll(t, c, l, data)
	st := c.Stats()
	t.Logf("cache on a full disk: %+v", st)
	if st.StoreErrors == 0 || st.Evictions == 0 || st.UsedBytes > 2<<20 {
		t.Fatalf("stats %+v", st)
	}
	if _, err := os.Stat(filepath.Join(dir, "other")); err != nil {
		t.Fatal("the cache removed a file that is not its own")
	}
}

// TestMissingChunk: a chunk removed from the repository fails the read with
// ErrNotFound; nothing is cached for it.
func TestMissingChunk(t *testing.T) {
	repo, l, _ := pushed(t, 512<<10)
	if err := repo.Delete(context.Background(), repoKindChunk, l.Chunks[1]); err != nil {
		t.Fatal(err)
	}
	c, _ := OpenCache(t.TempDir(), 64<<20, repo, nil)
	buf := make([]byte, l.Size)
	err := (&LayerExport{Layer: l, Cache: c}).ReadAt(context.Background(), buf, 0)
	if !errors.Is(err, repository.ErrNotFound) {
		t.Fatalf("read of a layer with a missing chunk: %v", err)
	}
	if st := c.Stats(); st.UsedBytes != 256<<10 {
		t.Fatalf("stats %+v", st)
	}
}
