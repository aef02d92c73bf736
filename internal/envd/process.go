package envd

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"connectrpc.com/connect"
	"github.com/creack/pty"
	"google.golang.org/protobuf/proto"

	"github.com/agentenv/agentenv/internal/envd/gen/processpb"
	"github.com/agentenv/agentenv/internal/envd/gen/processpb/processpbconnect"
)

const (
	// keepaliveHeader carries the client's desired keepalive period in seconds.
	keepaliveHeader         = "Keepalive-Ping-Interval"
	defaultKeepalive        = 50 * time.Second
	readChunk               = 32 << 10
	subscriberBuffer        = 256
	outputDrainAfterExitFor = 250 * time.Millisecond
	// maxDrainReads bounds the reads of output already buffered once the
	// drain's deadline has passed (a pipe holds 64 KiB, a pty less).
	maxDrainReads = 64
	// inputWriteTimeout bounds how long SendInput waits for a process that
	// does not read its input.
	inputWriteTimeout = 30 * time.Second
)

// processManager tracks the processes started through process.Process.
type processManager struct {
	s     *Server
	mu    sync.Mutex
	procs map[uint32]*proc
}

func newProcessManager(s *Server) *processManager {
	return &processManager{s: s, procs: map[uint32]*proc{}}
}

// proc is one running process and its event fan-out.
type proc struct {
	pid  uint32
	tag  *string
	cfg  *processpb.ProcessConfig
	cmd  *exec.Cmd
	ptmx *os.File

	stdinMu sync.Mutex
	stdin   *os.File // write end of the stdin pipe; nil when closed or not requested

	mu       sync.Mutex
	subs     map[*subscriber]struct{}
	finished bool
	end      *processpb.ProcessEvent

	exited  atomic.Bool
	readers []*os.File

	// deadline kills the process when the timeout its start request gave
	// passes (Connect-Timeout-Ms), whether or not its client is still
	// there, as upstream envd does.
	deadlineMu sync.Mutex
	deadline   *time.Timer
}

// killAfter kills p (its process group) after d, unless it exits first.
func (p *proc) killAfter(d time.Duration) {
	p.deadlineMu.Lock()
	defer p.deadlineMu.Unlock()
	if p.exited.Load() {
		return
	}
	p.deadline = time.AfterFunc(d, func() {
		p.deadlineMu.Lock()
		defer p.deadlineMu.Unlock()
		if !p.exited.Load() {
			_ = p.signal(syscall.SIGKILL)
		}
	})
}

// exit marks p exited and stops its deadline.
func (p *proc) exit() {
	p.deadlineMu.Lock()
	defer p.deadlineMu.Unlock()
	p.exited.Store(true)
	if p.deadline != nil {
		p.deadline.Stop()
	}
}

// requestTimeout is the timeout a connect request carries
// (Connect-Timeout-Ms), 0 if none.
func requestTimeout(h http.Header) time.Duration {
	ms, err := strconv.ParseInt(h.Get("Connect-Timeout-Ms"), 10, 64)
	if err != nil || ms <= 0 {
		return 0
	}
	return time.Duration(ms) * time.Millisecond
}

type subscriber struct {
	ch   chan *processpb.ProcessEvent
	gone chan struct{}
}

func (p *proc) subscribe() (*subscriber, *processpb.ProcessEvent) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.finished {
		return nil, p.end
	}
	sub := &subscriber{ch: make(chan *processpb.ProcessEvent, subscriberBuffer), gone: make(chan struct{})}
	p.subs[sub] = struct{}{}
	return sub, nil
}

func (p *proc) unsubscribe(sub *subscriber) {
	p.mu.Lock()
	delete(p.subs, sub)
	p.mu.Unlock()
	close(sub.gone)
}

// broadcast hands ev to every subscriber. A subscriber that is alive but
// slow applies back-pressure; one that went away is skipped.
func (p *proc) broadcast(ev *processpb.ProcessEvent) {
	p.mu.Lock()
	subs := make([]*subscriber, 0, len(p.subs))
	for s := range p.subs {
		subs = append(subs, s)
	}
	p.mu.Unlock()
	for _, s := range subs {
		select {
		case s.ch <- ev:
		case <-s.gone:
		}
	}
}

func (p *proc) finish(ev *processpb.ProcessEvent) {
	p.mu.Lock()
	p.finished = true
	p.end = ev
	p.mu.Unlock()
	// New subscribers now get p.end directly; existing ones get it here.
	p.broadcast(ev)
}

