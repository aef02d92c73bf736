package image

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
)

// TestPolicyLocalSources: local sources are read only under the node's
// image directories, as plain files and directories; anything else is a
// refusal that reads the same whether the path exists or not.
func TestPolicyLocalSources(t *testing.T) {
	imgDir := t.TempDir()
	outside := t.TempDir()
	os.WriteFile(filepath.Join(imgDir, "ok.tar"), []byte("x"), 0o600)
	os.WriteFile(filepath.Join(outside, "secret.tar"), []byte("x"), 0o600)
	syscall.Mkfifo(filepath.Join(imgDir, "fifo.tar"), 0o600)
	os.Symlink(filepath.Join(outside, "secret.tar"), filepath.Join(imgDir, "link.tar"))
	os.Symlink(outside, filepath.Join(imgDir, "linkdir"))
	layout := filepath.Join(imgDir, "layout")
	os.MkdirAll(filepath.Join(layout, "blobs", "sha256"), 0o755)
	os.WriteFile(filepath.Join(layout, "index.json"), []byte("{}"), 0o644)
	bad := filepath.Join(imgDir, "badlayout")
	os.MkdirAll(filepath.Join(bad, "blobs", "sha256"), 0o755)
	os.Symlink("/etc/shadow", filepath.Join(bad, "blobs", "sha256", "abc"))
	fifoLayout := filepath.Join(imgDir, "fifolayout")
	os.MkdirAll(fifoLayout, 0o755)
	syscall.Mkfifo(filepath.Join(fifoLayout, "index.json"), 0o600)

	p := Policy{Dirs: []string{imgDir}}
	outsideMsg := ""
	for _, tc := range []struct {
		name string
		src  Source
		want error // nil: accepted
	}{
		{"an archive inside", Source{Archive: filepath.Join(imgDir, "ok.tar")}, nil},
		{"a layout inside", Source{Layout: layout}, nil},
		{"a host file", Source{Archive: "/etc/shadow"}, ErrSourceRefused},
		{"a missing host file", Source{Archive: "/no/such/file"}, ErrSourceRefused},
		{"dot-dot out", Source{Archive: imgDir + "/../" + filepath.Base(outside) + "/secret.tar"}, ErrSourceRefused},
		{"relative", Source{Archive: "ok.tar"}, ErrSourceRefused},
		{"a FIFO inside", Source{Archive: filepath.Join(imgDir, "fifo.tar")}, ErrSourceRefused},
		{"a symlink out", Source{Archive: filepath.Join(imgDir, "link.tar")}, ErrSourceRefused},
		{"through a symlinked directory", Source{Archive: filepath.Join(imgDir, "linkdir", "secret.tar")}, ErrSourceRefused},
		{"a layout with a symlinked blob", Source{Layout: bad}, ErrSourceRefused},
		{"a layout with a FIFO", Source{Layout: fifoLayout}, ErrSourceRefused},
		{"missing inside", Source{Archive: filepath.Join(imgDir, "none.tar")}, ErrNotFound},
	} {
		t.Run(tc.name, func(t *testing.T) {
			src := tc.src
			err := p.Check(&src)
			if tc.want == nil {
				if err != nil {
					t.Fatal(err)
				}
				return
			}
			if !errors.Is(err, tc.want) || !errors.Is(err, ErrImage) && tc.want != ErrNotFound {
				t.Fatalf("%v, want %v", err, tc.want)
			}
			if strings.Contains(err.Error(), outside) || strings.Contains(err.Error(), "/etc") || strings.Contains(err.Error(), "/no/such") {
				t.Fatalf("the refusal names the host path: %v", err)
			}
			if tc.name == "a host file" {
				outsideMsg = err.Error()
			}
			if tc.name == "a missing host file" && err.Error() != outsideMsg {
				t.Fatalf("a missing path is told apart from an existing one: %q vs %q", err, outsideMsg)
			}
		})
	}
	// No directories: no local sources at all.
	src := Source{Archive: filepath.Join(imgDir, "ok.tar")}
	if err := (Policy{}).Check(&src); !errors.Is(err, ErrSourceRefused) {
		t.Fatalf("no image directories: %v", err)
	}
}

// TestPolicyRegistries: without PrivateRegistries a pull never connects to
// loopback (the node's own services); with it, it does. A registry's
// answer never reaches the error.
func TestPolicyRegistries(t *testing.T) {
	hits := 0
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits++
		w.WriteHeader(http.StatusForbidden)
		w.Write([]byte("SECRET-BODY of an internal service"))
	}))
	defer srv.Close()
	host := strings.TrimPrefix(srv.URL, "http://")
	for _, ref := range []string{host + "/x/y:z", "localhost:" + strings.Split(host, ":")[1] + "/x/y:z"} {
		src := Source{Ref: ref}
		if err := (Policy{}).Check(&src); err != nil {
			t.Fatal(err)
		}
		_, err := Import(context.Background(), src, Options{LayersDir: t.TempDir(), SizeMiB: 32})
		if !errors.Is(err, ErrSourceRefused) || strings.Contains(err.Error(), "SECRET") {
			t.Fatalf("pull from loopback %s: %v", ref, err)
		}
	}
	if hits != 0 {
		t.Fatalf("the refused pulls reached the service %d times", hits)
	}
	src := Source{Ref: host + "/x/y:z"}
	(Policy{PrivateRegistries: true}).Check(&src)
	_, err := Import(context.Background(), src, Options{LayersDir: t.TempDir(), SizeMiB: 32})
	if hits == 0 || !errors.Is(err, ErrImage) || strings.Contains(err.Error(), "SECRET") || !strings.Contains(err.Error(), "403") {
		t.Fatalf("allowed pull: %d hits, %v", hits, err)
	}
}
