package orchestrator

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/agentenv/agentenv/internal/builds"
	"github.com/agentenv/agentenv/internal/diskspace"
	"github.com/agentenv/agentenv/internal/errkind"
	"github.com/agentenv/agentenv/internal/network"
	"github.com/agentenv/agentenv/internal/operation"
	"github.com/agentenv/agentenv/internal/sandboxes"
	"github.com/agentenv/agentenv/internal/templates"
	"github.com/agentenv/agentenv/internal/vmm"
)

func TestExpiryKillsSandbox(t *testing.T) {
	n := testNode(t)
	s := create(t, n, CreateRequest{TemplateID: "minimal", Timeout: 2 * time.Second})
	if got := s.EndAt.Sub(s.StartedAt); got != 2*time.Second {
		t.Fatalf("end - start = %s", got)
	}
	deadline := time.Now().Add(15 * time.Second)
	for {
		_, err := n.Get(context.Background(), s.ID)
		if errors.Is(err, ErrNotFound) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("sandbox still exists 15s after its timeout")
		}
		time.Sleep(200 * time.Millisecond)
	}
	assertGone(t, n, s)
}

func TestSetTimeout(t *testing.T) {
	n := testNode(t)
	ctx := context.Background()
	s := create(t, n, CreateRequest{TemplateID: "minimal", Timeout: time.Minute})
	got, err := n.SetTimeout(ctx, s.ID, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	if d := time.Until(got.EndAt); d < 59*time.Minute || d > time.Hour {
		t.Fatalf("end at %s, %s from now", got.EndAt, d)
	}
	again, _ := n.Get(ctx, s.ID)
	if !again.EndAt.Equal(got.EndAt) {
		t.Fatalf("end time not persisted: %s vs %s", again.EndAt, got.EndAt)
	}
	for _, bad := range []time.Duration{0, -time.Second, 25 * time.Hour} {
		if _, err := n.SetTimeout(ctx, s.ID, bad); !errors.Is(err, ErrInvalid) {
			t.Errorf("SetTimeout(%s) = %v", bad, err)
		}
	}
	if _, err := n.SetTimeout(ctx, "nosuchsandbox", time.Minute); !errors.Is(err, ErrNotFound) {
		t.Errorf("SetTimeout on unknown id = %v", err)
	}
}

// TestRestartReadoptsAndCleansUp closes a node (as a crash or upgrade would
// leave it) and opens a new one on the same data dir: the running sandbox is
// re-adopted and still works; a sandbox caught mid-create is cleaned up.
func TestRestartReadoptsAndCleansUp(t *testing.T) {
	dir := newTestDataDir(t)
	ctx := context.Background()
	n1 := openTestNode(t, dir)
	keep := create(t, n1, CreateRequest{TemplateID: "minimal", Secure: true})
	half := create(t, n1, CreateRequest{TemplateID: "minimal"})
	// Pretend the process died in the middle of creating `half`, and of
	// assembling a snapshot.
	if err := n1.records.Set(ctx, half.ID, "state = ?", sandboxes.Creating); err != nil {
		t.Fatal(err)
	}
	unfinished := filepath.Join(dir, snapshotsDir, ".fork-unfinished")
	if err := os.MkdirAll(unfinished, 0o700); err != nil {
		t.Fatal(err)
	}
	n1.Close()

	n2 := openTestNode(t, dir)
	if _, err := os.Stat(unfinished); !os.IsNotExist(err) {
		t.Fatalf("an unfinished snapshot survived the restart: %v", err)
	}
	defer func() {
		all, _ := n2.List(ctx)
		for _, s := range all {
			n2.Kill(ctx, s.ID)
		}
		n2.Close()
	}()
	got, err := n2.Get(ctx, keep.ID)
	if err != nil || got.State != sandboxes.Running || got.PID != keep.PID {
		t.Fatalf("after restart: %+v, %v", got, err)
	}
	r, err := newEnvdClient(got).run(ctx, "", "/bin/sh", "-c", "echo still here")
	if err != nil || r.stdout != "still here\n" {
		t.Fatalf("re-adopted sandbox does not answer: %+v %v", r, err)
	}
	assertGone(t, n2, half)
	// The re-adopted machine is fully managed: killing it cleans up.
	if err := n2.Kill(ctx, keep.ID); err != nil {
		t.Fatal(err)
	}
	assertGone(t, n2, keep)
}

// TestQEMUDeathIsNoticed kills a sandbox's QEMU from outside: the node
// reports the sandbox gone and frees its resources.
func TestQEMUDeathIsNoticed(t *testing.T) {
	n := testNode(t)
	s := create(t, n, CreateRequest{TemplateID: "minimal"})
	if err := exec.Command("kill", "-9", fmt.Sprint(s.PID)).Run(); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		if _, err := n.Get(context.Background(), s.ID); errors.Is(err, ErrNotFound) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("dead sandbox still listed")
		}
		time.Sleep(100 * time.Millisecond)
	}
	assertGone(t, n, s)
}

