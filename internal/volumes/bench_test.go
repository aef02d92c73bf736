package volumes

import (
	"bytes"
	"context"
	"crypto/rand"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"testing"
	"time"
)

// BenchmarkVolume times a volume's hot paths b.N times each and prints
// p50/p90: creating one, the first content request (the host opens it:
// storage daemon, e2fsck, fuse2fs), a request on an open volume, and
// writing and reading 8 MiB; the baseline is the same write and read on a
// plain file of the host's, measured in the same run.
func BenchmarkVolume(b *testing.B) {
	needTools(b)
	ctx := context.Background()
	dir := b.TempDir()
	s := openStore(b, dir, nil)
	payload := make([]byte, 8<<20)
	rand.Read(payload)
	var create, open, warm, write, read, baseWrite, baseRead []time.Duration
	for i := 0; i < b.N; i++ {
		t0 := time.Now()
		v, err := s.Create(ctx, fmt.Sprintf("bench-%d", i))
		if err != nil {
			b.Fatal(err)
		}
		create = append(create, time.Since(t0))
		t0 = time.Now()
		if _, err := s.Stat(ctx, v.ID, "/"); err != nil {
			b.Fatal(err)
		}
		open = append(open, time.Since(t0))
		t0 = time.Now()
		if _, err := s.Stat(ctx, v.ID, "/"); err != nil {
			b.Fatal(err)
		}
		warm = append(warm, time.Since(t0))
		t0 = time.Now()
		if _, err := s.WriteFile(ctx, v.ID, "/f", Owner{}, false, bytes.NewReader(payload)); err != nil {
			b.Fatal(err)
		}
		write = append(write, time.Since(t0))
		t0 = time.Now()
		if err := s.ReadFile(ctx, v.ID, "/f", func(int64) {}, io.Discard); err != nil {
			b.Fatal(err)
		}
		read = append(read, time.Since(t0))
		// The baseline: a synced write and a read of a host file.
		p := filepath.Join(dir, "baseline")
		t0 = time.Now()
		f, err := os.Create(p)
		if err != nil {
			b.Fatal(err)
		}
		f.Write(payload)
		f.Sync()
		f.Close()
		baseWrite = append(baseWrite, time.Since(t0))
		t0 = time.Now()
		if _, err := os.ReadFile(p); err != nil {
			b.Fatal(err)
		}
		baseRead = append(baseRead, time.Since(t0))
		if err := s.Delete(ctx, v.ID); err != nil {
			b.Fatal(err)
		}
	}
	for _, r := range []struct {
		name string
		ds   []time.Duration
	}{
		{"create", create}, {"first request (open)", open}, {"request, open", warm},
		{"write 8 MiB", write}, {"baseline host write 8 MiB", baseWrite},
		{"read 8 MiB", read}, {"baseline host read 8 MiB", baseRead},
	} {
		fmt.Fprintf(os.Stderr, "volume %-26s n=%d p50 %9s p90 %9s\n", r.name, len(r.ds),
			pct(r.ds, 50).Round(10*time.Microsecond), pct(r.ds, 90).Round(10*time.Microsecond))
	}
	b.ReportMetric(float64(pct(open, 50).Microseconds())/1000, "open-p50-ms")
	b.ReportMetric(0, "ns/op")
}

func pct(ds []time.Duration, p int) time.Duration {
	s := append([]time.Duration(nil), ds...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	if len(s) == 0 {
		return 0
	}
	return s[(len(s)-1)*p/100]
}
