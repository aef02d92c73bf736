package imagecache

import (
	"database/sql"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/agentenv/agentenv/internal/statedb"
	"github.com/agentenv/agentenv/internal/store"
	"github.com/agentenv/agentenv/internal/templates"
)

// Past its bound the cache lets go of the least recently used image (not
// the one in use): that image's own layer goes, the layer it shares with
// another image stays, and within the bound nothing goes.
func TestEvictLeastRecentlyUsed(t *testing.T) {
	dir := t.TempDir()
	db, err := statedb.Open(filepath.Join(dir, statedb.FileName))
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	st, err := store.Open(db, dir, nil)
	if err != nil {
		t.Fatal(err)
	}
	layer := func(id string, mib int) string {
		p := filepath.Join(dir, store.LayersDir, id+".qcow2")
		if err := os.WriteFile(p, make([]byte, mib<<20), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	// Images a (base, a-top) and b (base, b-top), 1 MiB per layer.
	paths := map[string]string{"base": layer("base", 1), "a-top": layer("a-top", 1), "b-top": layer("b-top", 1)}
	if err := st.Tx(t.Context(), func(tx *sql.Tx) error {
		for _, id := range []string{"base", "a-top", "b-top"} {
			needs := []string{}
			if id != "base" {
				needs = append(needs, "base")
			}
			if err := st.Add(tx, id, store.KindLayer, paths[id], needs...); err != nil {
				return err
			}
		}
		if err := store.SetRefs(tx, templates.ImageCacheHolder+"/a-top", "base", "a-top"); err != nil {
			return err
		}
		return store.SetRefs(tx, templates.ImageCacheHolder+"/b-top", "base", "b-top")
	}); err != nil {
		t.Fatal(err)
	}
	c, err := Open(t.Context(), st, 2<<20+512<<10, nil) // room for about two layers
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	c.now = func() time.Time { return now }
	c.Used(t.Context(), "a-top", "docker-archive:a.tar")
	now = now.Add(time.Minute)
	c.Used(t.Context(), "b-top", "docker-archive:b.tar")

	evicted, err := c.Evict(t.Context(), "b-top")
	if err != nil || len(evicted) != 1 || evicted[0] != "docker-archive:a.tar" {
		t.Fatalf("evicted %v, %v", evicted, err)
	}
	for id, want := range map[string]bool{"base": true, "a-top": false, "b-top": true} {
		_, err := os.Stat(paths[id])
		if (err == nil) != want {
			t.Errorf("layer %s on disk: %v, want %v", id, err == nil, want)
		}
	}
	if size, _ := c.Size(); size > 2<<20+512<<10 {
		t.Fatalf("still %d bytes", size)
	}
	// Within the bound, or with only the image in use left, nothing goes.
	if evicted, err := c.Evict(t.Context(), "b-top"); err != nil || len(evicted) != 0 {
		t.Fatalf("second eviction: %v %v", evicted, err)
	}
	c.limit = 1 << 20
	if evicted, err := c.Evict(t.Context(), "b-top"); err != nil || len(evicted) != 0 {
		t.Fatalf("the image in use was evicted: %v %v", evicted, err)
	}
}
