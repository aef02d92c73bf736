package orchestrator

import (
	"bytes"
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"github.com/agentenv/agentenv/internal/storage/image"
	"io"
	"log/slog"
	"mime/multipart"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"

	"github.com/agentenv/agentenv/internal/envd/gen/filesystempb"
	"github.com/agentenv/agentenv/internal/envd/gen/filesystempb/filesystempbconnect"
	"github.com/agentenv/agentenv/internal/envd/gen/processpb"
	"github.com/agentenv/agentenv/internal/envd/gen/processpb/processpbconnect"
	"github.com/agentenv/agentenv/internal/guest"
	"github.com/agentenv/agentenv/internal/sandboxes"
	"github.com/agentenv/agentenv/internal/templates"
	"github.com/agentenv/agentenv/internal/vmm"
)

// testNode opens a node on a fresh data dir sharing the kernel, initramfs and
// templates prepared by scripts/test in $AENV_TEST_DATA_DIR. VM tests are
// skipped, with the reason printed, only where they cannot run: not root, or
// no prepared data dir.
func testNode(t testing.TB, opts ...func(*Config)) *Node {
	t.Helper()
	return testNodeIn(t, newTestDataDir(t), opts...)
}

// testNodeIn is testNode on the data dir dir (a newTestDataDir).
func testNodeIn(t testing.TB, dir string, opts ...func(*Config)) *Node {
	t.Helper()
	slot := takeTestSlot()
	n := openTestNodeIn(t, dir, slot, opts...)
	t.Cleanup(func() {
		// The pools discard their own machines first: a pooled record
		// destroyed below would be destroyed again by the pool's Close.
		n.pool.Close(context.Background())
		n.forkPool.Close(context.Background())
		all, _ := n.records.List(context.Background(), "")
		for _, s := range all {
			if err := n.Kill(context.Background(), s.ID); err != nil {
				n.destroy(context.Background(), s) // left mid-operation by a failed test
			}
		}
		n.Close()
		releaseTestSlot(slot)
	})
	return n
}

// Test nodes open at the same time need their own host object names and
// address ranges: a node's start removes network namespaces and veths of
// its instance that it does not know. Slot 0 is the usual single node.
var (
	testSlotsMu sync.Mutex
	testSlots   = map[int]bool{}
)

func takeTestSlot() int {
	testSlotsMu.Lock()
	defer testSlotsMu.Unlock()
	for i := 0; ; i++ {
		if !testSlots[i] {
			testSlots[i] = true
			return i
		}
	}
}

func releaseTestSlot(i int) {
	testSlotsMu.Lock()
	defer testSlotsMu.Unlock()
	delete(testSlots, i)
}

// testInstance names slot i's host objects and address range (slots up to
// 15: 10.214.0.0/20, 10.214.16.0/20, ...). A second run of this package at
// the same time (scripts/test runs the lifecycle tests on another QEMU
// beside the whole suite) sets AENV_TEST_LANE=1 and gets names, a range
// (10.215.0.0/16) and QEMU user ids of its own.
func testInstance(slot int) (instance, cidr string) {
	lane := testLane()
	if lane > 0 {
		// Lane 1: 10.215.0.0/16; lane 2: 10.223.0.0/16 (10.216 to 10.222
		// are other tests').
		return fmt.Sprintf("ae%dt%d", lane, slot), fmt.Sprintf("10.%d.%d.0/20", []int{0, 215, 223}[lane], 16*slot)
	}
	instance = "aetst"
	if slot > 0 {
		instance = fmt.Sprintf("aets%d", slot)
	}
	return instance, fmt.Sprintf("10.214.%d.0/20", 16*slot)
}

// testLane is AENV_TEST_LANE (0 when unset).
func testLane() int {
	l, _ := strconv.Atoi(os.Getenv("AENV_TEST_LANE"))
	if l < 0 || l > 2 {
		panic("AENV_TEST_LANE must be 0, 1 or 2")
	}
	return l
}

// preparedTemplates are the templates scripts/test builds in
// $AENV_TEST_DATA_DIR.
var preparedTemplates = []string{"base", "minimal"}

