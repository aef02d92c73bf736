package vmm

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"math/rand"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// TestPrivatePagesOfACopyOnWriteMapping maps a file privately in this
// process, reads all of it and writes some pages: exactly the written pages
// are private.
func TestPrivatePagesOfACopyOnWriteMapping(t *testing.T) {
	path := filepath.Join(t.TempDir(), "image")
	data := make([]byte, 64*guestPageSize)
	rand.New(rand.NewSource(1)).Read(data[:32*guestPageSize]) // the rest: a hole
	if err := os.WriteFile(path, data[:32*guestPageSize], 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(path, int64(len(data))); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	mem, err := syscall.Mmap(int(f.Fd()), 0, len(data), syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_PRIVATE)
	if err != nil {
		t.Fatal(err)
	}
	defer syscall.Munmap(mem)
	var sum byte
	for i := 0; i < len(mem); i += guestPageSize {
		sum += mem[i] // fault every page in, unchanged
	}
	maps, err := fileMappings(os.Getpid(), path)
	if err != nil || len(maps) != 1 {
		t.Fatalf("mappings %v %v", maps, err)
	}
	if got, err := privatePages(os.Getpid(), maps); err != nil || len(got) != 0 {
		t.Fatalf("private pages of a mapping only read: %v %v", got, err)
	}
	want := []int64{0, 3, 10, 11, 31, 32, 40, 63}
	for _, p := range want {
		mem[p*guestPageSize+7] = sum + 1
	}
	got, err := privatePages(os.Getpid(), maps)
	if err != nil || !slices.Equal(got, want) {
		t.Fatalf("private pages %v %v, want %v", got, err, want)
	}
	if maps[0].shared {
		t.Fatal("a private mapping was read as shared")
	}
	// A shared mapping of the same file is told apart (its changes are in
	// the file; SaveStateFromPrivatePages refuses it).
	shared, err := syscall.Mmap(int(f.Fd()), 0, guestPageSize, syscall.PROT_READ, syscall.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	defer syscall.Munmap(shared)
	all, err := fileMappings(os.Getpid(), path)
	if err != nil || len(all) != 2 || all[0].shared == all[1].shared {
		t.Fatalf("a private and a shared mapping: %+v %v", all, err)
	}
}

// qemuWithRAM starts a firmware-only microvm whose RAM maps image
// privately, as sandboxes running copy-on-write do, and returns it as a
// Machine. incoming: it waits for a migration stream.
func qemuWithRAM(t *testing.T, bin, image string, mib int, incoming bool) *Machine {
	t.Helper()
	mem := strconv.Itoa(mib) + "M"
	args := []string{"-M", "microvm,x-option-roms=off,isa-serial=on,rtc=on,memory-backend=mem", "-accel", "tcg",
		"-m", mem, "-object", "memory-backend-file,id=mem,size=" + mem + ",mem-path=" + image + ",share=off",
		"-nodefaults", "-no-user-config", "-display", "none",
		"-device", "virtio-rng-device", "-device", "virtio-balloon-device"}
	if incoming {
		args = append(args, "-S", "-incoming", "defer")
	}
	return startQEMU(t, bin, args)
}

// guestRAM reads all of m's mapping of image.
func guestRAM(t *testing.T, m *Machine, image string, size int) []byte {
	t.Helper()
	maps, err := fileMappings(m.pid, image)
	if err != nil || len(maps) != 1 || maps[0].offset != 0 || int(maps[0].end-maps[0].start) != size {
		t.Fatalf("QEMU %d maps %s as %v (%v)", m.pid, image, maps, err)
	}
	buf := make([]byte, size)
	local := []unix.Iovec{{Base: &buf[0]}}
	local[0].SetLen(size)
	n, err := unix.ProcessVMReadv(m.pid, local, []unix.RemoteIovec{{Base: uintptr(maps[0].start), Len: size}}, 0)
	if err != nil || n != size {
		t.Fatalf("read QEMU's RAM: %d %v", n, err)
	}
	return buf
}

// TestStateFromPrivatePagesRestoresTheMachine: a machine whose RAM maps an
// image copy-on-write has pages written (into QEMU's memory, as a guest
// writes them); its state is saved from its private pages and, as the
// baseline, through the migration filter. Each loads into a new QEMU on the
// same image, whose RAM then equals the saved machine's, page for page, and
// which runs on.
func TestStateFromPrivatePagesRestoresTheMachine(t *testing.T) {
	bin, err := FindQEMU(os.Getenv("AENV_QEMU"))
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatal(err)
		}
		t.Skip(err)
	}
	const mib = 16
	size := mib << 20
	dir := t.TempDir()
	image := filepath.Join(dir, "ram")
	content := make([]byte, size/2)
	rand.New(rand.NewSource(2)).Read(content)
	if err := os.WriteFile(image, content, 0o600); err != nil { // the upper half: a hole
		t.Fatal(err)
	}
	if err := os.Truncate(image, int64(size)); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	src := qemuWithRAM(t, bin, image, mib, false)
	time.Sleep(300 * time.Millisecond) // the firmware runs and writes
	if err := src.Pause(ctx); err != nil {
		t.Fatal(err)
	}
	// Pages written in both halves: random bytes, a page of zeros over
	// the image's data, and single bytes.
	maps, err := fileMappings(src.pid, image)
	if err != nil || len(maps) != 1 {
		t.Fatalf("maps %v %v", maps, err)
	}
	r := rand.New(rand.NewSource(3))
	for i := 0; i < 300; i++ {
		off := r.Intn(size/guestPageSize) * guestPageSize
		page := make([]byte, guestPageSize)
		switch i % 3 {
		case 0:
			r.Read(page)
		case 1: // zeros
		case 2:
			page = page[:1]
			page[0] = byte(i)
		}
		local := []unix.Iovec{{Base: &page[0]}}
		local[0].SetLen(len(page))
		if _, err := unix.ProcessVMWritev(src.pid, local, []unix.RemoteIovec{{Base: uintptr(maps[0].start) + uintptr(off), Len: len(page)}}, 0); err != nil {
			t.Fatal(err)
		}
	}
	want := guestRAM(t, src, image, size)

	pp := filepath.Join(dir, "private-pages.state")
	st, err := src.SaveStateFromPrivatePages(ctx, pp, image)
	if err != nil {
		t.Fatal(err)
	}
	if st.PagesKept < 200 || st.PagesKept > int64(size/guestPageSize/4) {
		t.Fatalf("private pages: %+v", st)
	}
	filtered := filepath.Join(dir, "migration-filter.state")
	fst, err := src.SaveStateDiff(ctx, filtered, image)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("private pages: %d pages, %d bytes; migration filter: %d of %d pages kept, %d bytes", st.PagesKept, st.Bytes, fst.PagesKept, fst.PagesSent, fst.Bytes)
	for _, state := range []string{pp, filtered} {
		dst := qemuWithRAM(t, bin, image, mib, true)
		if err := dst.LoadFullState(ctx, state); err != nil {
			t.Fatalf("%s: %v", filepath.Base(state), err)
		}
		got := guestRAM(t, dst, image, size)
		for off := 0; off < size; off += guestPageSize {
			if !bytes.Equal(got[off:off+guestPageSize], want[off:off+guestPageSize]) {
				t.Fatalf("%s: page at %#x differs from the saved machine's", filepath.Base(state), off)
			}
		}
		if err := dst.Resume(ctx); err != nil {
			t.Fatalf("%s: cont: %v", filepath.Base(state), err)
		}
		if s, err := dst.Status(ctx); err != nil || s != "running" {
			t.Fatalf("%s: restored machine: %q %v", filepath.Base(state), s, err)
		}
	}
}

