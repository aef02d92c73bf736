package api

import (
	"context"
	"encoding/json"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/agentenv/agentenv/internal/apispec"
	"github.com/agentenv/agentenv/internal/statedb"
	"github.com/agentenv/agentenv/internal/volumes"
)

// newVolumeAPI is a test API with real volumes (they need root, FUSE,
// QEMU's storage daemon and fuse2fs: skipped without them, failed under CI).
func newVolumeAPI(t *testing.T) *testAPI {
	t.Helper()
	if missing := volumesMissing(); len(missing) > 0 {
		if os.Getenv("CI") == "true" {
			t.Fatalf("volumes need %v", missing)
		}
		t.Skipf("volumes need %v", missing)
	}
	dir := t.TempDir()
	db, err := statedb.Open(filepath.Join(dir, "state.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	vols, err := volumes.Open(context.Background(), db, volumes.Config{Dir: filepath.Join(dir, "volumes"), Size: 64 << 20, UID: 1000, GID: 1000, IdleClose: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { vols.Close() })
	node := newFakeNode()
	srv, err := New(node, Config{APIKey: testKey, Domain: "sandbox.test", SandboxProxy: http.NotFoundHandler(), Volumes: vols})
	if err != nil {
		t.Fatal(err)
	}
	return &testAPI{t: t, node: node, srv: srv, volumesDir: filepath.Join(dir, "volumes")}
}

// volumesMissing lists what volumes need that this host lacks.
func volumesMissing() []string {
	var missing []string
	for _, p := range []string{"qemu-storage-daemon", "fuse2fs", "mkfs.ext4", "qemu-img"} {
		if _, err := exec.LookPath(p); err != nil {
			missing = append(missing, p)
		}
	}
	if _, err := os.Stat("/dev/fuse"); err != nil || os.Geteuid() != 0 {
		missing = append(missing, "root with /dev/fuse")
	}
	return missing
}

// volumesRunHere reports whether the host runs volumes (under CI it must:
// newVolumeAPI fails there otherwise).
func volumesRunHere() bool { return len(volumesMissing()) == 0 || os.Getenv("CI") == "true" }

// content sends a volume content request with a bearer token.
func (a *testAPI) content(method, path, token, body string) *httptest.ResponseRecorder {
	a.t.Helper()
	req := httptest.NewRequest(method, path, strings.NewReader(body))
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	rec := httptest.NewRecorder()
	a.srv.ServeHTTP(rec, req)
	return rec
}

func decodeTo[T any](t *testing.T, rec *httptest.ResponseRecorder, status int) T {
	t.Helper()
	var v T
	if rec.Code != status {
		t.Fatalf("status %d, want %d: %s", rec.Code, status, rec.Body)
	}
	if err := json.Unmarshal(rec.Body.Bytes(), &v); err != nil {
		t.Fatalf("%s: %v", rec.Body, err)
	}
	return v
}

func TestVolumesAPI(t *testing.T) {
	a := newVolumeAPI(t)
	v := decodeTo[apispec.VolumeAndToken](t, a.do("POST", "/volumes", `{"name":"data"}`), http.StatusCreated)
	if v.VolumeID == "" || v.Name != "data" || v.Token == "" {
		t.Fatalf("created %+v", v)
	}
	assertError(t, a.do("POST", "/volumes", `{"name":"data"}`), http.StatusConflict)
	l := decodeTo[[]apispec.Volume](t, a.do("GET", "/volumes", ""), http.StatusOK)
	if len(l) != 1 || l[0] != (apispec.Volume{VolumeID: v.VolumeID, Name: "data"}) {
		t.Fatalf("list %+v", l)
	}
	if got := decodeTo[apispec.VolumeAndToken](t, a.do("GET", "/volumes/"+v.VolumeID, ""), http.StatusOK); got != v {
		t.Fatalf("get %+v", got)
	}
	base := "/volumecontent/" + v.VolumeID
	e := decodeTo[apispec.VolumeEntryStat](t, a.content("PUT", base+"/file?path=/dir/f.txt&mode=384", v.Token, "hello"), http.StatusCreated)
	if e.Path != "/dir/f.txt" || e.Size != 5 || e.Mode != 0o600 || e.Uid != 1000 {
		t.Fatalf("write %+v", e)
	}
	rec := a.content("GET", base+"/file?path=/dir/f.txt", v.Token, "")
	if rec.Code != http.StatusOK || rec.Body.String() != "hello" || rec.Header().Get("Content-Type") != "application/octet-stream" || rec.Header().Get("Content-Length") != "5" {
		t.Fatalf("read %d %q %v", rec.Code, rec.Body, rec.Header())
	}
	if e := decodeTo[apispec.VolumeEntryStat](t, a.content("GET", base+"/path?path=dir", v.Token, ""), http.StatusOK); e.Type != apispec.Directory {
		t.Fatalf("stat %+v", e)
	}
	if e := decodeTo[apispec.VolumeEntryStat](t, a.content("POST", base+"/dir?path=/a/b&force=true&uid=0", v.Token, ""), http.StatusCreated); e.Type != apispec.Directory || e.Uid != 0 {
		t.Fatalf("mkdir %+v", e)
	}
	entries := decodeTo[[]apispec.VolumeEntryStat](t, a.content("GET", base+"/dir?path=/&depth=2", v.Token, ""), http.StatusOK)
	var paths []string
	for _, e := range entries {
		paths = append(paths, e.Path)
	}
	if strings.Join(paths, " ") != "/a /a/b /dir /dir/f.txt /lost+found" {
		t.Fatalf("list %v", paths)
	}
	if e := decodeTo[apispec.VolumeEntryStat](t, a.content("PATCH", base+"/path?path=/dir/f.txt", v.Token, `{"gid":7,"mode":420}`), http.StatusOK); e.Gid != 7 || e.Mode != 0o644 || e.Uid != 1000 {
		t.Fatalf("patch %+v", e)
	}
	if rec := a.content("DELETE", base+"/path?path=/dir", v.Token, ""); rec.Code != http.StatusNoContent {
		t.Fatalf("remove %d %s", rec.Code, rec.Body)
	}
	assertError(t, a.content("GET", base+"/file?path=/dir/f.txt", v.Token, ""), http.StatusNotFound)
	if rec := a.do("DELETE", "/volumes/"+v.VolumeID, ""); rec.Code != http.StatusNoContent {
		t.Fatalf("delete %d %s", rec.Code, rec.Body)
	}
	assertError(t, a.do("GET", "/volumes/"+v.VolumeID, ""), http.StatusNotFound)
	assertError(t, a.content("GET", base+"/path?path=/", v.Token, ""), http.StatusNotFound)
}

// Bad requests of the volume routes are a 4xx naming what is wrong, and
// change nothing in the volume.
func TestVolumesBadInput(t *testing.T) {
	a := newVolumeAPI(t)
	v := decodeTo[apispec.VolumeAndToken](t, a.do("POST", "/volumes", `{"name":"data"}`), http.StatusCreated)
	if rec := a.content("PUT", "/volumecontent/"+v.VolumeID+"/file?path=/keep", v.Token, "kept"); rec.Code != http.StatusCreated {
		t.Fatalf("write %d %s", rec.Code, rec.Body)
	}
	base := "/volumecontent/" + v.VolumeID
	for _, c := range []struct {
		name, method, path, token, body string
		status                          int
		says                            string
	}{
		{"no name", "POST", "/volumes", "", `{}`, 400, `"name"`},
		{"bad name", "POST", "/volumes", "", `{"name":"a/b"}`, 400, "volume name"},
		{"name not a string", "POST", "/volumes", "", `{"name":3}`, 400, `"name"`},
		{"body not an object", "POST", "/volumes", "", `[]`, 400, "object"},
		{"body not JSON", "POST", "/volumes", "", `name=x`, 415, "application/json"},
		{"unknown volume", "GET", "/volumes/nope", "", "", 404, "nope"},
		{"no token", "GET", base + "/path?path=/", "-", "", 401, "Bearer"},
		{"wrong token", "GET", base + "/path?path=/", "vol_wrong", "", 401, "invalid volume token"},
		{"the API key is not the token", "GET", base + "/path?path=/", testKey, "", 401, "invalid volume token"},
		{"unknown volume's content", "GET", "/volumecontent/nope/path?path=/", v.Token, "", 404, "nope"},
		{"no path", "GET", base + "/path", v.Token, "", 400, `"path"`},
		{"unknown parameter", "GET", base + "/path?path=/&recursive=1", v.Token, "", 400, `"recursive"`},
		{"depth on a stat", "GET", base + "/path?path=/&depth=2", v.Token, "", 400, `"depth"`},
		{"depth 0", "GET", base + "/dir?path=/&depth=0", v.Token, "", 400, `"depth"`},
		{"depth not a number", "GET", base + "/dir?path=/&depth=x", v.Token, "", 400, `"depth"`},
		{"uid negative", "POST", base + "/dir?path=/d&uid=-1", v.Token, "", 400, `"uid"`},
		{"mode too big", "PUT", base + "/file?path=/keep&mode=4096", v.Token, "x", 400, `"mode"`},
		{"force not a bool", "PUT", base + "/file?path=/keep&force=yes", v.Token, "x", 400, `"force"`},
		{"patch mode too big", "PATCH", base + "/path?path=/keep", v.Token, `{"mode":99999}`, 400, "mode"},
		{"patch uid a string", "PATCH", base + "/path?path=/keep", v.Token, `{"uid":"0"}`, 400, `"uid"`},
		{"read a directory", "GET", base + "/file?path=/", v.Token, "", 400, "not a regular file"},
		{"list a file", "GET", base + "/dir?path=/keep", v.Token, "", 400, "not a directory"},
		{"write over a directory", "PUT", base + "/file?path=/lost%2Bfound", v.Token, "x", 409, "force"},
		{"mkdir exists", "POST", base + "/dir?path=/lost%2Bfound", v.Token, "", 409, "exists"},
		{"remove the root", "DELETE", base + "/path?path=/", v.Token, "", 400, "root"},
		{"missing path", "DELETE", base + "/path?path=/nothing", v.Token, "", 404, "/nothing"},
		{"NUL in a path", "GET", base + "/path?path=/a%00b", v.Token, "", 400, "NUL"},
	} {
		t.Run(c.name, func(t *testing.T) {
			var rec *httptest.ResponseRecorder
			switch {
			case c.status == 415:
				req := httptest.NewRequest(c.method, c.path, strings.NewReader(c.body))
				req.Header.Set("X-API-Key", testKey)
				req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
				rec = httptest.NewRecorder()
				a.srv.ServeHTTP(rec, req)
			case strings.HasPrefix(c.path, "/volumes"):
				rec = a.do(c.method, c.path, c.body)
			case c.token == "-":
				rec = a.content(c.method, c.path, "", c.body)
			default:
				rec = a.content(c.method, c.path, c.token, c.body)
			}
			assertError(t, rec, c.status)
			var e Error
			json.Unmarshal(rec.Body.Bytes(), &e)
			if !strings.Contains(e.Message, c.says) {
				t.Fatalf("%q does not say %q", e.Message, c.says)
			}
		})
	}
	rec := a.content("GET", base+"/file?path=/keep", v.Token, "")
	if rec.Code != 200 || rec.Body.String() != "kept" {
		t.Fatalf("the file after the bad requests: %d %q", rec.Code, rec.Body)
	}
	entries := decodeTo[[]apispec.VolumeEntryStat](t, a.content("GET", base+"/dir?path=/", v.Token, ""), http.StatusOK)
	if len(entries) != 2 {
		t.Fatalf("entries after the bad requests: %+v", entries)
	}
	if l := decodeTo[[]apispec.Volume](t, a.do("GET", "/volumes", ""), http.StatusOK); len(l) != 1 {
		t.Fatalf("volumes after the bad requests: %+v", l)
	}
}

// threads is how many OS threads this process runs.
func threads(t *testing.T) int {
	t.Helper()
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "Threads:"); ok {
			n, _ := strconv.Atoi(strings.TrimSpace(v))
			return n
		}
	}
	t.Fatal("no thread count")
	return 0
}

