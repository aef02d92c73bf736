package cli

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"os/signal"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"
	"golang.org/x/term"

	"github.com/agentenv/agentenv/internal/apispec"
	"github.com/agentenv/agentenv/internal/envd/gen/processpb"
	"github.com/agentenv/agentenv/internal/envd/gen/processpb/processpbconnect"
)

// exec, shell and cp talk to the sandbox's envd through the server's (or
// gateway's) sandbox proxy, as the E2B SDKs do: the E2b-Sandbox-Id and
// E2b-Sandbox-Port headers route, X-Access-Token authenticates, and a
// Basic Authorization header names the guest user.

const envdPort = "49983"

// envdConn reaches one sandbox's envd.
type envdConn struct {
	base string
	http *http.Client
	proc processpbconnect.ProcessClient
}

// sandboxTransport adds the routing and auth headers to every request.
type sandboxTransport struct {
	id, token, user string
	next            http.RoundTripper
}

func (t *sandboxTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.Header.Set("E2b-Sandbox-Id", t.id)
	r.Header.Set("E2b-Sandbox-Port", envdPort)
	if t.token != "" {
		r.Header.Set("X-Access-Token", t.token)
	}
	if t.user != "" {
		r.Header.Set("Authorization", "Basic "+basicUser(t.user))
	}
	return t.next.RoundTrip(r)
}

func basicUser(u string) string { return base64.StdEncoding.EncodeToString([]byte(u + ":")) }

// connectSandbox gets a sandbox's envd token (resuming it if paused) and
// returns a connection to its envd.
func connectSandbox(ctx context.Context, c *apiClient, id, user string) (*envdConn, error) {
	var sb apispec.Sandbox
	if err := c.do(ctx, "POST", "/sandboxes/"+url.PathEscape(id)+"/connect", map[string]any{}, &sb); err != nil {
		return nil, err
	}
	token := ""
	if sb.EnvdAccessToken != nil {
		token = *sb.EnvdAccessToken
	}
	hc := &http.Client{Transport: &sandboxTransport{id: id, token: token, user: user, next: http.DefaultTransport}}
	return &envdConn{base: c.base, http: hc, proc: processpbconnect.NewProcessClient(hc, c.base)}, nil
}

func execCmd() *cobra.Command {
	var (
		conn             connection
		user, cwd        string
		env              []string
		stdin, noTimeout bool
	)
	cmd := &cobra.Command{
		Use:   "exec SANDBOX -- COMMAND [ARGS...]",
		Short: "Run a command in a sandbox, streaming its output; exits with the command's exit code",
		Example: `  aenv exec i1a2b3c4d5e6f7g8h9j0 -- uname -a
  aenv exec i1a2b3c4d5e6f7g8h9j0 --user root -- apt-get update
  echo 'print(42)' | aenv exec -i i1a2b3c4d5e6f7g8h9j0 -- python3 -`,
		Args: cobra.MinimumNArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			if cmd.ArgsLenAtDash() != 1 {
				return usageError{errors.New("write the command after `--`: aenv exec SANDBOX -- COMMAND [ARGS...]")}
			}
			envs, err := keyValues("env", env)
			if err != nil {
				return err
			}
			c, err := conn.client()
			if err != nil {
				return err
			}
			ctx, stop := signal.NotifyContext(cmd.Context(), os.Interrupt)
			defer stop()
			e, err := connectSandbox(ctx, c, args[0], user)
			if err != nil {
				return err
			}
			req := &processpb.StartRequest{Process: &processpb.ProcessConfig{Cmd: args[1], Args: args[2:], Envs: envs}}
			if cwd != "" {
				req.Process.Cwd = &cwd
			}
			if stdin {
				req.Stdin = &stdin
			}
			code, err := e.run(ctx, req, cmd.InOrStdin(), cmd.OutOrStdout(), cmd.ErrOrStderr(), stdin)
			if err != nil {
				return err
			}
			if code != 0 {
				return exitCode(code)
			}
			return nil
		},
	}
	conn.flags(cmd)
	cmd.Flags().StringVarP(&user, "user", "u", "", "guest user to run as (default: the template's, usually \"user\")")
	cmd.Flags().StringVarP(&cwd, "cwd", "w", "", "working directory (default: the user's home)")
	cmd.Flags().StringArrayVarP(&env, "env", "e", nil, "environment variable KEY=VALUE (repeatable)")
	cmd.Flags().BoolVarP(&stdin, "interactive", "i", false, "send this command's stdin to the process")
	cmd.Flags().BoolVar(&noTimeout, "no-timeout", false, "ignored (commands run until they end or Ctrl-C)")
	_ = cmd.Flags().MarkHidden("no-timeout")
	return cmd
}

