package guest

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/agentenv/agentenv/internal/mountinfo"
)

// TestRemoveStaleWorkDirs: the work dir of a build killed mid-debootstrap
// holds the mounts debootstrap made in its tree (proc, sysfs, devpts); the
// next build detaches them and then removes the dir, and the host's own
// mounts are untouched.
func TestRemoveStaleWorkDirs(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (mounts)")
	}
	parent := t.TempDir()
	tree := filepath.Join(parent, workPrefix+"base-1234", "tree")
	mounts := []struct{ dir, fstype string }{
		{"proc", "proc"}, {"sys", "sysfs"}, {"dev/pts", "tmpfs"},
	}
	for _, m := range mounts {
		dir := filepath.Join(tree, m.dir)
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := unix.Mount(m.fstype, dir, m.fstype, 0, ""); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { unix.Unmount(dir, unix.MNT_DETACH) })
	}
	if err := os.WriteFile(filepath.Join(tree, "etc-file"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	var logged []string
	removeStaleWorkDirs(parent, func(f string, a ...any) { logged = append(logged, f) })
	points, err := mountinfo.Own()
	if err != nil {
		t.Fatal(err)
	}
	for _, mp := range points {
		if strings.HasPrefix(mp, parent+"/") {
			t.Errorf("mount left: %s", mp)
		}
	}
	if _, err := os.Stat(filepath.Join(parent, workPrefix+"base-1234")); !os.IsNotExist(err) {
		t.Fatalf("the stale work dir is still there: %v (%q)", err, logged)
	}
	for _, host := range []string{"/proc/self/status", "/sys/kernel"} {
		if _, err := os.Stat(host); err != nil {
			t.Fatalf("the host's %s: %v", host, err)
		}
	}
}
