package sandboxes

import (
	"database/sql"
	"errors"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/agentenv/agentenv/internal/errkind"
	"github.com/agentenv/agentenv/internal/network"
	"github.com/agentenv/agentenv/internal/statedb"
	"github.com/agentenv/agentenv/internal/store"
)

// openRecords opens an empty node database with one layer object,
// "layer-a", that sandboxes may reference as their base.
func openRecords(t *testing.T, slots int) (*Records, *store.Store) {
	t.Helper()
	dir := t.TempDir()
	db, err := statedb.Open(filepath.Join(dir, statedb.FileName))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	st, err := store.Open(db, dir, nil)
	if err != nil {
		t.Fatal(err)
	}
	layer := filepath.Join(dir, "layer-a.qcow2")
	if err := os.WriteFile(layer, []byte("layer"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := st.Tx(t.Context(), func(tx *sql.Tx) error { return st.Add(tx, "layer-a", store.KindLayer, layer) }); err != nil {
		t.Fatal(err)
	}
	r, err := Open(db, st, slots, func(s *Sandbox) []string { return []string{s.BaseLayer} })
	if err != nil {
		t.Fatal(err)
	}
	return r, st
}

func newSandbox(id string, state State) *Sandbox {
	now := time.Now().Truncate(time.Millisecond).UTC()
	return &Sandbox{ID: id, TemplateID: "base", State: state, VCPUs: 1, MemoryMiB: 512, BaseLayer: "layer-a",
		Metadata: map[string]string{"k": "v"}, CreatedAt: now, StartedAt: now, EndAt: now.Add(time.Minute)}
}

func TestTransitionTable(t *testing.T) {
	all := []State{Pooled, Creating, Running, Pausing, Paused, Resuming, Snapshotting, Forking, Killing}
	for _, s := range all {
		if _, ok := transitions[s]; !ok {
			t.Errorf("state %s is missing from the table", s)
		}
	}
	for from, tos := range transitions {
		for _, to := range tos {
			if _, ok := transitions[to]; !ok {
				t.Errorf("%s → %s leads out of the table", from, to)
			}
		}
	}
	// Every operation in progress can fall back to a resting state.
	for _, s := range all {
		if s.Resting() || s == Creating || s == Killing {
			continue
		}
		if !slices.ContainsFunc(transitions[s], State.Resting) {
			t.Errorf("%s has no way back to a resting state", s)
		}
	}
	for _, tc := range []struct {
		from, to State
		ok       bool
	}{
		{Running, Pausing, true},
		{Pausing, Running, true},
		{Paused, Forking, false}, // fork needs a running sandbox
		{Paused, Pausing, false},
		{Forking, Paused, true}, // the parent rests on its snapshot
		{Killing, Forking, false},
		{Creating, Paused, false},
		{Pooled, Running, false}, // a create claims it first
	} {
		if got := CanMove(tc.from, tc.to); got != tc.ok {
			t.Errorf("%s → %s allowed = %v, want %v", tc.from, tc.to, got, tc.ok)
		}
	}
}

func TestMove(t *testing.T) {
	r, _ := openRecords(t, 8)
	ctx := t.Context()
	if err := r.InsertNew(ctx, newSandbox("s1", Running)); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name     string
		from, to State
		set      string
		args     []any
		want     error // nil, errkind.ErrConflict, or errAny
		state    State
	}{
		{"allowed", Running, Pausing, "pid = ?", []any{42}, nil, Pausing},
		{"stale from", Running, Pausing, "", nil, errkind.ErrConflict, Pausing},
		{"not in the table", Pausing, Forking, "", nil, errAny, Pausing},
		{"rolled back", Pausing, Running, "", nil, nil, Running},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := r.Move(ctx, "s1", tc.from, tc.to, tc.set, tc.args...)
			switch {
			case tc.want == nil && err != nil:
				t.Fatalf("Move: %v", err)
			case tc.want == errAny && err == nil:
				t.Fatal("Move succeeded")
			case tc.want != nil && tc.want != errAny && !errors.Is(err, tc.want):
				t.Fatalf("Move: %v, want %v", err, tc.want)
			}
			s, err := r.Get(ctx, "s1")
			if err != nil {
				t.Fatal(err)
			}
			if s.State != tc.state {
				t.Fatalf("state %s, want %s", s.State, tc.state)
			}
		})
	}
	if s, _ := r.Get(ctx, "s1"); s.PID != 42 {
		t.Fatalf("pid %d: the extra assignment was not written with the move", s.PID)
	}
	if err := r.Move(ctx, "nope", Running, Pausing, ""); !errors.Is(err, errkind.ErrNotFound) {
		t.Fatalf("Move of a missing sandbox: %v", err)
	}
}

