package vmm

import (
	"bufio"
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"sort"
	"syscall"
)

// An incremental memory snapshot is QEMU's own migration stream with the
// pages of guest RAM that still equal a base image left out. Loaded into a
// machine whose RAM maps that base image, it restores the exact machine: the
// pages the stream carries are written over the mapping, the others keep the
// base's contents. QEMU 7.2 has no way to save only changed RAM, so the full
// stream is read from a socket and rewritten on the fly (ramDiffWriter).
//
// The stream format (QEMU's migration/savevm.c and migration/ram.c): a
// "QEVM" magic and version, a configuration section, then sections. "ram"
// is the one iterative section: its START carries the list of RAM blocks
// and each START, PART and END section carries page records ending in an
// EOS record. Every other device state follows in FULL sections, which have
// no length prefix; they are copied through unparsed, as is everything
// after them, so only the RAM records need to be understood.

// Migration stream constants (QEMU migration/savevm.c, migration/ram.c).
const (
	migMagic   = 0x5145564d // "QEVM"
	migVersion = 3

	secEOF           = 0x00
	secStart         = 0x01
	secPart          = 0x02
	secEnd           = 0x03
	secFull          = 0x04
	secSubsection    = 0x05
	secConfiguration = 0x07
	secCommand       = 0x08 // QEMU_VM_COMMAND: be16 command, be16 length, data (QEMU 8 and later send some in a save)
	secFooter        = 0x7e

	ramFlagZero     = 0x002
	ramFlagMemSize  = 0x004
	ramFlagPage     = 0x008
	ramFlagEOS      = 0x010
	ramFlagContinue = 0x020
	ramFlagMask     = 0xfff // flags live in the low bits of a page-aligned offset

	guestPageSize = 4096
)

// ramBlockName is QEMU's name for the RAM block of the memory backend
// holding guest RAM (its object id in Config's arguments).
const ramBlockName = "mem"

// RAMDiffStats describes an incremental memory snapshot.
type RAMDiffStats struct {
	// PagesSent is how many pages of guest RAM QEMU sent (zero pages
	// included); PagesKept how many of them differ from the base and were
	// written.
	PagesSent, PagesKept int64
	// Bytes is the size of the written stream, SHA256 its checksum (hex;
	// empty where the writer leaves hashing to its caller).
	Bytes  int64
	SHA256 string
}

// baseImage is the read-only RAM image pages are compared with.
type baseImage struct {
	data  []byte     // the file, mapped read-only
	holes [][2]int64 // sorted [start, end) ranges known to read as zeros
}

func openBaseImage(path string) (*baseImage, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("open base RAM image: %w", err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, err
	}
	b := &baseImage{}
	if st.Size() > 0 {
		b.data, err = syscall.Mmap(int(f.Fd()), 0, int(st.Size()), syscall.PROT_READ, syscall.MAP_SHARED)
		if err != nil {
			return nil, fmt.Errorf("map base RAM image: %w", err)
		}
	}
	// Holes read as zeros without touching (and caching) their pages.
	const seekData, seekHole = 3, 4
	for off := int64(0); off < st.Size(); {
		data, err := f.Seek(off, seekData)
		if err != nil {
			data = st.Size() // ENXIO: no data after off
		}
		if data > off {
			b.holes = append(b.holes, [2]int64{off, data})
		}
		if data >= st.Size() {
			break
		}
		hole, err := f.Seek(data, seekHole)
		if err != nil {
			break
		}
		off = hole
	}
	return b, nil
}

func (b *baseImage) close() {
	if b.data != nil {
		_ = syscall.Munmap(b.data)
		b.data = nil
	}
}

// inHole reports whether the page at off lies in a hole.
func (b *baseImage) inHole(off int64) bool {
	i := sort.Search(len(b.holes), func(i int) bool { return b.holes[i][1] > off })
	return i < len(b.holes) && b.holes[i][0] <= off && off+guestPageSize <= b.holes[i][1]
}

var zeroPage [guestPageSize]byte

// equal reports whether page (nil: a zero page) equals the base at off.
func (b *baseImage) equal(off int64, page []byte) bool {
	if off < 0 || off+guestPageSize > int64(len(b.data)) {
		// Past the image's end the base reads as zeros.
		return page == nil || bytes.Equal(page, zeroPage[:])
	}
	if b.inHole(off) {
		return page == nil
	}
	base := b.data[off : off+guestPageSize]
	if page == nil {
		return bytes.Equal(base, zeroPage[:])
	}
	return bytes.Equal(base, page)
}

// ramDiffWriter copies a migration stream from src to dst, leaving out the
// pages of the RAM block named block that equal base.
type ramDiffWriter struct {
	src   *bufio.Reader
	dst   *bufio.Writer
	block string
	base  *baseImage

	ignoreShared  bool   // the x-ignore-shared capability is on
	ramSection    uint32 // section id of "ram"
	haveRAM       bool
	lastReadBlock string // block of the previous record read (for CONTINUE)
	lastEmitted   string // block of the previous record written
	stats         RAMDiffStats
	scratch       [guestPageSize]byte
}

