package storage

import (
	"encoding/binary"
	"fmt"
	"io"
	"os"
	"sync"
)

// An empty overlay is the same bytes for the same base and size: a qcow2
// header naming the base, its tables, nothing that differs between two
// runs of qemu-img (qcow2 holds no time or identifier). CreateOverlay keeps
// the ones it made and writes a copy instead of running qemu-img again,
// which costs a process (14.5 ms here, most of it qemu-img's start) per
// sandbox: sixteen of them in a fork into sixteen children, one in each
// create.

// overlayKey names what an empty overlay's bytes depend on: the base as
// its header names it (an absolute path), the base's virtual size, which
// the overlay takes, and the size asked for.
type overlayKey struct {
	base        string
	virtualSize uint64
	sizeMiB     int
}

// overlayCacheMax bounds the overlays kept; each is a few hundred KB (196
// KB for a 2 GiB disk with 64 KiB clusters).
const (
	overlayCacheMax = 32
	overlayMaxBytes = 4 << 20
)

var overlays = struct {
	sync.Mutex
	m     map[overlayKey][]byte
	order []overlayKey // oldest first
}{m: map[overlayKey][]byte{}}

// overlayKeyOf reads the base's virtual size from its qcow2 header (bytes
// 24-31, after the magic); a base that is no qcow2 is not cached.
func overlayKeyOf(absBase string, sizeMiB int) (overlayKey, bool) {
	f, err := os.Open(absBase)
	if err != nil {
		return overlayKey{}, false
	}
	defer f.Close()
	var hdr [32]byte
	if _, err := io.ReadFull(f, hdr[:]); err != nil || string(hdr[:4]) != "QFI\xfb" {
		return overlayKey{}, false
	}
	return overlayKey{base: absBase, virtualSize: binary.BigEndian.Uint64(hdr[24:32]), sizeMiB: sizeMiB}, true
}

func cachedOverlay(k overlayKey) []byte {
	overlays.Lock()
	defer overlays.Unlock()
	return overlays.m[k]
}

// keepOverlay remembers the overlay qemu-img just made at path for k.
func keepOverlay(k overlayKey, path string) {
	b, err := os.ReadFile(path)
	if err != nil || len(b) == 0 || len(b) > overlayMaxBytes {
		return
	}
	overlays.Lock()
	defer overlays.Unlock()
	if _, ok := overlays.m[k]; ok {
		return
	}
	if len(overlays.order) == overlayCacheMax {
		delete(overlays.m, overlays.order[0])
		overlays.order = overlays.order[1:]
	}
	overlays.m[k] = b
	overlays.order = append(overlays.order, k)
}

// writeOverlay writes a copy of an overlay's bytes to path, as qemu-img
// would (replacing a file there, mode 0644 less the umask).
func writeOverlay(path string, b []byte) error {
	if err := os.WriteFile(path, b, 0o644); err != nil {
		return fmt.Errorf("create overlay %s: %w", path, err)
	}
	return nil
}
