package vmm

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
)

// TestLogRing appends numbered lines to a log, as QEMU does, trimming it
// between writes: the file's blocks stay within the cap, and what is read
// is the newest lines, in order, ending with the last one written. On
// tmpfs the head cannot be removed (no FALLOC_FL_COLLAPSE_RANGE) and is
// punched out instead.
func TestLogRing(t *testing.T) {
	dirs := map[string]string{"data dir's file system": t.TempDir()}
	if st, err := os.Stat("/dev/shm"); err == nil && st.IsDir() {
		d, err := os.MkdirTemp("/dev/shm", "logring")
		if err == nil {
			t.Cleanup(func() { os.RemoveAll(d) })
			dirs["tmpfs"] = d
		}
	}
	const capBytes = 64 << 10
	for name, dir := range dirs {
		t.Run(name, func(t *testing.T) {
			path := filepath.Join(dir, ConsoleName)
			w, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
			if err != nil {
				t.Fatal(err)
			}
			defer w.Close()
			r, err := openLogRing(path, capBytes)
			if err != nil {
				t.Fatal(err)
			}
			defer r.f.Close()
			const lines = 200_000 // about 40 times the cap
			for i := 0; i < lines; i++ {
				fmt.Fprintf(w, "line %d\n", i)
				if i%1000 == 0 {
					if err := r.trim(); err != nil {
						t.Fatal(err)
					}
				}
			}
			if err := r.trim(); err != nil {
				t.Fatal(err)
			}
			var st syscall.Stat_t
			if err := syscall.Stat(path, &st); err != nil {
				t.Fatal(err)
			}
			if held := st.Blocks * 512; held > capBytes+8<<10 {
				t.Fatalf("%d bytes on disk, cap %d", held, capBytes)
			}
			all, err := ReadLogTail(path, 0)
			if err != nil {
				t.Fatal(err)
			}
			if len(all) > capBytes || len(all) < capBytes/4 {
				t.Fatalf("read %d bytes, cap %d", len(all), capBytes)
			}
			// The first line may be cut by the trim; the rest count up to
			// the last one written.
			got := bytes.Split(bytes.TrimSuffix(all, []byte("\n")), []byte("\n"))[1:]
			last := lines - len(got)
			for i, l := range got {
				if want := "line " + strconv.Itoa(last+i); string(l) != want {
					t.Fatalf("line %d of the ring is %q, want %q", i, l, want)
				}
			}
			tail, err := ReadLogTail(path, 12)
			if err != nil || string(tail) != "line 199999\n" {
				t.Fatalf("tail %q %v", tail, err)
			}
			t.Logf("%d lines read, %d bytes on disk, punched: %v", len(got), st.Blocks*512, r.punch)
		})
	}
}

// TestReadLogTailRefusesSpecialFiles: a log that is not a regular file (a
// FIFO would block a reader) is refused at once.
func TestReadLogTailRefusesSpecialFiles(t *testing.T) {
	path := filepath.Join(t.TempDir(), "fifo")
	if err := syscall.Mkfifo(path, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := ReadLogTail(path, 0); err == nil {
		t.Fatal("a FIFO read as a log")
	}
	if _, err := openLogRing(path, 1<<20); err == nil {
		t.Fatal("a FIFO opened as a log ring")
	}
	if b, err := ReadLogTail(filepath.Join(t.TempDir(), "missing"), 0); err != nil || b != nil {
		t.Fatalf("a missing log: %q %v", b, err)
	}
}
