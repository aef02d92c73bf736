package volumes

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"sort"
	"strings"
	"syscall"
	"time"

	"github.com/agentenv/agentenv/internal/errkind"
)

// Entry describes a file, directory or symbolic link of a volume.
type Entry struct {
	Name string
	// Type is file, directory, symlink or unknown.
	Type string
	// Path is the entry's absolute path in the volume.
	Path                string
	Size                int64
	Mode                uint32 // permission bits (with setuid, setgid, sticky)
	UID, GID            uint32
	Atime, Mtime, Ctime time.Time
	// Target is a symbolic link's target.
	Target string
}

// Owner is what a write or a new directory sets: nil fields keep the
// default (the store's owner, mode 0644 for files and 0755 for
// directories) or, for SetMetadata, what the entry has.
type Owner struct {
	UID, GID *int
	Mode     *uint32
}

// MaxDepth bounds a listing's depth.
const MaxDepth = 64

// uploadDir, at a volume's root, holds the files being written; the host
// empties it whenever it opens the volume, so a write a crash cut short
// leaves nothing behind. Clients cannot name it.
const uploadDir = ".aenv-uploads"

// clean turns a client's path into one relative to the volume's root ("."
// for the root itself); ".." cannot climb above the root.
func clean(p string) (string, error) {
	if strings.ContainsRune(p, 0) {
		return "", fmt.Errorf("%w: path holds a NUL byte", errkind.ErrInvalid)
	}
	c := path.Clean("/" + p)
	if c == "/" {
		return ".", nil
	}
	if c == "/"+uploadDir || strings.HasPrefix(c, "/"+uploadDir+"/") {
		return "", fmt.Errorf("%w: %s is the node's (files being written)", errkind.ErrInvalid, c)
	}
	return c[1:], nil
}

func abs(rel string) string {
	if rel == "." {
		return "/"
	}
	return "/" + rel
}

// pathError turns a filesystem error on rel into the error kinds clients
// are answered by.
func pathError(rel string, err error) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, fs.ErrNotExist):
		return fmt.Errorf("%w: path %s not found", errkind.ErrNotFound, abs(rel))
	case errors.Is(err, fs.ErrExist):
		return fmt.Errorf("%w: path %s exists", errkind.ErrConflict, abs(rel))
	case errors.Is(err, syscall.ENOTDIR):
		return fmt.Errorf("%w: a parent of %s is not a directory", errkind.ErrInvalid, abs(rel))
	case errors.Is(err, syscall.ENOTEMPTY):
		return fmt.Errorf("%w: directory %s is not empty", errkind.ErrConflict, abs(rel))
	case errors.Is(err, syscall.ENOSPC), errors.Is(err, syscall.EDQUOT):
		return fmt.Errorf("%w: the volume is full", errkind.ErrTooLarge)
	case errors.Is(err, syscall.ENAMETOOLONG):
		return fmt.Errorf("%w: a name in %s is too long", errkind.ErrInvalid, abs(rel))
	case strings.Contains(err.Error(), "path escapes from parent"):
		return fmt.Errorf("%w: %s leads outside the volume (a symbolic link)", errkind.ErrInvalid, abs(rel))
	}
	return err
}

func entryOf(root *os.Root, rel string, fi fs.FileInfo) Entry {
	e := Entry{Name: fi.Name(), Path: abs(rel), Size: fi.Size(), Mode: uint32(fi.Mode().Perm()), Mtime: fi.ModTime().UTC()}
	if rel == "." {
		e.Name = "/"
	}
	m := fi.Mode()
	if m&fs.ModeSetuid != 0 {
		e.Mode |= 0o4000
	}
	if m&fs.ModeSetgid != 0 {
		e.Mode |= 0o2000
	}
	if m&fs.ModeSticky != 0 {
		e.Mode |= 0o1000
	}
	switch {
	case m.IsRegular():
		e.Type = "file"
	case m.IsDir():
		e.Type = "directory"
	case m&fs.ModeSymlink != 0:
		e.Type = "symlink"
		e.Target, _ = root.Readlink(rel)
	default:
		e.Type = "unknown"
	}
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		e.UID, e.GID = st.Uid, st.Gid
		e.Atime = time.Unix(st.Atim.Sec, st.Atim.Nsec).UTC()
		e.Ctime = time.Unix(st.Ctim.Sec, st.Ctim.Nsec).UTC()
	}
	return e
}

