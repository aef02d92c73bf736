package e2e

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestCrashRecovery kills the server (SIGKILL, from fault injection points
// in the code: AENV_FAULT) in the middle of a create, a pause, a snapshot
// upload and a fork, and kills a sandbox's QEMU; after each restart nothing
// acknowledged is lost and nothing is left behind: every network
// namespace, veth, cgroup, sandbox directory and QEMU process belongs to a
// sandbox the server lists.
func TestCrashRecovery(t *testing.T) {
	s := needServer(t) // builds the binary
	testData := os.Getenv("AENV_TEST_DATA_DIR")
	root := t.TempDir()
	dataDir := filepath.Join(root, "data")
	if err := prepareDataDir(testData, dataDir, false); err != nil {
		t.Fatal(err)
	}
	addr := freeAddr(t)
	const instance = "crsh"
	p := &proc{name: "server", url: "http://" + addr, log: filepath.Join(root, "server.log"),
		args: []string{"server", "--data-dir", dataDir, "--listen", addr, "--instance", instance, "--dns", "none",
			"--network-cidr", "10.220.0.0/16", "--pool-size", "0", "--log-level", "debug"}}
	api := &server{url: p.url, logPath: p.log, bin: s.bin}
	start := func(fault string) {
		t.Helper()
		p.env = nil
		if fault != "" {
			p.env = []string{"AENV_FAULT=" + fault}
		}
		p.start(t, s.bin)
	}
	t.Cleanup(func() {
		if p.cmd == nil {
			start("")
		}
		var list []map[string]any
		api.rest(context.Background(), "GET", "/v2/sandboxes", nil, &list)
		for _, sb := range list {
			api.rest(context.Background(), "DELETE", "/sandboxes/"+sb["sandboxID"].(string), nil, nil)
		}
		p.stop()
	})
	// tryCrash arms a fault point, sends the request and waits for the
	// server to die of SIGKILL there; a request that is answered instead
	// (it did not pass the point) stops the armed server and starts it
	// clean, and tryCrash reports false.
	tryCrash := func(fault string, send func(ctx context.Context) error) bool {
		t.Helper()
		p.stop()
		start(fault)
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		err := send(ctx)
		var ae *apiError
		if err == nil || errors.As(err, &ae) {
			t.Logf("answered (%v) at %s", err, fault)
			p.stop()
			start("")
			return false
		}
		werr := p.cmd.Wait()
		var ee *exec.ExitError
		if !errors.As(werr, &ee) || ee.Sys().(syscall.WaitStatus).Signal() != syscall.SIGKILL {
			t.Fatalf("server did not die of SIGKILL at %s: %v", fault, werr)
		}
		p.cmd = nil
		start("")
		return true
	}
	crashWith := func(fault, what string, send func(ctx context.Context) error) {
		t.Helper()
		if !tryCrash(fault, send) {
			t.Fatalf("%s answered instead of crashing at %s\n%s", what, fault, p.tail())
		}
	}
	// crashMaybe is tryCrash for a request to the API.
	crashMaybe := func(fault, method, path string, body any) bool {
		t.Helper()
		return tryCrash(fault, func(ctx context.Context) error { return api.rest(ctx, method, path, body, nil) })
	}
	crashIn := func(fault, method, path string, body any) {
		t.Helper()
		crashWith(fault, method+" "+path, func(ctx context.Context) error { return api.rest(ctx, method, path, body, nil) })
	}
	list := func() map[string]string {
		t.Helper()
		var l []struct {
			SandboxID string `json:"sandboxID"`
			State     string `json:"state"`
		}
		if err := api.rest(context.Background(), "GET", "/v2/sandboxes", nil, &l); err != nil {
			t.Fatal(err)
		}
		out := map[string]string{}
		for _, sb := range l {
			out[sb.SandboxID] = sb.State
		}
		return out
	}
	noOrphans := func(when string) {
		t.Helper()
		known := list()
		var problems []string
		if out, err := exec.Command("ip", "netns", "list").Output(); err == nil {
			for _, line := range strings.Split(string(out), "\n") {
				if id, ok := strings.CutPrefix(strings.Fields(line + " x")[0], instance+"-"); ok && known[id] == "" {
					problems = append(problems, "netns "+strings.Fields(line)[0])
				}
			}
		}
		if out, err := exec.Command("ip", "-o", "link", "show").Output(); err == nil {
			veths := strings.Count(string(out), ": "+instance+"-h")
			if veths > len(known) {
				problems = append(problems, fmt.Sprintf("%d veths for %d sandboxes", veths, len(known)))
			}
		}
		ents, _ := os.ReadDir(filepath.Join(dataDir, "sandboxes"))
		for _, e := range ents {
			if !strings.HasPrefix(e.Name(), ".") && known[e.Name()] == "" {
				problems = append(problems, "directory sandboxes/"+e.Name())
			}
		}
		cgs, _ := filepath.Glob("/sys/fs/cgroup/*/aenv/" + instance + "-*")
		more, _ := filepath.Glob("/sys/fs/cgroup/aenv/" + instance + "-*")
		for _, cg := range append(cgs, more...) {
			if known[strings.TrimPrefix(filepath.Base(cg), instance+"-")] == "" {
				problems = append(problems, "cgroup "+cg)
			}
		}
		procs, _ := filepath.Glob("/proc/[0-9]*/cmdline")
		for _, c := range procs {
			b, err := os.ReadFile(c)
			if err != nil || !strings.Contains(string(b), filepath.Join(dataDir, "sandboxes")+"/") || !strings.Contains(string(b), "qemu") {
				continue
			}
			rest := string(b)[strings.Index(string(b), filepath.Join(dataDir, "sandboxes")+"/")+len(filepath.Join(dataDir, "sandboxes"))+1:]
			id := strings.FieldsFunc(rest, func(r rune) bool { return r == '/' || r == 0 || r == ',' })[0]
			if known[id] != "running" {
				problems = append(problems, fmt.Sprintf("QEMU %s of sandbox %s (%q)", filepath.Base(filepath.Dir(c)), id, known[id]))
			}
		}
		if len(problems) > 0 {
			t.Fatalf("after %s, left behind: %v (sandboxes %v)\n%s", when, problems, known, p.tail())
		}
	}
	create := func() *sandbox {
		t.Helper()
		var sb sandbox
		if err := api.rest(context.Background(), "POST", "/sandboxes", map[string]any{"templateID": "minimal", "timeout": 600}, &sb); err != nil {
			t.Fatalf("create: %v\n%s", err, p.tail())
		}
		return &sb
	}
	envdUp := func(sb *sandbox) bool {
		req := api.sandboxRequest(context.Background(), sb, envdPort, "GET", "/health", nil, true)
		resp, err := http1Client.Do(req)
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode/100 == 2
	}

	start("")
	// Wait for the template snapshots, so the crashes hit restores.
	for deadline := time.Now().Add(4 * time.Minute); !strings.Contains(readAll(p.log), `msg="template snapshot ready" template=minimal`); time.Sleep(250 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("no template snapshot\n%s", p.tail())
		}
	}

	t.Run("create, recorded", func(t *testing.T) {
		crashIn("create-recorded", "POST", "/sandboxes", map[string]any{"templateID": "minimal"})
		if l := list(); len(l) != 0 {
			t.Fatalf("a half-created sandbox is listed: %v", l)
		}
		noOrphans("a crash in create (recorded)")
	})

	t.Run("create, QEMU started", func(t *testing.T) {
		crashIn("create-started", "POST", "/sandboxes", map[string]any{"templateID": "minimal"})
		l := list()
		if len(l) != 0 {
			t.Fatalf("a create that was never acknowledged left %v", l)
		}
		noOrphans("a crash in create (QEMU started)")
	})

	t.Run("create, made but its answer not kept for the Idempotency-Key", func(t *testing.T) {
		body := `{"templateID":"minimal","timeout":600}`
		post := func(ctx context.Context) (int, string, error) {
			req, _ := http.NewRequestWithContext(ctx, "POST", api.url+"/v2/sandboxes", strings.NewReader(body))
			req.Header.Set("X-API-Key", apiKey)
			req.Header.Set("Content-Type", "application/json")
			req.Header.Set("Idempotency-Key", "crash-episode-1")
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				return 0, "", err
			}
			defer resp.Body.Close()
			var sb sandbox
			err = json.NewDecoder(resp.Body).Decode(&sb)
			return resp.StatusCode, sb.SandboxID, err
		}
		crashWith("idempotent-answered", "an idempotent create", func(ctx context.Context) error {
			_, _, err := post(ctx)
			return err
		})
		made := list()
		if len(made) != 1 {
			t.Fatalf("after the crash: %v (want the one sandbox the create made)", made)
		}
		status, id, err := post(context.Background())
		if err != nil || status != http.StatusCreated || made[id] != "running" {
			t.Fatalf("retry after the crash: %d %q %v; sandboxes before it %v\n%s", status, id, err, made, p.tail())
		}
		if l := list(); len(l) != 1 {
			t.Fatalf("the retry made another sandbox: %v", l)
		}
		if err := api.rest(context.Background(), "DELETE", "/sandboxes/"+id, nil, nil); err != nil {
			t.Fatal(err)
		}
		noOrphans("a crash between an idempotent create and its kept answer")
	})

	sb := create()
	api.upload(t, sb, "/home/user/kept.txt", []byte("written before the crash\n"))

	t.Run("pause", func(t *testing.T) {
		crashIn("pause-saved", "POST", "/sandboxes/"+sb.SandboxID+"/pause", nil)
		state := list()[sb.SandboxID]
		if state != "paused" && state != "running" {
			t.Fatalf("sandbox after a crash in pause: %q", state)
		}
		if state == "paused" {
			if err := api.rest(context.Background(), "POST", "/sandboxes/"+sb.SandboxID+"/resume", map[string]any{"timeout": 600}, nil); err != nil {
				t.Fatalf("resume after a crash in pause: %v\n%s", err, p.tail())
			}
		}
		if out, code := api.run(t, sb, "cat", "/home/user/kept.txt"); code != 0 || out != "written before the crash\n" {
			t.Fatalf("state after a crash in pause: %q %d", out, code)
		}
		t.Logf("after a crash in pause the sandbox was %s and is running again, its files intact", state)
		noOrphans("a crash in pause")
	})

	// Every step of a pause, a named snapshot and a fork is a fault point
	// (operation steps): the steps a clean run passes are read from the
	// server's log, then the server is killed at each in turn. The sandbox
	// comes back running or paused with its files, a child a fork made
	// before the kill runs with them too, and nothing is left behind.
	stepsOf := func(op string) []string {
		t.Helper()
		re := regexp.MustCompile(`msg="operation steps" op=` + op + ` steps=("[^"]*"|\S+) failed=false`)
		all := re.FindAllStringSubmatch(readAll(p.log), -1)
		if len(all) == 0 {
			t.Fatalf("no steps of a %s in the log\n%s", op, p.tail())
		}
		var out []string
		seen := map[string]bool{}
		for _, st := range strings.Split(strings.Trim(all[len(all)-1][1], `"`), ",") {
			if st != "" && !seen[st] {
				seen[st] = true
				out = append(out, st)
			}
		}
		return out
	}
	restingWithFiles := func(sb *sandbox, when string) string {
		t.Helper()
		state := list()[sb.SandboxID]
		switch state {
		case "running":
		case "paused":
			if err := api.rest(context.Background(), "POST", "/sandboxes/"+sb.SandboxID+"/resume", map[string]any{"timeout": 600}, nil); err != nil {
				t.Fatalf("resume after %s: %v\n%s", when, err, p.tail())
			}
		default:
			t.Fatalf("sandbox %s after %s: %q\n%s", sb.SandboxID, when, state, p.tail())
		}
		if out, code := api.run(t, sb, "cat", "/home/user/kept.txt"); code != 0 || out != "written before the crash\n" {
			t.Fatalf("files after %s: %q %d\n%s", when, out, code, p.tail())
		}
		return state
	}
	t.Run("kill at every step of pause, snapshot and fork", func(t *testing.T) {
		ctx := context.Background()
		// killFresh kills the server at point in an operation on a new
		// sandbox (never paused nor snapshotted) and checks that it
		// comes back; the sandbox is deleted after.
		killFresh := func(point, path string, body any) string {
			t.Helper()
			fresh := create()
			api.upload(t, fresh, "/home/user/kept.txt", []byte("written before the crash\n"))
			if !crashMaybe(point, "POST", "/sandboxes/"+fresh.SandboxID+path, body) {
				t.Fatalf("the operation on a fresh sandbox did not pass %s", point)
			}
			st := restingWithFiles(fresh, "a kill at "+point+" (a fresh sandbox)")
			api.rest(ctx, "DELETE", "/sandboxes/"+fresh.SandboxID, nil, nil)
			return st
		}
		if err := api.rest(ctx, "POST", "/sandboxes/"+sb.SandboxID+"/pause", nil, nil); err != nil {
			t.Fatal(err)
		}
		restingWithFiles(sb, "a clean pause")
		if err := api.rest(ctx, "POST", "/sandboxes/"+sb.SandboxID+"/snapshots", map[string]any{"name": "steps-probe"}, nil); err != nil {
			t.Fatal(err)
		}
		api.rest(ctx, "DELETE", "/snapshots/steps-probe", nil, nil)
		if err := api.rest(ctx, "POST", "/sandboxes/"+sb.SandboxID+"/fork", map[string]any{"count": 1}, nil); err != nil {
			t.Fatal(err)
		}
		for id := range list() {
			if id != sb.SandboxID {
				api.rest(ctx, "DELETE", "/sandboxes/"+id, nil, nil)
			}
		}
		for _, c := range []struct {
			op     string
			path   string
			body   any
			oneOff func()
		}{
			{"pause", "/pause", nil, nil},
			{"snapshot", "/snapshots", map[string]any{"name": "killed-snapshot"}, func() { api.rest(ctx, "DELETE", "/snapshots/killed-snapshot", nil, nil) }},
			{"fork", "/fork", map[string]any{"count": 1}, nil},
		} {
			for _, step := range stepsOf(c.op) {
				point := c.op + "/" + step
				if c.op == "pause" {
					// A sandbox that was never paused saves its state by
					// migration (QEMU ends postmigrate); one resumed from a
					// pause (as sb) writes its private pages: both are cut.
					t.Logf("a kill at %s: a fresh sandbox came back %s", point, killFresh(point, c.path, c.body))
				}
				if !crashMaybe(point, "POST", "/sandboxes/"+sb.SandboxID+c.path, c.body) {
					// This run took another path: a snapshot of a sandbox
					// that was snapshotted before is taken live. A fresh
					// sandbox's first one passes the point.
					if c.oneOff != nil {
						c.oneOff()
					}
					t.Logf("a kill at %s: a fresh sandbox came back %s", point, killFresh(point, c.path, c.body))
				}
				state := restingWithFiles(sb, "a kill at "+point)
				for id, st := range list() {
					if id == sb.SandboxID {
						continue
					}
					// A child the fork made before the kill runs on with the
					// parent's files, or is paused with them.
					kid := &sandbox{SandboxID: id}
					api.rest(ctx, "GET", "/sandboxes/"+id, nil, kid)
					restingWithFiles(kid, "a kill at "+point+" (a child)")
					api.rest(ctx, "DELETE", "/sandboxes/"+id, nil, nil)
					t.Logf("a kill at %s left a child that was %s", point, st)
				}
				if c.oneOff != nil {
					c.oneOff()
				}
				t.Logf("a kill at %s: the sandbox came back %s", point, state)
				noOrphans("a kill at " + point)
			}
		}
	})

	t.Run("snapshot upload", func(t *testing.T) {
		crashIn("repo-put-file", "POST", "/sandboxes/"+sb.SandboxID+"/snapshots", map[string]any{"name": "crashed-upload"})
		var snaps []struct {
			Names []string `json:"names"`
		}
		if err := api.rest(context.Background(), "GET", "/snapshots", nil, &snaps); err != nil {
			t.Fatal(err)
		}
		listed := false
		for _, sn := range snaps {
			for _, n := range sn.Names {
				listed = listed || n == "crashed-upload"
			}
		}
		if listed {
			// Kept locally: it works.
			child := &sandbox{}
			if err := api.rest(context.Background(), "POST", "/sandboxes", map[string]any{"templateID": "crashed-upload"}, child); err != nil {
				t.Fatalf("create from the snapshot whose upload crashed: %v", err)
			}
			if out, code := api.run(t, child, "cat", "/home/user/kept.txt"); code != 0 || out != "written before the crash\n" {
				t.Fatalf("snapshot contents: %q %d", out, code)
			}
			api.rest(context.Background(), "DELETE", "/sandboxes/"+child.SandboxID, nil, nil)
		}
		// The repository shows no half-uploaded snapshot.
		if _, err := os.Stat(filepath.Join(dataDir, "repository", "snapshot", "crashed-upload", "manifest.json")); err == nil && !listed {
			t.Fatal("the repository holds a snapshot the node does not list")
		}
		if s := list()[sb.SandboxID]; s != "running" {
			t.Fatalf("the snapshotted sandbox is %q after the crash", s)
		}
		t.Logf("after a crash in the upload the snapshot is listed: %v", listed)
		noOrphans("a crash in a snapshot upload")
	})

	t.Run("fork", func(t *testing.T) {
		crashIn("fork-frozen", "POST", "/sandboxes/"+sb.SandboxID+"/fork", map[string]any{"count": 2})
		l := list()
		state := l[sb.SandboxID]
		if state == "paused" {
			if err := api.rest(context.Background(), "POST", "/sandboxes/"+sb.SandboxID+"/resume", map[string]any{"timeout": 600}, nil); err != nil {
				t.Fatalf("resume after a crash in fork: %v\n%s", err, p.tail())
			}
		} else if state != "running" {
			t.Fatalf("parent after a crash in fork: %q (%v)", state, l)
		}
		if out, code := api.run(t, sb, "cat", "/home/user/kept.txt"); code != 0 || out != "written before the crash\n" {
			t.Fatalf("parent after a crash in fork: %q %d", out, code)
		}
		if len(list()) != 1 {
			t.Fatalf("children of a crashed fork are listed: %v", list())
		}
		t.Logf("after a crash in fork the parent was %s; no child", state)
		noOrphans("a crash in fork")
	})

	// A live snapshot of the (now copy-on-write) sandbox seals its disk:
	// killed before QEMU switches to the new overlay, and after it did but
	// before the sandbox's directory names it. Either way the sandbox runs
	// on with every file, the crashed name is no snapshot, and the next
	// snapshot works.
	for i, c := range []struct{ point, settled string }{
		{"snapshot/seal", "a seal cut short before QEMU switched"},
		{"snapshot/seat-overlay", "a seal cut short after QEMU switched: completed"},
	} {
		point := c.point
		t.Run("snapshot, "+point, func(t *testing.T) {
			name := fmt.Sprintf("crashed-seal-%d", i)
			api.upload(t, sb, "/home/user/before-"+name, []byte(name+"\n"))
			crashIn(point, "POST", "/sandboxes/"+sb.SandboxID+"/snapshots", map[string]any{"name": name})
			if s := list()[sb.SandboxID]; s != "running" {
				t.Fatalf("the sandbox is %q after a crash at %s\n%s", s, point, p.tail())
			}
			if out, code := api.run(t, sb, "cat", "/home/user/kept.txt", "/home/user/before-"+name); code != 0 || out != "written before the crash\n"+name+"\n" {
				t.Fatalf("files after a crash at %s: %q %d", point, out, code)
			}
			if _, err := os.Stat(filepath.Join(dataDir, "sandboxes", sb.SandboxID, "overlay.next.qcow2")); !os.IsNotExist(err) {
				t.Errorf("the next overlay is left after a crash at %s: %v", point, err)
			}
			var snaps []struct {
				Names []string `json:"names"`
			}
			if err := api.rest(context.Background(), "GET", "/snapshots", nil, &snaps); err != nil {
				t.Fatal(err)
			}
			for _, sn := range snaps {
				if slices.Contains(sn.Names, name) {
					t.Errorf("the snapshot cut short at %s is listed", point)
				}
			}
			if !strings.Contains(readAll(p.log), c.settled) {
				t.Errorf("the restart did not say %q\n%s", c.settled, p.tail())
			}
			noOrphans("a crash at " + point)
		})
	}
	t.Run("snapshot after the crashed seals", func(t *testing.T) {
		api.upload(t, sb, "/home/user/after-seals", []byte("after\n"))
		if err := api.rest(context.Background(), "POST", "/sandboxes/"+sb.SandboxID+"/snapshots", map[string]any{"name": "after-seals"}, nil); err != nil {
			t.Fatalf("snapshot after the crashes: %v\n%s", err, p.tail())
		}
		child := &sandbox{}
		if err := api.rest(context.Background(), "POST", "/sandboxes", map[string]any{"templateID": "after-seals"}, child); err != nil {
			t.Fatalf("create from the snapshot: %v", err)
		}
		if out, code := api.run(t, child, "cat", "/home/user/kept.txt", "/home/user/before-crashed-seal-1", "/home/user/after-seals"); code != 0 || out != "written before the crash\ncrashed-seal-1\nafter\n" {
			t.Fatalf("a sandbox of the snapshot after the crashes: %q %d", out, code)
		}
		api.rest(context.Background(), "DELETE", "/sandboxes/"+child.SandboxID, nil, nil)
		api.rest(context.Background(), "DELETE", "/snapshots/after-seals", nil, nil)
		noOrphans("snapshots after crashed seals")
	})

	t.Run("QEMU killed", func(t *testing.T) {
		victim := create()
		if !envdUp(victim) {
			t.Fatal("envd of the new sandbox does not answer")
		}
		pid := 0
		procs, _ := filepath.Glob("/proc/[0-9]*/cmdline")
		for _, c := range procs {
			if b, err := os.ReadFile(c); err == nil && strings.Contains(string(b), filepath.Join(dataDir, "sandboxes", victim.SandboxID)+"/") && strings.Contains(string(b), "qemu") {
				pid, _ = strconv.Atoi(filepath.Base(filepath.Dir(c)))
			}
		}
		if pid == 0 {
			t.Fatal("QEMU of the sandbox not found")
		}
		syscall.Kill(pid, syscall.SIGKILL)
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(100 * time.Millisecond) {
			err := api.rest(context.Background(), "GET", "/sandboxes/"+victim.SandboxID, nil, nil)
			var ae *apiError
			if errors.As(err, &ae) && ae.Status == http.StatusNotFound {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("a sandbox whose QEMU died is still reported: %v", err)
			}
		}
		noOrphans("a QEMU killed")
	})
}
