package envd

import (
	"path/filepath"
	"strings"
	"testing"
)

// FuzzResolvePath: whatever path a request names, envd works on one clean
// absolute path (relative ones under the user's home), never on a path
// with a NUL byte; what the user may do there is then the kernel's
// permission check on the opened file (see the symlink tests).
func FuzzResolvePath(f *testing.F) {
	for _, seed := range []string{"", "~", "~/a", "a/b", "/etc/passwd", "../../etc/shadow", "/home/user/../../root", "a\x00b", "~user", "//x//y/.", "~/../.."} {
		f.Add(seed)
	}
	u := &sysUser{Name: "user", Home: "/home/user"}
	f.Fuzz(func(t *testing.T, p string) {
		got, err := resolvePath(p, u)
		if strings.IndexByte(p, 0) >= 0 {
			if err == nil {
				t.Fatalf("accepted a path with NUL: %q", p)
			}
			return
		}
		if err != nil {
			t.Fatalf("%q: %v", p, err)
		}
		if !filepath.IsAbs(got) || filepath.Clean(got) != got {
			t.Fatalf("%q resolved to %q: not clean and absolute", p, got)
		}
		if filepath.IsAbs(p) && got != filepath.Clean(p) {
			t.Fatalf("absolute %q resolved to %q", p, got)
		}
	})
}