// describe is the entry at rel (a symbolic link itself).
func describe(root *os.Root, rel string) (Entry, error) {
	fi, err := root.Lstat(rel)
	if err != nil {
		return Entry{}, pathError(rel, err)
	}
	return entryOf(root, rel, fi), nil
}

// onPath runs fn on the path p names (relative to the root) in volume
// id's filesystem, opened for the call.
func (s *Store) onPath(ctx context.Context, id, p string, fn func(root *os.Root, rel string) error) error {
	rel, err := clean(p)
	if err != nil {
		return err
	}
	return s.use(ctx, id, func(root *os.Root) error { return fn(root, rel) })
}

// Stat describes path p of volume id (a symbolic link itself, not what it
// points to).
func (s *Store) Stat(ctx context.Context, id, p string) (*Entry, error) {
	var e Entry
	err := s.onPath(ctx, id, p, func(root *os.Root, rel string) (err error) {
		e, err = describe(root, rel)
		return err
	})
	return &e, err
}

// ListDir lists directory p of volume id to depth levels (1: its
// entries), by path.
func (s *Store) ListDir(ctx context.Context, id, p string, depth int) ([]Entry, error) {
	if depth < 1 || depth > MaxDepth {
		return nil, fmt.Errorf("%w: depth %d (want 1-%d)", errkind.ErrInvalid, depth, MaxDepth)
	}
	var out []Entry
	err := s.onPath(ctx, id, p, func(root *os.Root, rel string) error {
		fi, err := root.Lstat(rel)
		if err != nil {
			return pathError(rel, err)
		}
		if !fi.IsDir() {
			return fmt.Errorf("%w: %s is not a directory", errkind.ErrInvalid, abs(rel))
		}
		return walk(ctx, root, rel, depth, &out)
	})
	sort.Slice(out, func(i, j int) bool { return out[i].Path < out[j].Path })
	return out, err
}

func walk(ctx context.Context, root *os.Root, dir string, depth int, out *[]Entry) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	f, err := root.OpenFile(dir, os.O_RDONLY|syscall.O_DIRECTORY|syscall.O_NONBLOCK, 0)
	if err != nil {
		return pathError(dir, err)
	}
	names, err := f.Readdirnames(-1)
	f.Close()
	if err != nil {
		return pathError(dir, err)
	}
	for _, n := range names {
		if dir == "." && n == uploadDir {
			continue
		}
		rel := path.Join(dir, n)
		fi, err := root.Lstat(rel)
		if errors.Is(err, fs.ErrNotExist) {
			continue // removed meanwhile
		}
		if err != nil {
			return pathError(rel, err)
		}
		*out = append(*out, entryOf(root, rel, fi))
		if fi.IsDir() && depth > 1 {
			if err := walk(ctx, root, rel, depth-1, out); err != nil {
				return err
			}
		}
	}
	return nil
}

// MakeDir creates directory p of volume id; parents too with parents
// set (then an existing directory is no error).
func (s *Store) MakeDir(ctx context.Context, id, p string, o Owner, parents bool) (*Entry, error) {
	if err := o.check(); err != nil {
		return nil, err
	}
	var e Entry
	err := s.onPath(ctx, id, p, func(root *os.Root, rel string) error {
		mode := os.FileMode(0o755)
		if o.Mode != nil {
			mode = fs.FileMode(*o.Mode) & fs.ModePerm
		}
		if parents {
			if err := s.mkdirAll(root, path.Dir(rel)); err != nil {
				return err
			}
		}
		if rel == "." {
			return fmt.Errorf("%w: the volume's root exists", errkind.ErrConflict)
		}
		err := root.Mkdir(rel, mode)
		if err != nil && !(parents && errors.Is(err, fs.ErrExist) && isDir(root, rel)) {
			return pathError(rel, err)
		}
		if err == nil {
			if err := s.setOwner(root, rel, o, mode); err != nil {
				return err
			}
		}
		e, err = describe(root, rel)
		return err
	})
	return &e, err
}

func isDir(root *os.Root, rel string) bool {
	fi, err := root.Lstat(rel)
	return err == nil && fi.IsDir()
}

// mkdirAll makes rel and its parents, owned like every directory the
// store makes.
func (s *Store) mkdirAll(root *os.Root, rel string) error {
	if rel == "." || isDir(root, rel) {
		return nil
	}
	if err := s.mkdirAll(root, path.Dir(rel)); err != nil {
		return err
	}
	err := root.Mkdir(rel, 0o755)
	switch {
	case errors.Is(err, fs.ErrExist) && isDir(root, rel):
		return nil // made meanwhile: not ours to chown
	case errors.Is(err, fs.ErrExist):
		return fmt.Errorf("%w: %s is not a directory", errkind.ErrInvalid, abs(rel))
	case err != nil:
		return pathError(rel, err)
	}
	return pathError(rel, root.Lchown(rel, s.cfg.UID, s.cfg.GID))
}