// newTestDataDir returns a fresh node data dir holding the prepared
// templates of $AENV_TEST_DATA_DIR, exported as template directories (their
// root layers hard-linked) that the node adopts when it opens: templates a
// test makes stay in its own data dir.
func newTestDataDir(t testing.TB) string {
	t.Helper()
	shared := testData(t)
	dir := t.TempDir()
	cat, closeCat, err := templates.OpenReadOnly(shared)
	if err != nil {
		t.Fatalf("prepared data dir %s: %v (run scripts/test, or aenv setup --data-dir %s --templates base,minimal)", shared, err, shared)
	}
	defer closeCat()
	for _, name := range preparedTemplates {
		if err := cat.Export(context.Background(), name, filepath.Join(dir, templates.LegacyDir, name)); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

func testData(t testing.TB) string {
	t.Helper()
	shared := os.Getenv("AENV_TEST_DATA_DIR")
	if shared == "" {
		t.Skip("AENV_TEST_DATA_DIR is not set: run scripts/test, which prepares the guest kernel and templates")
	}
	if os.Geteuid() != 0 {
		t.Skip("VM tests need root (network namespaces, tap devices)")
	}
	return shared
}

// openTestNode opens a node on dir (which must hold the templates link).
func openTestNode(t testing.TB, dir string) *Node {
	t.Helper()
	return openTestNodeIn(t, dir, 0)
}

func openTestNodeIn(t testing.TB, dir string, slot int, opts ...func(*Config)) *Node {
	t.Helper()
	instance, cidr := testInstance(slot)
	shared := testData(t)
	k, err := guest.LoadKernel(filepath.Join(shared, "cache", "kernel"))
	if err != nil {
		t.Fatal(err)
	}
	level := slog.LevelWarn
	if testing.Verbose() {
		level = slog.LevelInfo
	}
	accel := vmm.ProbeAccel().Accel
	cfg := Config{
		DataDir:     dir,
		Kernel:      k.BootImage(),
		KernelArgs:  k.BootArgs(accel == vmm.AccelTCG),
		Initrd:      filepath.Join(shared, "cache", "initramfs.img"),
		Accel:       accel,
		QEMU:        os.Getenv("AENV_QEMU"), // another QEMU than PATH's (e.g. 10.0 unpacked from backports)
		NetworkCIDR: cidr,
		Instance:    instance,
		QEMUUIDBase: testQEMUUIDBase + testLane()*10_000_000 + slot*100000, // ids of its own per test node
		BootTimeout: 60 * time.Second,
		// The image tests write their archives and layouts under the
		// temporary directory and pull from registries on loopback.
		Images: image.Policy{Dirs: []string{os.TempDir()}, PrivateRegistries: true},
		Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level})),
	}
	for _, o := range opts {
		o(&cfg)
	}
	n, err := Open(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// testQEMUUIDBase numbers the ids test nodes' QEMUs run as.
const testQEMUUIDBase = 1_600_000_000

// testHTTP keeps no idle connections: guest addresses are reused by later
// sandboxes (and by the next test's node).
var testHTTP = &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}

type envdClient struct {
	addr, token string
	proc        processpbconnect.ProcessClient
	fs          filesystempbconnect.FilesystemClient
}

func newEnvdClient(s *sandboxes.Sandbox) *envdClient {
	url := "http://" + s.EnvdAddr
	return &envdClient{
		addr:  s.EnvdAddr,
		token: s.AccessToken,
		proc:  processpbconnect.NewProcessClient(testHTTP, url, connect.WithProtoJSON()),
		fs:    filesystempbconnect.NewFilesystemClient(testHTTP, url, connect.WithProtoJSON()),
	}
}

func (c *envdClient) headers(h http.Header, user string) {
	if c.token != "" {
		h.Set("X-Access-Token", c.token)
	}
	if user != "" {
		h.Set("Authorization", "Basic "+base64.StdEncoding.EncodeToString([]byte(user+":")))
	}
}

type result struct {
	stdout, stderr string
	exit           int32
	chunks         int
}