func (p *proc) info() *processpb.ProcessInfo {
	return &processpb.ProcessInfo{Config: proto.CloneOf(p.cfg), Pid: p.pid, Tag: p.tag}
}

func (p *proc) signal(sig syscall.Signal) error {
	// Signal the whole process group so children holding the output pipes
	// go too; fall back to the process itself.
	if err := syscall.Kill(-int(p.pid), sig); err == nil {
		return nil
	}
	return p.cmd.Process.Signal(sig)
}

func (m *processManager) get(sel *processpb.ProcessSelector) (*proc, error) {
	if sel == nil {
		return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("process selector is required"))
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	switch v := sel.GetSelector().(type) {
	case *processpb.ProcessSelector_Pid:
		if p, ok := m.procs[v.Pid]; ok {
			return p, nil
		}
		return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("process with pid %d not found", v.Pid))
	case *processpb.ProcessSelector_Tag:
		var found *proc
		for _, p := range m.procs {
			if p.tag != nil && *p.tag == v.Tag && (found == nil || p.pid < found.pid) {
				found = p
			}
		}
		if found != nil {
			return found, nil
		}
		return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("process with tag %q not found", v.Tag))
	default:
		return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("process selector needs a pid or a tag"))
	}
}

func (m *processManager) list() []*processpb.ProcessInfo {
	m.mu.Lock()
	out := make([]*processpb.ProcessInfo, 0, len(m.procs))
	for _, p := range m.procs {
		out = append(out, p.info())
	}
	m.mu.Unlock()
	sort.Slice(out, func(i, j int) bool { return out[i].Pid < out[j].Pid })
	return out
}

func (m *processManager) killAll() {
	m.mu.Lock()
	procs := make([]*proc, 0, len(m.procs))
	for _, p := range m.procs {
		procs = append(procs, p)
	}
	m.mu.Unlock()
	for _, p := range procs {
		_ = p.signal(syscall.SIGKILL)
	}
}

// findExecutable resolves cmd against the PATH of the environment the
// process will get (not envd's own).
func findExecutable(cmd string, env []string) (string, error) {
	if strings.Contains(cmd, "/") {
		return cmd, nil
	}
	pathVal := defaultPath
	for _, kv := range env {
		if v, ok := strings.CutPrefix(kv, "PATH="); ok {
			pathVal = v
		}
	}
	for _, dir := range filepath.SplitList(pathVal) {
		if dir == "" {
			continue
		}
		cand := filepath.Join(dir, cmd)
		if fi, err := os.Stat(cand); err == nil && fi.Mode().IsRegular() && fi.Mode()&0o111 != 0 {
			return cand, nil
		}
	}
	return "", fmt.Errorf("executable %q not found in PATH", cmd)
}