// testHost makes a test host: network namespace ns, linked to the host by
// the veth pair hostIf/eth0, the host end at hostIP and the namespace end at
// nsIP (both /30), its default route through the host. It goes with the test.
func testHost(t *testing.T, ns, hostIf, hostIP, nsIP string) {
	t.Helper()
	sh := func(args ...string) {
		t.Helper()
		if out, err := exec.Command(args[0], args[1:]...).CombinedOutput(); err != nil {
			t.Fatalf("%v: %v %s", args, err, out)
		}
	}
	exec.Command("ip", "netns", "del", ns).Run()
	exec.Command("ip", "link", "del", hostIf).Run()
	sh("ip", "netns", "add", ns)
	t.Cleanup(func() {
		exec.Command("ip", "netns", "del", ns).Run()
		exec.Command("ip", "link", "del", hostIf).Run()
	})
	sh("ip", "link", "add", hostIf, "type", "veth", "peer", "name", "eth0", "netns", ns)
	sh("ip", "addr", "add", hostIP+"/30", "dev", hostIf)
	sh("ip", "link", "set", hostIf, "up")
	sh("ip", "-n", ns, "addr", "add", nsIP+"/30", "dev", "eth0")
	sh("ip", "-n", ns, "link", "set", "eth0", "up")
	sh("ip", "-n", ns, "link", "set", "lo", "up")
	sh("ip", "-n", ns, "route", "add", "default", "via", hostIP)
}

