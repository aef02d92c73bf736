// Package datadir owns the exclusive claim of one process on a node's data
// directory: a lock file held with flock(2) for the life of the process
// (the kernel drops it when the process dies, however it dies), so a second
// server, or an offline command such as `aenv template import`, refuses to
// write a data dir another process is using instead of corrupting it.
package datadir

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// LockName is the lock file inside a data dir.
const LockName = "lock"

// ErrInUse is returned when another process holds the data dir.
var ErrInUse = errors.New("data dir in use")

// Lock is a held claim on a data dir.
type Lock struct {
	f *os.File
}

// Acquire claims dir for this process (creating dir if needed); what names
// the claimant in the message a refused second process prints (e.g.
// "aenv server"). It fails at once, wrapping ErrInUse, when another
// process holds the dir.
func Acquire(dir, what string) (*Lock, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("create data dir: %w", err)
	}
	path := filepath.Join(dir, LockName)
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, fmt.Errorf("open data dir lock: %w", err)
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		holder := readHolder(f)
		f.Close()
		if errors.Is(err, unix.EWOULDBLOCK) {
			return nil, fmt.Errorf("%w: %s is used by %s; stop it first (or give another --data-dir)", ErrInUse, dir, holder)
		}
		return nil, fmt.Errorf("lock data dir %s: %w", dir, err)
	}
	// Who holds it, for the message of the next one refused.
	if err := f.Truncate(0); err == nil {
		_, _ = f.WriteAt([]byte(fmt.Sprintf("%d %s\n", os.Getpid(), what)), 0)
	}
	return &Lock{f: f}, nil
}

// readHolder describes the process named in the lock file.
func readHolder(f *os.File) string {
	b := make([]byte, 256)
	n, _ := f.ReadAt(b, 0)
	pid, what, ok := strings.Cut(strings.TrimSpace(string(b[:n])), " ")
	if _, err := strconv.Atoi(pid); !ok || err != nil {
		return "another process"
	}
	return fmt.Sprintf("%s (pid %s)", what, pid)
}

// Release gives the claim up.
func (l *Lock) Release() error {
	if l == nil || l.f == nil {
		return nil
	}
	err := l.f.Close() // closing the descriptor drops the flock
	l.f = nil
	return err
}
