package image

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
)

// hdr is one raw tar header of a hostile layer; body is written after it
// (a header that claims more than its body makes a truncated layer).
type hdr struct {
	tar.Header
	body string
}

// rawLayer writes the headers as a tar stream, as a hostile tool would:
// sizes, types and names as given.
func rawLayer(t *testing.T, hs ...hdr) v1.Layer {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	complete := true
	for _, h := range hs {
		hh := h.Header
		if hh.Mode == 0 {
			hh.Mode = 0o644
		}
		if hh.Typeflag == tar.TypeReg && hh.Size == 0 {
			hh.Size = int64(len(h.body))
		}
		if hh.ModTime.IsZero() {
			hh.ModTime = time.Unix(1700000000, 0)
		}
		if err := tw.WriteHeader(&hh); err != nil {
			t.Fatalf("header %q: %v", hh.Name, err)
		}
		io.WriteString(tw, h.body)
		if hh.Typeflag == tar.TypeReg && hh.Size != int64(len(h.body)) {
			complete = false
			break
		}
	}
	if complete {
		tw.Close()
	}
	return layerFromBytes(t, buf.Bytes())
}

func layoutOf(t *testing.T, layers ...v1.Layer) string {
	t.Helper()
	img, err := mutate.AppendLayers(empty.Image, layers...)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	p, err := layout.Write(dir, empty.Index)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.AppendImage(img); err != nil {
		t.Fatal(err)
	}
	return dir
}

// imageStat is what debugfs says of a path of a qcow2 layer's file
// system: its type word ("regular", "block", "FIFO", ...) and the whole
// stat text; "" when the path is not there.
func imageStat(t *testing.T, layer, path string) (string, string) {
	t.Helper()
	raw := filepath.Join(t.TempDir(), "fs.raw")
	if out, err := exec.Command("qemu-img", "convert", "-O", "raw", layer, raw).CombinedOutput(); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	out, _ := exec.Command("debugfs", "-R", "stat "+quote(path), raw).CombinedOutput()
	s := string(out)
	_, rest, ok := strings.Cut(s, "Type: ")
	if !ok {
		return "", s
	}
	typ, _, _ := strings.Cut(rest, " ")
	return typ, s
}

// imageCat is the content of a regular file of a qcow2 layer.
func imageCat(t *testing.T, layer, path string) string {
	t.Helper()
	raw := filepath.Join(t.TempDir(), "fs.raw")
	if out, err := exec.Command("qemu-img", "convert", "-O", "raw", layer, raw).CombinedOutput(); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	out, err := exec.Command("debugfs", "-R", "cat "+quote(path), raw).Output()
	if err != nil {
		t.Fatal(err)
	}
	return string(out)
}

// hostSpecials lists every file under root that is not a regular file,
// a directory or a symlink.
func hostSpecials(root string) []string {
	var found []string
	filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return nil
		}
		if d.Type()&(fs.ModeDevice|fs.ModeCharDevice|fs.ModeNamedPipe|fs.ModeSocket) != 0 {
			found = append(found, p)
		}
		if !d.IsDir() && d.Type().IsRegular() {
			if st, err := os.Lstat(p); err == nil && st.Mode()&(fs.ModeSetuid|fs.ModeSetgid) != 0 {
				found = append(found, p+" (setuid)")
			}
		}
		return nil
	})
	return found
}

