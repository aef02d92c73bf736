package storage

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
)

func TestWriteFileAtomic(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "state.json")
	for _, content := range []string{"first", "second, longer content", ""} {
		if err := WriteFileAtomic(p, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		got, err := os.ReadFile(p)
		if err != nil || string(got) != content {
			t.Fatalf("read back %q, %v; want %q", got, err, content)
		}
	}
	st, _ := os.Stat(p)
	if st.Mode().Perm() != 0o600 {
		t.Fatalf("mode %v", st.Mode())
	}
	ents, _ := os.ReadDir(dir)
	if len(ents) != 1 {
		t.Fatalf("temporary files left: %v", ents)
	}
	if err := WriteFileAtomic(filepath.Join(dir, "missing", "x"), nil, 0o600); err == nil {
		t.Fatal("write into a missing directory succeeded")
	}
}

func TestOverlayChain(t *testing.T) {
	if _, err := FindQEMUImg(); err != nil {
		t.Skip(err)
	}
	ctx := context.Background()
	dir := t.TempDir()
	base := filepath.Join(dir, "base.qcow2")
	makeQcow2(t, base, "64M")
	tests := []struct {
		name    string
		sizeMiB int
		want    int64
	}{
		{"same size", 0, 64 << 20},
		{"smaller request keeps base size", 32, 64 << 20},
		{"grown", 128, 128 << 20},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ov := filepath.Join(dir, tt.name+".qcow2")
			if err := CreateOverlay(ctx, base, ov, tt.sizeMiB); err != nil {
				t.Fatal(err)
			}
			info, err := Info(ctx, ov)
			if err != nil {
				t.Fatal(err)
			}
			if info.Format != "qcow2" || info.BackingFilename != base || info.VirtualSize != tt.want {
				t.Fatalf("overlay info %+v", info)
			}
		})
	}
	if err := CreateOverlay(ctx, filepath.Join(dir, "nope.qcow2"), filepath.Join(dir, "x.qcow2"), 0); err == nil {
		t.Fatal("overlay on a missing base succeeded")
	}
}

// TestOverlayFromTheCache: a second overlay of the same base is written
// from the first one's bytes, without qemu-img (here not even on PATH),
// and is the overlay qemu-img makes; a new file at the base's path, or
// another size, is another overlay.
func TestOverlayFromTheCache(t *testing.T) {
	if _, err := FindQEMUImg(); err != nil {
		t.Skip(err)
	}
	ctx := context.Background()
	dir := t.TempDir()
	base := filepath.Join(dir, "base.qcow2")
	makeQcow2(t, base, "64M")
	first, second := filepath.Join(dir, "first.qcow2"), filepath.Join(dir, "second.qcow2")
	if err := CreateOverlay(ctx, base, first, 0); err != nil {
		t.Fatal(err)
	}
	bin, _ := FindQEMUImg()
	t.Setenv("PATH", t.TempDir())
	if err := CreateOverlay(ctx, base, second, 0); err != nil {
		t.Fatalf("the second overlay needed qemu-img: %v", err)
	}
	a, _ := os.ReadFile(first)
	b, _ := os.ReadFile(second)
	if len(a) == 0 || string(a) != string(b) {
		t.Fatalf("the cached overlay (%d bytes) differs from qemu-img's (%d)", len(b), len(a))
	}
	if err := CreateOverlay(ctx, base, filepath.Join(dir, "grown.qcow2"), 128); err == nil {
		t.Fatal("another size came from the cache")
	}
	t.Setenv("PATH", filepath.Dir(bin))
	// A new base at the same path (the same name, another size; the
	// same file size, and maybe the same inode and timestamps).
	os.Remove(base)
	makeQcow2(t, base, "96M")
	third := filepath.Join(dir, "third.qcow2")
	if err := CreateOverlay(ctx, base, third, 0); err != nil {
		t.Fatal(err)
	}
	for _, ov := range []string{second, third} {
		info, err := Info(ctx, ov)
		want := int64(64 << 20)
		if ov == third {
			want = 96 << 20
		}
		if err != nil || info.BackingFilename != base || info.VirtualSize != want {
			t.Fatalf("%s: %+v %v", filepath.Base(ov), info, err)
		}
	}
	if out, err := exec.Command(bin, "check", second).CombinedOutput(); err != nil {
		t.Fatalf("qemu-img check of the cached overlay: %v: %s", err, out)
	}
}

// makeQcow2 makes an empty qcow2 image of size at path.
func makeQcow2(t *testing.T, path, size string) {
	t.Helper()
	if out, err := exec.Command("qemu-img", "create", "-q", "-f", "qcow2", path, size).CombinedOutput(); err != nil {
		t.Fatal(err, string(out))
	}
}

