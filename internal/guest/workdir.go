package guest

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/agentenv/agentenv/internal/mountinfo"
)

// A base rootfs is built in a work dir beside its image, where debootstrap
// mounts proc, sysfs and devpts inside the tree it makes (and unmounts them
// as it exits, unless it is killed). The work dir is never removed with
// mounts inside it (removing would walk into the host's /proc, /sys and
// /dev/pts): its mounts are detached first, after every build and, for the
// work dirs of a setup that was killed, before the next.

// workPrefix starts the names of rootfs work dirs.
const workPrefix = ".rootfs-"

// removeWorkDir detaches every mount below dir, then removes it. A dir
// whose mounts cannot all be detached is kept (and the error says why).
func removeWorkDir(dir string) error {
	if err := unmountBelow(dir); err != nil {
		return fmt.Errorf("remove %s: %w", dir, err)
	}
	return os.RemoveAll(dir)
}

// unmountBelow detaches the mounts on dir and below it, innermost first,
// and checks that none is left.
func unmountBelow(dir string) error {
	dir = filepath.Clean(dir)
	below := func() ([]string, error) {
		points, err := mountinfo.Own()
		if err != nil {
			return nil, err
		}
		var out []string
		for _, mp := range points {
			if mp == dir || strings.HasPrefix(mp, dir+"/") {
				out = append(out, mp)
			}
		}
		sort.Slice(out, func(i, j int) bool { return len(out[i]) > len(out[j]) })
		return out, nil
	}
	mps, err := below()
	if err != nil {
		return err
	}
	var errs []error
	for _, mp := range mps {
		if err := unix.Unmount(mp, unix.MNT_DETACH|unix.UMOUNT_NOFOLLOW); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
			errs = append(errs, fmt.Errorf("detach %s: %w", mp, err))
		}
	}
	if left, err := below(); err != nil || len(left) > 0 {
		return errors.Join(append(errs, fmt.Errorf("mounts left below %s: %q (%v)", dir, left, err))...)
	}
	return nil
}

// removeStaleWorkDirs removes the rootfs work dirs in parent that a killed
// build left, their mounts detached first.
func removeStaleWorkDirs(parent string, log func(string, ...any)) {
	stale, _ := filepath.Glob(filepath.Join(parent, workPrefix+"*"))
	for _, d := range stale {
		if err := removeWorkDir(d); err != nil {
			log("an interrupted build's work dir stays: %v", err)
			continue
		}
		log("removed the work dir of an interrupted build: %s", d)
	}
}
