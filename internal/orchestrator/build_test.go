package orchestrator

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/agentenv/agentenv/internal/buildfiles"
	"github.com/agentenv/agentenv/internal/builds"
)

// buildLog collects a build's log lines.
type buildLog struct {
	mu    sync.Mutex
	lines []string
}

func (l *buildLog) log(t *testing.T) builds.Logger {
	return func(level, step, msg string) {
		l.mu.Lock()
		defer l.mu.Unlock()
		l.lines = append(l.lines, level+" ["+step+"] "+msg)
		t.Logf("%s [%s] %s", level, step, msg)
	}
}

func (l *buildLog) has(s string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, line := range l.lines {
		if strings.Contains(line, s) {
			return true
		}
	}
	return false
}

// uploadFiles uploads a COPY step's archive for template the way the API
// does (for a requested build: the node collects the files of templates
// with none), and returns the files hash an SDK would send with it.
func uploadFiles(t *testing.T, n *Node, template, src, dest string, files map[string]string) string {
	t.Helper()
	if !n.builds.Pending(template) {
		if _, err := n.RequestBuild(template, nil, 0, 0); err != nil {
			t.Fatal(err)
		}
	}
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for name, body := range files {
		tw.WriteHeader(&tar.Header{Name: name, Typeflag: tar.TypeReg, Mode: 0o644, Size: int64(len(body))})
		tw.Write([]byte(body))
	}
	tw.Close()
	hash, _, err := buildfiles.Hash(bytes.NewReader(buf.Bytes()), src, dest)
	if err != nil {
		t.Fatal(err)
	}
	if err := n.BuildFiles().Receive(template, hash, bytes.NewReader(buf.Bytes())); err != nil {
		t.Fatal(err)
	}
	return hash
}

// TestBuildTemplate builds a template from `minimal` with ENV, WORKDIR,
// RUN, COPY, a start and a ready command; sandboxes of it have the files,
// the env and the started process; a rebuild with a changed last step
// reuses the layers before it; a failing step fails the build and
// registers nothing.
func TestBuildTemplate(t *testing.T) {
	n := testNode(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	confFiles := uploadFiles(t, n, "built", ".", "/app/files", map[string]string{"conf/app.txt": "copied\n"})
	helloFiles := uploadFiles(t, n, "built", "hello.txt", "h.txt", map[string]string{"hello.txt": "hello file\n"})
	steps := []builds.Step{
		{Type: "ENV", Args: []string{"GREETING", "built-in"}},
		{Type: "WORKDIR", Args: []string{"/app"}},
		{Type: "RUN", Args: []string{"echo $GREETING > out.txt && pwd >> out.txt"}},
		{Type: "COPY", Args: []string{".", "/app/files"}, FilesHash: confFiles},
		{Type: "COPY", Args: []string{"hello.txt", "h.txt", "user", "0600"}, FilesHash: helloFiles},
		{Type: "RUN", Args: []string{"echo v1 > /app/version"}},
	}
	spec := builds.Spec{Template: "built", FromTemplate: "minimal", Steps: steps,
		StartCmd: "echo started > /tmp/started; exec sleep 100000", ReadyCmd: "test -f /tmp/started"}
	var l1 buildLog
	start := time.Now()
	if err := n.builds.Run(ctx, spec, l1.log(t)); err != nil {
		t.Fatal(err)
	}
	t.Logf("first build took %s", time.Since(start))
	s := create(t, n, CreateRequest{TemplateID: "built"})
	if !strings.Contains(strings.Join(phaseNames(s), ","), "envd init") {
		t.Logf("phases %v", s.Phases)
	}
	out, err := newEnvdClient(s).run(ctx, "", "/bin/sh", "-c", "cat /app/out.txt /app/files/conf/app.txt /app/h.txt /app/version /tmp/started; stat -c %a /app/h.txt; echo $GREETING; ps | grep -q '[s]leep 100000' && echo running")
	want := "built-in\n/app\ncopied\nhello file\nv1\nstarted\n600\nbuilt-in\nrunning\n"
	if err != nil || out.stdout != want {
		t.Fatalf("sandbox of the built template: %+v %v, want %q", out, err, want)
	}
	n.Kill(ctx, s.ID)
	// A size its template snapshot does not have boots cold: the start
	// command runs there too.
	cold := create(t, n, CreateRequest{TemplateID: "built", MemoryMiB: s.MemoryMiB + 64})
	if !strings.Contains(strings.Join(phaseNames(cold), ","), "guest boot") {
		t.Fatalf("the other size did not boot cold: phases %v", phaseNames(cold))
	}
	out, err = newEnvdClient(cold).run(ctx, "", "/bin/sh", "-c", "cat /tmp/started; ps | grep -q '[s]leep 100000' && echo running")
	if err != nil || out.stdout != "started\nrunning\n" {
		t.Fatalf("cold-booted sandbox of the built template: %+v %v", out, err)
	}
	n.Kill(ctx, cold.ID)

	// Change the last step: everything before it comes from the cache.
	spec.Steps = append(append([]builds.Step{}, steps[:5]...), builds.Step{Type: "RUN", Args: []string{"echo v2 > /app/version"}})
	var l2 buildLog
	start = time.Now()
	if err := n.builds.Run(ctx, spec, l2.log(t)); err != nil {
		t.Fatal(err)
	}
	t.Logf("rebuild took %s", time.Since(start))
	for _, cached := range []string{"[3/6 RUN", "[4/6 COPY", "[5/6 COPY", "[2/6 WORKDIR"} {
		if !l2.has(cached) || !l2.has("CACHED") {
			t.Fatalf("rebuild did not reuse %s", cached)
		}
	}
	if l2.has("[3/6 RUN echo $GREETING > out.txt && pwd >> out.txt] running") {
		t.Fatal("rebuild ran a cached step again")
	}
	s = create(t, n, CreateRequest{TemplateID: "built"})
	out, err = newEnvdClient(s).run(ctx, "", "/bin/sh", "-c", "cat /app/version /app/out.txt")
	if err != nil || out.stdout != "v2\nbuilt-in\n/app\n" {
		t.Fatalf("sandbox of the rebuilt template: %+v %v", out, err)
	}

	// A failing step: an error naming it, no template.
	var l3 buildLog
	err = n.builds.Run(ctx, builds.Spec{Template: "broken", FromTemplate: "minimal",
		Steps: []builds.Step{{Type: "RUN", Args: []string{"echo about to fail; exit 3"}}}}, l3.log(t))
	if err == nil || !strings.Contains(err.Error(), "exited with code 3") || !l3.has("about to fail") {
		t.Fatalf("failing build: %v", err)
	}
	if _, err := n.Template("broken"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("a failed build registered its template: %v", err)
	}
	// Bad input: unknown step, COPY of files never uploaded.
	for _, st := range []builds.Step{{Type: "FROB"}, {Type: "COPY", Args: []string{"a", "/b"}, FilesHash: "beef"}} {
		if err := n.builds.Run(ctx, builds.Spec{Template: "bad", FromTemplate: "minimal", Steps: []builds.Step{st}}, l3.log(t)); !errors.Is(err, ErrInvalid) {
			t.Fatalf("step %+v: %v", st, err)
		}
	}
	if all, _ := n.List(ctx); len(all) != 1 {
		t.Fatalf("builder sandboxes left behind: %d sandboxes", len(all))
	}
}