// TestHostileLayers imports layers a hostile user would write. Each
// either becomes inert inodes inside the image (checked in the image file
// with debugfs) or is refused with ErrImage naming the entry; in both
// cases nothing of the layer becomes a file of the host (checked in the
// builder's own directory while each layer is written, and a canary
// outside it), and the import never blocks.
func TestHostileLayers(t *testing.T) {
	needRoot(t)
	ctx := context.Background()
	canaryDir := t.TempDir()
	canary := filepath.Join(canaryDir, "canary")
	os.WriteFile(canary, []byte("host data"), 0o600)
	var hostMu sync.Mutex
	var onHost []string
	testHookApplied = func(dir string) {
		hostMu.Lock()
		onHost = append(onHost, hostSpecials(dir)...)
		hostMu.Unlock()
	}
	t.Cleanup(func() { testHookApplied = nil })

	var hostDev syscall.Stat_t
	syscall.Stat("/", &hostDev)
	major, minor := int64(hostDev.Dev>>8&0xfff), int64(hostDev.Dev&0xff|(hostDev.Dev>>12)&0xfff00)
	dir := func(n string) hdr { return hdr{Header: tar.Header{Name: n, Typeflag: tar.TypeDir, Mode: 0o755}} }
	file := func(n, body string) hdr { return hdr{Header: tar.Header{Name: n, Typeflag: tar.TypeReg}, body: body} }
	deep := make([]string, 10000)
	for i := range deep {
		deep[i] = "d"
	}
	var deepDirs []hdr
	for i := 1; i <= 1500; i++ {
		deepDirs = append(deepDirs, dir(strings.Join(deep[:i], "/")+"/"))
	}
	deepDirs = append(deepDirs, file(strings.Join(deep[:1500], "/")+"/leaf", "deep"))

	type want struct {
		path, typ, body, stat string // in the image
	}
	for _, tc := range []struct {
		name    string
		layers  [][]hdr
		refused string // part of the error, naming the entry; "" when it imports
		want    []want
		absent  []string
	}{
		{name: "block device of the host's disk as /etc/passwd",
			layers: [][]hdr{{dir("etc/"), {Header: tar.Header{Name: "etc/passwd", Typeflag: tar.TypeBlock, Devmajor: major, Devminor: minor, Mode: 0o644}}}},
			want:   []want{{path: "/etc/passwd", typ: "block", stat: fmt.Sprintf("Device major/minor number: %02d:%02d", major, minor)}}},
		{name: "char device /dev/mem and a hard link to it",
			layers: [][]hdr{{{Header: tar.Header{Name: "dev/mem", Typeflag: tar.TypeChar, Devmajor: 1, Devminor: 1, Mode: 0o666}},
				{Header: tar.Header{Name: "etc/shadow", Typeflag: tar.TypeLink, Linkname: "dev/mem"}}}},
			want: []want{{path: "/dev/mem", typ: "character", stat: "Links: 2"}, {path: "/etc/shadow", typ: "character"}}},
		{name: "FIFO as /etc/passwd",
			layers: [][]hdr{{{Header: tar.Header{Name: "etc/passwd", Typeflag: tar.TypeFifo, Mode: 0o644}}}},
			want:   []want{{path: "/etc/passwd", typ: "FIFO"}}},
		{name: "setuid root shell",
			layers: [][]hdr{{{Header: tar.Header{Name: "bin/rootsh", Typeflag: tar.TypeReg, Mode: 0o4755}, body: "#!/bin/sh\n"}}},
			want:   []want{{path: "/bin/rootsh", typ: "regular", body: "#!/bin/sh\n", stat: "Mode:  04755"}}},
		{name: "symlink chain out of the image",
			layers: [][]hdr{{{Header: tar.Header{Name: "a", Typeflag: tar.TypeSymlink, Linkname: "../../../../../" + strings.TrimPrefix(canaryDir, "/")}},
				{Header: tar.Header{Name: "b", Typeflag: tar.TypeSymlink, Linkname: "/a"}},
				{Header: tar.Header{Name: "c", Typeflag: tar.TypeSymlink, Linkname: "b"}},
				file("c/canary", "overwritten through a symlink")}},
			want: []want{{path: canaryDir + "/canary", typ: "regular", body: "overwritten through a symlink"}, {path: "/c", typ: "symlink"}}},
		{name: "dot-dot names",
			layers: [][]hdr{{file("../../../../"+strings.TrimPrefix(canary, "/"), "overwritten through .."), file("./x/../../y", "y")}},
			want:   []want{{path: canary, typ: "regular", body: "overwritten through .."}, {path: "/y", typ: "regular", body: "y"}}},
		{name: "whiteouts outside the image",
			layers: [][]hdr{{file("etc/keep", "k"), file("top", "t")}, {file("../../.wh.top", ""), file("x/../../../etc/.wh.nothing", "")}},
			want:   []want{{path: "/etc/keep", typ: "regular", body: "k"}}, absent: []string{"/top"}},
		{name: "whiteout of dot-dot", layers: [][]hdr{{file("etc/.wh..", "")}}, refused: `"etc/.wh.."`},
		{name: "huge entry", layers: [][]hdr{{{Header: tar.Header{Name: "huge", Typeflag: tar.TypeReg, Size: 100 << 30}}}}, refused: `"huge"`},
		{name: "sparse-looking entry within the size",
			layers: [][]hdr{{file("zeros", string(make([]byte, 8<<20)))}},
			want:   []want{{path: "/zeros", typ: "regular", stat: "Size: 8388608"}}},
		{name: "a 10,000-deep name", layers: [][]hdr{{file(strings.Join(deep, "/")+"/f", "x")}}, refused: "a name of 20001 bytes"},
		{name: "1,500-deep directories", layers: [][]hdr{deepDirs},
			want: []want{{path: "/" + strings.Join(deep[:1500], "/") + "/leaf", typ: "regular", body: "deep"}}},
		{name: "symlink loop",
			layers: [][]hdr{{{Header: tar.Header{Name: "l1", Typeflag: tar.TypeSymlink, Linkname: "l2"}},
				{Header: tar.Header{Name: "l2", Typeflag: tar.TypeSymlink, Linkname: "l1"}}, file("l1/x", "")}},
			refused: `"l1/x"`},
		{name: "control characters", layers: [][]hdr{{file("evil\nrm /etc", "")}}, refused: `"evil\nrm /etc"`},
		{name: "quotes and debugfs syntax in names",
			layers: [][]hdr{{file(`q"uote`, "1"), file("<12>", "2"), file("-rf", "3"), file("a b", "4")}},
			want: []want{{path: `/q"uote`, typ: "regular", body: "1"}, {path: "/./<12>", typ: "regular", body: "2"},
				{path: "/-rf", typ: "regular", body: "3"}, {path: "/a b", typ: "regular", body: "4"}}},
		{name: "hard link to nothing", layers: [][]hdr{{{Header: tar.Header{Name: "h", Typeflag: tar.TypeLink, Linkname: "missing"}}}}, refused: `"h"`},
		{name: "hard link to a directory",
			layers: [][]hdr{{dir("d/"), {Header: tar.Header{Name: "h", Typeflag: tar.TypeLink, Linkname: "d"}}}}, refused: `"h"`},
		{name: "a directory replaced by a file and back",
			layers: [][]hdr{{dir("x/"), file("x/inner", "i"), file("f", "f")}, {file("x", "now a file"), dir("f/"), file("f/in", "in")}},
			want:   []want{{path: "/x", typ: "regular", body: "now a file"}, {path: "/f/in", typ: "regular", body: "in"}},
			absent: []string{"/x/inner"}},
		{name: "truncated layer", layers: [][]hdr{{{Header: tar.Header{Name: "short", Typeflag: tar.TypeReg, Size: 100}, body: "abc"}}}, refused: "short"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var ls []v1.Layer
			for _, l := range tc.layers {
				ls = append(ls, rawLayer(t, l...))
			}
			src := Source{Layout: layoutOf(t, ls...)}
			layers := filepath.Join(t.TempDir(), "layers")
			tctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
			defer cancel()
			res, err := Import(tctx, src, Options{LayersDir: layers, SizeMiB: 64})
			if tc.refused != "" {
				if err == nil || !errors.Is(err, ErrImage) || !strings.Contains(err.Error(), tc.refused) {
					t.Fatalf("import: %v; want a refusal (ErrImage) naming %s", err, tc.refused)
				}
			} else {
				if err != nil {
					t.Fatal(err)
				}
				for _, w := range tc.want {
					typ, stat := imageStat(t, res.Top, w.path)
					if typ != w.typ || !strings.Contains(stat, w.stat) {
						t.Errorf("%s in the image: type %q, want %q with %q:\n%s", w.path, typ, w.typ, w.stat, stat)
					}
					if w.body != "" {
						if got := imageCat(t, res.Top, w.path); got != w.body {
							t.Errorf("%s in the image holds %q, want %q", w.path, got, w.body)
						}
					}
				}
				for _, p := range tc.absent {
					if typ, _ := imageStat(t, res.Top, p); typ != "" {
						t.Errorf("%s is in the image (%s)", p, typ)
					}
				}
			}
			if b, err := os.ReadFile(canary); err != nil || string(b) != "host data" {
				t.Fatalf("the host's canary changed: %q %v", b, err)
			}
			if ents, _ := os.ReadDir(canaryDir); len(ents) != 1 {
				t.Fatalf("files appeared beside the host's canary: %v", ents)
			}
			hostMu.Lock()
			defer hostMu.Unlock()
			if len(onHost) > 0 {
				t.Fatalf("the layer made special files on the host: %v", onHost)
			}
			if left := hostSpecials(layers); len(left) > 0 {
				t.Fatalf("special files left on the host: %v", left)
			}
		})
	}
}

