package vmm

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func TestDecideAccel(t *testing.T) {
	tests := []struct {
		name  string
		facts hostFacts
		want  Accel
	}{
		{"no kvm device", hostFacts{cpuFlags: "flags : fpu vmx"}, AccelTCG},
		{"pvm without vmx", hostFacts{kvmDevice: true, cpuFlags: "flags : fpu sse", kvmModules: []string{"kvm_pvm"}}, AccelTCG},
		{"vmx without module", hostFacts{kvmDevice: true, cpuFlags: "flags : fpu vmx"}, AccelTCG},
		{"intel", hostFacts{kvmDevice: true, cpuFlags: "flags : fpu vmx sse", kvmModules: []string{"kvm_intel"}}, AccelKVM},
		{"amd", hostFacts{kvmDevice: true, cpuFlags: "flags : svm", kvmModules: []string{"kvm_amd"}}, AccelKVM},
		{"flag substring is not a flag", hostFacts{kvmDevice: true, cpuFlags: "flags : vmxfoo", kvmModules: []string{"kvm_intel"}}, AccelTCG},
		{"override tcg", hostFacts{override: "tcg", kvmDevice: true, cpuFlags: "flags : vmx", kvmModules: []string{"kvm_intel"}}, AccelTCG},
		{"override kvm", hostFacts{override: "kvm"}, AccelKVM},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := decideAccel(tt.facts)
			if got.Accel != tt.want {
				t.Fatalf("decideAccel = %s (%s), want %s", got.Accel, got.Reason, tt.want)
			}
			if (got.Accel == AccelTCG) != (got.Warning() != "") {
				t.Fatalf("warning %q does not match accel %s", got.Warning(), got.Accel)
			}
		})
	}
}

func TestArgs(t *testing.T) {
	tap, err := os.CreateTemp(t.TempDir(), "tap")
	if err != nil {
		t.Fatal(err)
	}
	c := Config{Accel: AccelTCG, VCPUs: 2, MemoryMiB: 512, Kernel: "/k", Initrd: "/i", Cmdline: "console=ttyS0",
		RootDisk: "/d.qcow2", MemFile: "/run/mem", RunDir: "/run/sbx1", Tap: tap, MAC: "02:00:00:00:00:01", TBSizeMiB: 32}
	args := strings.Join(c.Args(), " ")
	for _, want := range []string{
		"-accel tcg,thread=multi,tb-size=32",
		"-cpu max",
		"-smp 2",
		"-m 512M",
		"memory-backend-file,id=mem,size=512M,mem-path=/run/mem,share=on",
		"-kernel /k", "-initrd /i", "-append console=ttyS0",
		"file=/d.qcow2,format=qcow2",
		"-netdev tap,id=net0,fd=3",
		"virtio-net-device,netdev=net0,mac=02:00:00:00:00:01",
		"unix:/run/sbx1/qmp.sock,server=on,wait=off",
		"-name aenv:sbx1",
	} {
		if !strings.Contains(args, want) {
			t.Errorf("args lack %q:\n%s", want, args)
		}
	}
	if strings.Contains(args, "virtio-blk-device,drive=vol") {
		t.Errorf("a machine without volume slots has some: %s", args)
	}
	// Volume slots come last (a machine without any keeps the layout of
	// those made before slots); a filled one holds its qcow2 disk, an
	// empty one nothing a guest could write to the host.
	c.VolumeSlots, c.Volumes = 3, []string{"", "/v/disk.qcow2"}
	args = strings.Join(c.Args(), " ")
	for _, want := range []string{
		"-drive id=vol0,driver=null-co,size=1099511627776,read-zeroes=on,if=none,cache=writeback,discard=unmap -device virtio-blk-device,drive=vol0,serial=aenv-vol0",
		"-drive id=vol1,file=/v/disk.qcow2,format=qcow2,if=none,cache=writeback,discard=unmap -device virtio-blk-device,drive=vol1,serial=aenv-vol1",
		"-device virtio-blk-device,drive=vol2,serial=aenv-vol2",
	} {
		if !strings.Contains(args, want) {
			t.Errorf("args lack %q:\n%s", want, args)
		}
	}
	if !strings.HasSuffix(args, "serial=aenv-vol2") {
		t.Errorf("the slots are not last: %s", args)
	}
	c.VolumeSlots, c.Volumes = 0, nil
	c.Tap = nil
	c.Accel = AccelKVM
	args = strings.Join(c.Args(), " ")
	if strings.Contains(args, "netdev") || !strings.Contains(args, "-accel kvm") || !strings.Contains(args, "-cpu host") {
		t.Errorf("kvm args without tap wrong: %s", args)
	}
}