// start launches a process described by req on behalf of u and returns it
// together with a subscriber that already holds the start event.
func (m *processManager) start(req *processpb.StartRequest, u *sysUser) (*proc, *subscriber, error) {
	cfg := req.GetProcess()
	if cfg == nil || cfg.GetCmd() == "" {
		return nil, nil, connect.NewError(connect.CodeInvalidArgument, errors.New("process.cmd is required"))
	}
	m.s.mu.RLock()
	workdir := m.s.defaultWorkdir
	m.s.mu.RUnlock()
	var cwd string
	switch {
	case cfg.Cwd != nil && cfg.GetCwd() != "":
		c, err := resolvePath(cfg.GetCwd(), u)
		if err != nil {
			return nil, nil, connect.NewError(connect.CodeInvalidArgument, err)
		}
		cwd = c
	case workdir != "":
		cwd = workdir
	default:
		cwd = u.Home
	}
	if fi, err := os.Stat(cwd); err != nil || !fi.IsDir() {
		if cfg.Cwd == nil || cfg.GetCwd() == "" {
			cwd = "/" // the account's home may not exist; do not fail for that
		} else {
			return nil, nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("cwd %q is not an existing directory", cwd))
		}
	}

	env := m.s.processEnv(u, cfg.GetEnvs())
	usePty := req.GetPty() != nil
	if usePty && !hasEnv(env, "TERM") {
		env = append(env, "TERM=xterm-256color")
	}
	path, err := findExecutable(cfg.GetCmd(), env)
	if err != nil {
		return nil, nil, connect.NewError(connect.CodeInvalidArgument, err)
	}
	cmd := exec.Command(path, cfg.GetArgs()...)
	cmd.Args[0] = cfg.GetCmd()
	cmd.Env = env
	cmd.Dir = cwd
	attr := &syscall.SysProcAttr{Credential: credential(u)}
	cmd.SysProcAttr = attr

	p := &proc{tag: req.Tag, cmd: cmd, subs: map[*subscriber]struct{}{}}
	p.cfg = proto.CloneOf(cfg)
	p.cfg.Cwd = proto.String(cwd)

	var childEnds []*os.File
	closeAll := func(fs []*os.File) {
		for _, f := range fs {
			if f != nil {
				_ = f.Close()
			}
		}
	}
	if usePty {
		ptmx, tty, err := pty.Open()
		if err != nil {
			return nil, nil, connect.NewError(connect.CodeInternal, fmt.Errorf("open pty: %w", err))
		}
		if sz := req.GetPty().GetSize(); sz != nil && sz.GetCols() > 0 && sz.GetRows() > 0 {
			_ = pty.Setsize(ptmx, &pty.Winsize{Cols: uint16(sz.GetCols()), Rows: uint16(sz.GetRows())})
		}
		cmd.Stdin, cmd.Stdout, cmd.Stderr = tty, tty, tty
		attr.Setsid = true
		attr.Setctty = true
		attr.Ctty = 0
		p.ptmx = ptmx
		p.readers = []*os.File{ptmx}
		childEnds = []*os.File{tty}
	} else {
		attr.Setpgid = true
		outR, outW, err := os.Pipe()
		if err != nil {
			return nil, nil, connect.NewError(connect.CodeInternal, err)
		}
		errR, errW, err := os.Pipe()
		if err != nil {
			closeAll([]*os.File{outR, outW})
			return nil, nil, connect.NewError(connect.CodeInternal, err)
		}
		cmd.Stdout, cmd.Stderr = outW, errW
		p.readers = []*os.File{outR, errR}
		childEnds = []*os.File{outW, errW}
		if req.GetStdin() {
			inR, inW, err := os.Pipe()
			if err != nil {
				closeAll(append(childEnds, p.readers...))
				return nil, nil, connect.NewError(connect.CodeInternal, err)
			}
			cmd.Stdin = inR
			p.stdin = inW
			childEnds = append(childEnds, inR)
		}
	}

	if err := m.s.oom.start(cmd); err != nil {
		closeAll(childEnds)
		closeAll(p.readers)
		if p.stdin != nil {
			_ = p.stdin.Close()
		}
		code := connect.CodeInternal
		if errors.Is(err, os.ErrNotExist) || errors.Is(err, os.ErrPermission) || errors.Is(err, syscall.ENOEXEC) {
			code = connect.CodeInvalidArgument
		}
		return nil, nil, connect.NewError(code, fmt.Errorf("start %q: %w", cfg.GetCmd(), err))
	}
	closeAll(childEnds)
	p.pid = uint32(cmd.Process.Pid)

	sub, _ := p.subscribe()
	p.broadcast(&processpb.ProcessEvent{Event: &processpb.ProcessEvent_Start{Start: &processpb.ProcessEvent_StartEvent{Pid: p.pid}}})

	m.mu.Lock()
	m.procs[p.pid] = p
	m.mu.Unlock()

	var wg sync.WaitGroup
	for i, r := range p.readers {
		kind := i // 0 stdout (or pty), 1 stderr
		wg.Add(1)
		go func() {
			defer wg.Done()
			p.pump(r, kind)
		}()
	}
	go func() {
		werr := cmd.Wait()
		p.exit()
		for _, r := range p.readers {
			if err := r.SetReadDeadline(time.Now().Add(outputDrainAfterExitFor)); err != nil {
				// Not pollable: closing is the only way to stop the reader.
				time.AfterFunc(outputDrainAfterExitFor, func() { _ = r.Close() })
			}
		}
		wg.Wait()
		for _, r := range p.readers {
			_ = r.Close()
		}
		p.stdinMu.Lock()
		if p.stdin != nil {
			_ = p.stdin.Close()
			p.stdin = nil
		}
		p.stdinMu.Unlock()

		end := &processpb.ProcessEvent_EndEvent{}
		if st := cmd.ProcessState; st != nil {
			end.ExitCode = int32(st.ExitCode())
			end.Exited = st.Exited()
			end.Status = st.String()
		}
		var exitErr *exec.ExitError
		if werr != nil && !errors.As(werr, &exitErr) {
			end.Error = proto.String(werr.Error())
		}
		m.mu.Lock()
		if m.procs[p.pid] == p {
			delete(m.procs, p.pid)
		}
		m.mu.Unlock()
		p.finish(&processpb.ProcessEvent{Event: &processpb.ProcessEvent_End{End: end}})
	}()
	return p, sub, nil
}

