package orchestrator

import (
	"archive/tar"
	"compress/gzip"
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"

	"github.com/agentenv/agentenv/internal/imagecache"
	"github.com/agentenv/agentenv/internal/storage/image"
	"github.com/agentenv/agentenv/internal/storage/repository"
	"github.com/agentenv/agentenv/internal/store"
)

// BenchmarkSandboxFromImage: time to the first command of a sandbox
// straight from an image (POST /sandboxes-cold's path), for an image of
// about 500 MB the node has never seen: the base template's Debian root
// filesystem and a layer of 200 MB of files, under a layer of its own at
// the bottom so every layer is new to the node (each iteration's image is
// another; the layer store's bound of 1 MiB evicts the one before). The
// baseline in the same run: a second sandbox of each image, its layers
// already converted. Also in the same run: the first sandbox of each image
// on a second node of the same repository, which has never seen it either
// and loads the layers the first node converted lazily, through a chunk
// cache emptied before each. Run with -benchtime=Nx.
func BenchmarkSandboxFromImage(b *testing.B) {
	repo, err := repository.OpenPosixFS(filepath.Join(b.TempDir(), "repo"))
	if err != nil {
		b.Fatal(err)
	}
	n := testNode(b, func(c *Config) { c.LayerStoreMiB, c.Repository = 1, repo })
	other := testNode(b, func(c *Config) { c.LayerStoreMiB, c.Repository, c.LayerCacheMiB = 1, repo, 1024 })
	dir := b.TempDir()
	rootTar := filepath.Join(dir, "root.tar")
	baseRootTar(b, n, rootTar)
	filesTar := filepath.Join(dir, "files.tar")
	randomFilesTar(b, filesTar, 200, 1<<20, 1)
	rootLayer := fileLayer(b, rootTar)
	filesLayer := fileLayer(b, filesTar)
	var imageBytes int64
	for _, p := range []string{rootTar, filesTar} {
		st, _ := os.Stat(p)
		imageBytes += st.Size()
	}

	var first, second, convert, lazily, push []time.Duration
	var fetched int64
	for i := 0; i < b.N; i++ {
		b.StopTimer()
		archive := filepath.Join(dir, fmt.Sprintf("image-%d.tar", i))
		marker := fmt.Sprintf("image %d of %d\n", i, time.Now().UnixNano())
		img, err := mutate.AppendLayers(withLayer(b, empty.Image, "aenv/bench-id", marker), rootLayer, filesLayer)
		if err != nil {
			b.Fatal(err)
		}
		if err := tarball.WriteToFile(archive, benchRef(b, fmt.Sprintf("bench/image:%d", i)), img); err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
		took, boot := imageSandboxUntilCommand(b, n, "docker-archive:"+archive, "cat /aenv/bench-id", marker)
		first = append(first, took)
		convert = append(convert, took-boot)
		took, _ = imageSandboxUntilCommand(b, n, "docker-archive:"+archive, "cat /aenv/bench-id", marker)
		second = append(second, took)
		b.StopTimer()
		push = append(push, waitImagePushed(b, n, repo, "docker-archive:"+archive))
		if c := other.remote.Cache(); c != nil {
			c.Purge()
		}
		before := other.LayerCacheStats().FetchedBytes
		b.StartTimer()
		took, _ = imageSandboxUntilCommand(b, other, "docker-archive:"+archive, "cat /aenv/bench-id", marker)
		lazily = append(lazily, took)
		b.StopTimer()
		fetched += other.LayerCacheStats().FetchedBytes - before
		os.Remove(archive)
		b.StartTimer()
	}
	fmt.Fprintf(os.Stderr, "on another node of the repository, the same never-seen images loaded lazily: n=%d p50 %s p90 %s (%d MB fetched per sandbox; "+
		"waited for the first node's push of the layers, in the background, after its second sandbox: p50 %s)\n",
		len(lazily), percentile(lazily, 50).Round(time.Millisecond), percentile(lazily, 90).Round(time.Millisecond),
		fetched/int64(max(b.N, 1))>>20, percentile(push, 50).Round(time.Millisecond))
	fmt.Fprintf(os.Stderr, "sandbox from a never-seen image of %d MB (uncompressed), until its first command: n=%d p50 %s p90 %s (converting its layers: p50 %s)\n"+
		"baseline, a second sandbox of the same image (layers converted): n=%d p50 %s p90 %s\n",
		imageBytes>>20, len(first), percentile(first, 50).Round(time.Millisecond), percentile(first, 90).Round(time.Millisecond),
		percentile(convert, 50).Round(time.Millisecond),
		len(second), percentile(second, 50).Round(time.Millisecond), percentile(second, 90).Round(time.Millisecond))
	reportPercentiles(b, first)
}

