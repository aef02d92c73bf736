package buildfiles

import (
	"archive/tar"
	"bytes"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/agentenv/agentenv/internal/errkind"
)

type sdkCase struct {
	Name, Src, Dest, Hash string
}

// sdkCases are archives and files hashes the official Python SDK made
// (testdata/gen.py).
func sdkCases(t *testing.T) []sdkCase {
	t.Helper()
	b, err := os.ReadFile("testdata/python-sdk.json")
	if err != nil {
		t.Fatal(err)
	}
	var doc struct{ Cases []sdkCase }
	if err := json.Unmarshal(b, &doc); err != nil {
		t.Fatal(err)
	}
	if len(doc.Cases) == 0 {
		t.Fatal("no cases")
	}
	return doc.Cases
}

func fixture(t *testing.T, name string) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("testdata", name+".tar.gz"))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// TestHashMatchesTheSDK recomputes, from the archive alone, the hash the
// SDK computed over the files on disk: gzip and plain tar alike.
func TestHashMatchesTheSDK(t *testing.T) {
	for _, c := range sdkCases(t) {
		t.Run(c.Name, func(t *testing.T) {
			sum, _, err := Hash(bytes.NewReader(fixture(t, c.Name)), c.Src, c.Dest)
			if err != nil {
				t.Fatal(err)
			}
			if sum != c.Hash {
				t.Fatalf("hash %s, the SDK sent %s", sum, c.Hash)
			}
			other, _, _ := Hash(bytes.NewReader(fixture(t, c.Name)), c.Src, c.Dest+"x")
			if other == c.Hash {
				t.Fatal("the destination is not part of the hash")
			}
		})
	}
}

func TestHashPlainTarAndCheckable(t *testing.T) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	tw.WriteHeader(&tar.Header{Name: "a.txt", Typeflag: tar.TypeReg, Mode: 0o644, Size: 2})
	tw.Write([]byte("hi"))
	tw.Close()
	sum, checkable, err := Hash(bytes.NewReader(buf.Bytes()), "a.txt", "/a")
	if err != nil || !checkable || len(sum) != 64 {
		t.Fatalf("sum %q checkable %v err %v", sum, checkable, err)
	}
	_, checkable, _ = Hash(bytes.NewReader(fixture(t, "dir")), "conf", "/c")
	if checkable {
		t.Fatal("an archive with directories is checkable, but the JS SDK hashes their sizes")
	}
	for _, bad := range [][]byte{nil, []byte("not a tar at all, not at all, no"), {0x1f, 0x8b, 0, 0}} {
		if _, _, err := Hash(bytes.NewReader(bad), "a", "b"); !errors.Is(err, errkind.ErrInvalid) {
			t.Fatalf("%q: err %v, want ErrInvalid", bad, err)
		}
	}
}

// tamper returns a copy of a single-file fixture with its content changed.
func tamper(t *testing.T) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	body := "copied from an attacker\n"
	tw.WriteHeader(&tar.Header{Name: "app.txt", Typeflag: tar.TypeReg, Mode: 0o644, Size: int64(len(body))})
	tw.Write([]byte(body))
	tw.Close()
	return buf.Bytes()
}

