package image

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
)

// tarEntry is one file of a test layer.
type tarEntry struct {
	name, body, link string
	typ              byte
	mode             int64
	uid              int
}

func layerOf(t *testing.T, entries ...tarEntry) v1.Layer {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range entries {
		h := &tar.Header{Name: e.name, Typeflag: e.typ, Mode: e.mode, Linkname: e.link, Uid: e.uid, Gid: e.uid, ModTime: time.Unix(1700000000, 0)}
		if h.Typeflag == 0 {
			h.Typeflag = tar.TypeReg
		}
		if h.Mode == 0 {
			h.Mode = 0o644
		}
		if h.Typeflag == tar.TypeReg {
			h.Size = int64(len(e.body))
		}
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		tw.Write([]byte(e.body))
	}
	tw.Close()
	return layerFromBytes(t, buf.Bytes())
}

// layerFromBytes is a layer whose uncompressed tar stream is b.
func layerFromBytes(t *testing.T, b []byte) v1.Layer {
	t.Helper()
	l, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(b)), nil })
	if err != nil {
		t.Fatal(err)
	}
	return l
}

func needRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("skipped: building disk layers needs root")
	}
	for _, tool := range []string{"mkfs.ext4", "debugfs", "e2fsck", "qemu-img", "mount"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("skipped: %s not installed", tool)
		}
	}
}

// readTree mounts a qcow2 layer (converted to raw) read-only and calls fn
// (only for the benign images of the tests: the node itself never mounts
// an image).
func readTree(t *testing.T, layer string, fn func(root string)) {
	t.Helper()
	dir := t.TempDir()
	raw := filepath.Join(dir, "fs.raw")
	if out, err := exec.Command("qemu-img", "convert", "-O", "raw", layer, raw).CombinedOutput(); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	mnt := filepath.Join(dir, "mnt")
	os.Mkdir(mnt, 0o755)
	if out, err := exec.Command("mount", "-o", "loop,ro,nodev,nosuid,noexec", raw, mnt).CombinedOutput(); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	defer exec.Command("umount", mnt).Run()
	fn(mnt)
}

func TestImportLayersWhiteoutsAndSharing(t *testing.T) {
	needRoot(t)
	ctx := context.Background()
	base := layerOf(t,
		tarEntry{name: "etc/", typ: tar.TypeDir, mode: 0o755},
		tarEntry{name: "etc/passwd", body: "root:x:0:0:root:/root:/bin/sh\n"},
		tarEntry{name: "etc/gone", body: "deleted by the layer above"},
		tarEntry{name: "opt/keep/a", body: "a"},
		tarEntry{name: "opt/keep/b", body: "b"},
		tarEntry{name: "tmp/", typ: tar.TypeDir, mode: 0o1777},
		tarEntry{name: "escape", typ: tar.TypeSymlink, link: "/tmp"},
		tarEntry{name: "srv/owned", body: "x", uid: 1234, mode: 0o4750},
	)
	top := layerOf(t,
		tarEntry{name: "etc/.wh.gone", body: ""},
		tarEntry{name: "opt/keep/c", body: "c"},
		tarEntry{name: "opt/keep/.wh..wh..opq", body: ""},
		tarEntry{name: "escape/evil", body: "must stay inside the image"},
		tarEntry{name: "srv/hard", typ: tar.TypeLink, link: "srv/owned"},
		tarEntry{name: "data/hello", body: "hello from a layer\n"},
	)
	other := layerOf(t, tarEntry{name: "data/other", body: "second image\n"})

	imgA, err := mutate.AppendLayers(empty.Image, base, top)
	if err != nil {
		t.Fatal(err)
	}
	imgA, _ = mutate.Config(imgA, v1.Config{Env: []string{"PATH=/bin", "GREETING=hi"}})
	imgB, _ := mutate.AppendLayers(empty.Image, base, other)
	dirA, dirB := t.TempDir(), t.TempDir()
	for _, c := range []struct {
		dir string
		img v1.Image
	}{{dirA, imgA}, {dirB, imgB}} {
		p, err := layout.Write(c.dir, empty.Index)
		if err != nil {
			t.Fatal(err)
		}
		if err := p.AppendImage(c.img); err != nil {
			t.Fatal(err)
		}
	}
	layers := filepath.Join(t.TempDir(), "layers")
	finished := false
	opt := Options{LayersDir: layers, SizeMiB: 64, Log: t.Logf, FinishID: "test-v1", Finish: func(fs *Filesystem) error {
		finished = true
		var buf bytes.Buffer
		tw := tar.NewWriter(&buf)
		tw.WriteHeader(&tar.Header{Name: "etc/finished", Typeflag: tar.TypeReg, Mode: 0o644, Size: 3})
		tw.Write([]byte("yes"))
		tw.Close()
		return fs.Apply(ctx, &buf)
	}}
	res, err := Import(ctx, Source{Layout: dirA}, opt)
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Layers) != 3 || !finished || len(res.Env) != 2 {
		t.Fatalf("result: %+v", res)
	}
	// The config alone names the top layer Import made.
	if top, err := TopChain(ctx, Source{Layout: dirA}, "test-v1"); err != nil || LayerPath(layers, top) != res.Top {
		t.Fatalf("top chain %s %v, Import made %s", top, err, res.Top)
	}
	if top, err := TopChain(ctx, Source{Layout: dirA}, ""); err != nil || top != res.Layers[1].ChainID {
		t.Fatalf("top chain without the finish layer %s %v, want %s", top, err, res.Layers[1].ChainID)
	}
	if _, err := os.Stat("/tmp/evil"); err == nil {
		os.Remove("/tmp/evil")
		t.Fatal("a layer's symlink let it write to the host's /tmp")
	}
	readTree(t, res.Top, func(root string) {
		want := map[string]string{
			"data/hello": "hello from a layer\n", "opt/keep/c": "c", "tmp/evil": "must stay inside the image",
			"etc/finished": "yes", "etc/passwd": "root:x:0:0:root:/root:/bin/sh\n",
		}
		for name, body := range want {
			if b, err := os.ReadFile(filepath.Join(root, name)); err != nil || string(b) != body {
				t.Errorf("%s: %q %v", name, b, err)
			}
		}
		for _, gone := range []string{"etc/gone", "opt/keep/a", "opt/keep/b"} {
			if _, err := os.Lstat(filepath.Join(root, gone)); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("%s survived its whiteout: %v", gone, err)
			}
		}
		st, err := os.Stat(filepath.Join(root, "srv/owned"))
		hard, herr := os.Stat(filepath.Join(root, "srv/hard"))
		if err != nil || herr != nil || !os.SameFile(st, hard) || st.Mode()&os.ModeSetuid == 0 {
			t.Errorf("owner, mode or hard link lost: %v %v %v", st, err, herr)
		}
	})
	// The second image shares the base layer: built once.
	finished = false
	res2, err := Import(ctx, Source{Layout: dirB}, opt)
	if err != nil {
		t.Fatal(err)
	}
	if !res2.Layers[0].Reused || res2.Layers[0].Path != res.Layers[0].Path || res2.Layers[1].Reused {
		t.Fatalf("base layer not shared: %+v", res2.Layers)
	}
	ents, _ := os.ReadDir(layers)
	var qcows []string
	for _, e := range ents {
		if strings.HasSuffix(e.Name(), ".qcow2") {
			qcows = append(qcows, e.Name())
		}
	}
	if len(qcows) != 5 { // base, top, finish(A), other, finish(B)
		t.Fatalf("layers on disk: %v", qcows)
	}
	// Importing again reuses everything.
	res3, err := Import(ctx, Source{Layout: dirA}, opt)
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range res3.Layers {
		if !l.Reused {
			t.Fatalf("layer %s rebuilt", l.ChainID)
		}
	}
}

