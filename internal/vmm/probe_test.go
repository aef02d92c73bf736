package vmm

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

func TestParseQEMUVersion(t *testing.T) {
	for _, tc := range []struct {
		out  string
		want QEMUVersion
		bad  bool
	}{
		{out: "QEMU emulator version 7.2.19 (Debian 1:7.2+dfsg-7+deb12u18)\nCopyright (c) 2003-2022 Fabrice Bellard\n", want: QEMUVersion{7, 2, 19}},
		{out: "QEMU emulator version 8.2.2 (Debian 1:8.2.2+ds-0ubuntu1)\n", want: QEMUVersion{8, 2, 2}},
		{out: "QEMU emulator version 10.0.3 (Debian 1:10.0.3+ds-0+deb13u1)\n", want: QEMUVersion{10, 0, 3}},
		{out: "QEMU emulator version 9.1\n", want: QEMUVersion{9, 1, 0}},
		{out: "Python 3.11.2\n", bad: true},
		{out: "", bad: true},
	} {
		v, err := ParseQEMUVersion(tc.out)
		if tc.bad != (err != nil) || v != tc.want {
			t.Errorf("%q: %v %v", tc.out, v, err)
		}
	}
}

// fakeQEMU writes an executable that prints version like QEMU does.
func fakeQEMU(t *testing.T, version string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "qemu-system-x86_64")
	script := "#!/bin/sh\necho 'QEMU emulator version " + version + " (test)'\n"
	if err := os.WriteFile(p, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestProbeQEMURefusesOldVersions(t *testing.T) {
	for _, version := range []string{"6.2.0", "7.1.5"} {
		_, err := ProbeQEMU(context.Background(), fakeQEMU(t, version))
		if err == nil || !strings.Contains(err.Error(), "needs QEMU 7.2 or newer") || !strings.Contains(err.Error(), "install") {
			t.Errorf("QEMU %s: %v, want a refusal saying what to install", version, err)
		}
	}
	if _, err := ProbeQEMU(context.Background(), filepath.Join(t.TempDir(), "none")); err == nil {
		t.Error("a QEMU that is not there was accepted")
	}
	// A 10.0 that dies listing its devices, as one from backports did when
	// it found the system's 7.2 modules.
	broken := filepath.Join(t.TempDir(), "qemu-system-x86_64")
	script := `#!/bin/sh
case "$1" in
--version) echo 'QEMU emulator version 10.0.2 (test)' ;;
-accel) printf 'Accelerators supported in QEMU binary:\ntcg\n' ;;
*) echo 'failed to initialize module: /usr/lib/x86_64-linux-gnu/qemu/ui-opengl.so' >&2; kill -ABRT $$ ;;
esac
`
	if err := os.WriteFile(broken, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	if _, err := ProbeQEMU(context.Background(), broken); err == nil || !strings.Contains(err.Error(), "ui-opengl.so") {
		t.Errorf("a QEMU that aborts under QMP: %v", err)
	}
}

// TestParseQMPProbe reads the probe's QMP session as Debian's QEMU 7.2
// and the 10.0 from bookworm-backports answered it (captured), and as a
// build without what the node needs would.
func TestParseQMPProbe(t *testing.T) {
	read := func(name string) string {
		b, err := os.ReadFile(filepath.Join("testdata", name))
		if err != nil {
			t.Fatal(err)
		}
		return string(b)
	}
	for _, tc := range []struct {
		name, file string
		edit       func(string) string
		runWith    bool
		noDevices  bool // no xen-save-devices-state
		noSeal     bool // no blockdev-snapshot
		noRestack  bool // no blockdev-reopen
		missing    []string
	}{
		{name: "7.2", file: "qmp-probe-7.2.jsonl"},
		{name: "10.0", file: "qmp-probe-10.0.jsonl", runWith: true},
		{name: "no device state alone", file: "qmp-probe-7.2.jsonl", noDevices: true,
			edit: func(s string) string {
				return strings.ReplaceAll(s, `"name": "xen-save-devices-state"`, `"name": "x"`)
			}},
		{name: "no blockdev-reopen", file: "qmp-probe-7.2.jsonl", noRestack: true,
			edit: func(s string) string {
				return strings.ReplaceAll(s, `"name": "blockdev-reopen"`, `"name": "x"`)
			}},
		{name: "no blockdev-snapshot", file: "qmp-probe-10.0.jsonl", runWith: true, noSeal: true,
			edit: func(s string) string {
				return strings.ReplaceAll(s, `"name": "blockdev-snapshot"`, `"name": "x"`)
			}},
		{name: "no microvm, no virtio-net", file: "qmp-probe-10.0.jsonl", runWith: true,
			edit: func(s string) string {
				return strings.NewReplacer(`"name": "microvm"`, `"name": "pc"`, `"name": "virtio-net-device"`, `"name": "e1000"`).Replace(s)
			},
			missing: []string{"machine microvm", "device virtio-net-device"}},
		{name: "no migration to a socket, no x-ignore-shared", file: "qmp-probe-7.2.jsonl",
			edit: func(s string) string {
				return strings.NewReplacer(`"name": "migrate-incoming"`, `"name": "x"`, `"capability": "x-ignore-shared"`, `"capability": "y"`).Replace(s)
			},
			missing: []string{"QMP command migrate-incoming", "migration capability x-ignore-shared"}},
		{name: "no seccomp", file: "qmp-probe-7.2.jsonl",
			edit: func(s string) string {
				var out []string
				for _, l := range strings.Split(s, "\n") {
					if strings.Contains(l, `"id": "sandbox"`) {
						l = `{"id": "sandbox", "error": {"class": "GenericError", "desc": "invalid option name: sandbox"}}`
					}
					out = append(out, l)
				}
				return strings.Join(out, "\n")
			},
			missing: []string{"-sandbox (seccomp)"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := read(tc.file)
			if tc.edit != nil {
				s = tc.edit(s)
			}
			p, err := ParseQMPProbe([]byte(s))
			if err != nil {
				t.Fatal(err)
			}
			if p.RunWith != tc.runWith || !slices.Equal(p.Missing, tc.missing) {
				t.Errorf("missing %q run-with %v; want %q %v", p.Missing, p.RunWith, tc.missing, tc.runWith)
			}
			want := CapturePrivatePages
			if tc.noDevices {
				want = CaptureMigration
			}
			if got := (QEMUInfo{DevicesState: p.DevicesState}).DiffCapture(); got != want {
				t.Errorf("diff capture %s, want %s", got, want)
			}
			if p.Seals == tc.noSeal {
				t.Errorf("seals disks: %v, want %v", p.Seals, !tc.noSeal)
			}
			if p.Restacks == tc.noRestack {
				t.Errorf("restacks disks: %v, want %v", p.Restacks, !tc.noRestack)
			}
		})
	}
	if _, err := ParseQMPProbe([]byte(read("qmp-probe-7.2.jsonl")[:300])); err == nil {
		t.Error("a session cut short was read as complete")
	}
	for _, v := range []string{"7.2", "10.0"} {
		if got := ParseAccelHelp(read("accel-help-" + v + ".txt")); !slices.Equal(got, []string{"tcg", "kvm"}) {
			t.Errorf("%s: accelerators %q", v, got)
		}
	}
	if got := ParseAccelHelp("Accelerators supported in QEMU binary:\nkvm\n"); !slices.Equal(got, []string{"kvm"}) {
		t.Errorf("microvm build: %q", got)
	}
}

// TestProbeQEMU probes the real binaries: the one in PATH and AENV_QEMU's
// (CI sets it to the 10.0 from bookworm-backports), and checks that the
// node's command line follows what each has.
func TestProbeQEMU(t *testing.T) {
	bins := []string{""}
	if q := os.Getenv("AENV_QEMU"); q != "" {
		bins = append(bins, q)
	}
	for _, b := range bins {
		info, err := ProbeQEMU(context.Background(), b)
		if err != nil {
			if b == "" && os.Getenv("CI") != "true" {
				t.Skipf("no usable QEMU here: %v", err)
			}
			t.Fatal(err)
		}
		if err := info.Supports(AccelTCG); err != nil {
			t.Errorf("%s: %v", info.Path, err)
		}
		if err := (QEMUInfo{Path: "q", Accels: []string{"kvm"}}).Supports(AccelTCG); err == nil || !strings.Contains(err.Error(), "no tcg accelerator") {
			t.Errorf("a KVM-only build: %v", err)
		}
		// -run-with came in 9.1, -runas went later.
		if info.RunWithUser() != info.Version.AtLeast(QEMUVersion{9, 1, 0}) {
			t.Errorf("QEMU %s: run-with %v", info.Version, info.RunWithUser())
		}
		c := Config{QEMU: info.Path, RunWithUser: info.RunWithUser(), User: "1000:1000", Kernel: "k", Initrd: "i", RootDisk: "d", MemFile: "m", RunDir: "r"}
		args := c.Args()
		switch {
		case info.RunWithUser() && !containsPair(args, "-run-with", "user=1000:1000"):
			t.Errorf("QEMU %s: no -run-with user= in %v", info.Version, args)
		case !info.RunWithUser() && !containsPair(args, "-runas", "1000:1000"):
			t.Errorf("QEMU %s: no -runas in %v", info.Version, args)
		}
		t.Logf("%s: QEMU %s, accelerators %v, run-with %v", info.Path, info.Version, info.Accels, info.RunWithUser())
	}
}

func containsPair(args []string, flag, value string) bool {
	i := slices.Index(args, flag)
	return i >= 0 && i+1 < len(args) && args[i+1] == value
}
