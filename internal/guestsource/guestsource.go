// Package guestsource owns the choice of where the guest kernel and the base
// root filesystem come from: which distribution and suite, which archive
// mirror, which kernel metapackage, and whether the host's own apt can be used
// to fetch them. Resolve decides from the setup flags and the host's
// /etc/os-release and apt sources; Check asks the mirror before anything is
// written.
package guestsource

import (
	"fmt"
	"net/url"
	"sort"
	"strings"
)

// Known guest distributions.
const (
	DebianBookworm = "debian-bookworm"
	UbuntuNoble    = "ubuntu-noble"
)

// Source says where the guest kernel and the base root filesystem come from.
type Source struct {
	Distro        string   `json:"distro"`        // DebianBookworm or UbuntuNoble
	Suite         string   `json:"suite"`         // debootstrap and apt suite: "bookworm", "noble"
	Mirror        string   `json:"mirror"`        // archive URL, e.g. http://mirror.example/debian
	KernelPackage string   `json:"kernelPackage"` // metapackage naming the concrete kernel
	Components    []string `json:"components"`    // archive components debootstrap and apt need
	// KernelSuites are the suites a private apt configuration reads the
	// kernel from: Suite and its updates, on the same mirror.
	KernelSuites []string `json:"kernelSuites"`
	// HostMirror is true when Mirror is the host's own apt source for
	// Suite, so the host's apt (its lists and keys) can fetch the kernel.
	HostMirror bool `json:"hostMirror"`
	// Keyring holds the archive's signing keys on the host; KeyringPackage
	// installs it.
	Keyring        string `json:"keyring"`
	KeyringPackage string `json:"keyringPackage"`
	Reason         string `json:"reason"` // why this source was chosen
}

// String is a one-line summary: distro, suite, mirror.
func (s Source) String() string {
	return fmt.Sprintf("%s (suite %s, kernel %s) from %s", s.Distro, s.Suite, s.KernelPackage, s.Mirror)
}

// distros are the known guest distributions; Resolve fills in the mirror,
// HostMirror and Reason.
var distros = map[string]Source{
	DebianBookworm: {
		Distro: DebianBookworm, Suite: "bookworm", KernelPackage: "linux-image-cloud-amd64",
		Components: []string{"main"}, KernelSuites: []string{"bookworm", "bookworm-updates"},
		Keyring: "/usr/share/keyrings/debian-archive-keyring.gpg", KeyringPackage: "debian-archive-keyring",
	},
	UbuntuNoble: {
		Distro: UbuntuNoble, Suite: "noble", KernelPackage: "linux-image-kvm",
		Components: []string{"main", "universe"}, KernelSuites: []string{"noble", "noble-updates", "noble-security"},
		Keyring: "/usr/share/keyrings/ubuntu-archive-keyring.gpg", KeyringPackage: "ubuntu-keyring",
	},
}

