package builds

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/agentenv/agentenv/internal/buildfiles"
	"github.com/agentenv/agentenv/internal/errkind"
	"github.com/agentenv/agentenv/internal/statedb"
	"github.com/agentenv/agentenv/internal/store"
	"github.com/agentenv/agentenv/internal/templates"
)

// noHost is a host with no sandboxes; the records part of Builds needs
// nothing else.
type noHost struct{ snapshots map[string]bool }

func (h noHost) StartBuilder(context.Context, *templates.Template, string, string, int, int, string) (Builder, error) {
	return nil, errors.New("no sandboxes here")
}
func (h noHost) PrepareTemplateSnapshot(context.Context, string) error { return nil }
func (h noHost) RefillTemplatePool(string)                             {}
func (h noHost) SnapshotExists(name string) bool                       { return h.snapshots[name] }
func (h noHost) Go(fn func(context.Context))                           { fn(context.Background()) }

var _ Host = noHost{}

func TestCheckStep(t *testing.T) {
	for _, tc := range []struct {
		st Step
		ok bool
	}{
		{Step{Type: "RUN", Args: []string{"true"}}, true},
		{Step{Type: "RUN"}, false},
		{Step{Type: "ENV", Args: []string{"K", "V"}}, true},
		{Step{Type: "ENV", Args: []string{"K"}}, false},
		{Step{Type: "WORKDIR", Args: []string{"/app"}}, true},
		{Step{Type: "USER", Args: []string{""}}, false},
		{Step{Type: "COPY", Args: []string{".", "/x"}, FilesHash: strings.Repeat("be", 32)}, true},
		{Step{Type: "COPY", Args: []string{"."}, FilesHash: strings.Repeat("be", 32)}, false},
		{Step{Type: "COPY", Args: []string{".", "/x"}, FilesHash: "NOT-HEX"}, false},
		{Step{Type: "FROB"}, false},
	} {
		if err := CheckStep(tc.st); (err == nil) != tc.ok {
			t.Errorf("%+v: %v", tc.st, err)
		}
	}
}

// TestStartChecksCopyFiles: a build whose COPY names files that do not
// match their hash, or were never uploaded, is refused (ErrInvalid) before
// it starts, and the upload is not kept; matching files are admitted.
func TestStartChecksCopyFiles(t *testing.T) {
	dir := t.TempDir()
	files, err := buildfiles.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	bs := New(Config{DataDir: dir, Files: files, Host: noHost{}, MaxVCPUs: 4, MaxMemoryMiB: 4096})
	body := []byte("hello\n")
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	tw.WriteHeader(&tar.Header{Name: "a.txt", Typeflag: tar.TypeReg, Mode: 0o644, Size: int64(len(body))})
	tw.Write(body)
	tw.Close()
	good, _, err := buildfiles.Hash(bytes.NewReader(buf.Bytes()), "a.txt", "/a.txt")
	if err != nil {
		t.Fatal(err)
	}
	bad := strings.Repeat("0", 64)
	for _, tc := range []struct {
		name, hash string
		upload     bool
		want       string
	}{
		{"tampered", bad, true, "do not match"},
		{"never uploaded", strings.Repeat("1", 64), false, "not uploaded"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rec, err := bs.Request("app", nil, 0, 0)
			if err != nil {
				t.Fatal(err)
			}
			if tc.upload {
				if err := files.Receive("app", tc.hash, bytes.NewReader(buf.Bytes())); err != nil {
					t.Fatal(err)
				}
			}
			spec := Spec{FromImage: "example/image:1", Steps: []Step{{Type: "COPY", Args: []string{"a.txt", "/a.txt"}, FilesHash: tc.hash}}}
			err = bs.Start("app", rec.BuildID, spec)
			if !errors.Is(err, errkind.ErrInvalid) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err %v, want ErrInvalid saying %q", err, tc.want)
			}
			if got, _ := bs.Get("app", rec.BuildID); got.Status != Waiting {
				t.Fatalf("refused build is %s", got.Status)
			}
			if files.Present("app", tc.hash) {
				t.Fatal("refused files are kept")
			}
		})
	}
	spec := Spec{Template: "app", Steps: []Step{{Type: "COPY", Args: []string{"a.txt", "/a.txt"}, FilesHash: good}}}
	files.Receive("app", good, bytes.NewReader(buf.Bytes()))
	if err := bs.admit(&spec); err != nil {
		t.Fatal(err)
	}
	if st := spec.Steps[0]; !st.Files.Verified || st.Files.Path == "" || st.Files.Key != good {
		t.Fatalf("admitted step %+v", st)
	}
}