// pump forwards one output stream as data events. After the process has
// exited it keeps draining while data keeps coming, then stops even if a
// leftover child still holds the write end. What is already in the pipe
// when the drain's deadline passes is still read: a pump that comes back
// to its pipe late (a slow subscriber, a loaded guest) loses nothing the
// process wrote.
func (p *proc) pump(r *os.File, kind int) {
	buf := make([]byte, readChunk)
	for {
		n, err := r.Read(buf)
		if n > 0 {
			p.emit(buf[:n], kind)
			if p.exited.Load() {
				_ = r.SetReadDeadline(time.Now().Add(outputDrainAfterExitFor))
			}
		}
		if errors.Is(err, os.ErrDeadlineExceeded) {
			p.drainBuffered(r, buf, kind)
			return
		}
		if err != nil {
			return
		}
	}
}

// drainBuffered forwards what r holds now, without waiting for more, up to
// a bound (a leftover child writing without pause cannot keep it going).
func (p *proc) drainBuffered(r *os.File, buf []byte, kind int) {
	// A passed deadline fails every read before it is tried; with none,
	// the read below still never waits.
	if r.SetReadDeadline(time.Time{}) != nil {
		return
	}
	rc, err := r.SyscallConn()
	if err != nil {
		return
	}
	for range maxDrainReads {
		var n int
		var rerr error
		// The function reports done after one attempt: RawConn.Read does
		// not wait for readiness, so an empty pipe answers EAGAIN.
		if err := rc.Read(func(fd uintptr) bool {
			n, rerr = syscall.Read(int(fd), buf)
			return true
		}); err != nil || rerr != nil || n <= 0 {
			return
		}
		p.emit(buf[:n], kind)
	}
}

// emit broadcasts one chunk of output (copied) as a data event.
func (p *proc) emit(b []byte, kind int) {
	chunk := append([]byte(nil), b...)
	data := &processpb.ProcessEvent_DataEvent{}
	switch {
	case p.ptmx != nil:
		data.Output = &processpb.ProcessEvent_DataEvent_Pty{Pty: chunk}
	case kind == 1:
		data.Output = &processpb.ProcessEvent_DataEvent_Stderr{Stderr: chunk}
	default:
		data.Output = &processpb.ProcessEvent_DataEvent_Stdout{Stdout: chunk}
	}
	p.broadcast(&processpb.ProcessEvent{Event: &processpb.ProcessEvent_Data{Data: data}})
}

func hasEnv(env []string, key string) bool {
	for _, kv := range env {
		if strings.HasPrefix(kv, key+"=") {
			return true
		}
	}
	return false
}

func keepaliveInterval(h http.Header) time.Duration {
	if v := h.Get(keepaliveHeader); v != "" {
		if n, err := strconv.Atoi(v); err == nil && n > 0 && n <= 3600 {
			return time.Duration(n) * time.Second
		}
	}
	return defaultKeepalive
}

// streamEvents relays sub's events through send until the end event, the
// client going away or the server stopping.
func streamEvents(ctx context.Context, p *proc, sub *subscriber, every time.Duration, send func(*processpb.ProcessEvent) error) error {
	defer p.unsubscribe(sub)
	tick := time.NewTicker(every)
	defer tick.Stop()
	for {
		select {
		case ev := <-sub.ch:
			if err := send(ev); err != nil {
				return err
			}
			if _, ok := ev.GetEvent().(*processpb.ProcessEvent_End); ok {
				return nil
			}
		case <-tick.C:
			if err := send(&processpb.ProcessEvent{Event: &processpb.ProcessEvent_Keepalive{Keepalive: &processpb.ProcessEvent_KeepAlive{}}}); err != nil {
				return err
			}
		case <-ctx.Done():
			return streamEnd(ctx)
		}
	}
}

