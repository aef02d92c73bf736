package guest

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"github.com/agentenv/agentenv/internal/guestsource"
	"github.com/agentenv/agentenv/internal/storage"
)

// KernelMetaPackage is the Debian metapackage whose dependency names the
// concrete guest kernel package.
const KernelMetaPackage = "linux-image-cloud-amd64"

// completeMarker is written last into an unpacked kernel directory.
const completeMarker = ".aenv-complete"

// currentFile in the kernel directory names the version FetchKernel last
// resolved; LoadKernel prefers it.
const currentFile = "current"

// Kernel is an unpacked guest kernel.
type Kernel struct {
	Version    string // e.g. "6.1.0-57-cloud-amd64"
	Vmlinuz    string // absolute path of the bzImage
	ModulesDir string // absolute path of lib/modules/<Version>
	// Vmlinux is the uncompressed ELF kernel with a PVH entry point,
	// extracted from Vmlinuz at fetch time, or "" if that was not possible.
	// QEMU (-M microvm -kernel) boots it ~0.3-0.4 s faster under TCG, as the
	// kernel need not decompress itself.
	Vmlinux string
}

// BootImage returns the kernel file to give QEMU's -kernel: Vmlinux when
// available, else Vmlinuz.
func (k *Kernel) BootImage() string {
	if k.Vmlinux != "" {
		return k.Vmlinux
	}
	return k.Vmlinuz
}

// FetchKernel resolves the concrete kernel package behind
// linux-image-cloud-amd64 with apt-cache, downloads it with apt-get download
// and unpacks it with dpkg-deb into dir/<version>/. It is idempotent: a
// kernel already unpacked completely is returned without downloading. It
// uses the host's apt: its sources, lists and keys.
func FetchKernel(ctx context.Context, dir string, log func(format string, args ...any)) (*Kernel, error) {
	return FetchKernelFrom(ctx, dir, guestsource.Source{KernelPackage: KernelMetaPackage, HostMirror: true}, log)
}

