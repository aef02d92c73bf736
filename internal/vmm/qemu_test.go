package vmm

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// testQEMU finds the QEMU the tests run (AENV_QEMU's, or the one in
// PATH); without one the test skips, or fails under CI.
func testQEMU(t *testing.T) string {
	t.Helper()
	bin, err := FindQEMU(os.Getenv("AENV_QEMU"))
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatal(err)
		}
		t.Skip(err)
	}
	return bin
}

// startQEMU runs bin with args and a QMP socket in a directory of its own,
// files inherited from descriptor 3 on, and returns the connected machine;
// it is killed when the test ends (with what it said if the test failed).
func startQEMU(t *testing.T, bin string, args []string, files ...*os.File) *Machine {
	t.Helper()
	dir, err := os.MkdirTemp("", "aenv-vmm-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	sock := filepath.Join(dir, "qmp.sock")
	cmd := exec.Command(bin, append(args, "-qmp", "unix:"+sock+",server=on,wait=off")...)
	cmd.ExtraFiles = files
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	// What QEMU prints (HMP qemu-io, in a coroutine, writes here), for
	// qemuIO.
	stdout, err := os.Create(filepath.Join(dir, "stdout"))
	if err != nil {
		t.Fatal(err)
	}
	defer stdout.Close()
	cmd.Stdout = stdout
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	m := &Machine{pid: cmd.Process.Pid, runDir: dir, uid: -1, gid: -1, exited: make(chan struct{})}
	go func() { m.setExited(cmd.Wait()) }()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-m.exited
		if t.Failed() {
			t.Logf("QEMU %d said: %s", m.pid, stderr.String())
		}
	})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	for {
		q, err := DialQMP(ctx, sock)
		if err == nil {
			m.qmp = q
			break
		}
		if ctx.Err() != nil {
			t.Fatalf("QMP: %v: %s", err, stderr.String())
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Cleanup(func() { m.qmp.Close() })
	return m
}

// qemuImg runs qemu-img (or qemu-io, with tool) and fails the test on error.
func qemuImg(t *testing.T, tool string, args ...string) string {
	t.Helper()
	if tool == "" {
		tool = "qemu-img"
	}
	out, err := exec.Command(tool, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s %v: %v: %s", tool, args, err, out)
	}
	return string(out)
}

// hmp runs a human monitor command on m and fails the test when it says
// it failed.
func hmp(t *testing.T, m *Machine, line string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	out, err := m.qmp.Execute(ctx, "human-monitor-command", map[string]any{"command-line": line})
	if err != nil || strings.Contains(strings.ToLower(string(out)), "fail") || strings.Contains(string(out), "rror") {
		t.Fatalf("%s: %s %v", line, out, err)
	}
	return string(out)
}

// qemuIO runs a qemu-io command on the block device named dev of m (a
// machine from startQEMU) and returns what it printed.
func qemuIO(t *testing.T, m *Machine, dev, command string) string {
	t.Helper()
	out := filepath.Join(m.runDir, "stdout")
	before, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	hmp(t, m, "qemu-io "+dev+` "`+command+`"`)
	after, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	return string(after[len(before):])
}
