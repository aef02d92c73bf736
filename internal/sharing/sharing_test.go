package sharing

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/agentenv/agentenv/internal/errkind"
	"github.com/agentenv/agentenv/internal/sandboxes"
	"github.com/agentenv/agentenv/internal/sealed"
	"github.com/agentenv/agentenv/internal/storage/repository"
)

// twoNodes returns the shelves of two nodes sharing one posix_fs
// repository.
func twoNodes(t *testing.T) (*Shelf, *Shelf) {
	t.Helper()
	root := t.TempDir()
	repo, err := repository.OpenPosixFS(root)
	if err != nil {
		t.Fatal(err)
	}
	repoRoots[repo] = root
	a, err := Open(t.Context(), repo, "node-a", clusterKey(t, "the cluster's node token, 32+ bytes"))
	if err != nil {
		t.Fatal(err)
	}
	b, err := Open(t.Context(), repo, "node-b", clusterKey(t, "the cluster's node token, 32+ bytes"))
	if err != nil {
		t.Fatal(err)
	}
	return a, b
}

var repoRoots = map[repository.Repository]string{}

func clusterKey(t *testing.T, secret string) *sealed.Key {
	t.Helper()
	k, err := sealed.NewKey([]byte(secret), "repository tokens")
	if err != nil {
		t.Fatal(err)
	}
	return k
}

