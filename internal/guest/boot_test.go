package guest

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"
)

// TestBootMinimal boots the minimal rootfs under QEMU (TCG, -M microvm)
// with an initramfs whose /init is the standin envd from testdata, checks
// envd's health endpoint and networking from the host, runs a command, and
// powers the guest off through the ACPI power button. Skipped with -short
// or without QEMU.
func TestBootMinimal(t *testing.T) {
	if testing.Short() {
		t.Skip("boots a VM")
	}
	if os.Geteuid() != 0 {
		t.Skip("needs root (rootfs build)")
	}
	qemu, err := exec.LookPath("qemu-system-x86_64")
	if err != nil || runtime.GOARCH != "amd64" {
		t.Skip("qemu-system-x86_64 not available")
	}
	k := testKernel(t)
	dir := t.TempDir()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()

	standin := filepath.Join(dir, "standin")
	build := exec.CommandContext(ctx, "go", "build", "-o", standin, "./testdata/standin")
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build standin: %v: %s", err, out)
	}
	initrd := filepath.Join(dir, "initrd.img")
	if err := BuildInitramfs(k, standin, initrd); err != nil {
		t.Fatal(err)
	}
	base := filepath.Join(dir, "minimal.qcow2")
	if err := BuildRootfs(ctx, RootfsSpec{Kind: RootfsMinimal}, base, t.Logf); err != nil {
		t.Fatal(err)
	}
	overlay := filepath.Join(dir, "overlay.qcow2")
	if out, err := exec.Command("qemu-img", "create", "-q", "-f", "qcow2", "-b", base, "-F", "qcow2", overlay).CombinedOutput(); err != nil {
		t.Fatalf("qemu-img create: %v: %s", err, out)
	}
	// Without the TSC frequency the TCG guest sometimes hangs calibrating.
	tscKHz, err := HostTSCkHz()
	if err != nil {
		t.Logf("host TSC: %v", err)
	}
	cmdline, err := BootParams{
		Hostname: "boottest",
		IP:       netip.MustParsePrefix("10.0.2.15/24"),
		Gateway:  netip.MustParseAddr("10.0.2.2"),
		DNS:      []netip.Addr{netip.MustParseAddr("10.0.2.3")},
		Extra:    k.TimingParams(tscKHz),
	}.KernelCmdline()
	if err != nil {
		t.Fatal(err)
	}
	port := freePort(t)
	mon := filepath.Join(dir, "mon.sock")
	serial := filepath.Join(dir, "serial.log")
	args := []string{
		"-M", "microvm,acpi=on", "-accel", "tcg", "-cpu", "max", "-m", "256", "-smp", "2",
		"-nodefaults", "-no-user-config", "-nographic",
		"-kernel", k.BootImage(), "-initrd", initrd,
		"-append", cmdline,
		"-serial", "file:" + serial, "-monitor", "unix:" + mon + ",server,nowait",
		"-drive", "id=root,file=" + overlay + ",format=qcow2,if=none", "-device", "virtio-blk-device,drive=root",
		"-netdev", fmt.Sprintf("user,id=n0,restrict=on,hostfwd=tcp:127.0.0.1:%d-:49983", port),
		"-device", "virtio-net-device,netdev=n0",
	}
	cmd := exec.CommandContext(ctx, qemu, args...)
	start := time.Now()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	defer func() {
		_ = cmd.Process.Kill()
		if t.Failed() {
			b, _ := os.ReadFile(serial)
			t.Logf("serial console:\n%s", b)
		}
	}()

	baseURL := fmt.Sprintf("http://127.0.0.1:%d", port)
	client := &http.Client{Timeout: 300 * time.Millisecond}
	for {
		resp, err := client.Get(baseURL + "/health")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusNoContent {
				break
			}
		}
		select {
		case err := <-exited:
			t.Fatalf("qemu exited before envd was healthy: %v", err)
		case <-time.After(100 * time.Millisecond):
		}
		if time.Since(start) > 60*time.Second {
			t.Fatal("envd not healthy within 60s")
		}
	}
	t.Logf("envd healthy %s after QEMU start", time.Since(start).Round(time.Millisecond))

	resp, err := (&http.Client{Timeout: 30 * time.Second}).Get(baseURL + "/exec?cmd=" + url.QueryEscape("hostname; cat /etc/resolv.conf; id user; mount"))
	if err != nil {
		t.Fatal(err)
	}
	out, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	for _, want := range []string{"boottest", "nameserver 10.0.2.3", "uid=1000(user)", "/dev/vda on / type ext4 (rw", "devpts on /dev/pts"} {
		if !strings.Contains(string(out), want) {
			t.Errorf("guest output lacks %q:\n%s", want, out)
		}
	}

	c, err := net.Dial("unix", mon)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.Write([]byte("system_powerdown\n")); err != nil {
		t.Fatal(err)
	}
	select {
	case <-exited:
		b, _ := os.ReadFile(serial)
		if !strings.Contains(string(b), "shutting down: ACPI power button") {
			t.Errorf("no clean shutdown on the console:\n%s", b)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("guest did not power off within 30s of system_powerdown")
	}
}

func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}