var errStream = errors.New("unexpected migration stream")

func streamErr(format string, a ...any) error {
	return fmt.Errorf("%w: %s", errStream, fmt.Sprintf(format, a...))
}

// filterRAMDiff runs the copy; it returns once src is exhausted.
func filterRAMDiff(dst io.Writer, src io.Reader, block string, base *baseImage) (RAMDiffStats, error) {
	sum := sha256.New()
	cw := &countingWriter{w: io.MultiWriter(dst, sum)}
	w := &ramDiffWriter{src: bufio.NewReaderSize(src, 1<<20), dst: bufio.NewWriterSize(cw, 1<<20), block: block, base: base}
	err := w.run()
	if ferr := w.dst.Flush(); err == nil {
		err = ferr
	}
	w.stats.Bytes, w.stats.SHA256 = cw.n, hex.EncodeToString(sum.Sum(nil))
	return w.stats, err
}

type countingWriter struct {
	w io.Writer
	n int64
}

func (c *countingWriter) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	c.n += int64(n)
	return n, err
}

func (w *ramDiffWriter) run() error {
	var hdr [8]byte
	if _, err := io.ReadFull(w.src, hdr[:]); err != nil {
		return streamErr("header: %v", err)
	}
	if binary.BigEndian.Uint32(hdr[:4]) != migMagic || binary.BigEndian.Uint32(hdr[4:]) != migVersion {
		return streamErr("bad magic or version %x", hdr)
	}
	w.dst.Write(hdr[:])
	for {
		typ, err := w.copyByte()
		if err != nil {
			return streamErr("section type: %v", err)
		}
		switch typ {
		case secConfiguration:
			if err := w.configuration(); err != nil {
				return err
			}
		case secStart:
			id, name, err := w.sectionHeader(true)
			if err != nil {
				return err
			}
			if name != "ram" {
				return streamErr("iterative section %q is not supported", name)
			}
			w.ramSection, w.haveRAM = id, true
			if err := w.ramRecords(); err != nil {
				return err
			}
		case secPart, secEnd:
			id, _, err := w.sectionHeader(false)
			if err != nil {
				return err
			}
			if !w.haveRAM || id != w.ramSection {
				return streamErr("section %d is not ram", id)
			}
			if err := w.ramRecords(); err != nil {
				return err
			}
		case secCommand:
			var h [4]byte
			if _, err := io.ReadFull(w.src, h[:]); err != nil {
				return streamErr("command: %v", err)
			}
			w.dst.Write(h[:])
			if err := w.copyN(int64(binary.BigEndian.Uint16(h[2:]))); err != nil {
				return streamErr("command %d: %v", binary.BigEndian.Uint16(h[:2]), err)
			}
		case secFull, secEOF:
			// Device state (no lengths to parse by) and the trailing
			// description: copied as they are.
			_, err := io.Copy(w.dst, w.src)
			return err
		default:
			return streamErr("section type %#x", typ)
		}
		// Each section may be followed by a footer repeating its id.
		if b, err := w.src.Peek(1); err == nil && b[0] == secFooter {
			if err := w.copyN(5); err != nil {
				return streamErr("footer: %v", err)
			}
		}
	}
}

func (w *ramDiffWriter) copyByte() (byte, error) {
	b, err := w.src.ReadByte()
	if err != nil {
		return 0, err
	}
	return b, w.dst.WriteByte(b)
}

func (w *ramDiffWriter) copyN(n int64) error {
	_, err := io.CopyN(w.dst, w.src, n)
	return err
}

func (w *ramDiffWriter) readBE32(copy bool) (uint32, error) {
	var b [4]byte
	if _, err := io.ReadFull(w.src, b[:]); err != nil {
		return 0, err
	}
	if copy {
		w.dst.Write(b[:])
	}
	return binary.BigEndian.Uint32(b[:]), nil
}

// readString reads a length-prefixed (one byte) string.
func (w *ramDiffWriter) readString(copy bool) (string, error) {
	n, err := w.src.ReadByte()
	if err != nil {
		return "", err
	}
	b := make([]byte, n)
	if _, err := io.ReadFull(w.src, b); err != nil {
		return "", err
	}
	if copy {
		w.dst.WriteByte(n)
		w.dst.Write(b)
	}
	return string(b), nil
}

