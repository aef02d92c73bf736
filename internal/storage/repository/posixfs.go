package repository

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"time"

	"github.com/agentenv/agentenv/internal/faults"
)

// incomingDir is the per-kind directory holding uploads in progress and
// deletions in progress. Its name cannot collide with an id (ids start with
// a letter or digit).
const incomingDir = ".incoming"

type posixFS struct {
	root string
	hook faultHook
	now  func() time.Time
}

// OpenPosixFS returns a repository in directory root (created if missing).
// See docs/REPOSITORY.md for the layout.
func OpenPosixFS(root string) (Repository, error) {
	if root == "" {
		return nil, errors.New("posix_fs repository: root directory not set")
	}
	abs, err := filepath.Abs(root)
	if err != nil {
		return nil, fmt.Errorf("posix_fs repository: %w", err)
	}
	if err := os.MkdirAll(abs, 0o755); err != nil {
		return nil, fmt.Errorf("posix_fs repository: %w", err)
	}
	return &posixFS{root: abs, now: time.Now}, nil
}

func (r *posixFS) artifactDir(kind, id string) string { return filepath.Join(r.root, kind, id) }

func (r *posixFS) Put(ctx context.Context, kind, id, dir string) (_ *Manifest, err error) {
	if err := validKindID(kind, id); err != nil {
		return nil, err
	}
	names, err := inputFiles(dir)
	if err != nil {
		return nil, err
	}
	if _, err := r.Stat(ctx, kind, id); err == nil {
		return nil, fmt.Errorf("put %s/%s: %w", kind, id, ErrExists)
	} else if !errors.Is(err, ErrNotFound) {
		return nil, fmt.Errorf("put %s/%s: %w", kind, id, err)
	}
	kindDir := filepath.Join(r.root, kind)
	inc := filepath.Join(kindDir, incomingDir)
	if err := os.MkdirAll(inc, 0o755); err != nil {
		return nil, fmt.Errorf("put %s/%s: %w", kind, id, err)
	}
	tmp, err := os.MkdirTemp(inc, id+".")
	if err != nil {
		return nil, fmt.Errorf("put %s/%s: %w", kind, id, err)
	}
	defer func() {
		if err != nil && !errors.Is(err, errSimulatedCrash) {
			os.RemoveAll(tmp)
		}
	}()
	if err := os.Chmod(tmp, 0o755); err != nil {
		return nil, fmt.Errorf("put %s/%s: %w", kind, id, err)
	}

	m, data, err := storeFiles(ctx, kind, id, names, r.hook, r.now, func(name string) (File, error) {
		fe, err := copyFileSparse(ctx, filepath.Join(dir, name), filepath.Join(tmp, name), -1)
		if err != nil {
			return fe, fmt.Errorf("put %s/%s: %w", kind, id, err)
		}
		faults.Point(faults.RepoPutFile)
		return fe, nil
	}, "")
	if err != nil {
		return nil, err
	}
	if err := writeFileSync(filepath.Join(tmp, ManifestName), data); err != nil {
		return nil, fmt.Errorf("put %s/%s: %w", kind, id, err)
	}
	if err := syncDir(tmp); err != nil {
		return nil, fmt.Errorf("put %s/%s: %w", kind, id, err)
	}
	if err := r.hook.at("commit"); err != nil {
		return nil, err
	}
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("put %s/%s: %w", kind, id, err)
	}
	// The commit point: one rename makes the complete artifact visible.
	final := r.artifactDir(kind, id)
	if err := os.Rename(tmp, final); err != nil {
		if !isDirNotEmpty(err) {
			return nil, fmt.Errorf("put %s/%s: commit: %w", kind, id, err)
		}
		if _, serr := r.Stat(ctx, kind, id); serr == nil {
			return nil, fmt.Errorf("put %s/%s: %w", kind, id, ErrExists)
		}
		// An incomplete leftover (a deletion interrupted after removing the
		// manifest) is in the way: move it aside and retry once.
		if err := r.moveAside(kind, id, "stale"); err != nil {
			return nil, fmt.Errorf("put %s/%s: %w", kind, id, err)
		}
		if err := os.Rename(tmp, final); err != nil {
			if isDirNotEmpty(err) {
				return nil, fmt.Errorf("put %s/%s: %w", kind, id, ErrExists)
			}
			return nil, fmt.Errorf("put %s/%s: commit: %w", kind, id, err)
		}
	}
	if err := syncDir(kindDir); err != nil {
		return nil, fmt.Errorf("put %s/%s: %w", kind, id, err)
	}
	return m, nil
}

func isDirNotEmpty(err error) bool {
	return errors.Is(err, syscall.ENOTEMPTY) || errors.Is(err, syscall.EEXIST)
}

