package guest

import (
	"bytes"
	"compress/gzip"
	"encoding/binary"
	"os"
	"path/filepath"
	"testing"

	"github.com/pierrec/lz4/v4"
)

func fakeELF(n int) []byte {
	b := make([]byte, n)
	copy(b, "\x7fELF")
	for i := 4; i < n; i++ {
		b[i] = byte(i * 7 % 251)
	}
	return b
}

func TestExtractVmlinuxSynthetic(t *testing.T) {
	img := fakeELF(3 << 20)
	var gz bytes.Buffer
	w := gzip.NewWriter(&gz)
	w.Write(img)
	w.Close()

	var lz bytes.Buffer
	lz.Write([]byte{0x02, 0x21, 0x4c, 0x18})
	comp := make([]byte, lz4.CompressBlockBound(len(img)))
	n, err := lz4.CompressBlock(img, comp, nil)
	if err != nil || n == 0 {
		t.Fatalf("lz4 compress: %d %v", n, err)
	}
	binary.Write(&lz, binary.LittleEndian, uint32(n))
	lz.Write(comp[:n])
	binary.Write(&lz, binary.LittleEndian, uint32(len(img))) // trailing size, as the kernel appends

	for name, payload := range map[string][]byte{"gzip": gz.Bytes(), "lz4": lz.Bytes()} {
		t.Run(name, func(t *testing.T) {
			dir := t.TempDir()
			bz := append(append([]byte("MZ fake setup code \x1f\x8b junk"), payload...), "trailer"...)
			in := filepath.Join(dir, "vmlinuz")
			if err := os.WriteFile(in, bz, 0o644); err != nil {
				t.Fatal(err)
			}
			out := filepath.Join(dir, "vmlinux")
			if err := ExtractVmlinux(in, out); err != nil {
				t.Fatal(err)
			}
			got, _ := os.ReadFile(out)
			if !bytes.Equal(got, img) {
				t.Errorf("extracted %d bytes, want %d identical", len(got), len(img))
			}
		})
	}
	dir := t.TempDir()
	in := filepath.Join(dir, "vmlinuz")
	os.WriteFile(in, []byte("no payload here"), 0o644)
	if err := ExtractVmlinux(in, filepath.Join(dir, "x")); err == nil {
		t.Error("extracted from garbage")
	}
}