// TestVolumeSpecialFiles: a guest can leave FIFOs, device nodes, sockets
// and symlinks in a volume. Reading them through the content API is a 4xx
// at once, never an open that blocks a thread: 10,000 such reads leave the
// server's thread count and /health as they were, and the volume can be
// deleted after.
func TestVolumeSpecialFiles(t *testing.T) {
	a := newVolumeAPI(t)
	v := decodeTo[apispec.VolumeAndToken](t, a.do("POST", "/volumes", `{"name":"specials"}`), http.StatusCreated)
	base := "/volumecontent/" + v.VolumeID
	decodeTo[apispec.VolumeEntryStat](t, a.content("PUT", base+"/file?path=/plain", v.Token, "plain"), http.StatusCreated)
	mnt := filepath.Join(a.volumesDir, v.VolumeID, "mnt")
	// What a guest would leave there (made here on the volume's mount).
	if err := syscall.Mkfifo(filepath.Join(mnt, "fifo"), 0o644); err != nil {
		t.Fatal(err)
	}
	var st syscall.Stat_t
	if err := syscall.Stat("/", &st); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Mknod(filepath.Join(mnt, "disk"), syscall.S_IFBLK|0o644, int(st.Dev)); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Mknod(filepath.Join(mnt, "zero"), syscall.S_IFCHR|0o666, int(1<<8|5)); err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("unix", filepath.Join(mnt, "sock"))
	if err != nil {
		t.Fatal(err)
	}
	ln.(*net.UnixListener).SetUnlinkOnClose(false)
	ln.Close()
	if err := os.Symlink("fifo", filepath.Join(mnt, "link-to-fifo")); err != nil {
		t.Fatal(err)
	}
	if rec := a.do("GET", "/health", ""); rec.Code != http.StatusOK {
		t.Fatalf("health %d", rec.Code)
	}
	before := threads(t)
	names := []string{"fifo", "disk", "zero", "sock", "link-to-fifo"}
	start := time.Now()
	var wg sync.WaitGroup
	for w := 0; w < 8; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			for i := w; i < 10000; i += 8 {
				rec := a.content("GET", base+"/file?path=/"+names[i%len(names)], v.Token, "")
				if rec.Code != http.StatusBadRequest || strings.Contains(rec.Body.String(), a.volumesDir) {
					t.Errorf("read of %s: %d %s", names[i%len(names)], rec.Code, rec.Body)
					return
				}
			}
		}(w)
	}
	wg.Wait()
	took := time.Since(start)
	after := threads(t)
	t.Logf("10,000 reads of special files in %s; threads %d -> %d", took, before, after)
	if after > before+8 {
		t.Fatalf("threads went from %d to %d: reads are blocking threads", before, after)
	}
	if rec := a.do("GET", "/health", ""); rec.Code != http.StatusOK {
		t.Fatalf("health after: %d", rec.Code)
	}
	for _, n := range names {
		rec := a.content("GET", base+"/file?path=/"+n, v.Token, "")
		if !strings.Contains(rec.Body.String(), "not a regular file") {
			t.Errorf("%s: %s", n, rec.Body)
		}
	}
	if got := a.content("GET", base+"/file?path=/plain", v.Token, ""); got.Code != http.StatusOK || got.Body.String() != "plain" {
		t.Fatalf("plain file %d %q", got.Code, got.Body)
	}
	// The listing describes them without opening them.
	entries := decodeTo[[]apispec.VolumeEntryStat](t, a.content("GET", base+"/dir?path=/", v.Token, ""), http.StatusOK)
	if len(entries) != 7 {
		t.Fatalf("listing %+v", entries)
	}
	done := make(chan *httptest.ResponseRecorder, 1)
	go func() { done <- a.do("DELETE", "/volumes/"+v.VolumeID, "") }()
	select {
	case rec := <-done:
		if rec.Code != http.StatusNoContent {
			t.Fatalf("delete %d %s", rec.Code, rec.Body)
		}
	case <-time.After(time.Minute):
		t.Fatal("deleting the volume hangs")
	}
}
