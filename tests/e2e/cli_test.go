package e2e

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/creack/pty"
)

// The aenv CLI as a user runs it: the real binary against the package's
// real server, credentials in a temporary home.

type cliRun struct {
	stdout, stderr string
	code           int
}

// aenvCLI runs the binary with env (HOME and XDG_CONFIG_HOME set to home)
// and stdin.
func aenvCLI(t *testing.T, s *server, home, stdin string, args ...string) cliRun {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, s.bin, args...)
	cmd.Env = cliEnv(home)
	cmd.Stdin = strings.NewReader(stdin)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	code := 0
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		code = ee.ExitCode()
	} else if err != nil {
		t.Fatalf("aenv %s: %v", strings.Join(args, " "), err)
	}
	return cliRun{out.String(), errb.String(), code}
}

// cliEnv is a clean environment: no server settings but the saved ones.
func cliEnv(home string) []string {
	var env []string
	for _, kv := range os.Environ() {
		k, _, _ := strings.Cut(kv, "=")
		switch k {
		case "AENV_URL", "AENV_API_KEY", "E2B_API_URL", "E2B_API_KEY", "HOME", "XDG_CONFIG_HOME":
			continue
		}
		env = append(env, kv)
	}
	return append(env, "HOME="+home, "XDG_CONFIG_HOME="+filepath.Join(home, ".config"))
}

func mustCLI(t *testing.T, s *server, home string, args ...string) string {
	t.Helper()
	r := aenvCLI(t, s, home, "", args...)
	if r.code != 0 {
		t.Fatalf("aenv %s: exit %d\nstdout: %s\nstderr: %s", strings.Join(args, " "), r.code, r.stdout, r.stderr)
	}
	return r.stdout
}

