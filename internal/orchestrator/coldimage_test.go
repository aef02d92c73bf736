package orchestrator

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"

	"github.com/agentenv/agentenv/internal/storage/repository"
	"github.com/agentenv/agentenv/internal/store"
)

// withLayer is img with one more layer holding file path with body.
func withLayer(t testing.TB, img v1.Image, path, body string) v1.Image {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	tw.WriteHeader(&tar.Header{Name: filepath.Dir(path) + "/", Typeflag: tar.TypeDir, Mode: 0o755})
	tw.WriteHeader(&tar.Header{Name: path, Typeflag: tar.TypeReg, Mode: 0o644, Size: int64(len(body))})
	tw.Write([]byte(body))
	tw.Close()
	b := buf.Bytes()
	l, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(b)), nil })
	if err != nil {
		t.Fatal(err)
	}
	out, err := mutate.AppendLayers(img, l)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// TestSandboxFromImage: a sandbox straight from a docker-archive, with no
// template (its files, its env, the E2B user, the node's envd); a second
// sandbox of it reuses the converted layers; past the layer store's
// bound the least recently used image is evicted (its own layer goes, the
// layer it shares with the image in use stays) and converted again when
// asked for; bad references are refused.
func TestSandboxFromImage(t *testing.T) {
	n := testNode(t, func(c *Config) { c.LayerStoreMiB = 1 }) // every other image is evicted
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	dir := t.TempDir()
	a, b := filepath.Join(dir, "a.tar"), filepath.Join(dir, "b.tar")
	base := busyboxImage(t)
	if err := tarball.WriteToFile(a, name.MustParseReference("test/a:1"), withLayer(t, base, "task/id", "a\n")); err != nil {
		t.Fatal(err)
	}
	if err := tarball.WriteToFile(b, name.MustParseReference("test/b:1"), withLayer(t, base, "task/id", "b\n")); err != nil {
		t.Fatal(err)
	}
	cold := func(archive string) (string, time.Duration) {
		t.Helper()
		start := time.Now()
		s, err := n.CreateFromImage(ctx, "docker-archive:"+archive, CreateRequest{VCPUs: 1, MemoryMiB: 256, EnvVars: map[string]string{"MINE": "x"}})
		if err != nil {
			t.Fatal(err)
		}
		took := time.Since(start)
		out, err := newEnvdClient(s).run(ctx, "", "/bin/sh", "-c", "cat /task/id /data/hello; echo $GREETING $MINE; id -u")
		if err != nil || out.exit != 0 {
			t.Fatalf("command in a sandbox from %s: %+v %v", archive, out, err)
		}
		if err := n.Kill(ctx, s.ID); err != nil {
			t.Fatal(err)
		}
		return out.stdout, took
	}
	out, first := cold(a)
	if out != "a\nhello from an OCI layer\nfrom-the-image x\n1000\n" {
		t.Fatalf("sandbox from image a: %q", out)
	}
	_, second := cold(a)
	t.Logf("image a: first sandbox (conversion and cold boot) %s, second (layers reused) %s", first.Round(time.Millisecond), second.Round(time.Millisecond))
	topOf := func(archive string) string {
		var top string
		n.db.QueryRowContext(ctx, `SELECT top_layer FROM image_cache WHERE source = ?`, "docker-archive:"+archive).Scan(&top)
		return top
	}
	topA := topOf(a)
	if topA == "" {
		t.Fatal("image a is not in the image cache")
	}
	if out, _ := cold(b); out != "b\nhello from an OCI layer\nfrom-the-image x\n1000\n" {
		t.Fatalf("sandbox from image b: %q", out)
	}
	// a was evicted: its cache entry and top layer are gone, the busybox
	// layer b shares stays.
	if topOf(a) != "" || topOf(b) == "" {
		t.Fatalf("after b: a %q, b %q", topOf(a), topOf(b))
	}
	if _, err := n.store.Get(ctx, topA); !errors.Is(err, store.ErrNotFound) {
		t.Fatalf("image a's top layer after its eviction: %v", err)
	}
	if _, err := os.Stat(filepath.Join(n.cfg.DataDir, store.LayersDir, topA+".qcow2")); !os.IsNotExist(err) {
		t.Fatalf("image a's top layer file after its eviction: %v", err)
	}
	// Asked for again, a is converted again.
	if out, _ := cold(a); out != "a\nhello from an OCI layer\nfrom-the-image x\n1000\n" {
		t.Fatalf("sandbox from image a again: %q", out)
	}
	// An image without a shell cannot run a sandbox's commands.
	noShell := filepath.Join(dir, "noshell.tar")
	if err := tarball.WriteToFile(noShell, name.MustParseReference("test/noshell:1"), withLayer(t, empty.Image, "data/only", "x\n")); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		ref  string
		want error
	}{
		{"", ErrInvalid}, {"docker-archive:", ErrInvalid}, {"oci-layout:", ErrInvalid}, {"has spaces in it", ErrInvalid},
		{"docker-archive:" + noShell, ErrInvalid},
		{"docker-archive:" + filepath.Join(dir, "missing.tar"), ErrNotFound},
		{"oci-layout:" + filepath.Join(dir, "missing") + ":v1", ErrNotFound},
	} {
		_, err := n.CreateFromImage(ctx, tc.ref, CreateRequest{})
		if !errors.Is(err, tc.want) {
			t.Errorf("image %q: %v, want %v", tc.ref, err, tc.want)
		}
		t.Logf("image %q: %v", tc.ref, err)
	}
	if !strings.Contains(fmt.Sprint(n.CreateFromImage(ctx, "docker-archive:"+noShell, CreateRequest{})), "/bin/sh") {
		t.Error("the refusal of an image without a shell does not say why")
	}
	var cached int
	n.db.QueryRowContext(ctx, `SELECT count(*) FROM image_cache WHERE source = ?`, "docker-archive:"+noShell).Scan(&cached)
	if cached != 0 {
		t.Error("a refused image is in the image cache")
	}
}

