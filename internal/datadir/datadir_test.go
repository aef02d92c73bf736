package datadir

import (
	"errors"
	"os"
	"os/exec"
	"strings"
	"testing"
)

func TestSecondClaimRefused(t *testing.T) {
	dir := t.TempDir()
	l, err := Acquire(dir, "aenv server")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := Acquire(dir, "aenv template import"); !errors.Is(err, ErrInUse) || !strings.Contains(err.Error(), "aenv server (pid ") {
		t.Fatalf("second claim in the same process: %v", err)
	}
	if err := l.Release(); err != nil {
		t.Fatal(err)
	}
	l2, err := Acquire(dir, "again")
	if err != nil {
		t.Fatalf("claim after release: %v", err)
	}
	l2.Release()
}

// TestClaimOfAnotherProcess holds the lock from a child process (flock
// locks belong to open files, so this is the case of two processes).
func TestClaimOfAnotherProcess(t *testing.T) {
	if os.Getenv("DATADIR_HOLD") != "" {
		if _, err := Acquire(os.Getenv("DATADIR_HOLD"), "holder"); err != nil {
			os.Exit(3)
		}
		os.Stdout.WriteString("held\n")
		os.Stdin.Read(make([]byte, 1)) // until the parent closes the pipe
		os.Exit(0)
	}
	dir := t.TempDir()
	cmd := exec.Command(os.Args[0], "-test.run=^TestClaimOfAnotherProcess$")
	cmd.Env = append(os.Environ(), "DATADIR_HOLD="+dir)
	in, _ := cmd.StdinPipe()
	out, _ := cmd.StdoutPipe()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 5)
	if _, err := out.Read(buf); err != nil || string(buf) != "held\n" {
		t.Fatalf("child: %q %v", buf, err)
	}
	if _, err := Acquire(dir, "me"); !errors.Is(err, ErrInUse) || !strings.Contains(err.Error(), "holder (pid ") {
		t.Fatalf("claim held by another process: %v", err)
	}
	in.Close()
	cmd.Wait()
	// The child is gone, and with it its lock.
	l, err := Acquire(dir, "me")
	if err != nil {
		t.Fatalf("claim after the holder exited: %v", err)
	}
	l.Release()
}
