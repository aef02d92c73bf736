package vmm

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestRestackPutsImagesUnderTheTop starts a QEMU waiting for its state
// over an empty top on a base image, as a pre-started machine is, stacks
// two newer images between them (a failed attempt first, which must leave
// nothing behind), points the top's header at them as the node does, and
// loads a state saved by another QEMU: the guest's disk then reads the
// newer images' data, writes land in the top, and the files alone (QEMU
// gone) say the same chain.
func TestRestackPutsImagesUnderTheTop(t *testing.T) {
	bin := testQEMU(t)
	dir := t.TempDir()
	path := func(name string) string { return filepath.Join(dir, name) }
	qemuImg(t, "", "create", "-q", "-f", "qcow2", path("base.qcow2"), "64M")
	qemuImg(t, "qemu-io", "-c", "write -P 0xaa 0 192k", path("base.qcow2"))
	for _, l := range []struct{ name, on, write string }{
		{"layer1.qcow2", "base.qcow2", "write -P 0xbb 0 64k"},
		{"layer2.qcow2", "layer1.qcow2", "write -P 0xcc 64k 64k"},
		{"top.qcow2", "base.qcow2", ""},
		{"source.qcow2", "base.qcow2", ""},
	} {
		qemuImg(t, "", "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", path(l.on), path(l.name))
		if l.write != "" {
			qemuImg(t, "qemu-io", "-c", l.write, path(l.name))
		}
	}
	machine := []string{"-M", "microvm,x-option-roms=off", "-accel", "tcg", "-m", "64M", "-nodefaults", "-no-user-config", "-display", "none", "-S"}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	// The state of a machine with the same devices.
	src := startQEMU(t, bin, append(machine, "-drive", "id=root,file="+path("source.qcow2")+",format=qcow2,if=none",
		"-device", "virtio-blk-device,drive=root"))
	state := path("state")
	if err := src.SaveState(ctx, state); err != nil {
		t.Fatal(err)
	}

	rw, err := os.OpenFile(path("top.qcow2"), os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer rw.Close()
	ro, err := os.Open(path("top.qcow2"))
	if err != nil {
		t.Fatal(err)
	}
	defer ro.Close()
	c := Config{rootDiskFDs: [2]int{3, 4}}
	args := append(append(machine, c.rootDiskArgs()...), "-device", "virtio-blk-device,drive=root", "-incoming", "defer")
	m := startQEMU(t, bin, args, rw, ro)
	rw.Close()
	ro.Close()

	nodes := func() string {
		raw, err := m.qmp.Execute(ctx, "query-named-block-nodes", map[string]any{"flat": true})
		if err != nil {
			t.Fatal(err)
		}
		var list []struct {
			NodeName string `json:"node-name"`
		}
		if err := json.Unmarshal(raw, &list); err != nil {
			t.Fatal(err)
		}
		var names []string
		for _, n := range list {
			names = append(names, n.NodeName)
		}
		return strings.Join(names, " ")
	}
	before := nodes()
	if err := m.Restack(ctx, []string{path("missing.qcow2"), path("layer1.qcow2")}); err == nil {
		t.Fatal("a restack onto a missing image succeeded")
	}
	if after := nodes(); after != before || strings.Contains(after, "restack") {
		t.Fatalf("a failed restack left nodes: %s (before: %s)", after, before)
	}
	// One QEMU refuses to open (the state file is no qcow2): the images
	// above it, in the same command, go with it.
	if err := m.Restack(ctx, []string{path("layer2.qcow2"), state}); err == nil {
		t.Fatal("a restack onto a file that is no qcow2 image succeeded")
	}
	if after := nodes(); after != before {
		t.Fatalf("a refused restack left nodes: %s (before: %s)", after, before)
	}

	if err := m.Restack(ctx, []string{path("layer2.qcow2"), path("layer1.qcow2")}); err != nil {
		t.Fatal(err)
	}
	// The header, as the node rewrites it before the state loads. The
	// layers then leave the names QEMU could open (in a jail they are not
	// there at all): what QEMU reads of them comes through the descriptors.
	qemuImg(t, "", "rebase", "-u", "-F", "qcow2", "-b", path("layer2.qcow2"), path("top.qcow2"))
	hidden := filepath.Join(dir, "hidden")
	if err := os.Mkdir(hidden, 0o700); err != nil {
		t.Fatal(err)
	}
	for _, l := range []string{"layer1.qcow2", "layer2.qcow2"} {
		if err := os.Rename(path(l), filepath.Join(hidden, l)); err != nil {
			t.Fatal(err)
		}
	}
	if err := m.LoadState(ctx, state); err != nil {
		t.Fatal(err)
	}
	// What the guest's disk reads (a pattern that is not there first: a
	// check that can fail).
	for _, io := range []struct {
		command string
		ok      bool
	}{{"read -P 0x11 0 64k", false}, {"read -P 0xbb 0 64k", true}, {"read -P 0xcc 64k 64k", true},
		{"read -P 0xaa 128k 64k", true}, {"write -P 0xdd 128k 64k", true}, {"read -P 0xdd 128k 64k", true}, {"flush", true}} {
		out := qemuIO(t, m, "root", io.command)
		if failed := strings.Contains(out, "fail") || strings.Contains(out, "rror"); failed == io.ok || (out == "" && io.command != "flush") {
			t.Fatalf("%s (should succeed: %v): %q", io.command, io.ok, out)
		}
	}
	if err := m.Resume(ctx); err != nil {
		t.Fatal(err)
	}
	if err := m.Quit(ctx); err != nil {
		t.Fatal(err)
	}
	<-m.Exited()
	for _, l := range []string{"layer1.qcow2", "layer2.qcow2"} {
		if err := os.Rename(filepath.Join(hidden, l), path(l)); err != nil {
			t.Fatal(err)
		}
	}
	chain := qemuImg(t, "", "info", "--backing-chain", path("top.qcow2"))
	if strings.Count(chain, "image: ") != 4 || !strings.Contains(chain, "backing file: "+path("layer2.qcow2")) {
		t.Fatalf("the top's chain on disk:\n%s", chain)
	}
	for _, io := range []string{"read -P 0xbb 0 64k", "read -P 0xcc 64k 64k", "read -P 0xdd 128k 64k"} {
		if out := qemuImg(t, "qemu-io", "-r", "-c", io, path("top.qcow2")); strings.Contains(out, "ail") {
			t.Fatalf("the files after QEMU: %s: %s", io, out)
		}
	}
	if out := qemuImg(t, "qemu-io", "-r", "-c", "read -P 0xaa 128k 64k", path("layer2.qcow2")); strings.Contains(out, "ail") {
		t.Fatalf("a write through the restacked disk reached a layer below the top: %s", out)
	}
}