var errAny = errors.New("any error")

// Records hold their store references in the same transaction: a record
// cannot name an object the store lacks, Save never changes the state, and
// Delete drops the references with the record.
func TestRecordsHoldReferences(t *testing.T) {
	r, st := openRecords(t, 8)
	ctx := t.Context()
	s := newSandbox("s1", Running)
	if err := r.InsertNew(ctx, s); err != nil {
		t.Fatal(err)
	}
	if refs, _ := st.Refs(ctx, Holder("s1")); !slices.Equal(refs, []string{"layer-a"}) {
		t.Fatalf("refs %v", refs)
	}
	bad := newSandbox("s2", Running)
	bad.BaseLayer = "layer-gone"
	if err := r.InsertNew(ctx, bad); !errors.Is(err, store.ErrMissing) {
		t.Fatalf("insert naming a missing layer: %v", err)
	}
	if _, err := r.Get(ctx, "s2"); !errors.Is(err, errkind.ErrNotFound) {
		t.Fatalf("the failed insert left a record: %v", err)
	}
	s.State = Paused
	s.Metadata = map[string]string{"k": "w"}
	s.Egress = network.Egress{Allow: []netip.Prefix{netip.MustParsePrefix("10.1.0.0/16")}, Deny: []netip.Prefix{netip.MustParsePrefix("192.0.2.7/32")}}
	if err := r.Save(ctx, s); err != nil {
		t.Fatal(err)
	}
	got, err := r.Get(ctx, "s1")
	if err != nil {
		t.Fatal(err)
	}
	if got.State != Running || got.Metadata["k"] != "w" || !got.EndAt.Equal(s.EndAt) ||
		!slices.Equal(got.Egress.Allow, s.Egress.Allow) || !slices.Equal(got.Egress.Deny, s.Egress.Deny) {
		t.Fatalf("after Save: %+v", got)
	}
	// Domain rules alone are rules too.
	s.Egress = network.Egress{Domains: []string{"*.example.com"}, DNSServers: []netip.Prefix{netip.MustParsePrefix("192.0.2.53/32")}}
	if err := r.Save(ctx, s); err != nil {
		t.Fatal(err)
	}
	if got, err = r.Get(ctx, "s1"); err != nil || !slices.Equal(got.Egress.Domains, s.Egress.Domains) || !slices.Equal(got.Egress.DNSServers, s.Egress.DNSServers) {
		t.Fatalf("domain rules after Save: %+v %v", got, err)
	}
	if err := r.Delete(ctx, "s1"); err != nil {
		t.Fatal(err)
	}
	if refs, _ := st.Refs(ctx, Holder("s1")); len(refs) != 0 {
		t.Fatalf("refs after delete %v", refs)
	}
}

