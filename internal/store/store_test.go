package store

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/agentenv/agentenv/internal/statedb"
)

func openTest(t *testing.T) (*Store, string) {
	t.Helper()
	dir := t.TempDir()
	db, err := statedb.Open(filepath.Join(dir, statedb.FileName))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	s, err := Open(db, dir, nil)
	if err != nil {
		t.Fatal(err)
	}
	return s, dir
}

// object makes a file or directory in the store and records it.
func object(t *testing.T, s *Store, dir string, id string, kind Kind, needs ...string) string {
	t.Helper()
	var p string
	switch kind {
	case KindLayer:
		p = filepath.Join(dir, LayersDir, id+".qcow2")
		if err := os.WriteFile(p, []byte(id), 0o444); err != nil {
			t.Fatal(err)
		}
	case KindSnapshot:
		p = filepath.Join(dir, SnapshotsDir, id)
		if err := os.MkdirAll(p, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.Tx(context.Background(), func(tx *sql.Tx) error { return s.Add(tx, id, kind, p, needs...) }); err != nil {
		t.Fatal(err)
	}
	return p
}

func exists(p string) bool { _, err := os.Stat(p); return err == nil }

func ids(objs []Object) []string {
	var out []string
	for _, o := range objs {
		out = append(out, o.ID)
	}
	slices.Sort(out)
	return out
}

func TestGCKeepsWhatIsReachedOnly(t *testing.T) {
	ctx := context.Background()
	s, dir := openTest(t)
	// base ← mid ← top (a template chain); snap1 stacks on top; snap2 on
	// snap1's disk and relative to its RAM; lonely is reached by nothing.
	paths := map[string]string{}
	paths["base"] = object(t, s, dir, "base", KindLayer)
	paths["mid"] = object(t, s, dir, "mid", KindLayer, "base")
	paths["top"] = object(t, s, dir, "top", KindLayer, "mid")
	paths["snap1"] = object(t, s, dir, "snap1", KindSnapshot, "top")
	paths["snap2"] = object(t, s, dir, "snap2", KindSnapshot, "snap1")
	paths["lonely"] = object(t, s, dir, "lonely", KindLayer)
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(s.Tx(ctx, func(tx *sql.Tx) error { return SetLabel(tx, "template", "py", "top", `{}`) }))
	must(s.Tx(ctx, func(tx *sql.Tx) error { return SetRefs(tx, "sandbox/a", "snap2") }))

	removed, err := s.GC(ctx)
	must(err)
	if got := ids(removed); !slices.Equal(got, []string{"lonely"}) {
		t.Fatalf("GC removed %v, want [lonely]", got)
	}
	if exists(paths["lonely"]) || !exists(paths["snap2"]) || !exists(paths["base"]) {
		t.Fatal("files do not match what GC reported")
	}
	holders, err := s.Holders(ctx, "mid")
	must(err)
	if !slices.Equal(holders, []string{"label:template/py", "sandbox/a"}) {
		t.Fatalf("holders of mid: %v", holders)
	}

	// The label moves to a new chain: the old one lives through the sandbox.
	object(t, s, dir, "top2", KindLayer, "base")
	must(s.Tx(ctx, func(tx *sql.Tx) error { return SetLabel(tx, "template", "py", "top2", `{}`) }))
	removed, err = s.GC(ctx)
	must(err)
	if len(removed) != 0 {
		t.Fatalf("GC removed %v while the sandbox needs the old chain", ids(removed))
	}
	// The sandbox goes: its snapshots and the old chain go, base stays.
	must(s.Tx(ctx, func(tx *sql.Tx) error { return DropRefs(tx, "sandbox/a") }))
	removed, err = s.GC(ctx)
	must(err)
	if got := ids(removed); !slices.Equal(got, []string{"mid", "snap1", "snap2", "top"}) {
		t.Fatalf("GC removed %v", got)
	}
	if !exists(paths["base"]) || exists(paths["snap1"]) || exists(paths["top"]) {
		t.Fatal("files do not match what GC reported")
	}
}

func TestLeases(t *testing.T) {
	ctx := context.Background()
	s, dir := openTest(t)
	l, err := s.NewLease(ctx, "fork", time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	p := object(t, s, dir, "assembling", KindSnapshot)
	if err := s.Tx(ctx, func(tx *sql.Tx) error { return l.Hold(tx, "assembling") }); err != nil {
		t.Fatal(err)
	}
	if removed, _ := s.GC(ctx); len(removed) != 0 {
		t.Fatalf("GC removed %v under a lease", ids(removed))
	}
	// The record that takes over and the lease's end in one transaction.
	if err := s.Tx(ctx, func(tx *sql.Tx) error {
		if err := SetRefs(tx, "sandbox/child", "assembling"); err != nil {
			return err
		}
		return l.Release(tx)
	}); err != nil {
		t.Fatal(err)
	}
	if removed, _ := s.GC(ctx); len(removed) != 0 || !exists(p) {
		t.Fatalf("GC removed %v after the hand-over", ids(removed))
	}

	// An expired lease keeps nothing.
	short, _ := s.NewLease(ctx, "build", time.Millisecond)
	object(t, s, dir, "stale", KindLayer)
	s.Tx(ctx, func(tx *sql.Tx) error { return short.Hold(tx, "stale") })
	time.Sleep(5 * time.Millisecond)
	if removed, _ := s.GC(ctx); !slices.Equal(ids(removed), []string{"stale"}) {
		t.Fatalf("expired lease: GC removed %v", ids(removed))
	}
}

func TestReferenceToMissingObjectFails(t *testing.T) {
	ctx := context.Background()
	s, _ := openTest(t)
	err := s.Tx(ctx, func(tx *sql.Tx) error { return SetRefs(tx, "sandbox/x", "no-such") })
	if !errors.Is(err, ErrMissing) {
		t.Fatalf("got %v", err)
	}
	err = s.Tx(ctx, func(tx *sql.Tx) error { return SetLabel(tx, "template", "t", "no-such", "{}") })
	if !errors.Is(err, ErrMissing) {
		t.Fatalf("label: got %v", err)
	}
}

func TestCommitLayerByContent(t *testing.T) {
	ctx := context.Background()
	s, dir := openTest(t)
	write := func(name, content string) string {
		p := filepath.Join(dir, LayersDir, name)
		if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	a, err := s.CommitLayer(ctx, write(".tmp1", "same"), "cache/x")
	if err != nil {
		t.Fatal(err)
	}
	b, err := s.CommitLayer(ctx, write(".tmp2", "same"), "cache/y")
	if err != nil {
		t.Fatal(err)
	}
	if a != b {
		t.Fatalf("same content, two names: %s %s", a, b)
	}
	if exists(filepath.Join(dir, LayersDir, ".tmp2")) {
		t.Fatal("the duplicate's file was kept")
	}
	st, err := os.Stat(filepath.Join(dir, LayersDir, a+".qcow2"))
	if err != nil || st.Mode().Perm() != 0o444 {
		t.Fatalf("committed layer: %v %v", st, err)
	}
	h, _ := s.Holders(ctx, a)
	if !slices.Equal(h, []string{"cache/x", "cache/y"}) {
		t.Fatalf("holders %v", h)
	}
}

func TestRecoverRemovesDebrisAndLeases(t *testing.T) {
	ctx := context.Background()
	s, dir := openTest(t)
	kept := object(t, s, dir, "kept", KindLayer)
	s.Tx(ctx, func(tx *sql.Tx) error { return SetRefs(tx, "sandbox/a", "kept") })
	leased := object(t, s, dir, "leased", KindSnapshot)
	l, _ := s.NewLease(ctx, "fork", time.Hour)
	s.Tx(ctx, func(tx *sql.Tx) error { return l.Hold(tx, "leased") })
	debris := filepath.Join(dir, SnapshotsDir, ".stage-123")
	os.MkdirAll(debris, 0o700)
	stray := filepath.Join(dir, LayersDir, "stray.qcow2")
	os.WriteFile(stray, nil, 0o600)
	sidecar := filepath.Join(dir, LayersDir, "kept.json")
	os.WriteFile(sidecar, nil, 0o600)
	if err := s.Recover(ctx); err != nil {
		t.Fatal(err)
	}
	if !exists(kept) || !exists(sidecar) || exists(leased) || exists(debris) || exists(stray) {
		t.Fatalf("after recovery: kept %v sidecar %v leased %v debris %v stray %v",
			exists(kept), exists(sidecar), exists(leased), exists(debris), exists(stray))
	}
}

// TestGCRacingReferences adds references to fresh objects while GC runs
// over and over: nothing referenced is ever removed.
func TestGCRacingReferences(t *testing.T) {
	ctx := context.Background()
	s, dir := openTest(t)
	object(t, s, dir, "base", KindLayer)
	s.Tx(ctx, func(tx *sql.Tx) error { return SetLabel(tx, "template", "t", "base", "{}") })
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-stop:
				return
			default:
			}
			if _, err := s.GC(ctx); err != nil {
				t.Error(err)
				return
			}
		}
	}()
	for i := 0; i < 200; i++ {
		id := fmt.Sprintf("snap%d", i)
		l, err := s.NewLease(ctx, "fork", time.Hour)
		if err != nil {
			t.Fatal(err)
		}
		p := filepath.Join(dir, SnapshotsDir, id)
		if err := s.Tx(ctx, func(tx *sql.Tx) error {
			if err := s.Add(tx, id, KindSnapshot, p, "base"); err != nil {
				return err
			}
			return l.Hold(tx, id)
		}); err != nil {
			t.Fatal(err)
		}
		os.MkdirAll(p, 0o700)
		if err := s.Tx(ctx, func(tx *sql.Tx) error {
			if err := SetRefs(tx, "sandbox/"+id, id); err != nil {
				return err
			}
			return l.Release(tx)
		}); err != nil {
			t.Fatal(err)
		}
		if !exists(p) {
			t.Fatalf("GC removed %s while it was referenced", id)
		}
		if i%2 == 0 {
			s.Tx(ctx, func(tx *sql.Tx) error { return DropRefs(tx, "sandbox/"+id) })
		}
	}
	close(stop)
	wg.Wait()
	s.GC(ctx)
	objs, _ := s.Objects(ctx)
	if len(objs) != 101 { // base + the 100 odd snapshots
		t.Fatalf("%d objects left, want 101", len(objs))
	}
}
