package guestsource

import (
	"context"
	"errors"
	"io/fs"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

// host reads a captured host root under testdata.
func host(t *testing.T, name string) Options {
	t.Helper()
	o := ReadHost(filepath.Join("testdata", name))
	if o.OSRelease == "" || len(o.AptSources) == 0 {
		t.Fatalf("testdata/%s: no os-release or apt sources", name)
	}
	return o
}

func TestReadHost(t *testing.T) {
	tests := []struct {
		root  string
		names []string
	}{
		{"debian12", []string{"sources.list.d/debian.sources", "sources.list.d/tools.list.disabled"}},
		{"debian12-classic", []string{"sources.list"}},
		{"ubuntu2404", []string{"sources.list", "sources.list.d/ubuntu.sources"}},
	}
	for _, tt := range tests {
		var names []string
		for _, f := range host(t, tt.root).AptSources {
			names = append(names, f.Name)
		}
		if !reflect.DeepEqual(names, tt.names) {
			t.Errorf("%s: apt sources %v, want %v", tt.root, names, tt.names)
		}
	}
	if o := ReadHost(t.TempDir()); o.OSRelease != "" || o.AptSources != nil {
		t.Errorf("empty root: %+v", o)
	}
}

func TestResolve(t *testing.T) {
	tests := []struct {
		name, host, distro, mirror string
		// want: distro, suite, mirror, kernel package; hostMirror; words
		// of the Reason or of the error.
		want       [4]string
		hostMirror bool
		words      []string
		wantErr    bool
	}{
		{name: "debian default, deb822", host: "debian12",
			want:       [4]string{DebianBookworm, "bookworm", "http://mirror.example/debian", "linux-image-cloud-amd64"},
			hostMirror: true, words: []string{"default", "Debian GNU/Linux 12", "sources.list.d/debian.sources"}},
		{name: "debian default, sources.list", host: "debian12-classic",
			want:       [4]string{DebianBookworm, "bookworm", "http://mirror.example/debian", "linux-image-cloud-amd64"},
			hostMirror: true, words: []string{"default", "sources.list"}},
		{name: "debian explicit", host: "debian12", distro: DebianBookworm,
			want:       [4]string{DebianBookworm, "bookworm", "http://mirror.example/debian", "linux-image-cloud-amd64"},
			hostMirror: true, words: []string{"--guest-distro debian-bookworm", "debian.sources"}},
		{name: "debian, host mirror given again", host: "debian12", mirror: "http://mirror.example/debian/",
			want:       [4]string{DebianBookworm, "bookworm", "http://mirror.example/debian/", "linux-image-cloud-amd64"},
			hostMirror: true, words: []string{"--guest-mirror", "host's own apt source"}},
		{name: "debian, other mirror", host: "debian12", mirror: "https://other.example/debian",
			want:  [4]string{DebianBookworm, "bookworm", "https://other.example/debian", "linux-image-cloud-amd64"},
			words: []string{"default", "--guest-mirror"}},
		{name: "ubuntu default", host: "ubuntu2404",
			want:       [4]string{UbuntuNoble, "noble", "http://mirror.example/ubuntu/", "linux-image-kvm"},
			hostMirror: true, words: []string{"Ubuntu host", "Ubuntu 24.04.1 LTS", "ubuntu.sources"}},
		{name: "ubuntu, debian guest without mirror", host: "ubuntu2404", distro: DebianBookworm,
			wantErr: true, words: []string{"--guest-mirror", "bookworm", "Ubuntu 24.04.1 LTS"}},
		{name: "ubuntu, debian guest with mirror", host: "ubuntu2404", distro: DebianBookworm, mirror: "http://mirror.example/debian",
			want:  [4]string{DebianBookworm, "bookworm", "http://mirror.example/debian", "linux-image-cloud-amd64"},
			words: []string{"--guest-distro debian-bookworm", "--guest-mirror"}},
		{name: "debian, ubuntu guest without mirror", host: "debian12", distro: UbuntuNoble,
			wantErr: true, words: []string{"--guest-mirror", "noble", "Ubuntu archive"}},
		{name: "debian, ubuntu guest with mirror", host: "debian12", distro: UbuntuNoble, mirror: "http://mirror.example/ubuntu",
			want:  [4]string{UbuntuNoble, "noble", "http://mirror.example/ubuntu", "linux-image-kvm"},
			words: []string{"--guest-distro ubuntu-noble"}},
		{name: "unknown distro", host: "debian12", distro: "fedora-40",
			wantErr: true, words: []string{"fedora-40", DebianBookworm, UbuntuNoble}},
		{name: "ftp mirror", host: "debian12", mirror: "ftp://mirror.example/debian",
			wantErr: true, words: []string{"--guest-mirror", "http"}},
		{name: "mirror without scheme", host: "debian12", mirror: "mirror.example/debian",
			wantErr: true, words: []string{"--guest-mirror"}},
		{name: "unknown host", wantErr: true, words: []string{"--guest-mirror", "no /etc/os-release"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var opts Options
			if tt.host != "" {
				opts = host(t, tt.host)
			}
			opts.Distro, opts.Mirror = tt.distro, tt.mirror
			src, err := Resolve(opts)
			text := src.Reason
			if tt.wantErr {
				if err == nil {
					t.Fatalf("Resolve = %+v, want an error", src)
				}
				text = err.Error()
			} else if err != nil {
				t.Fatalf("Resolve: %v", err)
			}
			for _, w := range tt.words {
				if !strings.Contains(text, w) {
					t.Errorf("%q does not say %q", text, w)
				}
			}
			if tt.wantErr {
				return
			}
			if got := [4]string{src.Distro, src.Suite, src.Mirror, src.KernelPackage}; got != tt.want {
				t.Errorf("got %v, want %v", got, tt.want)
			}
			if src.HostMirror != tt.hostMirror {
				t.Errorf("HostMirror = %v, want %v", src.HostMirror, tt.hostMirror)
			}
			if len(src.Components) == 0 || src.Components[0] != "main" || src.Keyring == "" || src.KeyringPackage == "" {
				t.Errorf("components %v, keyring %q (%q)", src.Components, src.Keyring, src.KeyringPackage)
			}
		})
	}
}

func TestMirrorFor(t *testing.T) {
	tests := []struct {
		name, file, text, suite, want string
	}{
		{"list with options", "sources.list", "deb [arch=amd64 signed-by=/k.gpg] http://mirror.example/debian bookworm main\n", "bookworm", "http://mirror.example/debian"},
		{"list, deb-src only", "sources.list", "deb-src http://src.example/debian bookworm main\n", "bookworm", ""},
		{"list, other suite", "sources.list", "deb http://mirror.example/debian bookworm main\n", "trixie", ""},
		{"list, commented", "sources.list", "# deb http://mirror.example/debian bookworm main\n", "bookworm", ""},
		{"deb822 second suite", "x.sources", "Types: deb\nURIs: http://mirror.example/debian\nSuites: bookworm bookworm-updates\n", "bookworm-updates", "http://mirror.example/debian"},
		{"deb822 disabled", "x.sources", "Enabled: no\nTypes: deb\nURIs: http://mirror.example/debian\nSuites: bookworm\n", "bookworm", ""},
		{"deb822 deb-src only", "x.sources", "Types: deb-src\nURIs: http://mirror.example/debian\nSuites: bookworm\n", "bookworm", ""},
		{"deb822 both types", "x.sources", "Types: deb deb-src\nURIs: http://mirror.example/debian\nSuites: bookworm\n", "bookworm", "http://mirror.example/debian"},
		{"ignored file name", "x.list.save", "deb http://mirror.example/debian bookworm main\n", "bookworm", ""},
	}
	for _, tt := range tests {
		got, file := MirrorFor([]AptFile{{Name: tt.file, Text: tt.text}}, tt.suite)
		if got != tt.want || (got != "") != (file == tt.file) {
			t.Errorf("%s: MirrorFor = %q, %q; want %q", tt.name, got, file, tt.want)
		}
	}
	// The security suite is on its own URI in both captured hosts.
	if got, _ := MirrorFor(host(t, "ubuntu2404").AptSources, "noble-security"); got != "http://security.example/ubuntu/" {
		t.Errorf("ubuntu noble-security: %q", got)
	}
	debian := host(t, "debian12").AptSources
	if got, _ := MirrorFor(debian, "bookworm-security"); got != "http://security.example/debian-security" {
		t.Errorf("debian bookworm-security: %q", got)
	}
	if got, _ := MirrorFor(debian, "bookworm"); got != "http://mirror.example/debian" {
		t.Errorf("debian bookworm: %q", got)
	}
}

func TestKernelPackage(t *testing.T) {
	tests := []struct {
		fixture, meta, want string
	}{
		{"depends-linux-image-cloud-amd64", "linux-image-cloud-amd64", "linux-image-6.1.0-57-cloud-amd64"},
		{"depends-linux-image-cloud-amd64-alternatives", "linux-image-cloud-amd64", "linux-image-6.1.0-28-cloud-amd64"},
		{"depends-linux-image-kvm", "linux-image-kvm", "linux-image-6.8.0-1020-kvm"},
		{"depends-linux-image-kvm", "linux-image-cloud-amd64", ""}, // another flavour
	}
	for _, tt := range tests {
		b, err := os.ReadFile(filepath.Join("testdata", "apt-cache", tt.fixture))
		if err != nil {
			t.Fatal(err)
		}
		if got := KernelPackage(string(b), tt.meta); got != tt.want {
			t.Errorf("%s for %s: %q, want %q", tt.fixture, tt.meta, got, tt.want)
		}
	}
	for _, out := range []string{"", "linux-image-kvm\n", "linux-image-kvm\n  Depends: linux-image-kvm\n", "linux-image-kvm\n  Depends: linux-image-extra-kvm\n"} {
		if got := KernelPackage(out, "linux-image-kvm"); got != "" {
			t.Errorf("KernelPackage(%q) = %q, want none", out, got)
		}
	}
}

func TestCheck(t *testing.T) {
	release := func(suite string) string {
		return "Origin: Example\nLabel: Example\nSuite: stable\nCodename: " + suite + "\nDate: Sat, 01 Mar 2025 10:00:00 UTC\nSHA256:\n 0123 456 main/binary-amd64/Packages\n"
	}
	tests := []struct {
		name    string
		files   map[string]string // path: body; others are 404
		status  int               // for every path, when not 0
		wantErr string
	}{
		{name: "InRelease", files: map[string]string{"/debian/dists/bookworm/InRelease": "-----BEGIN PGP SIGNED MESSAGE-----\nHash: SHA512\n\n" + release("bookworm")}},
		{name: "Release only", files: map[string]string{"/debian/dists/bookworm/Release": release("bookworm")}},
		{name: "no suite", files: map[string]string{"/debian/dists/trixie/Release": release("trixie")}, wantErr: "has no suite bookworm"},
		{name: "another suite's file", files: map[string]string{"/debian/dists/bookworm/Release": release("trixie")}, wantErr: "not the Release file"},
		{name: "server error", status: http.StatusBadGateway, wantErr: "502"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if tt.status != 0 {
					w.WriteHeader(tt.status)
					return
				}
				body, ok := tt.files[r.URL.Path]
				if !ok {
					http.NotFound(w, r)
					return
				}
				_, _ = w.Write([]byte(body))
			}))
			defer srv.Close()
			src := Source{Distro: DebianBookworm, Suite: "bookworm", Mirror: srv.URL + "/debian/"}
			err := Check(context.Background(), src, srv.Client())
			if tt.wantErr == "" {
				if err != nil {
					t.Fatalf("Check: %v", err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("Check = %v, want an error saying %q", err, tt.wantErr)
			}
		})
	}
	t.Run("no answer", func(t *testing.T) {
		srv := httptest.NewServer(http.NotFoundHandler())
		srv.Close() // nothing listens on its loopback port any more
		err := Check(context.Background(), Source{Suite: "noble", Mirror: srv.URL + "/ubuntu"}, srv.Client())
		if err == nil || !strings.Contains(err.Error(), "does not answer") {
			t.Fatalf("Check = %v, want a mirror that does not answer", err)
		}
	})
}

