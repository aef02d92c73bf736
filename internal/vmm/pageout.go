package vmm

import (
	"bufio"
	"fmt"
	"os"
	"strconv"
	"strings"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Saving a machine whose RAM maps an image copy-on-write makes QEMU read
// every page of guest RAM, which faults the image's holes in as zero-filled
// page-cache pages mapped by this one QEMU. They hold nothing and nobody
// else maps them; releaseHoles hands them back to the kernel
// (process_madvise MADV_PAGEOUT, which leaves pages other processes map and
// pages the guest has written alone), so a machine that is saved and runs on
// costs no more memory than before.

// mapping is one VMA of a file in a process.
type mapping struct {
	start, end uint64 // addresses
	offset     int64  // file offset of start
	shared     bool   // MAP_SHARED (else private: copy-on-write)
}

// fileMappings lists the VMAs of file in process pid.
func fileMappings(pid int, file string) ([]mapping, error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/maps", pid))
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var out []mapping
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		// start-end perms offset dev inode path
		fields := strings.Fields(sc.Text())
		if len(fields) < 6 || strings.Join(fields[5:], " ") != file {
			continue
		}
		addrs := strings.SplitN(fields[0], "-", 2)
		start, err1 := strconv.ParseUint(addrs[0], 16, 64)
		end, err2 := strconv.ParseUint(addrs[1], 16, 64)
		off, err3 := strconv.ParseInt(fields[2], 16, 64)
		if err1 != nil || err2 != nil || err3 != nil {
			return nil, fmt.Errorf("parse maps line %q", sc.Text())
		}
		out = append(out, mapping{start, end, off, strings.HasSuffix(fields[1], "s")})
	}
	return out, sc.Err()
}

// releaseHoles pages out the parts of pid's mappings of file that lie in
// the file's holes.
func releaseHoles(pid int, file string, holes [][2]int64) error {
	maps, err := fileMappings(pid, file)
	if err != nil || len(maps) == 0 {
		return err
	}
	// struct iovec, with the base as a plain address: it is one in QEMU's
	// address space, not ours.
	type iovec struct{ base, len uint64 }
	var iov []iovec
	for _, m := range maps {
		mEnd := m.offset + int64(m.end-m.start)
		for _, h := range holes {
			lo, hi := max(h[0], m.offset), min(h[1], mEnd)
			if lo >= hi {
				continue
			}
			iov = append(iov, iovec{m.start + uint64(lo-m.offset), uint64(hi - lo)})
		}
	}
	if len(iov) == 0 {
		return nil
	}
	pidfd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		return fmt.Errorf("pidfd of %d: %w", pid, err)
	}
	defer unix.Close(pidfd)
	const maxIOV = 1024
	for len(iov) > 0 {
		n := min(len(iov), maxIOV)
		_, _, errno := unix.Syscall6(unix.SYS_PROCESS_MADVISE, uintptr(pidfd), uintptr(unsafe.Pointer(&iov[0])), uintptr(n), unix.MADV_PAGEOUT, 0, 0)
		if errno != 0 {
			return fmt.Errorf("process_madvise: %w", errno)
		}
		iov = iov[n:]
	}
	return nil
}
