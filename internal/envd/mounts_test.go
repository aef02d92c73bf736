package envd

import (
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// POST /aenv/mounts: behind the access token, bad requests are 400 and
// mount nothing, and a slot with no disk is an error that names it.
func TestMountsRequests(t *testing.T) {
	sys := t.TempDir()
	for name, serial := range map[string]string{"vda": "", "vdb": "aenv-vol0\n"} {
		if err := os.MkdirAll(filepath.Join(sys, name), 0o755); err != nil {
			t.Fatal(err)
		}
		if serial != "" {
			if err := os.WriteFile(filepath.Join(sys, name, "serial"), []byte(serial), 0o644); err != nil {
				t.Fatal(err)
			}
		}
	}
	old := sysBlock
	sysBlock = sys
	t.Cleanup(func() { sysBlock = old })
	if dev, err := deviceBySerial("aenv-vol0"); err != nil || dev != "/dev/vdb" {
		t.Fatalf("deviceBySerial = %q, %v", dev, err)
	}

	e := startServer(t, Config{AccessToken: "tok"})
	for _, tc := range []struct {
		name, token, body string
		status            int
		msg               string
	}{
		{"no token", "", `{"mounts":[]}`, 401, "token"},
		{"not json", "tok", `{`, 400, "invalid JSON"},
		{"relative path", "tok", `{"mounts":[{"serial":"aenv-vol0","path":"mnt"}]}`, 400, "absolute"},
		{"root", "tok", `{"mounts":[{"serial":"aenv-vol0","path":"/"}]}`, 400, "absolute"},
		{"unclean", "tok", `{"mounts":[{"serial":"aenv-vol0","path":"/mnt/../etc"}]}`, 400, "clean"},
		{"no serial", "tok", `{"mounts":[{"path":"/mnt"}]}`, 400, "serial"},
		{"no such disk", "tok", `{"mounts":[{"serial":"aenv-vol3","path":"/mnt/x"}]}`, 500, "no disk with serial aenv-vol3"},
		{"nothing to mount", "tok", `{"mounts":[]}`, 204, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			req, _ := http.NewRequest(http.MethodPost, e.base+"/aenv/mounts", strings.NewReader(tc.body))
			if tc.token != "" {
				req.Header.Set("X-Access-Token", tc.token)
			}
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != tc.status || !strings.Contains(string(b), tc.msg) {
				t.Fatalf("%d %s, want %d with %q", resp.StatusCode, b, tc.status, tc.msg)
			}
		})
	}
}

func TestUnescapeOctal(t *testing.T) {
	for in, want := range map[string]string{`/mnt/a\040b`: "/mnt/a b", `/plain`: "/plain", `/tab\011x`: "/tab\tx", `/end\04`: `/end\04`} {
		if got := unescapeOctal(in); got != want {
			t.Errorf("unescapeOctal(%q) = %q, want %q", in, got, want)
		}
	}
}