// Distros lists the known guest distributions, sorted.
func Distros() []string {
	var names []string
	for n := range distros {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

// AptFile is one apt source file of the host: Name is its path relative to
// /etc/apt ("sources.list", "sources.list.d/debian.sources"), Text its
// contents. Files ending neither in .list nor in .sources are ignored, as apt
// does.
type AptFile struct {
	Name string
	Text string
}

// Options are Resolve's inputs: the setup flags and the host's files.
type Options struct {
	Distro     string    // --guest-distro, may be empty
	Mirror     string    // --guest-mirror, may be empty
	OSRelease  string    // contents of the host's /etc/os-release
	AptSources []AptFile // the host's apt sources, in apt's order
}

// Resolve chooses the guest source. Without --guest-distro it is
// debian-bookworm, or ubuntu-noble on an Ubuntu host. Without
// --guest-mirror the mirror is the host's apt source carrying the suite;
// when there is none, the caller must pass --guest-mirror.
func Resolve(opts Options) (Source, error) {
	host := parseOSRelease(opts.OSRelease)
	name, why := opts.Distro, "--guest-distro "+opts.Distro+" on "+host.describe()
	if name == "" {
		name = DebianBookworm
		why = "default: the host is " + host.describe()
		if host.is("ubuntu") {
			name = UbuntuNoble
			why = "default on an Ubuntu host (" + host.describe() + ")"
		}
	}
	src, ok := distros[name]
	if !ok {
		return Source{}, fmt.Errorf("unknown --guest-distro %q: want one of %s", name, strings.Join(Distros(), ", "))
	}
	src.Components = append([]string(nil), src.Components...)
	src.KernelSuites = append([]string(nil), src.KernelSuites...)
	hostMirror, file := MirrorFor(opts.AptSources, src.Suite)
	if opts.Mirror != "" {
		if err := checkMirrorURL(opts.Mirror); err != nil {
			return Source{}, err
		}
		src.Mirror = opts.Mirror
		src.HostMirror = hostMirror != "" && sameURL(hostMirror, opts.Mirror)
		src.Reason = why + "; mirror: --guest-mirror"
		if src.HostMirror {
			src.Reason += ", the host's own apt source in " + file
		}
		return src, nil
	}
	if hostMirror == "" {
		return Source{}, fmt.Errorf("guest distro %s: the host's apt sources (%s) carry no %s suite; pass --guest-mirror with the URL of %s (for example %s), or another --guest-distro (%s)",
			src.Distro, host.describe(), src.Suite, archiveKind(src.Distro), exampleMirror(src.Distro), strings.Join(Distros(), ", "))
	}
	src.Mirror, src.HostMirror = hostMirror, true
	src.Reason = fmt.Sprintf("%s; mirror: the host's apt source %s, which carries %s", why, file, src.Suite)
	return src, nil
}

// archiveKind names the kind of mirror distro needs, for messages.
func archiveKind(distro string) string {
	if strings.HasPrefix(distro, "ubuntu") {
		return "an Ubuntu archive mirror"
	}
	return "a Debian archive mirror"
}

func exampleMirror(distro string) string {
	if strings.HasPrefix(distro, "ubuntu") {
		return "http://mirror.example/ubuntu"
	}
	return "http://mirror.example/debian"
}

func checkMirrorURL(s string) error {
	u, err := url.Parse(s)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return fmt.Errorf("--guest-mirror %q: want an http:// or https:// archive URL (for example http://mirror.example/debian)", s)
	}
	return nil
}

func sameURL(a, b string) bool {
	return strings.TrimRight(a, "/") == strings.TrimRight(b, "/")
}

// osRelease holds the fields of /etc/os-release that Resolve uses.
type osRelease struct {
	id, idLike, pretty string
}

func parseOSRelease(s string) osRelease {
	var r osRelease
	for _, l := range strings.Split(s, "\n") {
		k, v, ok := strings.Cut(strings.TrimSpace(l), "=")
		if !ok {
			continue
		}
		v = strings.Trim(v, `"'`)
		switch k {
		case "ID":
			r.id = v
		case "ID_LIKE":
			r.idLike = v
		case "PRETTY_NAME":
			r.pretty = v
		}
	}
	return r
}

// is reports whether the host is distribution id or derived from it.
func (r osRelease) is(id string) bool {
	if r.id == id {
		return true
	}
	for _, l := range strings.Fields(r.idLike) {
		if l == id {
			return true
		}
	}
	return false
}

func (r osRelease) describe() string {
	switch {
	case r.pretty != "":
		return r.pretty
	case r.id != "":
		return r.id
	}
	return "an unknown distribution (no /etc/os-release)"
}

// MirrorFor returns the URI of the first apt source in files that carries
// suite (binary packages, enabled), and the name of the file holding it, or
// "" if none does. It reads the one-line format (.list) and deb822 (.sources).
func MirrorFor(files []AptFile, suite string) (uri, file string) {
	for _, f := range files {
		var m string
		switch {
		case strings.HasSuffix(f.Name, ".sources"):
			m = mirrorFromDeb822(f.Text, suite)
		case strings.HasSuffix(f.Name, ".list"):
			m = mirrorFromList(f.Text, suite)
		}
		if m != "" {
			return m, f.Name
		}
	}
	return "", ""
}

func mirrorFromList(s, suite string) string {
	for _, l := range strings.Split(s, "\n") {
		f := strings.Fields(l)
		if len(f) < 3 || f[0] != "deb" {
			continue
		}
		f = f[1:]
		if strings.HasPrefix(f[0], "[") { // options: [arch=amd64 signed-by=…]
			for len(f) > 0 && !strings.HasSuffix(f[0], "]") {
				f = f[1:]
			}
			if len(f) == 0 {
				continue
			}
			f = f[1:]
		}
		if len(f) >= 2 && f[1] == suite {
			return f[0]
		}
	}
	return ""
}

func mirrorFromDeb822(s, suite string) string {
	for _, stanza := range strings.Split(s, "\n\n") {
		fields := map[string]string{}
		for _, l := range strings.Split(stanza, "\n") {
			if strings.HasPrefix(strings.TrimSpace(l), "#") {
				continue
			}
			if k, v, ok := strings.Cut(l, ":"); ok && !strings.HasPrefix(l, " ") {
				fields[strings.ToLower(strings.TrimSpace(k))] = strings.TrimSpace(v)
			}
		}
		if strings.EqualFold(fields["enabled"], "no") || !strings.Contains(" "+fields["types"]+" ", " deb ") {
			continue
		}
		for _, st := range strings.Fields(fields["suites"]) {
			if st == suite {
				if uris := strings.Fields(fields["uris"]); len(uris) > 0 {
					return uris[0]
				}
			}
		}
	}
	return ""
}
