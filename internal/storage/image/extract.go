package image

import (
	"archive/tar"
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"strings"

	"golang.org/x/sys/unix"
)

// applyLayer applies one OCI layer (an uncompressed tar stream) to the
// filesystem tree at root: entries are created or replaced, `.wh.NAME`
// whiteouts delete NAME from the layers below, and `.wh..wh..opq` empties a
// directory of what the layers below put there. Every path is resolved
// inside root (openat2 with RESOLVE_IN_ROOT), so a layer's symlinks can never
// make it write outside the tree.
func applyLayer(root string, r io.Reader) error {
	rootFD, err := unix.Open(root, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("open layer root: %w", err)
	}
	defer unix.Close(rootFD)
	x := &extractor{root: rootFD, written: map[string]bool{}}
	tr := tar.NewReader(r)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("read layer: %w", err)
		}
		if err := x.entry(h, tr); err != nil {
			return fmt.Errorf("layer entry %q: %w", h.Name, err)
		}
	}
}

type extractor struct {
	root    int
	written map[string]bool // paths this layer created (opaque whiteouts spare them)
}

// clean turns a tar name into a relative path inside the tree ("" for the
// root itself).
func clean(name string) string {
	return strings.TrimPrefix(path.Clean("/"+name), "/")
}

// openDir resolves dir inside the tree (symlinks on the way resolve as if
// the tree were /), creating missing directories.
func (x *extractor) openDir(dir string) (int, error) {
	if dir == "" {
		return unix.Dup(x.root)
	}
	how := &unix.OpenHow{
		Flags:   unix.O_PATH | unix.O_DIRECTORY | unix.O_CLOEXEC,
		Resolve: unix.RESOLVE_IN_ROOT | unix.RESOLVE_NO_MAGICLINKS,
	}
	fd, err := unix.Openat2(x.root, dir, how)
	if err == nil || !errors.Is(err, unix.ENOENT) {
		if err != nil {
			return -1, fmt.Errorf("directory %s: %w", dir, err)
		}
		return fd, nil
	}
	parent, base := path.Split(dir)
	pfd, err := x.openDir(strings.TrimSuffix(parent, "/"))
	if err != nil {
		return -1, err
	}
	defer unix.Close(pfd)
	if err := unix.Mkdirat(pfd, base, 0o755); err != nil && !errors.Is(err, unix.EEXIST) {
		return -1, fmt.Errorf("directory %s: %w", dir, err)
	}
	fd, err = unix.Openat2(x.root, dir, how)
	if err != nil {
		return -1, fmt.Errorf("directory %s: %w", dir, err)
	}
	return fd, nil
}

// fdPath names an entry of an opened directory for calls that take paths.
func fdPath(dirFD int, name string) string {
	return fmt.Sprintf("/proc/self/fd/%d/%s", dirFD, name)
}