func TestCLI(t *testing.T) {
	s := needServer(t)
	home := t.TempDir()

	t.Run("auth", func(t *testing.T) {
		if r := aenvCLI(t, s, home, "", "ls"); r.code != 2 || !strings.Contains(r.stderr, "auth login") {
			t.Fatalf("ls before login: %+v", r)
		}
		if r := aenvCLI(t, s, home, "", "auth", "login", "--url", s.url, "--api-key", "e2b_0000"); r.code != 1 {
			t.Fatalf("login with a wrong key: %+v", r)
		}
		// The key from stdin, as from a password manager.
		if r := aenvCLI(t, s, home, apiKey+"\n", "auth", "login", "--url", s.url); r.code != 0 {
			t.Fatalf("login: %+v", r)
		}
		st, err := os.Stat(filepath.Join(home, ".config", "aenv", "credentials"))
		if err != nil || st.Mode().Perm() != 0o600 {
			t.Fatalf("credentials file: %v %v", st, err)
		}
		out := mustCLI(t, s, home, "auth", "status")
		if !strings.Contains(out, s.url) || !strings.Contains(out, "status:  ok") || strings.Contains(out, apiKey) {
			t.Fatalf("status (the key must be masked):\n%s", out)
		}
		// The environment overrides the saved login.
		cmd := exec.Command(s.bin, "auth", "status")
		cmd.Env = append(cliEnv(home), "AENV_URL=http://127.0.0.1:1", "AENV_API_KEY="+apiKey)
		if out, err := cmd.CombinedOutput(); err == nil || !strings.Contains(string(out), "127.0.0.1:1") {
			t.Fatalf("AENV_URL did not override: %v\n%s", err, out)
		}
	})

	id := strings.TrimSpace(mustCLI(t, s, home, "create", "minimal", "--timeout", "10m", "--metadata", "suite=cli", "--env", "GREETING=hi"))
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("the server's log about %s:\n%s", id, s.logAbout(id, 80))
		}
		aenvCLI(t, s, home, "", "kill", id)
	})

	t.Run("ls and info", func(t *testing.T) {
		if out := mustCLI(t, s, home, "ls", "--metadata", "suite=cli"); !strings.Contains(out, id) || !strings.Contains(out, "SANDBOX") {
			t.Fatalf("ls:\n%s", out)
		}
		var list []map[string]any
		if err := json.Unmarshal([]byte(mustCLI(t, s, home, "ls", "-o", "json", "--metadata", "suite=other")), &list); err != nil || len(list) != 0 {
			t.Fatalf("ls filtered by other metadata: %v %v", list, err)
		}
		var info map[string]any
		if err := json.Unmarshal([]byte(mustCLI(t, s, home, "info", id, "-o", "json")), &info); err != nil || info["sandboxID"] != id || info["state"] != "running" {
			t.Fatalf("info: %v %v", info, err)
		}
	})

	t.Run("exec exit codes and streams", func(t *testing.T) {
		r := aenvCLI(t, s, home, "", "exec", id, "--", "/bin/sh", "-c", "echo out $GREETING; echo err >&2; exit 7")
		if r.code != 7 || r.stdout != "out hi\n" || r.stderr != "err\n" {
			t.Fatalf("exec: %+v", r)
		}
		if r := aenvCLI(t, s, home, "line one\nline two\n", "exec", "-i", id, "--", "wc", "-l"); r.code != 0 || strings.TrimSpace(r.stdout) != "2" {
			t.Fatalf("exec -i: %+v", r)
		}
		if r := aenvCLI(t, s, home, "", "exec", id, "--", "/no/such/binary"); r.code == 0 {
			t.Fatalf("exec of a missing binary: %+v", r)
		}
		if r := aenvCLI(t, s, home, "", "exec", id, "uname"); r.code != 2 {
			t.Fatalf("exec without --: %+v", r)
		}
	})

	t.Run("cp round trip", func(t *testing.T) {
		data := make([]byte, 1<<20+123)
		rand.Read(data)
		dir := t.TempDir()
		src, back := filepath.Join(dir, "in.bin"), filepath.Join(dir, "out.bin")
		os.WriteFile(src, data, 0o600)
		mustCLI(t, s, home, "cp", src, id+":/home/user/in.bin")
		mustCLI(t, s, home, "cp", id+":/home/user/in.bin", back)
		if got, _ := os.ReadFile(back); !bytes.Equal(got, data) {
			t.Fatal("the file came back different")
		}
		if r := aenvCLI(t, s, home, "from stdin\n", "cp", "-", id+":/tmp/s.txt"); r.code != 0 {
			t.Fatalf("cp from stdin: %+v", r)
		}
		if out := mustCLI(t, s, home, "cp", id+":/tmp/s.txt", "-"); out != "from stdin\n" {
			t.Fatalf("cp to stdout: %q", out)
		}
		if r := aenvCLI(t, s, home, "", "cp", id+":/no/such/file", back); r.code != 3 {
			t.Fatalf("cp of a missing file: %+v", r)
		}
		if r := aenvCLI(t, s, home, "", "cp", src, back); r.code != 2 {
			t.Fatalf("cp with no sandbox side: %+v", r)
		}
	})

	t.Run("shell on a pseudo-terminal", func(t *testing.T) {
		cmd := exec.Command(s.bin, "shell", id, "--shell", "/bin/sh")
		cmd.Env = append(cliEnv(home), "TERM=xterm")
		f, err := pty.StartWithSize(cmd, &pty.Winsize{Rows: 40, Cols: 100})
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		out := &lockedBuffer{}
		go io.Copy(out, f)
		waitFor := func(what string) {
			t.Helper()
			for deadline := time.Now().Add(30 * time.Second); !strings.Contains(out.String(), what); time.Sleep(50 * time.Millisecond) {
				if time.Now().After(deadline) {
					t.Fatalf("the shell never printed %q:\n%s", what, out.String())
				}
			}
		}
		f.Write([]byte("stty size; echo marker-$((6*7))\n"))
		waitFor("marker-42")
		if !strings.Contains(out.String(), "40 100") {
			t.Fatalf("terminal size not passed on:\n%s", out.String())
		}
		pty.Setsize(f, &pty.Winsize{Rows: 30, Cols: 90})
		time.Sleep(500 * time.Millisecond)
		f.Write([]byte("stty size; exit 5\n"))
		waitFor("30 90")
		err = cmd.Wait()
		var ee *exec.ExitError
		if !errors.As(err, &ee) || ee.ExitCode() != 5 {
			t.Fatalf("shell exit: %v\n%s", err, out.String())
		}
	})

	t.Run("lifecycle", func(t *testing.T) {
		mustCLI(t, s, home, "timeout", id, "900")
		mustCLI(t, s, home, "pause", id)
		if out := mustCLI(t, s, home, "ls", "--state", "paused", "-o", "json"); !strings.Contains(out, id) {
			t.Fatalf("paused sandbox not listed:\n%s", out)
		}
		mustCLI(t, s, home, "resume", id)
		if r := aenvCLI(t, s, home, "", "exec", id, "--", "cat", "/home/user/in.bin"); r.code != 0 || len(r.stdout) != 1<<20+123 {
			t.Fatalf("after resume: exit %d, %d bytes", r.code, len(r.stdout))
		}
		children := strings.Fields(mustCLI(t, s, home, "fork", id, "-n", "2"))
		if len(children) != 2 {
			t.Fatalf("fork: %v", children)
		}
		for _, ch := range children {
			if r := aenvCLI(t, s, home, "", "exec", ch, "--", "/bin/sh", "-c", "echo $GREETING"); r.code != 0 || r.stdout != "hi\n" {
				t.Fatalf("child %s: %+v", ch, r)
			}
		}
		mustCLI(t, s, home, append([]string{"kill"}, children...)...)
		if r := aenvCLI(t, s, home, "", "info", children[0]); r.code != 3 {
			t.Fatalf("info of a killed sandbox: %+v", r)
		}
		// A sandbox restored from a snapshot has no boot messages: the
		// console log may be empty, but it is served.
		mustCLI(t, s, home, "logs", id)
		if r := aenvCLI(t, s, home, "", "logs", "nosuchsandbox"); r.code != 3 {
			t.Fatalf("logs of an unknown sandbox: %+v", r)
		}
	})

	t.Run("snapshots and templates", func(t *testing.T) {
		mustCLI(t, s, home, "snapshot", "create", id, "cli-snap")
		if out := mustCLI(t, s, home, "snapshot", "ls"); !strings.Contains(out, "cli-snap") {
			t.Fatalf("snapshot ls:\n%s", out)
		}
		mustCLI(t, s, home, "snapshot", "rm", "cli-snap")
		if r := aenvCLI(t, s, home, "", "snapshot", "rm", "cli-snap"); r.code != 3 {
			t.Fatalf("rm of a deleted snapshot: %+v", r)
		}
		if out := mustCLI(t, s, home, "template", "ls"); !strings.Contains(out, "minimal") {
			t.Fatalf("template ls:\n%s", out)
		}
		if r := aenvCLI(t, s, home, "", "template", "rm", "minimal"); r.code != 1 || !strings.Contains(r.stderr, "used by") {
			t.Fatalf("rm of a template in use: %+v", r)
		}
	})

	t.Run("usage errors", func(t *testing.T) {
		for _, args := range [][]string{{"create"}, {"ls", "--bogus"}, {"fork", id, "-n", "99"}, {"nosuchcommand"}, {"ls", "-o", "yaml"}} {
			if r := aenvCLI(t, s, home, "", args...); r.code != 2 {
				t.Errorf("aenv %s: exit %d (%s), want 2", strings.Join(args, " "), r.code, r.stderr)
			}
		}
		out := mustCLI(t, s, home, "exec", "--help")
		if !strings.Contains(out, "Examples:") {
			t.Fatalf("exec --help has no examples:\n%s", out)
		}
		for _, shell := range []string{"bash", "zsh", "fish"} {
			if out := mustCLI(t, s, home, "completion", shell); len(out) < 100 {
				t.Fatalf("completion %s: %q", shell, out)
			}
		}
	})

	t.Run("bench and doctor", func(t *testing.T) {
		out := mustCLI(t, s, home, "bench", "-n", "2", "--template", "minimal")
		for _, op := range []string{"baseline", "create", "exec", "pause", "resume", "resume+exec", "fork", "kill", "P50"} {
			if !strings.Contains(out, op) {
				t.Fatalf("bench output lacks %s:\n%s", op, out)
			}
		}
		t.Logf("aenv bench:\n%s", out)
		r := aenvCLI(t, s, home, "", "doctor", "--data-dir", os.Getenv("AENV_TEST_DATA_DIR"))
		if r.code != 0 || !strings.Contains(r.stdout, "accelerator") || !strings.Contains(r.stdout, "QEMU") {
			t.Fatalf("doctor on a prepared machine: %+v", r)
		}
		r = aenvCLI(t, s, home, "", "doctor", "--data-dir", t.TempDir())
		if r.code != 1 || !strings.Contains(r.stdout, "aenv setup --data-dir") {
			t.Fatalf("doctor without a prepared data dir: %+v", r)
		}
	})

	t.Run("logout", func(t *testing.T) {
		mustCLI(t, s, home, "auth", "logout")
		if r := aenvCLI(t, s, home, "", "auth", "status"); r.code != 1 || !strings.Contains(r.stdout, "not logged in") {
			t.Fatalf("status after logout: %+v", r)
		}
	})
}

