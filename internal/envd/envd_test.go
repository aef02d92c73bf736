package envd

import (
	"bytes"
	"compress/gzip"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime/multipart"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"

	"github.com/agentenv/agentenv/internal/envd/gen/filesystempb"
	"github.com/agentenv/agentenv/internal/envd/gen/filesystempb/filesystempbconnect"
	"github.com/agentenv/agentenv/internal/envd/gen/processpb"
	"github.com/agentenv/agentenv/internal/envd/gen/processpb/processpbconnect"
	"github.com/agentenv/agentenv/internal/signedurl"
)

type testEnv struct {
	t       *testing.T
	srv     *Server
	base    string
	httpc   *http.Client
	token   string
	headers http.Header
}

func startServer(t *testing.T, cfg Config) *testEnv {
	t.Helper()
	s, err := NewServer(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Serve(ctx, ln) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("Serve: %v", err)
			}
		case <-time.After(10 * time.Second):
			t.Errorf("server did not shut down")
		}
	})
	return &testEnv{t: t, srv: s, base: "http://" + ln.Addr().String(), httpc: &http.Client{}, token: cfg.AccessToken, headers: http.Header{}}
}

// interceptor adds the token and per-env headers to every call.
func (e *testEnv) interceptor() connect.Interceptor {
	return headerInterceptor(func(h http.Header) {
		if e.token != "" {
			h.Set("X-Access-Token", e.token)
		}
		for k, v := range e.headers {
			h[k] = v
		}
	})
}

type headerInterceptor func(http.Header)

func (f headerInterceptor) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		f(req.Header())
		return next(ctx, req)
	}
}

func (f headerInterceptor) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return func(ctx context.Context, spec connect.Spec) connect.StreamingClientConn {
		conn := next(ctx, spec)
		f(conn.RequestHeader())
		return conn
	}
}

func (f headerInterceptor) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return next
}

func (e *testEnv) clientOpts(binary bool) []connect.ClientOption {
	opts := []connect.ClientOption{connect.WithInterceptors(e.interceptor())}
	if !binary {
		opts = append(opts, connect.WithProtoJSON())
	}
	return opts
}

func (e *testEnv) proc(binary bool) processpbconnect.ProcessClient {
	return processpbconnect.NewProcessClient(e.httpc, e.base, e.clientOpts(binary)...)
}

func (e *testEnv) fs(binary bool) filesystempbconnect.FilesystemClient {
	return filesystempbconnect.NewFilesystemClient(e.httpc, e.base, e.clientOpts(binary)...)
}

type result struct {
	pid            uint32
	stdout, stderr string
	pty            string
	end            *processpb.ProcessEvent_EndEvent
	events         int
}

type eventMsg interface {
	GetEvent() *processpb.ProcessEvent
}

type eventStream[T eventMsg] interface {
	Receive() bool
	Msg() T
	Err() error
}

// collect drains a Start/Connect stream.
func collect[T eventMsg](t *testing.T, st eventStream[T]) result {
	t.Helper()
	var r result
	for st.Receive() {
		r.events++
		ev := st.Msg().GetEvent()
		switch v := ev.GetEvent().(type) {
		case *processpb.ProcessEvent_Start:
			r.pid = v.Start.GetPid()
		case *processpb.ProcessEvent_Data:
			r.stdout += string(v.Data.GetStdout())
			r.stderr += string(v.Data.GetStderr())
			r.pty += string(v.Data.GetPty())
		case *processpb.ProcessEvent_End:
			r.end = v.End
		}
	}
	if err := st.Err(); err != nil {
		t.Fatalf("stream error: %v", err)
	}
	if r.end == nil {
		t.Fatalf("stream ended without end event (stdout=%q stderr=%q)", r.stdout, r.stderr)
	}
	return r
}

func startReq(cmd string, args ...string) *processpb.StartRequest {
	return &processpb.StartRequest{Process: &processpb.ProcessConfig{Cmd: cmd, Args: args}}
}

func TestProcessStartOutput(t *testing.T) {
	e := startServer(t, Config{})
	dir := t.TempDir()
	cases := []struct {
		name       string
		req        *processpb.StartRequest
		wantOut    string
		wantErr    string
		wantCode   int32
		wantExited bool
	}{
		{name: "python stdout+stderr", req: startReq("python3", "-c", "import sys; print('hello'); print('oops', file=sys.stderr)"), wantOut: "hello\n", wantErr: "oops\n", wantExited: true},
		{name: "bash -l -c like the SDK", req: startReq("/bin/bash", "-l", "-c", "echo $((6*7))"), wantOut: "42\n", wantExited: true},
		{name: "non-zero exit", req: startReq("bash", "-c", "echo partial; exit 3"), wantOut: "partial\n", wantCode: 3, wantExited: true},
		{name: "envs", req: &processpb.StartRequest{Process: &processpb.ProcessConfig{Cmd: "bash", Args: []string{"-c", "printf %s \"$FOO\""}, Envs: map[string]string{"FOO": "bar baz"}}}, wantOut: "bar baz", wantExited: true},
		{name: "cwd", req: &processpb.StartRequest{Process: &processpb.ProcessConfig{Cmd: "pwd", Cwd: &dir}}, wantOut: dir + "\n", wantExited: true},
		{name: "self signal", req: startReq("bash", "-c", "kill -TERM $$"), wantCode: -1, wantExited: false},
	}
	for _, binary := range []bool{false, true} {
		for _, tc := range cases {
			t.Run(fmt.Sprintf("%s/binary=%v", tc.name, binary), func(t *testing.T) {
				st, err := e.proc(binary).Start(context.Background(), connect.NewRequest(tc.req))
				if err != nil {
					t.Fatal(err)
				}
				r := collect(t, st)
				if r.pid == 0 {
					t.Errorf("no pid in start event")
				}
				if r.stdout != tc.wantOut || r.stderr != tc.wantErr {
					t.Errorf("stdout=%q stderr=%q, want %q %q", r.stdout, r.stderr, tc.wantOut, tc.wantErr)
				}
				if r.end.GetExitCode() != tc.wantCode || r.end.GetExited() != tc.wantExited {
					t.Errorf("end=%v, want code %d exited %v", r.end, tc.wantCode, tc.wantExited)
				}
				if r.end.GetStatus() == "" {
					t.Errorf("empty status")
				}
			})
		}
	}
}

func TestProcessStartErrors(t *testing.T) {
	e := startServer(t, Config{})
	bad := "/does/not/exist"
	for name, req := range map[string]*processpb.StartRequest{
		"missing binary": startReq("no-such-binary-xyz"),
		"empty cmd":      startReq(""),
		"bad cwd":        {Process: &processpb.ProcessConfig{Cmd: "true", Cwd: &bad}},
	} {
		t.Run(name, func(t *testing.T) {
			st, err := e.proc(false).Start(context.Background(), connect.NewRequest(req))
			if err == nil {
				for st.Receive() {
				}
				err = st.Err()
			}
			if connect.CodeOf(err) != connect.CodeInvalidArgument {
				t.Fatalf("got %v, want invalid_argument", err)
			}
		})
	}
}

func TestProcessOutputIsStreamed(t *testing.T) {
	e := startServer(t, Config{})
	st, err := e.proc(false).Start(context.Background(), connect.NewRequest(startReq("bash", "-c", "echo first; sleep 1.5; echo second")))
	if err != nil {
		t.Fatal(err)
	}
	var firstAt, endAt time.Time
	for st.Receive() {
		ev := st.Msg().GetEvent()
		if d := ev.GetData(); d != nil && strings.Contains(string(d.GetStdout()), "first") && firstAt.IsZero() {
			firstAt = time.Now()
		}
		if ev.GetEnd() != nil {
			endAt = time.Now()
		}
	}
	if firstAt.IsZero() || endAt.IsZero() {
		t.Fatalf("missing events: first=%v end=%v err=%v", firstAt, endAt, st.Err())
	}
	if gap := endAt.Sub(firstAt); gap < time.Second {
		t.Fatalf("first output arrived only %v before the end: output is buffered", gap)
	}
}

