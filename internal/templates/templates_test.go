package templates

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"testing"

	"github.com/agentenv/agentenv/internal/errkind"
	"github.com/agentenv/agentenv/internal/statedb"
	"github.com/agentenv/agentenv/internal/storage"
	"github.com/agentenv/agentenv/internal/store"
)

func needQEMUImg(t *testing.T) {
	t.Helper()
	if _, err := exec.LookPath("qemu-img"); err != nil {
		t.Skip("qemu-img is not installed (scripts/test installs qemu-utils)")
	}
}

func openCatalog(t *testing.T, dir string) *Catalog {
	t.Helper()
	db, err := statedb.Open(filepath.Join(dir, statedb.FileName))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	st, err := store.Open(db, dir, nil)
	if err != nil {
		t.Fatal(err)
	}
	return NewCatalog(st, dir)
}

// qcow2 makes a small qcow2 image at path (over backing, if given) with
// content written at offset 0.
func qcow2(t *testing.T, path, backing, content string) {
	t.Helper()
	args := []string{"create", "-q", "-f", "qcow2"}
	if backing != "" {
		args = append(args, "-F", "qcow2", "-b", backing)
	}
	args = append(args, path, "16M")
	if out, err := exec.Command("qemu-img", args...).CombinedOutput(); err != nil {
		t.Fatalf("qemu-img create: %v %s", err, out)
	}
	if content != "" {
		if out, err := exec.Command("qemu-io", "-f", "qcow2", "-c", "write -P 0x"+content+" 0 64k", path).CombinedOutput(); err != nil {
			t.Fatalf("qemu-io: %v %s", err, out)
		}
	}
}

func legacyDir(t *testing.T, dir, name string, tpl Template, root func(path string)) {
	t.Helper()
	d := filepath.Join(dir, LegacyDir, name)
	if err := os.MkdirAll(d, 0o755); err != nil {
		t.Fatal(err)
	}
	root(filepath.Join(d, legacyRoot))
	b, _ := json.Marshal(tpl)
	if err := os.WriteFile(filepath.Join(d, legacyRecord), b, 0o644); err != nil {
		t.Fatal(err)
	}
}

// TestAdoptLegacyDataDir: a data dir of an older release (a template built
// over loose layers, one whose root is its own image, and one linked from a
// directory another data dir shares) becomes labels over content-named
// layers; an overlay made against an old root path keeps working.
func TestAdoptLegacyDataDir(t *testing.T) {
	needQEMUImg(t)
	ctx := context.Background()
	dir := t.TempDir()
	layers := filepath.Join(dir, store.LayersDir)
	os.MkdirAll(layers, 0o755)
	qcow2(t, filepath.Join(layers, "build-aaa.qcow2"), "", "aa")
	qcow2(t, filepath.Join(layers, "build-bbb.qcow2"), filepath.Join(layers, "build-aaa.qcow2"), "bb")
	legacyDir(t, dir, "built", Template{VCPUs: 1, MemoryMiB: 256, DefaultUser: "user"}, func(p string) {
		qcow2(t, p, filepath.Join(layers, "build-bbb.qcow2"), "")
	})
	legacyDir(t, dir, "plain", Template{DefaultUser: "root"}, func(p string) { qcow2(t, p, "", "cc") })
	shared := t.TempDir()
	legacyDir(t, shared, "shared", Template{}, func(p string) { qcow2(t, p, "", "dd") })
	os.MkdirAll(filepath.Join(dir, LegacyDir), 0o755)
	if err := os.Symlink(filepath.Join(shared, LegacyDir, "shared"), filepath.Join(dir, LegacyDir, "shared")); err != nil {
		t.Fatal(err)
	}
	// A sandbox overlay of the old release, on the old root path.
	oldPath := filepath.Join(dir, LegacyDir, "plain", legacyRoot)
	overlay := filepath.Join(t.TempDir(), "overlay.qcow2")
	qcow2(t, overlay, oldPath, "")

	c := openCatalog(t, dir)
	if err := c.AdoptLegacy(ctx, slog.Default()); err != nil {
		t.Fatal(err)
	}
	all, err := c.List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, tp := range all {
		names = append(names, tp.Name)
		if filepath.Dir(tp.RootDisk) != layers || len(tp.Layer) != len("sha256-")+64 {
			t.Errorf("template %s: layer %s at %s, not named by content in the store", tp.Name, tp.Layer, tp.RootDisk)
		}
	}
	if !slices.Equal(names, []string{"built", "plain", "shared"}) {
		t.Fatalf("templates %v", names)
	}
	built, _ := c.Get(ctx, "built")
	if built.VCPUs != 1 || built.MemoryMiB != 256 || built.DefaultUser != "user" {
		t.Fatalf("settings lost: %+v", built)
	}
	o, err := c.st.Get(ctx, built.Layer)
	if err != nil || !slices.Equal(o.Needs, []string{"build-bbb"}) {
		t.Fatalf("built's root layer needs %v (%v), want build-bbb", o, err)
	}
	if o, _ := c.st.Get(ctx, "build-bbb"); o == nil || !slices.Equal(o.Needs, []string{"build-aaa"}) {
		t.Fatalf("build-bbb: %+v", o)
	}
	if _, err := os.Stat(filepath.Join(shared, LegacyDir, "shared", legacyRecord)); err != nil {
		t.Fatalf("the shared directory was changed: %v", err)
	}
	if _, err := storage.Info(ctx, overlay); err != nil {
		t.Fatalf("an overlay on the old root path broke: %v", err)
	}
	if out, err := exec.Command("qemu-img", "check", overlay).CombinedOutput(); err != nil {
		t.Fatalf("qemu-img check of the old overlay: %v %s", err, out)
	}
	// Adoption is done once: a second open finds nothing to adopt.
	if err := c.AdoptLegacy(ctx, slog.Default()); err != nil {
		t.Fatal(err)
	}
	if again, _ := c.List(ctx); len(again) != 3 {
		t.Fatalf("second adoption: %d templates", len(again))
	}
}

