package repository

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"
)

// A real crash: a child process (this test binary) starts a Put and is
// killed with SIGKILL in the middle of it. Nothing may look complete, and
// Cleanup must reclaim the leftovers.

const crashChildEnv = "AENV_REPO_CRASH_CHILD"

func init() {
	url := os.Getenv(crashChildEnv)
	if url == "" {
		return
	}
	// Child: AENV_REPO_CRASH_CHILD=<repository URL>, AENV_REPO_CRASH_SRC=<dir to
	// upload>, AENV_REPO_CRASH_POINT=<fault point where it stops>,
	// AENV_REPO_CRASH_MARKER=<file created at the crash point>.
	src, marker := os.Getenv("AENV_REPO_CRASH_SRC"), os.Getenv("AENV_REPO_CRASH_MARKER")
	cfg, err := ParseURL(url)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	r, err := Open(cfg)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	setHook(r, func(p string) error {
		if p == os.Getenv("AENV_REPO_CRASH_POINT") {
			os.WriteFile(marker, nil, 0o644)
			time.Sleep(time.Hour) // killed here
		}
		return nil
	})
	_, err = r.Put(context.Background(), "snapshots", "crashed", src)
	fmt.Fprintln(os.Stderr, "child Put returned:", err)
	os.Exit(3)
}

func TestCrashMidUpload(t *testing.T) {
	ossURL := func(t *testing.T) string {
		ep := needVersity(t)
		return fmt.Sprintf("oss://%s/crash/t%d?endpoint=%s&region=%s&insecure=1&access_key=%s&secret_key=%s",
			testBucket, vgw.prefixes.Add(1), ep, testRegion, testAccessKey, testSecretKey)
	}
	for _, c := range []struct {
		name, point string
		large       bool // memory file bigger than one multipart part
		url         func(t *testing.T) string
	}{
		{"posix_fs", "file:disk.qcow2", false, func(t *testing.T) string { return "posix_fs://" + filepath.Join(t.TempDir(), "repo") }},
		{"oss", "file:disk.qcow2", false, ossURL},
		{"oss multipart", "streaming:memory", true, ossURL},
	} {
		t.Run(c.name, func(t *testing.T) {
			url := c.url(t)
			src := makeArtifact(t, 11)
			if c.large {
				makeLargeSparse(t, filepath.Join(src, "memory"), 64<<20, 40<<20)
			}
			marker := filepath.Join(t.TempDir(), "marker")
			exe, err := os.Executable()
			if err != nil {
				t.Fatal(err)
			}
			cmd := exec.Command(exe, "-test.run=^$")
			cmd.Env = append(os.Environ(), crashChildEnv+"="+url, "AENV_REPO_CRASH_SRC="+src, "AENV_REPO_CRASH_MARKER="+marker, "AENV_REPO_CRASH_POINT="+c.point)
			cmd.Stderr = os.Stderr
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			deadline := time.Now().Add(30 * time.Second)
			for !fileExists(marker) {
				if time.Now().After(deadline) {
					cmd.Process.Kill()
					cmd.Wait()
					t.Fatal("child never reached the crash point")
				}
				time.Sleep(5 * time.Millisecond)
			}
			cmd.Process.Kill() // SIGKILL
			cmd.Wait()

			cfg, _ := ParseURL(url)
			r, err := Open(cfg)
			if err != nil {
				t.Fatal(err)
			}
			ctx := context.Background()
			if _, err := r.Stat(ctx, "snapshots", "crashed"); !errors.Is(err, ErrNotFound) {
				t.Fatalf("Stat after crash: %v, want ErrNotFound", err)
			}
			if l, err := r.List(ctx, "snapshots"); err != nil || len(l) != 0 {
				t.Fatalf("List after crash: %v, %v", l, err)
			}
			incomplete := func() int {
				o, ok := r.(*ossRepo)
				if !ok {
					return 0
				}
				n := 0
				for u := range o.c.ListIncompleteUploads(ctx, o.bucket, o.prefix+"/", true) {
					if u.Err != nil {
						t.Fatal(u.Err)
					}
					n++
				}
				return n
			}
			if c.large && incomplete() == 0 {
				t.Fatal("no incomplete multipart upload after a crash mid-stream")
			}
			time.Sleep(10 * time.Millisecond)
			n, err := r.Cleanup(ctx, 0)
			if err != nil || n == 0 {
				t.Fatalf("Cleanup after crash = %d, %v; want > 0 removed", n, err)
			}
			if k := incomplete(); k != 0 {
				t.Fatalf("%d incomplete uploads left after Cleanup", k)
			}
			t.Logf("Cleanup removed %d leftovers", n)
			if _, err := r.Put(ctx, "snapshots", "crashed", src); err != nil {
				t.Fatalf("Put after crash: %v", err)
			}
		})
	}
}