// TestHostileRegistryLayer: the same hostile layer served by a registry on
// loopback becomes an inert inode; a registry that stalls a layer's blob
// holds the layers lock only until its import's context ends, and a benign
// import sent meanwhile finishes.
func TestHostileRegistryLayer(t *testing.T) {
	needRoot(t)
	hostile, err := mutate.AppendLayers(empty.Image, rawLayer(t,
		hdr{Header: tar.Header{Name: "etc/passwd", Typeflag: tar.TypeFifo, Mode: 0o644}},
		hdr{Header: tar.Header{Name: "dev/sda", Typeflag: tar.TypeBlock, Devmajor: 8, Mode: 0o600}}))
	if err != nil {
		t.Fatal(err)
	}
	stalled := rawLayer(t, hdr{Header: tar.Header{Name: "big", Typeflag: tar.TypeReg}, body: "served slowly"})
	stalledImg, _ := mutate.AppendLayers(empty.Image, stalled)
	stalledDigest, _ := stalled.Digest()
	reg := registry.New(registry.Logger(log.New(io.Discard, "", 0)))
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.Contains(r.URL.Path, stalledDigest.Hex) && r.Method == http.MethodGet {
			<-r.Context().Done() // never answers
			return
		}
		reg.ServeHTTP(w, r)
	}))
	t.Cleanup(srv.Close)
	host := strings.TrimPrefix(srv.URL, "http://")
	for ref, img := range map[string]v1.Image{"/team/hostile:v1": hostile, "/team/stalled:v1": stalledImg} {
		r, _ := name.ParseReference(host + ref)
		if err := remote.Write(r, img); err != nil {
			t.Fatal(err)
		}
	}
	dockerConfig(t, host, "", "")
	layers := filepath.Join(t.TempDir(), "layers")
	opt := Options{LayersDir: layers, SizeMiB: 32, Log: t.Logf}
	res, err := Import(context.Background(), Source{Ref: host + "/team/hostile:v1"}, opt)
	if err != nil {
		t.Fatal(err)
	}
	if typ, _ := imageStat(t, res.Top, "/etc/passwd"); typ != "FIFO" {
		t.Errorf("etc/passwd in the image is %q, want an inert FIFO inode", typ)
	}
	if typ, _ := imageStat(t, res.Top, "/dev/sda"); typ != "block" {
		t.Errorf("dev/sda in the image is %q, want an inert block device inode", typ)
	}

	stallCtx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	stalledDone := make(chan error, 1)
	go func() {
		_, err := Import(stallCtx, Source{Ref: host + "/team/stalled:v1"}, opt)
		stalledDone <- err
	}()
	time.Sleep(500 * time.Millisecond) // the stalled import holds the lock
	benign := layoutOf(t, rawLayer(t, hdr{Header: tar.Header{Name: "ok", Typeflag: tar.TypeReg}, body: "fine"}))
	start := time.Now()
	if _, err := Import(context.Background(), Source{Layout: benign}, opt); err != nil {
		t.Fatalf("a benign import behind a stalled one: %v", err)
	}
	if err := <-stalledDone; err == nil || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("the stalled import ended with %v, want its deadline", err)
	}
	if d := time.Since(start); d > 30*time.Second {
		t.Fatalf("the benign import took %s behind the stalled one", d)
	}
}

