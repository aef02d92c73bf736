package vmm

import (
	"bytes"
	"encoding/binary"
	"errors"
	"os"
	"path/filepath"
	"testing"
)

// streamBuilder writes migration streams in QEMU's format for tests.
type streamBuilder struct {
	bytes.Buffer
	last string // block of the previous page record in this section
}

func (b *streamBuilder) be32(v uint32) { binary.Write(&b.Buffer, binary.BigEndian, v) }
func (b *streamBuilder) be64(v uint64) { binary.Write(&b.Buffer, binary.BigEndian, v) }
func (b *streamBuilder) str(s string)  { b.WriteByte(byte(len(s))); b.WriteString(s) }

// command writes a QEMU_VM_COMMAND, as QEMU 8 and later send in a save
// (e.g. the switchover's start).
func (b *streamBuilder) command(cmd uint16, data []byte) {
	b.WriteByte(secCommand)
	binary.Write(&b.Buffer, binary.BigEndian, cmd)
	binary.Write(&b.Buffer, binary.BigEndian, uint16(len(data)))
	b.Write(data)
}

func (b *streamBuilder) header(ignoreShared bool) {
	b.be32(migMagic)
	b.be32(migVersion)
	b.WriteByte(secConfiguration)
	b.be32(7)
	b.WriteString("microvm")
	if ignoreShared {
		b.WriteByte(secSubsection)
		b.str("configuration/capabilities")
		b.be32(1)
		b.be32(1)
		b.str("x-ignore-shared")
	}
}

type testBlock struct {
	name  string
	pages int
}

func (b *streamBuilder) ramStart(id uint32, blocks []testBlock, ignoreShared bool) {
	b.WriteByte(secStart)
	b.be32(id)
	b.str("ram")
	b.be32(0)
	b.be32(4)
	var total uint64
	for _, bl := range blocks {
		total += uint64(bl.pages) * guestPageSize
	}
	b.be64(total | ramFlagMemSize)
	for _, bl := range blocks {
		b.str(bl.name)
		b.be64(uint64(bl.pages) * guestPageSize)
		if ignoreShared {
			b.be64(0x100000)
		}
	}
	b.be64(ramFlagEOS)
	b.footer(id)
}

func (b *streamBuilder) section(typ byte, id uint32) {
	b.WriteByte(typ)
	b.be32(id)
	b.last = ""
}

func (b *streamBuilder) footer(id uint32) {
	b.WriteByte(secFooter)
	b.be32(id)
}

// page writes a page record; data nil writes a zero page.
func (b *streamBuilder) page(block string, index int, data []byte) {
	flags := uint64(ramFlagPage)
	if data == nil {
		flags = ramFlagZero
	}
	if block == b.last {
		flags |= ramFlagContinue
	}
	b.be64(uint64(index)*guestPageSize | flags)
	if flags&ramFlagContinue == 0 {
		b.str(block)
	}
	b.last = block
	if data == nil {
		b.WriteByte(0)
	} else {
		b.Write(data)
	}
}

func (b *streamBuilder) eos() { b.be64(ramFlagEOS) }

func (b *streamBuilder) devicesAndEOF() {
	b.WriteByte(secFull)
	b.be32(9)
	b.str("serial")
	b.be32(0)
	b.be32(1)
	b.Write([]byte{1, 2, 3, 0x7e, 0x02, 0x00}) // device bytes that look like anything
	b.footer(9)
	b.WriteByte(secEOF)
	b.WriteByte(0x06)
	b.be32(2)
	b.WriteString("{}")
}

func filled(v byte) []byte { return bytes.Repeat([]byte{v}, guestPageSize) }

