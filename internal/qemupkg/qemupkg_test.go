package qemupkg

import (
	"context"
	"os"
	"strings"
	"testing"

	"github.com/agentenv/agentenv/internal/guestsource"
)

// madison is `apt-cache madison qemu-system-x86` with a private
// configuration reading bookworm-backports and bookworm (captured, the
// mirror's host replaced).
const madison = ` qemu-system-x86 | 1:10.0.2+ds-2+deb13u1~bpo12+1 | http://mirror.example/debian bookworm-backports/main amd64 Packages
 qemu-system-x86 | 1:9.2.1+ds-1~bpo12+1 | http://mirror.example/debian bookworm-backports/main amd64 Packages
 qemu-system-x86 | 1:7.2+dfsg-7+deb12u18+b3 | http://mirror.example/debian bookworm/main amd64 Packages
`

func TestPickVersion(t *testing.T) {
	for _, tc := range []struct {
		suite, want, got, err string
	}{
		{"bookworm-backports", "10.0", "1:10.0.2+ds-2+deb13u1~bpo12+1", ""},
		{"bookworm-backports", "10", "1:10.0.2+ds-2+deb13u1~bpo12+1", ""},
		{"bookworm-backports", "10.0.2", "1:10.0.2+ds-2+deb13u1~bpo12+1", ""},
		{"bookworm-backports", "9.2", "1:9.2.1+ds-1~bpo12+1", ""},
		{"bookworm", "7.2", "1:7.2+dfsg-7+deb12u18+b3", ""},
		{"bookworm-backports", "10.00", "", "none of them QEMU 10.00"},
		{"bookworm-backports", "1", "", "none of them QEMU 1"},
		{"bookworm-backports", "7.2", "", "1:10.0.2+ds-2+deb13u1~bpo12+1, 1:9.2.1+ds-1~bpo12+1, none of them QEMU 7.2"},
		{"trixie", "10.0", "", "trixie has no qemu-system-x86 package"},
	} {
		got, err := PickVersion(madison, tc.suite, tc.want)
		if got != tc.got || (tc.err == "") != (err == nil) || (err != nil && !strings.Contains(err.Error(), tc.err)) {
			t.Errorf("PickVersion(%s, %s) = %q, %v; want %q, %q", tc.suite, tc.want, got, err, tc.got, tc.err)
		}
	}
}

func TestInstallRefusesBadInputBeforeWriting(t *testing.T) {
	debian := []guestsource.AptFile{{Name: "sources.list.d/debian.sources",
		Text: "Types: deb\nURIs: http://mirror.example/debian\nSuites: bookworm bookworm-updates\nComponents: main\n"}}
	for _, tc := range []struct {
		name string
		o    Options
		err  string
	}{
		{"bad suite", Options{Suite: "bookworm backports", Version: "10.0", AptSources: debian}, "want a Debian suite"},
		{"bad version", Options{Suite: "bookworm-backports", Version: "ten", AptSources: debian}, "want an upstream QEMU version"},
		{"no version", Options{Suite: "bookworm-backports", AptSources: debian}, "want an upstream QEMU version"},
		{"no mirror", Options{Suite: "trixie-backports", Version: "10.0", AptSources: debian}, "carry no trixie suite"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir() + "/q"
			tc.o.Dir = dir
			_, err := Install(context.Background(), tc.o)
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Fatalf("err %v, want %q", err, tc.err)
			}
			if _, serr := os.Stat(dir); serr == nil {
				t.Fatalf("%s was made", dir)
			}
		})
	}
}
