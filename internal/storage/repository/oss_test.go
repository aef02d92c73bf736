package repository

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/minio/minio-go/v7"
	"github.com/minio/minio-go/v7/pkg/credentials"
)

// The oss tests run against a real S3-compatible server: versitygw built
// from the Go module proxy (cached between runs), serving a temp directory
// on loopback. If it cannot be built or started, the tests are skipped with
// the reason; S3 is never faked.

const (
	versitygwModule = "github.com/versity/versitygw/cmd/versitygw@v1.8.0"
	testAccessKey   = "aenvtestaccess"
	testSecretKey   = "aenvtestsecret1234567890"
	testBucket      = "aenv-test"
	testRegion      = "us-east-1"
)

var vgw struct {
	once     sync.Once
	endpoint string
	skip     string
	cmd      *exec.Cmd
	dir      string
	prefixes atomic.Int64
}

func TestMain(m *testing.M) {
	code := m.Run()
	if vgw.cmd != nil {
		vgw.cmd.Process.Kill()
		vgw.cmd.Wait()
		os.RemoveAll(vgw.dir)
	}
	os.Exit(code)
}

// versitygwBinary finds the cached versitygw or builds it into the cache.
func versitygwBinary() (string, string) {
	if p := os.Getenv("AENV_VERSITYGW"); p != "" {
		return p, ""
	}
	var dirs []string
	if d := os.Getenv("AENV_TEST_DATA_DIR"); d != "" {
		dirs = append(dirs, filepath.Join(d, "bin"))
	}
	dirs = append(dirs, "/var/cache/aenv-test/bin")
	for _, d := range dirs {
		if p := filepath.Join(d, "versitygw"); fileExists(p) {
			return p, ""
		}
	}
	var errs []string
	for _, d := range dirs {
		if err := os.MkdirAll(d, 0o755); err != nil {
			errs = append(errs, err.Error())
			continue
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
		cmd := exec.CommandContext(ctx, "go", "install", versitygwModule)
		cmd.Env = append(os.Environ(), "GOBIN="+d)
		out, err := cmd.CombinedOutput()
		cancel()
		if err == nil {
			return filepath.Join(d, "versitygw"), ""
		}
		errs = append(errs, fmt.Sprintf("GOBIN=%s go install %s: %v: %s", d, versitygwModule, err, bytes.TrimSpace(out)))
	}
	return "", "cannot build versitygw: " + strings.Join(errs, "; ")
}

func fileExists(p string) bool {
	st, err := os.Stat(p)
	return err == nil && st.Mode().IsRegular()
}

func startVersity() {
	bin, skip := versitygwBinary()
	if skip != "" {
		vgw.skip = skip
		return
	}
	dir, err := os.MkdirTemp("", "aenv-versitygw-")
	if err != nil {
		vgw.skip = err.Error()
		return
	}
	vgw.dir = dir
	data := filepath.Join(dir, "data")
	os.Mkdir(data, 0o755)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		vgw.skip = err.Error()
		return
	}
	addr := l.Addr().String()
	l.Close()
	logf, _ := os.Create(filepath.Join(dir, "versitygw.log"))
	cmd := exec.Command(bin, "--port", addr, "--quiet", "posix", data)
	cmd.Env = append(os.Environ(), "ROOT_ACCESS_KEY="+testAccessKey, "ROOT_SECRET_KEY="+testSecretKey)
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		vgw.skip = fmt.Sprintf("start %s: %v", bin, err)
		return
	}
	vgw.cmd = cmd
	c, _ := minio.New(addr, &minio.Options{Creds: credentials.NewStaticV4(testAccessKey, testSecretKey, ""), Region: testRegion})
	deadline := time.Now().Add(30 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		_, err = c.BucketExists(ctx, testBucket)
		cancel()
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			log, _ := os.ReadFile(filepath.Join(dir, "versitygw.log"))
			vgw.skip = fmt.Sprintf("versitygw on %s did not answer: %v; log: %s", addr, err, log)
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
	if err := c.MakeBucket(context.Background(), testBucket, minio.MakeBucketOptions{Region: testRegion}); err != nil {
		vgw.skip = fmt.Sprintf("create bucket: %v", err)
		return
	}
	vgw.endpoint = addr
}

