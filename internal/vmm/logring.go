package vmm

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// A machine's console log (the guest's serial port) and QEMU's own log are
// files in its run dir that the guest can make grow: `yes > /dev/ttyS0`
// writes about 0.3 MiB/s under TCG, about 25 GiB a day. Both are written
// appending, and while the machine runs its log bound drops their oldest
// bytes in place once they hold more than the cap, so each stays a ring
// of its newest bytes that is read as a whole (ReadLogTail). The files are
// never rotated or renamed: QEMU keeps writing to the one it opened.

// DefaultLogCap is the cap of a machine's console and QEMU logs when its
// Config sets none.
const DefaultLogCap = 4 << 20

// logCheckEvery is how often a running machine's logs are checked: a log
// may pass its cap by what the guest writes in that time.
const logCheckEvery = 500 * time.Millisecond

// logRing is one log file being held to its cap.
type logRing struct {
	f   *os.File
	cap int64
	// punch is set once the file system turned down removing the head of
	// the file (FALLOC_FL_COLLAPSE_RANGE, which ext4 and XFS have): the
	// head is then punched out instead (the file keeps its length, its
	// dropped bytes a hole) and start is where its data begins.
	punch bool
	start int64
}

// openLogRing opens the log at path to hold it to capBytes. The file must
// be a regular one (it is made by this package in a run dir only the node
// writes, but nothing in that is taken on trust).
func openLogRing(path string, capBytes int64) (*logRing, error) {
	f, _, err := openLog(path, os.O_RDWR)
	if err != nil {
		return nil, err
	}
	return &logRing{f: f, cap: capBytes}, nil
}

// openLog opens the log at path (flag: O_RDONLY or O_RDWR) without
// following a link or blocking on a special file, and refuses anything but
// a regular file.
func openLog(path string, flag int) (*os.File, os.FileInfo, error) {
	f, err := os.OpenFile(path, flag|syscall.O_NOFOLLOW|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, nil, err
	}
	st, err := f.Stat()
	if err == nil && !st.Mode().IsRegular() {
		err = fmt.Errorf("%s is not a regular file", path)
	}
	if err != nil {
		f.Close()
		return nil, nil, err
	}
	return f, st, nil
}

// trim drops the oldest bytes of the log once it holds more than its cap,
// leaving about half the cap (the file system drops whole blocks).
func (r *logRing) trim() error {
	var st unix.Stat_t
	if err := unix.Fstat(int(r.f.Fd()), &st); err != nil {
		return err
	}
	held := st.Size - r.start
	if held <= r.cap {
		return nil
	}
	block := int64(st.Blksize)
	if block <= 0 {
		block = 4096
	}
	drop := (held - r.cap/2) / block * block
	if drop <= 0 {
		return nil
	}
	if !r.punch {
		err := unix.Fallocate(int(r.f.Fd()), unix.FALLOC_FL_COLLAPSE_RANGE, 0, drop)
		if err == nil {
			return nil
		}
		r.punch = true
	}
	if err := unix.Fallocate(int(r.f.Fd()), unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, r.start, drop); err != nil {
		// The last resort keeps the bound: the log starts over.
		r.start = 0
		if terr := r.f.Truncate(0); terr != nil {
			return fmt.Errorf("punch the head of %s: %w; truncate it: %w", r.f.Name(), err, terr)
		}
		return nil
	}
	r.start += drop
	return nil
}

// boundLogs holds the machine's console and QEMU logs to capBytes each
// until it exits.
func (m *Machine) boundLogs(capBytes int64) {
	if capBytes <= 0 {
		capBytes = DefaultLogCap
	}
	var rings []*logRing
	for _, name := range []string{ConsoleName, QEMULogName} {
		r, err := openLogRing(filepath.Join(m.runDir, name), capBytes)
		if err != nil {
			// QEMU makes the console log as it starts; one it has not
			// made holds nothing to bound.
			continue
		}
		rings = append(rings, r)
	}
	if len(rings) == 0 {
		return
	}
	go func() {
		t := time.NewTicker(logCheckEvery)
		defer t.Stop()
		defer func() {
			for _, r := range rings {
				r.f.Close()
			}
		}()
		for {
			select {
			case <-m.exited:
				return
			case <-t.C:
			}
			for _, r := range rings {
				// A log that can be neither trimmed nor truncated
				// (an I/O error) is tried again at the next tick.
				_ = r.trim()
			}
		}
	}()
}

// ReadLogTail reads up to the newest maxBytes of a log kept by a log ring
// (all of it when maxBytes is 0): the bytes a ring punched out are skipped.
// A missing log reads as empty.
func ReadLogTail(path string, maxBytes int64) ([]byte, error) {
	f, st, err := openLog(path, os.O_RDONLY)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	defer f.Close()
	size := st.Size()
	off := int64(0)
	if maxBytes > 0 && size > maxBytes {
		off = size - maxBytes
	}
	data, err := unix.Seek(int(f.Fd()), 0, unix.SEEK_DATA)
	switch {
	case errors.Is(err, unix.ENXIO):
		return nil, nil // all hole
	case err == nil && data > off:
		off = data
	}
	return io.ReadAll(io.NewSectionReader(f, off, size-off))
}
