// Package e2e holds end-to-end tests of `aenv server` with real QEMU guests:
// the official E2B JS SDK (sdk/*.test.cjs, run with `node --test`) and the
// sandbox proxy (HTTP streaming over HTTP/1.1 and h2c, Connect streams,
// WebSocket, access tokens, 502s), plus REST bad-input checks.
//
// They need root, QEMU and a prepared test data dir in AENV_TEST_DATA_DIR
// (scripts/test makes one); without it every test skips with the reason.
// One server is started for the package and every sandbox is killed before
// it stops. Set AENV_BIN to use a prebuilt aenv binary instead of building
// one.
package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/agentenv/agentenv/internal/codeinterpreter"
	"github.com/agentenv/agentenv/internal/templates"
)

const (
	apiKey = "e2b_5eed0000000000000000000000000000000000e2e"
	// nodeToken is the cluster tests' node credential (AENV_NODE_TOKEN).
	nodeToken   = "aenv-e2e-node-token-0123456789abcdef0123456789abcdef"
	instance    = "sdkt"
	networkCIDR = "10.217.0.0/16"
	envdPort    = 49983
)

// server is a running `aenv server`.
type server struct {
	url     string // http://127.0.0.1:port
	bin     string // the aenv binary it runs
	dataDir string
	cmd     *exec.Cmd
	logPath string
}

var (
	srvOnce sync.Once
	srv     *server
	srvSkip string
	srvErr  error
	tmpRoot string
)

// runLock is the machine-wide lock of this package's run (see TestMain).
var runLock *os.File

func TestMain(m *testing.M) {
	// The package's servers use fixed instance names and network ranges
	// (they clean up after a run that crashed): two runs on one machine
	// would tear down each other's sandbox networks. The second waits.
	if lock, err := os.OpenFile(filepath.Join(os.TempDir(), "aenv-e2e.lock"), os.O_CREATE|os.O_RDWR, 0o600); err == nil {
		if syscall.Flock(int(lock.Fd()), syscall.LOCK_EX|syscall.LOCK_NB) != nil {
			fmt.Fprintln(os.Stderr, "another tests/e2e run is going on this machine (it holds", lock.Name()+"); waiting for it to end")
			_ = syscall.Flock(int(lock.Fd()), syscall.LOCK_EX)
		}
		runLock = lock // held (kept from the collector) until the process exits
	}
	code := m.Run()
	if srv != nil {
		srv.stop()
		if code != 0 {
			srv.keepLog()
		}
	}
	if tmpRoot != "" {
		os.RemoveAll(tmpRoot)
	}
	os.Exit(code)
}

// needServer returns the package's server, starting it on first use, or
// skips the test when the machine cannot run one.
func needServer(t *testing.T) *server {
	t.Helper()
	srvOnce.Do(func() { srv, srvSkip, srvErr = startServer() })
	if srvSkip != "" {
		t.Skip(srvSkip)
	}
	if srvErr != nil {
		t.Fatal(srvErr)
	}
	return srv
}

