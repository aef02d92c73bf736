package orchestrator

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
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

	"github.com/agentenv/agentenv/internal/storage/image"
)

// busyboxImage is a two-layer image: a static busybox with its applets, and
// a layer with data; its config sets an env var.
func busyboxImage(t testing.TB) v1.Image {
	t.Helper()
	bb, err := os.ReadFile("/bin/busybox")
	if err != nil {
		t.Skipf("skipped: no /bin/busybox on this host (apt-get install busybox-static): %v", err)
	}
	mk := func(write func(tw *tar.Writer)) v1.Layer {
		var buf bytes.Buffer
		tw := tar.NewWriter(&buf)
		write(tw)
		tw.Close()
		b := buf.Bytes()
		l, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(b)), nil })
		if err != nil {
			t.Fatal(err)
		}
		return l
	}
	base := mk(func(tw *tar.Writer) {
		for _, d := range []string{"bin/", "etc/", "dev/", "proc/", "sys/", "run/", "tmp/", "root/"} {
			tw.WriteHeader(&tar.Header{Name: d, Typeflag: tar.TypeDir, Mode: 0o755})
		}
		tw.WriteHeader(&tar.Header{Name: "bin/busybox", Typeflag: tar.TypeReg, Mode: 0o755, Size: int64(len(bb))})
		tw.Write(bb)
		for _, applet := range []string{"sh", "cat", "echo", "id", "ls", "true", "sleep"} {
			tw.WriteHeader(&tar.Header{Name: "bin/" + applet, Typeflag: tar.TypeSymlink, Linkname: "busybox", Mode: 0o777})
		}
		passwd := "root:x:0:0:root:/root:/bin/sh\n"
		tw.WriteHeader(&tar.Header{Name: "etc/passwd", Typeflag: tar.TypeReg, Mode: 0o644, Size: int64(len(passwd))})
		tw.Write([]byte(passwd))
	})
	data := mk(func(tw *tar.Writer) {
		body := "hello from an OCI layer\n"
		tw.WriteHeader(&tar.Header{Name: "data/hello", Typeflag: tar.TypeReg, Mode: 0o644, Size: int64(len(body))})
		tw.Write([]byte(body))
	})
	img, err := mutate.AppendLayers(empty.Image, base, data)
	if err != nil {
		t.Fatal(err)
	}
	img, err = mutate.Config(img, v1.Config{Env: []string{"PATH=/bin", "GREETING=from-the-image"}})
	if err != nil {
		t.Fatal(err)
	}
	return img
}

// TestTemplateFromImage imports a `docker save` tarball as a template and
// runs a sandbox of it: files of both layers, the image's env var, and the
// E2B user added on top.
func TestTemplateFromImage(t *testing.T) {
	n := testNode(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	archive := filepath.Join(t.TempDir(), "busybox.tar")
	if err := tarball.WriteToFile(archive, name.MustParseReference("test/busybox:1"), busyboxImage(t)); err != nil {
		t.Fatal(err)
	}
	tpl, err := n.templates.ImportImage(ctx, "from-image", image.Source{Archive: archive}, 256, t.Logf)
	if err != nil {
		t.Fatal(err)
	}
	if tpl.EnvVars["GREETING"] != "from-the-image" || tpl.DefaultUser != "user" {
		t.Fatalf("template: %+v", tpl)
	}
	s := create(t, n, CreateRequest{TemplateID: "from-image", VCPUs: 1, MemoryMiB: 256, EnvVars: map[string]string{"MINE": "x"}})
	out, err := newEnvdClient(s).run(ctx, "", "/bin/sh", "-c", "cat /data/hello; echo $GREETING $MINE; id -u; ls -d /home/user")
	if err != nil || out.stdout != "hello from an OCI layer\nfrom-the-image x\n1000\n/home/user\n" {
		t.Fatalf("sandbox from an imported image: %+v %v", out, err)
	}
	// Bad input: an unreadable archive is refused as invalid, and nothing
	// is registered.
	bad := filepath.Join(t.TempDir(), "bad.tar")
	os.WriteFile(bad, []byte("not an image"), 0o600)
	if _, err := n.templates.ImportImage(ctx, "bad-image", image.Source{Archive: bad}, 256, t.Logf); !errors.Is(err, ErrInvalid) {
		t.Fatalf("import of a broken archive: %v", err)
	}
	if _, err := n.Template("bad-image"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("broken import left a template: %v", err)
	}
	if _, err := n.templates.ImportImage(ctx, "Bad Name", image.Source{Archive: archive}, 256, t.Logf); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "name") {
		t.Fatalf("bad template name: %v", err)
	}
}

// writeBusyboxArchive writes busyboxImage as a `docker save` tarball.
func writeBusyboxArchive(t *testing.T, path string) {
	t.Helper()
	if err := tarball.WriteToFile(path, name.MustParseReference("test/busybox:1"), busyboxImage(t)); err != nil {
		t.Fatal(err)
	}
}

func imageSource(archive string) image.Source { return image.Source{Archive: archive} }