func TestProcessSignalListConnect(t *testing.T) {
	e := startServer(t, Config{})
	pc := e.proc(false)
	tag := "long-runner"
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	// The child sleep keeps the output pipe open; killing the group must end the stream.
	st, err := pc.Start(ctx, connect.NewRequest(&processpb.StartRequest{
		Process: &processpb.ProcessConfig{Cmd: "bash", Args: []string{"-c", "echo ready; sleep 300 & sleep 300"}},
		Tag:     &tag,
	}))
	if err != nil {
		t.Fatal(err)
	}
	if !st.Receive() || st.Msg().GetEvent().GetStart() == nil {
		t.Fatalf("first event is not start: %v %v", st.Msg(), st.Err())
	}
	pid := st.Msg().GetEvent().GetStart().GetPid()

	list, err := pc.List(ctx, connect.NewRequest(&processpb.ListRequest{}))
	if err != nil {
		t.Fatal(err)
	}
	found := false
	for _, p := range list.Msg.GetProcesses() {
		if p.GetPid() == pid {
			found = true
			if p.GetTag() != tag || p.GetConfig().GetCmd() != "bash" {
				t.Errorf("list entry %v", p)
			}
		}
	}
	if !found {
		t.Fatalf("pid %d not in list %v", pid, list.Msg.GetProcesses())
	}

	cst, err := pc.Connect(ctx, connect.NewRequest(&processpb.ConnectRequest{Process: &processpb.ProcessSelector{Selector: &processpb.ProcessSelector_Tag{Tag: tag}}}))
	if err != nil {
		t.Fatal(err)
	}
	if !cst.Receive() || cst.Msg().GetEvent().GetStart().GetPid() != pid {
		t.Fatalf("connect start event: %v %v", cst.Msg(), cst.Err())
	}
	connected := make(chan result, 1)
	go func() { connected <- collect(t, cst) }()

	if _, err := pc.SendSignal(ctx, connect.NewRequest(&processpb.SendSignalRequest{
		Process: &processpb.ProcessSelector{Selector: &processpb.ProcessSelector_Pid{Pid: pid}},
		Signal:  processpb.Signal_SIGNAL_SIGKILL,
	})); err != nil {
		t.Fatal(err)
	}
	begin := time.Now()
	r := collect(t, st)
	if time.Since(begin) > 5*time.Second {
		t.Errorf("stream took %v to end after kill", time.Since(begin))
	}
	if r.end.GetExited() || !strings.Contains(r.end.GetStatus(), "killed") {
		t.Errorf("end event %v, want killed", r.end)
	}
	if cr := <-connected; !strings.Contains(cr.end.GetStatus(), "killed") {
		t.Errorf("connect end %v", cr.end)
	}
	// Gone now.
	_, err = pc.SendSignal(ctx, connect.NewRequest(&processpb.SendSignalRequest{
		Process: &processpb.ProcessSelector{Selector: &processpb.ProcessSelector_Pid{Pid: pid}},
		Signal:  processpb.Signal_SIGNAL_SIGKILL,
	}))
	if connect.CodeOf(err) != connect.CodeNotFound {
		t.Errorf("signal after exit: %v, want not_found", err)
	}
	_, err = pc.Connect(ctx, connect.NewRequest(&processpb.ConnectRequest{Process: &processpb.ProcessSelector{Selector: &processpb.ProcessSelector_Tag{Tag: "nope"}}}))
	if err == nil {
		cs, _ := pc.Connect(ctx, connect.NewRequest(&processpb.ConnectRequest{Process: &processpb.ProcessSelector{Selector: &processpb.ProcessSelector_Tag{Tag: "nope"}}}))
		cs.Receive()
		err = cs.Err()
	}
	if connect.CodeOf(err) != connect.CodeNotFound {
		t.Errorf("connect unknown tag: %v", err)
	}
}

func TestProcessBackgroundChildDoesNotHang(t *testing.T) {
	e := startServer(t, Config{})
	begin := time.Now()
	st, err := e.proc(false).Start(context.Background(), connect.NewRequest(startReq("bash", "-c", "sleep 30 & echo parent-done")))
	if err != nil {
		t.Fatal(err)
	}
	r := collect(t, st)
	if d := time.Since(begin); d > 5*time.Second {
		t.Fatalf("stream ended after %v", d)
	}
	if r.stdout != "parent-done\n" || r.end.GetExitCode() != 0 {
		t.Fatalf("got %+v", r)
	}
	_ = syscall.Kill(-int(r.pid), syscall.SIGKILL)
}