// moveAside renames kind/id into the incoming dir (to be removed there).
func (r *posixFS) moveAside(kind, id, why string) error {
	inc := filepath.Join(r.root, kind, incomingDir)
	if err := os.MkdirAll(inc, 0o755); err != nil {
		return err
	}
	dst := filepath.Join(inc, fmt.Sprintf("%s.%s.%d", id, why, time.Now().UnixNano()))
	if err := os.Rename(r.artifactDir(kind, id), dst); err != nil {
		return fmt.Errorf("move %s/%s aside: %w", kind, id, err)
	}
	if err := syncDir(filepath.Join(r.root, kind)); err != nil {
		return err
	}
	if err := os.RemoveAll(dst); err != nil {
		return fmt.Errorf("remove %s: %w", dst, err)
	}
	return nil
}

// copyFileSparse copies src to a new file dst, preserving holes and turning
// all-zero blocks into holes, fsyncs dst and returns its size and SHA-256.
// wantSize >= 0 is checked against src's size first (ErrCorrupt).
func copyFileSparse(ctx context.Context, src, dst string, wantSize int64) (File, error) {
	in, err := os.Open(src)
	if err != nil {
		return File{}, err
	}
	defer in.Close()
	st, err := in.Stat()
	if err != nil {
		return File{}, err
	}
	if !st.Mode().IsRegular() {
		return File{}, fmt.Errorf("%s is not a regular file", src)
	}
	size := st.Size()
	if wantSize >= 0 && size != wantSize {
		return File{}, fmt.Errorf("%w: file %q: size %d, manifest says %d", ErrCorrupt, filepath.Base(src), size, wantSize)
	}
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
	if err != nil {
		return File{}, err
	}
	defer out.Close()
	w := &sparseWriter{f: out, h: sha256.New()}
	err = scanFile(ctx, in, size, nil, func(off int64, p []byte) error {
		w.skipTo(off)
		_, err := w.Write(p)
		return err
	})
	if err != nil {
		return File{}, err
	}
	w.skipTo(size)
	if err := w.finish(); err != nil {
		return File{}, err
	}
	if err := out.Close(); err != nil {
		return File{}, fmt.Errorf("close %s: %w", dst, err)
	}
	return File{Size: size, SHA256: hex.EncodeToString(w.h.Sum(nil))}, nil
}

func writeFileSync(path string, data []byte) error {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
	if err != nil {
		return err
	}
	if _, err := f.Write(data); err != nil {
		f.Close()
		return fmt.Errorf("write %s: %w", path, err)
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return fmt.Errorf("fsync %s: %w", path, err)
	}
	return f.Close()
}

func (r *posixFS) Stat(ctx context.Context, kind, id string) (*Manifest, error) {
	if err := validKindID(kind, id); err != nil {
		return nil, err
	}
	data, err := os.ReadFile(filepath.Join(r.artifactDir(kind, id), ManifestName))
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil, fmt.Errorf("%s/%s: %w", kind, id, ErrNotFound)
		}
		return nil, fmt.Errorf("stat %s/%s: %w", kind, id, err)
	}
	return decodeManifest(data, kind, id)
}

func (r *posixFS) List(ctx context.Context, kind string) ([]*Manifest, error) {
	if err := validName("kind", kind); err != nil {
		return nil, err
	}
	ents, err := os.ReadDir(filepath.Join(r.root, kind))
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil, nil
		}
		return nil, fmt.Errorf("list %s: %w", kind, err)
	}
	var out []*Manifest
	for _, e := range ents {
		if !e.IsDir() || validName("id", e.Name()) != nil {
			continue // .incoming and foreign entries
		}
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		m, err := r.Stat(ctx, kind, e.Name())
		if errors.Is(err, ErrNotFound) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("list %s: %w", kind, err)
		}
		out = append(out, m)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out, nil
}

func (r *posixFS) Get(ctx context.Context, kind, id, dir string) (_ *Manifest, err error) {
	m, err := r.Stat(ctx, kind, id)
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("get %s/%s: %w", kind, id, err)
	}
	var temps []string
	defer func() {
		if err != nil {
			for _, t := range temps {
				os.Remove(t)
			}
		}
	}()
	src := r.artifactDir(kind, id)
	for _, f := range m.Files {
		tmp, err := tempName(dir, f.Name)
		if err != nil {
			return nil, fmt.Errorf("get %s/%s: %w", kind, id, err)
		}
		temps = append(temps, tmp)
		res, err := copyFileSparse(ctx, filepath.Join(src, f.Name), tmp, f.Size)
		if err != nil {
			if errors.Is(err, fs.ErrNotExist) {
				return nil, fmt.Errorf("get %s/%s: %w: file %q is missing", kind, id, ErrCorrupt, f.Name)
			}
			return nil, fmt.Errorf("get %s/%s: %w", kind, id, err)
		}
		if err := checkFile(f, res.Size, res.SHA256); err != nil {
			return nil, fmt.Errorf("get %s/%s: %w", kind, id, err)
		}
	}
	if err := renameAll(m, temps, dir); err != nil {
		return nil, fmt.Errorf("get %s/%s: %w", kind, id, err)
	}
	return m, nil
}