func (c *envdClient) run(ctx context.Context, user, cmd string, args ...string) (result, error) {
	req := connect.NewRequest(&processpb.StartRequest{Process: &processpb.ProcessConfig{Cmd: cmd, Args: args}})
	c.headers(req.Header(), user)
	stream, err := c.proc.Start(ctx, req)
	if err != nil {
		return result{}, err
	}
	defer stream.Close()
	var r result
	var out, errb bytes.Buffer
	ended := false
	for stream.Receive() {
		ev := stream.Msg().GetEvent()
		if d := ev.GetData(); d != nil {
			out.Write(d.GetStdout())
			errb.Write(d.GetStderr())
			r.chunks++
		}
		if e := ev.GetEnd(); e != nil {
			r.exit = e.GetExitCode()
			ended = true
		}
	}
	if err := stream.Err(); err != nil {
		return r, err
	}
	if !ended {
		return r, errors.New("stream ended without an end event")
	}
	r.stdout, r.stderr = out.String(), errb.String()
	return r, nil
}

func create(t *testing.T, n *Node, req CreateRequest) *sandboxes.Sandbox {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	start := time.Now()
	s, err := n.Create(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("created %s from %s in %s", s.ID, req.TemplateID, time.Since(start).Round(time.Millisecond))
	return s
}

func TestSandboxLifecycleMinimal(t *testing.T) {
	n := testNode(t)
	s := create(t, n, CreateRequest{TemplateID: "minimal", Secure: true, EnvVars: map[string]string{"GREETING": "hello from env"}})
	if s.State != sandboxes.Running || s.PID == 0 || s.AccessToken == "" {
		t.Fatalf("unexpected sandbox %+v", s)
	}
	c := newEnvdClient(s)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	tests := []struct {
		name      string
		user, cmd string
		args      []string
		stdout    string
		stderrHas string
		exit      int32
	}{
		{"stdout and exit 0", "", "/bin/sh", []string{"-c", "echo one; echo two"}, "one\ntwo\n", "", 0},
		{"stderr and exit code", "", "/bin/sh", []string{"-c", "echo oops >&2; exit 7"}, "", "oops", 7},
		{"env vars from init", "", "/bin/sh", []string{"-c", "echo $GREETING"}, "hello from env\n", "", 0},
		{"default user", "", "/bin/sh", []string{"-c", "id -u; echo $HOME"}, "1000\n/home/user\n", "", 0},
		{"root on request", "root", "/bin/sh", []string{"-c", "id -u"}, "0\n", "", 0},
		{"kernel is the guest's", "", "/bin/sh", []string{"-c", "uname -r"}, "", "", 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r, err := c.run(ctx, tt.user, tt.cmd, tt.args...)
			if err != nil {
				t.Fatal(err)
			}
			if tt.name == "kernel is the guest's" {
				host, _ := exec.Command("uname", "-r").Output()
				if r.stdout == "" || r.stdout == string(host) {
					t.Fatalf("guest kernel %q should differ from host %q", r.stdout, host)
				}
				return
			}
			if r.stdout != tt.stdout || !strings.Contains(r.stderr, tt.stderrHas) || r.exit != tt.exit {
				t.Fatalf("got stdout %q stderr %q exit %d; want %q, %q, %d", r.stdout, r.stderr, r.exit, tt.stdout, tt.stderrHas, tt.exit)
			}
		})
	}

	// Without the access token envd refuses.
	anon := *c
	anon.token = ""
	if _, err := anon.run(ctx, "", "/bin/true"); connect.CodeOf(err) != connect.CodeUnauthenticated && !strings.Contains(fmt.Sprint(err), "401") {
		t.Fatalf("run without token: %v", err)
	}

	// Kill removes everything.
	if err := n.Kill(ctx, s.ID); err != nil {
		t.Fatal(err)
	}
	assertGone(t, n, s)
}

func assertGone(t *testing.T, n *Node, s *sandboxes.Sandbox) {
	t.Helper()
	if _, err := n.Get(context.Background(), s.ID); !errors.Is(err, ErrNotFound) {
		t.Errorf("sandbox still recorded: %v", err)
	}
	if err := unixKill0(s.PID); err == nil {
		if b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", s.PID)); strings.Contains(string(b), s.ID) {
			t.Errorf("QEMU %d still running", s.PID)
		}
	}
	nss, _ := n.net.Namespaces()
	veths, _ := n.net.HostVeths()
	ep, _ := n.endpoint(s)
	if slices.Contains(nss, ep.Namespace) || slices.Contains(veths, ep.HostVeth) {
		t.Errorf("network leftovers: %v %v", nss, veths)
	}
	if _, err := os.Stat(n.sandboxDir(s.ID)); !os.IsNotExist(err) {
		t.Errorf("sandbox dir left: %v", err)
	}
	if strings.Contains(mounts(), s.ID) {
		t.Errorf("mounts left for %s", s.ID)
	}
}