// The repository never holds a sandbox's tokens in plaintext; a node with
// the cluster's secret gets them back, one with another secret is refused.
func TestTokensAreSealed(t *testing.T) {
	a, b := twoNodes(t)
	stage := t.TempDir()
	os.WriteFile(filepath.Join(stage, "state"), []byte("s"), 0o600)
	rec := &Record{Sandbox: sandboxes.Sandbox{ID: "sb1", AccessToken: "envd-secret-token", TrafficToken: "traffic-secret-token"},
		Pause: json.RawMessage(`{}`), Generation: NewGeneration()}
	if err := a.Put(t.Context(), stage, rec); err != nil {
		t.Fatal(err)
	}
	err := filepath.Walk(repoRoots[a.repo], func(p string, info os.FileInfo, err error) error {
		if err != nil || info.IsDir() {
			return err
		}
		if b, _ := os.ReadFile(p); strings.Contains(string(b), "secret-token") {
			t.Errorf("%s holds a token in plaintext", p)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	got, err := b.Get(t.Context(), "sb1", t.TempDir())
	if err != nil || got.Sandbox.AccessToken != "envd-secret-token" || got.Sandbox.TrafficToken != "traffic-secret-token" {
		t.Fatalf("tokens back: %+v %v", got, err)
	}
	stranger, _ := Open(t.Context(), a.repo, "node-x", clusterKey(t, "another cluster's token, 32+ bytes"))
	if _, err := stranger.Get(t.Context(), "sb1", t.TempDir()); !errors.Is(err, errkind.ErrCorrupt) {
		t.Fatalf("a node with another secret: %v", err)
	}
}

// upload puts a paused sandbox with one state file on shelf sh and marks
// its local directory, as a node does after a pause.
func upload(t *testing.T, sh *Shelf, id string) (*Record, string) {
	t.Helper()
	local := t.TempDir()
	stage := t.TempDir()
	if err := os.WriteFile(filepath.Join(stage, "state"), []byte("state of "+id), 0o600); err != nil {
		t.Fatal(err)
	}
	rec := &Record{Sandbox: sandboxes.Sandbox{ID: id, State: sandboxes.Paused, TemplateID: "base",
		Phases: []sandboxes.Phase{{Name: "boot"}}},
		Pause: json.RawMessage(`{"stateSHA256":"x"}`), Generation: NewGeneration(), Template: "base", SharedAt: time.Now().UTC()}
	if err := WriteMark(local, rec); err != nil {
		t.Fatal(err)
	}
	if err := sh.Put(t.Context(), stage, rec); err != nil {
		t.Fatal(err)
	}
	return rec, local
}

func TestUploadRoundTrip(t *testing.T) {
	a, b := twoNodes(t)
	rec, local := upload(t, a, "sb1")
	m, ok := ReadMark(local)
	if !ok || m.Generation != rec.Generation {
		t.Fatalf("mark %+v, want generation %s", m, rec.Generation)
	}
	stage := t.TempDir()
	got, err := b.Get(t.Context(), "sb1", stage)
	if err != nil {
		t.Fatal(err)
	}
	var pause struct{ StateSHA256 string }
	if err := json.Unmarshal(got.Pause, &pause); err != nil || pause.StateSHA256 != "x" {
		t.Fatalf("pause record %s: %v", got.Pause, err)
	}
	if got.Generation != rec.Generation || got.Node != "node-a" || got.Sandbox.ID != "sb1" || got.Sandbox.Phases != nil {
		t.Fatalf("record %+v", got)
	}
	if b, err := os.ReadFile(filepath.Join(stage, "state")); err != nil || string(b) != "state of sb1" {
		t.Fatalf("state file %q, %v", b, err)
	}
	if _, err := os.Stat(filepath.Join(stage, RecordFile)); !errors.Is(err, os.ErrNotExist) {
		t.Fatal("the record was left among the sandbox's files")
	}
	// A second upload (the sandbox paused again) replaces the first.
	rec2, _ := upload(t, a, "sb1")
	if got, err := b.Get(t.Context(), "sb1", t.TempDir()); err != nil || got.Generation != rec2.Generation {
		t.Fatalf("after a second upload: %+v, %v", got, err)
	}
	if _, err := b.Get(t.Context(), "nope", t.TempDir()); !errors.Is(err, errkind.ErrNotFound) {
		t.Fatalf("Get of a sandbox never shared: %v", err)
	}
	if err := RemoveMark(local); err != nil {
		t.Fatal(err)
	}
	if _, ok := ReadMark(local); ok {
		t.Fatal("mark still there")
	}
	if err := RemoveMark(local); err != nil {
		t.Fatalf("removing a missing mark: %v", err)
	}
}

// Nodes racing to claim one generation: exactly one wins, the others get
// ErrConflict, and everyone sees it claimed; a new generation is free.
func TestClaimsHaveOneWinner(t *testing.T) {
	a, b := twoNodes(t)
	rec, _ := upload(t, a, "sb1")
	const racers = 8
	var wg sync.WaitGroup
	errs := make([]error, racers)
	for i := range racers {
		sh := a
		if i%2 == 1 {
			sh = b
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = sh.Claim(context.Background(), "sb1", rec.Generation)
		}()
	}
	wg.Wait()
	won := 0
	for _, err := range errs {
		switch {
		case err == nil:
			won++
		case !errors.Is(err, errkind.ErrConflict):
			t.Fatalf("claim: %v", err)
		}
	}
	if won != 1 {
		t.Fatalf("%d claims won, want 1", won)
	}
	for _, sh := range []*Shelf{a, b} {
		if taken, err := sh.Claimed(t.Context(), "sb1", rec.Generation); err != nil || !taken {
			t.Fatalf("Claimed = %v, %v", taken, err)
		}
	}
	if taken, err := a.Claimed(t.Context(), "sb1", NewGeneration()); err != nil || taken {
		t.Fatalf("a new generation is claimed: %v, %v", taken, err)
	}
}

func TestKillAndForget(t *testing.T) {
	a, b := twoNodes(t)
	rec, _ := upload(t, a, "sb1")
	if err := b.Kill(t.Context(), "sb1"); err != nil {
		t.Fatal(err)
	}
	if _, err := a.Get(t.Context(), "sb1", t.TempDir()); !errors.Is(err, errkind.ErrNotFound) {
		t.Fatalf("the killed sandbox is still shared: %v", err)
	}
	// The node that paused it must not resume its copy any more.
	if err := a.Claim(t.Context(), "sb1", rec.Generation); !errors.Is(err, errkind.ErrConflict) {
		t.Fatalf("claim of a killed sandbox: %v", err)
	}
	if err := b.Kill(t.Context(), "sb1"); !errors.Is(err, errkind.ErrNotFound) {
		t.Fatalf("second kill: %v", err)
	}
	// A sandbox a node claimed (it resumes it) cannot be killed from the
	// shelf: it runs there now.
	rec2, _ := upload(t, a, "sb2")
	if err := a.Claim(t.Context(), "sb2", rec2.Generation); err != nil {
		t.Fatal(err)
	}
	if err := b.Kill(t.Context(), "sb2"); !errors.Is(err, errkind.ErrConflict) {
		t.Fatalf("kill of a claimed sandbox: %v", err)
	}
	// Forget (a node killing its own shared copy) works whoever claimed.
	if err := a.Forget(t.Context(), "sb2", rec2.Generation); err != nil {
		t.Fatal(err)
	}
	if _, err := b.Get(t.Context(), "sb2", t.TempDir()); !errors.Is(err, errkind.ErrNotFound) {
		t.Fatalf("forgotten sandbox still shared: %v", err)
	}
}

func TestRAMImagesAreSharedOnce(t *testing.T) {
	a, b := twoNodes(t)
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "memory"), []byte("ram"), 0o600); err != nil {
		t.Fatal(err)
	}
	if a.HasRAM(t.Context(), "img1") {
		t.Fatal("HasRAM before upload")
	}
	for range 2 {
		if err := a.PutRAM(t.Context(), "img1", dir); err != nil {
			t.Fatal(err)
		}
	}
	out := t.TempDir()
	if err := b.GetRAM(t.Context(), "img1", out); err != nil {
		t.Fatal(err)
	}
	if got, _ := os.ReadFile(filepath.Join(out, "memory")); string(got) != "ram" {
		t.Fatalf("RAM image %q", got)
	}
}

// A record that names another sandbox than the one it is stored as is
// reported corrupt, not adopted.
func TestCorruptRecord(t *testing.T) {
	_, b := twoNodes(t)
	bad := t.TempDir()
	if err := os.WriteFile(filepath.Join(bad, RecordFile), []byte(`{"sandbox":{"ID":"someone-else"},"generation":"g"}`), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := b.repo.Put(t.Context(), kindPaused, "victim", bad); err != nil {
		t.Fatal(err)
	}
	if _, err := b.Get(t.Context(), "victim", t.TempDir()); !errors.Is(err, errkind.ErrCorrupt) {
		t.Fatalf("Get of a record naming another sandbox: %v", err)
	}
}