// streamEnd is how a stream ends when its context does: a client that went
// away gets nothing (there is no one to tell), a deadline the client set
// (Connect-Timeout-Ms: the SDKs' command and watch timeouts) is the
// deadline_exceeded error the SDKs turn into their TimeoutException.
func streamEnd(ctx context.Context) error {
	if errors.Is(ctx.Err(), context.DeadlineExceeded) {
		return connect.NewError(connect.CodeDeadlineExceeded, errors.New("the request's timeout passed"))
	}
	return nil
}

// processService implements process.Process.
type processService struct {
	processpbconnect.UnimplementedProcessHandler
	s *Server
}

func (ps *processService) user(h http.Header) (*sysUser, error) {
	u, err := ps.s.requestUser("", h)
	if err != nil {
		return nil, connect.NewError(connect.CodeUnauthenticated, err)
	}
	return u, nil
}

func (ps *processService) Start(ctx context.Context, req *connect.Request[processpb.StartRequest], stream *connect.ServerStream[processpb.StartResponse]) error {
	u, err := ps.user(req.Header())
	if err != nil {
		return err
	}
	p, sub, err := ps.s.procs.start(req.Msg, u)
	if err != nil {
		return err
	}
	ps.s.log.Debug("process started", "pid", p.pid, "cmd", req.Msg.GetProcess().GetCmd(), "user", u.Name)
	if d := requestTimeout(req.Header()); d > 0 {
		// The command's timeout (as upstream envd): the process goes when
		// it passes, its client connected or not. A client that only
		// disconnects before leaves it running.
		p.killAfter(d)
	}
	return streamEvents(ctx, p, sub, keepaliveInterval(req.Header()), func(ev *processpb.ProcessEvent) error {
		return stream.Send(&processpb.StartResponse{Event: ev})
	})
}

func (ps *processService) Connect(ctx context.Context, req *connect.Request[processpb.ConnectRequest], stream *connect.ServerStream[processpb.ConnectResponse]) error {
	p, err := ps.s.procs.get(req.Msg.GetProcess())
	if err != nil {
		return err
	}
	send := func(ev *processpb.ProcessEvent) error {
		return stream.Send(&processpb.ConnectResponse{Event: ev})
	}
	sub, end := p.subscribe()
	if sub == nil {
		// Finished between lookup and subscription.
		if err := send(&processpb.ProcessEvent{Event: &processpb.ProcessEvent_Start{Start: &processpb.ProcessEvent_StartEvent{Pid: p.pid}}}); err != nil {
			return err
		}
		return send(end)
	}
	if err := send(&processpb.ProcessEvent{Event: &processpb.ProcessEvent_Start{Start: &processpb.ProcessEvent_StartEvent{Pid: p.pid}}}); err != nil {
		p.unsubscribe(sub)
		return err
	}
	return streamEvents(ctx, p, sub, keepaliveInterval(req.Header()), send)
}

func (ps *processService) List(ctx context.Context, req *connect.Request[processpb.ListRequest]) (*connect.Response[processpb.ListResponse], error) {
	return connect.NewResponse(&processpb.ListResponse{Processes: ps.s.procs.list()}), nil
}

func (p *proc) writeInput(in *processpb.ProcessInput) error {
	if in == nil {
		return connect.NewError(connect.CodeInvalidArgument, errors.New("input is required"))
	}
	var data []byte
	switch v := in.GetInput().(type) {
	case *processpb.ProcessInput_Stdin:
		data = v.Stdin
	case *processpb.ProcessInput_Pty:
		data = v.Pty
	default:
		return connect.NewError(connect.CodeInvalidArgument, errors.New("input needs stdin or pty bytes"))
	}
	if p.ptmx != nil {
		_ = p.ptmx.SetWriteDeadline(time.Now().Add(inputWriteTimeout))
		if _, err := p.ptmx.Write(data); err != nil {
			return connect.NewError(connect.CodeInternal, fmt.Errorf("write to pty: %w", err))
		}
		return nil
	}
	p.stdinMu.Lock()
	defer p.stdinMu.Unlock()
	if p.stdin == nil {
		return connect.NewError(connect.CodeFailedPrecondition, errors.New("stdin of the process is not open (start it with stdin enabled)"))
	}
	_ = p.stdin.SetWriteDeadline(time.Now().Add(inputWriteTimeout))
	if _, err := p.stdin.Write(data); err != nil {
		return connect.NewError(connect.CodeInternal, fmt.Errorf("write to stdin: %w", err))
	}
	return nil
}

