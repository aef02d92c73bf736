package network

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/vishvananda/netns"

	"github.com/agentenv/agentenv/internal/mountinfo"
)

// A named namespace is bound under a /run/netns that is a mount of its
// own (as iproute2 makes it), so deleting it leaves nothing: on a host
// whose /run/netns was a plain directory, the first namespace bound there
// was covered by iproute2's later mount of it, could not be deleted, and
// the next run failed with "file exists".
func TestNamedNamespaceLeavesNothing(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to create network namespaces")
	}
	const name = "aetst-nsdir"
	ns, err := newNamedNS(name)
	if err != nil {
		t.Fatal(err)
	}
	ns.Close()
	if mounted, err := mountinfo.IsMountPoint(NetnsDir); err != nil || !mounted {
		t.Fatalf("%s is not a mount point: %v", NetnsDir, err)
	}
	if err := netns.DeleteNamed(name); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(NetnsDir, name)); !os.IsNotExist(err) {
		t.Fatalf("namespace %s left after its deletion: %v", name, err)
	}
	// Made again under its name.
	ns, err = newNamedNS(name)
	if err != nil {
		t.Fatal(err)
	}
	ns.Close()
	netns.DeleteNamed(name)
}
