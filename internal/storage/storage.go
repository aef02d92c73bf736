// Package storage owns the on-disk artifacts of sandboxes and templates:
// qcow2 disk layers (read-only template layers and per-sandbox writable
// overlays stacked on them with backing chains) and crash-safe file writes.
// Repository backends (posix_fs, oss) and lazily loaded layers live here too.
package storage

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
)

// FindQEMUImg returns the qemu-img binary or an error saying how to install it.
func FindQEMUImg() (string, error) {
	p, err := exec.LookPath("qemu-img")
	if err != nil {
		return "", errors.New("qemu-img not found: install it with `apt-get install qemu-utils` or run scripts/setup")
	}
	return p, nil
}

// CreateOverlay creates a writable qcow2 layer at path whose backing file is
// the read-only layer base. sizeMiB, when larger than the base's virtual
// size, grows the disk seen by the guest.
func CreateOverlay(ctx context.Context, base, path string, sizeMiB int) error {
	absBase, err := filepath.Abs(base)
	if err != nil {
		return err
	}
	if _, err := os.Stat(absBase); err != nil {
		return fmt.Errorf("base layer: %w", err)
	}
	key, cacheable := overlayKeyOf(absBase, sizeMiB)
	if b := cachedOverlay(key); cacheable && b != nil {
		return writeOverlay(path, b)
	}
	bin, err := FindQEMUImg()
	if err != nil {
		return err
	}
	args := []string{"create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", absBase, path}
	if sizeMiB > 0 {
		info, err := Info(ctx, absBase)
		if err != nil {
			return err
		}
		if int64(sizeMiB)<<20 > info.VirtualSize {
			args = append(args, fmt.Sprintf("%dM", sizeMiB))
		}
	}
	out, err := exec.CommandContext(ctx, bin, args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("qemu-img create overlay %s: %w: %s", path, err, strings.TrimSpace(string(out)))
	}
	if cacheable {
		keepOverlay(key, path)
	}
	return nil
}

// CreateOverlayOver makes a qcow2 overlay at path of virtualSize bytes
// whose header names base as its backing file, without opening base (it
// may be in use by a QEMU, or not be in place yet): the caller vouches
// that base is a qcow2 image of that size.
func CreateOverlayOver(ctx context.Context, base, path string, virtualSize int64) error {
	bin, err := FindQEMUImg()
	if err != nil {
		return err
	}
	if !filepath.IsAbs(base) {
		return fmt.Errorf("overlay %s: backing file %q is not an absolute path", path, base)
	}
	out, err := exec.CommandContext(ctx, bin, "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", base, "-u", path,
		strconv.FormatInt(virtualSize, 10)).CombinedOutput()
	if err != nil {
		return fmt.Errorf("qemu-img create overlay %s: %w: %s", path, err, strings.TrimSpace(string(out)))
	}
	return nil
}

// BackingChain reads the headers of the image at path and of every image
// below it, top first.
func BackingChain(ctx context.Context, path string) ([]ImageInfo, error) {
	bin, err := FindQEMUImg()
	if err != nil {
		return nil, err
	}
	out, err := exec.CommandContext(ctx, bin, "info", "--output=json", "--backing-chain", "-U", path).Output()
	if err != nil {
		return nil, fmt.Errorf("qemu-img info --backing-chain %s: %w", path, err)
	}
	var chain []ImageInfo
	if err := json.Unmarshal(out, &chain); err != nil {
		return nil, fmt.Errorf("parse qemu-img info: %w", err)
	}
	return chain, nil
}

// ImageInfo is what qemu-img reports about a layer.
type ImageInfo struct {
	Filename        string `json:"filename"`
	Format          string `json:"format"`
	VirtualSize     int64  `json:"virtual-size"`
	ActualSize      int64  `json:"actual-size"`
	BackingFilename string `json:"backing-filename"`
}

// Info reads a layer's header.
func Info(ctx context.Context, path string) (*ImageInfo, error) {
	bin, err := FindQEMUImg()
	if err != nil {
		return nil, err
	}
	out, err := exec.CommandContext(ctx, bin, "info", "--output=json", "-U", path).Output()
	if err != nil {
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			return nil, fmt.Errorf("qemu-img info %s: %s", path, strings.TrimSpace(string(ee.Stderr)))
		}
		return nil, fmt.Errorf("qemu-img info %s: %w", path, err)
	}
	var info ImageInfo
	if err := json.Unmarshal(out, &info); err != nil {
		return nil, fmt.Errorf("parse qemu-img info: %w", err)
	}
	return &info, nil
}

// WriteFileAtomic writes data to path so that readers and crashes see either
// the old content or the new, never a torn file: it writes a temporary file
// in the same directory, syncs it, renames it over path and syncs the
// directory.
func WriteFileAtomic(path string, data []byte, perm os.FileMode) error {
	dir := filepath.Dir(path)
	f, err := os.CreateTemp(dir, "."+filepath.Base(path)+".tmp-*")
	if err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	tmp := f.Name()
	defer os.Remove(tmp)
	if _, err := f.Write(data); err != nil {
		f.Close()
		return fmt.Errorf("write %s: %w", path, err)
	}
	if err := f.Chmod(perm); err != nil {
		f.Close()
		return fmt.Errorf("write %s: %w", path, err)
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return fmt.Errorf("sync %s: %w", path, err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	if err := os.Rename(tmp, path); err != nil {
		return fmt.Errorf("rename into %s: %w", path, err)
	}
	return SyncDir(dir)
}

// WriteJSONAtomic writes v as indented JSON to path, atomically (see
// WriteFileAtomic).
func WriteJSONAtomic(path string, v any, perm os.FileMode) error {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	return WriteFileAtomic(path, append(b, '\n'), perm)
}

// ReadJSON reads the JSON file at path into v.
func ReadJSON(path string, v any) error {
	b, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	return json.Unmarshal(b, v)
}

// SyncDir makes a directory's entries (new names, renames) durable.
func SyncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	if err := d.Sync(); err != nil {
		return fmt.Errorf("sync dir %s: %w", dir, err)
	}
	return nil
}

// SyncFile makes a file's content durable (fsync).
func SyncFile(path string) error {
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	if err := f.Sync(); err != nil {
		return fmt.Errorf("sync %s: %w", path, err)
	}
	return nil
}
