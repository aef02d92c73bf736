package repository

import (
	"os"
	"path/filepath"
	"testing"
)

func posixEnv() backendEnv {
	return backendEnv{
		name: "posix_fs",
		open: func(t *testing.T) Repository {
			r, err := Open(Config{Root: filepath.Join(t.TempDir(), "repo")})
			if err != nil {
				t.Fatal(err)
			}
			return r
		},
		mutate: func(t *testing.T, r Repository, kind, id, name string, fn func([]byte) []byte) {
			p := filepath.Join(r.(*posixFS).root, kind, id, name)
			b, err := os.ReadFile(p)
			if err != nil {
				t.Fatal(err)
			}
			if b = fn(b); b == nil {
				err = os.Remove(p)
			} else {
				err = os.WriteFile(p, b, 0o644)
			}
			if err != nil {
				t.Fatal(err)
			}
		},
	}
}

func TestPosixFSConformance(t *testing.T) { runConformance(t, posixEnv()) }

func TestPosixFSLargeSparse(t *testing.T) { runLargeSparse(t, posixEnv()) }

// The stored files of posix_fs are plain files with their holes kept, so
// a shared mount can serve them directly.
func TestPosixFSLayout(t *testing.T) {
	root := t.TempDir()
	r, err := OpenPosixFS(root)
	if err != nil {
		t.Fatal(err)
	}
	src := makeArtifact(t, 9)
	if _, err := r.Put(t.Context(), "snapshots", "s1", src); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"memory", "disk.qcow2", "devices.vmstate", "empty", ManifestName} {
		if _, err := os.Stat(filepath.Join(root, "snapshots", "s1", name)); err != nil {
			t.Error(err)
		}
	}
	if a := allocated(t, filepath.Join(root, "snapshots", "s1", "memory")); a > 2<<20 {
		t.Errorf("stored memory file has %d bytes allocated: holes not preserved", a)
	}
	ents, _ := os.ReadDir(filepath.Join(root, "snapshots", incomingDir))
	if len(ents) != 0 {
		t.Errorf("%d entries left in %s", len(ents), incomingDir)
	}
}
