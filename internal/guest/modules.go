package guest

import (
	"bufio"
	"bytes"
	"debug/elf"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"github.com/klauspost/compress/zstd"
	"github.com/ulikunitz/xz"
)

// WantedModule names a kernel module the guest needs. Optional modules are
// skipped silently when the kernel has neither a module nor a built-in by
// that name.
type WantedModule struct {
	Name     string
	Optional bool
}

// DefaultModules is the set of modules the initramfs carries (with their
// dependencies) unless they are built into the kernel.
var DefaultModules = []WantedModule{
	{Name: "virtio_mmio"},
	{Name: "virtio_blk"},
	{Name: "virtio_net"},
	{Name: "virtio_balloon"},
	{Name: "virtio_rng", Optional: true},
	{Name: "vsock"},
	{Name: "vmw_vsock_virtio_transport"},
	{Name: "overlay"},
	{Name: "ext4"},
	// ACPI power button, so that a host-side system_powerdown reaches init.
	{Name: "button", Optional: true},
	{Name: "evdev", Optional: true},
}

// ModName normalises a module name or file name: "virtio-rng.ko.xz" and
// "kernel/drivers/char/hw_random/virtio-rng.ko" both become "virtio_rng".
func ModName(s string) string {
	s = filepath.Base(s)
	for _, ext := range []string{".xz", ".zst", ".gz"} {
		s = strings.TrimSuffix(s, ext)
	}
	s = strings.TrimSuffix(s, ".ko")
	return strings.ReplaceAll(s, "-", "_")
}

// ModuleSet describes the modules of one kernel: where each module file is
// (relative to the modules directory), which modules each depends on, and
// which are built in.
type ModuleSet struct {
	Path    map[string]string   // module name -> relative file path
	Deps    map[string][]string // module name -> direct (or transitive) dependencies
	Builtin map[string]bool

	dir      string
	depCache map[string][]string
	modCache map[string][]byte
}

// LoadModuleSet indexes the modules directory of a kernel
// (…/lib/modules/<version>). Dependencies come from modules.dep when depmod
// has produced it, otherwise from each module's .modinfo "depends=" field
// (Debian's package ships no modules.dep: depmod runs at install time).
func LoadModuleSet(modulesDir string) (*ModuleSet, error) {
	ms := &ModuleSet{Path: map[string]string{}, Deps: map[string][]string{}, Builtin: map[string]bool{}, dir: modulesDir}
	if b, err := os.ReadFile(filepath.Join(modulesDir, "modules.builtin")); err == nil {
		for _, l := range strings.Fields(string(b)) {
			ms.Builtin[ModName(l)] = true
		}
	} else if !os.IsNotExist(err) {
		return nil, fmt.Errorf("read modules.builtin: %w", err)
	}
	depFile := filepath.Join(modulesDir, "modules.dep")
	if b, err := os.ReadFile(depFile); err == nil {
		paths, deps, err := ParseModulesDep(bytes.NewReader(b))
		if err != nil {
			return nil, fmt.Errorf("parse %s: %w", depFile, err)
		}
		ms.Path, ms.Deps = paths, deps
		return ms, nil
	} else if !os.IsNotExist(err) {
		return nil, fmt.Errorf("read modules.dep: %w", err)
	}
	err := filepath.WalkDir(modulesDir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() || !isModuleFile(d.Name()) {
			return nil
		}
		rel, err := filepath.Rel(modulesDir, p)
		if err != nil {
			return err
		}
		name := ModName(rel)
		if old, ok := ms.Path[name]; !ok || rel < old {
			ms.Path[name] = rel
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("index modules in %s: %w", modulesDir, err)
	}
	// Dependencies are read lazily (see deps) to avoid parsing ~3000 ELF files.
	ms.Deps = nil
	return ms, nil
}

func isModuleFile(n string) bool {
	for _, ext := range []string{".ko", ".ko.xz", ".ko.zst", ".ko.gz"} {
		if strings.HasSuffix(n, ext) {
			return true
		}
	}
	return false
}

// ParseModulesDep parses depmod's modules.dep ("path: dep-path dep-path…").
func ParseModulesDep(r io.Reader) (paths map[string]string, deps map[string][]string, err error) {
	paths = map[string]string{}
	deps = map[string][]string{}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 1<<16), 1<<20)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		mod, rest, ok := strings.Cut(line, ":")
		if !ok {
			return nil, nil, fmt.Errorf("malformed line %q", line)
		}
		name := ModName(mod)
		paths[name] = strings.TrimSpace(mod)
		var ds []string
		for _, d := range strings.Fields(rest) {
			ds = append(ds, ModName(d))
		}
		deps[name] = ds
	}
	return paths, deps, sc.Err()
}