// FetchKernelFrom is FetchKernel for src's kernel metapackage
// (src.KernelPackage). With src.HostMirror it uses the host's apt, as
// FetchKernel does. Otherwise apt-get and apt-cache run with a private
// configuration in dir/.apt (guestsource.AptOptions) that reads only src's
// mirror, suite and components, after an apt-get update of its own: the
// host's lists and distribution do not matter, but the archive keyring
// src.Keyring must be installed on the host. A kernel package without its
// modules (Ubuntu ships them in linux-modules-<version>) is completed with
// that package.
func FetchKernelFrom(ctx context.Context, dir string, src guestsource.Source, log func(format string, args ...any)) (*Kernel, error) {
	if log == nil {
		log = func(string, ...any) {}
	}
	meta := src.KernelPackage
	if meta == "" {
		meta = KernelMetaPackage
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("create kernel dir: %w", err)
	}
	var apt guestsource.Apt
	var pkg string
	var err error
	if src.HostMirror {
		pkg, err = resolveKernelPackage(ctx, apt, meta)
		if err != nil {
			log("guest kernel: %v; running apt-get update", err)
			if out, uerr := exec.CommandContext(ctx, "apt-get", "update").CombinedOutput(); uerr != nil {
				err = fmt.Errorf("%w (apt-get update also failed: %v: %s)", err, uerr, guestsource.LastLines(out, 5))
			} else {
				pkg, err = resolveKernelPackage(ctx, apt, meta)
			}
			if err != nil {
				// Offline, or apt is broken: a kernel fetched earlier will do.
				if k, lerr := LoadKernel(dir); lerr == nil {
					log("guest kernel: cannot resolve %s (%v); using %s fetched earlier", meta, err, k.Version)
					return k, nil
				}
				return nil, fmt.Errorf("resolve %s: %w", meta, err)
			}
		}
	} else {
		if apt, err = src.PrivateApt(ctx, filepath.Join(dir, ".apt"), log); err != nil {
			return nil, err
		}
		if pkg, err = resolveKernelPackage(ctx, apt, meta); err != nil {
			return nil, fmt.Errorf("resolve %s from %s: %w", meta, src.Mirror, err)
		}
	}
	version := strings.TrimPrefix(pkg, "linux-image-")
	dest := filepath.Join(dir, version)
	if k, err := kernelAt(dest, version); err == nil {
		log("guest kernel %s already present in %s", version, dest)
		if k.Vmlinux == "" && ensureVmlinux(dest, version, log) {
			if k, err = kernelAt(dest, version); err != nil {
				return nil, err
			}
		}
		if err := storage.WriteFileAtomic(filepath.Join(dir, currentFile), []byte(version+"\n"), 0o644); err != nil {
			return nil, err
		}
		return k, nil
	}

	tmp, err := os.MkdirTemp(dir, ".fetch-")
	if err != nil {
		return nil, fmt.Errorf("create temp dir: %w", err)
	}
	defer os.RemoveAll(tmp)
	// apt's download sandbox user (_apt) must be able to write here.
	if err := os.Chmod(tmp, 0o777); err != nil {
		return nil, fmt.Errorf("chmod temp dir: %w", err)
	}
	log("guest kernel: downloading %s", pkg)
	start := time.Now()
	unpack := filepath.Join(tmp, "unpack")
	deb, err := apt.FetchDeb(ctx, tmp, pkg, unpack)
	if err != nil {
		return nil, err
	}
	marker := fmt.Sprintf("package=%s\ndeb=%s\n", pkg, deb)
	if _, err := findKernelFiles(unpack, version); err != nil {
		modules := "linux-modules-" + version
		if !fileExists(filepath.Join(unpack, "boot", "vmlinuz-"+version)) {
			return nil, fmt.Errorf("unpacked %s: %w", deb, err)
		}
		log("guest kernel: %s holds no modules; downloading %s", pkg, modules)
		mdeb, merr := apt.FetchDeb(ctx, tmp, modules, unpack)
		if merr != nil {
			return nil, fmt.Errorf("unpacked %s: %w; and %w", deb, err, merr)
		}
		if _, err := findKernelFiles(unpack, version); err != nil {
			return nil, fmt.Errorf("unpacked %s and %s: %w", deb, mdeb, err)
		}
		marker += fmt.Sprintf("modules=%s\n", mdeb)
	}
	// QEMU, running unprivileged, reads the image (Ubuntu's is mode 0600).
	if err := os.Chmod(filepath.Join(unpack, "boot", "vmlinuz-"+version), 0o644); err != nil {
		return nil, fmt.Errorf("chmod kernel image: %w", err)
	}
	ensureVmlinux(unpack, version, log)
	marker += fmt.Sprintf("fetched=%s\n", time.Now().UTC().Format(time.RFC3339))
	if err := os.WriteFile(filepath.Join(unpack, completeMarker), []byte(marker), 0o644); err != nil {
		return nil, fmt.Errorf("write marker: %w", err)
	}
	if err := os.Chmod(unpack, 0o755); err != nil {
		return nil, fmt.Errorf("chmod: %w", err)
	}
	// An incomplete earlier attempt is replaced.
	if err := os.RemoveAll(dest); err != nil {
		return nil, fmt.Errorf("remove incomplete %s: %w", dest, err)
	}
	if err := os.Rename(unpack, dest); err != nil {
		return nil, fmt.Errorf("install kernel into %s: %w", dest, err)
	}
	if err := storage.WriteFileAtomic(filepath.Join(dir, currentFile), []byte(version+"\n"), 0o644); err != nil {
		return nil, err
	}
	log("guest kernel %s unpacked into %s in %s", version, dest, time.Since(start).Round(time.Millisecond))
	return kernelAt(dest, version)
}