// lockedBuffer is a bytes.Buffer safe for one writer and one reader.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// TestCLIVolumes: aenv volume create, put, get, files, mkdir, delete-path
// and rm against the server, by name and by id.
func TestCLIVolumes(t *testing.T) {
	s := needServer(t)
	home := t.TempDir()
	if r := aenvCLI(t, s, home, apiKey+"\n", "auth", "login", "--url", s.url); r.code != 0 {
		t.Fatalf("login: %+v", r)
	}
	name := "clivol-" + strings.ToLower(rand.Text()[:8])
	mustCLI(t, s, home, "volume", "create", name)
	t.Cleanup(func() { aenvCLI(t, s, home, "", "volume", "rm", name) })
	var vols []map[string]string
	if err := json.Unmarshal([]byte(mustCLI(t, s, home, "volume", "ls", "-o", "json")), &vols); err != nil {
		t.Fatal(err)
	}
	id := ""
	for _, v := range vols {
		if v["name"] == name {
			id = v["volumeID"]
		}
	}
	if id == "" {
		t.Fatalf("%s not listed: %v", name, vols)
	}
	local := filepath.Join(t.TempDir(), "data.bin")
	data := make([]byte, 3<<20)
	rand.Read(data)
	if err := os.WriteFile(local, data, 0o644); err != nil {
		t.Fatal(err)
	}
	if out := mustCLI(t, s, home, "volume", "put", name, local, "/sets/data.bin"); !strings.Contains(out, "3145728 bytes") {
		t.Fatalf("put: %s", out)
	}
	if r := aenvCLI(t, s, home, "from stdin", "volume", "put", id, "-", "/notes/n.txt", "--mode", "0600"); r.code != 0 {
		t.Fatalf("put from stdin: %+v", r)
	}
	back := filepath.Join(t.TempDir(), "back.bin")
	mustCLI(t, s, home, "volume", "get", id, "/sets/data.bin", back)
	if b, err := os.ReadFile(back); err != nil || !bytes.Equal(b, data) {
		t.Fatalf("get to a file: %d bytes, %v", len(b), err)
	}
	if out := mustCLI(t, s, home, "volume", "get", name, "/notes/n.txt"); out != "from stdin" {
		t.Fatalf("get to stdout: %q", out)
	}
	mustCLI(t, s, home, "volume", "mkdir", name, "/a/b/c", "-p")
	out := mustCLI(t, s, home, "volume", "files", name, "/", "--depth", "3")
	for _, want := range []string{"/a/b/c", "/sets/data.bin", "file 0600", "/notes/n.txt"} {
		if !strings.Contains(out, want) {
			t.Fatalf("files lacks %q:\n%s", want, out)
		}
	}
	mustCLI(t, s, home, "volume", "delete-path", name, "/a")
	if r := aenvCLI(t, s, home, "", "volume", "get", name, "/a/b"); r.code != 3 || !strings.Contains(r.stderr, "not found") {
		t.Fatalf("get a removed path: %+v", r)
	}
	if r := aenvCLI(t, s, home, "", "volume", "mkdir", name, "/x/y"); r.code != 3 {
		t.Fatalf("mkdir without its parent: %+v", r)
	}
	// Mounted in a sandbox (aenv create --volume): the guest sees the
	// files, and the volume is the sandbox's until it goes.
	sbx := strings.TrimSpace(mustCLI(t, s, home, "create", "base", "--volume", name+":/mnt/vol", "--timeout", "120"))
	if out := mustCLI(t, s, home, "exec", sbx, "--", "cat", "/mnt/vol/notes/n.txt"); out != "from stdin" {
		t.Fatalf("the guest reads %q", out)
	}
	if r := aenvCLI(t, s, home, "", "volume", "get", name, "/notes/n.txt"); r.code == 0 || !strings.Contains(r.stderr, "mounted in sandbox "+sbx) {
		t.Fatalf("get from a mounted volume: %+v", r)
	}
	if r := aenvCLI(t, s, home, "", "create", "base", "--volume", "nocolon"); r.code == 0 || !strings.Contains(r.stderr, "NAME:PATH") {
		t.Fatalf("a bad --volume: %+v", r)
	}
	mustCLI(t, s, home, "kill", sbx)
	mustCLI(t, s, home, "volume", "rm", name)
	if r := aenvCLI(t, s, home, "", "volume", "files", name); r.code == 0 || !strings.Contains(r.stderr, name) {
		t.Fatalf("files of a deleted volume: %+v", r)
	}
}

