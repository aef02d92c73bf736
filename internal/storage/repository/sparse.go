package repository

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"hash"
	"io"
	"os"

	"golang.org/x/sys/unix"
)

const (
	// zeroBlock is the granularity at which all-zero data is treated as a
	// hole: not written to local files, not uploaded by oss. Blocks are
	// aligned to absolute file offsets.
	zeroBlock = 64 << 10
	// ioChunk is the read/write buffer size.
	ioChunk = 1 << 20
)

var zeroChunk = make([]byte, ioChunk)

// hashZeros feeds n zero bytes to h (nil: nothing).
func hashZeros(h hash.Hash, n int64) {
	if h == nil {
		return
	}
	for n > 0 {
		k := min(n, int64(len(zeroChunk)))
		h.Write(zeroChunk[:k])
		n -= k
	}
}

// nextData returns the next data region [start, end) of f at or after off,
// using SEEK_DATA/SEEK_HOLE; on file systems without them everything is data.
// start == size means no data remains.
func nextData(f *os.File, off, size int64) (int64, int64, error) {
	fd := int(f.Fd())
	start, err := unix.Seek(fd, off, unix.SEEK_DATA)
	if err != nil {
		if errors.Is(err, unix.ENXIO) {
			return size, size, nil
		}
		if errors.Is(err, unix.EINVAL) || errors.Is(err, unix.EOPNOTSUPP) {
			return off, size, nil
		}
		return 0, 0, fmt.Errorf("seek data in %s: %w", f.Name(), err)
	}
	end, err := unix.Seek(fd, start, unix.SEEK_HOLE)
	if err != nil {
		end = size
	}
	return min(start, size), min(end, size), nil
}

// forEachDataRun calls fn for every maximal run of p (which starts at file
// offset off) made of zeroBlock-aligned pieces that are not all zero.
func forEachDataRun(off int64, p []byte, fn func(off int64, run []byte) error) error {
	runStart := -1
	for i := 0; i < len(p); {
		end := i + int(zeroBlock-(off+int64(i))%zeroBlock)
		end = min(end, len(p))
		if bytes.Equal(p[i:end], zeroChunk[:end-i]) {
			if runStart >= 0 {
				if err := fn(off+int64(runStart), p[runStart:i]); err != nil {
					return err
				}
				runStart = -1
			}
		} else if runStart < 0 {
			runStart = i
		}
		i = end
	}
	if runStart >= 0 {
		return fn(off+int64(runStart), p[runStart:])
	}
	return nil
}

// scanFile reads the first size bytes of f in order. Holes (SEEK_HOLE) and
// all-zero blocks are skipped; emit is called, in increasing offset order,
// with the remaining data (p is only valid during the call; adjacent calls
// may continue the same run). If h is not nil the whole logical content,
// zeros included, is written to it. A file shorter than size is an error.
func scanFile(ctx context.Context, f *os.File, size int64, h hash.Hash, emit func(off int64, p []byte) error) error {
	buf := make([]byte, ioChunk)
	var off int64
	for off < size {
		start, end, err := nextData(f, off, size)
		if err != nil {
			return err
		}
		hashZeros(h, start-off)
		off = start
		for off < end {
			if err := ctx.Err(); err != nil {
				return err
			}
			n := int(min(int64(len(buf)), end-off))
			if _, err := f.ReadAt(buf[:n], off); err != nil {
				if errors.Is(err, io.EOF) {
					return fmt.Errorf("read %s: file shrank while being read (at %d of %d bytes)", f.Name(), off, size)
				}
				return fmt.Errorf("read %s: %w", f.Name(), err)
			}
			if h != nil {
				h.Write(buf[:n])
			}
			if err := forEachDataRun(off, buf[:n], emit); err != nil {
				return err
			}
			off += int64(n)
		}
	}
	return nil
}

// sparseWriter writes a logical byte stream into a new (empty) file, leaving
// holes where the stream has all-zero blocks, and hashes the stream.
type sparseWriter struct {
	f   *os.File
	off int64
	h   hash.Hash
}

func (w *sparseWriter) Write(p []byte) (int, error) {
	if w.h != nil {
		w.h.Write(p)
	}
	err := forEachDataRun(w.off, p, func(off int64, run []byte) error {
		_, err := w.f.WriteAt(run, off)
		return err
	})
	if err != nil {
		return 0, fmt.Errorf("write %s: %w", w.f.Name(), err)
	}
	w.off += int64(len(p))
	return len(p), nil
}

// skipTo advances the stream to off with zeros (a hole).
func (w *sparseWriter) skipTo(off int64) {
	if off > w.off {
		hashZeros(w.h, off-w.off)
		w.off = off
	}
}

// finish sets the file's size to the stream length and syncs it.
func (w *sparseWriter) finish() error {
	if err := w.f.Truncate(w.off); err != nil {
		return fmt.Errorf("truncate %s: %w", w.f.Name(), err)
	}
	if err := w.f.Sync(); err != nil {
		return fmt.Errorf("fsync %s: %w", w.f.Name(), err)
	}
	return nil
}

// onlyReader hides WriterTo/ReaderFrom so io.CopyBuffer uses our buffer.
type onlyReader struct{ io.Reader }

// syncDir fsyncs a directory so renames and creations in it are durable.
func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("fsync dir: %w", err)
	}
	defer d.Close()
	if err := d.Sync(); err != nil {
		return fmt.Errorf("fsync dir %s: %w", dir, err)
	}
	return nil
}

// inputFiles lists the files of a Put source directory: regular files only,
// valid names, sorted.
func inputFiles(dir string) ([]string, error) {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("read source dir: %w", err)
	}
	var names []string
	for _, e := range ents {
		if !e.Type().IsRegular() {
			return nil, fmt.Errorf("source dir %s: %q is not a regular file (artifacts are flat sets of regular files)", dir, e.Name())
		}
		if err := validFileName(e.Name()); err != nil {
			return nil, fmt.Errorf("source dir %s: %w", dir, err)
		}
		names = append(names, e.Name())
	}
	if len(names) == 0 {
		return nil, fmt.Errorf("source dir %s has no files", dir)
	}
	return names, nil
}
