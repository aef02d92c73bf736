package codeinterpreter

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
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

// These tests run the embedded server.py on the host against Debian's
// ipykernel and jupyter_client (scripts/test installs them); the template
// in a real guest is tested with both official SDKs in tests/e2e.

type server struct {
	url string
	cwd string
}

func startServer(t *testing.T) *server {
	t.Helper()
	const python = "/usr/bin/python3"
	if out, err := exec.Command(python, "-c", "import jupyter_client, ipykernel").CombinedOutput(); err != nil {
		msg := fmt.Sprintf("Debian's python3-ipykernel and python3-jupyter-client are needed (scripts/test installs them): %v: %s", err, out)
		if os.Getenv("CI") == "true" {
			t.Fatal(msg)
		}
		t.Skip(msg)
	}
	dir := t.TempDir()
	script := filepath.Join(dir, "server.py")
	if err := os.WriteFile(script, Server, 0o644); err != nil {
		t.Fatal(err)
	}
	cwd := filepath.Join(dir, "work")
	if err := os.Mkdir(cwd, 0o755); err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	l.Close()
	cmd := exec.Command(python, script)
	cmd.Env = []string{"PATH=/usr/bin:/bin", "HOME=" + dir, "JUPYTER_RUNTIME_DIR=" + filepath.Join(dir, "runtime"),
		fmt.Sprintf("AENV_CODE_INTERPRETER_PORT=%d", port), "AENV_CODE_INTERPRETER_CWD=" + cwd,
		// No envd on the host: the sandbox's env vars are tested in a guest.
		"AENV_ENVD_URL=http://127.0.0.1:1"}
	var log bytes.Buffer
	cmd.Stdout, cmd.Stderr = &log, &log
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		done := make(chan struct{})
		go func() { _ = cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			t.Errorf("server did not stop on SIGTERM")
		}
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		if t.Failed() {
			t.Logf("server log:\n%s", log.String())
		}
	})
	s := &server{url: fmt.Sprintf("http://127.0.0.1:%d", port), cwd: cwd}
	deadline := time.Now().Add(60 * time.Second)
	for {
		resp, err := http.Get(s.url + "/health")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == 200 {
				return s
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("server not healthy within 60 s: %v\n%s", err, log.String())
		}
		time.Sleep(100 * time.Millisecond)
	}
}

type message map[string]any

// ansi matches the colour codes of IPython's tracebacks (kept, as E2B's).
var ansi = regexp.MustCompile("\x1b\\[[0-9;]*m")