// TestCLILeasesAndGC: sandboxes created with --lease end when the lease is
// not renewed (paused: they auto-pause), become orphans that aenv ls
// --orphans lists and aenv gc --orphans kills; a renewed lease keeps its
// sandbox running; aenv gc by age and metadata kills only what matches;
// aenv lease rm kills what a lease binds.
func TestCLILeasesAndGC(t *testing.T) {
	s := needServer(t)
	home := t.TempDir()
	if r := aenvCLI(t, s, home, apiKey+"\n", "auth", "login", "--url", s.url); r.code != 0 {
		t.Fatalf("login: %+v", r)
	}
	tag := "gc-" + strings.ToLower(rand.Text()[:8])
	create := func(args ...string) string {
		t.Helper()
		id := strings.TrimSpace(mustCLI(t, s, home, append([]string{"create", "minimal", "--metadata", "job=" + tag}, args...)...))
		t.Cleanup(func() { aenvCLI(t, s, home, "", "kill", id) })
		return id
	}
	// Creates may take longer than the ttls (cold boots under load): both
	// leases are renewed until the sandboxes are made.
	setup, renewed := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(renewed)
		for {
			select {
			case <-setup:
				return
			case <-time.After(time.Second):
				for _, l := range []string{tag + "-a", tag + "-b"} {
					s.rest(context.Background(), "POST", "/leases/"+l+"/keepalive", map[string]any{}, nil)
				}
			}
		}
	}()
	forgotten := create("--lease", tag+"-a", "--lease-ttl", "6s")
	forgotten2 := create("--lease", tag+"-a", "--lease-ttl", "6s") // a create renews the lease with its ttl
	kept := create("--lease", tag+"-b", "--lease-ttl", "20s")
	plain := create()
	close(setup)
	<-renewed
	if out := mustCLI(t, s, home, "ls", "--orphans", "--metadata", "job="+tag); strings.Contains(out, forgotten) {
		t.Fatalf("an orphan before its lease expired:\n%s", out)
	}
	if r := aenvCLI(t, s, home, "", "gc"); r.code == 0 || !strings.Contains(r.stderr, "--older-than") {
		t.Fatalf("gc without a filter: %+v", r)
	}
	// Lease a is forgotten; lease b is renewed every second.
	deadline := time.Now().Add(90 * time.Second)
	for {
		mustCLI(t, s, home, "lease", "keepalive", tag+"-b")
		out := mustCLI(t, s, home, "ls", "--orphans", "--metadata", "job="+tag, "-o", "json")
		if strings.Contains(out, forgotten) && strings.Contains(out, forgotten2) {
			if strings.Contains(out, kept) || strings.Contains(out, plain) {
				t.Fatalf("a renewed or unbound sandbox listed as an orphan:\n%s", out)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the sandboxes of the forgotten lease are not orphans:\n%s\n%s", out, mustCLI(t, s, home, "lease", "ls"))
		}
		time.Sleep(time.Second)
	}
	// The expired lease's sandboxes are paused (they auto-pause), one
	// after the other; the others run on.
	for deadline := time.Now().Add(60 * time.Second); ; {
		var listed []struct {
			SandboxID string `json:"sandboxID"`
			State     string `json:"state"`
		}
		json.Unmarshal([]byte(mustCLI(t, s, home, "ls", "--metadata", "job="+tag, "-o", "json")), &listed)
		wrong := ""
		for _, sb := range listed {
			want := "running"
			if sb.SandboxID == forgotten || sb.SandboxID == forgotten2 {
				want = "paused"
			}
			if sb.State != want {
				wrong = fmt.Sprintf("%s is %s, want %s", sb.SandboxID, sb.State, want)
			}
		}
		if wrong == "" && len(listed) == 4 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s (%d listed)", wrong, len(listed))
		}
		mustCLI(t, s, home, "lease", "keepalive", tag+"-b")
		time.Sleep(time.Second)
	}
	if out := mustCLI(t, s, home, "gc", "--orphans", "--dry-run"); !strings.Contains(out, "would kill "+forgotten) || !strings.Contains(out, "would kill 2 of") {
		t.Fatalf("gc --dry-run:\n%s", out)
	}
	if out := mustCLI(t, s, home, "gc", "--orphans", "--metadata", "job="+tag); !strings.Contains(out, "killed 2 of 4") {
		t.Fatalf("gc --orphans:\n%s", out)
	}
	// Young sandboxes are not older than an hour.
	if out := mustCLI(t, s, home, "gc", "--older-than", "1h", "--metadata", "job="+tag); !strings.Contains(out, "killed 0 of 2") {
		t.Fatalf("gc --older-than 1h:\n%s", out)
	}
	if out := mustCLI(t, s, home, "lease", "rm", tag+"-b"); !strings.Contains(out, "1 sandboxes killed") {
		t.Fatalf("lease rm:\n%s", out)
	}
	if out := mustCLI(t, s, home, "gc", "--older-than", "1ms", "--metadata", "job="+tag); !strings.Contains(out, "killed 1 of 1") {
		t.Fatalf("gc --older-than 1ms:\n%s", out)
	}
	if r := aenvCLI(t, s, home, "", "lease", "keepalive", tag+"-b"); r.code == 0 || !strings.Contains(r.stderr, "not found") {
		t.Fatalf("keepalive of a removed lease: %+v", r)
	}
}

