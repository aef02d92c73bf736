package storage

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
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

// emptyOverlay returns the bytes of an empty overlay on base (absolute) of
// base's own size: from the cache, or made by CreateOverlay in a directory
// of its own.
func emptyOverlay(ctx context.Context, base string) ([]byte, error) {
	if key, ok := overlayKeyOf(base, 0); ok {
		if b := cachedOverlay(key); b != nil {
			return b, nil
		}
	}
	dir, err := os.MkdirTemp("", "aenv-overlay-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	p := filepath.Join(dir, "overlay.qcow2")
	if err := CreateOverlay(ctx, base, p, 0); err != nil {
		return nil, err
	}
	return os.ReadFile(p)
}

// swappedBacking returns the empty overlay was (on oldBase) on newBase
// instead, made without qemu-img when the two names have the same length:
// the backing file's name is the one thing that differs (its offset and
// size in the header stay), so it is swapped in place. The bases of a
// sandbox (snapshot and layer directories named by equal-length ids) are
// such names.
func swappedBacking(was []byte, oldBase, newBase string) ([]byte, error) {
	if len(oldBase) != len(newBase) || bytes.Count(was, []byte(oldBase)) != 1 {
		return nil, errors.New("the backing name cannot be swapped in place")
	}
	return bytes.Replace(was, []byte(oldBase), []byte(newBase), 1), nil
}

// RebaseEmptyOverlay makes the empty overlay at path, made by
// CreateOverlay on oldBase, an empty overlay on newBase instead, in place:
// the same file (a QEMU that has it open but inactive, waiting for its
// state, reads the new header when the state loads), rewritten and
// synced. It refuses, changing nothing, when the file is not exactly such
// an empty overlay (something wrote to it) or the two bases differ in
// size (the guest's disk would change size under it).
func RebaseEmptyOverlay(ctx context.Context, path, oldBase, newBase string) error {
	oldBase, err := filepath.Abs(oldBase)
	if err != nil {
		return err
	}
	newBase, err = filepath.Abs(newBase)
	if err != nil {
		return err
	}
	oldKey, ok1 := overlayKeyOf(oldBase, 0)
	newKey, ok2 := overlayKeyOf(newBase, 0)
	if !ok1 || !ok2 {
		return fmt.Errorf("rebase %s: %s or %s is not a qcow2 image", path, oldBase, newBase)
	}
	if oldKey.virtualSize != newKey.virtualSize {
		return fmt.Errorf("rebase %s: %s is %d bytes, %s %d", path, newBase, newKey.virtualSize, oldBase, oldKey.virtualSize)
	}
	was, err := emptyOverlay(ctx, oldBase)
	if err != nil {
		return err
	}
	next, err := swappedBacking(was, oldBase, newBase)
	if err != nil {
		next, err = emptyOverlay(ctx, newBase)
	}
	if err != nil {
		return err
	}
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	cur, err := io.ReadAll(io.LimitReader(f, int64(len(was))+1))
	if err != nil {
		return err
	}
	if !bytes.Equal(cur, was) {
		return fmt.Errorf("rebase %s: it is not an empty overlay on %s", path, oldBase)
	}
	if _, err := f.WriteAt(next, 0); err != nil {
		return fmt.Errorf("rebase %s: %w", path, err)
	}
	if err := f.Truncate(int64(len(next))); err != nil {
		return fmt.Errorf("rebase %s: %w", path, err)
	}
	if err := f.Sync(); err != nil {
		return fmt.Errorf("rebase %s: %w", path, err)
	}
	return nil
}