func mounts() string {
	b, _ := os.ReadFile("/proc/self/mountinfo")
	return string(b)
}

func TestBaseTemplateProcessesFilesAndIsolation(t *testing.T) {
	n := testNode(t)
	s := create(t, n, CreateRequest{TemplateID: "base", Secure: true})
	c := newEnvdClient(s)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	t.Run("python3 streams output", func(t *testing.T) {
		r, err := c.run(ctx, "", "python3", "-c", "import sys,time\nfor i in range(3):\n print(i, flush=True); time.sleep(0.2)\nsys.exit(3)")
		if err != nil {
			t.Fatal(err)
		}
		if r.stdout != "0\n1\n2\n" || r.exit != 3 {
			t.Fatalf("python3: %+v", r)
		}
		if r.chunks < 3 {
			t.Fatalf("output arrived in %d chunks; want it streamed line by line", r.chunks)
		}
	})
	t.Run("bash", func(t *testing.T) {
		r, err := c.run(ctx, "", "bash", "-c", "echo ${BASH_VERSION%%.*} $(whoami) $PWD; false")
		if err != nil {
			t.Fatal(err)
		}
		if r.stdout != "5 user /home/user\n" || r.exit != 1 {
			t.Fatalf("bash: %+v", r)
		}
	})
	t.Run("files", func(t *testing.T) {
		content := []byte("hello\x00binary\xff world\n")
		if err := c.upload(ctx, "/home/user/dir/a.bin", content); err != nil {
			t.Fatal(err)
		}
		got, err := c.download(ctx, "/home/user/dir/a.bin")
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, content) {
			t.Fatalf("downloaded %q, want %q", got, content)
		}
		req := connect.NewRequest(&filesystempb.ListDirRequest{Path: "/home/user/dir", Depth: 1})
		c.headers(req.Header(), "")
		ls, err := c.fs.ListDir(ctx, req)
		if err != nil {
			t.Fatal(err)
		}
		if len(ls.Msg.Entries) != 1 || ls.Msg.Entries[0].Name != "a.bin" || ls.Msg.Entries[0].Size != int64(len(content)) || ls.Msg.Entries[0].Owner != "user" {
			t.Fatalf("ListDir: %v", ls.Msg.Entries)
		}
		r, err := c.run(ctx, "", "python3", "-c", "print(open('/home/user/dir/a.bin','rb').read().count(b'o'))")
		if err != nil || r.stdout != "2\n" {
			t.Fatalf("read back in guest: %+v %v", r, err)
		}
	})
	t.Run("guest cannot reach host services", func(t *testing.T) {
		ep, _ := n.endpoint(s)
		// A host service on all addresses, including the veth address the
		// guest's traffic arrives on, and one on loopback.
		ln, err := net.Listen("tcp", "0.0.0.0:0")
		if err != nil {
			t.Fatal(err)
		}
		defer ln.Close()
		go func() {
			for {
				c, err := ln.Accept()
				if err != nil {
					return
				}
				c.Write([]byte("host secret\n"))
				c.Close()
			}
		}()
		port := ln.Addr().(*net.TCPAddr).Port
		// Sanity: the host itself reaches it.
		if conn, err := net.Dial("tcp", fmt.Sprintf("127.0.0.1:%d", port)); err != nil {
			t.Fatal(err)
		} else {
			conn.Close()
		}
		script := fmt.Sprintf(`
import socket, sys
reached = []
for host in sys.argv[1:]:
    try:
        s = socket.create_connection((host, %d), timeout=3)
        reached.append(host + ":" + s.recv(100).decode().strip())
    except Exception as e:
        pass
print(reached)
`, port)
		r, err := c.run(ctx, "", "python3", "-c", script, "127.0.0.1", ep.HostIP.String(), ep.NSIP.String(), "169.254.0.22")
		if err != nil {
			t.Fatal(err)
		}
		if r.stdout != "[]\n" {
			t.Fatalf("guest reached host services: %s %s", r.stdout, r.stderr)
		}
	})
	if err := n.Kill(ctx, s.ID); err != nil {
		t.Fatal(err)
	}
	assertGone(t, n, s)
}

