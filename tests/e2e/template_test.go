package e2e

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// TestTemplateBuildCLI builds a template from a Dockerfile with
// `aenv template build` against the real server, and runs a sandbox of it;
// a failing RUN fails the command with the step's output.
func TestTemplateBuildCLI(t *testing.T) {
	s := needServer(t)
	dir := t.TempDir()
	os.MkdirAll(filepath.Join(dir, "site"), 0o755)
	os.WriteFile(filepath.Join(dir, "site", "index.html"), []byte("<h1>hi</h1>\n"), 0o644)
	df := `FROM minimal
ENV WHO=dockerfile
WORKDIR /srv
COPY site/ ./www/
RUN echo "built by $WHO" > built.txt
`
	os.WriteFile(filepath.Join(dir, "Dockerfile"), []byte(df), 0o644)
	build := func(name, file string) (string, error) {
		cmd := exec.Command(s.bin, "template", "build", name, "-f", file, "--api-url", s.url, "--api-key", apiKey,
			"--start-cmd", "echo up > /tmp/up; exec sleep 100000", "--ready-cmd", "test -f /tmp/up")
		out, err := cmd.CombinedOutput()
		return string(out), err
	}
	out, err := build("cli-built", filepath.Join(dir, "Dockerfile"))
	t.Logf("aenv template build:\n%s", out)
	if err != nil || !strings.Contains(out, "uploaded") || !strings.Contains(out, `template cli-built ready`) {
		t.Fatalf("build: %v", err)
	}
	sb := s.createSandbox(t, map[string]any{"templateID": "cli-built"})
	got, code := s.run(t, sb, "/bin/sh", "-c", "cat /srv/www/index.html /srv/built.txt /tmp/up")
	if code != 0 || got != "<h1>hi</h1>\nbuilt by dockerfile\nup\n" {
		t.Fatalf("sandbox of the built template: %d %q", code, got)
	}
	// Built again: the upload and the layers are reused.
	out, err = build("cli-built", filepath.Join(dir, "Dockerfile"))
	if err != nil || !strings.Contains(out, "already uploaded") || !strings.Contains(out, "CACHED") {
		t.Fatalf("rebuild: %v\n%s", err, out)
	}
	// A failing step.
	os.WriteFile(filepath.Join(dir, "Bad"), []byte("FROM minimal\nRUN echo broken-step; exit 4\n"), 0o644)
	out, err = build("cli-broken", filepath.Join(dir, "Bad"))
	if err == nil || !strings.Contains(out, "broken-step") || !strings.Contains(out, "exited with code 4") {
		t.Fatalf("failing build: %v\n%s", err, out)
	}
}
