package deploy

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestInstallScript runs deploy/install.sh server from this checkout as a
// user would on a Debian 12 machine: it installs the packages, the
// binaries, /var/lib/aenv with the base template, /etc/aenv/aenv.env and
// the unit. systemd is not PID 1 on these machines, so the script checks
// the unit with systemd-analyze verify and enables it offline, and this
// test starts the server exactly as the unit's ExecStart does (the unit's
// environment file, systemd's expansion of ${VAR} and $VAR), makes a
// sandbox and runs a command in it, stops the server as KillMode=process
// does (the sandbox outlives it), starts it again and finds the sandbox
// re-adopted. Bad input is refused first, before anything is written.
//
// It changes the machine (/usr/local/bin, /etc/aenv, /etc/systemd/system,
// /var/lib/aenv), so it runs under CI, or where AENV_TEST_INSTALL=1 asks.
func TestInstallScript(t *testing.T) {
	if os.Getenv("CI") != "true" && os.Getenv("AENV_TEST_INSTALL") != "1" {
		t.Skip("installs AgentENV into this machine's /usr/local/bin, /etc and /var/lib/aenv: runs under CI=true or AENV_TEST_INSTALL=1")
	}
	if os.Geteuid() != 0 {
		t.Fatal("deploy/install.sh needs root")
	}
	script, err := filepath.Abs(filepath.Join(deployDir, "install.sh"))
	if err != nil {
		t.Fatal(err)
	}
	const envFile = "/etc/aenv/aenv.env"
	before, _ := os.ReadFile(envFile)

	t.Run("bad input changes nothing", func(t *testing.T) {
		token := strings.Repeat("t", 32)
		for _, tc := range []struct {
			name string
			env  []string
			args []string
			code int
			want string
		}{
			{"no role", nil, nil, 2, "install.sh server"},
			{"unknown role", nil, []string{"worker"}, 2, "install.sh server"},
			{"unknown flag", nil, []string{"server", "--listen", "x"}, 2, "install.sh server"},
			{"node without the cluster key", nil, []string{"node", "--scheduler", "http://127.0.0.1:9", "--advertise-url", "http://127.0.0.1:8000"}, 1, "set AENV_API_KEY"},
			{"node token equal to the key", []string{"AENV_API_KEY=e2b_0a", "AENV_NODE_TOKEN=e2b_0a"}, []string{"node", "--scheduler", "http://127.0.0.1:9", "--advertise-url", "http://127.0.0.1:8000"}, 1, "set AENV_NODE_TOKEN"},
			{"node without --scheduler", []string{"AENV_API_KEY=e2b_0a", "AENV_NODE_TOKEN=" + token}, []string{"node", "--advertise-url", "http://127.0.0.1:8000"}, 1, "needs --scheduler"},
			{"node without --advertise-url", []string{"AENV_API_KEY=e2b_0a", "AENV_NODE_TOKEN=" + token}, []string{"node", "--scheduler", "http://127.0.0.1:9"}, 1, "needs --advertise-url"},
			{"a quote in an argument", nil, []string{"server", "--", "--log-level", "it's"}, 1, "single quote"},
		} {
			t.Run(tc.name, func(t *testing.T) {
				cmd := exec.Command(script, tc.args...)
				cmd.Env = append(cleanEnv(), tc.env...)
				out, err := cmd.CombinedOutput()
				if cmd.ProcessState == nil || cmd.ProcessState.ExitCode() != tc.code || !strings.Contains(string(out), tc.want) {
					t.Fatalf("exit %v, want %d with %q:\n%s", err, tc.code, tc.want, out)
				}
				if after, _ := os.ReadFile(envFile); string(after) != string(before) {
					t.Fatalf("%s changed", envFile)
				}
			})
		}
	})
	if t.Failed() {
		return
	}

	listen := freeAddr(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, script, "server", "--", "--dns", "none")
	cmd.Env = append(cleanEnv(), "AENV_LISTEN="+listen)
	start := time.Now()
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("install.sh server: %v\n%s", err, tail(out, 40))
	}
	t.Logf("install.sh server took %s", time.Since(start).Round(time.Second))
	if _, err := os.Stat("/run/systemd/system"); err == nil {
		// systemd runs here: install.sh started the service itself.
		if out, err := exec.Command("systemctl", "is-active", "aenv-server.service").CombinedOutput(); err != nil {
			t.Fatalf("aenv-server.service: %v %s", err, out)
		}
		resp, err := http.Get("http://" + listen + "/health")
		if err != nil || resp.StatusCode != http.StatusOK {
			t.Fatalf("/health of aenv-server.service: %v", err)
		}
		resp.Body.Close()
		return
	}
	if !strings.Contains(string(out), "systemd is not running here") {
		t.Fatalf("install.sh did not say that systemd is not running:\n%s", tail(out, 20))
	}
	unit := "/etc/systemd/system/aenv-server.service"
	if out, err := exec.Command("systemd-analyze", "verify", unit).CombinedOutput(); err != nil || len(out) > 0 {
		t.Fatalf("systemd-analyze verify %s: %v\n%s", unit, err, out)
	}
	if dst, err := os.Readlink("/etc/systemd/system/multi-user.target.wants/aenv-server.service"); err != nil || dst != unit {
		t.Fatalf("not enabled for multi-user.target: %q %v", dst, err)
	}
	svc := readUnit(t, unit)
	if svc.killMode != "process" {
		t.Fatalf("KillMode=%q", svc.killMode)
	}
	env := readEnvFile(t, svc.envFile)
	if env["AENV_LISTEN"] != listen || env["AENV_ARGS"] != "--dns none" {
		t.Fatalf("%s: %v", svc.envFile, env)
	}
	argv := expandExec(svc.exec, env)
	t.Logf("ExecStart: %q", argv)

	key := ""
	if m := regexp.MustCompile(`E2B_API_KEY=(e2b_[0-9a-f]+)`).FindSubmatch(out); m != nil {
		key = string(m[1])
	}
	server := startAsUnit(t, argv, env)
	url := "http://" + listen
	if key == "" { // not the first install here: the key was shown before
		k, err := exec.Command("/usr/local/bin/aenv", "key", "create", fmt.Sprintf("deploy-test-%d", time.Now().UnixNano()), "--data-dir", "/var/lib/aenv").Output()
		if err != nil {
			t.Fatalf("aenv key create: %v", err)
		}
		key = strings.TrimSpace(string(k))
	}
	client := func(args ...string) string {
		t.Helper()
		c := exec.CommandContext(ctx, "/usr/local/bin/aenv", args...)
		c.Env = append(cleanEnv(), "AENV_URL="+url, "AENV_API_KEY="+key)
		out, err := c.CombinedOutput()
		if err != nil {
			t.Fatalf("aenv %s: %v\n%s", strings.Join(args, " "), err, out)
		}
		return strings.TrimSpace(string(out))
	}
	id := client("create", "base", "--no-internet", "--timeout", "10m")
	t.Cleanup(func() {
		c := exec.Command("/usr/local/bin/aenv", "kill", id)
		c.Env = append(cleanEnv(), "AENV_URL="+url, "AENV_API_KEY="+key)
		_ = c.Run()
	})
	if got := client("exec", id, "--", "sh", "-c", "echo installed; id -un"); got != "installed\nuser" {
		t.Fatalf("exec: %q", got)
	}
	// systemctl restart with KillMode=process: SIGTERM to the server alone.
	server.stop(t)
	server = startAsUnit(t, argv, env)
	if got := client("exec", id, "--", "echo", "re-adopted"); got != "re-adopted" {
		t.Fatalf("exec after the restart: %q", got)
	}
	client("kill", id)
	server.stop(t)
}

