package guestsource

import (
	"bufio"
	"fmt"
	"os"
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
	suites := s.KernelSuites
	if len(suites) == 0 {
		suites = []string{s.Suite}
	}
	var b strings.Builder
	for _, suite := range suites {
		fmt.Fprintf(&b, "deb %s%s %s %s\n", opts, s.Mirror, suite, strings.Join(s.Components, " "))
	}
	return b.String()
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