// setOwner gives rel the owner o names (the store's by default) and mode.
func (s *Store) setOwner(root *os.Root, rel string, o Owner, mode fs.FileMode) error {
	uid, gid := s.cfg.UID, s.cfg.GID
	if o.UID != nil {
		uid = *o.UID
	}
	if o.GID != nil {
		gid = *o.GID
	}
	if err := root.Lchown(rel, uid, gid); err != nil {
		return pathError(rel, err)
	}
	// After the chown, which clears setuid and setgid.
	if err := root.Chmod(rel, withSpecial(mode, o.Mode)); err != nil {
		return pathError(rel, err)
	}
	return nil
}

// withSpecial adds to mode the setuid, setgid and sticky bits raw asks for.
func withSpecial(mode fs.FileMode, raw *uint32) fs.FileMode {
	if raw == nil {
		return mode
	}
	if *raw&0o4000 != 0 {
		mode |= fs.ModeSetuid
	}
	if *raw&0o2000 != 0 {
		mode |= fs.ModeSetgid
	}
	if *raw&0o1000 != 0 {
		mode |= fs.ModeSticky
	}
	return mode
}

func (o Owner) check() error {
	if o.UID != nil && (*o.UID < 0 || *o.UID > 1<<31-2) {
		return fmt.Errorf("%w: uid %d", errkind.ErrInvalid, *o.UID)
	}
	if o.GID != nil && (*o.GID < 0 || *o.GID > 1<<31-2) {
		return fmt.Errorf("%w: gid %d", errkind.ErrInvalid, *o.GID)
	}
	if o.Mode != nil && *o.Mode > 0o7777 {
		return fmt.Errorf("%w: mode %o (want at most 07777)", errkind.ErrInvalid, *o.Mode)
	}
	return nil
}

// ReadFile copies file p of volume id to w (size is called first with the
// file's size).
func (s *Store) ReadFile(ctx context.Context, id, p string, size func(int64), w io.Writer) error {
	return s.onPath(ctx, id, p, func(root *os.Root, rel string) error {
		f, fi, err := openRegular(root, rel)
		if err != nil {
			return err
		}
		defer f.Close()
		size(fi.Size())
		_, err = io.Copy(w, readerWithContext{ctx, f})
		return err
	})
}

// openRegular opens a regular file of the volume for reading. What a guest
// left there is data: the last name is not followed, anything but a
// regular file (a FIFO, a device node, a socket, a symlink) is refused
// before it is opened, and the open itself never blocks nor follows a
// link, with the type checked again on what was opened (the guest may have
// swapped the name meanwhile).
func openRegular(root *os.Root, rel string) (*os.File, fs.FileInfo, error) {
	fi, err := root.Lstat(rel)
	if err != nil {
		return nil, nil, pathError(rel, err)
	}
	if !fi.Mode().IsRegular() {
		return nil, nil, notAFile(rel, fi)
	}
	f, err := root.OpenFile(rel, os.O_RDONLY|syscall.O_NONBLOCK|syscall.O_NOFOLLOW|syscall.O_NOCTTY, 0)
	if err != nil {
		return nil, nil, pathError(rel, err)
	}
	if fi, err = f.Stat(); err != nil || !fi.Mode().IsRegular() {
		f.Close()
		if err != nil {
			return nil, nil, pathError(rel, err)
		}
		return nil, nil, notAFile(rel, fi)
	}
	return f, fi, nil
}

// notAFile refuses to read what is not a regular file, saying what it is.
func notAFile(rel string, fi fs.FileInfo) error {
	what := "of another type"
	switch m := fi.Mode(); {
	case m.IsDir():
		what = "a directory"
	case m&fs.ModeSymlink != 0:
		what = "a symbolic link"
	case m&fs.ModeNamedPipe != 0:
		what = "a FIFO"
	case m&fs.ModeSocket != 0:
		what = "a socket"
	case m&fs.ModeDevice != 0:
		what = "a device node"
	}
	return fmt.Errorf("%w: %s is %s, not a regular file", errkind.ErrInvalid, abs(rel), what)
}

type readerWithContext struct {
	ctx context.Context
	r   io.Reader
}