// TestInternetAccessSwitch stands up an "internet" host in a network
// namespace of its own, reachable from the host only by routing, and checks
// that a default sandbox reaches it while one created with internet access
// off does not.
func TestInternetAccessSwitch(t *testing.T) {
	n := testNode(t)
	const ns = "aetstinet"
	testHost(t, ns, "aetstinet0", "10.216.0.1", "10.216.0.2")
	srv := exec.Command("ip", "netns", "exec", ns, "python3", "-c", `
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("10.216.0.2", 18080)); s.listen(16)
while True:
    c, a = s.accept(); c.sendall(b"internet says hi from " + a[0].encode() + b"\n"); c.close()
`)
	if err := srv.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Process.Kill(); srv.Wait() })

	probe := `
import socket, time
for i in range(20):
    try:
        s = socket.create_connection(("10.216.0.2", 18080), timeout=2)
        print(s.recv(100).decode().strip()); break
    except Exception as e:
        err = e; time.sleep(0.2)
else:
    print("unreachable:", err)
`
	reaches := func(s *sandboxes.Sandbox) (bool, string) {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		r, err := newEnvdClient(s).run(ctx, "", "python3", "-c", strings.Replace(probe, "range(20)", "range(3)", 1))
		if err != nil {
			t.Fatalf("probe in %s: %v", s.ID, err)
		}
		return strings.HasPrefix(r.stdout, "internet says hi"), r.stdout
	}
	// The test host is at a private address, as a cluster's own services
	// are: a guest with internet access does not reach it by default.
	def := create(t, n, CreateRequest{TemplateID: "base"})
	if ok, out := reaches(def); ok {
		t.Fatalf("a default sandbox reached a host at a private address: %s", out)
	}
	host := network.Egress{Allow: []netip.Prefix{netip.MustParsePrefix("10.216.0.2/32")}}
	allowed := create(t, n, CreateRequest{TemplateID: "base", Egress: &host})
	ok, out := reaches(allowed)
	if !ok {
		t.Fatalf("a sandbox allowed to reach the host cannot: %s", out)
	}
	if !strings.Contains(out, "10.216.0.1") {
		t.Errorf("egress not masqueraded behind the host (want source 10.216.0.1): %s", out)
	}
	off := false
	blocked := create(t, n, CreateRequest{TemplateID: "base", AllowInternet: &off})
	if ok, out := reaches(blocked); ok {
		t.Fatalf("sandbox with internet off reached the host: %s", out)
	}
	// Rules change on a running sandbox, and survive pause, resume and
	// fork (children inherit).
	ctx := context.Background()
	if _, err := n.SetNetwork(ctx, def.ID, true, host); err != nil {
		t.Fatal(err)
	}
	if ok, out := reaches(def); !ok {
		t.Fatalf("after opening the host: %s", out)
	}
	if _, err := n.SetNetwork(ctx, allowed.ID, true, network.Egress{}); err != nil {
		t.Fatal(err)
	}
	if ok, out := reaches(allowed); ok {
		t.Fatalf("after closing the host again: %s", out)
	}
	if _, err := n.Pause(ctx, def.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := n.Resume(ctx, def.ID, 0); err != nil {
		t.Fatal(err)
	}
	if ok, out := reaches(def); !ok {
		t.Fatalf("the rules did not survive pause and resume: %s", out)
	}
	kids, err := n.Fork(ctx, def.ID, 1, 0)
	if err != nil || kids[0].Err != nil {
		t.Fatalf("fork: %v %v", err, kids)
	}
	t.Cleanup(func() { n.Kill(context.Background(), kids[0].Sandbox.ID) })
	if ok, out := reaches(kids[0].Sandbox); !ok {
		t.Fatalf("the fork child did not inherit its parent's rules: %s", out)
	}
	if ok, out := reaches(blocked); ok {
		t.Fatalf("the other sandbox's rules changed: %s", out)
	}
	// No sandbox reaches another's envd, even with everything allowed.
	if _, err := n.SetNetwork(ctx, allowed.ID, true, network.Egress{Allow: []netip.Prefix{netip.MustParsePrefix("0.0.0.0/0")}}); err != nil {
		t.Fatal(err)
	}
	bep, _ := n.endpoint(blocked)
	r, err := newEnvdClient(allowed).run(ctx, "", "python3", "-c", fmt.Sprintf(`
import socket
try:
    socket.create_connection((%q, 49983), timeout=3); print("reached")
except Exception as e:
    print("blocked")
`, bep.NSIP.String()))
	if err != nil || r.stdout != "blocked\n" {
		t.Fatalf("sandbox reached another sandbox: %+v %v", r, err)
	}
}

