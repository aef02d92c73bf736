package lazy

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/agentenv/agentenv/internal/storage/repository"
)

func needQEMUImg(t *testing.T) {
	t.Helper()
	if _, err := exec.LookPath("qemu-img"); err != nil {
		t.Skip("skipped: qemu-img (qemu-utils) is not installed; it is the NBD client these tests use")
	}
}

// testLayer writes a 6 MiB file: random data with a hole and a repeated
// chunk in it.
func testLayer(t *testing.T) (string, []byte) {
	t.Helper()
	data := make([]byte, 6<<20)
	rand.Read(data[:2<<20])
	copy(data[3<<20:4<<20], data[:1<<20]) // the same chunk again
	rand.Read(data[5<<20:])
	p := filepath.Join(t.TempDir(), "layer.raw")
	if err := os.WriteFile(p, data, 0o600); err != nil {
		t.Fatal(err)
	}
	return p, data
}

// serve pushes the file into a fresh repository and serves it through a
// cache of limit bytes.
func serve(t *testing.T, file string, limit int64) (string, *Cache, string, *Layer) {
	t.Helper()
	ctx := context.Background()
	repoDir := filepath.Join(t.TempDir(), "repo")
	repo, err := repository.OpenPosixFS(repoDir)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := PushLayer(ctx, repo, "test-layer", file, 512<<10); err != nil {
		t.Fatal(err)
	}
	layer, err := FetchLayer(ctx, repo, "test-layer")
	if err != nil {
		t.Fatal(err)
	}
	cache, err := OpenCache(filepath.Join(t.TempDir(), "cache"), limit, repo, nil)
	if err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(t.TempDir(), "nbd.sock")
	srv, err := Listen(sock, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Close() })
	srv.Add("test-layer", &LayerExport{Layer: layer, Cache: cache})
	return sock, cache, repoDir, layer
}

func nbdURI(sock, export string) string { return "nbd+unix:///" + export + "?socket=" + sock }

// TestLayerThroughNBDWithSmallCache reads a whole layer through the NBD
// server with qemu-img while the cache holds a third of it: the bytes are
// exact, the cache never exceeds its limit, chunks are evicted and fetched
// again, and chunks of zeros are never fetched.
func TestLayerThroughNBDWithSmallCache(t *testing.T) {
	needQEMUImg(t)
	file, data := testLayer(t)
	sock, cache, _, layer := serve(t, file, 2<<20)
	zeros := 0
	for _, c := range layer.Chunks {
		if c == "" {
			zeros++
		}
	}
	if zeros != 4 { // 2-3 MiB and 4-5 MiB, in 512 KiB chunks
		t.Fatalf("zero chunks %d, want 4: %v", zeros, layer.Chunks)
	}
	for round := 0; round < 2; round++ {
		out := filepath.Join(t.TempDir(), "copy.raw")
		if b, err := exec.Command("qemu-img", "convert", "-f", "raw", "-O", "raw", nbdURI(sock, "test-layer"), out).CombinedOutput(); err != nil {
			t.Fatalf("qemu-img convert over NBD: %v: %s", err, b)
		}
		got, _ := os.ReadFile(out)
		if !bytes.Equal(got, data) {
			t.Fatalf("round %d: the layer read through NBD differs from the original", round)
		}
		st := cache.Stats()
		t.Logf("round %d: %+v", round, st)
		if st.UsedBytes > st.LimitBytes {
			t.Fatalf("cache holds %d bytes, limit %d", st.UsedBytes, st.LimitBytes)
		}
	}
	st := cache.Stats()
	if st.Evictions == 0 || st.FetchedBytes <= 2<<20 {
		t.Fatalf("a cache smaller than the layer did not evict and refetch: %+v", st)
	}
	// Reads beyond the end and writes are refused; the export is listed.
	if b, err := exec.Command("qemu-io", "-f", "raw", "-c", "write 0 512", nbdURI(sock, "test-layer")).CombinedOutput(); err == nil && !strings.Contains(string(b), "ermission") && !strings.Contains(string(b), "read-only") && !strings.Contains(string(b), "read only") {
		t.Fatalf("write to a read-only export: %s", b)
	}
}

// TestCorruptChunkIsRefused: a chunk whose stored bytes were altered fails
// the read (qemu-img sees an I/O error) and is not cached.
func TestCorruptChunkIsRefused(t *testing.T) {
	needQEMUImg(t)
	file, _ := testLayer(t)
	sock, cache, repoDir, layer := serve(t, file, 64<<20)
	// Alter the first chunk's stored bytes (same size).
	var stored string
	filepath.WalkDir(repoDir, func(p string, d os.DirEntry, err error) error {
		if err == nil && !d.IsDir() && d.Name() == chunkFileName && strings.Contains(p, layer.Chunks[0]) {
			stored = p
			return filepath.SkipAll
		}
		return nil
	})
	if stored == "" {
		t.Fatal("stored chunk not found")
	}
	st, _ := os.Stat(stored)
	os.Chmod(stored, 0o600)
	if err := os.WriteFile(stored, bytes.Repeat([]byte{7}, int(st.Size())), 0o600); err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(t.TempDir(), "copy.raw")
	b, err := exec.Command("qemu-img", "convert", "-f", "raw", "-O", "raw", nbdURI(sock, "test-layer"), out).CombinedOutput()
	if err == nil {
		t.Fatal("a corrupt chunk was served")
	}
	t.Logf("qemu-img: %s", strings.TrimSpace(string(b)))
	if _, err := cache.Chunk(context.Background(), layer.Chunks[0]); !errors.Is(err, repository.ErrCorrupt) && !errors.Is(err, ErrCorruptChunk) {
		t.Fatalf("corrupt chunk: %v", err)
	}
	if _, err := os.Stat(filepath.Join(cache.dir, layer.Chunks[0])); err == nil {
		t.Fatal("the corrupt chunk was cached")
	}
}

// TestQcow2LayerThroughNBD: QEMU reads a qcow2 layer (the format template
// layers have) from the NBD export as it reads the local file.
func TestQcow2LayerThroughNBD(t *testing.T) {
	needQEMUImg(t)
	dir := t.TempDir()
	layer := filepath.Join(dir, "layer.qcow2")
	run := func(name string, args ...string) {
		t.Helper()
		if b, err := exec.Command(name, args...).CombinedOutput(); err != nil {
			t.Fatalf("%s %v: %v: %s", name, args, err, b)
		}
	}
	run("qemu-img", "create", "-q", "-f", "qcow2", layer, "64M")
	run("qemu-io", "-f", "qcow2", "-c", "write -P 0x5a 1M 3M", "-c", "write -P 0xa5 40M 512k", layer)
	sock, cache, _, _ := serve(t, layer, 1<<20)
	local, remote := filepath.Join(dir, "local.raw"), filepath.Join(dir, "remote.raw")
	run("qemu-img", "convert", "-f", "qcow2", "-O", "raw", layer, local)
	run("qemu-img", "convert", "-f", "qcow2", "-O", "raw", nbdURI(sock, "test-layer"), remote)
	a, _ := os.ReadFile(local)
	b, _ := os.ReadFile(remote)
	if !bytes.Equal(a, b) {
		t.Fatal("the qcow2 layer read over NBD differs from the local one")
	}
	t.Logf("qcow2 over NBD: %+v", cache.Stats())
}
