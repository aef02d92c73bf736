package vmm

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

// TestQMPPassesADescriptor stacks a new qcow2 overlay on a running
// machine's disk (blockdev-snapshot-sync, mode existing) from a descriptor
// passed with add-fd, of a file that has no name any more: QEMU can only
// have it through the descriptor. A write through QEMU then lands in that
// file and not in the disk below. This is what sealing an overlay in place
// needs from a QEMU that cannot open the sandbox's files itself.
func TestQMPPassesADescriptor(t *testing.T) {
	bin, err := FindQEMU(os.Getenv("AENV_QEMU"))
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatal(err)
		}
		t.Skip(err)
	}
	img, err := exec.LookPath("qemu-img")
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	base, top := filepath.Join(dir, "base.qcow2"), filepath.Join(dir, "top.qcow2")
	for _, args := range [][]string{
		{"create", "-q", "-f", "qcow2", base, "64M"},
		{"create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", base, top},
	} {
		if out, err := exec.Command(img, args...).CombinedOutput(); err != nil {
			t.Fatalf("qemu-img %v: %v: %s", args, err, out)
		}
	}
	sock := filepath.Join(dir, "qmp.sock")
	cmd := exec.Command(bin, "-M", "microvm", "-accel", "tcg", "-m", "64M", "-nodefaults", "-no-user-config",
		"-display", "none", "-drive", "id=root,file="+base+",format=qcow2,if=none", "-device", "virtio-blk-device,drive=root",
		"-qmp", "unix:"+sock+",server=on,wait=off")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	q, err := DialQMP(ctx, sock)
	if err != nil {
		t.Fatalf("%v: %s", err, stderr.String())
	}
	defer q.Close()

	// QEMU opens an image read-only first, then read-write: the set holds
	// a descriptor of each access mode (it dups the one that matches).
	f, err := os.OpenFile(top, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	ro, err := os.Open(top)
	if err != nil {
		t.Fatal(err)
	}
	defer ro.Close()
	if err := os.Remove(top); err != nil { // from now on only the descriptors reach it
		t.Fatal(err)
	}
	for _, fd := range []*os.File{f, ro} {
		raw, err := q.ExecuteWithFile(ctx, "add-fd", map[string]any{"fdset-id": 7}, fd)
		if err != nil {
			t.Fatalf("add-fd: %v", err)
		}
		var added struct {
			FdsetID int `json:"fdset-id"`
		}
		if err := json.Unmarshal(raw, &added); err != nil || added.FdsetID != 7 {
			t.Fatalf("add-fd answered %s (%v)", raw, err)
		}
	}
	if _, err := q.Execute(ctx, "blockdev-snapshot-sync", map[string]any{"device": "root",
		"snapshot-file": "/dev/fdset/7", "format": "qcow2", "mode": "existing"}); err != nil {
		t.Fatalf("seal onto the passed descriptor: %v", err)
	}
	raw, err := q.Execute(ctx, "query-block", nil)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(raw), `"/dev/fdset/7"`) || !strings.Contains(string(raw), `"backing_file_depth": 1`) {
		t.Fatalf("the disk after the seal: %s", raw)
	}
	// A write through QEMU goes to the new top, the descriptor's file.
	if _, err := q.Execute(ctx, "human-monitor-command", map[string]any{"command-line": "qemu-io root \"write -P 0xa5 0 64k\""}); err != nil {
		t.Fatal(err)
	}
	if _, err := q.Execute(ctx, "human-monitor-command", map[string]any{"command-line": "qemu-io root flush"}); err != nil {
		t.Fatal(err)
	}
	pattern := bytes.Repeat([]byte{0xa5}, 4096)
	contains := func(path string) bool {
		b, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		return bytes.Contains(b, pattern)
	}
	if !contains("/proc/self/fd/" + strconv.Itoa(int(f.Fd()))) {
		t.Error("the write did not reach the overlay passed as a descriptor")
	}
	if contains(base) {
		t.Error("the write reached the disk below the seal")
	}
}