// New records get the free slots in turn, never one in use, concurrently
// too, and ErrCapacity once all are taken.
func TestInsertNewSlots(t *testing.T) {
	const slots = 6
	r, _ := openRecords(t, slots)
	ctx := t.Context()
	var wg sync.WaitGroup
	errs := make([]error, slots)
	for i := range slots {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = r.InsertNew(ctx, newSandbox(string(rune('a'+i)), Running))
		}()
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	all, err := r.List(ctx, "")
	if err != nil {
		t.Fatal(err)
	}
	seen := map[int]bool{}
	for _, s := range all {
		if seen[s.Slot] || s.Slot < 0 || s.Slot >= slots {
			t.Fatalf("slot %d handed out twice or out of range", s.Slot)
		}
		seen[s.Slot] = true
	}
	if err := r.InsertNew(ctx, newSandbox("full", Running)); !errors.Is(err, errkind.ErrCapacity) {
		t.Fatalf("insert with every slot taken: %v", err)
	}
	// The next slot goes round from the last one handed out: one just
	// freed is not reused while others are free.
	for _, s := range all {
		if err := r.Delete(ctx, s.ID); err != nil {
			t.Fatal(err)
		}
	}
	first := newSandbox("first", Running)
	if err := r.InsertNew(ctx, first); err != nil {
		t.Fatal(err)
	}
	if err := r.Delete(ctx, first.ID); err != nil {
		t.Fatal(err)
	}
	second := newSandbox("second", Running)
	if err := r.InsertNew(ctx, second); err != nil {
		t.Fatal(err)
	}
	if second.Slot == first.Slot || second.Slot != (first.Slot+1)%slots {
		t.Fatalf("slot %d after %d was freed, want the next one", second.Slot, first.Slot)
	}
}

// TestMigratesOldDatabase opens a state database made by the first release
// (without the later columns) and checks its records read back.
func TestMigratesOldDatabase(t *testing.T) {
	path := filepath.Join(t.TempDir(), "aenv.db")
	old, err := sql.Open("sqlite", "file:"+path)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := old.Exec(`CREATE TABLE sandboxes (id TEXT PRIMARY KEY, template_id TEXT NOT NULL, state TEXT NOT NULL,
		vcpus INTEGER NOT NULL, memory_mib INTEGER NOT NULL, disk_mib INTEGER NOT NULL, slot INTEGER NOT NULL UNIQUE,
		pid INTEGER NOT NULL DEFAULT 0, allow_internet INTEGER NOT NULL, secure INTEGER NOT NULL, auto_pause INTEGER NOT NULL,
		access_token TEXT NOT NULL, traffic_token TEXT NOT NULL, default_user TEXT NOT NULL, metadata TEXT NOT NULL,
		env_vars TEXT NOT NULL, created_at INTEGER NOT NULL, started_at INTEGER NOT NULL, end_at INTEGER NOT NULL,
		updated_at INTEGER NOT NULL);
		INSERT INTO sandboxes VALUES ('old1', 'base', 'paused', 2, 512, 0, 3, 0, 1, 1, 1, 'tok', 'tt', 'user', '{"a":"b"}', '{}', 1, 2, 3, 4);`); err != nil {
		t.Fatal(err)
	}
	old.Close()
	db, err := statedb.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	st, err := store.Open(db, filepath.Dir(path), nil)
	if err != nil {
		t.Fatal(err)
	}
	r, err := Open(db, st, 8, func(*Sandbox) []string { return nil })
	if err != nil {
		t.Fatal(err)
	}
	s, err := r.Get(t.Context(), "old1")
	if err != nil {
		t.Fatal(err)
	}
	if s.State != Paused || s.Metadata["a"] != "b" || !s.PublicTraffic || s.AutoResume || s.MemFile != "" || s.Request != "" {
		t.Fatalf("migrated row %+v", s)
	}
	// It holds no references yet: the node's adoption finds it.
	var bare []*Sandbox
	err = st.Tx(t.Context(), func(tx *sql.Tx) error {
		var err error
		bare, err = r.UnreferencedTx(t.Context(), tx)
		return err
	})
	if err != nil || len(bare) != 1 || !strings.EqualFold(bare[0].ID, "old1") {
		t.Fatalf("unreferenced: %v, %v", bare, err)
	}
}

// The idempotent request that made a sandbox is kept with its record by
// Insert and Save, and found again by List.
func TestRecordsKeepTheRequest(t *testing.T) {
	r, _ := openRecords(t, 8)
	a, b := newSandbox("a1", Creating), newSandbox("b1", Creating)
	a.Request = "req-1"
	for _, s := range []*Sandbox{a, b} {
		if err := r.InsertNew(t.Context(), s); err != nil {
			t.Fatal(err)
		}
	}
	b.Request = "req-1" // a pooled sandbox takes its request when claimed
	if err := r.Save(t.Context(), b); err != nil {
		t.Fatal(err)
	}
	got, err := r.List(t.Context(), "request = ?", "req-1")
	if err != nil || len(got) != 2 || got[0].Request != "req-1" || got[1].Request != "req-1" {
		t.Fatalf("%v %v", got, err)
	}
	if none, err := r.List(t.Context(), "request = ?", "req-2"); err != nil || len(none) != 0 {
		t.Fatalf("%v %v", none, err)
	}
}