func TestAptConfig(t *testing.T) {
	dir := "/tmp/apt"
	want := []string{
		"-o", "Dir::Etc::SourceList=/tmp/apt/sources.list",
		"-o", "Dir::Etc::SourceParts=/tmp/apt/empty",
		"-o", "Dir::Etc::Preferences=/tmp/apt/preferences",
		"-o", "Dir::Etc::PreferencesParts=/tmp/apt/empty",
		"-o", "Dir::State=/tmp/apt/state",
		"-o", "Dir::State::status=/tmp/apt/status",
		"-o", "Dir::Cache=/tmp/apt/cache",
	}
	if got := AptOptions(dir); !reflect.DeepEqual(got, want) {
		t.Errorf("AptOptions =\n%q\nwant\n%q", got, want)
	}
	src, err := Resolve(Options{Distro: UbuntuNoble, Mirror: "http://mirror.example/ubuntu"})
	if err != nil {
		t.Fatal(err)
	}
	wantList := "deb [signed-by=/usr/share/keyrings/ubuntu-archive-keyring.gpg] http://mirror.example/ubuntu noble main universe\n" +
		"deb [signed-by=/usr/share/keyrings/ubuntu-archive-keyring.gpg] http://mirror.example/ubuntu noble-updates main universe\n" +
		"deb [signed-by=/usr/share/keyrings/ubuntu-archive-keyring.gpg] http://mirror.example/ubuntu noble-security main universe\n"
	if got := (Source{Mirror: "http://mirror.example/debian", Suite: "bookworm", Components: []string{"main"}}).SourcesList(); got != "deb http://mirror.example/debian bookworm main\n" {
		t.Errorf("SourcesList without keyring or kernel suites = %q", got)
	}
	if got := src.SourcesList(); got != wantList {
		t.Errorf("SourcesList = %q, want %q", got, wantList)
	}
	tmp := t.TempDir()
	if err := src.WriteAptDir(tmp); err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(filepath.Join(tmp, "sources.list")); err != nil || string(b) != wantList {
		t.Errorf("sources.list = %q, %v", b, err)
	}
	if st, err := os.Stat(filepath.Join(tmp, "status")); err != nil || st.Size() != 0 {
		t.Errorf("status file: %v", err)
	}
	for _, d := range []string{"empty", "state/lists/partial", "cache/archives/partial"} {
		if st, err := os.Stat(filepath.Join(tmp, d)); err != nil || !st.IsDir() {
			t.Errorf("%s: %v", d, err)
		}
	}
}

