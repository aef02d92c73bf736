package repository

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"math/rand"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// backendEnv is one backend under test.
type backendEnv struct {
	name string
	// open returns a fresh, empty repository.
	open func(t *testing.T) Repository
	// mutate replaces the stored bytes of file name of kind/id with
	// fn(old); fn returning nil deletes the stored file.
	mutate func(t *testing.T, r Repository, kind, id, name string, fn func([]byte) []byte)
}

func setHook(r Repository, h faultHook) {
	switch r := r.(type) {
	case *posixFS:
		r.hook = h
	case *ossRepo:
		r.hook = h
	}
}

// makeArtifact writes a snapshot-like set of files into a new dir: a sparse
// "memory" file (holes, data blocks, and a written-but-zero block), a random
// disk image of odd size, a small vmstate and an empty file.
func makeArtifact(t *testing.T, seed int64) string {
	t.Helper()
	dir := t.TempDir()
	rng := rand.New(rand.NewSource(seed))
	mem, err := os.Create(filepath.Join(dir, "memory"))
	if err != nil {
		t.Fatal(err)
	}
	const memSize = 8 << 20
	if err := mem.Truncate(memSize); err != nil {
		t.Fatal(err)
	}
	for _, off := range []int64{0, 1 << 20, 3<<20 + 4096, memSize - 4096} {
		b := make([]byte, 4096+rng.Intn(200<<10))
		rng.Read(b)
		b = b[:min(int64(len(b)), memSize-off)]
		if _, err := mem.WriteAt(b, off); err != nil {
			t.Fatal(err)
		}
	}
	// Allocated zeros: must read back as zeros (and may become a hole).
	if _, err := mem.WriteAt(make([]byte, 256<<10), 5<<20); err != nil {
		t.Fatal(err)
	}
	mem.Close()
	disk := make([]byte, 300<<10+17)
	rng.Read(disk)
	vm := make([]byte, 50000)
	rng.Read(vm)
	for name, data := range map[string][]byte{"disk.qcow2": disk, "devices.vmstate": vm, "empty": nil} {
		if err := os.WriteFile(filepath.Join(dir, name), data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

func fileSum(t *testing.T, p string) (int64, string) {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	s := sha256.Sum256(b)
	return int64(len(b)), hex.EncodeToString(s[:])
}

// sameDir checks that got holds exactly the files of want, byte for byte.
func sameDir(t *testing.T, want, got string) {
	t.Helper()
	we, _ := os.ReadDir(want)
	ge, _ := os.ReadDir(got)
	if len(we) != len(ge) {
		t.Fatalf("%s has %d entries, want %d", got, len(ge), len(we))
	}
	for _, e := range we {
		a, _ := os.ReadFile(filepath.Join(want, e.Name()))
		b, err := os.ReadFile(filepath.Join(got, e.Name()))
		if err != nil || !bytes.Equal(a, b) {
			t.Fatalf("file %s differs after round trip (err %v)", e.Name(), err)
		}
	}
}

func allocated(t *testing.T, p string) int64 {
	t.Helper()
	var st syscall.Stat_t
	if err := syscall.Stat(p, &st); err != nil {
		t.Fatal(err)
	}
	return st.Blocks * 512
}

func runConformance(t *testing.T, env backendEnv) {
	ctx := context.Background()

	t.Run("RoundTrip", func(t *testing.T) {
		r := env.open(t)
		src := makeArtifact(t, 1)
		m, err := r.Put(ctx, "snapshots", "snap-1", src)
		if err != nil {
			t.Fatal(err)
		}
		if m.Format != FormatVersion || m.Kind != "snapshots" || m.ID != "snap-1" || len(m.Files) != 4 || m.Created.IsZero() {
			t.Fatalf("manifest: %+v", m)
		}
		for _, f := range m.Files {
			size, sum := fileSum(t, filepath.Join(src, f.Name))
			if f.Size != size || f.SHA256 != sum {
				t.Errorf("%s: manifest size/sum %d %s, want %d %s", f.Name, f.Size, f.SHA256, size, sum)
			}
		}
		st, err := r.Stat(ctx, "snapshots", "snap-1")
		if err != nil || st.TotalSize() != m.TotalSize() || !st.Created.Equal(m.Created) {
			t.Fatalf("Stat: %+v, %v", st, err)
		}
		l, err := r.List(ctx, "snapshots")
		if err != nil || len(l) != 1 || l[0].ID != "snap-1" {
			t.Fatalf("List: %v, %v", l, err)
		}
		dst := filepath.Join(t.TempDir(), "out")
		if _, err := r.Get(ctx, "snapshots", "snap-1", dst); err != nil {
			t.Fatal(err)
		}
		sameDir(t, src, dst)
		if a := allocated(t, filepath.Join(dst, "memory")); a > 2<<20 {
			t.Errorf("downloaded memory file has %d bytes allocated: holes not preserved", a)
		}
		// Get over existing files replaces them.
		os.WriteFile(filepath.Join(dst, "disk.qcow2"), []byte("stale"), 0o644)
		if _, err := r.Get(ctx, "snapshots", "snap-1", dst); err != nil {
			t.Fatal(err)
		}
		sameDir(t, src, dst)
		if _, err := r.Put(ctx, "snapshots", "snap-1", src); !errors.Is(err, ErrExists) {
			t.Fatalf("second Put: %v, want ErrExists", err)
		}
		if l, err := r.List(ctx, "templates"); err != nil || len(l) != 0 {
			t.Fatalf("List of empty kind: %v, %v", l, err)
		}
	})

	t.Run("NotFound", func(t *testing.T) {
		r := env.open(t)
		if _, err := r.Stat(ctx, "snapshots", "nope"); !errors.Is(err, ErrNotFound) {
			t.Fatalf("Stat: %v", err)
		}
		if _, err := r.Get(ctx, "snapshots", "nope", t.TempDir()); !errors.Is(err, ErrNotFound) {
			t.Fatalf("Get: %v", err)
		}
		if err := r.Delete(ctx, "snapshots", "nope"); !errors.Is(err, ErrNotFound) {
			t.Fatalf("Delete: %v", err)
		}
	})

	t.Run("Corrupt", func(t *testing.T) {
		r := env.open(t)
		src := makeArtifact(t, 2)
		for i, c := range []struct {
			name, file string
			fn         func([]byte) []byte
		}{
			{"flipped byte", "disk.qcow2", func(b []byte) []byte { b[len(b)/2] ^= 1; return b }},
			{"flipped byte in sparse file", "memory", func(b []byte) []byte { b[10] ^= 0x80; return b }},
			{"truncated", "devices.vmstate", func(b []byte) []byte { return b[:len(b)-1] }},
			{"grown", "disk.qcow2", func(b []byte) []byte { return append(b, 0) }},
			{"missing", "devices.vmstate", func([]byte) []byte { return nil }},
		} {
			t.Run(c.name, func(t *testing.T) {
				id := fmt.Sprintf("c%d", i)
				if _, err := r.Put(ctx, "snapshots", id, src); err != nil {
					t.Fatal(err)
				}
				env.mutate(t, r, "snapshots", id, c.file, c.fn)
				dst := t.TempDir()
				_, err := r.Get(ctx, "snapshots", id, dst)
				if !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), c.file) {
					t.Fatalf("Get: %v, want ErrCorrupt naming %s", err, c.file)
				}
				if ents, _ := os.ReadDir(dst); len(ents) != 0 {
					t.Fatalf("failed Get left %d entries in %s", len(ents), dst)
				}
				// Nothing is deleted: the artifact is still there to inspect.
				if _, err := r.Stat(ctx, "snapshots", id); err != nil {
					t.Fatalf("Stat after corrupt Get: %v", err)
				}
			})
		}
	})

	t.Run("Interrupted", func(t *testing.T) {
		cases := []struct {
			point string
			crash bool // true: die without cleanup; false: cancel the context
		}{
			{"file:devices.vmstate", false},
			{"file:memory", true},
			{"manifest", false},
			{"manifest", true},
			{"commit", true},
		}
		for i, c := range cases {
			t.Run(fmt.Sprintf("%s/crash=%v", c.point, c.crash), func(t *testing.T) {
				r := env.open(t)
				src := makeArtifact(t, 3)
				id := fmt.Sprintf("int-%d", i)
				cctx, cancel := context.WithCancel(ctx)
				defer cancel()
				hit := false
				setHook(r, func(p string) error {
					if p != c.point {
						return nil
					}
					hit = true
					if c.crash {
						return errSimulatedCrash
					}
					cancel()
					return nil
				})
				_, err := r.Put(cctx, "snapshots", id, src)
				setHook(r, nil)
				if !hit {
					if c.point == "commit" {
						t.Skipf("backend %s has no %q point (its manifest PUT is the commit)", env.name, c.point)
					}
					t.Fatalf("fault point %q never reached", c.point)
				}
				if err == nil {
					t.Fatal("interrupted Put succeeded")
				}
				if _, err := r.Stat(ctx, "snapshots", id); !errors.Is(err, ErrNotFound) {
					t.Fatalf("Stat after interrupted Put: %v, want ErrNotFound", err)
				}
				if l, err := r.List(ctx, "snapshots"); err != nil || len(l) != 0 {
					t.Fatalf("List after interrupted Put: %v, %v", l, err)
				}
				if _, err := r.Get(ctx, "snapshots", id, t.TempDir()); !errors.Is(err, ErrNotFound) {
					t.Fatalf("Get after interrupted Put: %v", err)
				}
				// A fresh leftover survives a Cleanup with a long age...
				if n, err := r.Cleanup(ctx, time.Hour); err != nil || n != 0 {
					t.Fatalf("Cleanup(1h) = %d, %v; want 0", n, err)
				}
				// ...and goes with a zero age (crash leftovers only: a
				// cancelled Put cleans up after itself).
				time.Sleep(10 * time.Millisecond)
				n, err := r.Cleanup(ctx, 0)
				if err != nil {
					t.Fatal(err)
				}
				if c.crash && n == 0 {
					t.Fatalf("Cleanup removed nothing after a crash at %s", c.point)
				}
				t.Logf("cleanup removed %d leftovers", n)
				// The same id can be uploaded again.
				if _, err := r.Put(ctx, "snapshots", id, src); err != nil {
					t.Fatalf("Put after interrupted Put: %v", err)
				}
				dst := t.TempDir()
				if _, err := r.Get(ctx, "snapshots", id, dst); err != nil {
					t.Fatal(err)
				}
				sameDir(t, src, dst)
			})
		}
	})

	t.Run("AtomicPut", func(t *testing.T) {
		if err := CheckAtomicPut(ctx, env.open(t)); err != nil {
			t.Fatalf("claims need atomic puts: %v", err)
		}
	})

	t.Run("ConcurrentPut", func(t *testing.T) {
		r := env.open(t)
		const n = 8
		srcs := make([]string, n)
		for i := range srcs {
			srcs[i] = makeArtifact(t, int64(100+i))
		}
		var wg sync.WaitGroup
		errs := make([]error, n)
		for i := range n {
			wg.Add(1)
			go func() {
				defer wg.Done()
				_, errs[i] = r.Put(ctx, "snapshots", fmt.Sprintf("p%02d", i), srcs[i])
			}()
		}
		wg.Wait()
		for i, err := range errs {
			if err != nil {
				t.Fatalf("Put %d: %v", i, err)
			}
		}
		l, err := r.List(ctx, "snapshots")
		if err != nil || len(l) != n {
			t.Fatalf("List: %d, %v", len(l), err)
		}
		for i := range n {
			dst := t.TempDir()
			if _, err := r.Get(ctx, "snapshots", fmt.Sprintf("p%02d", i), dst); err != nil {
				t.Fatal(err)
			}
			sameDir(t, srcs[i], dst)
		}
	})

	// Two Puts of one id, the second completing while the first is about to
	// write its manifest: the first must fail with ErrExists and leave the
	// second's artifact intact.
	t.Run("SameIDRace", func(t *testing.T) {
		r := env.open(t)
		src1, src2 := makeArtifact(t, 20), makeArtifact(t, 21)
		var innerErr error
		setHook(r, func(p string) error {
			if p == "manifest" {
				setHook(r, nil)
				_, innerErr = r.Put(ctx, "snapshots", "same", src2)
			}
			return nil
		})
		_, err := r.Put(ctx, "snapshots", "same", src1)
		setHook(r, nil)
		if innerErr != nil {
			t.Fatalf("inner Put: %v", innerErr)
		}
		if !errors.Is(err, ErrExists) {
			t.Fatalf("outer Put: %v, want ErrExists", err)
		}
		dst := t.TempDir()
		if _, err := r.Get(ctx, "snapshots", "same", dst); err != nil {
			t.Fatal(err)
		}
		sameDir(t, src2, dst)
	})

	// Two Puts of one id whose uploads interleave: the second stores all its
	// files and then dies before its manifest, and the first commits. The
	// committed artifact must hold exactly the first's files, and Cleanup
	// must remove the dead Put's uploads without touching it.
	t.Run("SameIDInterleaved", func(t *testing.T) {
		r := env.open(t)
		src1, src2 := makeArtifact(t, 22), makeArtifact(t, 23)
		var innerErr error
		setHook(r, func(p string) error {
			if p == "manifest" {
				setHook(r, func(p string) error {
					if p == "manifest" {
						return errSimulatedCrash
					}
					return nil
				})
				_, innerErr = r.Put(ctx, "snapshots", "mixed", src2)
				setHook(r, nil)
			}
			return nil
		})
		_, err := r.Put(ctx, "snapshots", "mixed", src1)
		setHook(r, nil)
		if !errors.Is(innerErr, errSimulatedCrash) {
			t.Fatalf("inner Put: %v, want the simulated crash", innerErr)
		}
		if err != nil {
			t.Fatalf("outer Put: %v", err)
		}
		check := func() {
			t.Helper()
			dst := t.TempDir()
			if _, err := r.Get(ctx, "snapshots", "mixed", dst); err != nil {
				t.Fatal(err)
			}
			sameDir(t, src1, dst)
		}
		check()
		if _, err := r.Cleanup(ctx, -time.Hour); err != nil {
			t.Fatal(err)
		}
		check()
		if n, err := r.Cleanup(ctx, -time.Hour); err != nil || n != 0 {
			t.Fatalf("second Cleanup removed %d (%v), want nothing left to remove", n, err)
		}
	})

	t.Run("Delete", func(t *testing.T) {
		r := env.open(t)
		src := makeArtifact(t, 4)
		for _, id := range []string{"a", "b"} {
			if _, err := r.Put(ctx, "snapshots", id, src); err != nil {
				t.Fatal(err)
			}
		}
		if err := r.Delete(ctx, "snapshots", "a"); err != nil {
			t.Fatal(err)
		}
		if _, err := r.Stat(ctx, "snapshots", "a"); !errors.Is(err, ErrNotFound) {
			t.Fatalf("Stat after Delete: %v", err)
		}
		if l, err := r.List(ctx, "snapshots"); err != nil || len(l) != 1 || l[0].ID != "b" {
			t.Fatalf("List after Delete: %v, %v", l, err)
		}
		if err := r.Delete(ctx, "snapshots", "a"); !errors.Is(err, ErrNotFound) {
			t.Fatalf("second Delete: %v", err)
		}
		if n, err := r.Cleanup(ctx, 0); err != nil || n != 0 {
			t.Fatalf("Cleanup after clean Delete = %d, %v", n, err)
		}
		if _, err := r.Put(ctx, "snapshots", "a", src); err != nil {
			t.Fatalf("Put after Delete: %v", err)
		}
	})

	t.Run("InvalidNames", func(t *testing.T) {
		r := env.open(t)
		src := makeArtifact(t, 5)
		bad := []string{"", ".", "..", "../x", "x/../../y", "a/b", `a\b`, ".incoming", ".hidden", "-x", "x\x00", "x y", strings.Repeat("a", 129), "é"}
		for _, s := range bad {
			for _, kid := range [][2]string{{s, "ok"}, {"snapshots", s}} {
				kind, id := kid[0], kid[1]
				if _, err := r.Put(ctx, kind, id, src); !errors.Is(err, ErrInvalidName) {
					t.Errorf("Put(%q, %q): %v, want ErrInvalidName", kind, id, err)
				}
				if _, err := r.Get(ctx, kind, id, t.TempDir()); !errors.Is(err, ErrInvalidName) {
					t.Errorf("Get(%q, %q): %v", kind, id, err)
				}
				if _, err := r.Stat(ctx, kind, id); !errors.Is(err, ErrInvalidName) {
					t.Errorf("Stat(%q, %q): %v", kind, id, err)
				}
				if err := r.Delete(ctx, kind, id); !errors.Is(err, ErrInvalidName) {
					t.Errorf("Delete(%q, %q): %v", kind, id, err)
				}
			}
			if _, err := r.List(ctx, s); !errors.Is(err, ErrInvalidName) {
				t.Errorf("List(%q): %v", s, err)
			}
		}
		// Bad source dirs.
		for _, c := range []struct {
			name  string
			setup func(dir string) error
		}{
			{"reserved manifest name", func(d string) error { return os.WriteFile(filepath.Join(d, ManifestName), nil, 0o644) }},
			{"dot file", func(d string) error { return os.WriteFile(filepath.Join(d, ".x"), nil, 0o644) }},
			{"subdir", func(d string) error { return os.Mkdir(filepath.Join(d, "sub"), 0o755) }},
			{"symlink", func(d string) error { return os.Symlink("/etc/passwd", filepath.Join(d, "link")) }},
		} {
			d := t.TempDir()
			os.WriteFile(filepath.Join(d, "ok"), []byte("x"), 0o644)
			if err := c.setup(d); err != nil {
				t.Fatal(err)
			}
			if _, err := r.Put(ctx, "snapshots", "bad-src", d); err == nil {
				t.Errorf("Put of dir with %s succeeded", c.name)
			}
		}
		if _, err := r.Put(ctx, "snapshots", "empty", t.TempDir()); err == nil {
			t.Error("Put of empty dir succeeded")
		}
		if l, _ := r.List(ctx, "snapshots"); len(l) != 0 {
			t.Errorf("rejected Puts left %d artifacts", len(l))
		}
	})
}

// makeLargeSparse writes a size-byte file with about dataBytes of random
// data in scattered 1 MiB and 4 KiB pieces, the rest holes.
func makeLargeSparse(t testing.TB, p string, size, dataBytes int64) {
	f, err := os.Create(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	rng := rand.New(rand.NewSource(42))
	buf := make([]byte, 1<<20)
	var written int64
	for written < dataBytes {
		n := int64(1 << 20)
		if rng.Intn(4) == 0 {
			n = 4096
		}
		off := rng.Int63n(size/n) * n
		rng.Read(buf[:n])
		if _, err := f.WriteAt(buf[:n], off); err != nil {
			t.Fatal(err)
		}
		written += n
	}
}

// runLargeSparse times Put and Get of a 512 MiB memory file with ~100 MiB
// of data.
func runLargeSparse(t *testing.T, env backendEnv) {
	if testing.Short() {
		t.Skip("large file test skipped in -short mode")
	}
	ctx := context.Background()
	r := env.open(t)
	src := t.TempDir()
	makeLargeSparse(t, filepath.Join(src, "memory"), 512<<20, 100<<20)
	os.WriteFile(filepath.Join(src, "devices.vmstate"), bytes.Repeat([]byte("v"), 77<<10), 0o644)
	srcAlloc := allocated(t, filepath.Join(src, "memory"))

	start := time.Now()
	m, err := r.Put(ctx, "snapshots", "big", src)
	if err != nil {
		t.Fatal(err)
	}
	put := time.Since(start)
	stored := "verbatim file with holes"
	if f := m.File("memory"); f.Encoding == EncodingExtents {
		var n int64
		for _, e := range f.Extents {
			n += e[1]
		}
		stored = fmt.Sprintf("%d MiB object in %d extents", n>>20, len(f.Extents))
	}
	dst := filepath.Join(t.TempDir(), "out")
	start = time.Now()
	if _, err := r.Get(ctx, "snapshots", "big", dst); err != nil {
		t.Fatal(err)
	}
	get := time.Since(start)
	dstAlloc := allocated(t, filepath.Join(dst, "memory"))
	_, sum := fileSum(t, filepath.Join(dst, "memory"))
	if sum != m.File("memory").SHA256 {
		t.Fatal("checksum mismatch after round trip")
	}
	t.Logf("%s: 512 MiB sparse memory file, %d MiB allocated in source: Put %v, Get %v; %d MiB allocated after Get; stored as: %s",
		env.name, srcAlloc>>20, put.Round(time.Millisecond), get.Round(time.Millisecond), dstAlloc>>20, stored)
	if dstAlloc > srcAlloc+(8<<20) {
		t.Errorf("Get allocated %d bytes for a file with %d allocated in the source", dstAlloc, srcAlloc)
	}
}