// A volume is held by one sandbox record at most: a second record naming
// it is refused and leaves nothing; Save and Delete move the hold with
// the record.
func TestRecordsHoldVolumes(t *testing.T) {
	r, _ := openRecords(t, 8)
	ctx := t.Context()
	s1 := newSandbox("s1", Running)
	s1.VolumeSlots = 4
	s1.Volumes = []VolumeMount{{VolumeID: "v1", Name: "data", Path: "/mnt/data", Slot: 0}}
	if err := r.InsertNew(ctx, s1); err != nil {
		t.Fatal(err)
	}
	got, err := r.Get(ctx, "s1")
	if err != nil || got.VolumeSlots != 4 || !slices.Equal(got.Volumes, s1.Volumes) {
		t.Fatalf("read back %+v %v", got, err)
	}
	s2 := newSandbox("s2", Running)
	s2.Volumes = []VolumeMount{{VolumeID: "v1", Name: "data", Path: "/data"}}
	if err := r.InsertNew(ctx, s2); !errors.Is(err, errkind.ErrConflict) || !strings.Contains(err.Error(), "s1") {
		t.Fatalf("a second sandbox holding v1 = %v, want a conflict naming s1", err)
	}
	if _, err := r.Get(ctx, "s2"); !errors.Is(err, errkind.ErrNotFound) {
		t.Fatalf("the refused insert left a record: %v", err)
	}
	s1.Volumes = []VolumeMount{{VolumeID: "v2", Name: "other", Path: "/mnt/other"}}
	if err := r.Save(ctx, s1); err != nil {
		t.Fatal(err)
	}
	if h := volumeHolders(t, r); len(h) != 1 || h["v2"] != "s1" {
		t.Fatalf("holders after Save: %v", h)
	}
	if err := r.InsertNew(ctx, s2); err != nil {
		t.Fatalf("v1, no longer held: %v", err)
	}
	if err := r.Delete(ctx, "s1"); err != nil {
		t.Fatal(err)
	}
	if h := volumeHolders(t, r); len(h) != 1 || h["v1"] != "s2" {
		t.Fatalf("holders after Delete: %v", h)
	}
}

// volumeHolders maps each volume a sandbox record holds to that sandbox.
func volumeHolders(t *testing.T, r *Records) map[string]string {
	t.Helper()
	rows, err := r.db.QueryContext(t.Context(), `SELECT volume_id, sandbox_id FROM sandbox_volumes`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	out := map[string]string{}
	for rows.Next() {
		var v, s string
		if err := rows.Scan(&v, &s); err != nil {
			t.Fatal(err)
		}
		out[v] = s
	}
	return out
}

// TestRecordsKeepTheMaskRequestHost: the Host a sandbox's ports see is
// recorded at insert and rewritten by Save.
func TestRecordsKeepTheMaskRequestHost(t *testing.T) {
	r, _ := openRecords(t, 8)
	s := newSandbox("m1", Creating)
	s.MaskRequestHost = "app.internal:${PORT}"
	if err := r.InsertNew(t.Context(), s); err != nil {
		t.Fatal(err)
	}
	if got, err := r.Get(t.Context(), "m1"); err != nil || got.MaskRequestHost != "app.internal:${PORT}" {
		t.Fatalf("%+v %v", got, err)
	}
	s.MaskRequestHost = "other.internal"
	if err := r.Save(t.Context(), s); err != nil {
		t.Fatal(err)
	}
	if got, err := r.Get(t.Context(), "m1"); err != nil || got.MaskRequestHost != "other.internal" {
		t.Fatalf("%+v %v", got, err)
	}
}
