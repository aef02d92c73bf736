package vmm

import (
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"

	"golang.org/x/sys/unix"
)

// A machine running copy-on-write on a RAM image has exactly one kind of
// page that differs from the image: the private copies the kernel made when
// the guest (or a restore) wrote to a page of the mapping. /proc/PID/pagemap
// tells them apart from the image's page-cache pages, so an incremental
// snapshot can be assembled without QEMU's migration, which reads every page
// of guest RAM and sends each non-zero one (hundreds of milliseconds under
// TCG, with the guest stopped):
//
//   - the device state comes from QMP xen-save-devices-state (every section
//     but RAM, as a migration writes them, in about a millisecond);
//   - the RAM section is written here, holding the private pages of the
//     "mem" block read straight from QEMU's memory (process_vm_readv);
//   - the configuration section, which a load requires and
//     xen-save-devices-state leaves out, names the machine type.
//
// The result is the same stream format the migration filter of ramdiff.go
// writes and LoadFullState reads. The other RAM blocks of a microvm (the
// firmware and the ACPI tables, which QEMU rebuilds identically at each
// start of the same binary and configuration and the guest cannot write)
// are left out, so the loading QEMU keeps its own.

// DiffCapture is how an incremental snapshot finds the pages of guest RAM
// that differ from the image the machine maps.
type DiffCapture string

const (
	// CapturePrivatePages reads the mapping's private pages from pagemap
	// and the device state from xen-save-devices-state.
	CapturePrivatePages DiffCapture = "private-pages"
	// CaptureMigration filters QEMU's full migration stream against the
	// image (ramdiff.go): every QEMU can, at the cost of a walk over all
	// of guest RAM.
	CaptureMigration DiffCapture = "migration-filter"
)

// Sections of the assembled stream. The RAM section's id only has to be
// unique in the stream: the loader finds a START section's handler by
// name and a later END section's by the id the START gave.
const (
	assembledRAMSection = 0x7fff0000
	ramSectionVersion   = 4
	// machineTypeName is the machine class the configuration section names
	// (Config.Args starts every machine as "microvm").
	machineTypeName = "microvm"
)

// pagemap entry bits (Documentation/admin-guide/mm/pagemap.rst).
const (
	pmPresent = 1 << 63
	pmSwapped = 1 << 62
	pmFile    = 1 << 61 // file page or shared anonymous
)

// privatePages lists, as page indexes into the file mapped, the pages of
// pid's mappings of file that are private copies: present (or swapped out)
// and not the file's page-cache page.
func privatePages(pid int, maps []mapping) ([]int64, error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/pagemap", pid))
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var pages []int64
	var buf []byte
	for _, m := range maps {
		n := int((m.end - m.start) / guestPageSize)
		if cap(buf) < n*8 {
			buf = make([]byte, n*8)
		}
		buf = buf[:n*8]
		if _, err := f.ReadAt(buf, int64(m.start/guestPageSize*8)); err != nil {
			return nil, fmt.Errorf("read pagemap: %w", err)
		}
		first := m.offset / guestPageSize
		for i := 0; i < n; i++ {
			e := binary.LittleEndian.Uint64(buf[i*8:])
			if e&pmSwapped != 0 || (e&pmPresent != 0 && e&pmFile == 0) {
				pages = append(pages, first+int64(i))
			}
		}
	}
	sort.Slice(pages, func(i, j int) bool { return pages[i] < pages[j] })
	return pages, nil
}

