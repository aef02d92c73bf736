package apikeys

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/agentenv/agentenv/internal/errkind"
	"github.com/agentenv/agentenv/internal/statedb"
)

func openKeys(t *testing.T) *Keys {
	t.Helper()
	db, err := statedb.Open(filepath.Join(t.TempDir(), statedb.FileName))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	k, err := Open(db)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

func TestKeys(t *testing.T) {
	k := openKeys(t)
	ctx := t.Context()
	made := map[string]string{}
	for _, name := range []string{"a", "trainer-1", "ci.bot"} {
		key, err := k.Create(ctx, name)
		if err != nil || !Pattern.MatchString(key) {
			t.Fatalf("create %s: %q %v", name, key, err)
		}
		made[name] = key
	}
	for _, tc := range []struct {
		name string
		err  error
	}{
		{"a", errkind.ErrConflict},
		{"", errkind.ErrInvalid},
		{"UPPER", errkind.ErrInvalid},
		{"../x", errkind.ErrInvalid},
	} {
		if _, err := k.Create(ctx, tc.name); !errors.Is(err, tc.err) {
			t.Errorf("create %q: %v, want %v", tc.name, err, tc.err)
		}
	}
	for name, key := range made {
		if got, ok, err := k.Check(ctx, key); err != nil || !ok || got != name {
			t.Errorf("check %s: %q %v %v", name, got, ok, err)
		}
	}
	for _, bad := range []string{"", "e2b_", made["a"] + "0", made["a"][:len(made["a"])-1]} {
		if _, ok, _ := k.Check(ctx, bad); ok {
			t.Errorf("%q accepted", bad)
		}
	}
	l, err := k.List(ctx)
	if err != nil || len(l) != 3 || l[0].Name != "a" || len(l[0].Hint) != 8 {
		t.Fatalf("list: %+v %v", l, err)
	}
	if err := k.Revoke(ctx, "a"); err != nil {
		t.Fatal(err)
	}
	if _, ok, _ := k.Check(ctx, made["a"]); ok {
		t.Fatal("a revoked key is accepted")
	}
	if err := k.Revoke(ctx, "a"); !errors.Is(err, errkind.ErrNotFound) {
		t.Fatalf("second revoke: %v", err)
	}
}

// Checks racing creates and revokes (run with -race): no error, and a key
// is accepted exactly while it exists.
func TestConcurrentChecks(t *testing.T) {
	k := openKeys(t)
	ctx := t.Context()
	stable, _ := k.Create(ctx, "stable")
	var wg sync.WaitGroup
	for i := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 50 {
				if i == 0 {
					if _, err := k.Create(ctx, "churn"); err == nil {
						k.Revoke(ctx, "churn")
					}
					continue
				}
				if _, ok, err := k.Check(ctx, stable); err != nil || !ok {
					t.Errorf("stable key: %v %v", ok, err)
					return
				}
			}
		}()
	}
	wg.Wait()
}

// TestFile: keys kept in a file (a gateway's) are made, listed, checked and
// revoked; another process's edit is seen by a running checker within a
// second; a malformed file is an error, never an open door.
func TestFile(t *testing.T) {
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "gateway-keys")
	f := OpenFile(path)
	if _, ok, err := f.Check(ctx, "e2b_00"); ok || err != nil {
		t.Fatalf("empty: %v %v", ok, err)
	}
	k1, err := f.Create(ctx, "trainer-1")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.Create(ctx, "trainer-1"); !errors.Is(err, errkind.ErrConflict) {
		t.Fatalf("name in use: %v", err)
	}
	if _, err := f.Create(ctx, "Bad Name"); !errors.Is(err, errkind.ErrInvalid) {
		t.Fatalf("bad name: %v", err)
	}
	if name, ok, err := f.Check(ctx, k1); !ok || name != "trainer-1" || err != nil {
		t.Fatalf("check: %q %v %v", name, ok, err)
	}
	b, _ := os.ReadFile(path)
	if strings.Contains(string(b), k1) {
		t.Fatal("the key itself is in the file")
	}
	if fi, _ := os.Stat(path); fi.Mode().Perm() != 0o600 {
		t.Fatalf("file mode %v", fi.Mode())
	}
	// Another process (another File on the same path) revokes it and
	// makes another: the first checker sees both within a second.
	other := OpenFile(path)
	if err := other.Revoke(ctx, "trainer-1"); err != nil {
		t.Fatal(err)
	}
	k2, _ := other.Create(ctx, "trainer-2")
	deadline := time.Now().Add(3 * time.Second)
	for {
		_, ok1, _ := f.Check(ctx, k1)
		_, ok2, _ := f.Check(ctx, k2)
		if !ok1 && ok2 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("after another process's edit: old key accepted %v, new key accepted %v", ok1, ok2)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if l, _ := f.List(ctx); len(l) != 1 || l[0].Name != "trainer-2" {
		t.Fatalf("list %+v", l)
	}
	if err := f.Revoke(ctx, "nobody"); !errors.Is(err, errkind.ErrNotFound) {
		t.Fatalf("revoke unknown: %v", err)
	}
	os.WriteFile(path, []byte("trainer-2 nothex 1\n"), 0o600)
	time.Sleep(reloadEvery + 100*time.Millisecond)
	if _, ok, err := f.Check(ctx, k2); ok || err == nil {
		t.Fatalf("malformed file: ok %v err %v", ok, err)
	}
}