// BenchmarkImageChurn: b.N distinct images (a shared busybox layer and 4
// MiB of files of each image's own) through a layer store bounded to a
// quarter of their sum, one sandbox each until its first command, as a
// trainer walking through its tasks' images: the least recently used
// images are evicted as it goes, and no create fails. Baseline in the same
// run: a sandbox of an image whose layers are converted. Run with
// -benchtime=50x.
func BenchmarkImageChurn(b *testing.B) {
	const ownMiB = 4
	dir := newTestDataDir(b)
	files := b.TempDir()
	base := busyboxImage(b)
	mk := func(i int) string {
		b.Helper()
		own := filepath.Join(files, fmt.Sprintf("own-%d.tar", i))
		randomFilesTar(b, own, ownMiB, 1<<20, uint64(i)+100)
		img, err := mutate.AppendLayers(base, fileLayer(b, own))
		if err != nil {
			b.Fatal(err)
		}
		archive := filepath.Join(files, fmt.Sprintf("image-%d.tar", i))
		if err := tarball.WriteToFile(archive, benchRef(b, fmt.Sprintf("bench/churn:%d", i+1)), img); err != nil {
			b.Fatal(err)
		}
		os.Remove(own)
		return "docker-archive:" + archive
	}
	// What the store holds before (the templates' layers, laid out by a
	// node's start) and what one image adds on disk (its layers over the
	// shared busybox one, the E2B user layer): the bound is the first and a
	// quarter of what the images add.
	layersDir := filepath.Join(dir, store.LayersDir)
	probe := testNodeIn(b, dir)
	templates := imagecache.DirBytes(layersDir)
	if _, err := probe.templates.ImageLayers(context.Background(), mustSource(b, mk(-2)), imageDiskMiB, nil); err != nil {
		b.Fatal(err)
	}
	withBusybox := imagecache.DirBytes(layersDir)
	if _, err := probe.templates.ImageLayers(context.Background(), mustSource(b, mk(-3)), imageDiskMiB, nil); err != nil {
		b.Fatal(err)
	}
	perImage := imagecache.DirBytes(layersDir) - withBusybox
	probe.Close()
	limit := int((templates + (withBusybox - templates) + int64(b.N)*perImage/4) >> 20)
	n := testNodeIn(b, dir, func(c *Config) { c.LayerStoreMiB = limit })
	ctx := context.Background()
	warm := mk(-1)
	imageSandboxUntilCommand(b, n, warm, "true", "")
	var baseline []time.Duration
	for range 3 {
		took, _ := imageSandboxUntilCommand(b, n, warm, "true", "")
		baseline = append(baseline, took)
	}
	var ds []time.Duration
	var peak int64
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		b.StopTimer()
		ref := mk(i)
		b.StartTimer()
		took, _ := imageSandboxUntilCommand(b, n, ref, "true", "")
		ds = append(ds, took)
		b.StopTimer()
		if size, err := n.images.Size(); err == nil && size > peak {
			peak = size
		}
		b.StartTimer()
	}
	var cached int
	if err := n.db.QueryRowContext(ctx, `SELECT count(*) FROM image_cache`).Scan(&cached); err != nil {
		b.Fatal(err)
	}
	fmt.Fprintf(os.Stderr, "%d distinct images (%d MiB of files each; %.1f MiB of layers each on disk) through a layer store of %d MiB "+
		"(the templates' layers %d MiB, the shared busybox layer, a quarter of the images'): until the first command p50 %s p90 %s; "+
		"%d images evicted, %d cached at the end, store peak %d MiB, 0 failures\n"+
		"baseline, a sandbox of an image already converted: n=%d p50 %s p90 %s\n",
		b.N, ownMiB, float64(perImage)/(1<<20), limit, templates>>20,
		percentile(ds, 50).Round(time.Millisecond), percentile(ds, 90).Round(time.Millisecond),
		b.N+3-cached, cached, peak>>20,
		len(baseline), percentile(baseline, 50).Round(time.Millisecond), percentile(baseline, 90).Round(time.Millisecond))
	reportPercentiles(b, ds)
}

func mustSource(b *testing.B, ref string) image.Source {
	b.Helper()
	src, err := ParseImageRef(ref)
	if err != nil {
		b.Fatal(err)
	}
	return src
}