func (x *extractor) entry(h *tar.Header, r io.Reader) error {
	name := clean(h.Name)
	if name == "" {
		return nil // the root's own attributes are the base filesystem's
	}
	dir, base := path.Split(name)
	dir = strings.TrimSuffix(dir, "/")
	dfd, err := x.openDir(dir)
	if err != nil {
		return err
	}
	defer unix.Close(dfd)

	switch {
	case base == ".wh..wh..opq":
		return x.opaque(dfd, dir)
	case strings.HasPrefix(base, ".wh."):
		return removeAll(dfd, strings.TrimPrefix(base, ".wh."))
	}
	x.written[name] = true

	// Replace what is there unless both are directories.
	var st unix.Stat_t
	if err := unix.Fstatat(dfd, base, &st, unix.AT_SYMLINK_NOFOLLOW); err == nil {
		if !(h.Typeflag == tar.TypeDir && st.Mode&unix.S_IFMT == unix.S_IFDIR) {
			if err := removeAll(dfd, base); err != nil {
				return err
			}
		}
	}
	mode := uint32(h.Mode & 0o7777)
	switch h.Typeflag {
	case tar.TypeDir:
		if err := unix.Mkdirat(dfd, base, 0o700); err != nil && !errors.Is(err, unix.EEXIST) {
			return err
		}
	case tar.TypeReg: // (the reader turns old TypeRegA entries into TypeReg)
		fd, err := unix.Openat(dfd, base, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
		if err != nil {
			return err
		}
		f := os.NewFile(uintptr(fd), base)
		_, err = io.Copy(f, r)
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return err
		}
	case tar.TypeSymlink:
		if err := unix.Symlinkat(h.Linkname, dfd, base); err != nil {
			return err
		}
	case tar.TypeLink:
		target := clean(h.Linkname)
		tdir, tbase := path.Split(target)
		tfd, err := x.openDir(strings.TrimSuffix(tdir, "/"))
		if err != nil {
			return err
		}
		err = unix.Linkat(tfd, tbase, dfd, base, 0)
		unix.Close(tfd)
		return err // a hard link shares the target's attributes
	case tar.TypeChar, tar.TypeBlock, tar.TypeFifo:
		kind := map[byte]uint32{tar.TypeChar: unix.S_IFCHR, tar.TypeBlock: unix.S_IFBLK, tar.TypeFifo: unix.S_IFIFO}[h.Typeflag]
		dev := unix.Mkdev(uint32(h.Devmajor), uint32(h.Devminor))
		if err := unix.Mknodat(dfd, base, kind|0o600, int(dev)); err != nil {
			return err
		}
	default:
		return nil // pax globals and the like carry no file
	}
	if err := unix.Fchownat(dfd, base, h.Uid, h.Gid, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return err
	}
	for k, v := range h.PAXRecords {
		if attr, ok := strings.CutPrefix(k, "SCHILY.xattr."); ok {
			if err := unix.Lsetxattr(fdPath(dfd, base), attr, []byte(v), 0); err != nil && !errors.Is(err, unix.ENOTSUP) {
				return fmt.Errorf("xattr %s: %w", attr, err)
			}
		}
	}
	if h.Typeflag != tar.TypeSymlink {
		if err := unix.Fchmodat(dfd, base, mode, 0); err != nil {
			return err
		}
	}
	ts := []unix.Timespec{unix.NsecToTimespec(h.AccessTime.UnixNano()), unix.NsecToTimespec(h.ModTime.UnixNano())}
	if h.AccessTime.IsZero() {
		ts[0] = ts[1]
	}
	return unix.UtimesNanoAt(dfd, base, ts, unix.AT_SYMLINK_NOFOLLOW)
}

// opaque empties dir of entries from lower layers.
func (x *extractor) opaque(dfd int, dir string) error {
	f, err := os.Open(fdPath(dfd, "."))
	if err != nil {
		return err
	}
	names, err := f.Readdirnames(-1)
	f.Close()
	if err != nil {
		return err
	}
	for _, n := range names {
		if !x.written[path.Join(dir, n)] {
			if err := removeAll(dfd, n); err != nil {
				return err
			}
		}
	}
	return nil
}

// removeAll deletes name in the directory dfd, recursively, without
// following symlinks.
func removeAll(dfd int, name string) error {
	if name == "" || name == "." || name == ".." || strings.Contains(name, "/") {
		return fmt.Errorf("bad whiteout name %q", name)
	}
	err := os.RemoveAll(fdPath(dfd, name))
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	return err
}

// ApplyTar applies a tar stream to the tree at root with the same rules as
// an image layer (see applyLayer).
func ApplyTar(root string, r io.Reader) error { return applyLayer(root, r) }

// ReadFileInRoot reads a file of the tree at root, resolving its path (and
// any symlinks on the way) inside root.
func ReadFileInRoot(root, name string) ([]byte, error) {
	f, err := OpenInRoot(root, name)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return io.ReadAll(io.LimitReader(f, 16<<20))
}

// OpenInRoot opens a file of the tree at root for reading, resolving its
// path (and any symlinks on the way) inside root.
func OpenInRoot(root, name string) (*os.File, error) {
	rootFD, err := unix.Open(root, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	defer unix.Close(rootFD)
	fd, err := unix.Openat2(rootFD, clean(name), &unix.OpenHow{
		Flags:   unix.O_RDONLY | unix.O_CLOEXEC,
		Resolve: unix.RESOLVE_IN_ROOT | unix.RESOLVE_NO_MAGICLINKS,
	})
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: name, Err: err}
	}
	return os.NewFile(uintptr(fd), name), nil
}