// needVersity returns the endpoint of the shared test server or skips.
func needVersity(t *testing.T) string {
	t.Helper()
	vgw.once.Do(startVersity)
	if vgw.skip != "" {
		t.Skip("oss tests skipped: " + vgw.skip)
	}
	return vgw.endpoint
}

func ossEnv() backendEnv {
	return backendEnv{
		name: "oss",
		open: func(t *testing.T) Repository {
			ep := needVersity(t)
			r, err := Open(Config{Backend: BackendOSS, OSS: OSSConfig{
				Endpoint: ep, Bucket: testBucket, Region: testRegion, Insecure: true,
				Prefix:    fmt.Sprintf("tests/t%d", vgw.prefixes.Add(1)),
				AccessKey: testAccessKey, SecretKey: testSecretKey,
			}})
			if err != nil {
				t.Fatal(err)
			}
			return r
		},
		mutate: func(t *testing.T, r Repository, kind, id, name string, fn func([]byte) []byte) {
			o := r.(*ossRepo)
			ctx := context.Background()
			m, err := o.Stat(ctx, kind, id)
			if err != nil {
				t.Fatal(err)
			}
			key := o.key(kind, id, m.Data, name)
			obj, err := o.c.GetObject(ctx, o.bucket, key, minio.GetObjectOptions{})
			if err != nil {
				t.Fatal(err)
			}
			b, err := io.ReadAll(obj)
			obj.Close()
			if err != nil {
				t.Fatal(err)
			}
			if b = fn(b); b == nil {
				err = o.c.RemoveObject(ctx, o.bucket, key, minio.RemoveObjectOptions{})
			} else {
				_, err = o.c.PutObject(ctx, o.bucket, key, bytes.NewReader(b), int64(len(b)), minio.PutObjectOptions{})
			}
			if err != nil {
				t.Fatal(err)
			}
		},
	}
}

func TestOSSConformance(t *testing.T) { runConformance(t, ossEnv()) }

func TestOSSLargeSparse(t *testing.T) { runLargeSparse(t, ossEnv()) }

// A credentials file and a URL configuration against the real server, and
// the object layout.
func TestOSSCredentialsFileAndLayout(t *testing.T) {
	ep := needVersity(t)
	cred := filepath.Join(t.TempDir(), "credentials")
	os.WriteFile(cred, []byte(fmt.Sprintf("[default]\naws_access_key_id = wrong\naws_secret_access_key = wrong\n\n[aenv]\naws_access_key_id = %s\naws_secret_access_key = %s\n", testAccessKey, testSecretKey)), 0o600)
	cfg, err := ParseURL(fmt.Sprintf("oss://%s/layout/x?endpoint=%s&region=%s&insecure=1&credentials_file=%s&profile=aenv", testBucket, ep, testRegion, cred))
	if err != nil {
		t.Fatal(err)
	}
	r, err := Open(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	src := makeArtifact(t, 7)
	m, err := r.Put(ctx, "snapshots", "s1", src)
	if err != nil {
		t.Fatal(err)
	}
	if f := m.File("memory"); f.Encoding != EncodingExtents || len(f.Extents) == 0 {
		t.Errorf("sparse memory file stored verbatim: %+v", f)
	}
	if f := m.File("disk.qcow2"); f.Encoding != "" {
		t.Errorf("dense file stored with encoding %q", f.Encoding)
	}
	o := r.(*ossRepo)
	var keys []string
	for obj := range o.c.ListObjects(ctx, testBucket, minio.ListObjectsOptions{Prefix: "layout/", Recursive: true}) {
		if obj.Err != nil {
			t.Fatal(obj.Err)
		}
		keys = append(keys, obj.Key)
	}
	if !strings.HasPrefix(m.Data, "data-") {
		t.Fatalf("manifest names data folder %q, want data-<random>", m.Data)
	}
	d := "layout/x/snapshots/s1/" + m.Data + "/"
	want := d + "devices.vmstate " + d + "disk.qcow2 " + d + "empty " + d + "memory layout/x/snapshots/s1/manifest.json"
	if got := strings.Join(keys, " "); got != want {
		t.Errorf("objects:\n got %s\nwant %s", got, want)
	}

	// The wrong profile is rejected by the server.
	cfg.OSS.Profile = "default"
	bad, err := Open(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := bad.Stat(ctx, "snapshots", "s1"); err == nil {
		t.Error("Stat with wrong credentials succeeded")
	}
}