func TestAdmit(t *testing.T) {
	cases := map[string]sdkCase{}
	for _, c := range sdkCases(t) {
		cases[c.Name] = c
	}
	file, dir := cases["file"], cases["dir"]
	tests := []struct {
		name     string
		template string
		upload   []byte
		c        sdkCase
		want     error // nil: admitted
		verified bool
		shared   bool // Present for another template afterwards
	}{
		{"matching file", "t1", fixture(t, "file"), file, nil, true, true},
		{"matching directory", "t1", fixture(t, "dir"), dir, nil, true, true},
		{"tampered file", "t1", tamper(t), file, ErrMismatch, false, false},
		{"directory under another hash", "t1", fixture(t, "dir"), sdkCase{Src: "conf", Dest: "/etc/conf/", Hash: strings.Repeat("ab", 32)}, nil, false, false},
		{"not an archive", "t1", []byte("garbage"), file, ErrBadArchive, false, false},
		{"never uploaded", "t1", nil, file, ErrNotUploaded, false, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			s, err := Open(t.TempDir())
			if err != nil {
				t.Fatal(err)
			}
			if tc.upload != nil {
				if err := s.Receive(tc.template, tc.c.Hash, bytes.NewReader(tc.upload)); err != nil {
					t.Fatal(err)
				}
			}
			if s.Present(tc.template, tc.c.Hash) {
				t.Fatal("an unchecked upload is present")
			}
			a, err := s.Admit(tc.template, tc.c.Hash, tc.c.Src, tc.c.Dest)
			if tc.want != nil {
				if !errors.Is(err, tc.want) || !errors.Is(err, errkind.ErrInvalid) {
					t.Fatalf("err %v, want %v", err, tc.want)
				}
				if s.Present(tc.template, tc.c.Hash) || s.Present("t2", tc.c.Hash) {
					t.Fatal("refused files are present")
				}
				if n := countFiles(t, s.dir); n != 0 {
					t.Fatalf("%d files left after a refusal", n)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if a.Verified != tc.verified {
				t.Fatalf("verified %v, want %v", a.Verified, tc.verified)
			}
			if !s.Present(tc.template, tc.c.Hash) {
				t.Fatal("admitted files are not present for their template")
			}
			if got := s.Present("t2", tc.c.Hash); got != tc.shared {
				t.Fatalf("present for another template: %v, want %v", got, tc.shared)
			}
			if !tc.verified && a.Key == tc.c.Hash {
				t.Fatal("an unverified archive's cache key is the hash its client claims")
			}
			// Admitted again (a rebuild): the same archive.
			again, err := s.Admit(tc.template, tc.c.Hash, tc.c.Src, tc.c.Dest)
			if err != nil || again != a {
				t.Fatalf("again: %+v %v, want %+v", again, err, a)
			}
		})
	}
}

// TestVerifiedCannotBeReplaced: once files are verified, a later upload
// under their hash that does not match is refused and the verified files stay.
func TestVerifiedCannotBeReplaced(t *testing.T) {
	var file sdkCase
	for _, c := range sdkCases(t) {
		if c.Name == "file" {
			file = c
		}
	}
	s, _ := Open(t.TempDir())
	s.Receive("t1", file.Hash, bytes.NewReader(fixture(t, "file")))
	if _, err := s.Admit("t1", file.Hash, file.Src, file.Dest); err != nil {
		t.Fatal(err)
	}
	s.Receive("t2", file.Hash, bytes.NewReader(tamper(t)))
	if _, err := s.Admit("t2", file.Hash, file.Src, file.Dest); !errors.Is(err, ErrMismatch) {
		t.Fatalf("err %v, want ErrMismatch", err)
	}
	a, err := s.Admit("t1", file.Hash, file.Src, file.Dest)
	if err != nil {
		t.Fatal(err)
	}
	got, _ := os.ReadFile(a.Path)
	if !bytes.Equal(got, fixture(t, "file")) {
		t.Fatal("verified files were replaced")
	}
}

func TestReceiveRefusesBadNames(t *testing.T) {
	s, _ := Open(t.TempDir())
	for _, tc := range []struct{ template, hash string }{
		{"t1", "XYZ"}, {"t1", "abc"}, {"../x", strings.Repeat("a", 64)}, {"", strings.Repeat("a", 64)},
	} {
		if err := s.Receive(tc.template, tc.hash, strings.NewReader("x")); !errors.Is(err, errkind.ErrInvalid) {
			t.Errorf("%q %q: err %v", tc.template, tc.hash, err)
		}
	}
	if n := countFiles(t, s.dir); n != 0 {
		t.Fatalf("%d files stored", n)
	}
}

func TestOpenRemovesStaleAndLegacy(t *testing.T) {
	data := t.TempDir()
	s, _ := Open(data)
	h := strings.Repeat("c", 64)
	s.Receive("t1", h, strings.NewReader("old"))
	s.Receive("t1", strings.Repeat("d", 64), strings.NewReader("new"))
	old := time.Now().Add(-2 * pendingTTL)
	os.Chtimes(s.pendingPath("t1", h), old, old)
	os.WriteFile(filepath.Join(s.dir, h+".tar"), []byte("legacy, unverified"), 0o600)
	s, _ = Open(data)
	if n := countFiles(t, s.dir); n != 1 {
		t.Fatalf("%d files after reopening, want the fresh upload only", n)
	}
	if err := s.RemoveTemplate("t1"); err != nil {
		t.Fatal(err)
	}
	if n := countFiles(t, s.dir); n != 0 {
		t.Fatalf("%d files after removing the template", n)
	}
}

func countFiles(t *testing.T, dir string) int {
	t.Helper()
	n := 0
	filepath.Walk(dir, func(p string, fi os.FileInfo, err error) error {
		if err == nil && !fi.IsDir() {
			n++
		}
		return nil
	})
	return n
}

// TestReceiveBounds: the uploads waiting for builds are bounded per
// template and on the node (413, keeping nothing of the refused upload);
// a second upload of the same hash replaces the first within the bound.
func TestReceiveBounds(t *testing.T) {
	s, _ := Open(t.TempDir())
	s.maxTemplate, s.maxNode = 1000, 1500
	body := strings.NewReader
	hash := func(c string) string { return strings.Repeat(c, 64) }
	for _, tc := range []struct {
		name, template, hash string
		size                 int
		ok                   bool
	}{
		{"first upload", "t1", hash("a"), 600, true},
		{"past the template's bound", "t1", hash("b"), 600, false},
		{"the same hash again, replacing it", "t1", hash("a"), 900, true},
		{"another template", "t2", hash("c"), 500, true},
		{"past the node's bound", "t3", hash("d"), 200, false},
		{"within what the node has left", "t3", hash("d"), 100, true},
	} {
		err := s.Receive(tc.template, tc.hash, body(strings.Repeat("x", tc.size)))
		if tc.ok != (err == nil) || (err != nil && !errors.Is(err, errkind.ErrTooLarge)) {
			t.Fatalf("%s: %v", tc.name, err)
		}
		_, kept := os.Stat(s.pendingPath(tc.template, tc.hash))
		if tc.ok != (kept == nil) {
			t.Fatalf("%s: kept %v", tc.name, kept)
		}
	}
	if n := dirBytes(filepath.Join(s.dir, "pending")); n != 1500 {
		t.Fatalf("%d bytes waiting, want 1500", n)
	}
	if len(s.inflight) != 0 {
		t.Fatalf("room still taken: %v", s.inflight)
	}
}

// TestSweep: uploads no build named for a day, checked archives unused for
// a week, and the uploads and private archives of templates not wanted
// (never came) are collected; the rest stays.
func TestSweep(t *testing.T) {
	s, _ := Open(t.TempDir())
	now := time.Now()
	write := func(p string, age time.Duration) {
		t.Helper()
		if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte("x"), 0o600); err != nil {
			t.Fatal(err)
		}
		os.Chtimes(p, now.Add(-age), now.Add(-age))
	}
	h := func(c string) string { return strings.Repeat(c, 64) }
	keep := []string{s.pendingPath("wanted", h("a")), s.verifiedPath(h("b")), s.privatePath("wanted", h("c"))}
	gone := []string{s.pendingPath("wanted", h("d")), s.verifiedPath(h("e")), s.pendingPath("never", h("f")), s.privatePath("never", h("a"))}
	write(keep[0], time.Hour)
	write(keep[1], 6*24*time.Hour)
	write(keep[2], 30*24*time.Hour)
	write(gone[0], 25*time.Hour)
	write(gone[1], 8*24*time.Hour)
	write(gone[2], time.Minute)
	write(gone[3], time.Minute)
	s.Sweep(now, func(template string) bool { return template == "wanted" })
	for _, p := range keep {
		if _, err := os.Stat(p); err != nil {
			t.Errorf("%s: %v", p, err)
		}
	}
	for _, p := range gone {
		if _, err := os.Stat(p); !os.IsNotExist(err) {
			t.Errorf("%s is still there", p)
		}
	}
}
