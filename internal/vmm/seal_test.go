package vmm

import (
	"bytes"
	"context"
	"crypto/sha256"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

// TestSealFreezesTheTopAndReleasesIt starts QEMU on a root disk inherited
// as Start passes it (an fdset of a read-write and a read-only
// descriptor), seals it twice, and checks after each seal that QEMU's
// writes land in the new top only, that the sealed image is unchanged,
// and that QEMU holds no writable descriptor of any sealed image once
// ReleaseSealed ran (it held one before: the check can fail).
func TestSealFreezesTheTopAndReleasesIt(t *testing.T) {
	writable := func(t *testing.T, pid int, path string) int {
		t.Helper()
		n, err := WritableDescriptors(pid, path)
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	bin := testQEMU(t)
	dir := t.TempDir()
	img := func(args ...string) { t.Helper(); qemuImg(t, "", args...) }
	base, top := filepath.Join(dir, "base.qcow2"), filepath.Join(dir, "top.qcow2")
	img("create", "-q", "-f", "qcow2", base, "64M")
	img("create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", base, top)
	rw, err := os.OpenFile(top, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer rw.Close()
	ro, err := os.Open(top)
	if err != nil {
		t.Fatal(err)
	}
	defer ro.Close()
	c := Config{rootDiskFDs: [2]int{3, 4}}
	args := append([]string{"-M", "microvm", "-accel", "tcg", "-m", "64M", "-nodefaults", "-no-user-config", "-display", "none"},
		c.rootDiskArgs()...)
	args = append(args, "-device", "virtio-blk-device,drive=root")
	m := startQEMU(t, bin, args, rw, ro)
	rw.Close()
	ro.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	hmp := func(line string) { t.Helper(); hmp(t, m, line) }
	sum := func(p string) [32]byte {
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		return sha256.Sum256(b)
	}
	if n := writable(t, m.pid, top); n == 0 {
		t.Fatal("QEMU holds no writable descriptor of its disk before any seal: the check below could not fail")
	}
	if sealed, err := m.Sealed(ctx); err != nil || sealed {
		t.Fatalf("a disk never sealed reports sealed=%v (%v)", sealed, err)
	}
	sealedImages := []string{}
	for round, pattern := range []byte{0xa5, 0x5a} {
		hmp("qemu-io root \"write -P " + strconv.Itoa(int(pattern)) + " 0 64k\"")
		hmp("qemu-io root flush")
		next := filepath.Join(dir, "next"+strconv.Itoa(round)+".qcow2")
		// Backed by the sealed image's name, which QEMU does not open:
		// -u, as the node makes it while QEMU holds the image.
		img("create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", top, "-u", next, "64M")
		if err := m.Pause(ctx); err != nil {
			t.Fatal(err)
		}
		if err := m.Seal(ctx, next); err != nil {
			t.Fatalf("round %d: %v", round, err)
		}
		if err := m.Resume(ctx); err != nil {
			t.Fatal(err)
		}
		closed, err := m.ReleaseSealed(ctx)
		if err != nil || closed != 1 {
			t.Fatalf("round %d: ReleaseSealed closed %d descriptors (%v), want 1", round, closed, err)
		}
		if sealed, err := m.Sealed(ctx); err != nil || !sealed {
			t.Fatalf("round %d: sealed=%v (%v)", round, sealed, err)
		}
		sealedImages = append(sealedImages, top)
		frozen := sum(top)
		hmp("qemu-io root \"write -P 0x77 0 64k\"")
		hmp("qemu-io root flush")
		if sum(top) != frozen {
			t.Errorf("round %d: a write after the seal changed the sealed image", round)
		}
		b, err := os.ReadFile(next)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Contains(b, bytes.Repeat([]byte{0x77}, 4096)) {
			t.Errorf("round %d: the write after the seal is not in the new top", round)
		}
		for _, p := range sealedImages {
			if n := writable(t, m.pid, p); n != 0 {
				t.Errorf("round %d: QEMU still holds %d writable descriptors of sealed %s", round, n, filepath.Base(p))
			}
		}
		if writable(t, m.pid, next) == 0 {
			t.Errorf("round %d: QEMU cannot write its new top", round)
		}
		top = next
	}
	// A migration after the seals (a full save) and the guest on: QEMU
	// reopens every image of the chain at its end.
	if err := m.Pause(ctx); err != nil {
		t.Fatal(err)
	}
	if err := m.SaveState(ctx, filepath.Join(dir, "state")); err != nil {
		t.Fatalf("a migration after the seals: %v", err)
	}
	if err := m.Resume(ctx); err != nil {
		t.Fatalf("cont after a migration after the seals: %v", err)
	}
	hmp("qemu-io root \"write -P 0x66 64k 64k\"")
	hmp("qemu-io root flush")
	// The chain as the files say it, and every image in it, is sound.
	out, err := exec.Command("qemu-img", "check", "-U", top).CombinedOutput()
	if err != nil {
		t.Fatalf("qemu-img check: %v: %s", err, out)
	}
	out, err = exec.Command("qemu-img", "info", "-U", "--backing-chain", top).CombinedOutput()
	if err != nil || strings.Count(string(out), "image: ") != 4 {
		t.Fatalf("backing chain (%v):\n%s", err, out)
	}
}
