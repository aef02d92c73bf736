// Package diskspace owns a node's floor of free disk space: what would
// grow the node's use of its data dir (sandbox starts, image imports,
// template builds, uploads, snapshots) is refused while the file system
// holding it has less free than the floor, with an error of kind
// errkind.ErrNoSpace (HTTP 507) whose message says so in numbers. What
// the node already holds is never removed to make room.
package diskspace

import (
	"fmt"

	"golang.org/x/sys/unix"

	"github.com/agentenv/agentenv/internal/errkind"
)

// Floor is the free space a node keeps on the file system of its data
// dir.
type Floor struct {
	dir     string
	minFree int64
}

// NewFloor keeps minFree bytes free on the file system holding dir (none
// when minFree <= 0).
func NewFloor(dir string, minFree int64) Floor { return Floor{dir: dir, minFree: minFree} }

// Shortage is the refusal of something that would grow the node's disk
// use while it is below its floor.
type Shortage struct {
	// What was refused ("a create", "an upload").
	What string
	// Free is the space left for unprivileged use, MinFree the floor.
	Free, MinFree int64
}

func (s *Shortage) Error() string {
	return fmt.Sprintf("the node's disk is nearly full: %s needs %s free and %s is; nothing was changed (free space on the node, e.g. delete snapshots or templates, or use another node)",
		s.What, mib(s.MinFree), mib(s.Free))
}

// Unwrap makes a shortage an errkind.ErrNoSpace.
func (s *Shortage) Unwrap() error { return errkind.ErrNoSpace }

// Check refuses what (e.g. "a create") with a *Shortage while the file
// system has less than the floor free. A file system that cannot be
// read passes (the operation then meets its own errors).
func (f Floor) Check(what string) error {
	if f.minFree <= 0 {
		return nil
	}
	free, err := Free(f.dir)
	if err != nil || free >= f.minFree {
		return nil
	}
	return &Shortage{What: what, Free: free, MinFree: f.minFree}
}

// Free is the space left on the file system holding dir for
// unprivileged use (the node runs as root, but the blocks reserved for
// root are the host's last resort, not the node's).
func Free(dir string) (int64, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return 0, err
	}
	return int64(st.Bavail) * st.Bsize, nil
}

func mib(b int64) string {
	if b >= 10<<30 {
		return fmt.Sprintf("%d GiB", b>>30)
	}
	return fmt.Sprintf("%d MiB", b>>20)
}
