package guestsource

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"

	"github.com/agentenv/agentenv/internal/storage"
)

// ReadHost reads the host files Resolve decides from, under root ("/" in
// production): etc/os-release (or usr/lib/os-release) and the apt sources,
// etc/apt/sources.list then etc/apt/sources.list.d/* in name order, as apt
// reads them. Missing or unreadable files are left out.
func ReadHost(root string) Options {
	var o Options
	for _, p := range []string{"etc/os-release", "usr/lib/os-release"} {
		if b, err := os.ReadFile(filepath.Join(root, p)); err == nil {
			o.OSRelease = string(b)
			break
		}
	}
	apt := filepath.Join(root, "etc/apt")
	names := []string{"sources.list"}
	more, _ := filepath.Glob(filepath.Join(apt, "sources.list.d", "*"))
	for _, m := range more {
		names = append(names, filepath.Join("sources.list.d", filepath.Base(m)))
	}
	for _, n := range names {
		if b, err := os.ReadFile(filepath.Join(apt, n)); err == nil {
			o.AptSources = append(o.AptSources, AptFile{Name: n, Text: string(b)})
		}
	}
	return o
}

// FileName is the record of the source `aenv setup` used, kept in the data
// dir's kernel directory.
const FileName = "guest-source.json"

// Save records s in the file path, atomically.
func Save(path string, s Source) error {
	b, err := json.MarshalIndent(s, "", "  ")
	if err != nil {
		return fmt.Errorf("record guest source: %w", err)
	}
	if err := storage.WriteFileAtomic(path, append(b, '\n'), 0o644); err != nil {
		return fmt.Errorf("record guest source: %w", err)
	}
	return nil
}

// Load reads a source recorded by Save. A missing record is an error
// satisfying errors.Is(err, fs.ErrNotExist).
func Load(path string) (Source, error) {
	var s Source
	b, err := os.ReadFile(path)
	if err != nil {
		return s, fmt.Errorf("read guest source record: %w", err)
	}
	if err := json.Unmarshal(b, &s); err != nil {
		return s, fmt.Errorf("parse guest source record %s: %w", path, err)
	}
	return s, nil
}

// CheckHostFiles reports what the host lacks to build from s: the archive
// keyring (without it apt refuses the mirror and debootstrap would not
// verify it) and, when debootstrap is true, debootstrap's script for the
// suite. exists is os.Stat in production.
func (s Source) CheckHostFiles(debootstrap bool, exists func(path string) bool) error {
	if s.Keyring != "" && !exists(s.Keyring) {
		return fmt.Errorf("guest distro %s: the archive keyring %s is missing; install it with `apt-get install %s`",
			s.Distro, s.Keyring, s.KeyringPackage)
	}
	if script := filepath.Join(DebootstrapScripts, s.Suite); debootstrap && !exists(script) {
		return fmt.Errorf("guest distro %s: this host's debootstrap does not know suite %s (no %s); install a newer debootstrap",
			s.Distro, s.Suite, script)
	}
	return nil
}

// DebootstrapScripts is where debootstrap keeps its per-suite scripts.
const DebootstrapScripts = "/usr/share/debootstrap/scripts"