func TestCreateBadInputLeavesNothing(t *testing.T) {
	n := testNode(t)
	ctx := context.Background()
	tests := []struct {
		name string
		req  CreateRequest
		want error
	}{
		{"unknown template", CreateRequest{TemplateID: "no-such-template"}, ErrNotFound},
		{"traversal template", CreateRequest{TemplateID: "../etc"}, ErrNotFound},
		{"empty template", CreateRequest{}, ErrInvalid},
		{"absurd cpu", CreateRequest{TemplateID: "minimal", VCPUs: 4096}, ErrInvalid},
		{"absurd memory", CreateRequest{TemplateID: "minimal", MemoryMiB: 1 << 30}, ErrInvalid},
		{"tiny memory", CreateRequest{TemplateID: "minimal", MemoryMiB: 16}, ErrInvalid},
		{"negative timeout", CreateRequest{TemplateID: "minimal", Timeout: -time.Second}, ErrInvalid},
		{"disk past the node's limit", CreateRequest{TemplateID: "minimal", DiskMiB: 64<<10 + 1}, ErrInvalid},
		{"negative disk", CreateRequest{TemplateID: "minimal", DiskMiB: -1}, ErrInvalid},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := n.Create(ctx, tt.req)
			if !errors.Is(err, tt.want) {
				t.Fatalf("err = %v, want %v", err, tt.want)
			}
		})
	}
	all, _ := n.List(ctx)
	nss, _ := n.net.Namespaces()
	ents, _ := os.ReadDir(filepath.Join(n.cfg.DataDir, "sandboxes"))
	if len(all)+len(nss)+len(ents) != 0 {
		t.Fatalf("leftovers: %d records, netns %v, dirs %d", len(all), nss, len(ents))
	}
}

func TestMissingKernelOrQEMU(t *testing.T) {
	dir := t.TempDir()
	_, err := Open(context.Background(), Config{DataDir: dir, Kernel: filepath.Join(dir, "vmlinuz"), Initrd: filepath.Join(dir, "initrd")})
	if !errors.Is(err, ErrSetup) || !strings.Contains(err.Error(), "aenv setup") {
		t.Fatalf("missing kernel: %v", err)
	}
	for _, f := range []string{"vmlinuz", "initrd"} {
		os.WriteFile(filepath.Join(dir, f), []byte("x"), 0o644)
	}
	_, err = Open(context.Background(), Config{DataDir: dir, Kernel: filepath.Join(dir, "vmlinuz"), Initrd: filepath.Join(dir, "initrd"), QEMU: "qemu-does-not-exist"})
	if !errors.Is(err, ErrSetup) || !strings.Contains(err.Error(), "apt-get install qemu-system-x86") {
		t.Fatalf("missing qemu: %v", err)
	}
}

func (c *envdClient) upload(ctx context.Context, path string, content []byte) error {
	var body bytes.Buffer
	mw := multipart.NewWriter(&body)
	fw, _ := mw.CreateFormFile("file", filepath.Base(path))
	fw.Write(content)
	mw.Close()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+c.addr+"/files?path="+path, &body)
	req.Header.Set("Content-Type", mw.FormDataContentType())
	c.headers(req.Header, "")
	resp, err := testHTTP.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(resp.Body)
		return fmt.Errorf("upload: %d %s", resp.StatusCode, b)
	}
	return nil
}

func (c *envdClient) download(ctx context.Context, path string) ([]byte, error) {
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+c.addr+"/files?path="+path, nil)
	c.headers(req.Header, "")
	resp, err := testHTTP.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("download: %d %s", resp.StatusCode, b)
	}
	return b, err
}

func unixKill0(pid int) error {
	p, err := os.FindProcess(pid)
	if err != nil {
		return err
	}
	return p.Signal(syscall.Signal(0))
}