func startServer() (*server, string, error) {
	testData := os.Getenv("AENV_TEST_DATA_DIR")
	if testData == "" {
		return nil, "AENV_TEST_DATA_DIR is not set (scripts/test prepares one with `aenv setup`)", nil
	}
	if os.Geteuid() != 0 {
		return nil, "aenv server needs root (network namespaces, tap devices)", nil
	}
	for _, p := range []string{"aenv.db", "cache/initramfs.img"} {
		if _, err := os.Stat(filepath.Join(testData, p)); err != nil {
			return nil, "", fmt.Errorf("AENV_TEST_DATA_DIR %s is not prepared (%v): run `aenv setup --data-dir %s --templates base,minimal`", testData, err, testData)
		}
	}
	var err error
	tmpRoot, err = os.MkdirTemp("", "aenv-e2e-")
	if err != nil {
		return nil, "", err
	}
	bin := os.Getenv("AENV_BIN")
	if bin == "" {
		bin = filepath.Join(tmpRoot, "aenv")
		build := exec.Command("go", "build", "-o", bin, "github.com/agentenv/agentenv/cmd/aenv")
		if out, err := build.CombinedOutput(); err != nil {
			return nil, "", fmt.Errorf("build aenv: %v\n%s", err, out)
		}
	}
	dataDir := filepath.Join(tmpRoot, "data")
	if err := os.MkdirAll(dataDir, 0o700); err != nil {
		return nil, "", err
	}
	if err := prepareDataDir(testData, dataDir, true); err != nil {
		return nil, "", err
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, "", err
	}
	addr := ln.Addr().String()
	ln.Close()
	s := &server{url: "http://" + addr, bin: bin, dataDir: dataDir, logPath: filepath.Join(tmpRoot, "server.log")}
	logf, err := os.Create(s.logPath)
	if err != nil {
		return nil, "", err
	}
	s.cmd = exec.Command(bin, "server", "--data-dir", dataDir, "--listen", addr,
		"--instance", instance, "--network-cidr", networkCIDR, "--log-level", "debug", "--dns", "none")
	s.cmd.Env = append(os.Environ(), "AENV_API_KEY="+apiKey)
	s.cmd.Stdout, s.cmd.Stderr = logf, logf
	s.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGTERM}
	if err := s.cmd.Start(); err != nil {
		return nil, "", err
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		resp, err := http.Get(s.url + "/health")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return s, "", nil
			}
		}
		if time.Now().After(deadline) {
			s.stop()
			return nil, "", fmt.Errorf("aenv server did not come up: %v\n%s", err, s.log())
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// prepareDataDir gives a node's data dir the kernel and initramfs of the
// prepared test data dir (linked) and its templates base and minimal
// (exported as template directories, their layers hard-linked, which the
// node adopts when it starts), and with codeInterpreter the
// code-interpreter template: templates the tests build stay in this data
// dir. (A node snapshots each template at start: the code-interpreter's
// takes minutes under TCG, so only the package's server gets it.)
func prepareDataDir(testData, dataDir string, codeInterpreter bool) error {
	if err := os.MkdirAll(dataDir, 0o700); err != nil {
		return err
	}
	if err := os.Symlink(filepath.Join(testData, "cache"), filepath.Join(dataDir, "cache")); err != nil {
		return err
	}
	cat, closeCat, err := templates.OpenReadOnly(testData)
	if err != nil {
		return err
	}
	defer closeCat()
	for _, name := range []string{"base", "minimal"} {
		if err := cat.Export(context.Background(), name, filepath.Join(dataDir, templates.LegacyDir, name)); err != nil {
			return err
		}
	}
	// The code-interpreter template, when the test data dir has it
	// (scripts/test builds it; the tests that need it fail under CI
	// without it).
	if _, err := cat.Get(context.Background(), codeinterpreter.TemplateName); err == nil && codeInterpreter {
		if err := cat.Export(context.Background(), codeinterpreter.TemplateName, filepath.Join(dataDir, templates.LegacyDir, codeinterpreter.TemplateName)); err != nil {
			return err
		}
		haveCodeInterpreter = true
	}
	return nil
}

// haveCodeInterpreter is whether the server has the code-interpreter
// template.
var haveCodeInterpreter bool

// waitCodeInterpreter waits until the server has the code-interpreter
// template's snapshot (it makes it after it starts: minutes under TCG),
// so that the SDK suites' creates of it restore instead of waiting longer
// than the SDKs' request timeout (60 s). It fails when the server says the
// snapshot could not be made.
func (s *server) waitCodeInterpreter(t *testing.T) {
	t.Helper()
	if !haveCodeInterpreter {
		return
	}
	ready := fmt.Sprintf(`msg="template snapshot ready" template=%s`, codeinterpreter.TemplateName)
	failed := fmt.Sprintf(`msg="template snapshot" template=%s`, codeinterpreter.TemplateName)
	start := time.Now()
	for deadline := start.Add(20 * time.Minute); ; {
		b, _ := os.ReadFile(s.logPath)
		switch {
		case bytes.Contains(b, []byte(ready)):
			t.Logf("the %s template snapshot was ready after %s more", codeinterpreter.TemplateName, time.Since(start).Round(time.Second))
			return
		case bytes.Contains(b, []byte(failed)):
			t.Fatalf("the server could not make the %s template snapshot:\n%s", codeinterpreter.TemplateName, s.log())
		case time.Now().After(deadline):
			t.Fatalf("the %s template snapshot is not ready after 20 minutes:\n%s", codeinterpreter.TemplateName, s.log())
		}
		time.Sleep(2 * time.Second)
	}
}

func (s *server) log() string {
	b, _ := os.ReadFile(s.logPath)
	if len(b) > 8000 {
		b = b[len(b)-8000:]
	}
	return string(b)
}

// logAbout is the last max lines of the server's log that mention what
// (a sandbox id): what a failed test shows of the server's side.
func (s *server) logAbout(what string, max int) string {
	b, _ := os.ReadFile(s.logPath)
	var lines []string
	for _, l := range strings.Split(string(b), "\n") {
		if strings.Contains(l, what) {
			lines = append(lines, l)
		}
	}
	if len(lines) > max {
		lines = lines[len(lines)-max:]
	}
	return strings.Join(lines, "\n")
}

// keepLog moves the server's log out of the run's temporary root, which
// goes, and says where: a failed run's log is what explains it.
func (s *server) keepLog() {
	kept := filepath.Join(os.TempDir(), fmt.Sprintf("aenv-e2e-server-%s.log", time.Now().UTC().Format("20060102T150405")))
	if err := os.Rename(s.logPath, kept); err != nil {
		fmt.Fprintln(os.Stderr, "the server's log could not be kept:", err)
		return
	}
	fmt.Fprintln(os.Stderr, "the run failed; the server's log is kept in", kept)
}

// stop kills every sandbox (they would outlive the server) and stops it.
func (s *server) stop() {
	var list []map[string]any
	if err := s.rest(context.Background(), "GET", "/v2/sandboxes", nil, &list); err == nil {
		for _, sb := range list {
			_ = s.rest(context.Background(), "DELETE", "/sandboxes/"+sb["sandboxID"].(string), nil, nil)
		}
	}
	_ = s.cmd.Process.Signal(syscall.SIGTERM)
	done := make(chan struct{})
	go func() { _ = s.cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(15 * time.Second):
		_ = s.cmd.Process.Kill()
		<-done
	}
}

// apiError is a non-2xx REST answer.
type apiError struct {
	Status int
	Body   string
}

func (e *apiError) Error() string { return fmt.Sprintf("HTTP %d: %s", e.Status, e.Body) }

// checkNoHostPaths fails for an answer that names the server's data dir
// (or the test data dir its templates come from): no answer of the API
// may show host paths, whatever went wrong.
func (s *server) checkNoHostPaths(body []byte) error {
	for _, dir := range []string{s.dataDir, os.Getenv("AENV_TEST_DATA_DIR")} {
		if dir != "" && bytes.Contains(body, []byte(dir)) {
			return fmt.Errorf("the answer shows the host path %s: %s", dir, body)
		}
	}
	return nil
}

// rest calls the REST API with the key; out (if non-nil) receives the JSON.
func (s *server) rest(ctx context.Context, method, path string, in, out any) error {
	var body io.Reader
	if in != nil {
		if raw, ok := in.(string); ok {
			body = strings.NewReader(raw)
		} else {
			b, _ := json.Marshal(in)
			body = bytes.NewReader(b)
		}
	}
	req, err := http.NewRequestWithContext(ctx, method, s.url+path, body)
	if err != nil {
		return err
	}
	req.Header.Set("X-API-Key", apiKey)
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if err := s.checkNoHostPaths(b); err != nil {
		return fmt.Errorf("%s %s: %w", method, path, err)
	}
	if resp.StatusCode/100 != 2 {
		return &apiError{Status: resp.StatusCode, Body: string(b)}
	}
	if out != nil {
		return json.Unmarshal(b, out)
	}
	return nil
}

type sandbox struct {
	SandboxID       string `json:"sandboxID"`
	EnvdAccessToken string `json:"envdAccessToken"`
}

// createSandbox creates a base sandbox that is killed when t ends.
func (s *server) createSandbox(t *testing.T, body map[string]any) *sandbox {
	t.Helper()
	if body == nil {
		body = map[string]any{}
	}
	if body["templateID"] == nil {
		body["templateID"] = "base"
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var sb sandbox
	if err := s.rest(ctx, "POST", "/v2/sandboxes", body, &sb); err != nil {
		t.Fatalf("create sandbox: %v\n%s", err, s.log())
	}
	t.Cleanup(func() {
		var ae *apiError
		if err := s.rest(context.Background(), "DELETE", "/sandboxes/"+sb.SandboxID, nil, nil); err != nil && !(errors.As(err, &ae) && ae.Status == 404) {
			t.Errorf("kill %s: %v", sb.SandboxID, err)
		}
	})
	return &sb
}