func TestProcessStdin(t *testing.T) {
	e := startServer(t, Config{})
	pc := e.proc(false)
	ctx := context.Background()
	yes := true
	st, err := pc.Start(ctx, connect.NewRequest(&processpb.StartRequest{Process: &processpb.ProcessConfig{Cmd: "cat"}, Stdin: &yes}))
	if err != nil {
		t.Fatal(err)
	}
	if !st.Receive() {
		t.Fatal(st.Err())
	}
	pid := st.Msg().GetEvent().GetStart().GetPid()
	sel := &processpb.ProcessSelector{Selector: &processpb.ProcessSelector_Pid{Pid: pid}}
	if _, err := pc.SendInput(ctx, connect.NewRequest(&processpb.SendInputRequest{Process: sel, Input: &processpb.ProcessInput{Input: &processpb.ProcessInput_Stdin{Stdin: []byte("hello\n")}}})); err != nil {
		t.Fatal(err)
	}
	in := pc.StreamInput(ctx)
	in.RequestHeader().Set("X-Test", "1")
	for _, m := range []*processpb.StreamInputRequest{
		{Event: &processpb.StreamInputRequest_Start{Start: &processpb.StreamInputRequest_StartEvent{Process: sel}}},
		{Event: &processpb.StreamInputRequest_Data{Data: &processpb.StreamInputRequest_DataEvent{Input: &processpb.ProcessInput{Input: &processpb.ProcessInput_Stdin{Stdin: []byte("world\n")}}}}},
	} {
		if err := in.Send(m); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := in.CloseAndReceive(); err != nil {
		t.Fatal(err)
	}
	if _, err := pc.CloseStdin(ctx, connect.NewRequest(&processpb.CloseStdinRequest{Process: sel})); err != nil {
		t.Fatal(err)
	}
	r := collect(t, st)
	if r.stdout != "hello\nworld\n" || r.end.GetExitCode() != 0 {
		t.Fatalf("got stdout %q end %v", r.stdout, r.end)
	}

	// Without stdin requested, input is refused and the process sees EOF.
	st2, err := pc.Start(ctx, connect.NewRequest(startReq("cat")))
	if err != nil {
		t.Fatal(err)
	}
	if r := collect(t, st2); r.stdout != "" || r.end.GetExitCode() != 0 {
		t.Fatalf("cat without stdin: %+v", r)
	}
}

func TestProcessPTY(t *testing.T) {
	e := startServer(t, Config{})
	pc := e.proc(false)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	st, err := pc.Start(ctx, connect.NewRequest(&processpb.StartRequest{
		Process: &processpb.ProcessConfig{Cmd: "bash", Args: []string{"--norc", "--noprofile", "-i"}, Envs: map[string]string{"PS1": "$ "}},
		Pty:     &processpb.PTY{Size: &processpb.PTY_Size{Cols: 80, Rows: 24}},
	}))
	if err != nil {
		t.Fatal(err)
	}
	if !st.Receive() {
		t.Fatal(st.Err())
	}
	pid := st.Msg().GetEvent().GetStart().GetPid()
	sel := &processpb.ProcessSelector{Selector: &processpb.ProcessSelector_Pid{Pid: pid}}
	var out strings.Builder
	waitFor := func(s string) {
		t.Helper()
		for !strings.Contains(out.String(), s) {
			if !st.Receive() {
				t.Fatalf("stream ended waiting for %q; output %q err %v", s, out.String(), st.Err())
			}
			out.Write(st.Msg().GetEvent().GetData().GetPty())
		}
	}
	send := func(s string) {
		t.Helper()
		if _, err := pc.SendInput(ctx, connect.NewRequest(&processpb.SendInputRequest{Process: sel, Input: &processpb.ProcessInput{Input: &processpb.ProcessInput_Pty{Pty: []byte(s)}}})); err != nil {
			t.Fatal(err)
		}
	}
	send("echo size=$(stty size)\n")
	waitFor("size=24 80")
	if _, err := pc.Update(ctx, connect.NewRequest(&processpb.UpdateRequest{Process: sel, Pty: &processpb.PTY{Size: &processpb.PTY_Size{Cols: 120, Rows: 40}}})); err != nil {
		t.Fatal(err)
	}
	send("echo size=$(stty size)\n")
	waitFor("size=40 120")
	send("tty -s && echo is-a-tty; exit 7\n")
	waitFor("is-a-tty")
	var end *processpb.ProcessEvent_EndEvent
	for st.Receive() {
		if x := st.Msg().GetEvent().GetEnd(); x != nil {
			end = x
		}
	}
	if end == nil || end.GetExitCode() != 7 {
		t.Fatalf("end %v err %v", end, st.Err())
	}
	// Update of a non-pty process fails cleanly.
	_, err = pc.Update(ctx, connect.NewRequest(&processpb.UpdateRequest{Process: &processpb.ProcessSelector{Selector: &processpb.ProcessSelector_Pid{Pid: 999999}}}))
	if connect.CodeOf(err) != connect.CodeNotFound {
		t.Fatalf("update unknown pid: %v", err)
	}
}

func TestFilesystem(t *testing.T) {
	e := startServer(t, Config{})
	for _, binary := range []bool{false, true} {
		t.Run(fmt.Sprintf("binary=%v", binary), func(t *testing.T) {
			fc := e.fs(binary)
			ctx := context.Background()
			root := t.TempDir()
			dir := filepath.Join(root, "a", "b")
			mk, err := fc.MakeDir(ctx, connect.NewRequest(&filesystempb.MakeDirRequest{Path: dir}))
			if err != nil {
				t.Fatal(err)
			}
			if mk.Msg.GetEntry().GetType() != filesystempb.FileType_FILE_TYPE_DIRECTORY || mk.Msg.GetEntry().GetPath() != dir || mk.Msg.GetEntry().GetName() != "b" {
				t.Errorf("makedir entry %v", mk.Msg.GetEntry())
			}
			if _, err := fc.MakeDir(ctx, connect.NewRequest(&filesystempb.MakeDirRequest{Path: dir})); connect.CodeOf(err) != connect.CodeAlreadyExists {
				t.Errorf("second makedir: %v", err)
			}
			file := filepath.Join(dir, "f.txt")
			if err := os.WriteFile(file, []byte("12345"), 0o640); err != nil {
				t.Fatal(err)
			}
			if err := os.Symlink(file, filepath.Join(root, "link")); err != nil {
				t.Fatal(err)
			}
			st, err := fc.Stat(ctx, connect.NewRequest(&filesystempb.StatRequest{Path: file}))
			if err != nil {
				t.Fatal(err)
			}
			en := st.Msg.GetEntry()
			if en.GetSize() != 5 || en.GetMode() != 0o640 || en.GetPermissions() != "-rw-r-----" || en.GetType() != filesystempb.FileType_FILE_TYPE_FILE ||
				en.GetOwner() != "root" || en.GetName() != "f.txt" || en.GetModifiedTime().AsTime().IsZero() || en.SymlinkTarget != nil {
				t.Errorf("stat entry %v", en)
			}
			// A symlink as E2B's envd describes it: the type and mode of
			// what it leads to, the resolved target, its own mode string;
			// one leading nowhere has no type and itself as target.
			if err := os.Symlink("relative/../a/b/f.txt", filepath.Join(root, "rel-link")); err != nil {
				t.Fatal(err)
			}
			if err := os.Symlink(filepath.Join(root, "nowhere"), filepath.Join(root, "dangling")); err != nil {
				t.Fatal(err)
			}
			os.MkdirAll(filepath.Join(root, "relative"), 0o755)
			for _, c := range []struct {
				link, target string
				typ          filesystempb.FileType
				mode         uint32
			}{
				{"link", file, filesystempb.FileType_FILE_TYPE_FILE, 0o640},
				{"rel-link", file, filesystempb.FileType_FILE_TYPE_FILE, 0o640},
				{"dangling", filepath.Join(root, "dangling"), filesystempb.FileType_FILE_TYPE_UNSPECIFIED, 0},
			} {
				ln, err := fc.Stat(ctx, connect.NewRequest(&filesystempb.StatRequest{Path: filepath.Join(root, c.link)}))
				en := ln.Msg.GetEntry()
				if err != nil || en.GetType() != c.typ || en.GetSymlinkTarget() != c.target || en.GetMode() != c.mode || !strings.HasPrefix(en.GetPermissions(), "L") {
					t.Errorf("stat symlink %s: %v %v", c.link, en, err)
				}
			}
			os.Remove(filepath.Join(root, "rel-link"))
			os.Remove(filepath.Join(root, "dangling"))
			os.Remove(filepath.Join(root, "relative"))
			if _, err := fc.Stat(ctx, connect.NewRequest(&filesystempb.StatRequest{Path: filepath.Join(root, "missing")})); connect.CodeOf(err) != connect.CodeNotFound {
				t.Errorf("stat missing: %v", err)
			}

			names := func(depth uint32) []string {
				res, err := fc.ListDir(ctx, connect.NewRequest(&filesystempb.ListDirRequest{Path: root, Depth: depth}))
				if err != nil {
					t.Fatal(err)
				}
				var out []string
				for _, x := range res.Msg.GetEntries() {
					rel, _ := filepath.Rel(root, x.GetPath())
					out = append(out, rel)
				}
				return out
			}
			if got := strings.Join(names(1), ","); got != "a,link" {
				t.Errorf("depth 1: %s", got)
			}
			if got := strings.Join(names(3), ","); got != "a,a/b,a/b/f.txt,link" {
				t.Errorf("depth 3: %s", got)
			}
			if _, err := fc.ListDir(ctx, connect.NewRequest(&filesystempb.ListDirRequest{Path: file})); connect.CodeOf(err) != connect.CodeInvalidArgument {
				t.Errorf("listdir on file: %v", err)
			}
			if _, err := fc.ListDir(ctx, connect.NewRequest(&filesystempb.ListDirRequest{Path: root + "/nope"})); connect.CodeOf(err) != connect.CodeNotFound {
				t.Errorf("listdir missing: %v", err)
			}

			dst := filepath.Join(root, "moved", "g.txt")
			mv, err := fc.Move(ctx, connect.NewRequest(&filesystempb.MoveRequest{Source: file, Destination: dst}))
			if err != nil {
				t.Fatal(err)
			}
			if mv.Msg.GetEntry().GetPath() != dst || mv.Msg.GetEntry().GetSize() != 5 {
				t.Errorf("move entry %v", mv.Msg.GetEntry())
			}
			if _, err := os.Stat(file); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("source still there: %v", err)
			}
			if _, err := fc.Move(ctx, connect.NewRequest(&filesystempb.MoveRequest{Source: file, Destination: dst})); connect.CodeOf(err) != connect.CodeNotFound {
				t.Errorf("move missing: %v", err)
			}
			if _, err := fc.Remove(ctx, connect.NewRequest(&filesystempb.RemoveRequest{Path: filepath.Join(root, "a")})); err != nil {
				t.Fatal(err)
			}
			if _, err := os.Stat(filepath.Join(root, "a")); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("not removed: %v", err)
			}
			// As E2B's envd: removing what is not there succeeds.
			if _, err := fc.Remove(ctx, connect.NewRequest(&filesystempb.RemoveRequest{Path: filepath.Join(root, "a")})); err != nil {
				t.Errorf("remove missing: %v", err)
			}
		})
	}
}

