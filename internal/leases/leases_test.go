package leases

import (
	"errors"
	"path/filepath"
	"testing"
	"time"

	"github.com/agentenv/agentenv/internal/errkind"
	"github.com/agentenv/agentenv/internal/statedb"
)

func openStore(t *testing.T) *Store {
	t.Helper()
	db, err := statedb.Open(filepath.Join(t.TempDir(), "aenv.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	s, err := Open(t.Context(), db)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func TestLeaseLife(t *testing.T) {
	s := openStore(t)
	now := time.Now()
	s.now = func() time.Time { return now }
	l, err := s.Take(t.Context(), "trainer-1", 30*time.Second)
	if err != nil || l.TTL != 30*time.Second || !l.ExpiresAt.Equal(now.Add(30*time.Second).Truncate(time.Millisecond).UTC()) || l.Expired {
		t.Fatalf("%+v %v", l, err)
	}
	now = now.Add(20 * time.Second)
	if l, err = s.Renew(t.Context(), "trainer-1", 0); err != nil || l.ExpiresAt.Before(now.Add(29*time.Second)) {
		t.Fatalf("renew: %+v %v", l, err)
	}
	if got, _ := s.Expire(t.Context()); len(got) != 0 {
		t.Fatalf("expired while renewed: %+v", got)
	}
	now = now.Add(31 * time.Second)
	got, err := s.Expire(t.Context())
	if err != nil || len(got) != 1 || got[0].ID != "trainer-1" || !got[0].Expired {
		t.Fatalf("expire: %+v %v", got, err)
	}
	if got, _ := s.Expire(t.Context()); len(got) != 0 {
		t.Fatalf("expired twice: %+v", got)
	}
	if _, err := s.Renew(t.Context(), "trainer-1", 0); !errors.Is(err, errkind.ErrConflict) {
		t.Fatalf("renew an expired lease: %v", err)
	}
	// A create taking it again revives it.
	if l, err = s.Take(t.Context(), "trainer-1", time.Minute); err != nil || l.Expired || l.TTL != time.Minute {
		t.Fatalf("take again: %+v %v", l, err)
	}
	if err := s.Delete(t.Context(), "trainer-1"); err != nil {
		t.Fatal(err)
	}
	for _, err := range []error{s.Delete(t.Context(), "trainer-1"), func() error { _, err := s.Renew(t.Context(), "trainer-1", 0); return err }()} {
		if !errors.Is(err, errkind.ErrNotFound) {
			t.Fatalf("after delete: %v", err)
		}
	}
}

func TestLeaseBadInput(t *testing.T) {
	s := openStore(t)
	for _, tc := range []struct {
		id  string
		ttl time.Duration
	}{{"", 0}, {"has space", 0}, {"-dash-first", 0}, {string(make([]byte, 129)), 0}, {"ok", time.Second}, {"ok", 25 * time.Hour}} {
		if _, err := s.Take(t.Context(), tc.id, tc.ttl); !errors.Is(err, errkind.ErrInvalid) {
			t.Errorf("%q %s: %v", tc.id, tc.ttl, err)
		}
	}
	if l, err := s.List(t.Context()); err != nil || len(l) != 0 {
		t.Fatalf("bad input made %+v %v", l, err)
	}
	if l, err := s.Take(t.Context(), "a.b_c-1", 0); err != nil || l.TTL != DefaultTTL {
		t.Fatalf("%+v %v", l, err)
	}
}