// LoadKernel finds a kernel previously fetched into dir by FetchKernel.
func LoadKernel(dir string) (*Kernel, error) {
	notFound := fmt.Errorf("guest kernel not found in %s: run `aenv setup`", dir)
	if b, err := os.ReadFile(filepath.Join(dir, currentFile)); err == nil {
		v := strings.TrimSpace(string(b))
		if k, err := kernelAt(filepath.Join(dir, v), v); err == nil {
			return k, nil
		}
	}
	ents, err := os.ReadDir(dir)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil, notFound
		}
		return nil, fmt.Errorf("read kernel dir: %w", err)
	}
	var found []*Kernel
	for _, e := range ents {
		if !e.IsDir() || strings.HasPrefix(e.Name(), ".") {
			continue
		}
		if k, err := kernelAt(filepath.Join(dir, e.Name()), e.Name()); err == nil {
			found = append(found, k)
		}
	}
	if len(found) == 0 {
		return nil, notFound
	}
	sort.Slice(found, func(i, j int) bool { return found[i].Version < found[j].Version })
	return found[len(found)-1], nil
}

func kernelAt(root, version string) (*Kernel, error) {
	if _, err := os.Stat(filepath.Join(root, completeMarker)); err != nil {
		return nil, fmt.Errorf("kernel %s incomplete: %w", root, err)
	}
	return findKernelFiles(root, version)
}

func findKernelFiles(root, version string) (*Kernel, error) {
	abs, err := filepath.Abs(root)
	if err != nil {
		return nil, err
	}
	k := &Kernel{Version: version, Vmlinuz: filepath.Join(abs, "boot", "vmlinuz-"+version)}
	if _, err := os.Stat(k.Vmlinuz); err != nil {
		return nil, fmt.Errorf("no kernel image: %w", err)
	}
	if v := filepath.Join(abs, "boot", "vmlinux-"+version); fileExists(v) {
		k.Vmlinux = v
	}
	for _, d := range []string{"lib/modules", "usr/lib/modules"} {
		p := filepath.Join(abs, d, version)
		if st, err := os.Stat(p); err == nil && st.IsDir() {
			k.ModulesDir = p
			return k, nil
		}
	}
	return nil, fmt.Errorf("no modules directory for %s under %s", version, abs)
}

// resolveKernelPackage asks apt-cache which linux-image-<version>-<flavour>
// package the metapackage meta depends on.
func resolveKernelPackage(ctx context.Context, apt guestsource.Apt, meta string) (string, error) {
	out, err := apt.Command(ctx, "apt-cache", "depends", meta).CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("apt-cache depends %s: %w: %s", meta, err, guestsource.LastLines(out, 3))
	}
	if pkg := guestsource.KernelPackage(string(out), meta); pkg != "" {
		return pkg, nil
	}
	return "", fmt.Errorf("apt-cache depends %s names no %s-<version> package", meta, meta)
}

func fileExists(p string) bool {
	st, err := os.Stat(p)
	return err == nil && st.Mode().IsRegular()
}

// ensureVmlinux extracts boot/vmlinux-<version> from boot/vmlinuz-<version>
// under root if it is not there yet, keeping it only if QEMU can boot it
// directly (PVH entry point). Failure is not an error: vmlinuz still boots.
func ensureVmlinux(root, version string, log func(string, ...any)) bool {
	v := filepath.Join(root, "boot", "vmlinux-"+version)
	if fileExists(v) {
		return true
	}
	if err := ExtractVmlinux(filepath.Join(root, "boot", "vmlinuz-"+version), v); err != nil {
		log("guest kernel: no uncompressed vmlinux (boot uses vmlinuz): %v", err)
		return false
	}
	if !HasPVHEntry(v) {
		log("guest kernel: vmlinux has no PVH entry point; boot uses vmlinuz")
		_ = os.Remove(v)
		return false
	}
	return true
}