func TestWatchDir(t *testing.T) {
	e := startServer(t, Config{})
	fc := e.fs(false)
	root := t.TempDir()
	if err := os.Mkdir(filepath.Join(root, "sub"), 0o755); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	st, err := fc.WatchDir(ctx, connect.NewRequest(&filesystempb.WatchDirRequest{Path: root, Recursive: true, IncludeEntry: true}))
	if err != nil {
		t.Fatal(err)
	}
	if !st.Receive() || st.Msg().GetStart() == nil {
		t.Fatalf("first watch event not start: %v %v", st.Msg(), st.Err())
	}
	if err := os.WriteFile(filepath.Join(root, "sub", "x.txt"), []byte("hi"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(filepath.Join(root, "sub", "x.txt")); err != nil {
		t.Fatal(err)
	}
	seen := map[filesystempb.EventType]bool{}
	for !(seen[filesystempb.EventType_EVENT_TYPE_CREATE] && seen[filesystempb.EventType_EVENT_TYPE_WRITE] && seen[filesystempb.EventType_EVENT_TYPE_REMOVE]) {
		if !st.Receive() {
			t.Fatalf("stream ended: %v (seen %v)", st.Err(), seen)
		}
		fe := st.Msg().GetFilesystem()
		if fe == nil {
			continue
		}
		if fe.GetName() != "sub/x.txt" {
			t.Errorf("event name %q", fe.GetName())
		}
		if fe.GetType() == filesystempb.EventType_EVENT_TYPE_CREATE && fe.GetEntry() != nil && fe.GetEntry().GetPath() != filepath.Join(root, "sub", "x.txt") {
			t.Errorf("entry %v", fe.GetEntry())
		}
		seen[fe.GetType()] = true
	}
	cancel()

	// Polled watchers.
	ctx2 := context.Background()
	cw, err := fc.CreateWatcher(ctx2, connect.NewRequest(&filesystempb.CreateWatcherRequest{Path: root}))
	if err != nil {
		t.Fatal(err)
	}
	id := cw.Msg.GetWatcherId()
	if err := os.WriteFile(filepath.Join(root, "top.txt"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	var got []*filesystempb.FilesystemEvent
	for deadline := time.Now().Add(5 * time.Second); len(got) == 0 && time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		res, err := fc.GetWatcherEvents(ctx2, connect.NewRequest(&filesystempb.GetWatcherEventsRequest{WatcherId: id}))
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, res.Msg.GetEvents()...)
	}
	if len(got) == 0 || got[0].GetName() != "top.txt" || got[0].GetType() != filesystempb.EventType_EVENT_TYPE_CREATE {
		t.Fatalf("polled events %v", got)
	}
	if _, err := fc.RemoveWatcher(ctx2, connect.NewRequest(&filesystempb.RemoveWatcherRequest{WatcherId: id})); err != nil {
		t.Fatal(err)
	}
	if _, err := fc.GetWatcherEvents(ctx2, connect.NewRequest(&filesystempb.GetWatcherEventsRequest{WatcherId: id})); connect.CodeOf(err) != connect.CodeNotFound {
		t.Fatalf("removed watcher: %v", err)
	}
	if _, err := fc.WatchDir(ctx2, connect.NewRequest(&filesystempb.WatchDirRequest{Path: root + "/missing"})); err == nil {
		t.Log("watch of missing dir returned no immediate error (streams report lazily)")
	}
}

func (e *testEnv) do(req *http.Request) (*http.Response, []byte) {
	e.t.Helper()
	if e.token != "" && req.Header.Get("X-Access-Token") == "" {
		req.Header.Set("X-Access-Token", e.token)
	}
	res, err := e.httpc.Do(req)
	if err != nil {
		e.t.Fatal(err)
	}
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	if err != nil {
		e.t.Fatal(err)
	}
	return res, b
}

func (e *testEnv) filesURL(q url.Values) string { return e.base + "/files?" + q.Encode() }

func multipartBody(t *testing.T, files map[string]string) (string, *bytes.Buffer) {
	var buf bytes.Buffer
	mw := multipart.NewWriter(&buf)
	for name, content := range files {
		w, err := mw.CreateFormFile("file", name)
		if err != nil {
			t.Fatal(err)
		}
		io.WriteString(w, content)
	}
	mw.Close()
	return mw.FormDataContentType(), &buf
}

func TestFilesUploadDownload(t *testing.T) {
	e := startServer(t, Config{AccessToken: "tok"})
	root := t.TempDir()

	// Multipart, several files, destination in the part's file name.
	p1, p2 := filepath.Join(root, "x", "one.txt"), filepath.Join(root, "y", "z", "two.json")
	ct, body := multipartBody(t, map[string]string{p1: "first", p2: `{"a":1}`})
	req, _ := http.NewRequest(http.MethodPost, e.filesURL(nil), body)
	req.Header.Set("Content-Type", ct)
	res, b := e.do(req)
	if res.StatusCode != 200 {
		t.Fatalf("multipart upload: %d %s", res.StatusCode, b)
	}
	var entries []uploadedEntry
	if err := json.Unmarshal(b, &entries); err != nil || len(entries) != 2 {
		t.Fatalf("upload response %s (%v)", b, err)
	}
	for _, en := range entries {
		if en.Type != "file" || (en.Path != p1 && en.Path != p2) || en.Name != filepath.Base(en.Path) {
			t.Errorf("entry %+v", en)
		}
	}

	// Multipart with ?path= (single-file SDK write).
	p3 := filepath.Join(root, "single.bin")
	ct, body = multipartBody(t, map[string]string{"blob": "\x00\x01binary"})
	req, _ = http.NewRequest(http.MethodPost, e.filesURL(url.Values{"path": {p3}}), body)
	req.Header.Set("Content-Type", ct)
	if res, b := e.do(req); res.StatusCode != 200 || !strings.Contains(string(b), `"path":"`+p3+`"`) {
		t.Fatalf("single multipart: %d %s", res.StatusCode, b)
	}

	// Octet-stream, plain and gzip.
	p4 := filepath.Join(root, "deep", "raw.txt")
	req, _ = http.NewRequest(http.MethodPost, e.filesURL(url.Values{"path": {p4}}), strings.NewReader("raw body"))
	req.Header.Set("Content-Type", "application/octet-stream")
	if res, b := e.do(req); res.StatusCode != 200 {
		t.Fatalf("octet upload: %d %s", res.StatusCode, b)
	}
	var gz bytes.Buffer
	zw := gzip.NewWriter(&gz)
	zw.Write([]byte("zipped content"))
	zw.Close()
	p5 := filepath.Join(root, "gz.txt")
	req, _ = http.NewRequest(http.MethodPost, e.filesURL(url.Values{"path": {p5}}), &gz)
	req.Header.Set("Content-Type", "application/octet-stream")
	req.Header.Set("Content-Encoding", "gzip")
	if res, b := e.do(req); res.StatusCode != 200 {
		t.Fatalf("gzip upload: %d %s", res.StatusCode, b)
	}

	for path, want := range map[string]string{p1: "first", p2: `{"a":1}`, p3: "\x00\x01binary", p4: "raw body", p5: "zipped content"} {
		req, _ := http.NewRequest(http.MethodGet, e.filesURL(url.Values{"path": {path}}), nil)
		res, b := e.do(req)
		if res.StatusCode != 200 || string(b) != want {
			t.Errorf("download %s: %d %q", path, res.StatusCode, b)
		}
		if cd := res.Header.Get("Content-Disposition"); !strings.Contains(cd, filepath.Base(path)) || !strings.HasPrefix(cd, "attachment") {
			t.Errorf("content-disposition %q", cd)
		}
		if res.Header.Get("Content-Length") != strconv.Itoa(len(want)) {
			t.Errorf("content-length %q", res.Header.Get("Content-Length"))
		}
	}
	req, _ = http.NewRequest(http.MethodGet, e.filesURL(url.Values{"path": {p2}}), nil)
	if res, _ := e.do(req); !strings.HasPrefix(res.Header.Get("Content-Type"), "application/json") {
		t.Errorf("content type for .json: %q", res.Header.Get("Content-Type"))
	}

	// Missing file: 404 JSON; directory: 400.
	req, _ = http.NewRequest(http.MethodGet, e.filesURL(url.Values{"path": {root + "/nope"}}), nil)
	res, b = e.do(req)
	var apiErr apiError
	if res.StatusCode != 404 || json.Unmarshal(b, &apiErr) != nil || apiErr.Code != 404 || apiErr.Message == "" {
		t.Errorf("missing: %d %s", res.StatusCode, b)
	}
	req, _ = http.NewRequest(http.MethodGet, e.filesURL(url.Values{"path": {root}}), nil)
	if res, b := e.do(req); res.StatusCode != 400 {
		t.Errorf("directory download: %d %s", res.StatusCode, b)
	}
	// Uploading onto a directory is refused.
	req, _ = http.NewRequest(http.MethodPost, e.filesURL(url.Values{"path": {root}}), strings.NewReader("x"))
	req.Header.Set("Content-Type", "application/octet-stream")
	if res, b := e.do(req); res.StatusCode != 400 {
		t.Errorf("upload onto dir: %d %s", res.StatusCode, b)
	}
}

func TestAccessToken(t *testing.T) {
	e := startServer(t, Config{AccessToken: "secret-token"})
	get := func(path, token string) (int, []byte) {
		req, _ := http.NewRequest(http.MethodGet, e.base+path, nil)
		if token != "" {
			req.Header.Set("X-Access-Token", token)
		}
		res, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer res.Body.Close()
		b, _ := io.ReadAll(res.Body)
		return res.StatusCode, b
	}
	if code, _ := get("/health", ""); code != 204 {
		t.Errorf("/health without token: %d", code)
	}
	readable := filepath.Join(t.TempDir(), "readable.txt")
	if err := os.WriteFile(readable, []byte("r"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{"/envs", "/metrics", "/files?path=" + url.QueryEscape(readable)} {
		code, b := get(p, "")
		var ae apiError
		if code != 401 || json.Unmarshal(b, &ae) != nil || ae.Code != 401 || ae.Message == "" {
			t.Errorf("%s without token: %d %s", p, code, b)
		}
		if code, _ := get(p, "wrong"); code != 401 {
			t.Errorf("%s wrong token: %d", p, code)
		}
		if code, b := get(p, "secret-token"); code != 200 {
			t.Errorf("%s with token: %d %s", p, code, b)
		}
	}
	// Connect calls.
	noTok := processpbconnect.NewProcessClient(http.DefaultClient, e.base, connect.WithProtoJSON())
	if _, err := noTok.List(context.Background(), connect.NewRequest(&processpb.ListRequest{})); connect.CodeOf(err) != connect.CodeUnauthenticated {
		t.Errorf("rpc without token: %v", err)
	}
	st, err := noTok.Start(context.Background(), connect.NewRequest(startReq("true")))
	if err == nil {
		st.Receive()
		err = st.Err()
	}
	if connect.CodeOf(err) != connect.CodeUnauthenticated {
		t.Errorf("stream without token: %v", err)
	}
	if _, err := e.proc(false).List(context.Background(), connect.NewRequest(&processpb.ListRequest{})); err != nil {
		t.Errorf("rpc with token: %v", err)
	}

	// Signed URLs, as the SDK computes them.
	f := filepath.Join(t.TempDir(), "signed.txt")
	os.WriteFile(f, []byte("signed!"), 0o644)
	sign := func(path, op, user, exp string) string {
		return signedurl.Sign(path, op, user, "secret-token", exp)
	}
	exp := strconv.FormatInt(time.Now().Add(time.Minute).Unix(), 10)
	past := strconv.FormatInt(time.Now().Add(-time.Minute).Unix(), 10)
	// The 401s say what E2B's envd says: the signature is checked before
	// its expiry.
	for _, tc := range []struct {
		name string
		q    url.Values
		want int
		msg  string
	}{
		{"no expiry", url.Values{"path": {f}, "signature": {sign(f, "read", "", "")}}, 200, ""},
		{"with user and expiry", url.Values{"path": {f}, "username": {"root"}, "signature": {sign(f, "read", "root", exp)}, "signature_expiration": {exp}}, 200, ""},
		{"expired", url.Values{"path": {f}, "signature": {sign(f, "read", "", past)}, "signature_expiration": {past}}, 401, "signature is already expired"},
		{"expired and wrong", url.Values{"path": {f}, "signature": {sign(f, "write", "", past)}, "signature_expiration": {past}}, 401, "invalid signature"},
		{"wrong op", url.Values{"path": {f}, "signature": {sign(f, "write", "", "")}}, 401, "invalid signature"},
		{"other path", url.Values{"path": {"/etc/passwd"}, "signature": {sign(f, "read", "", "")}}, 401, "invalid signature"},
	} {
		code, b := get("/files?"+tc.q.Encode(), "")
		var body struct{ Message string }
		_ = json.Unmarshal(b, &body)
		if code != tc.want || body.Message != tc.msg {
			t.Errorf("signed %s: %d %s", tc.name, code, b)
		}
		if tc.want == 200 && string(b) != "signed!" {
			t.Errorf("signed %s body %q", tc.name, b)
		}
	}
	// Known SDK value: "v1_" + unpadded base64 of sha256.
	if got := signedurl.Sign("/a", "read", "user", "tok", ""); !strings.HasPrefix(got, "v1_") || strings.HasSuffix(got, "=") || len(got) != 3+43 {
		t.Errorf("signature format %q", got)
	}
	// Signed upload.
	up := filepath.Join(t.TempDir(), "up.txt")
	q := url.Values{"path": {up}, "signature": {sign(up, "write", "", "")}}
	req, _ := http.NewRequest(http.MethodPost, e.base+"/files?"+q.Encode(), strings.NewReader("via signature"))
	req.Header.Set("Content-Type", "application/octet-stream")
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	res.Body.Close()
	if b, _ := os.ReadFile(up); res.StatusCode != 200 || string(b) != "via signature" {
		t.Errorf("signed upload: %d %q", res.StatusCode, b)
	}

	// /init: refused without the current token, accepted with it.
	post := func(token string, body any) int {
		b, _ := json.Marshal(body)
		req, _ := http.NewRequest(http.MethodPost, e.base+"/init", bytes.NewReader(b))
		req.Header.Set("Content-Type", "application/json")
		if token != "" {
			req.Header.Set("X-Access-Token", token)
		}
		res, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		res.Body.Close()
		return res.StatusCode
	}
	if code := post("", map[string]any{"accessToken": "hijack"}); code != 401 {
		t.Errorf("/init takeover: %d", code)
	}
	if code := post("secret-token", map[string]any{"envVars": map[string]string{"FROM_INIT": "yes"}, "timestamp": time.Now().UTC().Format(time.RFC3339Nano)}); code != 204 {
		t.Errorf("/init with token: %d", code)
	}
	if code, b := get("/envs", "secret-token"); code != 200 || !strings.Contains(string(b), `"FROM_INIT":"yes"`) {
		t.Errorf("/envs: %d %s", code, b)
	}
	st2, err := e.proc(false).Start(context.Background(), connect.NewRequest(startReq("bash", "-c", "printf %s \"$FROM_INIT\"")))
	if err != nil {
		t.Fatal(err)
	}
	if r := collect(t, st2); r.stdout != "yes" {
		t.Errorf("init env not applied: %q", r.stdout)
	}
	// Token rotation by a caller that knows the current token.
	if code := post("secret-token", map[string]any{"accessToken": "new-token"}); code != 204 {
		t.Errorf("rotate: %d", code)
	}
	if code, _ := get("/envs", "secret-token"); code != 401 {
		t.Errorf("old token still accepted: %d", code)
	}
	if code, _ := get("/envs", "new-token"); code != 200 {
		t.Errorf("new token refused: %d", code)
	}
}

func TestInitSetsTokenOnce(t *testing.T) {
	e := startServer(t, Config{})
	body := `{"accessToken":"abc","defaultUser":"root","defaultWorkdir":"/tmp","envVars":{"K":"V"}}`
	res, err := http.Post(e.base+"/init", "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	res.Body.Close()
	if res.StatusCode != 204 {
		t.Fatalf("init: %d", res.StatusCode)
	}
	res, _ = http.Get(e.base + "/envs")
	res.Body.Close()
	if res.StatusCode != 401 {
		t.Fatalf("token not enforced after init: %d", res.StatusCode)
	}
	e.token = "abc"
	st, err := e.proc(false).Start(context.Background(), connect.NewRequest(startReq("pwd")))
	if err != nil {
		t.Fatal(err)
	}
	if r := collect(t, st); r.stdout != "/tmp\n" {
		t.Fatalf("default workdir not used: %q", r.stdout)
	}
	// Whoever holds the token may clear it (a non-secure sandbox made
	// from a secure one's snapshot); without it, nobody may.
	req, _ := http.NewRequest(http.MethodPost, e.base+"/init", strings.NewReader(`{"accessToken":""}`))
	if res, err := http.DefaultClient.Do(req); err != nil || res.StatusCode != 401 {
		t.Fatalf("token cleared without the token: %d", res.StatusCode)
	}
	req, _ = http.NewRequest(http.MethodPost, e.base+"/init", strings.NewReader(`{"accessToken":""}`))
	req.Header.Set("X-Access-Token", "abc")
	if res, err := http.DefaultClient.Do(req); err != nil || res.StatusCode != 204 {
		t.Fatalf("clear the token: %v %v", res, err)
	}
	res, _ = http.Get(e.base + "/envs")
	res.Body.Close()
	if res.StatusCode != 200 {
		t.Fatalf("cleared token still enforced: %d", res.StatusCode)
	}
}

func TestMetricsAndHealth(t *testing.T) {
	e := startServer(t, Config{})
	res, b := e.do(mustReq(http.MethodGet, e.base+"/metrics"))
	var m map[string]any
	if res.StatusCode != 200 || json.Unmarshal(b, &m) != nil {
		t.Fatalf("metrics %d %s", res.StatusCode, b)
	}
	for _, k := range []string{"ts", "cpu_count", "mem_total", "mem_used", "disk_total", "disk_used"} {
		if v, ok := m[k].(float64); !ok || v <= 0 {
			t.Errorf("metric %s = %v", k, m[k])
		}
	}
	if _, ok := m["cpu_used_pct"].(float64); !ok {
		t.Errorf("cpu_used_pct missing")
	}
	res, _ = e.do(mustReq(http.MethodGet, e.base+"/health"))
	if res.StatusCode != 204 {
		t.Errorf("health %d", res.StatusCode)
	}
	res, b = e.do(mustReq(http.MethodGet, e.base+"/nope"))
	if res.StatusCode != 404 || !strings.Contains(string(b), `"code":404`) {
		t.Errorf("unknown route %d %s", res.StatusCode, b)
	}
}

func mustReq(method, u string) *http.Request {
	r, err := http.NewRequest(method, u, nil)
	if err != nil {
		panic(err)
	}
	return r
}

func TestH2C(t *testing.T) {
	e := startServer(t, Config{})
	e.httpc = h2cClient()
	st, err := e.proc(false).Start(context.Background(), connect.NewRequest(startReq("bash", "-c", "echo over-h2c")))
	if err != nil {
		t.Fatal(err)
	}
	if r := collect(t, st); r.stdout != "over-h2c\n" {
		t.Fatalf("h2c stdout %q", r.stdout)
	}
	res, err := e.httpc.Get(e.base + "/health")
	if err != nil {
		t.Fatal(err)
	}
	res.Body.Close()
	if res.ProtoMajor != 2 || res.StatusCode != 204 {
		t.Fatalf("h2c health: %s %d", res.Proto, res.StatusCode)
	}
}

const testUser = "envdtestuser"

// ensureTestUser creates a throwaway account when running as root.
func ensureTestUser(t *testing.T) *user.User {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root")
	}
	if u, err := user.Lookup(testUser); err == nil {
		return u
	}
	if _, err := exec.LookPath("useradd"); err != nil {
		t.Skip("useradd not available")
	}
	if out, err := exec.Command("useradd", "-m", "-s", "/bin/bash", testUser).CombinedOutput(); err != nil {
		t.Skipf("useradd: %v %s", err, out)
	}
	t.Cleanup(func() {
		if out, err := exec.Command("userdel", "-r", testUser).CombinedOutput(); err != nil {
			t.Logf("userdel: %v %s", err, out)
		}
	})
	u, err := user.Lookup(testUser)
	if err != nil {
		t.Fatal(err)
	}
	return u
}

func basicAuth(name string) string {
	return "Basic " + base64.StdEncoding.EncodeToString([]byte(name+":"))
}

func TestRunAsUser(t *testing.T) {
	u := ensureTestUser(t)
	e := startServer(t, Config{})
	e.headers.Set("Authorization", basicAuth(testUser))
	st, err := e.proc(false).Start(context.Background(), connect.NewRequest(startReq("/bin/bash", "-l", "-c", `id -un; id -u; pwd; echo "$HOME $USER"`)))
	if err != nil {
		t.Fatal(err)
	}
	r := collect(t, st)
	want := fmt.Sprintf("%s\n%s\n%s\n%s %s\n", testUser, u.Uid, u.HomeDir, u.HomeDir, testUser)
	if r.stdout != want {
		t.Fatalf("got %q want %q (stderr %q)", r.stdout, want, r.stderr)
	}

	// Relative paths resolve against the user's home; created dirs are theirs.
	fc := e.fs(false)
	mk, err := fc.MakeDir(context.Background(), connect.NewRequest(&filesystempb.MakeDirRequest{Path: "proj/src"}))
	if err != nil {
		t.Fatal(err)
	}
	if mk.Msg.GetEntry().GetPath() != filepath.Join(u.HomeDir, "proj/src") || mk.Msg.GetEntry().GetOwner() != testUser {
		t.Errorf("makedir as user: %v", mk.Msg.GetEntry())
	}
	for _, d := range []string{"proj", "proj/src"} {
		fi, err := os.Stat(filepath.Join(u.HomeDir, d))
		if err != nil || strconv.Itoa(int(fi.Sys().(*syscall.Stat_t).Uid)) != u.Uid {
			t.Errorf("%s not owned by user: %v", d, err)
		}
	}

	// Upload via username query: file and parents owned by the user.
	req, _ := http.NewRequest(http.MethodPost, e.filesURL(url.Values{"path": {"up/a.txt"}, "username": {testUser}}), strings.NewReader("mine"))
	req.Header.Set("Content-Type", "application/octet-stream")
	res, b := e.do(req)
	if res.StatusCode != 200 || !strings.Contains(string(b), filepath.Join(u.HomeDir, "up/a.txt")) {
		t.Fatalf("upload as user: %d %s", res.StatusCode, b)
	}
	for _, p := range []string{"up", "up/a.txt"} {
		fi, err := os.Stat(filepath.Join(u.HomeDir, p))
		if err != nil || strconv.Itoa(int(fi.Sys().(*syscall.Stat_t).Uid)) != u.Uid {
			t.Errorf("%s not owned by user: %v", p, err)
		}
	}
	// A root-only file is not readable by the user.
	secret := filepath.Join(t.TempDir(), "secret")
	os.WriteFile(secret, []byte("x"), 0o600)
	req, _ = http.NewRequest(http.MethodGet, e.filesURL(url.Values{"path": {secret}, "username": {testUser}}), nil)
	if res, _ := e.do(req); res.StatusCode != http.StatusForbidden {
		t.Errorf("user read of root-only file: %d", res.StatusCode)
	}
	// Escapes: a path climbing out of the home, and symlinks the user made
	// in their home pointing at root's files, read and write nothing the
	// user could not.
	rootOwned := filepath.Join(t.TempDir(), "root-owned")
	os.WriteFile(rootOwned, []byte("root's\n"), 0o644)
	// Let the user reach both files, so only their own modes protect them.
	for _, f := range []string{secret, rootOwned} {
		os.Chmod(filepath.Dir(f), 0o755)
		os.Chmod(filepath.Dir(filepath.Dir(f)), 0o755)
	}
	os.Symlink(secret, filepath.Join(u.HomeDir, "to-secret"))
	os.Symlink(rootOwned, filepath.Join(u.HomeDir, "to-root-owned"))
	for _, tc := range []struct {
		name, method, path string
	}{
		{"read through ..", http.MethodGet, "up/../../../.." + secret},
		{"read through a symlink", http.MethodGet, "to-secret"},
		{"write through a symlink", http.MethodPost, "to-root-owned"},
		{"write through ..", http.MethodPost, "../../../.." + rootOwned},
	} {
		req, _ := http.NewRequest(tc.method, e.filesURL(url.Values{"path": {tc.path}, "username": {testUser}}), strings.NewReader("overwritten"))
		req.Header.Set("Content-Type", "application/octet-stream")
		if res, b := e.do(req); res.StatusCode != http.StatusForbidden {
			t.Errorf("%s: %d %s", tc.name, res.StatusCode, b)
		}
	}
	if b, _ := os.ReadFile(rootOwned); string(b) != "root's\n" {
		t.Errorf("the user overwrote a root file: %q", b)
	}
	// Unknown user.
	e.headers.Set("Authorization", basicAuth("no-such-user-xyz"))
	if _, err := e.proc(false).List(context.Background(), connect.NewRequest(&processpb.ListRequest{})); err != nil {
		t.Errorf("list does not depend on user: %v", err)
	}
	st, err = e.proc(false).Start(context.Background(), connect.NewRequest(startReq("true")))
	if err == nil {
		st.Receive()
		err = st.Err()
	}
	if connect.CodeOf(err) != connect.CodeUnauthenticated {
		t.Errorf("unknown user: %v", err)
	}

	// Default user via /init applies when no header is sent.
	e.headers.Del("Authorization")
	res, err = http.Post(e.base+"/init", "application/json", strings.NewReader(`{"defaultUser":"`+testUser+`"}`))
	if err != nil {
		t.Fatal(err)
	}
	res.Body.Close()
	st, err = e.proc(false).Start(context.Background(), connect.NewRequest(startReq("id", "-un")))
	if err != nil {
		t.Fatal(err)
	}
	if r := collect(t, st); r.stdout != testUser+"\n" {
		t.Errorf("default user: %q", r.stdout)
	}
}

func TestShutdownEndsStreams(t *testing.T) {
	s, err := NewServer(Config{})
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Serve(ctx, ln) }()
	pc := processpbconnect.NewProcessClient(http.DefaultClient, "http://"+ln.Addr().String(), connect.WithProtoJSON())
	st, err := pc.Start(context.Background(), connect.NewRequest(startReq("sleep", "300")))
	if err != nil {
		t.Fatal(err)
	}
	if !st.Receive() {
		t.Fatal(st.Err())
	}
	pid := int(st.Msg().GetEvent().GetStart().GetPid())
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("Serve returned %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Serve did not return after cancel")
	}
	for st.Receive() {
	}
	time.Sleep(100 * time.Millisecond)
	if err := syscall.Kill(pid, 0); err == nil {
		t.Errorf("process %d still alive after shutdown", pid)
	}
}

func TestCORSAndBadInput(t *testing.T) {
	e := startServer(t, Config{AccessToken: "tok"})
	req, _ := http.NewRequest(http.MethodOptions, e.base+"/process.Process/Start", nil)
	req.Header.Set("Origin", "https://example.com")
	req.Header.Set("Access-Control-Request-Method", "POST")
	req.Header.Set("Access-Control-Request-Headers", "x-access-token,content-type")
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	res.Body.Close()
	if res.StatusCode != 204 || res.Header.Get("Access-Control-Allow-Origin") != "*" || !strings.Contains(res.Header.Get("Access-Control-Allow-Headers"), "x-access-token") {
		t.Errorf("preflight: %d %v", res.StatusCode, res.Header)
	}
	fc := e.fs(false)
	if _, err := fc.Remove(context.Background(), connect.NewRequest(&filesystempb.RemoveRequest{Path: ""})); connect.CodeOf(err) != connect.CodeInvalidArgument {
		t.Errorf("remove empty path: %v", err)
	}
	if _, err := fc.Stat(context.Background(), connect.NewRequest(&filesystempb.StatRequest{Path: "/tmp/\x00bad"})); connect.CodeOf(err) != connect.CodeInvalidArgument {
		t.Errorf("NUL path: %v", err)
	}
	if _, err := fc.Stat(context.Background(), connect.NewRequest(&filesystempb.StatRequest{Path: "/" + strings.Repeat("x", 5000)})); connect.CodeOf(err) != connect.CodeInvalidArgument {
		t.Errorf("long path: %v", err)
	}
	// Odd /files requests do not crash and answer JSON errors.
	for _, u := range []string{"/files", "/files?path=", "/files?path=%00", "/files?path=/etc/passwd&username=nobody-xyz"} {
		res, b := e.do(mustReq(http.MethodGet, e.base+u))
		if res.StatusCode < 400 || !strings.Contains(string(b), `"code":`) {
			t.Errorf("GET %s: %d %s", u, res.StatusCode, b)
		}
	}
}

func TestFileMetadataAndCompose(t *testing.T) {
	e := startServer(t, Config{})
	root := t.TempDir()
	if err := unixSetxattrProbe(root); err != nil {
		t.Skipf("user xattrs unsupported on %s: %v", root, err)
	}
	p := filepath.Join(root, "m.txt")
	upload := func(hdr map[string]string) (int, []byte) {
		req, _ := http.NewRequest(http.MethodPost, e.filesURL(url.Values{"path": {p}}), strings.NewReader("data"))
		req.Header.Set("Content-Type", "application/octet-stream")
		for k, v := range hdr {
			req.Header.Set(k, v)
		}
		res, b := e.do(req)
		return res.StatusCode, b
	}
	code, b := upload(map[string]string{"X-Metadata-Owner": "alice", "X-Metadata-stage": "raw"})
	if code != 200 || !strings.Contains(string(b), `"metadata":{"owner":"alice","stage":"raw"}`) {
		t.Fatalf("upload with metadata: %d %s", code, b)
	}
	st, err := e.fs(false).Stat(context.Background(), connect.NewRequest(&filesystempb.StatRequest{Path: p}))
	if err != nil {
		t.Fatal(err)
	}
	if md := st.Msg.GetEntry().GetMetadata(); len(md) != 2 || md["owner"] != "alice" || md["stage"] != "raw" {
		t.Fatalf("stat metadata %v", md)
	}
	// A new upload replaces the set; none clears it.
	if code, _ := upload(map[string]string{"X-Metadata-Stage": "done"}); code != 200 {
		t.Fatal(code)
	}
	if md := readMetadata(p); len(md) != 1 || md["stage"] != "done" {
		t.Fatalf("after replace %v", md)
	}
	if code, _ := upload(nil); code != 200 || readMetadata(p) != nil {
		t.Fatalf("metadata not cleared: %d %v", code, readMetadata(p))
	}
	if code, b := upload(map[string]string{"X-Metadata-Big": strings.Repeat("v", 5000)}); code != 400 {
		t.Fatalf("oversized metadata: %d %s", code, b)
	}

	// Compose.
	a, b2 := filepath.Join(root, "part1"), filepath.Join(root, "part2")
	os.WriteFile(a, []byte("hello "), 0o644)
	os.WriteFile(b2, []byte("world"), 0o644)
	dst := filepath.Join(root, "out", "joined.txt")
	body, _ := json.Marshal(composeRequest{Destination: dst, SourcePaths: []string{a, b2}})
	res, rb := e.do(mustBodyReq(http.MethodPost, e.base+"/files/compose", body))
	if res.StatusCode != 200 || !strings.Contains(string(rb), `"path":"`+dst+`"`) {
		t.Fatalf("compose: %d %s", res.StatusCode, rb)
	}
	if got, _ := os.ReadFile(dst); string(got) != "hello world" {
		t.Fatalf("composed %q", got)
	}
	if _, err := os.Stat(a); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("source not deleted")
	}
	body, _ = json.Marshal(composeRequest{Destination: dst, SourcePaths: []string{a}})
	if res, rb := e.do(mustBodyReq(http.MethodPost, e.base+"/files/compose", body)); res.StatusCode != 404 {
		t.Errorf("compose missing source: %d %s", res.StatusCode, rb)
	}
}

func mustBodyReq(method, u string, body []byte) *http.Request {
	r, err := http.NewRequest(method, u, bytes.NewReader(body))
	if err != nil {
		panic(err)
	}
	r.Header.Set("Content-Type", "application/json")
	return r
}

func unixSetxattrProbe(dir string) error {
	f := filepath.Join(dir, ".xattr-probe")
	if err := os.WriteFile(f, nil, 0o644); err != nil {
		return err
	}
	defer os.Remove(f)
	return replaceMetadata(f, map[string]string{"probe": "1"})
}

func TestKeepaliveAndConnectData(t *testing.T) {
	e := startServer(t, Config{})
	e.headers.Set("Keepalive-Ping-Interval", "1")
	pc := e.proc(false)
	ctx := context.Background()
	st, err := pc.Start(ctx, connect.NewRequest(startReq("bash", "-c", "sleep 1; echo late; sleep 2")))
	if err != nil {
		t.Fatal(err)
	}
	if !st.Receive() {
		t.Fatal(st.Err())
	}
	pid := st.Msg().GetEvent().GetStart().GetPid()
	cst, err := pc.Connect(ctx, connect.NewRequest(&processpb.ConnectRequest{Process: &processpb.ProcessSelector{Selector: &processpb.ProcessSelector_Pid{Pid: pid}}}))
	if err != nil {
		t.Fatal(err)
	}
	keepalives := 0
	var out string
	var end *processpb.ProcessEvent_EndEvent
	for cst.Receive() {
		ev := cst.Msg().GetEvent()
		if ev.GetKeepalive() != nil {
			keepalives++
		}
		out += string(ev.GetData().GetStdout())
		if ev.GetEnd() != nil {
			end = ev.GetEnd()
		}
	}
	if cst.Err() != nil || end == nil || end.GetExitCode() != 0 {
		t.Fatalf("connect stream: err %v end %v", cst.Err(), end)
	}
	if out != "late\n" {
		t.Errorf("connect stdout %q", out)
	}
	if keepalives < 2 {
		t.Errorf("got %d keepalives in ~3s with a 1s interval", keepalives)
	}
	if r := collect(t, st); r.stdout != "late\n" {
		t.Errorf("start stdout %q", r.stdout)
	}
}

func TestHandlerServesH2CWhenMounted(t *testing.T) {
	s, err := NewServer(Config{})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ts := httptest.NewUnstartedServer(s.Handler())
	ts.Config.Protocols = new(http.Protocols)
	ts.Config.Protocols.SetHTTP1(true)
	ts.Config.Protocols.SetUnencryptedHTTP2(true)
	ts.Start()
	defer ts.Close()
	c := h2cClient()
	pc := processpbconnect.NewProcessClient(c, ts.URL, connect.WithProtoJSON())
	st, err := pc.Start(context.Background(), connect.NewRequest(startReq("echo", "mounted")))
	if err != nil {
		t.Fatal(err)
	}
	if r := collect(t, st); r.stdout != "mounted\n" {
		t.Fatalf("stdout %q", r.stdout)
	}
}

// h2cClient speaks only cleartext HTTP/2 (prior knowledge), so a test using
// it fails if the server falls back to HTTP/1.1.
func h2cClient() *http.Client {
	var p http.Protocols
	p.SetUnencryptedHTTP2(true)
	return &http.Client{Transport: &http.Transport{Protocols: &p}}
}

// TestTimeoutsEndStreamsWithDeadlineExceeded: a command whose request
// timeout (Connect-Timeout-Ms, set by the client from its deadline, as the
// SDKs' timeouts do) passes ends with deadline_exceeded and is killed; a
// client that only goes away leaves its command running; a watch whose
// timeout passes ends with deadline_exceeded too.
func TestTimeoutsEndStreamsWithDeadlineExceeded(t *testing.T) {
	e := startServer(t, Config{})
	pc := e.proc(false)
	running := func(tag string) bool {
		t.Helper()
		list, err := pc.List(context.Background(), connect.NewRequest(&processpb.ListRequest{}))
		if err != nil {
			t.Fatal(err)
		}
		for _, p := range list.Msg.GetProcesses() {
			if p.GetTag() == tag {
				return true
			}
		}
		return false
	}
	// The timeout is sent as the header alone (the client keeps no
	// deadline of its own), so the error can only be the server's.
	start := func(ctx context.Context, tag, timeoutMs string) *connect.ServerStreamForClient[processpb.StartResponse] {
		t.Helper()
		req := connect.NewRequest(&processpb.StartRequest{
			Process: &processpb.ProcessConfig{Cmd: "bash", Args: []string{"-c", "sleep 30; echo never"}}, Tag: &tag})
		if timeoutMs != "" {
			req.Header().Set("Connect-Timeout-Ms", timeoutMs)
		}
		st, err := pc.Start(ctx, req)
		if err != nil {
			t.Fatal(err)
		}
		return st
	}
	st := start(context.Background(), "timed", "1000")
	for st.Receive() {
	}
	if connect.CodeOf(st.Err()) != connect.CodeDeadlineExceeded {
		t.Fatalf("stream ended with %v, want deadline_exceeded", st.Err())
	}
	// gone waits (up to within) for the command tagged tag to be gone.
	gone := func(tag string, within time.Duration, why string) {
		t.Helper()
		deadline := time.Now().Add(within)
		for running(tag) {
			if time.Now().After(deadline) {
				t.Fatal(why)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	gone("timed", 5*time.Second, "the command outlived its timeout")
	// A client that goes away before its timeout passes: the command
	// still ends when it does (the SDK may close its side first).
	early, leaveEarly := context.WithCancel(context.Background())
	st = start(early, "timed-gone", "1500")
	st.Receive()
	leaveEarly()
	for st.Receive() {
	}
	gone("timed-gone", 6*time.Second, "a command whose client left outlived its timeout")
	// A client that goes away (no timeout): the command runs on.
	away, leave := context.WithCancel(context.Background())
	st = start(away, "left", "")
	st.Receive()
	leave()
	for st.Receive() {
	}
	time.Sleep(300 * time.Millisecond)
	if !running("left") {
		t.Fatal("a command whose client went away was killed")
	}
	// A watch with a timeout.
	wreq := connect.NewRequest(&filesystempb.WatchDirRequest{Path: t.TempDir()})
	wreq.Header().Set("Connect-Timeout-Ms", "1000")
	w, err := e.fs(false).WatchDir(context.Background(), wreq)
	if err != nil {
		t.Fatal(err)
	}
	for w.Receive() {
	}
	if connect.CodeOf(w.Err()) != connect.CodeDeadlineExceeded {
		t.Fatalf("watch ended with %v, want deadline_exceeded", w.Err())
	}
}

// TestFilesDownloadProcFiles: the files of /proc report a size of 0 and
// some cannot seek; a download has their contents all the same.
func TestFilesDownloadProcFiles(t *testing.T) {
	e := startServer(t, Config{AccessToken: "tok"})
	for _, p := range []string{"/proc/version", "/proc/sys/kernel/random/boot_id", "/proc/self/status"} {
		want, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		req, _ := http.NewRequest(http.MethodGet, e.filesURL(url.Values{"path": {p}}), nil)
		res, b := e.do(req)
		if res.StatusCode != 200 || len(b) == 0 {
			t.Fatalf("%s: %d %q", p, res.StatusCode, b)
		}
		if p != "/proc/self/status" && string(b) != string(want) {
			t.Fatalf("%s: %q, want %q", p, b, want)
		}
	}
}
