package apikeys

import (
	"errors"
	"path/filepath"
	"sync"
	"testing"

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