// SaveStateFromPrivatePages writes an incremental snapshot of a paused
// machine whose RAM maps base privately (Config.PrivateMemory) to path, in
// the format SaveStateDiff writes and LoadFullState reads, without QEMU's
// walk over guest RAM (see the top of this file). The file is not synced:
// the caller syncs it (storage.SyncFile) when the guest may go on.
func (m *Machine) SaveStateFromPrivatePages(ctx context.Context, path, base string) (RAMDiffStats, error) {
	devices, err := m.saveDevicesState(ctx)
	if err != nil {
		return RAMDiffStats{}, err
	}
	maps, err := fileMappings(m.pid, base)
	if err != nil {
		return RAMDiffStats{}, fmt.Errorf("find guest RAM in QEMU: %w", err)
	}
	var size int64
	for _, mp := range maps {
		if mp.shared {
			// Its changes are in the file itself, and no page is private.
			return RAMDiffStats{}, fmt.Errorf("QEMU (pid %d) maps %s shared, not copy-on-write", m.pid, base)
		}
		size = max(size, mp.offset+int64(mp.end-mp.start))
	}
	if len(maps) == 0 || size == 0 {
		return RAMDiffStats{}, fmt.Errorf("QEMU (pid %d) does not map %s", m.pid, base)
	}
	pages, err := privatePages(m.pid, maps)
	if err != nil {
		return RAMDiffStats{}, err
	}
	out, err := os.OpenFile(path, os.O_CREATE|os.O_TRUNC|os.O_WRONLY, 0o600)
	if err != nil {
		return RAMDiffStats{}, err
	}
	defer out.Close()
	// No checksum here: hashing runs at about 1 GB/s, as long as the
	// copy itself; the callers hash the file once the guest runs again.
	w := &countingWriter{w: out}
	if err := assembleStream(w, devices, maps, pages, size, remoteReader(m.pid)); err != nil {
		return RAMDiffStats{}, err
	}
	st := RAMDiffStats{PagesSent: int64(len(pages)), PagesKept: int64(len(pages)), Bytes: w.n}
	return st, out.Close()
}

// saveDevicesState asks QEMU for its device state (xen-save-devices-state,
// which with live=false leaves the disks active) through a file in a
// directory of QEMU's user, and returns the file's bytes.
func (m *Machine) saveDevicesState(ctx context.Context) ([]byte, error) {
	dir, err := os.MkdirTemp("", "aenv-dev-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	if m.uid >= 0 {
		if err := os.Chown(dir, m.uid, m.gid); err != nil {
			return nil, err
		}
	}
	file := filepath.Join(dir, "devices")
	if _, err := m.qmp.Execute(ctx, "xen-save-devices-state", map[string]any{"filename": file, "live": false}); err != nil {
		return nil, fmt.Errorf("save device state: %w", err)
	}
	b, err := readOwnFile(file, m.uid, maxDevicesState)
	if err != nil {
		return nil, fmt.Errorf("read device state: %w", err)
	}
	if len(b) < 9 || binary.BigEndian.Uint32(b) != migMagic || binary.BigEndian.Uint32(b[4:]) != migVersion {
		return nil, streamErr("device state of %d bytes has no stream header", len(b))
	}
	if b[8] != secFull || b[len(b)-1] != secEOF {
		return nil, streamErr("device state does not hold device sections alone (first section %#x)", b[8])
	}
	return b, nil
}

// maxDevicesState bounds the device state read back from QEMU (a microvm's
// is a few KiB; a compromised QEMU must not make the node read gigabytes).
const maxDevicesState = 16 << 20

// readOwnFile reads file, which a QEMU running as uid (-1: root) wrote in a
// directory it owns: so it may be anything that QEMU could make there. It
// must be a regular file of uid's, with no other name (no symbolic or hard
// link to a file of the node's), of at most limit bytes.
func readOwnFile(file string, uid int, limit int64) ([]byte, error) {
	f, err := os.OpenFile(file, os.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK, 0)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return nil, err
	}
	switch {
	case st.Mode&unix.S_IFMT != unix.S_IFREG:
		return nil, fmt.Errorf("%s is not a regular file", filepath.Base(file))
	case st.Nlink != 1:
		return nil, fmt.Errorf("%s has %d names", filepath.Base(file), st.Nlink)
	case uid >= 0 && int(st.Uid) != uid:
		return nil, fmt.Errorf("%s belongs to uid %d, not QEMU's %d", filepath.Base(file), st.Uid, uid)
	case st.Size > limit:
		return nil, fmt.Errorf("%s has %d bytes, more than %d", filepath.Base(file), st.Size, limit)
	}
	b, err := io.ReadAll(io.LimitReader(f, limit+1))
	if err == nil && int64(len(b)) > limit {
		err = fmt.Errorf("%s grew past %d bytes", filepath.Base(file), limit)
	}
	return b, err
}

// pageReader copies pages of guest RAM: dst[i] gets the page at
// file offset offs[i] of the RAM image's mapping.
type pageReader func(dst [][]byte, remote []unix.RemoteIovec) error

// remoteReader reads from process pid's memory.
func remoteReader(pid int) pageReader {
	return func(dst [][]byte, remote []unix.RemoteIovec) error {
		local := make([]unix.Iovec, len(dst))
		want := 0
		for i, d := range dst {
			local[i].Base = &d[0]
			local[i].SetLen(len(d))
			want += len(d)
		}
		n, err := unix.ProcessVMReadv(pid, local, remote, 0)
		if err != nil {
			return fmt.Errorf("read guest RAM from QEMU: %w", err)
		}
		if n != want {
			return fmt.Errorf("read guest RAM from QEMU: %d of %d bytes", n, want)
		}
		return nil
	}
}