func TestCheckHostFiles(t *testing.T) {
	src, err := Resolve(Options{Distro: UbuntuNoble, Mirror: "http://mirror.example/ubuntu"})
	if err != nil {
		t.Fatal(err)
	}
	script := filepath.Join(DebootstrapScripts, "noble")
	tests := []struct {
		name        string
		present     []string
		debootstrap bool
		wantErr     string
	}{
		{"all there", []string{src.Keyring, script}, true, ""},
		{"no keyring", []string{script}, true, "apt-get install ubuntu-keyring"},
		{"old debootstrap", []string{src.Keyring}, true, "debootstrap does not know suite noble"},
		{"no debootstrap needed", []string{src.Keyring}, false, ""},
	}
	for _, tt := range tests {
		exists := func(p string) bool {
			for _, q := range tt.present {
				if p == q {
					return true
				}
			}
			return false
		}
		err := src.CheckHostFiles(tt.debootstrap, exists)
		if (err == nil) != (tt.wantErr == "") || (err != nil && !strings.Contains(err.Error(), tt.wantErr)) {
			t.Errorf("%s: CheckHostFiles = %v, want %q", tt.name, err, tt.wantErr)
		}
	}
}

func TestSaveLoad(t *testing.T) {
	path := filepath.Join(t.TempDir(), FileName)
	if _, err := Load(path); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("Load before Save: %v, want not exist", err)
	}
	src, err := Resolve(host(t, "debian12"))
	if err != nil {
		t.Fatal(err)
	}
	if err := Save(path, src); err != nil {
		t.Fatal(err)
	}
	got, err := Load(path)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, src) {
		t.Errorf("Load = %+v, want %+v", got, src)
	}
}