// run starts a process and streams its output until it ends; it returns
// the exit code.
func (e *envdConn) run(ctx context.Context, req *processpb.StartRequest, in io.Reader, stdout, stderr io.Writer, sendStdin bool) (int, error) {
	// A stdin that cannot reach the process ends the run (cause: why).
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	var stdinCut atomic.Pointer[error] // set before the process can see its stdin end early
	stream, err := e.proc.Start(ctx, connect.NewRequest(req))
	if err != nil {
		return 0, err
	}
	defer stream.Close()
	var pid uint32
	for stream.Receive() {
		ev := stream.Msg().GetEvent()
		switch {
		case ev.GetStart() != nil:
			pid = ev.GetStart().GetPid()
			if sendStdin {
				go func() {
					cut := func(err error) { stdinCut.Store(&err) }
					if err := e.pumpStdin(ctx, pid, in, cut); errors.Is(err, errStdinLost) {
						cancel(err) // the process would wait for it forever
					}
				}()
			}
			if ctx.Done() != nil {
				go func() {
					<-ctx.Done()
					sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
					defer cancel()
					e.proc.SendSignal(sctx, connect.NewRequest(&processpb.SendSignalRequest{
						Process: &processpb.ProcessSelector{Selector: &processpb.ProcessSelector_Pid{Pid: pid}},
						Signal:  processpb.Signal_SIGNAL_SIGTERM}))
				}()
			}
		case ev.GetData() != nil:
			d := ev.GetData()
			stdout.Write(d.GetStdout())
			stdout.Write(d.GetPty())
			stderr.Write(d.GetStderr())
		case ev.GetEnd() != nil:
			end := ev.GetEnd()
			if end.Error != nil && *end.Error != "" && !end.GetExited() {
				return 0, fmt.Errorf("the command did not run: %s", *end.Error)
			}
			if err := stdinCut.Load(); err != nil {
				// What the process read ended early: its exit code is not
				// the answer to the input it was given.
				return 0, *err
			}
			return int(end.GetExitCode()), nil
		}
	}
	if cause := context.Cause(ctx); errors.Is(cause, errStdinLost) {
		return 0, cause
	}
	if err := stream.Err(); err != nil {
		if ctx.Err() != nil {
			return 130, nil
		}
		return 0, err
	}
	return 0, errors.New("the process stream ended without an exit code")
}

// errStdinLost: neither the input nor its end reached the process, which
// is left waiting for it.
var errStdinLost = errors.New("the command's stdin could not be delivered, nor closed")

// pumpStdin sends in to the process, then closes its stdin. When a send
// (or reading in) fails, cut hears why and the stdin is closed at once, so
// that the process reads an end instead of waiting for input that will not
// come; the error is errStdinLost when the close failed too. A process that
// has ended (it stopped reading) is no error.
func (e *envdConn) pumpStdin(ctx context.Context, pid uint32, in io.Reader, cut func(error)) error {
	sel := &processpb.ProcessSelector{Selector: &processpb.ProcessSelector_Pid{Pid: pid}}
	closeStdin := func(why error) error {
		if why != nil {
			cut(why)
		}
		_, err := e.proc.CloseStdin(ctx, connect.NewRequest(&processpb.CloseStdinRequest{Process: sel}))
		if err == nil || connect.CodeOf(err) == connect.CodeNotFound {
			return nil
		}
		if why != nil {
			return fmt.Errorf("%w: %v; closing it: %v", errStdinLost, why, err)
		}
		return fmt.Errorf("%w: closing it: %v", errStdinLost, err)
	}
	buf := make([]byte, 32<<10)
	var sent int64
	for {
		n, err := in.Read(buf)
		if n > 0 {
			if _, serr := e.proc.SendInput(ctx, connect.NewRequest(&processpb.SendInputRequest{Process: sel,
				Input: &processpb.ProcessInput{Input: &processpb.ProcessInput_Stdin{Stdin: append([]byte(nil), buf[:n]...)}}})); serr != nil {
				if connect.CodeOf(serr) == connect.CodeNotFound || ctx.Err() != nil {
					return nil // the process ended, or the run was stopped
				}
				return closeStdin(fmt.Errorf("the command's stdin was cut short after %d bytes: %w", sent, serr))
			}
			sent += int64(n)
		}
		switch {
		case err == io.EOF:
			return closeStdin(nil)
		case err != nil:
			return closeStdin(fmt.Errorf("the command's stdin was cut short after %d bytes: reading it: %w", sent, err))
		}
	}
}

