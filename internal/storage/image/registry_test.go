package image

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
)

// privateRegistry runs go-containerregistry's registry on loopback behind
// HTTP basic auth (user "agent", password "s3cret"), with one image pushed.
func privateRegistry(t *testing.T, img v1.Image) (host string) {
	t.Helper()
	reg := registry.New(registry.Logger(log.New(io.Discard, "", 0)))
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if u, p, ok := r.BasicAuth(); !ok || u != "agent" || p != "s3cret" {
			w.Header().Set("WWW-Authenticate", `Basic realm="test"`)
			w.WriteHeader(http.StatusUnauthorized)
			return
		}
		reg.ServeHTTP(w, r)
	}))
	t.Cleanup(srv.Close)
	host = strings.TrimPrefix(srv.URL, "http://")
	ref, err := name.ParseReference(host + "/team/app:v1")
	if err != nil {
		t.Fatal(err)
	}
	if err := remote.Write(ref, img, remote.WithAuth(&authn.Basic{Username: "agent", Password: "s3cret"})); err != nil {
		t.Fatal(err)
	}
	return host
}

// dockerConfig points the default keychain at a docker config.json that
// holds user:password for host (none when user is "").
func dockerConfig(t *testing.T, host, user, password string) {
	t.Helper()
	dir := t.TempDir()
	auths := map[string]any{}
	if user != "" {
		auths[host] = map[string]string{"auth": base64.StdEncoding.EncodeToString([]byte(user + ":" + password))}
	}
	b, _ := json.Marshal(map[string]any{"auths": auths})
	if err := os.WriteFile(filepath.Join(dir, "config.json"), b, 0o600); err != nil {
		t.Fatal(err)
	}
	t.Setenv("DOCKER_CONFIG", dir)
}

// TestImportFromRegistry pulls an image from a registry on loopback that
// needs credentials, taken from the usual docker config; a registry that
// refuses (no or wrong credentials, unknown tag) fails the import with
// ErrImage (ErrNotFound for an image the registry does not have) and
// leaves no layer behind.
func TestImportFromRegistry(t *testing.T) {
	needRoot(t)
	ctx := context.Background()
	img, err := mutate.AppendLayers(empty.Image,
		layerOf(t, tarEntry{name: "app/hello", body: "pulled from a registry\n"}))
	if err != nil {
		t.Fatal(err)
	}
	img, _ = mutate.Config(img, v1.Config{Env: []string{"FROM=registry"}, WorkingDir: "/app"})
	host := privateRegistry(t, img)
	layers := t.TempDir()

	for _, tc := range []struct {
		name, user, password, ref string
		want                      error
	}{
		{"no credentials", "", "", host + "/team/app:v1", ErrImage},
		{"wrong password", "agent", "guess", host + "/team/app:v1", ErrImage},
		{"unknown tag", "agent", "s3cret", host + "/team/app:v2", ErrNotFound},
		{"unknown repository", "agent", "s3cret", host + "/team/none:v1", ErrNotFound},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dockerConfig(t, host, tc.user, tc.password)
			_, err := Import(ctx, Source{Ref: tc.ref}, Options{LayersDir: layers, SizeMiB: 32})
			if !errors.Is(err, tc.want) {
				t.Fatalf("import: %v, want %v", err, tc.want)
			}
			t.Logf("refused: %v", err)
			ents, _ := os.ReadDir(layers)
			for _, e := range ents {
				if strings.HasSuffix(e.Name(), ".qcow2") || strings.HasPrefix(e.Name(), ".build-") {
					t.Errorf("left behind: %s", e.Name())
				}
			}
		})
	}

	dockerConfig(t, host, "agent", "s3cret")
	res, err := Import(ctx, Source{Ref: host + "/team/app:v1"}, Options{LayersDir: layers, SizeMiB: 32})
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Layers) != 1 || res.WorkingDir != "/app" || len(res.Env) != 1 || res.Env[0] != "FROM=registry" {
		t.Fatalf("imported %+v", res)
	}
	readTree(t, res.Top, func(root string) {
		if b, err := os.ReadFile(filepath.Join(root, "app/hello")); err != nil || string(b) != "pulled from a registry\n" {
			t.Fatalf("app/hello: %q %v", b, err)
		}
	})
}
