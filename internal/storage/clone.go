package storage

import (
	"errors"
	"fmt"
	"io"
	"os"

	"golang.org/x/sys/unix"
)

// CloneFile makes out a copy of src: a reflink (instant, shared extents) on
// filesystems that support it (XFS, btrfs), otherwise a copy of the data
// extents only, keeping holes, so a sparse guest RAM image stays sparse.
func CloneFile(src, out string) (reflinked bool, err error) {
	in, err := os.Open(src)
	if err != nil {
		return false, err
	}
	defer in.Close()
	info, err := in.Stat()
	if err != nil {
		return false, err
	}
	dst, err := os.OpenFile(out, os.O_RDWR|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return false, err
	}
	defer dst.Close()
	if unix.IoctlFileClone(int(dst.Fd()), int(in.Fd())) == nil {
		return true, dst.Close()
	}
	if err := dst.Truncate(info.Size()); err != nil {
		return false, err
	}
	var off int64
	for off < info.Size() {
		data, err := unix.Seek(int(in.Fd()), off, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) {
			break // only holes remain
		}
		if err != nil {
			return false, fmt.Errorf("seek data in %s: %w", src, err)
		}
		hole, err := unix.Seek(int(in.Fd()), data, unix.SEEK_HOLE)
		if err != nil {
			return false, fmt.Errorf("seek hole in %s: %w", src, err)
		}
		if err := copyRange(in, dst, data, hole-data); err != nil {
			return false, fmt.Errorf("copy %s: %w", src, err)
		}
		off = hole
	}
	return false, dst.Close()
}

// copyRange copies n bytes at off from in to the same offset in out, in the
// kernel (copy_file_range) when it can.
func copyRange(in, out *os.File, off, n int64) error {
	for n > 0 {
		roff, woff := off, off
		c, err := unix.CopyFileRange(int(in.Fd()), &roff, int(out.Fd()), &woff, int(min(n, 1<<30)), 0)
		if err != nil || c == 0 {
			// Fall back to a plain copy for what is left.
			_, err := io.Copy(io.NewOffsetWriter(out, off), io.NewSectionReader(in, off, n))
			return err
		}
		off += int64(c)
		n -= int64(c)
	}
	return nil
}
