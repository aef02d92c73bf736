package guestsource

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
)

// SourcesList is the apt sources.list of s's kernel, signed by its
// keyring: one "deb [signed-by=KEYRING] MIRROR SUITE COMPONENTS..." line
// per kernel suite (Suite when KernelSuites is empty).
func (s Source) SourcesList() string {
	opts := ""
	if s.Keyring != "" {
		opts = "[signed-by=" + s.Keyring + "] "
	}
	var b strings.Builder
	for _, suite := range s.suites() {
		fmt.Fprintf(&b, "deb %s%s %s %s\n", opts, s.Mirror, suite, strings.Join(s.Components, " "))
	}
	return b.String()
}

// suites are the suites a private apt configuration reads: KernelSuites,
// or Suite alone.
func (s Source) suites() []string {
	if len(s.KernelSuites) == 0 {
		return []string{s.Suite}
	}
	return s.KernelSuites
}

// AptOptions are the apt-get and apt-cache options of a private apt
// configuration in dir (made by WriteAptDir): it reads only
// dir/sources.list, keeps its lists and caches in dir, sees no installed
// package and no host pinning. The host's apt.conf (proxies) still applies
// and authentication stays on: the source's signed-by keyring must verify
// the mirror.
func AptOptions(dir string) []string {
	opt := func(k, v string) []string { return []string{"-o", k + "=" + filepath.Join(dir, v)} }
	var args []string
	for _, o := range [][]string{
		opt("Dir::Etc::SourceList", "sources.list"),
		opt("Dir::Etc::SourceParts", "empty"),
		opt("Dir::Etc::Preferences", "preferences"),
		opt("Dir::Etc::PreferencesParts", "empty"),
		opt("Dir::State", "state"),
		opt("Dir::State::status", "status"),
		opt("Dir::Cache", "cache"),
	} {
		args = append(args, o...)
	}
	return args
}

// WriteAptDir lays out dir for AptOptions: s's sources.list, an empty
// status file, and the state and cache directories apt expects, readable
// by apt's unprivileged download user.
func (s Source) WriteAptDir(dir string) error {
	for _, d := range []string{"empty", "state/lists/partial", "cache/archives/partial"} {
		if err := os.MkdirAll(filepath.Join(dir, d), 0o755); err != nil {
			return fmt.Errorf("private apt config: %w", err)
		}
	}
	for name, data := range map[string]string{"sources.list": s.SourcesList(), "status": ""} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(data), 0o644); err != nil {
			return fmt.Errorf("private apt config: %w", err)
		}
	}
	return nil
}

// KernelPackage picks the concrete kernel package from the output of
// `apt-cache depends META`, where META is linux-image-FLAVOUR: the first
// dependency linux-image-VERSION-FLAVOUR ("Depends:
// linux-image-6.1.0-57-cloud-amd64" for linux-image-cloud-amd64, "Depends:
// linux-image-6.8.0-1020-kvm" for linux-image-kvm), -unsigned variants
// skipped. It returns "" when there is none.
func KernelPackage(dependsOutput, meta string) string {
	flavour := "-" + strings.TrimPrefix(meta, "linux-image-")
	sc := bufio.NewScanner(strings.NewReader(dependsOutput))
	for sc.Scan() {
		f := strings.Fields(strings.TrimLeft(sc.Text(), " |"))
		if len(f) != 2 || f[0] != "Depends:" {
			continue
		}
		version, ok := strings.CutPrefix(f[1], "linux-image-")
		if ok && f[1] != meta && strings.HasSuffix(f[1], flavour) && !strings.HasSuffix(f[1], "-unsigned") &&
			version != "" && version[0] >= '0' && version[0] <= '9' {
			return f[1]
		}
	}
	return ""
}

// Apt runs apt-get and apt-cache with a private configuration's options
// (AptOptions); a nil Apt runs them with the host's.
type Apt []string

// Command is name (apt-get or apt-cache) with a's options before args.
func (a Apt) Command(ctx context.Context, name string, args ...string) *exec.Cmd {
	return exec.CommandContext(ctx, name, append(append([]string(nil), a...), args...)...)
}

// PrivateApt lays out dir for s (WriteAptDir; kept between runs, so that
// apt-get update fetches only what changed) and updates its lists.
func (s Source) PrivateApt(ctx context.Context, dir string, log func(string, ...any)) (Apt, error) {
	if err := s.WriteAptDir(dir); err != nil {
		return nil, err
	}
	apt := Apt(AptOptions(dir))
	if log != nil {
		log("apt-get update from %s %s (private apt configuration in %s)", s.Mirror, strings.Join(s.suites(), ","), dir)
	}
	if out, err := apt.Command(ctx, "apt-get", "update", "-q").CombinedOutput(); err != nil {
		return nil, fmt.Errorf("apt-get update from %s (keyring %s, from package %s): %w: %s",
			s.Mirror, s.Keyring, s.KeyringPackage, err, LastLines(out, 5))
	}
	return apt, nil
}

// FetchDeb downloads pkg (a name, or name=version) into tmp with apt-get
// download and unpacks it into unpack, returning the .deb's name.
func (a Apt) FetchDeb(ctx context.Context, tmp, pkg, unpack string) (string, error) {
	cmd := a.Command(ctx, "apt-get", "download", pkg)
	cmd.Dir = tmp
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("apt-get download %s: %w: %s", pkg, err, LastLines(out, 5))
	}
	name, _, _ := strings.Cut(pkg, "=")
	debs, _ := filepath.Glob(filepath.Join(tmp, name+"_*.deb"))
	if len(debs) != 1 {
		return "", fmt.Errorf("apt-get download %s: expected one .deb in %s, found %d", pkg, tmp, len(debs))
	}
	if out, err := exec.CommandContext(ctx, "dpkg-deb", "-x", debs[0], unpack).CombinedOutput(); err != nil {
		return "", fmt.Errorf("dpkg-deb -x %s: %w: %s", filepath.Base(debs[0]), err, LastLines(out, 5))
	}
	return filepath.Base(debs[0]), nil
}

// LastLines is the last n lines of a command's output, for error messages.
func LastLines(b []byte, n int) string {
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.TrimSpace(strings.Join(lines, "\n"))
}