func TestCloneFileKeepsDataAndHoles(t *testing.T) {
	dir := t.TempDir()
	src := filepath.Join(dir, "src")
	f, err := os.Create(src)
	if err != nil {
		t.Fatal(err)
	}
	const size = 64 << 20
	f.Truncate(size)
	chunks := map[int64]string{0: "start", 10 << 20: "middle", size - 4096: "end"}
	for off, s := range chunks {
		f.WriteAt([]byte(s), off)
	}
	f.Close()
	out := filepath.Join(dir, "out")
	reflinked, err := CloneFile(src, out)
	if err != nil {
		t.Fatal(err)
	}
	got, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != size {
		t.Fatalf("size %d", len(got))
	}
	for off, s := range chunks {
		if string(got[off:off+int64(len(s))]) != s {
			t.Fatalf("data at %d lost", off)
		}
	}
	var st syscall.Stat_t
	syscall.Stat(out, &st)
	if !reflinked && st.Blocks*512 > 1<<20 {
		t.Fatalf("clone is not sparse: %d bytes allocated", st.Blocks*512)
	}
	// The copy is independent of the source.
	os.WriteFile(out, []byte("changed"), 0o600)
	if b, _ := os.ReadFile(src); string(b[:5]) != "start" {
		t.Fatal("writing the clone changed the source")
	}
}

// TestRebaseEmptyOverlay moves an empty overlay onto another base in
// place (the same inode, as a waiting QEMU holds it), and refuses an
// overlay something wrote to, or a base of another size, changing nothing.
func TestRebaseEmptyOverlay(t *testing.T) {
	if _, err := FindQEMUImg(); err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatal(err)
		}
		t.Skip(err)
	}
	ctx := context.Background()
	dir := t.TempDir()
	p := func(name string) string { return filepath.Join(dir, name) }
	makeQcow2(t, p("base.qcow2"), "64M")
	makeQcow2(t, p("other-size.qcow2"), "96M")
	if out, err := exec.Command("qemu-img", "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", p("base.qcow2"), p("a-much-longer-name-of-the-newer-layer.qcow2")).CombinedOutput(); err != nil {
		t.Fatal(err, string(out))
	}
	newer := p("a-much-longer-name-of-the-newer-layer.qcow2")
	if out, err := exec.Command("qemu-io", "-c", "write -P 0x5a 0 64k", newer).CombinedOutput(); err != nil {
		t.Fatal(err, string(out))
	}
	top, written := p("top.qcow2"), p("written.qcow2")
	for _, ov := range []string{top, written} {
		if err := CreateOverlay(ctx, p("base.qcow2"), ov, 0); err != nil {
			t.Fatal(err)
		}
	}
	if out, err := exec.Command("qemu-io", "-c", "write -P 0x11 1M 4k", written).CombinedOutput(); err != nil {
		t.Fatal(err, string(out))
	}
	before, _ := os.Stat(top)
	wroteBefore, _ := os.ReadFile(written)
	for name, tc := range map[string]struct{ path, base string }{
		"written to": {written, newer}, "another size": {top, p("other-size.qcow2")}, "not a qcow2": {top, p("missing")},
	} {
		if err := RebaseEmptyOverlay(ctx, tc.path, p("base.qcow2"), tc.base); err == nil {
			t.Errorf("%s: rebased", name)
		}
	}
	if b, _ := os.ReadFile(written); !bytes.Equal(b, wroteBefore) {
		t.Fatal("a refused rebase changed the overlay")
	}
	if err := RebaseEmptyOverlay(ctx, top, p("base.qcow2"), newer); err != nil {
		t.Fatal(err)
	}
	after, _ := os.Stat(top)
	if !os.SameFile(before, after) {
		t.Fatal("the rebase replaced the file instead of rewriting it")
	}
	info, err := Info(ctx, top)
	if err != nil || info.BackingFilename != newer || info.VirtualSize != 64<<20 {
		t.Fatalf("%+v %v", info, err)
	}
	if out, err := exec.Command("qemu-img", "check", top).CombinedOutput(); err != nil {
		t.Fatalf("qemu-img check: %v: %s", err, out)
	}
	if out, err := exec.Command("qemu-io", "-r", "-c", "read -P 0x5a 0 64k", top).CombinedOutput(); err != nil || bytes.Contains(out, []byte("fail")) {
		t.Fatalf("the newer layer's data through the rebased overlay: %v: %s", err, out)
	}
	// A base whose name has the old one's length (as snapshot ids do) gets
	// the name swapped, without qemu-img: the very bytes CreateOverlay makes
	// on it.
	same := p("nwer.qcow2") // as long as base.qcow2
	if out, err := exec.Command("qemu-img", "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", p("base.qcow2"), same).CombinedOutput(); err != nil {
		t.Fatal(err, string(out))
	}
	swapped, made := p("swapped.qcow2"), p("made.qcow2")
	if err := CreateOverlay(ctx, p("base.qcow2"), swapped, 0); err != nil {
		t.Fatal(err)
	}
	if err := RebaseEmptyOverlay(ctx, swapped, p("base.qcow2"), same); err != nil {
		t.Fatal(err)
	}
	if err := CreateOverlay(ctx, same, made, 0); err != nil {
		t.Fatal(err)
	}
	got, _ := os.ReadFile(swapped)
	want, _ := os.ReadFile(made)
	if !bytes.Equal(got, want) {
		t.Fatalf("the swapped overlay (%d bytes) differs from qemu-img's (%d bytes)", len(got), len(want))
	}
}