// imageSandboxUntilCommand creates a sandbox from ref, runs cmd in it
// (checking its output when want is set) and kills it: the time until the
// command answered, and the part of it the create's own phases took (the
// rest is the image's conversion).
func imageSandboxUntilCommand(b *testing.B, n *Node, ref, cmd, want string) (took, create time.Duration) {
	b.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	start := time.Now()
	s, err := n.CreateFromImage(ctx, ref, CreateRequest{VCPUs: 1, MemoryMiB: 256})
	if err != nil {
		b.Fatalf("sandbox from %s: %v", ref, err)
	}
	out, err := newEnvdClient(s).run(ctx, "", "/bin/sh", "-c", cmd)
	took = time.Since(start)
	if err != nil || out.exit != 0 || (want != "" && out.stdout != want) {
		b.Fatalf("%s in a sandbox from %s: %+v %v", cmd, ref, out, err)
	}
	for _, p := range s.Phases {
		create += p.Duration
	}
	b.StopTimer()
	if err := n.Kill(ctx, s.ID); err != nil {
		b.Fatal(err)
	}
	b.StartTimer()
	return took, create
}

// waitImagePushed waits until node n has stored the layers of image ref,
// which it converted, in repo, and says how long it waited.
func waitImagePushed(b *testing.B, n *Node, repo repository.Repository, ref string) time.Duration {
	b.Helper()
	start := time.Now()
	var top string
	if err := n.db.QueryRow(`SELECT top_layer FROM image_cache WHERE source = ?`, ref).Scan(&top); err != nil {
		b.Fatalf("image %s not in the cache: %v", ref, err)
	}
	for deadline := start.Add(5 * time.Minute); ; time.Sleep(100 * time.Millisecond) {
		if _, err := repo.Stat(context.Background(), "image", top); err == nil {
			return time.Since(start)
		}
		if time.Now().After(deadline) {
			b.Fatalf("image %s not in the repository after 5 minutes", ref)
		}
	}
}

// baseRootTar writes the base template's root filesystem as a tar.
func baseRootTar(b *testing.B, n *Node, out string) {
	b.Helper()
	t, err := n.Template("base")
	if err != nil {
		b.Fatal(err)
	}
	work := b.TempDir()
	raw, mnt := filepath.Join(work, "root.raw"), filepath.Join(work, "mnt")
	os.Mkdir(mnt, 0o755)
	for _, c := range [][]string{
		{"qemu-img", "convert", "-O", "raw", t.RootDisk, raw},
		{"mount", "-o", "loop,ro", raw, mnt},
		{"tar", "-C", mnt, "--numeric-owner", "-cf", out, "."},
		{"umount", mnt},
	} {
		if o, err := exec.Command(c[0], c[1:]...).CombinedOutput(); err != nil {
			exec.Command("umount", mnt).Run()
			b.Fatalf("%v: %v\n%s", c, err, o)
		}
	}
	os.Remove(raw)
}

// randomFilesTar writes count files of size random bytes (from seed) as a
// tar under data/.
func randomFilesTar(b *testing.B, out string, count, size int, seed uint64) {
	b.Helper()
	f, err := os.Create(out)
	if err != nil {
		b.Fatal(err)
	}
	defer f.Close()
	rng := rand.NewChaCha8([32]byte{byte(seed), byte(seed >> 8), byte(seed >> 16)})
	tw := tar.NewWriter(f)
	tw.WriteHeader(&tar.Header{Name: "data/", Typeflag: tar.TypeDir, Mode: 0o755})
	buf := make([]byte, size)
	for i := range count {
		rng.Read(buf)
		if err := tw.WriteHeader(&tar.Header{Name: fmt.Sprintf("data/f%04d", i), Typeflag: tar.TypeReg, Mode: 0o644, Size: int64(size)}); err != nil {
			b.Fatal(err)
		}
		if _, err := tw.Write(buf); err != nil {
			b.Fatal(err)
		}
	}
	if err := tw.Close(); err != nil {
		b.Fatal(err)
	}
}

// fileLayer is the uncompressed tar at path as an image layer (gzipped,
// at the fastest level, where an archive is written).
func fileLayer(b *testing.B, path string) v1.Layer {
	b.Helper()
	l, err := tarball.LayerFromFile(path, tarball.WithCompressionLevel(gzip.BestSpeed))
	if err != nil {
		b.Fatal(err)
	}
	return l
}

// benchRef is the tag an archive's image is written under.
func benchRef(b *testing.B, s string) name.Reference {
	b.Helper()
	ref, err := name.ParseReference(s)
	if err != nil {
		b.Fatal(err)
	}
	return ref
}