// writeBase writes a RAM image of pages (nil: a hole) and opens it.
func writeBase(t *testing.T, pages [][]byte) *baseImage {
	t.Helper()
	path := filepath.Join(t.TempDir(), "memory")
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	for i, p := range pages {
		if p != nil {
			f.WriteAt(p, int64(i)*guestPageSize)
		}
	}
	f.Truncate(int64(len(pages)) * guestPageSize)
	f.Close()
	img, err := openBaseImage(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(img.close)
	return img
}

func TestRAMDiffKeepsOnlyChangedPages(t *testing.T) {
	blocks := []testBlock{{"mem", 6}, {"pc.bios", 1}}
	base := writeBase(t, [][]byte{filled(1), filled(2), nil, filled(4), nil, filled(6)})
	for _, ignoreShared := range []bool{false, true} {
		in := &streamBuilder{}
		in.header(ignoreShared)
		in.ramStart(2, blocks, ignoreShared)
		in.section(secPart, 2)
		in.page("mem", 0, filled(1))     // equal: dropped
		in.page("mem", 1, filled(9))     // changed: kept
		in.page("mem", 2, nil)           // zero over a hole: dropped
		in.page("pc.bios", 0, filled(7)) // other blocks: always kept
		in.page("mem", 3, nil)           // zeroed: kept
		in.eos()
		in.footer(2)
		in.section(secEnd, 2)
		in.page("mem", 4, filled(5)) // written over a hole: kept
		in.page("mem", 5, filled(6)) // equal: dropped
		in.eos()
		in.footer(2)
		in.command(11, nil)
		in.command(3, []byte{1, 2, 3})
		in.devicesAndEOF()

		want := &streamBuilder{}
		want.header(ignoreShared)
		want.ramStart(2, blocks, ignoreShared)
		want.section(secPart, 2)
		want.page("mem", 1, filled(9))
		want.page("pc.bios", 0, filled(7))
		want.page("mem", 3, nil)
		want.eos()
		want.footer(2)
		want.section(secEnd, 2)
		want.page("mem", 4, filled(5))
		want.eos()
		want.footer(2)
		want.command(11, nil) // commands pass as they are
		want.command(3, []byte{1, 2, 3})
		want.devicesAndEOF()

		var out bytes.Buffer
		st, err := filterRAMDiff(&out, bytes.NewReader(in.Bytes()), "mem", base)
		if err != nil {
			t.Fatalf("ignoreShared=%v: %v", ignoreShared, err)
		}
		if st.PagesSent != 6 || st.PagesKept != 3 || st.Bytes != int64(out.Len()) {
			t.Errorf("ignoreShared=%v: stats %+v", ignoreShared, st)
		}
		if !bytes.Equal(out.Bytes(), want.Bytes()) {
			t.Errorf("ignoreShared=%v: output differs from the expected stream (%d vs %d bytes)", ignoreShared, out.Len(), want.Len())
		}
	}
}

func TestRAMDiffRejectsWhatItCannotParse(t *testing.T) {
	base := writeBase(t, [][]byte{filled(1)})
	valid := func() *streamBuilder {
		b := &streamBuilder{}
		b.header(false)
		b.ramStart(2, []testBlock{{"mem", 1}}, false)
		return b
	}
	for _, tc := range []struct {
		name   string
		stream func() []byte
	}{
		{"bad magic", func() []byte { return []byte("QEVX\x00\x00\x00\x03") }},
		{"truncated", func() []byte { b := valid(); return b.Bytes()[:b.Len()-3] }},
		{"truncated command", func() []byte { b := valid(); b.command(3, []byte{1, 2, 3}); return b.Bytes()[:b.Len()-1] }},
		{"compressed pages", func() []byte {
			b := valid()
			b.section(secPart, 2)
			b.be64(0x100 | 0x40) // XBZRLE
			return b.Bytes()
		}},
		{"block migration", func() []byte {
			b := &streamBuilder{}
			b.header(false)
			b.WriteByte(secStart)
			b.be32(3)
			b.str("block")
			b.be32(0)
			b.be32(1)
			return b.Bytes()
		}},
		{"continue without a block", func() []byte {
			b := valid()
			b.section(secPart, 2)
			b.be64(ramFlagPage | ramFlagContinue)
			b.Write(filled(1))
			return b.Bytes()
		}},
		{"part of an unknown section", func() []byte {
			b := valid()
			b.section(secPart, 5)
			return b.Bytes()
		}},
		{"block list that does not add up", func() []byte {
			b := &streamBuilder{}
			b.header(false)
			b.WriteByte(secStart)
			b.be32(2)
			b.str("ram")
			b.be32(0)
			b.be32(4)
			b.be64(2*guestPageSize | ramFlagMemSize)
			b.str("mem")
			b.be64(3 * guestPageSize)
			return b.Bytes()
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var out bytes.Buffer
			if _, err := filterRAMDiff(&out, bytes.NewReader(tc.stream()), "mem", base); !errors.Is(err, errStream) {
				t.Fatalf("got %v, want a stream error", err)
			}
		})
	}
}

func FuzzRAMDiff(f *testing.F) {
	b := &streamBuilder{}
	b.header(true)
	b.ramStart(2, []testBlock{{"mem", 2}}, true)
	b.section(secPart, 2)
	b.page("mem", 0, filled(3))
	b.page("mem", 1, nil)
	b.eos()
	b.devicesAndEOF()
	f.Add(b.Bytes())
	f.Fuzz(func(t *testing.T, data []byte) {
		path := filepath.Join(t.TempDir(), "memory")
		if err := os.WriteFile(path, filled(3), 0o600); err != nil {
			t.Fatal(err)
		}
		img, err := openBaseImage(path)
		if err != nil {
			t.Fatal(err)
		}
		defer img.close()
		var out bytes.Buffer
		_, _ = filterRAMDiff(&out, bytes.NewReader(data), "mem", img)
	})
}