// TestCLIBenchRollout: aenv bench rollout runs its episodes (a few
// sandboxes with commands and writes, a fork into 2) and reports each
// step with no errors. (The container baseline needs podman; its numbers
// are in docs/PERFORMANCE.md.)
func TestCLIBenchRollout(t *testing.T) {
	s := needServer(t)
	home := t.TempDir()
	if r := aenvCLI(t, s, home, apiKey+"\n", "auth", "login", "--url", s.url); r.code != 0 {
		t.Fatalf("login: %+v", r)
	}
	out := mustCLI(t, s, home, "bench", "rollout", "--template", "base", "--episodes", "3", "--concurrency", "2", "--commands", "2", "--fork", "2")
	for _, want := range []string{"sandboxes (base)", "fork into 2 (base)", "create", "command", "write file", "child command", "collect", "kill"} {
		if !strings.Contains(out, want) {
			t.Fatalf("no %q in:\n%s", want, out)
		}
	}
	for _, line := range strings.Split(out, "\n") {
		f := strings.Fields(line)
		if len(f) > 0 && (strings.HasPrefix(line, "sandboxes") || strings.HasPrefix(line, "fork")) && strings.Contains(line, " ms") && f[len(f)-1] != "0" {
			t.Errorf("a step with errors: %s", line)
		}
	}
	t.Logf("\n%s", out)
}