func TestValidateNamesMissingFiles(t *testing.T) {
	c := Config{VCPUs: 1, MemoryMiB: 128, Kernel: "/nonexistent/vmlinuz", Initrd: "/nonexistent/initrd", RootDisk: "/nonexistent/root.qcow2", RunDir: t.TempDir(), MemFile: "m"}
	_, err := Start(context.Background(), c)
	if err == nil || !strings.Contains(err.Error(), "kernel /nonexistent/vmlinuz") || !strings.Contains(err.Error(), "root disk") {
		t.Fatalf("want error naming the missing files, got %v", err)
	}
}

// TestQMPAgainstRealQEMU drives a real QEMU (no guest kernel: the machine
// just idles in its firmware) through stop/cont and checks the events.
func TestQMPAgainstRealQEMU(t *testing.T) {
	bin, err := FindQEMU("")
	if err != nil {
		t.Skip(err)
	}
	dir := t.TempDir()
	sock := filepath.Join(dir, "qmp.sock")
	cmd := exec.Command(bin, "-M", "microvm", "-accel", "tcg", "-m", "64M", "-nodefaults", "-no-user-config",
		"-display", "none", "-qmp", "unix:"+sock+",server=on,wait=off")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	q, err := DialQMP(ctx, sock)
	if err != nil {
		t.Fatal(err)
	}
	defer q.Close()
	status := func() string {
		raw, err := q.Execute(ctx, "query-status", nil)
		if err != nil {
			t.Fatal(err)
		}
		return string(raw)
	}
	if s := status(); !strings.Contains(s, `"running"`) {
		t.Fatalf("initial status %s", s)
	}
	if _, err := q.Execute(ctx, "stop", nil); err != nil {
		t.Fatal(err)
	}
	waitEvent(t, q, "STOP")
	if s := status(); !strings.Contains(s, `"paused"`) {
		t.Fatalf("status after stop %s", s)
	}
	if _, err := q.Execute(ctx, "cont", nil); err != nil {
		t.Fatal(err)
	}
	waitEvent(t, q, "RESUME")
	if _, err := q.Execute(ctx, "no-such-command", nil); err == nil || !strings.Contains(err.Error(), "CommandNotFound") {
		t.Fatalf("unknown command error = %v", err)
	}
	if _, err := q.Execute(ctx, "quit", nil); err != nil {
		t.Fatal(err)
	}
	select {
	case <-q.Done():
	case <-ctx.Done():
		t.Fatal("qmp connection did not end after quit")
	}
	if _, err := q.Execute(ctx, "query-status", nil); err == nil {
		t.Fatal("command after close succeeded")
	}
}

func waitEvent(t *testing.T, q *QMP, name string) {
	t.Helper()
	timeout := time.After(10 * time.Second)
	for {
		select {
		case ev := <-q.Events():
			if ev.Name == name {
				return
			}
		case <-timeout:
			t.Fatalf("no %s event", name)
		}
	}
}

// TestJailThatCannotBeSetUpFailsTheStart: a jail step that cannot build
// QEMU's mount namespace stops the start (QEMU never runs) with its reason.
func TestJailThatCannotBeSetUpFailsTheStart(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (a mount namespace)")
	}
	if _, err := FindQEMU(""); err != nil {
		t.Skip(err)
	}
	dir := t.TempDir()
	for _, f := range []string{"vmlinuz", "initrd", "root.qcow2", "mem"} {
		os.WriteFile(filepath.Join(dir, f), nil, 0o600)
	}
	c := Config{VCPUs: 1, MemoryMiB: 64, Kernel: filepath.Join(dir, "vmlinuz"), Initrd: filepath.Join(dir, "initrd"),
		RootDisk: filepath.Join(dir, "root.qcow2"), MemFile: filepath.Join(dir, "mem"), RunDir: filepath.Join(dir, "run"),
		Jail: Jail{Hide: filepath.Join(dir, "data"), Keep: []string{"/etc"}}} // a path outside what it hides
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	m, err := Start(ctx, c)
	if err == nil {
		m.Kill()
		t.Fatal("started with a jail that cannot be set up")
	}
	t.Logf("start: %v", err)
	if !strings.Contains(err.Error(), "aenv jail: mount namespace") || !strings.Contains(err.Error(), "not inside") {
		t.Fatalf("error does not say why: %v", err)
	}
}
