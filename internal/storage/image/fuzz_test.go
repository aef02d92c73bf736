package image

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"
)

// FuzzApplyLayer feeds arbitrary bytes to the tar-to-image writer as a
// layer over a small image that already holds a few files. Whatever the
// bytes, the writer changes nothing but its image file: its directory
// holds only that file after, nothing appears beside it, and the image
// either checks clean (Apply runs e2fsck) or the layer is refused with
// ErrEntry (a refused layer's image is discarded by the build). Seeds: testdata/fuzz/FuzzApplyLayer and the layers below.
//
//	go test -fuzz FuzzApplyLayer -fuzztime 5m ./internal/storage/image/
func FuzzApplyLayer(f *testing.F) {
	if os.Geteuid() != 0 {
		f.Skip("skipped: needs root")
	}
	for _, tool := range []string{"mkfs.ext4", "debugfs", "e2fsck"} {
		if _, err := exec.LookPath(tool); err != nil {
			f.Skipf("skipped: %s not installed", tool)
		}
	}
	for _, seed := range [][]tarEntry{
		{{name: "etc/passwd", typ: tar.TypeBlock}, {name: "dev/fifo", typ: tar.TypeFifo}},
		{{name: "a", typ: tar.TypeSymlink, link: "../../../tmp"}, {name: "a/x", body: "x"}},
		{{name: "base/.wh..wh..opq"}, {name: "../.wh.base"}, {name: "h", typ: tar.TypeLink, link: "base/f"}},
		{{name: `q"<1> -f`, body: "q", mode: 0o6755}, {name: "d/", typ: tar.TypeDir, mode: 0o1777}},
	} {
		var buf bytes.Buffer
		tw := tar.NewWriter(&buf)
		for _, e := range seed {
			h := &tar.Header{Name: e.name, Typeflag: e.typ, Mode: e.mode, Linkname: e.link, Size: int64(len(e.body))}
			if h.Typeflag == 0 {
				h.Typeflag = tar.TypeReg
			}
			tw.WriteHeader(h)
			tw.Write([]byte(e.body))
		}
		tw.Close()
		f.Add(buf.Bytes())
	}
	// One base image for every input, copied for each.
	baseDir := f.TempDir()
	base := filepath.Join(baseDir, "base.raw")
	if out, err := exec.Command("mkfs.ext4", "-q", "-F", "-E", "root_owner=0:0", base, "8M").CombinedOutput(); err != nil {
		f.Fatalf("%v: %s", err, out)
	}
	baseFS := &Filesystem{raw: base, work: baseDir, tree: newTree(), limit: 4 << 20}
	var seedLayer bytes.Buffer
	tw := tar.NewWriter(&seedLayer)
	for _, e := range []tarEntry{{name: "base/f", body: "below"}, {name: "base/sub/g", body: "deeper"}, {name: "link", typ: tar.TypeSymlink, link: "base"}} {
		h := &tar.Header{Name: e.name, Typeflag: e.typ, Mode: 0o644, Linkname: e.link, Size: int64(len(e.body))}
		if h.Typeflag == 0 {
			h.Typeflag = tar.TypeReg
		}
		tw.WriteHeader(h)
		tw.Write([]byte(e.body))
	}
	tw.Close()
	if err := baseFS.Apply(context.Background(), &seedLayer); err != nil {
		f.Fatal(err)
	}
	baseImage, err := os.ReadFile(base)
	if err != nil {
		f.Fatal(err)
	}
	baseTree, _ := baseFS.tree.marshal()

	f.Fuzz(func(t *testing.T, layer []byte) {
		outer := t.TempDir()
		work := filepath.Join(outer, "work")
		os.Mkdir(work, 0o700)
		raw := filepath.Join(work, "fs.raw")
		if err := os.WriteFile(raw, baseImage, 0o600); err != nil {
			t.Fatal(err)
		}
		tree, err := unmarshalTree(baseTree)
		if err != nil {
			t.Fatal(err)
		}
		fs := &Filesystem{raw: raw, work: work, tree: tree, limit: 4 << 20}
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		err = fs.Apply(ctx, bytes.NewReader(layer))
		if err != nil && !errors.Is(err, ErrEntry) {
			t.Fatalf("not a refusal of the layer: %v", err)
		}
		var all []string
		filepath.Walk(outer, func(p string, _ os.FileInfo, _ error) error {
			all = append(all, strings.TrimPrefix(p, outer))
			return nil
		})
		sort.Strings(all)
		if strings.Join(all, " ") != " /work /work/fs.raw" {
			t.Fatalf("the writer left files besides its image: %v", all)
		}
	})
}