// TestCLIBenchIdle: `aenv bench idle` starts idle sandboxes, reads each
// one's memory (PSS) and CPU from the node's /metrics and prints them
// with how many the host holds; the sandboxes are gone afterwards.
func TestCLIBenchIdle(t *testing.T) {
	s := needServer(t)
	home := t.TempDir()
	if r := aenvCLI(t, s, home, apiKey+"\n", "auth", "login", "--url", s.url); r.code != 0 {
		t.Fatalf("login: %+v", r)
	}
	running := func() int {
		t.Helper()
		var list []map[string]any
		if err := s.rest(context.Background(), "GET", "/v2/sandboxes?state=running,paused", nil, &list); err != nil {
			t.Fatal(err)
		}
		return len(list)
	}
	before := running()
	out := mustCLI(t, s, home, "bench", "idle", "--template", "minimal", "--sandboxes", "2", "--settle", "2s", "--window", "3s")
	t.Logf("\n%s", out)
	var row []string
	for _, line := range strings.Split(out, "\n") {
		if strings.HasPrefix(line, "sandboxes (minimal)") {
			row = strings.Fields(strings.TrimPrefix(line, "sandboxes (minimal)"))
		}
	}
	// N, PSS median / max MiB, CPU median / max, holds by memory, by CPU.
	if len(row) != 10 || row[0] != "2" {
		t.Fatalf("no sandboxes row of 2 in:\n%s", out)
	}
	if pss, err := strconv.ParseFloat(row[1], 64); err != nil || pss < 1 || pss > 1024 {
		t.Errorf("PSS each %q MiB", row[1])
	}
	if holds, err := strconv.Atoi(row[8]); err != nil || holds < 2 {
		t.Errorf("the host holds %q by memory", row[8])
	}
	if after := running(); after != before {
		t.Errorf("sandboxes before %d, after %d", before, after)
	}
}