// assembleStream writes the stream: devices' header, a configuration
// section, the RAM section with the private pages (pages, as indexes into
// the RAM image, read through read at their addresses in maps), then the
// device sections and EOF of devices.
func assembleStream(w io.Writer, devices []byte, maps []mapping, pages []int64, ramSize int64, read pageReader) error {
	b := make([]byte, 0, 64)
	b = append(b, devices[:8]...)
	b = append(b, secConfiguration)
	b = binary.BigEndian.AppendUint32(b, uint32(len(machineTypeName)))
	b = append(b, machineTypeName...)
	b = append(b, secStart)
	b = binary.BigEndian.AppendUint32(b, assembledRAMSection)
	b = append(b, byte(len("ram")))
	b = append(b, "ram"...)
	b = binary.BigEndian.AppendUint32(b, 0) // instance
	b = binary.BigEndian.AppendUint32(b, ramSectionVersion)
	b = binary.BigEndian.AppendUint64(b, uint64(ramSize)|ramFlagMemSize)
	b = append(b, byte(len(ramBlockName)))
	b = append(b, ramBlockName...)
	b = binary.BigEndian.AppendUint64(b, uint64(ramSize))
	if _, err := w.Write(b); err != nil {
		return err
	}
	if err := writePages(w, maps, pages, read); err != nil {
		return err
	}
	b = b[:0]
	b = binary.BigEndian.AppendUint64(b, ramFlagEOS)
	b = appendFooter(b, assembledRAMSection)
	b = append(b, secEnd)
	b = binary.BigEndian.AppendUint32(b, assembledRAMSection)
	b = binary.BigEndian.AppendUint64(b, ramFlagEOS)
	b = appendFooter(b, assembledRAMSection)
	if _, err := w.Write(b); err != nil {
		return err
	}
	_, err := w.Write(devices[8:])
	return err
}

func appendFooter(b []byte, section uint32) []byte {
	return binary.BigEndian.AppendUint32(append(b, secFooter), section)
}

// pageRecord is the size of a page record after the section's first: an
// offset with flags (CONTINUE: same block) and the page.
const pageRecord = 8 + guestPageSize

// writePages writes a page record for each of pages, in batches read
// straight into their place in the output buffer.
func writePages(w io.Writer, maps []mapping, pages []int64, read pageReader) error {
	const batch = 256
	buf := make([]byte, 0, 1+len(ramBlockName)+batch*pageRecord)
	dst := make([][]byte, 0, batch)
	remote := make([]unix.RemoteIovec, 0, batch)
	first := true
	for len(pages) > 0 {
		n := min(len(pages), batch)
		buf, dst, remote = buf[:0], dst[:0], remote[:0]
		for _, p := range pages[:n] {
			off := p * guestPageSize
			flags := uint64(ramFlagPage)
			if !first {
				flags |= ramFlagContinue
			}
			buf = binary.BigEndian.AppendUint64(buf, uint64(off)|flags)
			if first {
				buf = append(buf, byte(len(ramBlockName)))
				buf = append(buf, ramBlockName...)
				first = false
			}
			start := len(buf)
			buf = buf[:start+guestPageSize]
			dst = append(dst, buf[start:start+guestPageSize])
			addr, ok := addressOf(maps, off)
			if !ok {
				return fmt.Errorf("page at %#x is in no mapping", off)
			}
			if k := len(remote) - 1; k >= 0 && uint64(remote[k].Base)+uint64(remote[k].Len) == addr {
				remote[k].Len += guestPageSize
			} else {
				remote = append(remote, unix.RemoteIovec{Base: uintptr(addr), Len: guestPageSize})
			}
		}
		if err := read(dst, remote); err != nil {
			return err
		}
		if _, err := w.Write(buf); err != nil {
			return err
		}
		pages = pages[n:]
	}
	return nil
}

// addressOf returns the address in QEMU of the image's byte at off.
func addressOf(maps []mapping, off int64) (uint64, bool) {
	for _, m := range maps {
		if off >= m.offset && off < m.offset+int64(m.end-m.start) {
			return m.start + uint64(off-m.offset), true
		}
	}
	return 0, false
}
