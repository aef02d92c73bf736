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

func TestProbeQEMUChoosesByVersion(t *testing.T) {
	for _, tc := range []struct {
		version string
		refused bool
		runWith bool
	}{
		{"6.2.0", true, false},
		{"7.1.5", true, false},
		{"7.2.19", false, false},
		{"8.2.2", false, false},
		{"9.1.0", false, true},
		{"10.0.3", false, true},
	} {
		info, err := ProbeQEMU(context.Background(), fakeQEMU(t, tc.version))
		if tc.refused {
			if err == nil || !strings.Contains(err.Error(), "needs QEMU 7.2 or newer") || !strings.Contains(err.Error(), "install") {
				t.Errorf("QEMU %s: %v, want a refusal saying what to install", tc.version, err)
			}
			continue
		}
		if err != nil {
			t.Fatalf("QEMU %s: %v", tc.version, err)
		}
		if info.Version.String() != tc.version || info.RunWithUser() != tc.runWith {
			t.Errorf("QEMU %s: %+v run-with %v", tc.version, info, info.RunWithUser())
		}
		c := Config{QEMU: info.Path, RunWithUser: info.RunWithUser(), User: "1000:1000", Kernel: "k", Initrd: "i", RootDisk: "d", MemFile: "m", RunDir: "r"}
		args := c.Args()
		switch {
		case tc.runWith && !containsPair(args, "-run-with", "user=1000:1000"):
			t.Errorf("QEMU %s: no -run-with user= in %v", tc.version, args)
		case !tc.runWith && !containsPair(args, "-runas", "1000:1000"):
			t.Errorf("QEMU %s: no -runas in %v", tc.version, args)
		}
	}
	if _, err := ProbeQEMU(context.Background(), filepath.Join(t.TempDir(), "none")); err == nil {
		t.Error("a QEMU that is not there was accepted")
	}
}

func containsPair(args []string, flag, value string) bool {
	i := slices.Index(args, flag)
	return i >= 0 && i+1 < len(args) && args[i+1] == value
}
