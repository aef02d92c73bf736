package guest

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"strconv"
)

// File type bits of a newc (SVR4, magic 070701) cpio header.
const (
	cpioTypeDir     = 0o040000
	cpioTypeReg     = 0o100000
	cpioTypeSymlink = 0o120000
	cpioTypeChar    = 0o020000
)

const newcTrailer = "TRAILER!!!"

// newcEntry is one member of a newc cpio archive. Times are always 0 and
// owners root so that archives are reproducible.
type newcEntry struct {
	Name      string // path without a leading slash, e.g. "lib/aenv"
	Mode      uint32 // type and permission bits (cpioType* | perm)
	Data      []byte // contents of a regular file, target of a symlink
	RdevMajor uint32
	RdevMinor uint32
}

// newcWriter writes a newc ("070701", no checksums) cpio archive, the format
// the Linux kernel unpacks as an initramfs. Inode numbers are assigned
// sequentially, so the output depends only on the entries written.
type newcWriter struct {
	w     *bufio.Writer
	ino   uint32
	n     int64
	done  bool
	names map[string]bool
}

func newNewcWriter(w io.Writer) *newcWriter {
	return &newcWriter{w: bufio.NewWriterSize(w, 1<<16), names: map[string]bool{}}
}

func (cw *newcWriter) write(p []byte) error {
	n, err := cw.w.Write(p)
	cw.n += int64(n)
	return err
}

func (cw *newcWriter) pad() error {
	if r := cw.n % 4; r != 0 {
		return cw.write(make([]byte, 4-r))
	}
	return nil
}

func (cw *newcWriter) header(name string, mode uint32, nlink uint32, size int, major, minor uint32) error {
	cw.ino++
	fields := []uint32{
		cw.ino, mode, 0 /*uid*/, 0 /*gid*/, nlink, 0, /*mtime*/
		uint32(size), 0, 0 /*dev major/minor*/, major, minor,
		uint32(len(name) + 1), 0, /*check*/
	}
	hdr := make([]byte, 0, 110)
	hdr = append(hdr, "070701"...)
	for _, f := range fields {
		hdr = append(hdr, fmt.Sprintf("%08X", f)...)
	}
	if err := cw.write(hdr); err != nil {
		return err
	}
	if err := cw.write(append([]byte(name), 0)); err != nil {
		return err
	}
	return cw.pad()
}

// Add writes one entry.
func (cw *newcWriter) Add(e newcEntry) error {
	if cw.done {
		return errors.New("cpio: write after close")
	}
	if e.Name == "" || e.Name[0] == '/' {
		return fmt.Errorf("cpio: bad entry name %q", e.Name)
	}
	if cw.names[e.Name] {
		return fmt.Errorf("cpio: duplicate entry %q", e.Name)
	}
	cw.names[e.Name] = true
	nlink := uint32(1)
	size := 0
	switch e.Mode &^ 0o7777 {
	case cpioTypeDir:
		nlink = 2
	case cpioTypeReg, cpioTypeSymlink:
		size = len(e.Data)
	case cpioTypeChar:
	default:
		return fmt.Errorf("cpio: %s: unsupported mode %o", e.Name, e.Mode)
	}
	if err := cw.header(e.Name, e.Mode, nlink, size, e.RdevMajor, e.RdevMinor); err != nil {
		return err
	}
	if size > 0 {
		if err := cw.write(e.Data); err != nil {
			return err
		}
		return cw.pad()
	}
	return nil
}

// Close writes the trailer and flushes; it does not close the underlying writer.
func (cw *newcWriter) Close() error {
	if cw.done {
		return nil
	}
	cw.done = true
	cw.ino = 0
	if err := cw.header(newcTrailer, 0, 1, 0, 0, 0); err != nil {
		return err
	}
	return cw.w.Flush()
}

// readNewc parses a newc archive (used by tests and for inspection).
func readNewc(r io.Reader) ([]newcEntry, error) {
	br := bufio.NewReader(r)
	var off int64
	read := func(n int) ([]byte, error) {
		b := make([]byte, n)
		_, err := io.ReadFull(br, b)
		off += int64(n)
		return b, err
	}
	skipPad := func() error {
		if rem := off % 4; rem != 0 {
			_, err := read(int(4 - rem))
			return err
		}
		return nil
	}
	var out []newcEntry
	for {
		hdr, err := read(110)
		if err != nil {
			return nil, fmt.Errorf("cpio: header at %d: %w", off, err)
		}
		if string(hdr[:6]) != "070701" {
			return nil, fmt.Errorf("cpio: bad magic %q at %d", hdr[:6], off-110)
		}
		field := func(i int) (uint32, error) {
			v, err := strconv.ParseUint(string(hdr[6+8*i:14+8*i]), 16, 32)
			return uint32(v), err
		}
		var f [13]uint32
		for i := range f {
			if f[i], err = field(i); err != nil {
				return nil, fmt.Errorf("cpio: bad header field: %w", err)
			}
		}
		nameb, err := read(int(f[11]))
		if err != nil {
			return nil, err
		}
		name := string(nameb[:len(nameb)-1])
		if err := skipPad(); err != nil {
			return nil, err
		}
		if name == newcTrailer {
			return out, nil
		}
		data, err := read(int(f[6]))
		if err != nil {
			return nil, err
		}
		if err := skipPad(); err != nil {
			return nil, err
		}
		out = append(out, newcEntry{Name: name, Mode: f[1], Data: data, RdevMajor: f[9], RdevMinor: f[10]})
	}
}
