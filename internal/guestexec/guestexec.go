// Package guestexec runs commands in a guest and puts files into it through
// the guest's envd (Connect process API and /files), as the node itself
// needs for template builds and a template's start and ready commands.
package guestexec

import (
	"bufio"
	"bytes"
	"compress/gzip"
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strings"

	"connectrpc.com/connect"

	"github.com/agentenv/agentenv/internal/envd/gen/processpb"
	"github.com/agentenv/agentenv/internal/envd/gen/processpb/processpbconnect"
)

// Target is the envd of one guest: host:port and its access token ("" if
// none).
type Target struct {
	Addr, Token string
}

// Command is a command the node itself runs in a guest.
type Command struct {
	User string // "" : envd's default
	Cwd  string
	Env  map[string]string
	// Script runs with /bin/sh -c.
	Script string
	// Output receives the command's output line by line (stderr marked).
	Output func(line string, stderr bool)
}

// envdHTTP keeps no idle connections: guest addresses are reused by later
// sandboxes, and a pooled connection to a gone guest would be reset by its
// successor.
var envdHTTP = &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}

// Run runs c in the guest and returns its exit code.
func Run(ctx context.Context, g Target, c Command) (int32, error) {
	client := processpbconnect.NewProcessClient(envdHTTP, "http://"+g.Addr, connect.WithProtoJSON())
	cfg := &processpb.ProcessConfig{Cmd: "/bin/sh", Args: []string{"-c", c.Script}, Envs: c.Env}
	if c.Cwd != "" {
		cfg.Cwd = &c.Cwd
	}
	req := connect.NewRequest(&processpb.StartRequest{Process: cfg})
	if g.Token != "" {
		req.Header().Set("X-Access-Token", g.Token)
	}
	if c.User != "" {
		req.Header().Set("Authorization", "Basic "+base64.StdEncoding.EncodeToString([]byte(c.User+":")))
	}
	stream, err := client.Start(ctx, req)
	if err != nil {
		return -1, err
	}
	defer stream.Close()
	var out, errOut lineSplitter
	out.emit = func(l string) {
		if c.Output != nil {
			c.Output(l, false)
		}
	}
	errOut.emit = func(l string) {
		if c.Output != nil {
			c.Output(l, true)
		}
	}
	for stream.Receive() {
		ev := stream.Msg().GetEvent()
		if d := ev.GetData(); d != nil {
			out.write(d.GetStdout())
			errOut.write(d.GetStderr())
		}
		if e := ev.GetEnd(); e != nil {
			out.flush()
			errOut.flush()
			if e.GetError() != "" && e.GetExitCode() == 0 {
				return -1, fmt.Errorf("command ended: %s", e.GetError())
			}
			return e.GetExitCode(), nil
		}
	}
	if err := stream.Err(); err != nil {
		return -1, err
	}
	return -1, errors.New("the command's stream ended without an exit code")
}

// lineSplitter cuts a byte stream into lines.
type lineSplitter struct {
	buf  bytes.Buffer
	emit func(string)
}

func (l *lineSplitter) write(b []byte) {
	l.buf.Write(b)
	for {
		i := bytes.IndexByte(l.buf.Bytes(), '\n')
		if i < 0 {
			return
		}
		l.emit(string(l.buf.Next(i + 1)[:i]))
	}
}

func (l *lineSplitter) flush() {
	if l.buf.Len() > 0 {
		l.emit(l.buf.String())
		l.buf.Reset()
	}
}

// Upload writes a host file into the guest at guestPath (as root) through
// envd's /files endpoint; a gzip-compressed file goes up uncompressed.
func Upload(ctx context.Context, g Target, hostPath, guestPath string) error {
	f, err := os.Open(hostPath)
	if err != nil {
		return err
	}
	defer f.Close()
	// A gzip-compressed file goes up uncompressed.
	var body io.Reader = f
	br := bufio.NewReader(f)
	if magic, err := br.Peek(2); err == nil && magic[0] == 0x1f && magic[1] == 0x8b {
		gz, err := gzip.NewReader(br)
		if err != nil {
			return fmt.Errorf("%s: %w", filepath.Base(hostPath), err)
		}
		defer gz.Close()
		body = gz
	} else {
		body = br
	}
	u := "http://" + g.Addr + "/files?" + url.Values{"path": {guestPath}, "username": {"root"}}.Encode()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, u, body)
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/octet-stream")
	if g.Token != "" {
		req.Header.Set("X-Access-Token", g.Token)
	}
	resp, err := envdHTTP.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode/100 != 2 {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 2048))
		return fmt.Errorf("upload %s to the guest: %s: %s", filepath.Base(hostPath), resp.Status, strings.TrimSpace(string(b)))
	}
	return nil
}

// Quote quotes s for /bin/sh.
func Quote(s string) string { return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'" }