// ResolveModules returns the modules to load, dependencies first, for the
// wanted set. Built-in modules are skipped (and reported in builtin); a
// missing non-optional module, or a missing dependency, is an error. deps
// returns a module's dependencies (direct or transitive); exists reports
// whether a loadable module of that name exists. The order is deterministic:
// wanted modules in the given order, each preceded by its not yet listed
// dependencies in the order deps lists them.
func ResolveModules(wanted []WantedModule, exists func(string) bool, builtin map[string]bool, deps func(string) ([]string, error)) (order, skippedBuiltin []string, err error) {
	const (
		visiting = 1
		done     = 2
	)
	state := map[string]int{}
	var visit func(name string, chain []string) error
	visit = func(name string, chain []string) error {
		switch state[name] {
		case done:
			return nil
		case visiting:
			return fmt.Errorf("module dependency cycle: %s -> %s", strings.Join(chain, " -> "), name)
		}
		if builtin[name] {
			state[name] = done
			return nil
		}
		if !exists(name) {
			return fmt.Errorf("module %s (needed by %s) not found", name, strings.Join(chain, " -> "))
		}
		state[name] = visiting
		ds, err := deps(name)
		if err != nil {
			return fmt.Errorf("dependencies of %s: %w", name, err)
		}
		for _, d := range ds {
			if err := visit(d, append(chain, name)); err != nil {
				return err
			}
		}
		state[name] = done
		order = append(order, name)
		return nil
	}
	for _, w := range wanted {
		name := ModName(w.Name)
		if builtin[name] {
			if state[name] != done {
				skippedBuiltin = append(skippedBuiltin, name)
				state[name] = done
			}
			continue
		}
		if !exists(name) {
			if w.Optional {
				continue
			}
			return nil, nil, fmt.Errorf("module %s not found (neither a module nor built in)", name)
		}
		if err := visit(name, nil); err != nil {
			return nil, nil, err
		}
	}
	return order, skippedBuiltin, nil
}

// Resolve resolves wanted against this kernel's modules (see ResolveModules).
func (ms *ModuleSet) Resolve(wanted []WantedModule) (order, skippedBuiltin []string, err error) {
	exists := func(n string) bool { _, ok := ms.Path[n]; return ok }
	return ResolveModules(wanted, exists, ms.Builtin, ms.deps)
}

func (ms *ModuleSet) deps(name string) ([]string, error) {
	if ms.Deps != nil {
		return ms.Deps[name], nil
	}
	if ms.depCache == nil {
		ms.depCache = map[string][]string{}
	}
	if d, ok := ms.depCache[name]; ok {
		return d, nil
	}
	data, err := ms.ReadModule(name)
	if err != nil {
		return nil, err
	}
	info, err := ModInfo(data)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", ms.Path[name], err)
	}
	var ds []string
	for _, d := range strings.Split(info["depends"], ",") {
		if d = strings.TrimSpace(d); d != "" {
			ds = append(ds, ModName(d))
		}
	}
	ms.depCache[name] = ds
	return ds, nil
}

// ReadModule returns the uncompressed ELF image of a module, decompressing
// .ko.xz / .ko.zst / .ko.gz files so the guest can load it with
// finit_module without in-kernel decompression support.
func (ms *ModuleSet) ReadModule(name string) ([]byte, error) {
	rel, ok := ms.Path[name]
	if !ok {
		return nil, fmt.Errorf("module %s not found", name)
	}
	p := rel
	if !filepath.IsAbs(p) {
		p = filepath.Join(ms.dir, rel)
	}
	if ms.modCache == nil {
		ms.modCache = map[string][]byte{}
	}
	if b, ok := ms.modCache[name]; ok {
		return b, nil
	}
	b, err := readDecompressed(p)
	if err != nil {
		return nil, err
	}
	ms.modCache[name] = b
	return b, nil
}

func readDecompressed(p string) ([]byte, error) {
	f, err := os.Open(p)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var r io.Reader = f
	switch {
	case strings.HasSuffix(p, ".xz"):
		xr, err := xz.NewReader(bufio.NewReader(f))
		if err != nil {
			return nil, fmt.Errorf("xz %s: %w", p, err)
		}
		r = xr
	case strings.HasSuffix(p, ".zst"):
		zr, err := zstd.NewReader(f)
		if err != nil {
			return nil, fmt.Errorf("zstd %s: %w", p, err)
		}
		defer zr.Close()
		r = zr
	case strings.HasSuffix(p, ".gz"):
		return nil, fmt.Errorf("%s: gzip-compressed modules are not supported", p)
	}
	b, err := io.ReadAll(r)
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", p, err)
	}
	return b, nil
}

// ModInfo parses the .modinfo section of a module ELF image into key/value
// pairs (the last value wins for repeated keys such as "alias").
func ModInfo(ko []byte) (map[string]string, error) {
	ef, err := elf.NewFile(bytes.NewReader(ko))
	if err != nil {
		return nil, fmt.Errorf("parse module ELF: %w", err)
	}
	sec := ef.Section(".modinfo")
	if sec == nil {
		return nil, fmt.Errorf("module has no .modinfo section")
	}
	data, err := sec.Data()
	if err != nil {
		return nil, fmt.Errorf("read .modinfo: %w", err)
	}
	info := map[string]string{}
	for _, kv := range bytes.Split(data, []byte{0}) {
		if k, v, ok := strings.Cut(string(kv), "="); ok {
			info[k] = v
		}
	}
	return info, nil
}
