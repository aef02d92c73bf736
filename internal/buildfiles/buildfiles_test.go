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