// TestReadOwnFileRefusesWhatQEMUCouldPlant: the device state is read from a
// directory QEMU owns, so a compromised QEMU could leave a link to a file
// of the node's there, or something endless: each is refused.
func TestReadOwnFileRefusesWhatQEMUCouldPlant(t *testing.T) {
	dir := t.TempDir()
	secret := filepath.Join(dir, "secret")
	if err := os.WriteFile(secret, []byte("the node's"), 0o600); err != nil {
		t.Fatal(err)
	}
	good := filepath.Join(dir, "good")
	if err := os.WriteFile(good, []byte("state"), 0o600); err != nil {
		t.Fatal(err)
	}
	symlink, hardlink, fifo, big := filepath.Join(dir, "symlink"), filepath.Join(dir, "hardlink"), filepath.Join(dir, "fifo"), filepath.Join(dir, "big")
	if err := os.Symlink(secret, symlink); err != nil {
		t.Fatal(err)
	}
	if err := os.Link(secret, hardlink); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(big, make([]byte, 2048), 0o600); err != nil {
		t.Fatal(err)
	}
	uid := os.Getuid()
	if b, err := readOwnFile(good, uid, 1024); err != nil || string(b) != "state" {
		t.Fatalf("a plain file of QEMU's: %q %v", b, err)
	}
	for name, tc := range map[string]struct {
		path string
		uid  int
	}{
		"symbolic link": {symlink, uid}, "hard link": {hardlink, uid}, "fifo": {fifo, uid},
		"too big": {big, uid}, "another owner": {good, uid + 1},
	} {
		if b, err := readOwnFile(tc.path, tc.uid, 1024); err == nil {
			t.Errorf("%s: read %q", name, b)
		}
	}
}