// cleanEnv is the environment of a root shell without the test's own
// settings (no AENV_* or E2B_* leaking into the install).
func cleanEnv() []string {
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "AENV_") && !strings.HasPrefix(kv, "E2B_") {
			env = append(env, kv)
		}
	}
	return env
}

type unitFile struct{ exec, envFile, killMode string }

func readUnit(t *testing.T, path string) unitFile {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var u unitFile
	for _, l := range strings.Split(string(b), "\n") {
		k, v, _ := strings.Cut(l, "=")
		switch k {
		case "ExecStart":
			u.exec = v
		case "EnvironmentFile":
			u.envFile = strings.TrimPrefix(v, "-")
		case "KillMode":
			u.killMode = v
		}
	}
	if u.exec == "" || u.envFile == "" {
		t.Fatalf("%s has no ExecStart or EnvironmentFile", path)
	}
	return u
}

// readEnvFile reads a systemd environment file of KEY=VALUE lines, a value
// quoted whole in single or double quotes losing them.
func readEnvFile(t *testing.T, path string) map[string]string {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	env := map[string]string{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		l := strings.TrimSpace(sc.Text())
		if l == "" || strings.HasPrefix(l, "#") {
			continue
		}
		k, v, ok := strings.Cut(l, "=")
		if !ok {
			t.Fatalf("%s: %q", path, l)
		}
		if len(v) >= 2 && (v[0] == '\'' || v[0] == '"') && v[len(v)-1] == v[0] {
			v = v[1 : len(v)-1]
		}
		env[k] = v
	}
	return env
}

