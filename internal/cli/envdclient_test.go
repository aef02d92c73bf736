package cli

import (
	"context"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"

	"github.com/agentenv/agentenv/internal/envd"
	"github.com/agentenv/agentenv/internal/envd/gen/processpb"
	"github.com/agentenv/agentenv/internal/envd/gen/processpb/processpbconnect"
)

// TestExecStdinThatCannotBeDelivered: `aenv exec -i` against a real envd
// whose input calls fail (a proxy's 503). The run ends with an error that
// says the stdin was cut short, instead of leaving the process waiting for
// input forever; when even the close fails, the process is stopped.
func TestExecStdinThatCannotBeDelivered(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("envd runs processes as its users: needs root")
	}
	tests := []struct {
		name      string
		failClose bool
		want      string
	}{
		{"the input fails, the close reaches it", false, "stdin was cut short after 0 bytes"},
		{"the input and the close fail", true, "could not be delivered, nor closed"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			srv, err := envd.NewServer(envd.Config{})
			if err != nil {
				t.Fatal(err)
			}
			var inputs, closes atomic.Int32
			h := srv.Handler()
			ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				fail := false
				switch {
				case strings.HasSuffix(r.URL.Path, "/SendInput"):
					inputs.Add(1)
					fail = true
				case strings.HasSuffix(r.URL.Path, "/CloseStdin"):
					closes.Add(1)
					fail = tt.failClose
				}
				if fail {
					http.Error(w, "upstream unavailable", http.StatusServiceUnavailable)
					return
				}
				h.ServeHTTP(w, r)
			}))
			defer ts.Close()
			e := &envdConn{base: ts.URL, http: ts.Client(), proc: processpbconnect.NewProcessClient(ts.Client(), ts.URL)}
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			var out strings.Builder
			stdin := true
			req := &processpb.StartRequest{Process: &processpb.ProcessConfig{Cmd: "/bin/sh", Args: []string{"-c", "wc -l"}}, Stdin: &stdin}
			began := time.Now()
			code, err := e.run(ctx, req, strings.NewReader("line one\nline two\n"), &out, &out, true)
			if ctx.Err() != nil {
				t.Fatalf("the run waited until its deadline (exit %d, %v)", code, err)
			}
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("run: exit %d, err %v; want an error with %q", code, err, tt.want)
			}
			if inputs.Load() != 1 || closes.Load() != 1 {
				t.Fatalf("%d input calls, %d closes; want 1 and 1", inputs.Load(), closes.Load())
			}
			// Nothing of it is left running in the guest.
			for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(50 * time.Millisecond) {
				list, err := e.proc.List(context.Background(), connect.NewRequest(&processpb.ListRequest{}))
				if err != nil {
					t.Fatal(err)
				}
				if len(list.Msg.GetProcesses()) == 0 {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("still running: %v", list.Msg.GetProcesses())
				}
			}
			t.Logf("ended in %s: %v (output %q)", time.Since(began).Round(time.Millisecond), err, out.String())
		})
	}
}