// TestReadFileReadsOnlyRegularFiles: what the E2B conventions read of an
// image (Filesystem.ReadFile) is a regular file of bounded size, symlinks
// followed inside the image; a device node, a FIFO, a directory, a bigger
// file or a symlink loop is refused with ErrUnusable and never read.
func TestReadFileReadsOnlyRegularFiles(t *testing.T) {
	needRoot(t)
	file := func(n, body string) hdr { return hdr{Header: tar.Header{Name: n, Typeflag: tar.TypeReg}, body: body} }
	link := func(n, to string) hdr {
		return hdr{Header: tar.Header{Name: n, Typeflag: tar.TypeSymlink, Linkname: to}}
	}
	src := Source{Layout: layoutOf(t, rawLayer(t,
		file("etc/ok", "root:x:0:0::/root:/bin/sh\n"),
		link("etc/via-link", "../etc/./ok"),
		hdr{Header: tar.Header{Name: "etc/disk", Typeflag: tar.TypeBlock, Devmajor: 8}},
		hdr{Header: tar.Header{Name: "etc/fifo", Typeflag: tar.TypeFifo}},
		link("etc/to-disk", "/etc/disk"),
		file("etc/big", strings.Repeat("x", 2000)),
		link("etc/loop", "loop"),
	))}
	checked := false
	opt := Options{LayersDir: filepath.Join(t.TempDir(), "layers"), SizeMiB: 32, FinishID: "read-v1", Finish: func(fs *Filesystem) error {
		ctx := context.Background()
		for _, ok := range []string{"etc/ok", "etc/via-link"} {
			if b, err := fs.ReadFile(ctx, ok, 1000); err != nil || string(b) != "root:x:0:0::/root:/bin/sh\n" {
				t.Errorf("%s: %q %v", ok, b, err)
			}
		}
		for _, bad := range []string{"etc/disk", "etc/fifo", "etc/to-disk", "etc/big", "etc/loop", "etc"} {
			if b, err := fs.ReadFile(ctx, bad, 1000); !errors.Is(err, ErrUnusable) || b != nil {
				t.Errorf("%s: %q %v, want a refusal (ErrUnusable)", bad, b, err)
			}
		}
		if _, err := fs.ReadFile(ctx, "etc/none", 1000); !IsNotExist(err) {
			t.Errorf("a missing file: %v", err)
		}
		checked = true
		return nil
	}}
	if _, err := Import(context.Background(), src, opt); err != nil || !checked {
		t.Fatalf("import: %v (checked %v)", err, checked)
	}
}
