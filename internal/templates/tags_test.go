package templates

import (
	"context"
	"database/sql"
	"errors"
	"path/filepath"
	"regexp"
	"testing"

	"github.com/agentenv/agentenv/internal/errkind"
	"github.com/agentenv/agentenv/internal/store"
)

var uuidRE = regexp.MustCompile(`^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$`)

// TestTags: a tag keeps its build when the template is built again (and
// the build's layer with it), name:tag resolves to that build, a tag at
// the current build is the template itself, and deleting the template
// removes its tags.
func TestTags(t *testing.T) {
	needQEMUImg(t)
	ctx := context.Background()
	dir := t.TempDir()
	c := openCatalog(t, dir)
	mk := func(content string) string {
		p := filepath.Join(dir, store.LayersDir, ".build-"+content+".qcow2")
		qcow2(t, p, "", content)
		return p
	}
	v1, err := c.InstallFile(ctx, Template{Name: "app", BuildID: "11111111-1111-4111-8111-111111111111"}, mk("11"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.AssignTags(ctx, "app", []string{"v1", "stable"}); err != nil {
		t.Fatal(err)
	}
	// At the current build, app:v1 is app (its snapshot and pool serve it).
	if got, err := c.Get(ctx, "app:v1"); err != nil || got.Name != "app" || got.Layer != v1.Layer {
		t.Fatalf("app:v1 at the current build: %+v %v", got, err)
	}
	v2, err := c.InstallFile(ctx, Template{Name: "app", BuildID: "22222222-2222-4222-8222-222222222222"}, mk("22"))
	if err != nil {
		t.Fatal(err)
	}
	got, err := c.Get(ctx, "app:v1")
	if err != nil || got.Name != "app:v1" || got.Layer != v1.Layer || got.BuildID != v1.BuildID {
		t.Fatalf("app:v1 after a rebuild: %+v %v, want build 1", got, err)
	}
	if cur, _ := c.Get(ctx, "app:default"); cur.Layer != v2.Layer {
		t.Fatalf("app:default is %s, want the new build", cur.Layer)
	}
	if removed, _ := c.st.GC(ctx); len(removed) != 0 {
		t.Fatalf("GC removed %v, which tags reach", removed)
	}
	// Assigning from a tag points the new tags at that tag's build.
	if at, err := c.AssignTags(ctx, "app:v1", []string{"prod"}); err != nil || at.BuildID != v1.BuildID {
		t.Fatalf("assign from app:v1: %+v %v", at, err)
	}
	tags, err := c.Tags(ctx, "app")
	if err != nil {
		t.Fatal(err)
	}
	want := []struct{ tag, build string }{{"default", v2.BuildID}, {"prod", v1.BuildID}, {"stable", v1.BuildID}, {"v1", v1.BuildID}}
	if len(tags) != len(want) {
		t.Fatalf("tags %+v", tags)
	}
	for i, w := range want {
		if tags[i].Tag != w.tag || tags[i].BuildRef() != w.build {
			t.Errorf("tag %d: %+v, want %v", i, tags[i], w)
		}
	}

	bad := []struct {
		name string
		err  error
		do   func() error
	}{
		{"unknown tag", errkind.ErrNotFound, func() error { _, err := c.Get(ctx, "app:nope"); return err }},
		{"tag of an unknown template", errkind.ErrNotFound, func() error { _, err := c.AssignTags(ctx, "nope", []string{"x"}); return err }},
		{"bad tag", errkind.ErrInvalid, func() error { _, err := c.AssignTags(ctx, "app", []string{"-x"}); return err }},
		{"no tags", errkind.ErrInvalid, func() error { _, err := c.AssignTags(ctx, "app", nil); return err }},
		{"assign default", errkind.ErrInvalid, func() error { _, err := c.AssignTags(ctx, "app", []string{"default"}); return err }},
		{"remove default", errkind.ErrInvalid, func() error { return c.RemoveTags(ctx, "app", []string{"default"}) }},
		{"remove a missing tag with a present one", errkind.ErrNotFound, func() error { return c.RemoveTags(ctx, "app", []string{"prod", "missing"}) }},
	}
	for _, b := range bad {
		if err := b.do(); !errors.Is(err, b.err) {
			t.Errorf("%s: %v, want %v", b.name, err, b.err)
		}
	}
	// The failed removal removed nothing.
	if _, err := c.Get(ctx, "app:prod"); err != nil {
		t.Fatalf("a refused removal removed prod: %v", err)
	}
	if err := c.RemoveTags(ctx, "app", []string{"prod", "stable"}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Get(ctx, "app:prod"); !errors.Is(err, errkind.ErrNotFound) {
		t.Fatalf("removed tag: %v", err)
	}
	// Deleting the template removes its tags; then its layers can go.
	if err := c.st.Tx(ctx, func(tx *sql.Tx) error { return Delete(tx, "app") }); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Get(ctx, "app:v1"); !errors.Is(err, errkind.ErrNotFound) {
		t.Fatalf("tag of a deleted template: %v", err)
	}
	if removed, _ := c.st.GC(ctx); len(removed) != 2 {
		t.Fatalf("GC after delete removed %v, want both builds", removed)
	}
}

func TestBuildRefIsAUUID(t *testing.T) {
	a := Template{Layer: "sha256-aa"}.BuildRef()
	if !uuidRE.MatchString(a) || a != (Template{Layer: "sha256-aa"}).BuildRef() || a == (Template{Layer: "sha256-bb"}).BuildRef() {
		t.Fatalf("BuildRef of a template without a build: %q (want a UUID stable per layer)", a)
	}
	if got := (Template{Layer: "x", BuildID: "b"}).BuildRef(); got != "b" {
		t.Fatalf("BuildRef with a build id: %q", got)
	}
}