// TestConsoleLog reads a sandbox's console log, then floods it from the
// guest: the host's file stays within its cap (a ring of the newest bytes,
// still read whole).
func TestConsoleLog(t *testing.T) {
	n := testNode(t, func(c *Config) { c.ConsoleLogMiB = 1 })
	s := create(t, n, CreateRequest{TemplateID: "minimal"})
	ctx := context.Background()
	all, err := n.ConsoleLog(ctx, s.ID, 0)
	if err != nil || !strings.Contains(string(all), "aenv-init") {
		t.Fatalf("console log %q, %v", all, err)
	}
	tail, err := n.ConsoleLog(ctx, s.ID, 10)
	if err != nil || len(tail) != 10 || !strings.HasSuffix(string(all), string(tail)) {
		t.Fatalf("tail %q, %v", tail, err)
	}
	if _, err := n.ConsoleLog(ctx, "nosuchsandbox", 0); !errors.Is(err, ErrNotFound) {
		t.Fatalf("unknown sandbox: %v", err)
	}

	// Three times the cap, as a guest's `yes > /dev/ttyS0` would.
	const flood, limit = 3 << 20, 1 << 20
	r, err := newEnvdClient(s).run(ctx, "root", "sh", "-c",
		fmt.Sprintf("head -c %d /dev/zero | tr '\\0' y > /dev/ttyS0 && echo CONSOLE-FLOOD-END > /dev/ttyS0", flood))
	if err != nil || r.exit != 0 {
		t.Fatalf("flood: %+v %v", r, err)
	}
	var st syscall.Stat_t
	if err := syscall.Stat(filepath.Join(n.sandboxDir(s.ID), vmm.ConsoleName), &st); err != nil {
		t.Fatal(err)
	}
	// The ring is trimmed every half second: the guest writes well under
	// a MiB in that time.
	if held := st.Blocks * 512; held > 2*limit {
		t.Fatalf("console log holds %d bytes on disk after a %d-byte flood (cap %d)", held, flood, limit)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		all, err = n.ConsoleLog(ctx, s.ID, 0)
		if err != nil {
			t.Fatal(err)
		}
		if strings.Contains(string(all), "CONSOLE-FLOOD-END") || time.Now().After(deadline) {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if !strings.Contains(string(all), "CONSOLE-FLOOD-END") || len(all) > 2*limit || !strings.Contains(string(all), "yyyy") {
		t.Fatalf("console log after the flood: %d bytes, ends %q", len(all), all[max(0, len(all)-80):])
	}
	t.Logf("console log after a %d-byte flood: %d bytes read, %d on disk", flood, len(all), st.Blocks*512)
}

// TestRestartMidOperation reopens a node whose sandboxes were caught in the
// middle of a pause or a resume (as a crash would leave them): each comes
// back in the last state that can be trusted, nothing is lost.
func TestRestartMidOperation(t *testing.T) {
	dir := newTestDataDir(t)
	ctx := context.Background()
	n1 := openTestNode(t, dir)
	live := create(t, n1, CreateRequest{TemplateID: "minimal", Secure: true})
	saved := create(t, n1, CreateRequest{TemplateID: "minimal", Secure: true})
	if _, err := n1.Pause(ctx, saved.ID); err != nil {
		t.Fatal(err)
	}
	// `live` was being paused (its QEMU still runs, stopped), `saved` was
	// being resumed (its state on disk is complete, no QEMU yet).
	if err := n1.machines.get(live.ID).Pause(ctx); err != nil {
		t.Fatal(err)
	}
	n1.records.Set(ctx, live.ID, "state = ?", sandboxes.Pausing)
	n1.records.Set(ctx, saved.ID, "state = ?", sandboxes.Resuming)
	// A template build's builder, whose build the restart ends (a
	// crashed node never killed it): hidden from listings, it would run
	// on until its timeout.
	builder := create(t, n1, CreateRequest{TemplateID: "minimal", Metadata: map[string]string{sandboxes.MetaInternal: "template build"}})
	builderPID := n1.machines.get(builder.ID).PID()
	n1.Close()

	n2 := openTestNode(t, dir)
	defer func() {
		for _, id := range []string{live.ID, saved.ID} {
			n2.Kill(ctx, id)
		}
		n2.Close()
	}()
	if _, err := n2.Get(ctx, builder.ID); !errors.Is(err, ErrNotFound) {
		t.Fatalf("the builder of an interrupted build after restart: %v", err)
	}
	if unixKill0(builderPID) == nil {
		t.Fatalf("the QEMU of an interrupted build's builder (pid %d) runs on", builderPID)
	}
	got, err := n2.Get(ctx, live.ID)
	if err != nil || got.State != sandboxes.Running {
		t.Fatalf("mid-pause sandbox after restart: %+v %v", got, err)
	}
	if r, err := newEnvdClient(got).run(ctx, "", "/bin/sh", "-c", "echo ok"); err != nil || r.stdout != "ok\n" {
		t.Fatalf("mid-pause sandbox does not answer: %+v %v", r, err)
	}
	got, err = n2.Get(ctx, saved.ID)
	if err != nil || got.State != sandboxes.Paused {
		t.Fatalf("mid-resume sandbox after restart: %+v %v", got, err)
	}
	res, err := n2.Resume(ctx, saved.ID, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if r, err := newEnvdClient(res).run(ctx, "", "/bin/sh", "-c", "echo ok"); err != nil || r.stdout != "ok\n" {
		t.Fatalf("resumed sandbox does not answer: %+v %v", r, err)
	}
}

// TestRestartMidFork stops a node right after a fork froze its parent (QEMU
// gone, RAM and disk moved into the snapshot), as a crash would: on restart
// the parent is rebuilt from the snapshot as a paused sandbox and resumes
// with its processes and files.
func TestRestartMidFork(t *testing.T) {
	dir := newTestDataDir(t)
	ctx := context.Background()
	n1 := openTestNode(t, dir)
	s := create(t, n1, CreateRequest{TemplateID: "minimal", Secure: true})
	r, err := newEnvdClient(s).run(ctx, "", "/bin/sh", "-c", "echo precious > /home/user/f; sleep 1000 >/dev/null 2>&1 & echo $!")
	if err != nil || r.exit != 0 {
		t.Fatalf("prepare: %+v %v", r, err)
	}
	pid := strings.TrimSpace(r.stdout)
	if err := n1.records.Move(ctx, s.ID, sandboxes.Running, sandboxes.Forking, ""); err != nil {
		t.Fatal(err)
	}
	if _, _, err := n1.freeze(operation.Start(ctx, "fork", time.Minute, nil), s, sandboxes.Forking); err != nil {
		t.Fatal(err)
	}
	n1.Close() // "crash": the parent is not restored

	n2 := openTestNode(t, dir)
	defer func() { n2.Kill(ctx, s.ID); n2.Close() }()
	got, err := n2.Get(ctx, s.ID)
	if err != nil || got.State != sandboxes.Paused {
		t.Fatalf("parent after a crash mid-fork: %+v %v", got, err)
	}
	res, err := n2.Resume(ctx, s.ID, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	out, err := newEnvdClient(res).run(ctx, "", "/bin/sh", "-c", "cat /home/user/f && kill -0 "+pid+" && echo alive")
	if err != nil || out.stdout != "precious\nalive\n" {
		t.Fatalf("recovered parent: %+v %v", out, err)
	}
}

// TestGuestDomainRules: a guest resolves names through the node's resolver
// for it (forwarded to a test resolver this test runs at a private address)
// and, with internet access off and a domain rule, reaches by HTTP the
// names the rule allows and no other; names it may not reach do not
// resolve. The rules hold across pause and resume, in a fork child, and
// after the node restarts (its resolvers and proxies live in the node).
func TestGuestDomainRules(t *testing.T) {
	const ns, hostIf, world = "aetstdom", "aetstdom0", "10.216.1.2"
	dir := newTestDataDir(t)
	cfg := func(c *Config) {
		c.DNSResolvers = []netip.AddrPort{netip.MustParseAddrPort(world + ":53")}
		c.EgressOpen = []netip.Prefix{netip.MustParsePrefix(world + "/32")}
	}
	slot := takeTestSlot()
	t.Cleanup(func() { releaseTestSlot(slot) })
	n := openTestNodeIn(t, dir, slot, cfg)
	closed := false
	t.Cleanup(func() {
		if !closed {
			all, _ := n.List(context.Background())
			for _, s := range all {
				n.Kill(context.Background(), s.ID)
			}
			n.Close()
		}
	})
	testHost(t, ns, hostIf, "10.216.1.1", world)
	// The test host: a web server answering with the Host asked for, and a
	// resolver answering every A query with its own address.
	srv := exec.Command("ip", "netns", "exec", ns, "python3", "-c", `
import socket, socketserver, struct, threading, http.server
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = ("web says hi to " + self.headers.get("Host", "") + "\n").encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers(); self.wfile.write(body)
    def log_message(self, *a): pass
class S(socketserver.ThreadingMixIn, socketserver.TCPServer):
    allow_reuse_address = True; daemon_threads = True
web = S(("10.216.1.2", 80), H)
threading.Thread(target=web.serve_forever, daemon=True).start()
d = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); d.bind(("10.216.1.2", 53))
while True:
    q, a = d.recvfrom(4096)
    end = 12
    while q[end] != 0: end += 1 + q[end]
    qtype = struct.unpack(">H", q[end + 1:end + 3])[0]
    question = q[12:end + 5]
    if qtype == 1:
        r = q[:2] + struct.pack(">HHHHH", 0x8180, 1, 1, 0, 0) + question + b"\xc0\x0c" + struct.pack(">HHIH", 1, 1, 60, 4) + bytes([10, 216, 1, 2])
    else:
        r = q[:2] + struct.pack(">HHHHH", 0x8180, 1, 0, 0, 0) + question
    d.sendto(r, a)
`)
	if err := srv.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Process.Kill(); srv.Wait() })
	time.Sleep(500 * time.Millisecond)

	// get prints what http://<name>/ answers, the name resolved by the
	// guest's resolver, or connected to the test host directly with
	// "name@ip".
	probe := `
import socket, sys, http.client
for target in sys.argv[1:]:
    name, _, ip = target.partition("@")
    try:
        addr = ip or socket.gethostbyname(name)
        c = http.client.HTTPConnection(addr, 80, timeout=5)
        c.request("GET", "/", headers={"Host": name})
        r = c.getresponse()
        print(name, r.status, r.read().decode().strip())
    except Exception as e:
        print(name, "failed", type(e).__name__)
`
	check := func(s *sandboxes.Sandbox, when string) {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		r, err := newEnvdClient(s).run(ctx, "", "python3", "-c", probe, "www.allowed.test", "other.test", "other.test@"+world)
		if err != nil {
			t.Fatalf("%s: probe: %v", when, err)
		}
		want := "www.allowed.test 200 web says hi to www.allowed.test\nother.test failed gaierror\nother.test 403 the sandbox's network rules do not allow this host\n"
		if r.stdout != want {
			t.Fatalf("%s: got\n%s\nwant\n%s(stderr %s)", when, r.stdout, want, r.stderr)
		}
	}
	off := false
	rules := network.Egress{Domains: []string{"*.allowed.test"}}
	s := create(t, n, CreateRequest{TemplateID: "base", AllowInternet: &off, Egress: &rules})
	check(s, "created")
	ctx := context.Background()
	if _, err := n.Pause(ctx, s.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := n.Resume(ctx, s.ID, 0); err != nil {
		t.Fatal(err)
	}
	check(s, "after pause and resume")
	kids, err := n.Fork(ctx, s.ID, 1, 0)
	if err != nil || kids[0].Err != nil {
		t.Fatalf("fork: %v %v", err, kids)
	}
	check(kids[0].Sandbox, "fork child")
	closed = true
	n.Close()
	n = openTestNodeIn(t, dir, slot, cfg)
	closed = false
	check(s, "after the node restarted")
}

// TestDiskFloor: below its floor of free disk space the node refuses
// starts, snapshots, image imports and builds (507, saying so) having
// changed nothing, and keeps what it holds: a running sandbox runs on, a
// paused one stays paused, and both work again once there is room.
func TestDiskFloor(t *testing.T) {
	n := testNode(t)
	ctx := context.Background()
	s := create(t, n, CreateRequest{TemplateID: "minimal"})
	free, err := diskspace.Free(n.cfg.DataDir)
	if err != nil {
		t.Fatal(err)
	}
	n.floor = diskspace.NewFloor(n.cfg.DataDir, free+1<<40)
	before, err := n.records.List(ctx, "")
	if err != nil {
		t.Fatal(err)
	}
	build, err := n.RequestBuild("floor-build", nil, 1, 256)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name string
		do   func() error
	}{
		{"create", func() error { _, err := n.Create(ctx, CreateRequest{TemplateID: "minimal"}); return err }},
		{"fork", func() error { _, err := n.Fork(ctx, s.ID, 1, 0); return err }},
		{"snapshot", func() error { _, err := n.Snapshot(ctx, s.ID, "floor-snapshot"); return err }},
		{"image import", func() error {
			_, err := n.CreateFromImage(ctx, "oci-layout:"+t.TempDir(), CreateRequest{})
			return err
		}},
		{"build", func() error {
			return n.StartBuild(build.TemplateID, build.BuildID, builds.Spec{FromTemplate: "minimal"})
		}},
	} {
		err := c.do()
		var short *diskspace.Shortage
		if !errors.As(err, &short) || !errors.Is(err, errkind.ErrNoSpace) || !strings.Contains(err.Error(), "nearly full") {
			t.Fatalf("%s below the floor: %v", c.name, err)
		}
	}
	after, err := n.records.List(ctx, "")
	if err != nil || len(after) != len(before) {
		t.Fatalf("the refusals changed the sandboxes: %d before, %d after (%v)", len(before), len(after), err)
	}
	if _, err := n.namedSnapshot("floor-snapshot"); err == nil {
		t.Fatal("a refused snapshot exists")
	}
	if r, err := newEnvdClient(s).run(ctx, "", "true"); err != nil || r.exit != 0 {
		t.Fatalf("the running sandbox after the refusals: %+v %v", r, err)
	}
	// A pause keeps what the user has: it is not refused.
	if _, err := n.Pause(ctx, s.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := n.Resume(ctx, s.ID, 0); !errors.Is(err, errkind.ErrNoSpace) {
		t.Fatalf("resume below the floor: %v", err)
	}
	if got, err := n.Get(ctx, s.ID); err != nil || got.State != sandboxes.Paused {
		t.Fatalf("after a refused resume: %+v %v", got, err)
	}
	n.floor = diskspace.NewFloor(n.cfg.DataDir, 0)
	if _, err := n.Resume(ctx, s.ID, 0); err != nil {
		t.Fatal(err)
	}
	if r, err := newEnvdClient(s).run(ctx, "", "true"); err != nil || r.exit != 0 {
		t.Fatalf("the sandbox resumed with room again: %+v %v", r, err)
	}
}

// TestEnvdOutlivesGuestOOM: envd runs with oom_score_adj -1000, the
// processes it starts at the guest's default, so the guest's OOM killer
// takes a memory hog (twice) and never envd; and when envd dies anyway
// (killed), PID 1 starts it again.
func TestEnvdOutlivesGuestOOM(t *testing.T) {
	n := testNode(t)
	ctx := context.Background()
	s := create(t, n, CreateRequest{TemplateID: "base", MemoryMiB: 256})
	c := newEnvdClient(s)
	envdScore := `import os
for p in os.listdir("/proc"):
    if p.isdigit():
        try:
            cmd = open("/proc/%s/cmdline" % p, "rb").read().split(b"\0")
        except OSError:
            continue
        if cmd[:2] == [b"envd", b"serve"]:
            print(p, open("/proc/%s/oom_score_adj" % p).read().strip())
`
	pid, score := "", ""
	if _, err := fmt.Sscan(guestRun(t, s, "root", "python3 -c '"+envdScore+"'"), &pid, &score); err != nil || score != "-1000" {
		t.Fatalf("envd (pid %s) runs with oom_score_adj %q (%v)", pid, score, err)
	}
	if got := guestRun(t, s, "", "cat /proc/self/oom_score_adj"); got != "0\n" {
		t.Fatalf("a process envd started has oom_score_adj %q", got)
	}
	hog := "a = []\nwhile True: a.append(bytearray(16 << 20))"
	for i := 0; i < 2; i++ {
		r, err := c.run(ctx, "", "python3", "-c", hog)
		if err != nil || r.exit == 0 {
			t.Fatalf("memory hog %d: %+v %v", i, r, err)
		}
		if got := guestRun(t, s, "", "echo ok"); got != "ok\n" {
			t.Fatalf("after OOM %d envd answers %q", i, got)
		}
	}
	// The OOM killer took the hogs, not envd.
	var again string
	if _, err := fmt.Sscan(guestRun(t, s, "root", "python3 -c '"+envdScore+"'"), &again); err != nil || again != pid {
		t.Fatalf("envd was pid %s, is %s (%v)", pid, again, err)
	}
	// Killed anyway, envd is started again by PID 1.
	_, _ = c.run(ctx, "root", "kill", "-9", pid)
	deadline := time.Now().Add(30 * time.Second)
	for {
		rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		r, err := c.run(rctx, "", "echo", "back")
		cancel()
		if err == nil && r.stdout == "back\n" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("envd did not come back after a kill: %+v %v", r, err)
		}
		time.Sleep(200 * time.Millisecond)
	}
	if _, err := fmt.Sscan(guestRun(t, s, "root", "python3 -c '"+envdScore+"'"), &again, &score); err != nil || again == pid || score != "-1000" {
		t.Fatalf("the restarted envd: pid %s (was %s), oom_score_adj %q (%v)", again, pid, score, err)
	}
}

// TestFullDisk runs a node whose data dir's file system (a small tmpfs)
// fills up: a fork answers with the disk being full (507), not an
// internal error; a guest that then touches new memory (its RAM file is
// sparse on that disk) loses its QEMU; and once there is room again the
// dead sandbox is removed within seconds rather than listed running,
// unreachable, until a restart.
func TestFullDisk(t *testing.T) {
	shared := testData(t)
	dir := filepath.Join(t.TempDir(), "data")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Mount("tmpfs", dir, "tmpfs", 0, "size=1200m,mode=0700"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { syscall.Unmount(dir, syscall.MNT_DETACH) })
	cat, closeCat, err := templates.OpenReadOnly(shared)
	if err != nil {
		t.Fatal(err)
	}
	err = cat.Export(context.Background(), "minimal", filepath.Join(dir, templates.LegacyDir, "minimal"))
	closeCat()
	if err != nil {
		t.Fatal(err)
	}
	// No floor: the disk is to fill up.
	n := testNodeIn(t, dir, func(c *Config) { c.MinFreeDiskMiB = -1 })
	ctx := context.Background()
	s := create(t, n, CreateRequest{TemplateID: "minimal", MemoryMiB: 256})
	filler, err := os.Create(filepath.Join(dir, "filler"))
	if err != nil {
		t.Fatal(err)
	}
	for buf := make([]byte, 64<<10); ; {
		if _, err := filler.Write(buf); err != nil {
			break
		}
	}
	filler.Close()
	if _, err := n.Fork(ctx, s.ID, 1, 0); !errkind.IsNoSpace(err) {
		t.Fatalf("fork on a full disk: %v", err)
	}
	// The guest takes 128 MiB of memory it has not touched yet.
	rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	_, _ = newEnvdClient(s).run(rctx, "root", "dd", "if=/dev/zero", "of=/dev/null", "bs=128M", "count=1")
	cancel()
	if err := os.Remove(filler.Name()); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(60 * time.Second)
	for {
		got, err := n.Get(ctx, s.ID)
		if errors.Is(err, ErrNotFound) {
			t.Logf("the sandbox whose QEMU died on the full disk is gone")
			return
		}
		rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		r, rerr := newEnvdClient(s).run(rctx, "", "echo", "ok")
		cancel()
		if err == nil && got.State == sandboxes.Running && rerr == nil && r.stdout == "ok\n" {
			t.Logf("the sandbox outlived the full disk")
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("a minute after the disk had room again the sandbox is %+v (%v), unreachable: %v", got, err, rerr)
		}
		time.Sleep(500 * time.Millisecond)
	}
}
