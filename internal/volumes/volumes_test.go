package volumes

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/agentenv/agentenv/internal/errkind"
	"github.com/agentenv/agentenv/internal/faults"
	"github.com/agentenv/agentenv/internal/statedb"
)

// needTools skips (fails under CI) where the host lacks what volumes run:
// root, /dev/fuse and the programs.
func needTools(t testing.TB) {
	t.Helper()
	var missing []string
	if os.Geteuid() != 0 {
		missing = append(missing, "root")
	}
	if _, err := os.Stat("/dev/fuse"); err != nil {
		missing = append(missing, "/dev/fuse")
	}
	for _, p := range []string{"qemu-img", "qemu-storage-daemon", "fuse2fs", "mkfs.ext4", "e2fsck"} {
		if _, err := exec.LookPath(p); err != nil {
			missing = append(missing, p)
		}
	}
	if len(missing) == 0 {
		return
	}
	if os.Getenv("CI") == "true" {
		t.Fatalf("volumes need %v (scripts/test installs them)", missing)
	}
	t.Skipf("volumes need %v", missing)
}

func openStore(t testing.TB, dir string, mod func(*Config)) *Store {
	t.Helper()
	db, err := statedb.Open(filepath.Join(dir, "state.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	cfg := Config{Dir: filepath.Join(dir, "volumes"), Size: 256 << 20, UID: 1000, GID: 1000, IdleClose: time.Hour}
	if mod != nil {
		mod(&cfg)
	}
	s, err := Open(context.Background(), db, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

func ptr[T any](v T) *T { return &v }

// newVolume is a store of its own (Config changed by mod) with one volume
// in it, named name.
func newVolume(t *testing.T, name string, mod func(*Config)) (*Store, *Volume) {
	t.Helper()
	needTools(t)
	s := openStore(t, t.TempDir(), mod)
	v, err := s.Create(context.Background(), name)
	if err != nil {
		t.Fatal(err)
	}
	return s, v
}

func TestVolumesRecords(t *testing.T) {
	needTools(t)
	ctx := context.Background()
	s := openStore(t, t.TempDir(), nil)
	a, err := s.Create(ctx, "data")
	if err != nil {
		t.Fatal(err)
	}
	if len(a.ID) != 20 || !strings.HasPrefix(a.Token, "vol_") || a.Size != 256<<20 {
		t.Fatalf("volume %+v", a)
	}
	if _, err := s.Create(ctx, "data"); !errors.Is(err, errkind.ErrConflict) {
		t.Fatalf("second volume named data: %v", err)
	}
	for _, bad := range []string{"", "-x", "a/b", "a b", strings.Repeat("x", 64), "ü"} {
		if _, err := s.Create(ctx, bad); !errors.Is(err, errkind.ErrInvalid) {
			t.Errorf("name %q: %v", bad, err)
		}
	}
	b, err := s.Create(ctx, "other")
	if err != nil {
		t.Fatal(err)
	}
	l, err := s.List(ctx)
	if err != nil || len(l) != 2 || l[0].ID != a.ID || l[1].ID != b.ID {
		t.Fatalf("list %v %v", l, err)
	}
	if got, err := s.ByName(ctx, "other"); err != nil || got.ID != b.ID || got.Token != b.Token {
		t.Fatalf("by name %+v %v", got, err)
	}
	if err := s.Delete(ctx, a.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Get(ctx, a.ID); !errors.Is(err, errkind.ErrNotFound) {
		t.Fatalf("deleted volume: %v", err)
	}
	if _, err := os.Stat(s.dir(a.ID)); !os.IsNotExist(err) {
		t.Fatalf("deleted volume's disk: %v", err)
	}
	if err := s.Delete(ctx, a.ID); !errors.Is(err, errkind.ErrNotFound) {
		t.Fatalf("second delete: %v", err)
	}
}

// Each step of a creation that fails leaves neither a record nor a disk.
func TestCreateFaults(t *testing.T) {
	needTools(t)
	s := openStore(t, t.TempDir(), nil)
	for _, step := range []string{"dir", "disk", "record"} {
		inj := faults.NewInjector("volume-create/" + step)
		if _, err := s.Create(faults.With(context.Background(), inj), "v-"+step); !errors.Is(err, faults.ErrInjected) {
			t.Fatalf("%s: %v", step, err)
		}
		if l, _ := s.List(context.Background()); len(l) != 0 {
			t.Fatalf("%s: records %v", step, l)
		}
		if e, _ := os.ReadDir(s.cfg.Dir); len(e) != 0 {
			t.Fatalf("%s: left %v", step, e)
		}
	}
}

func TestContent(t *testing.T) {
	ctx := context.Background()
	s, v := newVolume(t, "data", nil)
	root, err := s.Stat(ctx, v.ID, "/")
	if err != nil || root.Type != "directory" || root.UID != 1000 || root.Path != "/" {
		t.Fatalf("root %+v %v", root, err)
	}
	// Write makes parents, owned by the default owner.
	e, err := s.WriteFile(ctx, v.ID, "/a/b/hello.txt", Owner{}, false, strings.NewReader("hello"))
	if err != nil || e.Type != "file" || e.Size != 5 || e.Mode != 0o644 || e.UID != 1000 || e.Path != "/a/b/hello.txt" || e.Name != "hello.txt" {
		t.Fatalf("write %+v %v", e, err)
	}
	if d, err := s.Stat(ctx, v.ID, "a/b"); err != nil || d.Type != "directory" || d.UID != 1000 || d.Mode != 0o755 {
		t.Fatalf("parent %+v %v", d, err)
	}
	// Overwrite, with an owner and mode of its own.
	e, err = s.WriteFile(ctx, v.ID, "/a/b/hello.txt", Owner{UID: ptr(0), GID: ptr(5), Mode: ptr(uint32(0o4750))}, false, strings.NewReader("hello again"))
	if err != nil || e.Size != 11 || e.UID != 0 || e.GID != 5 || e.Mode != 0o4750 {
		t.Fatalf("overwrite %+v %v", e, err)
	}
	var buf bytes.Buffer
	var size int64
	if err := s.ReadFile(ctx, v.ID, "/a/b/hello.txt", func(n int64) { size = n }, &buf); err != nil || buf.String() != "hello again" || size != 11 {
		t.Fatalf("read %q %d %v", buf.String(), size, err)
	}
	// Directories.
	if _, err := s.MakeDir(ctx, v.ID, "/x/y", Owner{}, false); !errors.Is(err, errkind.ErrNotFound) {
		t.Fatalf("mkdir without its parent: %v", err)
	}
	d, err := s.MakeDir(ctx, v.ID, "/x/y", Owner{Mode: ptr(uint32(0o700))}, true)
	if err != nil || d.Type != "directory" || d.Mode != 0o700 {
		t.Fatalf("mkdir -p %+v %v", d, err)
	}
	if _, err := s.MakeDir(ctx, v.ID, "/x/y", Owner{}, false); !errors.Is(err, errkind.ErrConflict) {
		t.Fatalf("mkdir of an existing dir: %v", err)
	}
	if _, err := s.MakeDir(ctx, v.ID, "/x/y", Owner{}, true); err != nil {
		t.Fatalf("mkdir -p of an existing dir: %v", err)
	}
	if _, err := s.MakeDir(ctx, v.ID, "/a/b/hello.txt/z", Owner{}, true); !errors.Is(err, errkind.ErrInvalid) {
		t.Fatalf("mkdir under a file: %v", err)
	}
	if _, err := s.WriteFile(ctx, v.ID, "/x", Owner{}, false, strings.NewReader("no")); !errors.Is(err, errkind.ErrConflict) {
		t.Fatalf("write over a directory: %v", err)
	}
	// Listings.
	l, err := s.ListDir(ctx, v.ID, "/", 1)
	if err != nil || paths(l) != "/a /lost+found /x" {
		t.Fatalf("list depth 1: %v %v", paths(l), err)
	}
	l, err = s.ListDir(ctx, v.ID, "/a", 3)
	if err != nil || paths(l) != "/a/b /a/b/hello.txt" {
		t.Fatalf("list depth 3: %v %v", paths(l), err)
	}
	if _, err := s.ListDir(ctx, v.ID, "/a/b/hello.txt", 1); !errors.Is(err, errkind.ErrInvalid) {
		t.Fatalf("list a file: %v", err)
	}
	if _, err := s.ListDir(ctx, v.ID, "/nope", 1); !errors.Is(err, errkind.ErrNotFound) {
		t.Fatalf("list a missing dir: %v", err)
	}
	if _, err := s.ListDir(ctx, v.ID, "/", 0); !errors.Is(err, errkind.ErrInvalid) {
		t.Fatalf("depth 0: %v", err)
	}
	// Metadata.
	e, err = s.SetMetadata(ctx, v.ID, "/a/b/hello.txt", Owner{UID: ptr(1000)})
	if err != nil || e.UID != 1000 || e.GID != 5 || e.Mode != 0o4750 {
		t.Fatalf("chown keeps gid and mode: %+v %v", e, err)
	}
	e, err = s.SetMetadata(ctx, v.ID, "/a/b/hello.txt", Owner{Mode: ptr(uint32(0o600))})
	if err != nil || e.Mode != 0o600 || e.UID != 1000 {
		t.Fatalf("chmod %+v %v", e, err)
	}
	if _, err := s.SetMetadata(ctx, v.ID, "/a", Owner{Mode: ptr(uint32(0o10000))}); !errors.Is(err, errkind.ErrInvalid) {
		t.Fatalf("mode too big: %v", err)
	}
	// Remove, a directory with what it holds.
	if err := s.Remove(ctx, v.ID, "/a"); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Stat(ctx, v.ID, "/a/b/hello.txt"); !errors.Is(err, errkind.ErrNotFound) {
		t.Fatalf("removed: %v", err)
	}
	if err := s.Remove(ctx, v.ID, "/a"); !errors.Is(err, errkind.ErrNotFound) {
		t.Fatalf("remove twice: %v", err)
	}
	if err := s.Remove(ctx, v.ID, "/"); !errors.Is(err, errkind.ErrInvalid) {
		t.Fatalf("remove the root: %v", err)
	}
	// ".." cannot climb out.
	if e, err := s.Stat(ctx, v.ID, "/../../x"); err != nil || e.Path != "/x" {
		t.Fatalf("dot-dot: %+v %v", e, err)
	}
}

func paths(l []Entry) string {
	var p []string
	for _, e := range l {
		p = append(p, e.Path)
	}
	return strings.Join(p, " ")
}

// A symbolic link a guest made cannot lead a content request outside the
// volume, to the host's files.
func TestSymlinkEscape(t *testing.T) {
	ctx := context.Background()
	s, v := newVolume(t, "data", nil)
	secret := filepath.Join(t.TempDir(), "secret")
	if err := os.WriteFile(secret, []byte("host"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := s.use(ctx, v.ID, func(root *os.Root) error {
		if err := root.Symlink(secret, "abs"); err != nil {
			return err
		}
		if err := root.Symlink("../../../../../../../../.."+secret, "rel"); err != nil {
			return err
		}
		return root.Symlink(filepath.Dir(secret), "dir")
	}); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{"/abs", "/rel"} {
		if err := s.ReadFile(ctx, v.ID, p, func(int64) {}, io.Discard); err == nil {
			t.Errorf("read through %s reached the host", p)
		}
		if _, err := s.WriteFile(ctx, v.ID, p, Owner{}, false, strings.NewReader("x")); err == nil {
			t.Errorf("write through %s", p)
		}
	}
	if _, err := s.WriteFile(ctx, v.ID, "/dir/secret", Owner{}, true, strings.NewReader("pwned")); err == nil {
		t.Error("write under a link to a host directory")
	}
	if _, err := s.MakeDir(ctx, v.ID, "/dir/sub", Owner{}, true); err == nil {
		t.Error("mkdir under a link to a host directory")
	}
	if _, err := s.SetMetadata(ctx, v.ID, "/dir/secret", Owner{Mode: ptr(uint32(0o777))}); err == nil {
		t.Error("chmod under a link to a host directory")
	}
	if err := s.Remove(ctx, v.ID, "/dir/secret"); err == nil {
		t.Error("remove under a link to a host directory")
	}
	if b, err := os.ReadFile(secret); err != nil || string(b) != "host" {
		t.Fatalf("host file %q %v", b, err)
	}
	if fi, _ := os.Stat(secret); fi.Mode().Perm() != 0o600 {
		t.Fatalf("host file mode %v", fi.Mode())
	}
	// The link itself is described, not followed.
	e, err := s.Stat(ctx, v.ID, "/abs")
	if err != nil || e.Type != "symlink" || e.Target != secret {
		t.Fatalf("stat link %+v %v", e, err)
	}
	// Removing the link removes the link.
	if err := s.Remove(ctx, v.ID, "/dir"); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(secret); err != nil {
		t.Fatalf("host file after removing the link: %v", err)
	}
}

// What a volume holds stays across the host closing it (idle), the store
// closing, and a server that stopped without closing it (its mount and
// storage daemon left running).
func TestPersistence(t *testing.T) {
	needTools(t)
	ctx := context.Background()
	dir := t.TempDir()
	s := openStore(t, dir, func(c *Config) { c.IdleClose = 50 * time.Millisecond })
	v, err := s.Create(ctx, "data")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.WriteFile(ctx, v.ID, "/one", Owner{}, false, strings.NewReader("1")); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for mounted(filepath.Join(s.dir(v.ID), mountName)) {
		if time.Now().After(deadline) {
			t.Fatal("idle volume still mounted")
		}
		time.Sleep(20 * time.Millisecond)
	}
	if _, err := s.WriteFile(ctx, v.ID, "/two", Owner{}, false, strings.NewReader("2")); err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	s2 := openStore(t, dir, nil)
	if _, err := s2.WriteFile(ctx, v.ID, "/three", Owner{}, false, strings.NewReader("3")); err != nil {
		t.Fatal(err)
	}
	// s2 is left open, as by a server that was killed (its files closed
	// with it, its fuse2fs and storage daemon left running): the next one
	// recovers its mount.
	if err := s2.use(ctx, v.ID, func(root *os.Root) error {
		return root.WriteFile(uploadDir+"/cut-short", []byte("half"), 0o600)
	}); err != nil {
		t.Fatal(err)
	}
	s2.mu.Lock()
	s2.usage[v.ID].mount.root.Close()
	s2.mu.Unlock()
	s3 := openStore(t, dir, nil)
	if mounted(filepath.Join(s3.dir(v.ID), mountName)) {
		t.Fatal("a stale mount survived recovery")
	}
	l, err := s3.ListDir(ctx, v.ID, "/", 1)
	if err != nil || paths(l) != "/lost+found /one /three /two" {
		t.Fatalf("after recovery: %v %v", paths(l), err)
	}
	if err := s3.use(ctx, v.ID, func(root *os.Root) error {
		entries, err := fs.ReadDir(root.FS(), uploadDir)
		if err != nil || len(entries) != 0 {
			return fmt.Errorf("unfinished writes after recovery: %v %v", entries, err)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if pids := pidsWith("qemu-storage-da", filepath.Join(s3.dir(v.ID), diskName)); len(pids) != 1 {
		t.Fatalf("storage daemons of the volume: %v", pids)
	}
}

// A volume that is full refuses the write (413), keeps what it had, and
// leaves no partial file.
func TestFull(t *testing.T) {
	ctx := context.Background()
	s, v := newVolume(t, "small", func(c *Config) { c.Size = 32 << 20 })
	_, err := s.WriteFile(ctx, v.ID, "/big", Owner{}, false, io.LimitReader(zeros{}, 64<<20))
	if !errors.Is(err, errkind.ErrTooLarge) {
		t.Fatalf("write 64 MiB to 32: %v", err)
	}
	l, err := s.ListDir(ctx, v.ID, "/", 1)
	if err != nil || paths(l) != "/lost+found" {
		t.Fatalf("after a failed write: %v %v", paths(l), err)
	}
	if _, err := s.WriteFile(ctx, v.ID, "/small", Owner{}, false, strings.NewReader("fits")); err != nil {
		t.Fatalf("a small write after: %v", err)
	}
}

type zeros struct{}

func (zeros) Read(p []byte) (int, error) {
	for i := range p {
		p[i] = 1 // not zeros: nothing may be left sparse
	}
	return len(p), nil
}

// Deleting a volume while a content request reads it waits for the read.
func TestDeleteWaitsForReaders(t *testing.T) {
	ctx := context.Background()
	s, v := newVolume(t, "data", nil)
	if _, err := s.WriteFile(ctx, v.ID, "/f", Owner{}, false, strings.NewReader("content")); err != nil {
		t.Fatal(err)
	}
	pr, pw := io.Pipe()
	readErr := make(chan error, 1)
	go func() {
		err := s.ReadFile(ctx, v.ID, "/f", func(int64) {}, pw)
		pw.CloseWithError(err)
		readErr <- err
	}()
	first := make([]byte, 3)
	if _, err := io.ReadFull(pr, first); err != nil {
		t.Fatal(err)
	}
	deleted := make(chan error, 1)
	go func() { deleted <- s.Delete(ctx, v.ID) }()
	// The deletion holds the volume (however long it takes to get there)
	// and then waits for the reader.
	for held := ""; held == ""; {
		select {
		case err := <-deleted:
			t.Fatalf("delete did not wait for the reader: %v", err)
		case <-time.After(10 * time.Millisecond):
		}
		s.mu.Lock()
		held = s.usage[v.ID].held
		s.mu.Unlock()
	}
	select {
	case err := <-deleted:
		t.Fatalf("delete did not wait for the reader: %v", err)
	case <-time.After(100 * time.Millisecond):
	}
	if _, err := s.Stat(ctx, v.ID, "/f"); !errors.Is(err, errkind.ErrConflict) {
		t.Fatalf("a request while deleting: %v", err)
	}
	rest, _ := io.ReadAll(pr)
	if string(first)+string(rest) != "content" || <-readErr != nil {
		t.Fatalf("read %q", string(first)+string(rest))
	}
	if err := <-deleted; err != nil {
		t.Fatal(err)
	}
}

// A write whose body breaks off (a client that goes away at any point)
// leaves the file as it was and nothing half-written.
func TestWriteCutShort(t *testing.T) {
	ctx := context.Background()
	s, v := newVolume(t, "data", nil)
	if _, err := s.WriteFile(ctx, v.ID, "/f", Owner{}, false, strings.NewReader("original")); err != nil {
		t.Fatal(err)
	}
	for _, n := range []int64{0, 1, 4095, 1 << 20} {
		body := io.MultiReader(io.LimitReader(zeros{}, n), failingReader{})
		if _, err := s.WriteFile(ctx, v.ID, "/f", Owner{}, false, body); err == nil {
			t.Fatalf("cut after %d bytes: no error", n)
		}
		var buf bytes.Buffer
		if err := s.ReadFile(ctx, v.ID, "/f", func(int64) {}, &buf); err != nil || buf.String() != "original" {
			t.Fatalf("cut after %d bytes: the file is %q (%v)", n, buf.String(), err)
		}
	}
	if err := s.use(ctx, v.ID, func(root *os.Root) error {
		entries, err := fs.ReadDir(root.FS(), uploadDir)
		if err != nil || len(entries) != 0 {
			return fmt.Errorf("left in the upload directory: %v %v", entries, err)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Stat(ctx, v.ID, "/"+uploadDir+"/x"); !errors.Is(err, errkind.ErrInvalid) {
		t.Fatalf("the upload directory named by a client: %v", err)
	}
}

type failingReader struct{}

func (failingReader) Read([]byte) (int, error) { return 0, errors.New("client went away") }

// A deletion that fails before its record goes leaves the volume as it
// was, usable; one that fails removing the disk has deleted the volume
// (the record is gone) and the next start removes the disk.
func TestDeleteFaults(t *testing.T) {
	needTools(t)
	ctx := context.Background()
	dir := t.TempDir()
	s := openStore(t, dir, nil)
	for _, step := range []string{"close", "record"} {
		v, err := s.Create(ctx, "d-"+step)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := s.WriteFile(ctx, v.ID, "/kept", Owner{}, false, strings.NewReader(step)); err != nil {
			t.Fatal(err)
		}
		inj := faults.NewInjector("volume-delete/" + step)
		if err := s.Delete(faults.With(ctx, inj), v.ID); !errors.Is(err, faults.ErrInjected) {
			t.Fatalf("%s: %v", step, err)
		}
		var buf bytes.Buffer
		if err := s.ReadFile(ctx, v.ID, "/kept", func(int64) {}, &buf); err != nil || buf.String() != step {
			t.Fatalf("%s: after the failed delete the volume reads %q (%v)", step, buf.String(), err)
		}
	}
	v, err := s.Create(ctx, "d-disk")
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Delete(faults.With(ctx, faults.NewInjector("volume-delete/disk")), v.ID); err != nil {
		t.Fatalf("a delete whose disk removal failed: %v", err)
	}
	if _, err := s.Get(ctx, v.ID); !errors.Is(err, errkind.ErrNotFound) {
		t.Fatalf("deleted volume: %v", err)
	}
	if _, err := os.Stat(s.dir(v.ID)); err != nil {
		t.Fatalf("the disk the failed step left: %v", err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	openStore(t, dir, nil) // the next start
	if _, err := os.Stat(s.dir(v.ID)); !os.IsNotExist(err) {
		t.Fatalf("the next start left the deleted volume's disk: %v", err)
	}
}

// A lent volume is the borrower's: content requests and deletions are
// refused (a refused deletion once dropped the loan, opening the disk to
// the host while a guest had it mounted) until it is returned.
func TestLend(t *testing.T) {
	ctx := context.Background()
	s, v := newVolume(t, "data", nil)
	if _, err := s.WriteFile(ctx, v.ID, "/f", Owner{}, false, strings.NewReader("content")); err != nil {
		t.Fatal(err)
	}
	disk, err := s.Lend(ctx, v.ID, "sbx1")
	if err != nil || disk != s.Disk(v.ID) {
		t.Fatalf("lend = %q, %v", disk, err)
	}
	if mounted(filepath.Join(s.dir(v.ID), mountName)) {
		t.Fatal("the host still has the lent volume mounted")
	}
	for i := 0; i < 2; i++ { // the second time after a refused deletion
		if _, err := s.Stat(ctx, v.ID, "/f"); !errors.Is(err, errkind.ErrConflict) || !strings.Contains(err.Error(), "sbx1") {
			t.Fatalf("stat of a lent volume = %v, want a conflict naming the sandbox", err)
		}
		if err := s.Delete(ctx, v.ID); !errors.Is(err, errkind.ErrConflict) {
			t.Fatalf("delete of a lent volume = %v", err)
		}
	}
	if _, err := s.Lend(ctx, v.ID, "sbx2"); !errors.Is(err, errkind.ErrConflict) {
		t.Fatalf("a second loan = %v", err)
	}
	if _, err := s.Lend(ctx, "nope", "sbx2"); !errors.Is(err, errkind.ErrNotFound) {
		t.Fatalf("lending a volume that does not exist = %v", err)
	}
	s.Return(v.ID)
	if e, err := s.Stat(ctx, v.ID, "/f"); err != nil || e.Size != 7 {
		t.Fatalf("after the return: %+v %v", e, err)
	}
}