// TestRebuildMovesLabel: installing a template again under its name moves
// the label; the old layer lives while something holds it and goes after.
func TestRebuildMovesLabel(t *testing.T) {
	needQEMUImg(t)
	ctx := context.Background()
	dir := t.TempDir()
	c := openCatalog(t, dir)
	mk := func(content string) string {
		p := filepath.Join(dir, store.LayersDir, ".build-"+content+".qcow2")
		qcow2(t, p, "", content)
		return p
	}
	v1, err := c.InstallFile(ctx, Template{Name: "py"}, mk("11"))
	if err != nil {
		t.Fatal(err)
	}
	if err := c.st.Tx(ctx, func(tx *sql.Tx) error { return store.SetRefs(tx, "sandbox/s1", v1.Layer) }); err != nil {
		t.Fatal(err)
	}
	v2, err := c.InstallFile(ctx, Template{Name: "py"}, mk("22"))
	if err != nil {
		t.Fatal(err)
	}
	if v1.Layer == v2.Layer {
		t.Fatal("two builds, one layer")
	}
	if got, _ := c.Get(ctx, "py"); got.Layer != v2.Layer {
		t.Fatalf("label points at %s, want the new build %s", got.Layer, v2.Layer)
	}
	if removed, _ := c.st.GC(ctx); len(removed) != 0 {
		t.Fatalf("GC removed %v while a sandbox uses the old build", removed)
	}
	if _, err := os.Stat(v1.RootDisk); err != nil {
		t.Fatal(err)
	}
	c.st.Tx(ctx, func(tx *sql.Tx) error { return store.DropRefs(tx, "sandbox/s1") })
	removed, _ := c.st.GC(ctx)
	if len(removed) != 1 || removed[0].ID != v1.Layer {
		t.Fatalf("GC removed %v, want the old build", removed)
	}
	if _, err := os.Stat(v2.RootDisk); err != nil {
		t.Fatal(err)
	}
	// Deleting the label lets the last build go.
	c.st.Tx(ctx, func(tx *sql.Tx) error { return Delete(tx, "py") })
	if _, err := c.Get(ctx, "py"); !errors.Is(err, errkind.ErrNotFound) {
		t.Fatalf("deleted template: %v", err)
	}
	if removed, _ := c.st.GC(ctx); len(removed) != 1 {
		t.Fatalf("GC after delete removed %v", removed)
	}
}

// TestExportAdoptRoundTrip: a template exported as a directory and placed
// in another data dir is adopted there under the same content name.
func TestExportAdoptRoundTrip(t *testing.T) {
	needQEMUImg(t)
	ctx := context.Background()
	a := openCatalog(t, t.TempDir())
	p := filepath.Join(a.dataDir, store.LayersDir, ".x.qcow2")
	qcow2(t, p, "", "ee")
	src, err := a.InstallFile(ctx, Template{Name: "x", DefaultUser: "user", EnvVars: map[string]string{"K": "v"}}, p)
	if err != nil {
		t.Fatal(err)
	}
	bdir := t.TempDir()
	if err := a.Export(ctx, "x", filepath.Join(bdir, LegacyDir, "x")); err != nil {
		t.Fatal(err)
	}
	b := openCatalog(t, bdir)
	if err := b.AdoptLegacy(ctx, slog.Default()); err != nil {
		t.Fatal(err)
	}
	got, err := b.Get(ctx, "x")
	if err != nil || got.Layer != src.Layer || got.EnvVars["K"] != "v" {
		t.Fatalf("adopted %+v %v, want layer %s", got, err, src.Layer)
	}
	// What is left of the directory is the old root path, leading to the layer.
	if _, err := os.Stat(filepath.Join(bdir, LegacyDir, "x", legacyRecord)); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("the adopted record is still there: %v", err)
	}
	if l, err := os.Readlink(filepath.Join(bdir, LegacyDir, "x", legacyRoot)); err != nil || l != got.RootDisk {
		t.Fatalf("old root path leads to %q (%v), want %s", l, err, got.RootDisk)
	}
}