func TestStepKeysChain(t *testing.T) {
	a := hashKey("from:x", Step{Type: "RUN", Args: []string{"make"}})
	if a != hashKey("from:x", Step{Type: "RUN", Args: []string{"make"}}) {
		t.Fatal("a step's key is not stable")
	}
	for _, other := range []string{
		hashKey("from:y", Step{Type: "RUN", Args: []string{"make"}}),
		hashKey("from:x", Step{Type: "RUN", Args: []string{"make", "root"}}),
		hashKey("from:x", Step{Type: "COPY", Args: []string{"make"}, FilesHash: "beef"}),
	} {
		if other == a {
			t.Fatal("different steps or bases share a key")
		}
	}
}

func TestRecords(t *testing.T) {
	dir := t.TempDir()
	bs := New(Config{DataDir: dir, Host: noHost{snapshots: map[string]bool{"snap": true}}, MaxVCPUs: 4, MaxMemoryMiB: 4096})
	for _, tc := range []struct {
		name       string
		tags       []string
		vcpus, mem int
		kind       error
	}{
		{"Bad Name", nil, 0, 0, errkind.ErrInvalid},
		{"ok", nil, 9, 0, errkind.ErrInvalid},
		{"ok", nil, 0, 64, errkind.ErrInvalid},
		{"snap", nil, 0, 0, errkind.ErrConflict}, // a snapshot's name
		{"ok", []string{""}, 0, 0, errkind.ErrInvalid},
		{"ok:-bad", nil, 0, 0, errkind.ErrInvalid},
	} {
		if _, err := bs.Request(tc.name, tc.tags, tc.vcpus, tc.mem); !errors.Is(err, tc.kind) {
			t.Errorf("Request(%q, %q, %d, %d): %v", tc.name, tc.tags, tc.vcpus, tc.mem, err)
		}
	}
	r1, err := bs.Request("app", nil, 2, 512)
	if err != nil {
		t.Fatal(err)
	}
	if !regexp.MustCompile(`^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$`).MatchString(r1.BuildID) {
		t.Fatalf("build id %q is not a UUID (the SDKs parse it as one)", r1.BuildID)
	}
	// name:tag names the template and a tag; "default" is every build's.
	tagged, err := bs.Request("app:v1", []string{"stable", "default", "v1"}, 0, 0)
	if err != nil || tagged.TemplateID != "app" || strings.Join(tagged.Tags, ",") != "v1,stable" {
		t.Fatalf("Request(app:v1, stable): %+v %v", tagged, err)
	}
	if got, _ := bs.Get("app", tagged.BuildID); strings.Join(got.Tags, ",") != "v1,stable" {
		t.Fatalf("recorded tags %+v", got)
	}
	time.Sleep(2 * time.Millisecond)
	r2, _ := bs.Request("app", nil, 0, 0)
	got, err := bs.Get("app", r1.BuildID)
	if err != nil || got.Status != Waiting || got.VCPUs != 2 {
		t.Fatalf("Get: %+v %v", got, err)
	}
	if _, err := bs.Get("app", "nosuchbuild"); !errors.Is(err, errkind.ErrNotFound) {
		t.Fatalf("unknown build: %v", err)
	}
	list, _ := bs.List("app")
	if len(list) != 3 || list[0].BuildID != r2.BuildID {
		t.Fatalf("List, newest first: %+v", list)
	}
	// A build a restart interrupted is recorded as failed.
	r1.Status = Building
	if err := bs.save(r1); err != nil {
		t.Fatal(err)
	}
	New(Config{DataDir: dir, Host: noHost{}, MaxVCPUs: 4, MaxMemoryMiB: 4096}).Recover()
	got, _ = bs.Get("app", r1.BuildID)
	if got.Status != Failed || got.Reason == "" {
		t.Fatalf("interrupted build after a restart: %+v", got)
	}
	// Start refuses a build that is not waiting.
	if err := bs.Start("app", r1.BuildID, Spec{FromTemplate: "base"}); !errors.Is(err, errkind.ErrConflict) {
		t.Fatalf("start of a failed build: %v", err)
	}
}