func (s *server) execute(t *testing.T, body any) []message {
	t.Helper()
	b, _ := json.Marshal(body)
	resp, err := http.Post(s.url+"/execute", "application/json", bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		out, _ := io.ReadAll(resp.Body)
		t.Fatalf("execute %s: %d %s", b, resp.StatusCode, out)
	}
	var msgs []message
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(nil, 16<<20)
	for sc.Scan() {
		var m message
		if err := json.Unmarshal(sc.Bytes(), &m); err != nil {
			t.Fatalf("line %q: %v", sc.Text(), err)
		}
		msgs = append(msgs, m)
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	if len(msgs) == 0 || msgs[len(msgs)-1]["type"] != "end_of_execution" {
		t.Fatalf("execute %s: stream did not end with end_of_execution: %v", b, msgs)
	}
	return msgs
}

// of returns the messages of one type.
func of(msgs []message, typ string) []message {
	var out []message
	for _, m := range msgs {
		if m["type"] == typ {
			out = append(out, m)
		}
	}
	return out
}

func text(msgs []message, typ string) string {
	var b strings.Builder
	for _, m := range of(msgs, typ) {
		b.WriteString(m["text"].(string))
	}
	return b.String()
}

func (s *server) do(t *testing.T, method, path string, body any) (int, []byte) {
	t.Helper()
	var r io.Reader
	if body != nil {
		switch b := body.(type) {
		case string:
			r = strings.NewReader(b)
		default:
			j, _ := json.Marshal(b)
			r = bytes.NewReader(j)
		}
	}
	req, _ := http.NewRequest(method, s.url+path, r)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	out, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, out
}

type context struct {
	ID, Language, Cwd string
}

func (s *server) newContext(t *testing.T, body any) context {
	t.Helper()
	code, out := s.do(t, "POST", "/contexts", body)
	if code != 200 {
		t.Fatalf("create context %v: %d %s", body, code, out)
	}
	var c context
	if err := json.Unmarshal(out, &c); err != nil {
		t.Fatal(err)
	}
	return c
}

func TestPythonExecution(t *testing.T) {
	s := startServer(t)

	t.Run("state, output and the main result", func(t *testing.T) {
		s.execute(t, map[string]any{"code": "x = 41"})
		msgs := s.execute(t, map[string]any{"code": "import os, sys\nprint('out', os.getcwd())\nprint('err', file=sys.stderr)\nx + 1"})
		if got := text(msgs, "stdout"); got != "out "+s.cwd+"\n" {
			t.Errorf("stdout %q", got)
		}
		if got := text(msgs, "stderr"); got != "err\n" {
			t.Errorf("stderr %q", got)
		}
		res := of(msgs, "result")
		if len(res) != 1 || res[0]["text"] != "42" || res[0]["is_main_result"] != true {
			t.Errorf("results %v", res)
		}
		n := of(msgs, "number_of_executions")
		if len(n) != 1 || n[0]["execution_count"].(float64) < 2 {
			t.Errorf("number_of_executions %v", n)
		}
		if ts, ok := of(msgs, "stdout")[0]["timestamp"].(float64); !ok || ts < 1e18 {
			t.Errorf("stdout timestamp %v is not Unix nanoseconds", of(msgs, "stdout")[0]["timestamp"])
		}
	})

	t.Run("display data in every format", func(t *testing.T) {
		msgs := s.execute(t, map[string]any{"code": "from IPython.display import display, HTML, JSON, Markdown\n" +
			"display(HTML('<b>x</b>'))\ndisplay(Markdown('# t'))\ndisplay({'image/png': 'iVBORw0=', 'text/plain': 'img', 'application/x-custom': 'c'}, raw=True)\n" +
			"JSON({'a': 1})"})
		res := of(msgs, "result")
		if len(res) != 4 {
			t.Fatalf("results %v", res)
		}
		if res[0]["html"] != "<b>x</b>" || res[0]["is_main_result"] != false {
			t.Errorf("html result %v", res[0])
		}
		if res[1]["markdown"] != "# t" {
			t.Errorf("markdown result %v", res[1])
		}
		if res[2]["png"] != "iVBORw0=" || res[2]["text"] != "img" {
			t.Errorf("png result %v", res[2])
		}
		if extra, _ := res[2]["extra"].(map[string]any); extra["application/x-custom"] != "c" {
			t.Errorf("a MIME type without a field should be in extra: %v", res[2])
		}
		if j, _ := res[3]["json"].(map[string]any); j["a"] != float64(1) || res[3]["is_main_result"] != true {
			t.Errorf("json result %v", res[3])
		}
	})

	t.Run("an error with its traceback", func(t *testing.T) {
		msgs := s.execute(t, map[string]any{"code": "def f():\n    raise ValueError('bad value')\nf()"})
		errs := of(msgs, "error")
		if len(errs) != 1 || errs[0]["name"] != "ValueError" || errs[0]["value"] != "bad value" ||
			!strings.Contains(ansi.ReplaceAllString(errs[0]["traceback"].(string), ""), "raise ValueError('bad value')") {
			t.Fatalf("error %v", errs)
		}
		// The context goes on after an error.
		if got := of(s.execute(t, map[string]any{"code": "x"}), "result"); len(got) != 1 || got[0]["text"] != "41" {
			t.Errorf("after the error: %v", got)
		}
	})

	t.Run("env vars last one execution", func(t *testing.T) {
		msgs := s.execute(t, map[string]any{"code": "import os\nprint(os.environ['AENV_T'])", "env_vars": map[string]string{"AENV_T": "v1"}})
		if got := text(msgs, "stdout"); got != "v1\n" {
			t.Errorf("with env_vars: %q", got)
		}
		msgs = s.execute(t, map[string]any{"code": "print(os.environ.get('AENV_T', 'unset'))"})
		if got := text(msgs, "stdout"); got != "unset\n" {
			t.Errorf("the next execution still sees it: %q", got)
		}
	})

	t.Run("a client that leaves interrupts the execution", func(t *testing.T) {
		b, _ := json.Marshal(map[string]any{"code": "import time\nfor i in range(600):\n    print(i, flush=True)\n    time.sleep(0.1)\nprint('not interrupted')"})
		req, _ := http.NewRequest("POST", s.url+"/execute", bytes.NewReader(b))
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		line, err := bufio.NewReader(resp.Body).ReadString('\n')
		if err != nil || !strings.Contains(line, "number_of_executions") {
			t.Fatalf("first line %q, %v", line, err)
		}
		resp.Body.Close() // as the SDKs do when an execution's timeout passes
		start := time.Now()
		msgs := s.execute(t, map[string]any{"code": "print('next')"})
		if got := text(msgs, "stdout"); got != "next\n" {
			t.Errorf("the next execution printed %q", got)
		}
		if took := time.Since(start); took > 20*time.Second {
			t.Errorf("the next execution waited %s: the left one was not interrupted", took)
		}
	})
}

func TestContexts(t *testing.T) {
	s := startServer(t)

	other := filepath.Join(s.cwd, "other")
	if err := os.Mkdir(other, 0o755); err != nil {
		t.Fatal(err)
	}
	py := s.newContext(t, map[string]any{"cwd": other})
	if py.Language != "python" || py.Cwd != other || py.ID == "" {
		t.Fatalf("context %+v", py)
	}
	t.Run("a context has its own state and directory", func(t *testing.T) {
		s.execute(t, map[string]any{"code": "y = 'default'"})
		s.execute(t, map[string]any{"code": "y = 'mine'", "context_id": py.ID})
		if got := of(s.execute(t, map[string]any{"code": "import os\nprint(os.getcwd())\ny", "context_id": py.ID}), "result"); len(got) != 1 || got[0]["text"] != "'mine'" {
			t.Errorf("context result %v", got)
		}
		if got := of(s.execute(t, map[string]any{"code": "y"}), "result"); len(got) != 1 || got[0]["text"] != "'default'" {
			t.Errorf("default context result %v", got)
		}
	})

	t.Run("list", func(t *testing.T) {
		code, out := s.do(t, "GET", "/contexts", nil)
		var list []context
		if err := json.Unmarshal(out, &list); code != 200 || err != nil {
			t.Fatalf("list: %d %s", code, out)
		}
		found := false
		for _, c := range list {
			found = found || c == py
		}
		if !found || len(list) < 2 {
			t.Errorf("list %+v lacks %+v or the default context", list, py)
		}
	})

	t.Run("restart forgets the state, keeps id and directory", func(t *testing.T) {
		if code, out := s.do(t, "POST", "/contexts/"+py.ID+"/restart", nil); code/100 != 2 {
			t.Fatalf("restart: %d %s", code, out)
		}
		msgs := s.execute(t, map[string]any{"code": "import os\nprint(os.getcwd())\n'y' in dir()", "context_id": py.ID})
		if got := text(msgs, "stdout"); got != other+"\n" {
			t.Errorf("cwd after restart %q", got)
		}
		if got := of(msgs, "result"); len(got) != 1 || got[0]["text"] != "False" {
			t.Errorf("state survived the restart: %v", got)
		}
	})

	t.Run("bash keeps its shell", func(t *testing.T) {
		sh := s.newContext(t, map[string]any{"language": "bash"})
		if sh.Language != "bash" || sh.Cwd != s.cwd {
			t.Fatalf("bash context %+v", sh)
		}
		s.execute(t, map[string]any{"code": "V=kept; cd " + other, "context_id": sh.ID})
		msgs := s.execute(t, map[string]any{"code": "echo $V; pwd; echo oops >&2; echo -n tail", "context_id": sh.ID})
		if got := text(msgs, "stdout"); got != "kept\n"+other+"\ntail" {
			t.Errorf("stdout %q", got)
		}
		if got := text(msgs, "stderr"); got != "oops\n" {
			t.Errorf("stderr %q", got)
		}
		if errs := of(msgs, "error"); len(errs) != 0 {
			t.Errorf("error for exit 0: %v", errs)
		}
		msgs = s.execute(t, map[string]any{"code": "echo $E; (exit 3)", "context_id": sh.ID, "env_vars": map[string]string{"E": "it's set"}})
		if got := text(msgs, "stdout"); got != "it's set\n" {
			t.Errorf("env var: %q", got)
		}
		if errs := of(msgs, "error"); len(errs) != 1 || errs[0]["value"] != "3" {
			t.Errorf("exit status 3: %v", errs)
		}
		if got := text(s.execute(t, map[string]any{"code": "echo ${E-unset}", "context_id": sh.ID}), "stdout"); got != "unset\n" {
			t.Errorf("env var outlived its execution: %q", got)
		}
		if errs := of(s.execute(t, map[string]any{"code": "if then fi", "context_id": sh.ID}), "error"); len(errs) != 1 {
			t.Errorf("syntax error: %v", errs)
		}
		msgs = s.execute(t, map[string]any{"code": "exit 7", "context_id": sh.ID})
		if errs := of(msgs, "error"); len(errs) != 1 {
			t.Errorf("exit: %v", errs)
		}
		if got := text(s.execute(t, map[string]any{"code": "echo alive", "context_id": sh.ID}), "stdout"); got != "alive\n" {
			t.Errorf("after exit: %q", got)
		}
		// The default bash context, by language.
		if got := text(s.execute(t, map[string]any{"code": "echo $0", "language": "bash"}), "stdout"); !strings.Contains(got, "bash") {
			t.Errorf("default bash context: %q", got)
		}
	})

	t.Run("delete", func(t *testing.T) {
		if code, out := s.do(t, "DELETE", "/contexts/"+py.ID, nil); code/100 != 2 {
			t.Fatalf("delete: %d %s", code, out)
		}
		if code, _ := s.do(t, "POST", "/execute", map[string]any{"code": "1", "context_id": py.ID}); code != 404 {
			t.Errorf("execute in a deleted context: %d", code)
		}
	})
}

func TestBadRequests(t *testing.T) {
	s := startServer(t)
	cases := []struct {
		method, path string
		body         any
		status       int
		says         string
	}{
		{"POST", "/execute", map[string]any{}, 400, "code"},
		{"POST", "/execute", map[string]any{"code": 1}, 400, "code"},
		{"POST", "/execute", "not json", 400, "JSON"},
		{"POST", "/execute", "[1]", 400, "object"},
		{"POST", "/execute", map[string]any{"code": "1", "language": "cobol"}, 400, "cobol"},
		{"POST", "/execute", map[string]any{"code": "1", "context_id": "nope"}, 404, "nope"},
		{"POST", "/execute", map[string]any{"code": "1", "context_id": "x", "language": "python"}, 400, "not both"},
		{"POST", "/execute", map[string]any{"code": "1", "env_vars": map[string]any{"A": 1}}, 400, "env_vars"},
		{"POST", "/execute", map[string]any{"code": "1", "env_vars": map[string]any{"A B": "x"}}, 400, "A B"},
		{"POST", "/contexts", map[string]any{"language": "r"}, 400, "'r'"},
		{"POST", "/contexts", map[string]any{"cwd": "/nonexistent/dir"}, 400, "/nonexistent/dir"},
		{"POST", "/contexts", map[string]any{"cwd": 5}, 400, "cwd"},
		{"DELETE", "/contexts/nope", nil, 404, "nope"},
		{"POST", "/contexts/nope/restart", nil, 404, "nope"},
		{"PUT", "/contexts", nil, 405, "PUT"},
		{"GET", "/nothing", nil, 404, "/nothing"},
	}
	for _, c := range cases {
		t.Run(c.method+" "+c.path, func(t *testing.T) {
			code, out := s.do(t, c.method, c.path, c.body)
			var e struct {
				Code    int    `json:"code"`
				Message string `json:"message"`
			}
			if err := json.Unmarshal(out, &e); err != nil || code != c.status || e.Code != c.status || !strings.Contains(e.Message, c.says) {
				t.Errorf("%s %s %v: %d %s; want %d naming %q", c.method, c.path, c.body, code, out, c.status, c.says)
			}
		})
	}
}
