package webhooks

import (
	"errors"
	"path/filepath"
	"testing"

	"github.com/agentenv/agentenv/internal/errkind"
	"github.com/agentenv/agentenv/internal/events"
)

// Records from one node bring another to the same webhooks: a
// registration (with its secret), an update and a deletion are taken, an
// older record (a node that was away) brings nothing back, and an
// invalid record is refused with nothing taken.
func TestRecordsBringANodeUpToDate(t *testing.T) {
	dir := t.TempDir()
	a, b, away := openStore(t, filepath.Join(dir, "a.db")), openStore(t, filepath.Join(dir, "b.db")), openStore(t, filepath.Join(dir, "c.db"))
	sync := func(from, to *Store) int {
		t.Helper()
		recs, err := from.Records(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		n, err := to.Apply(t.Context(), recs)
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	w, err := a.Create(t.Context(), Spec{ID: ptr("wh_one"), URL: ptr("http://127.0.0.1:9/h"), Secret: ptr("s3cret"), Revision: 100})
	if err != nil {
		t.Fatal(err)
	}
	if n := sync(a, b); n != 1 {
		t.Fatalf("took %d records, want 1", n)
	}
	if got, err := b.Get(t.Context(), w.ID); err != nil || got.Secret != "s3cret" || got.URL != w.URL {
		t.Fatalf("b has %+v %v", got, err)
	}
	if n := sync(a, b); n != 0 {
		t.Fatalf("the same records again: took %d", n)
	}
	sync(a, away) // a node that then goes away with this version
	if _, err := a.Update(t.Context(), w.ID, Spec{Enabled: ptr(false), Events: &[]events.Type{events.Killed}}); err != nil {
		t.Fatal(err)
	}
	sync(a, b)
	if got, _ := b.Get(t.Context(), w.ID); got.Enabled || len(got.Events) != 1 {
		t.Fatalf("update not taken: %+v", got)
	}
	if n := sync(away, b); n != 0 {
		t.Fatalf("an older record was taken (%d)", n)
	}
	if err := a.Delete(t.Context(), w.ID, 0); err != nil {
		t.Fatal(err)
	}
	sync(a, b)
	if _, err := b.Get(t.Context(), w.ID); !errors.Is(err, errkind.ErrNotFound) {
		t.Fatalf("deletion not taken: %v", err)
	}
	// The node that was away comes back: its old webhook is not brought
	// back to the others, and it takes the deletion.
	if n := sync(away, a) + sync(away, b); n != 0 {
		t.Fatalf("a deleted webhook came back (%d)", n)
	}
	sync(a, away)
	if _, err := away.Get(t.Context(), w.ID); !errors.Is(err, errkind.ErrNotFound) {
		t.Fatalf("the returning node kept a deleted webhook: %v", err)
	}
	// Registering the id again is newer than its deletion.
	if _, err := a.Create(t.Context(), Spec{ID: ptr("wh_one"), URL: ptr("http://127.0.0.1:9/again")}); err != nil {
		t.Fatal(err)
	}
	sync(a, b)
	if got, err := b.Get(t.Context(), w.ID); err != nil || got.URL != "http://127.0.0.1:9/again" {
		t.Fatalf("re-registration not taken: %+v %v", got, err)
	}
	// A deletion of the same revision as the webhook wins, as the gateway
	// orders them (Supersedes).
	recs, _ := b.Records(t.Context())
	if n, err := b.Apply(t.Context(), []Record{{ID: "wh_one", Revision: recs[0].Revision, Deleted: true}}); err != nil || n != 1 {
		t.Fatalf("a tombstone of the same revision: took %d, %v", n, err)
	}
	if n, err := b.Apply(t.Context(), recs); err != nil || n != 0 {
		t.Fatalf("the webhook again at the tombstone's revision: took %d, %v", n, err)
	}
	if _, err := b.Create(t.Context(), Spec{ID: ptr("wh_one"), URL: ptr("http://127.0.0.1:9/again")}); err != nil {
		t.Fatal(err)
	}
	for _, bad := range [][]Record{
		{{ID: "wh_two", Revision: 1, Webhook: &Webhook{ID: "wh_two", URL: "ftp://x", Events: events.All}}},
		{{ID: "nope", Revision: 1, Deleted: true}},
		{{ID: "wh_two", Revision: 0, Deleted: true}},
		{{ID: "wh_two", Revision: 5, Webhook: &Webhook{ID: "wh_three", URL: "http://x", Events: events.All}}},
		{{ID: "wh_ok", Revision: 9, Deleted: true}, {ID: "wh_two", Revision: 1}},
	} {
		if n, err := b.Apply(t.Context(), bad); !errors.Is(err, errkind.ErrInvalid) || n != 0 {
			t.Errorf("Apply(%+v) = %d, %v; want ErrInvalid", bad, n, err)
		}
	}
	if recs, _ := b.Records(t.Context()); len(recs) != 1 {
		t.Fatalf("b after refused records: %+v", recs)
	}
}