// TestSweep: a build that waited past waitingTTL for its start is recorded
// as failed, and the uploads of templates with no build waiting (nor the
// template itself) are collected; those of a waiting build stay.
func TestSweep(t *testing.T) {
	dir, st := openStore(t)
	files, err := buildfiles.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	bs := New(Config{DataDir: dir, Files: files, Store: st, Catalog: templates.NewCatalog(st, dir), Host: noHost{}, MaxVCPUs: 4, MaxMemoryMiB: 4096})
	stale, err := bs.Request("stale", nil, 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	stale.CreatedAt = time.Now().Add(-waitingTTL - time.Minute)
	if err := bs.save(stale); err != nil {
		t.Fatal(err)
	}
	if _, err := bs.Request("fresh", nil, 0, 0); err != nil {
		t.Fatal(err)
	}
	hash := strings.Repeat("a", 64)
	for _, tpl := range []string{"stale", "fresh", "never-requested"} {
		if err := files.Receive(tpl, hash, strings.NewReader("files")); err != nil {
			t.Fatal(err)
		}
	}
	bs.Sweep(context.Background(), time.Now())
	if got, _ := bs.Get("stale", stale.BuildID); got.Status != Failed || !strings.Contains(got.Reason, "never started") {
		t.Fatalf("a build that waited a day: %+v", got)
	}
	for tpl, want := range map[string]bool{"stale": false, "fresh": true, "never-requested": false} {
		_, err := os.Stat(filepath.Join(dir, "build-files", "pending", tpl, hash+".tar"))
		if (err == nil) != want {
			t.Errorf("upload for %s kept: %v, want %v", tpl, err == nil, want)
		}
	}
	if !bs.Pending("fresh") || bs.Pending("stale") {
		t.Fatalf("pending: fresh %v, stale %v", bs.Pending("fresh"), bs.Pending("stale"))
	}
}

// TestFromImageKeepsToTheImagePolicy: a build's base image comes from a
// registry only as the node's image policy allows: one on loopback (the
// node itself) is refused by default, saying so without a remote's words.
func TestFromImageKeepsToTheImagePolicy(t *testing.T) {
	dir, st := openStore(t)
	bs := New(Config{DataDir: dir, Store: st, Catalog: templates.NewCatalog(st, dir), Host: noHost{}, MaxVCPUs: 4, MaxMemoryMiB: 4096})
	err := bs.Run(context.Background(), Spec{Template: "from-loopback", FromImage: "127.0.0.1:1/x/y:z"}, func(string, string, string) {})
	if err == nil || !strings.Contains(err.Error(), "does not pull from") {
		t.Fatalf("a base image on loopback: %v", err)
	}
}

// openStore opens the store of a new data dir.
func openStore(t *testing.T) (string, *store.Store) {
	t.Helper()
	dir := t.TempDir()
	db, err := statedb.Open(filepath.Join(dir, "aenv.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	st, err := store.Open(db, dir, slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	return dir, st
}