func shellCmd() *cobra.Command {
	var (
		conn       connection
		user, cwd  string
		shell      string
		ptyCommand []string
	)
	cmd := &cobra.Command{
		Use:   "shell SANDBOX",
		Short: "Open an interactive shell (a terminal) in a sandbox",
		Example: `  aenv shell i1a2b3c4d5e6f7g8h9j0
  aenv shell i1a2b3c4d5e6f7g8h9j0 --user root`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := conn.client()
			if err != nil {
				return err
			}
			ctx := cmd.Context()
			e, err := connectSandbox(ctx, c, args[0], user)
			if err != nil {
				return err
			}
			ptyCommand = []string{shell, "-l"}
			code, err := e.shell(ctx, ptyCommand, cwd)
			if err != nil {
				return err
			}
			if code != 0 {
				return exitCode(code)
			}
			return nil
		},
	}
	conn.flags(cmd)
	cmd.Flags().StringVarP(&user, "user", "u", "", "guest user (default: the template's)")
	cmd.Flags().StringVarP(&cwd, "cwd", "w", "", "working directory")
	cmd.Flags().StringVar(&shell, "shell", "/bin/bash", "the shell to run")
	return cmd
}

// shell runs argv on a pseudo-terminal in the sandbox, wired to this
// terminal (raw mode, window size changes passed on).
func (e *envdConn) shell(ctx context.Context, argv []string, cwd string) (int, error) {
	in, out := os.Stdin, os.Stdout
	cols, rows := uint32(80), uint32(24)
	interactive := isTerminal(in)
	if w, h, err := term.GetSize(int(out.Fd())); err == nil {
		cols, rows = uint32(w), uint32(h)
	}
	envs := map[string]string{"TERM": os.Getenv("TERM")}
	if envs["TERM"] == "" {
		envs["TERM"] = "xterm-256color"
	}
	req := &processpb.StartRequest{
		Process: &processpb.ProcessConfig{Cmd: argv[0], Args: argv[1:], Envs: envs},
		Pty:     &processpb.PTY{Size: &processpb.PTY_Size{Cols: cols, Rows: rows}},
	}
	if cwd != "" {
		req.Process.Cwd = &cwd
	}
	if interactive {
		old, err := term.MakeRaw(int(in.Fd()))
		if err != nil {
			return 0, err
		}
		defer term.Restore(int(in.Fd()), old)
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := e.proc.Start(ctx, connect.NewRequest(req))
	if err != nil {
		return 0, err
	}
	defer stream.Close()
	for stream.Receive() {
		ev := stream.Msg().GetEvent()
		switch {
		case ev.GetStart() != nil:
			sel := &processpb.ProcessSelector{Selector: &processpb.ProcessSelector_Pid{Pid: ev.GetStart().GetPid()}}
			go e.pumpPTY(ctx, sel, in)
			go e.watchResize(ctx, sel, out)
		case ev.GetData() != nil:
			out.Write(ev.GetData().GetPty())
			out.Write(ev.GetData().GetStdout())
		case ev.GetEnd() != nil:
			return int(ev.GetEnd().GetExitCode()), nil
		}
	}
	if err := stream.Err(); err != nil && ctx.Err() == nil {
		return 0, err
	}
	return 0, nil
}

// pumpPTY sends keystrokes to the pseudo-terminal.
func (e *envdConn) pumpPTY(ctx context.Context, sel *processpb.ProcessSelector, in io.Reader) {
	buf := make([]byte, 4096)
	for {
		n, err := in.Read(buf)
		if n > 0 {
			if _, serr := e.proc.SendInput(ctx, connect.NewRequest(&processpb.SendInputRequest{Process: sel,
				Input: &processpb.ProcessInput{Input: &processpb.ProcessInput_Pty{Pty: append([]byte(nil), buf[:n]...)}}})); serr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

// watchResize passes this terminal's size changes on to the
// pseudo-terminal.
func (e *envdConn) watchResize(ctx context.Context, sel *processpb.ProcessSelector, out *os.File) {
	ch := make(chan os.Signal, 1)
	signal.Notify(ch, syscall.SIGWINCH)
	defer signal.Stop(ch)
	for {
		select {
		case <-ctx.Done():
			return
		case <-ch:
			w, h, err := term.GetSize(int(out.Fd()))
			if err != nil {
				continue
			}
			e.proc.Update(ctx, connect.NewRequest(&processpb.UpdateRequest{Process: sel,
				Pty: &processpb.PTY{Size: &processpb.PTY_Size{Cols: uint32(w), Rows: uint32(h)}}}))
		}
	}
}

func cpCmd() *cobra.Command {
	var (
		conn connection
		user string
	)
	cmd := &cobra.Command{
		Use:   "cp SOURCE DEST",
		Short: "Copy a file into or out of a sandbox (SANDBOX:PATH on one side; - is stdin/stdout)",
		Example: `  aenv cp ./data.csv i1a2b3c4d5e6f7g8h9j0:/home/user/data.csv
  aenv cp i1a2b3c4d5e6f7g8h9j0:/home/user/out.json ./out.json
  tar cz src | aenv cp - i1a2b3c4d5e6f7g8h9j0:/tmp/src.tgz`,
		Args: cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			srcID, srcPath, srcRemote := splitRemote(args[0])
			dstID, dstPath, dstRemote := splitRemote(args[1])
			if srcRemote == dstRemote {
				return usageError{errors.New("exactly one side must be SANDBOX:PATH")}
			}
			c, err := conn.client()
			if err != nil {
				return err
			}
			ctx := cmd.Context()
			if dstRemote {
				e, err := connectSandbox(ctx, c, dstID, user)
				if err != nil {
					return err
				}
				var src io.Reader = cmd.InOrStdin()
				if srcPath != "-" {
					f, err := os.Open(srcPath)
					if err != nil {
						return err
					}
					defer f.Close()
					if st, err := f.Stat(); err == nil && st.IsDir() {
						return usageError{fmt.Errorf("%s is a directory: copy an archive of it (tar cz DIR | aenv cp - ID:PATH)", srcPath)}
					}
					src = f
				}
				return e.upload(ctx, dstPath, src)
			}
			e, err := connectSandbox(ctx, c, srcID, user)
			if err != nil {
				return err
			}
			if dstPath == "-" {
				return e.download(ctx, srcPath, cmd.OutOrStdout())
			}
			tmp, err := os.CreateTemp(dirOf(dstPath), ".aenv-cp-")
			if err != nil {
				return err
			}
			defer os.Remove(tmp.Name())
			if err := e.download(ctx, srcPath, tmp); err != nil {
				tmp.Close()
				return err
			}
			if err := tmp.Close(); err != nil {
				return err
			}
			if err := os.Chmod(tmp.Name(), 0o644); err != nil {
				return err
			}
			return os.Rename(tmp.Name(), dstPath)
		},
	}
	conn.flags(cmd)
	cmd.Flags().StringVarP(&user, "user", "u", "", "guest user owning the written file (default: the template's)")
	return cmd
}

func dirOf(p string) string {
	if i := strings.LastIndexByte(p, os.PathSeparator); i >= 0 {
		return p[:i+1]
	}
	return "."
}

// splitRemote parses SANDBOX:PATH (a local path has no colon before its
// first slash).
func splitRemote(arg string) (id, path string, remote bool) {
	i := strings.IndexByte(arg, ':')
	if i <= 0 || strings.ContainsRune(arg[:i], '/') {
		return "", arg, false
	}
	return arg[:i], arg[i+1:], true
}

func (e *envdConn) upload(ctx context.Context, path string, body io.Reader) error {
	req, err := http.NewRequestWithContext(ctx, "POST", e.base+"/files?path="+url.QueryEscape(path), body)
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/octet-stream")
	resp, err := e.http.Do(req)
	if err != nil {
		return err
	}
	return decodeResponse(resp, "POST", "/files?path="+path, nil)
}

func (e *envdConn) download(ctx context.Context, path string, w io.Writer) error {
	req, err := http.NewRequestWithContext(ctx, "GET", e.base+"/files?path="+url.QueryEscape(path), nil)
	if err != nil {
		return err
	}
	resp, err := e.http.Do(req)
	if err != nil {
		return err
	}
	if resp.StatusCode != http.StatusOK {
		return decodeResponse(resp, "GET", "/files?path="+path, nil)
	}
	defer resp.Body.Close()
	_, err = io.Copy(w, resp.Body)
	return err
}