// tempName reserves a unique temporary name for file name in dir.
func tempName(dir, name string) (string, error) {
	f, err := os.CreateTemp(dir, "."+name+".tmp-*")
	if err != nil {
		return "", err
	}
	p := f.Name()
	f.Close()
	return p, os.Remove(p)
}

// checkFile compares a downloaded file with its manifest entry.
func checkFile(f File, size int64, sum string) error {
	if size != f.Size {
		return fmt.Errorf("%w: file %q: size %d, manifest says %d", ErrCorrupt, f.Name, size, f.Size)
	}
	if sum != f.SHA256 {
		return fmt.Errorf("%w: file %q: sha256 %s, manifest says %s", ErrCorrupt, f.Name, sum, f.SHA256)
	}
	return nil
}

// renameAll moves verified temporary files (temps[i] holds m.Files[i]) to
// their names in dir and makes the renames durable.
func renameAll(m *Manifest, temps []string, dir string) error {
	for i, f := range m.Files {
		if err := os.Rename(temps[i], filepath.Join(dir, f.Name)); err != nil {
			return err
		}
	}
	return syncDir(dir)
}

func (r *posixFS) Delete(ctx context.Context, kind, id string) error {
	if _, err := r.Stat(ctx, kind, id); err != nil {
		return err
	}
	d := r.artifactDir(kind, id)
	// Manifest first: from here on the artifact is invisible.
	if err := os.Remove(filepath.Join(d, ManifestName)); err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("%s/%s: %w", kind, id, ErrNotFound)
		}
		return fmt.Errorf("delete %s/%s: %w", kind, id, err)
	}
	if err := syncDir(d); err != nil {
		return fmt.Errorf("delete %s/%s: %w", kind, id, err)
	}
	if err := r.moveAside(kind, id, "deleted"); err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil // a concurrent Put moved the leftover aside
		}
		return fmt.Errorf("delete %s/%s: %w", kind, id, err)
	}
	return nil
}

func (r *posixFS) Cleanup(ctx context.Context, olderThan time.Duration) (int, error) {
	cutoff := time.Now().Add(-olderThan)
	kinds, err := os.ReadDir(r.root)
	if err != nil {
		return 0, fmt.Errorf("cleanup: %w", err)
	}
	n := 0
	remove := func(p string) error {
		if newestMtime(p).After(cutoff) {
			return nil
		}
		if err := os.RemoveAll(p); err != nil {
			return fmt.Errorf("cleanup: %w", err)
		}
		n++
		return nil
	}
	for _, k := range kinds {
		if !k.IsDir() || validName("kind", k.Name()) != nil {
			continue
		}
		kindDir := filepath.Join(r.root, k.Name())
		inc, err := os.ReadDir(filepath.Join(kindDir, incomingDir))
		if err != nil && !errors.Is(err, fs.ErrNotExist) {
			return n, fmt.Errorf("cleanup: %w", err)
		}
		for _, e := range inc {
			if err := ctx.Err(); err != nil {
				return n, err
			}
			if err := remove(filepath.Join(kindDir, incomingDir, e.Name())); err != nil {
				return n, err
			}
		}
		// Artifact dirs without a manifest: an interrupted Delete.
		ids, err := os.ReadDir(kindDir)
		if err != nil {
			return n, fmt.Errorf("cleanup: %w", err)
		}
		for _, e := range ids {
			if !e.IsDir() || strings.HasPrefix(e.Name(), ".") {
				continue
			}
			p := filepath.Join(kindDir, e.Name())
			if _, err := os.Lstat(filepath.Join(p, ManifestName)); errors.Is(err, fs.ErrNotExist) {
				if err := remove(p); err != nil {
					return n, err
				}
			}
		}
	}
	return n, nil
}

// newestMtime is the latest modification time of p and its direct entries,
// so a directory whose big file is still being written counts as fresh.
func newestMtime(p string) time.Time {
	var t time.Time
	if st, err := os.Lstat(p); err == nil {
		t = st.ModTime()
	}
	ents, _ := os.ReadDir(p)
	for _, e := range ents {
		if info, err := e.Info(); err == nil && info.ModTime().After(t) {
			t = info.ModTime()
		}
	}
	return t
}