// expandExec expands an ExecStart line as systemd does: ${VAR} is one
// word, $VAR splits at whitespace into words (none when empty).
func expandExec(line string, env map[string]string) []string {
	var argv []string
	for _, w := range strings.Fields(line) {
		switch {
		case strings.HasPrefix(w, "${") && strings.HasSuffix(w, "}"):
			argv = append(argv, env[w[2:len(w)-1]])
		case strings.HasPrefix(w, "$"):
			argv = append(argv, strings.Fields(env[w[1:]])...)
		default:
			argv = append(argv, w)
		}
	}
	return argv
}

type unitProcess struct {
	cmd  *exec.Cmd
	done chan struct{} // closed when the process has exited
	err  error         // its exit, once done is closed
}

// startAsUnit runs argv with the unit's environment (the environment file
// and systemd's default PATH, nothing of the test's) and waits for
// /health.
func startAsUnit(t *testing.T, argv []string, env map[string]string) *unitProcess {
	t.Helper()
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Env = []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
	for k, v := range env {
		cmd.Env = append(cmd.Env, k+"="+v)
	}
	log, err := os.Create(filepath.Join(t.TempDir(), "server.log"))
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stdout, cmd.Stderr = log, log
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGTERM}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &unitProcess{cmd: cmd, done: make(chan struct{})}
	go func() { p.err = cmd.Wait(); close(p.done) }()
	t.Cleanup(func() {
		select {
		case <-p.done:
		default:
			_ = cmd.Process.Signal(syscall.SIGTERM)
			<-p.done
		}
		if t.Failed() {
			b, _ := os.ReadFile(log.Name())
			t.Logf("server log:\n%s", tail(b, 40))
		}
	})
	deadline := time.Now().Add(60 * time.Second)
	for {
		resp, err := http.Get("http://" + env["AENV_LISTEN"] + "/health")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return p
			}
		}
		select {
		case <-p.done:
			b, _ := os.ReadFile(log.Name())
			t.Fatalf("the server exited: %v\n%s", p.err, tail(b, 40))
		default:
		}
		if time.Now().After(deadline) {
			t.Fatal("the server did not answer /health in 60s")
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// stop is systemd's stop under KillMode=process: SIGTERM to the main
// process, which must exit within TimeoutStopSec (90 s by default).
func (p *unitProcess) stop(t *testing.T) {
	t.Helper()
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case <-p.done:
		if p.err != nil {
			t.Fatalf("the server exited on SIGTERM with %v", p.err)
		}
	case <-time.After(90 * time.Second):
		t.Fatal("the server did not exit within 90s of SIGTERM")
	}
}

func freeAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

func tail(b []byte, n int) string {
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
