package e2e

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"
)

// installSDK makes sure the JS SDKs pinned in sdk/package.json (e2b and
// @e2b/code-interpreter) are installed under the test data dir, in
// AENV_TEST_DATA_DIR/npm/e2b-sdk-<hash of package.json> (scripts/test
// installs the same one; a change of pins makes a new one), and returns
// that directory. The install happens in a temporary directory that is
// renamed into place and marked complete, so a broken install is never
// reused.
func installSDK(t *testing.T) string {
	t.Helper()
	npm, err := exec.LookPath("npm")
	if err != nil {
		t.Skip("npm is not installed: the E2B SDK compatibility tests need node and npm")
	}
	pkg, err := os.ReadFile(filepath.Join("sdk", "package.json"))
	if err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(pkg)
	// Under the prepared data dir (scripts/test sets it); without one, in
	// the machine's temporary directory, never in the checkout.
	base := os.Getenv("AENV_TEST_DATA_DIR")
	if base == "" {
		base = filepath.Join(os.TempDir(), "aenv-test")
	}
	dir := filepath.Join(base, "npm", "e2b-sdk-"+hex.EncodeToString(sum[:])[:12])
	complete := func() bool { _, err := os.Stat(filepath.Join(dir, ".complete")); return err == nil }
	if complete() {
		return dir
	}
	if err := os.MkdirAll(filepath.Dir(dir), 0o755); err != nil {
		t.Fatal(err)
	}
	// Serialize concurrent installs (several test binaries, several runs).
	lock, err := os.OpenFile(dir+".lock", os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	defer lock.Close()
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX); err != nil {
		t.Fatal(err)
	}
	if complete() {
		return dir
	}
	tmp, err := os.MkdirTemp(filepath.Dir(dir), ".install-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(tmp)
	if err := os.WriteFile(filepath.Join(tmp, "package.json"), pkg, 0o644); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	start := time.Now()
	cmd := exec.CommandContext(ctx, npm, "install", "--no-audit", "--no-fund", "--loglevel=error")
	cmd.Dir = tmp
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("npm install (sdk/package.json): %v\n%s", err, out)
	}
	if err := os.WriteFile(filepath.Join(tmp, ".complete"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	os.RemoveAll(dir)
	if err := os.Rename(tmp, dir); err != nil {
		t.Fatal(err)
	}
	t.Logf("installed sdk/package.json into %s in %s", dir, time.Since(start).Round(time.Millisecond))
	return dir
}

// TestOfficialJSSDK runs sdk/*.test.cjs with node's test runner against the
// server, the official SDK pointed at it through E2B_API_URL and
// E2B_SANDBOX_URL. Every test file is one go subtest.
func TestOfficialJSSDK(t *testing.T) {
	if os.Getenv("AENV_TEST_DATA_DIR") == "" {
		t.Skip("AENV_TEST_DATA_DIR is not set (scripts/test prepares one with `aenv setup`)")
	}
	node, err := exec.LookPath("node")
	if err != nil {
		t.Skip("node is not installed: the E2B SDK compatibility tests need node and npm")
	}
	sdkDir := installSDK(t)
	s := needServer(t)
	files, err := filepath.Glob(filepath.Join("sdk", "*.test.cjs"))
	if err != nil || len(files) == 0 {
		t.Fatalf("no SDK test files: %v", err)
	}
	for _, f := range files {
		name := strings.TrimSuffix(filepath.Base(f), ".test.cjs")
		t.Run(name, func(t *testing.T) {
			if name == "code_interpreter" {
				s.waitCodeInterpreter(t)
			}
			runSDKFile(t, node, sdkDir, f, s.url, s.log)
		})
	}
}

// runSDKFile runs one SDK test file with node's test runner against the
// endpoint at url (a server or a gateway); serverLog is shown on failure.
func runSDKFile(t *testing.T, node, sdkDir, file, url string, serverLog func() string) {
	t.Helper()
	abs, _ := filepath.Abs(file)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	start := time.Now()
	cmd := exec.CommandContext(ctx, node, "--test", "--test-reporter=spec", abs)
	cmd.Env = append(os.Environ(),
		"E2B_API_URL="+url,
		"E2B_SANDBOX_URL="+url,
		"E2B_VOLUME_API_URL="+url,
		"E2B_API_KEY="+apiKey,
		"E2B_SDK_DIR="+sdkDir,
		"NO_COLOR=1",
		fmt.Sprintf("UV_THREADPOOL_SIZE=%d", max(4, runtime.NumCPU())),
	)
	if haveCodeInterpreter {
		cmd.Env = append(cmd.Env, "AENV_CODE_INTERPRETER=1")
	}
	out, err := cmd.CombinedOutput()
	t.Logf("node --test %s (%s):\n%s", filepath.Base(file), time.Since(start).Round(time.Millisecond), out)
	if err != nil {
		t.Fatalf("SDK tests in %s failed: %v\nserver log tail:\n%s", file, err, serverLog())
	}
}
