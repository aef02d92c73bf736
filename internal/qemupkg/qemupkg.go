// Package qemupkg installs a QEMU from a Debian suite's packages (for
// example 10.0 from bookworm-backports) into a private prefix beside the
// system's QEMU, without touching the host's packages, and gives the path of
// a launcher that runs it with its own firmware and data files. A node runs
// its sandboxes on it with --qemu (AENV_QEMU); CI runs the VM lifecycle tests
// on it as well as on the system's QEMU.
package qemupkg

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"time"

	"github.com/agentenv/agentenv/internal/guestsource"
	"github.com/agentenv/agentenv/internal/storage"
	"github.com/agentenv/agentenv/internal/vmm"
)

// Packages are the Debian packages that make a working
// qemu-system-x86_64: the binary, its modules, and the firmware and data
// files it loads. The libraries it links against are the host's (measured:
// the bookworm-backports 10.0 build runs on bookworm's). The module
// packages matter although sandboxes load no module: QEMU looks for a
// module in its own directory, then in the system's (Debian's QEMU 7.2
// keeps its OpenGL and spice modules in qemu-system-common, 10.0 splits
// them out), and a module of another build that it finds there aborts any
// command listing device types (qom-list-types, -device help).
var Packages = []string{"qemu-system-x86", "qemu-system-common", "qemu-system-data",
	"qemu-system-modules-opengl", "qemu-system-modules-spice"}

// Launcher is the name of the script in an installed prefix that runs its
// QEMU with -L pointing at its own data files.
const Launcher = "qemu-system-x86_64"

const completeMarker = ".complete"

// Options say which QEMU to install and where.
type Options struct {
	Dir     string // installs go to Dir/<Debian version>/
	Suite   string // the Debian suite, e.g. bookworm-backports
	Version string // the upstream version wanted, e.g. "10.0" (a prefix of it)
	// Mirror is the Debian archive URL; empty means the host's apt source
	// that carries the suite's release (bookworm for bookworm-backports).
	Mirror string
	// AptSources are the host's apt sources (guestsource.ReadHost), read
	// when Mirror is empty.
	AptSources []guestsource.AptFile
	Log        func(format string, args ...any)
}

var suiteRE = regexp.MustCompile(`^[a-z]+(-[a-z]+)?$`)

// source is the Debian archive suite the packages come from.
func (o Options) source() (guestsource.Source, error) {
	if !suiteRE.MatchString(o.Suite) {
		return guestsource.Source{}, fmt.Errorf("suite %q: want a Debian suite such as bookworm-backports", o.Suite)
	}
	release, _, _ := strings.Cut(o.Suite, "-")
	src := guestsource.Source{
		Suite: o.Suite, Components: []string{"main"}, Mirror: o.Mirror,
		Keyring: "/usr/share/keyrings/debian-archive-keyring.gpg", KeyringPackage: "debian-archive-keyring",
	}
	if src.Mirror == "" {
		uri, _ := guestsource.MirrorFor(o.AptSources, release)
		if uri == "" {
			return src, fmt.Errorf("the host's apt sources carry no %s suite to take the mirror of %s from: pass --mirror with a Debian archive URL", release, o.Suite)
		}
		src.Mirror = uri
	}
	if _, err := os.Stat(src.Keyring); err != nil {
		return src, fmt.Errorf("the Debian archive keyring %s is missing: apt-get install %s", src.Keyring, src.KeyringPackage)
	}
	return src, nil
}