// TestImageLayersFromRepository: a node with a repository stores the
// layers it converted from an image there (in the background); another
// node of the repository runs a sandbox of the image without converting
// it (no layer of its own, chunks fetched through its cache), and so does
// the first node once it evicted the image; after a restart the second
// node still serves the image's layers.
func TestImageLayersFromRepository(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 6*time.Minute)
	defer cancel()
	repo, err := repository.OpenPosixFS(filepath.Join(t.TempDir(), "repo"))
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	a1, a2, a3 := filepath.Join(dir, "a1.tar"), filepath.Join(dir, "a2.tar"), filepath.Join(dir, "a3.tar")
	base := busyboxImage(t)
	for i, f := range []string{a1, a2, a3} {
		if err := tarball.WriteToFile(f, name.MustParseReference("test/a:1"), withLayer(t, base, "task/id", fmt.Sprintf("task %d\n", i+1))); err != nil {
			t.Fatal(err)
		}
	}
	run := func(n *Node, archive, want string) (top string, took time.Duration) {
		t.Helper()
		start := time.Now()
		s, err := n.CreateFromImage(ctx, "docker-archive:"+archive, CreateRequest{VCPUs: 1, MemoryMiB: 256})
		if err != nil {
			t.Fatal(err)
		}
		took = time.Since(start)
		out, err := newEnvdClient(s).run(ctx, "", "/bin/sh", "-c", "cat /task/id; echo $GREETING; id -u")
		if err != nil || out.exit != 0 || out.stdout != want+"\nfrom-the-image\n1000\n" {
			t.Fatalf("sandbox of %s: %+v %v", archive, out, err)
		}
		if err := n.Kill(ctx, s.ID); err != nil {
			t.Fatal(err)
		}
		n.db.QueryRowContext(ctx, `SELECT top_layer FROM image_cache WHERE source = ?`, "docker-archive:"+archive).Scan(&top)
		return top, took
	}
	pushed := func(top string) {
		t.Helper()
		for deadline := time.Now().Add(2 * time.Minute); ; time.Sleep(200 * time.Millisecond) {
			if _, err := repo.Stat(ctx, "image", top); err == nil {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("image %s not in the repository", top)
			}
		}
	}
	a := testNode(t, func(c *Config) { c.Repository, c.LayerStoreMiB = repo, 1 }) // one image at a time
	topA1, convert := run(a, a1, "task 1")
	if strings.HasPrefix(topA1, "lazy-") {
		t.Fatalf("the first node did not convert the image: %s", topA1)
	}
	pushed(topA1)

	bDir, slot := newTestDataDir(t), takeTestSlot()
	defer releaseTestSlot(slot)
	withRepo := func(c *Config) { c.Repository, c.LayerCacheMiB = repo, 64 }
	b := openTestNodeIn(t, bDir, slot, withRepo)
	defer func() { b.Close() }()
	topB, lazily := run(b, a1, "task 1")
	if !strings.HasPrefix(topB, "lazy-") {
		t.Fatalf("the second node's image: %q, want one loaded lazily", topB)
	}
	if _, err := os.Stat(filepath.Join(b.cfg.DataDir, store.LayersDir, topA1+".qcow2")); !os.IsNotExist(err) {
		t.Fatalf("the second node converted the image: %v", err)
	}
	st := b.LayerCacheStats()
	if st.FetchedBytes == 0 {
		t.Fatalf("chunk cache: %+v", st)
	}
	t.Logf("first sandbox of the image: converted %s, loaded lazily on another node %s (%d bytes fetched)",
		convert.Round(time.Millisecond), lazily.Round(time.Millisecond), st.FetchedBytes)

	// a2 evicts a1 on the first node, which then loads a1 lazily.
	topA2, _ := run(a, a2, "task 2")
	pushed(topA2)
	if _, err := os.Stat(filepath.Join(a.cfg.DataDir, store.LayersDir, topA1+".qcow2")); !os.IsNotExist(err) {
		t.Fatalf("a1's top layer after its eviction: %v", err)
	}
	if top, _ := run(a, a1, "task 1"); !strings.HasPrefix(top, "lazy-") {
		t.Fatalf("a1 again on the first node: %q, want it loaded lazily", top)
	}
	// A third image, converted here, evicts the images loaded lazily, and
	// their labels go with them.
	run(a, a3, "task 3")
	var labels int
	a.db.QueryRowContext(ctx, `SELECT count(*) FROM labels WHERE kind = ?`, store.LabelLazyImage).Scan(&labels)
	if labels != 0 {
		t.Fatalf("%d lazy image labels after the lazily loaded image was evicted", labels)
	}

	// The second node restarted serves the layers again.
	b.Close()
	b = openTestNodeIn(t, bDir, slot, withRepo)
	run(b, a1, "task 1")
}