func (ps *processService) SendInput(ctx context.Context, req *connect.Request[processpb.SendInputRequest]) (*connect.Response[processpb.SendInputResponse], error) {
	p, err := ps.s.procs.get(req.Msg.GetProcess())
	if err != nil {
		return nil, err
	}
	if err := p.writeInput(req.Msg.GetInput()); err != nil {
		return nil, err
	}
	return connect.NewResponse(&processpb.SendInputResponse{}), nil
}

func (ps *processService) StreamInput(ctx context.Context, stream *connect.ClientStream[processpb.StreamInputRequest]) (*connect.Response[processpb.StreamInputResponse], error) {
	var p *proc
	for stream.Receive() {
		msg := stream.Msg()
		switch ev := msg.GetEvent().(type) {
		case *processpb.StreamInputRequest_Start:
			got, err := ps.s.procs.get(ev.Start.GetProcess())
			if err != nil {
				return nil, err
			}
			p = got
		case *processpb.StreamInputRequest_Data:
			if p == nil {
				return nil, connect.NewError(connect.CodeFailedPrecondition, errors.New("input stream must begin with a start event"))
			}
			if err := p.writeInput(ev.Data.GetInput()); err != nil {
				return nil, err
			}
		case *processpb.StreamInputRequest_Keepalive:
		}
	}
	if err := stream.Err(); err != nil && !errors.Is(err, io.EOF) {
		return nil, err
	}
	return connect.NewResponse(&processpb.StreamInputResponse{}), nil
}

func (ps *processService) SendSignal(ctx context.Context, req *connect.Request[processpb.SendSignalRequest]) (*connect.Response[processpb.SendSignalResponse], error) {
	p, err := ps.s.procs.get(req.Msg.GetProcess())
	if err != nil {
		return nil, err
	}
	var sig syscall.Signal
	switch req.Msg.GetSignal() {
	case processpb.Signal_SIGNAL_SIGKILL:
		sig = syscall.SIGKILL
	case processpb.Signal_SIGNAL_SIGTERM:
		sig = syscall.SIGTERM
	default:
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("unsupported signal %v", req.Msg.GetSignal()))
	}
	if err := p.signal(sig); err != nil {
		if errors.Is(err, os.ErrProcessDone) {
			return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("process %d already finished", p.pid))
		}
		return nil, connect.NewError(connect.CodeInternal, err)
	}
	return connect.NewResponse(&processpb.SendSignalResponse{}), nil
}

func (ps *processService) CloseStdin(ctx context.Context, req *connect.Request[processpb.CloseStdinRequest]) (*connect.Response[processpb.CloseStdinResponse], error) {
	p, err := ps.s.procs.get(req.Msg.GetProcess())
	if err != nil {
		return nil, err
	}
	if p.ptmx != nil {
		// A terminal has no separate stdin; send EOF (Ctrl-D) instead.
		if _, err := p.ptmx.Write([]byte{4}); err != nil {
			return nil, connect.NewError(connect.CodeInternal, err)
		}
		return connect.NewResponse(&processpb.CloseStdinResponse{}), nil
	}
	p.stdinMu.Lock()
	if p.stdin != nil {
		_ = p.stdin.Close()
		p.stdin = nil
	}
	p.stdinMu.Unlock()
	return connect.NewResponse(&processpb.CloseStdinResponse{}), nil
}

func (ps *processService) Update(ctx context.Context, req *connect.Request[processpb.UpdateRequest]) (*connect.Response[processpb.UpdateResponse], error) {
	p, err := ps.s.procs.get(req.Msg.GetProcess())
	if err != nil {
		return nil, err
	}
	if sz := req.Msg.GetPty().GetSize(); sz != nil {
		if p.ptmx == nil {
			return nil, connect.NewError(connect.CodeFailedPrecondition, fmt.Errorf("process %d has no pty", p.pid))
		}
		if sz.GetCols() == 0 || sz.GetRows() == 0 || sz.GetCols() > 65535 || sz.GetRows() > 65535 {
			return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("pty size must be between 1 and 65535"))
		}
		if err := pty.Setsize(p.ptmx, &pty.Winsize{Cols: uint16(sz.GetCols()), Rows: uint16(sz.GetRows())}); err != nil {
			return nil, connect.NewError(connect.CodeInternal, fmt.Errorf("resize pty: %w", err))
		}
	}
	return connect.NewResponse(&processpb.UpdateResponse{}), nil
}