// Install makes sure Dir holds a complete install of the newest version of
// Packages in Suite whose upstream version starts with Version, and returns
// the path of its launcher. An install already complete is reused without
// downloading anything once the version is resolved; an interrupted one is
// replaced. The launcher is probed (vmm.ProbeQEMU) before the install is
// marked complete.
func Install(ctx context.Context, o Options) (string, error) {
	log := o.Log
	if log == nil {
		log = func(string, ...any) {}
	}
	if o.Version == "" || !regexp.MustCompile(`^\d+(\.\d+){0,2}$`).MatchString(o.Version) {
		return "", fmt.Errorf("version %q: want an upstream QEMU version such as 10.0", o.Version)
	}
	src, err := o.source()
	if err != nil {
		return "", err
	}
	if err := os.MkdirAll(o.Dir, 0o755); err != nil {
		return "", fmt.Errorf("create %s: %w", o.Dir, err)
	}
	apt, err := src.PrivateApt(ctx, filepath.Join(o.Dir, ".apt"), log)
	if err != nil {
		return "", err
	}
	out, err := apt.Command(ctx, "apt-cache", "madison", Packages[0]).CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("apt-cache madison %s: %w: %s", Packages[0], err, guestsource.LastLines(out, 3))
	}
	version, err := PickVersion(string(out), o.Suite, o.Version)
	if err != nil {
		return "", err
	}
	dest := filepath.Join(o.Dir, strings.NewReplacer(":", "_", "~", "_", "+", "_").Replace(version))
	launcher := filepath.Join(dest, Launcher)
	if _, err := os.Stat(filepath.Join(dest, completeMarker)); err == nil {
		log("QEMU %s from %s already installed in %s", version, o.Suite, dest)
		return launcher, nil
	}

	tmp, err := os.MkdirTemp(o.Dir, ".install-")
	if err != nil {
		return "", fmt.Errorf("create temp dir: %w", err)
	}
	defer os.RemoveAll(tmp)
	// apt's download sandbox user (_apt) must be able to write here.
	if err := os.Chmod(tmp, 0o777); err != nil {
		return "", err
	}
	start := time.Now()
	unpack := filepath.Join(tmp, "prefix")
	root := filepath.Join(unpack, "root")
	if err := os.MkdirAll(root, 0o755); err != nil {
		return "", err
	}
	var debs []string
	for _, p := range Packages {
		log("downloading %s=%s from %s %s", p, version, src.Mirror, o.Suite)
		deb, err := apt.FetchDeb(ctx, tmp, p+"="+version, root)
		if err != nil {
			return "", err
		}
		debs = append(debs, deb)
	}
	if err := os.WriteFile(filepath.Join(unpack, Launcher), []byte(launcherScript), 0o755); err != nil {
		return "", err
	}
	if err := os.Chmod(unpack, 0o755); err != nil {
		return "", err
	}
	// The probe runs the launcher where it will stay, so the move comes
	// first and the marker last.
	if err := os.RemoveAll(dest); err != nil {
		return "", fmt.Errorf("remove incomplete %s: %w", dest, err)
	}
	if err := os.Rename(unpack, dest); err != nil {
		return "", fmt.Errorf("install into %s: %w", dest, err)
	}
	info, err := vmm.ProbeQEMU(ctx, launcher)
	if err != nil {
		return "", fmt.Errorf("the unpacked QEMU does not run here: %w", err)
	}
	marker := fmt.Sprintf("suite=%s\nmirror=%s\nversion=%s\nqemu=%s\ndebs=%s\ninstalled=%s\n", o.Suite, src.Mirror, version,
		info.Version, strings.Join(debs, ","), time.Now().UTC().Format(time.RFC3339))
	if err := storage.WriteFileAtomic(filepath.Join(dest, completeMarker), []byte(marker), 0o644); err != nil {
		return "", err
	}
	log("QEMU %s (%s from %s) installed in %s in %s", info.Version, version, o.Suite, dest, time.Since(start).Round(time.Millisecond))
	return launcher, nil
}

// launcherScript runs the prefix's QEMU on the prefix's firmware and data
// files (keymaps, option ROMs, qboot), found relative to the script.
const launcherScript = `#!/bin/sh
# Runs the QEMU unpacked beside this script (aenv qemu install).
here=$(dirname "$(readlink -f "$0")")
QEMU_MODULE_DIR=$here/root/usr/lib/x86_64-linux-gnu/qemu
export QEMU_MODULE_DIR
exec "$here/root/usr/bin/qemu-system-x86_64" -L "$here/root/usr/share/qemu" "$@"
`

// PickVersion reads `apt-cache madison` output ("pkg | version | mirror
// suite/component arch Packages" rows, newest first) and returns the newest
// version from suite whose upstream part (no epoch, no Debian revision)
// starts with want ("10.0" matches 10.0.2, not 10.1 or 10.00).
func PickVersion(madison, suite, want string) (string, error) {
	var seen []string
	sc := bufio.NewScanner(strings.NewReader(madison))
	for sc.Scan() {
		cols := strings.Split(sc.Text(), "|")
		if len(cols) < 3 {
			continue
		}
		v := strings.TrimSpace(cols[1])
		from := strings.Fields(cols[2])
		if len(from) < 2 || !strings.HasPrefix(from[1], suite+"/") {
			continue
		}
		seen = append(seen, v)
		upstream := v
		if _, after, ok := strings.Cut(upstream, ":"); ok {
			upstream = after
		}
		if upstream == want || strings.HasPrefix(upstream, want+".") || strings.HasPrefix(upstream, want+"+") || strings.HasPrefix(upstream, want+"~") {
			return v, nil
		}
	}
	if len(seen) == 0 {
		return "", fmt.Errorf("%s has no %s package", suite, Packages[0])
	}
	return "", errors.New(suite + " has " + Packages[0] + " " + strings.Join(seen, ", ") + ", none of them QEMU " + want)
}