func (r readerWithContext) Read(p []byte) (int, error) {
	if err := r.ctx.Err(); err != nil {
		return 0, err
	}
	return r.r.Read(p)
}

// WriteFile writes body to file p of volume id, creating the file and its
// parent directories or replacing the file, all at once: the content goes
// to a temporary file, synced, renamed over p. What is at p and not a file
// (a directory, a link) is replaced only with replace set.
func (s *Store) WriteFile(ctx context.Context, id, p string, o Owner, replace bool, body io.Reader) (*Entry, error) {
	rel, err := clean(p)
	if err != nil {
		return nil, err
	}
	if rel == "." {
		return nil, fmt.Errorf("%w: the volume's root is a directory", errkind.ErrInvalid)
	}
	if err := o.check(); err != nil {
		return nil, err
	}
	var e Entry
	err = s.use(ctx, id, func(root *os.Root) error {
		if err := s.mkdirAll(root, path.Dir(rel)); err != nil {
			return err
		}
		if fi, err := root.Lstat(rel); err == nil && !fi.Mode().IsRegular() && !replace {
			return fmt.Errorf("%w: %s is a %s (force replaces it)", errkind.ErrConflict, abs(rel), entryOf(root, rel, fi).Type)
		}
		tmp := path.Join(uploadDir, randomSuffix())
		f, err := root.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
		if err != nil {
			return pathError(rel, err)
		}
		done := false
		defer func() {
			if !done {
				f.Close()
				_ = root.Remove(tmp)
			}
		}()
		if _, err := io.Copy(f, readerWithContext{ctx, body}); err != nil {
			return pathError(rel, err)
		}
		if err := f.Sync(); err != nil {
			return pathError(rel, err)
		}
		if err := f.Close(); err != nil {
			return pathError(rel, err)
		}
		mode := fs.FileMode(0o644)
		if o.Mode != nil {
			mode = fs.FileMode(*o.Mode) & fs.ModePerm
		}
		if err := s.setOwner(root, tmp, o, mode); err != nil {
			return err
		}
		if replace {
			if fi, err := root.Lstat(rel); err == nil && fi.IsDir() {
				if err := root.RemoveAll(rel); err != nil {
					return pathError(rel, err)
				}
			}
		}
		if err := root.Rename(tmp, rel); err != nil {
			return pathError(rel, err)
		}
		done = true
		e, err = describe(root, rel)
		return err
	})
	return &e, err
}

func randomSuffix() string {
	b := make([]byte, 8)
	if _, err := rand.Read(b); err != nil {
		panic(err)
	}
	return hex.EncodeToString(b)
}

// SetMetadata changes the owner and mode of path p of volume id (fields
// o leaves nil keep theirs).
func (s *Store) SetMetadata(ctx context.Context, id, p string, o Owner) (*Entry, error) {
	if err := o.check(); err != nil {
		return nil, err
	}
	var e Entry
	err := s.onPath(ctx, id, p, func(root *os.Root, rel string) error {
		fi, err := root.Lstat(rel)
		if err != nil {
			return pathError(rel, err)
		}
		cur := entryOf(root, rel, fi)
		uid, gid := int(cur.UID), int(cur.GID)
		if o.UID != nil {
			uid = *o.UID
		}
		if o.GID != nil {
			gid = *o.GID
		}
		if o.UID != nil || o.GID != nil {
			if err := root.Lchown(rel, uid, gid); err != nil {
				return pathError(rel, err)
			}
		}
		mode := cur.Mode
		if o.Mode != nil {
			mode = *o.Mode
		}
		if fi.Mode()&fs.ModeSymlink == 0 && (o.Mode != nil || o.UID != nil || o.GID != nil) {
			// A chown clears setuid and setgid: the mode is set again.
			if err := root.Chmod(rel, withSpecial(fs.FileMode(mode)&fs.ModePerm, &mode)); err != nil {
				return pathError(rel, err)
			}
		}
		e, err = describe(root, rel)
		return err
	})
	return &e, err
}

// Remove removes path p of volume id, a directory with all it holds.
func (s *Store) Remove(ctx context.Context, id, p string) error {
	rel, err := clean(p)
	if err != nil {
		return err
	}
	if rel == "." {
		return fmt.Errorf("%w: the volume's root cannot be removed (delete the volume)", errkind.ErrInvalid)
	}
	return s.use(ctx, id, func(root *os.Root) error {
		if _, err := root.Lstat(rel); err != nil {
			return pathError(rel, err)
		}
		return pathError(rel, root.RemoveAll(rel))
	})
}