// TestAssembledStreamParses: a stream assembled from a device state and
// private pages (in two mappings, across more than one batch) reads back
// through the migration-stream parser record for record: every page is
// there with its contents, in the RAM block, and the device sections and
// EOF follow unchanged.
func TestAssembledStreamParses(t *testing.T) {
	var dev streamBuilder
	dev.be32(migMagic)
	dev.be32(migVersion)
	dev.WriteByte(secFull)
	dev.be32(3)
	dev.str("timer")
	dev.be32(0)
	dev.be32(2)
	dev.Write([]byte("device bytes"))
	dev.WriteByte(secFooter)
	dev.be32(3)
	dev.WriteByte(secEOF)
	const total = 1024 // pages
	maps := []mapping{{start: 0x7f0000000000, end: 0x7f0000000000 + 512*guestPageSize, offset: 0},
		{start: 0x7f1000000000, end: 0x7f1000000000 + 512*guestPageSize, offset: 512 * guestPageSize}}
	var pages []int64
	for p := int64(0); p < total; p += 3 {
		pages = append(pages, p) // 342 pages: two batches and a part
	}
	// The "remote" memory: each page holds its index.
	read := func(dst [][]byte, remote []unix.RemoteIovec) error {
		var addrs []uint64
		for _, r := range remote {
			for a := uint64(r.Base); a < uint64(r.Base)+uint64(r.Len); a += guestPageSize {
				addrs = append(addrs, a)
			}
		}
		if len(addrs) != len(dst) {
			return errors.New("remote and local ranges differ in size")
		}
		for i, a := range addrs {
			var off int64 = -1
			for _, m := range maps {
				if a >= m.start && a < m.end {
					off = m.offset + int64(a-m.start)
				}
			}
			binary.LittleEndian.PutUint64(dst[i], uint64(off/guestPageSize))
			copy(dst[i][8:], filled(byte(off / guestPageSize))[8:])
		}
		return nil
	}
	var out bytes.Buffer
	if err := assembleStream(&out, dev.Bytes(), maps, pages, total*guestPageSize, read); err != nil {
		t.Fatal(err)
	}
	// Against a base of zeros every page differs: the parser keeps all
	// of them and writes the stream back unchanged.
	base := writeBase(t, make([][]byte, total))
	var again bytes.Buffer
	st, err := filterRAMDiff(&again, bytes.NewReader(out.Bytes()), ramBlockName, base)
	if err != nil {
		t.Fatal(err)
	}
	if st.PagesSent != int64(len(pages)) || st.PagesKept != int64(len(pages)) || !bytes.Equal(again.Bytes(), out.Bytes()) {
		t.Fatalf("parsed %+v of %d pages; stream unchanged: %v", st, len(pages), bytes.Equal(again.Bytes(), out.Bytes()))
	}
	if !bytes.HasSuffix(out.Bytes(), dev.Bytes()[8:]) {
		t.Fatal("the device sections do not end the stream")
	}
	// Each page's record carries its own index.
	for _, p := range pages[:5] {
		var want [8]byte
		binary.LittleEndian.PutUint64(want[:], uint64(p))
		hdr := make([]byte, 8)
		binary.BigEndian.PutUint64(hdr, uint64(p*guestPageSize)|ramFlagPage|ramFlagContinue)
		i := bytes.Index(out.Bytes(), hdr)
		if p == 0 {
			binary.BigEndian.PutUint64(hdr, ramFlagPage)
			i = bytes.Index(out.Bytes(), append(hdr, append([]byte{byte(len(ramBlockName))}, ramBlockName...)...))
			i += 1 + len(ramBlockName)
		}
		if i < 0 || !bytes.Equal(out.Bytes()[i+8:i+16], want[:]) {
			t.Fatalf("page %d: record at %d", p, i)
		}
	}
}
