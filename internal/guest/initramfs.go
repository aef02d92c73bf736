package guest

import (
	"bytes"
	"compress/gzip"
	"debug/elf"
	"fmt"
	"github.com/agentenv/agentenv/internal/storage"
	"os"
	"path/filepath"
	"strings"
)

// Paths inside the initramfs, shared with package pid1.
const (
	InitramfsModulesDir  = "/lib/aenv/modules"
	InitramfsModuleOrder = "/lib/aenv/modules.order"
	InitramfsKernelFile  = "/lib/aenv/kernel-version"
)

// initramfsDirs is the directory skeleton of the initramfs.
var initramfsDirs = []string{"dev", "proc", "sys", "newroot", "etc", "tmp", "run", "lib", "lib/aenv", "lib/aenv/modules"}

// BuildInitramfs writes a gzip-compressed newc cpio archive to out holding
// initBinary as /init (a static executable: our envd, which acts as PID 1),
// the directory skeleton, /dev/console, and the kernel modules of
// DefaultModules with their dependencies, uncompressed, listed in load order
// in /lib/aenv/modules.order. The output is written atomically and is
// byte-for-byte reproducible for the same inputs.
func BuildInitramfs(k *Kernel, initBinary string, out string) error {
	_, err := BuildInitramfsModules(k, initBinary, out, DefaultModules)
	return err
}

// BuildInitramfsModules is BuildInitramfs with an explicit module set; it
// returns the module names in load order.
func BuildInitramfsModules(k *Kernel, initBinary string, out string, wanted []WantedModule) ([]string, error) {
	if k == nil {
		return nil, fmt.Errorf("build initramfs: no kernel")
	}
	initData, err := os.ReadFile(initBinary)
	if err != nil {
		return nil, fmt.Errorf("build initramfs: read init binary: %w", err)
	}
	if err := checkStatic(initData); err != nil {
		return nil, fmt.Errorf("build initramfs: init binary %s: %w", initBinary, err)
	}
	ms, err := LoadModuleSet(k.ModulesDir)
	if err != nil {
		return nil, fmt.Errorf("build initramfs: %w", err)
	}
	order, _, err := ms.Resolve(wanted)
	if err != nil {
		return nil, fmt.Errorf("build initramfs for kernel %s: %w", k.Version, err)
	}

	var buf bytes.Buffer
	gz, err := gzip.NewWriterLevel(&buf, gzip.BestSpeed)
	if err != nil {
		return nil, err
	}
	// gzip.Header is left zero: no name, no mtime, so output is reproducible.
	cw := newNewcWriter(gz)
	add := func(e newcEntry) error {
		if err := cw.Add(e); err != nil {
			return fmt.Errorf("build initramfs: %w", err)
		}
		return nil
	}
	for _, d := range initramfsDirs {
		if err := add(newcEntry{Name: d, Mode: cpioTypeDir | 0o755}); err != nil {
			return nil, err
		}
	}
	// The kernel opens /dev/console for init's stdio before init runs.
	if err := add(newcEntry{Name: "dev/console", Mode: cpioTypeChar | 0o600, RdevMajor: 5, RdevMinor: 1}); err != nil {
		return nil, err
	}
	if err := add(newcEntry{Name: "init", Mode: cpioTypeReg | 0o755, Data: initData}); err != nil {
		return nil, err
	}
	var orderFile strings.Builder
	for _, name := range order {
		data, err := ms.ReadModule(name)
		if err != nil {
			return nil, fmt.Errorf("build initramfs: %w", err)
		}
		p := InitramfsModulesDir + "/" + name + ".ko"
		if err := add(newcEntry{Name: p[1:], Mode: cpioTypeReg | 0o644, Data: data}); err != nil {
			return nil, err
		}
		orderFile.WriteString(p + "\n")
	}
	if err := add(newcEntry{Name: InitramfsModuleOrder[1:], Mode: cpioTypeReg | 0o644, Data: []byte(orderFile.String())}); err != nil {
		return nil, err
	}
	if err := add(newcEntry{Name: InitramfsKernelFile[1:], Mode: cpioTypeReg | 0o644, Data: []byte(k.Version + "\n")}); err != nil {
		return nil, err
	}
	if err := cw.Close(); err != nil {
		return nil, fmt.Errorf("build initramfs: %w", err)
	}
	if err := gz.Close(); err != nil {
		return nil, fmt.Errorf("build initramfs: gzip: %w", err)
	}
	if err := os.MkdirAll(filepath.Dir(out), 0o755); err != nil {
		return nil, fmt.Errorf("build initramfs: %w", err)
	}
	if err := storage.WriteFileAtomic(out, buf.Bytes(), 0o644); err != nil {
		return nil, fmt.Errorf("build initramfs: %w", err)
	}
	return order, nil
}

// checkStatic rejects binaries that need a dynamic loader, which the
// initramfs does not have.
func checkStatic(b []byte) error {
	ef, err := elf.NewFile(bytes.NewReader(b))
	if err != nil {
		return fmt.Errorf("not an ELF executable: %w", err)
	}
	for _, p := range ef.Progs {
		if p.Type == elf.PT_INTERP {
			return fmt.Errorf("dynamically linked (build it with CGO_ENABLED=0)")
		}
	}
	return nil
}