// configuration copies the configuration section: the machine type and the
// subsections QEMU 7.2 may add (capabilities to validate, page bits, uuid).
func (w *ramDiffWriter) configuration() error {
	n, err := w.readBE32(true)
	if err != nil || n > 256 {
		return streamErr("configuration name: %v", err)
	}
	if err := w.copyN(int64(n)); err != nil {
		return streamErr("configuration name: %v", err)
	}
	for {
		b, err := w.src.Peek(1)
		if err != nil || b[0] != secSubsection {
			return nil
		}
		w.copyByte()
		name, err := w.readString(true)
		if err != nil {
			return streamErr("configuration subsection: %v", err)
		}
		if _, err := w.readBE32(true); err != nil { // version
			return streamErr("configuration subsection %s: %v", name, err)
		}
		switch name {
		case "configuration/capabilities":
			count, err := w.readBE32(true)
			if err != nil || count > 64 {
				return streamErr("capabilities: %v", err)
			}
			for i := uint32(0); i < count; i++ {
				c, err := w.readString(true)
				if err != nil {
					return streamErr("capabilities: %v", err)
				}
				if c == "x-ignore-shared" {
					w.ignoreShared = true
				}
			}
		case "configuration/target-page-bits":
			bits, err := w.readBE32(true)
			if err != nil || bits != 12 {
				return streamErr("target page bits %d: %v", bits, err)
			}
		case "configuration/uuid":
			if err := w.copyN(16); err != nil {
				return streamErr("uuid: %v", err)
			}
		default:
			return streamErr("configuration subsection %q", name)
		}
	}
}

// sectionHeader reads a section's id and, for START and FULL (full), its
// name, instance and version.
func (w *ramDiffWriter) sectionHeader(full bool) (uint32, string, error) {
	id, err := w.readBE32(true)
	if err != nil {
		return 0, "", streamErr("section id: %v", err)
	}
	if !full {
		return id, "", nil
	}
	name, err := w.readString(true)
	if err != nil {
		return 0, "", streamErr("section name: %v", err)
	}
	if err := w.copyN(8); err != nil { // instance id, version
		return 0, "", streamErr("section %s: %v", name, err)
	}
	return id, name, nil
}

// ramRecords rewrites the RAM records of one section, up to its EOS.
func (w *ramDiffWriter) ramRecords() error {
	// A section's first written record always names its block.
	w.lastEmitted = ""
	var hdr [8]byte
	for {
		if _, err := io.ReadFull(w.src, hdr[:]); err != nil {
			return streamErr("ram record: %v", err)
		}
		v := binary.BigEndian.Uint64(hdr[:])
		flags, addr := v&ramFlagMask, v&^uint64(ramFlagMask)
		switch {
		case flags == ramFlagEOS:
			w.dst.Write(hdr[:])
			return nil
		case flags&ramFlagMemSize != 0:
			w.dst.Write(hdr[:])
			if err := w.blockList(addr); err != nil {
				return err
			}
		case flags&^ramFlagContinue == ramFlagZero || flags&^ramFlagContinue == ramFlagPage:
			if err := w.page(flags, addr); err != nil {
				return err
			}
		default:
			return streamErr("ram record flags %#x are not supported", flags)
		}
	}
}

// blockList copies the list of RAM blocks that follows a MEM_SIZE record.
func (w *ramDiffWriter) blockList(total uint64) error {
	var sum uint64
	for sum < total {
		name, err := w.readString(true)
		if err != nil {
			return streamErr("ram block list: %v", err)
		}
		var b [8]byte
		if _, err := io.ReadFull(w.src, b[:]); err != nil {
			return streamErr("ram block %s: %v", name, err)
		}
		w.dst.Write(b[:])
		sum += binary.BigEndian.Uint64(b[:])
		if w.ignoreShared { // the block's guest address follows
			if err := w.copyN(8); err != nil {
				return streamErr("ram block %s: %v", name, err)
			}
		}
	}
	if sum != total {
		return streamErr("ram blocks add up to %d, not %d", sum, total)
	}
	return nil
}

// page reads one page record and writes it unless it equals the base.
func (w *ramDiffWriter) page(flags, addr uint64) error {
	block := w.lastReadBlock
	if flags&ramFlagContinue == 0 {
		name, err := w.readString(false)
		if err != nil {
			return streamErr("ram page block: %v", err)
		}
		block, w.lastReadBlock = name, name
	} else if block == "" {
		return streamErr("ram page continues no block")
	}
	var page []byte
	var fill byte
	if flags&ramFlagZero != 0 {
		b, err := w.src.ReadByte()
		if err != nil {
			return streamErr("ram zero page: %v", err)
		}
		fill = b
	} else {
		if _, err := io.ReadFull(w.src, w.scratch[:]); err != nil {
			return streamErr("ram page: %v", err)
		}
		page = w.scratch[:]
	}
	if block == w.block {
		w.stats.PagesSent++
		if fill == 0 && w.base.equal(int64(addr), page) {
			return nil
		}
		w.stats.PagesKept++
	}
	out := addr | flags&^ramFlagContinue
	if block == w.lastEmitted {
		out |= ramFlagContinue
	}
	var hdr [8]byte
	binary.BigEndian.PutUint64(hdr[:], out)
	w.dst.Write(hdr[:])
	if out&ramFlagContinue == 0 {
		w.dst.WriteByte(byte(len(block)))
		w.dst.WriteString(block)
	}
	w.lastEmitted = block
	if page == nil {
		return w.dst.WriteByte(fill)
	}
	_, err := w.dst.Write(page)
	return err
}