func TestImportBadSources(t *testing.T) {
	needRoot(t)
	ctx := context.Background()
	layers := t.TempDir()
	bad := filepath.Join(t.TempDir(), "broken.tar")
	os.WriteFile(bad, []byte("not a tarball"), 0o600)
	// A layout whose layer blob is corrupted.
	img, _ := mutate.AppendLayers(empty.Image, layerOf(t, tarEntry{name: "f", body: "content"}))
	dir := t.TempDir()
	p, _ := layout.Write(dir, empty.Index)
	p.AppendImage(img)
	ls, _ := img.Layers()
	dg, _ := ls[0].Digest()
	blob := filepath.Join(dir, "blobs", "sha256", dg.Hex)
	os.Chmod(blob, 0o600)
	os.WriteFile(blob, []byte("garbage"), 0o600)
	// A layout whose one image is tagged v1.
	tagged := t.TempDir()
	tp, _ := layout.Write(tagged, empty.Index)
	tp.AppendImage(img, layout.WithAnnotations(map[string]string{refNameAnnotation: "v1"}))
	for _, tc := range []struct {
		name string
		src  Source
		want error
	}{
		{"missing layout", Source{Layout: "/nonexistent"}, ErrNotFound},
		{"missing archive", Source{Archive: filepath.Join(t.TempDir(), "none.tar")}, ErrNotFound},
		{"unknown tag in a layout", Source{Layout: tagged, Tag: "v2"}, ErrNotFound},
		{"not a tarball", Source{Archive: bad}, ErrImage},
		{"nothing", Source{}, ErrImage},
		{"corrupt layer", Source{Layout: dir}, nil},
		{"unreachable registry", Source{Ref: "127.0.0.1:1/none/such:latest"}, ErrImage},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Import(ctx, tc.src, Options{LayersDir: layers, SizeMiB: 32})
			if err == nil {
				t.Fatal("imported")
			}
			if tc.want != nil && !errors.Is(err, tc.want) {
				t.Fatalf("%v, want %v", err, tc.want)
			}
			if tc.want == ErrImage && errors.Is(err, ErrNotFound) {
				t.Fatalf("%v: a source that is there but unreadable is not a missing one", err)
			}
		})
	}
	ents, _ := os.ReadDir(layers)
	for _, e := range ents {
		if strings.HasSuffix(e.Name(), ".qcow2") || strings.HasPrefix(e.Name(), ".build-") {
			t.Errorf("left behind: %s", e.Name())
		}
	}
	// The tag picks the image.
	if _, err := Import(ctx, Source{Layout: tagged, Tag: "v1"}, Options{LayersDir: layers, SizeMiB: 32}); err != nil {
		t.Fatalf("tagged image: %v", err)
	}
}
