package api

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"testing"

	"go.yaml.in/yaml/v3"

	"github.com/agentenv/agentenv/internal/events"
	"github.com/agentenv/agentenv/internal/statedb"
	"github.com/agentenv/agentenv/internal/webhooks"
)

// webhookServer is a node's API over a fresh webhook store, with
// nodeToken ("": in no cluster).
func webhookServer(t *testing.T, nodeToken string) (*Server, *webhooks.Store) {
	t.Helper()
	db, err := statedb.Open(filepath.Join(t.TempDir(), "aenv.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	store, err := webhooks.Open(t.Context(), db, nil)
	if err != nil {
		t.Fatal(err)
	}
	srv, err := New(newFakeNode(), Config{APIKey: testKey, NodeToken: nodeToken, SandboxProxy: http.NotFoundHandler(), Webhooks: store})
	if err != nil {
		t.Fatal(err)
	}
	return srv, store
}

// The webhook routes register, list, change and unregister webhooks,
// never send a secret back, refuse bad input, list deliveries; every
// answer is as the document describes it.
func TestWebhookRoutes(t *testing.T) {
	srv, store := webhookServer(t, "")
	a := &testAPI{t: t, node: newFakeNode(), srv: srv}
	var doc map[string]any
	if err := yaml.Unmarshal(OpenAPISpec, &doc); err != nil {
		t.Fatal(err)
	}
	do := func(method, path, body string, want int) string {
		t.Helper()
		rec := a.do(method, path, body)
		checkAnswer(t, doc, method, path, rec)
		if rec.Code != want {
			t.Fatalf("%s %s: %d %s", method, path, rec.Code, rec.Body)
		}
		if strings.Contains(rec.Body.String(), "s3cret") {
			t.Fatalf("%s %s sent the secret: %s", method, path, rec.Body)
		}
		return rec.Body.String()
	}
	var h struct {
		ID     string   `json:"id"`
		Events []string `json:"events"`
		Signed bool     `json:"signed"`
	}
	body := do("POST", "/events/webhooks", `{"name":"t","url":"http://127.0.0.1:9/hook","signatureSecret":"s3cret"}`, http.StatusCreated)
	if json.Unmarshal([]byte(body), &h) != nil || h.ID == "" || len(h.Events) != len(events.All) || !h.Signed {
		t.Fatalf("%s", body)
	}
	for _, bad := range []string{`{"url":"ftp://x"}`, `{"url":"http://x","events":["nope"]}`, `{"name":"no url"}`, `{"url":3}`,
		`{"id":"bad id","url":"http://x"}`} {
		do("POST", "/events/webhooks", bad, http.StatusBadRequest)
	}
	do("POST", "/events/webhooks", `{"id":"`+h.ID+`","url":"http://127.0.0.1:9/"}`, http.StatusConflict)
	if got := do("GET", "/events/webhooks", "", http.StatusOK); strings.Count(got, `"id"`) != 1 {
		t.Fatalf("list: %s", got)
	}
	do("PATCH", "/events/webhooks/"+h.ID, `{"enabled":false,"events":["sandbox.lifecycle.killed"]}`, http.StatusOK)
	if got := do("GET", "/events/webhooks/"+h.ID, "", http.StatusOK); !strings.Contains(got, `"enabled":false`) || !strings.Contains(got, `"events":["sandbox.lifecycle.killed"]`) {
		t.Fatalf("after patch: %s", got)
	}
	do("PATCH", "/events/webhooks/"+h.ID, `{"url":"nope"}`, http.StatusBadRequest)
	do("PATCH", "/events/webhooks/"+h.ID, `{"enabled":true}`, http.StatusOK)
	store.Emit(events.New(events.Killed, "sbx1", "base", nil))
	if got := do("GET", "/events/webhooks/"+h.ID+"/deliveries", "", http.StatusOK); !strings.Contains(got, `"state":"pending"`) || !strings.Contains(got, `"sandboxID":"sbx1"`) {
		t.Fatalf("deliveries: %s", got)
	}
	do("GET", "/events/webhooks/"+h.ID+"/deliveries?limit=0", "", http.StatusBadRequest)
	do("GET", "/events/webhooks/nosuch", "", http.StatusNotFound)
	do("DELETE", "/events/webhooks/"+h.ID, "", http.StatusNoContent)
	do("DELETE", "/events/webhooks/"+h.ID, "", http.StatusNotFound)
	do("GET", "/events/webhooks/"+h.ID+"/deliveries", "", http.StatusNotFound)
}

// The webhook records are the gateway's: only its node token reads them
// (with the secrets) or brings records in, and only the node token's
// requests give a change its revision.
func TestWebhookRecordsAreTheGateways(t *testing.T) {
	srv, store := webhookServer(t, "nt")
	do := func(method, path, body string, hdr map[string]string) *httptest.ResponseRecorder {
		req := httptest.NewRequest(method, path, strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		for k, v := range hdr {
			req.Header.Set(k, v)
		}
		rec := httptest.NewRecorder()
		srv.ServeHTTP(rec, req)
		return rec
	}
	key, gw := map[string]string{"X-API-Key": testKey}, map[string]string{HeaderNodeToken: "nt"}
	for _, h := range []map[string]string{nil, key, {HeaderNodeToken: "wrong"}} {
		if rec := do("GET", "/events/webhook-records", "", h); rec.Code != http.StatusUnauthorized {
			t.Errorf("records with %v: %d %s", h, rec.Code, rec.Body)
		}
	}
	// A client's revision header is not taken; the gateway's is.
	do("POST", "/events/webhooks", `{"id":"wh_c","url":"http://127.0.0.1:9/c"}`, map[string]string{"X-API-Key": testKey, HeaderRevision: "7"})
	gwRev := map[string]string{HeaderNodeToken: "nt", HeaderRevision: "8000000000000000"}
	if rec := do("POST", "/events/webhooks", `{"id":"wh_g","url":"http://127.0.0.1:9/g","signatureSecret":"s3cret"}`, gwRev); rec.Code != http.StatusCreated {
		t.Fatalf("create as the gateway: %d %s", rec.Code, rec.Body)
	}
	rec := do("GET", "/events/webhook-records", "", gw)
	var recs []webhooks.Record
	if rec.Code != http.StatusOK || json.Unmarshal(rec.Body.Bytes(), &recs) != nil || len(recs) != 2 {
		t.Fatalf("records: %d %s", rec.Code, rec.Body)
	}
	for _, r := range recs {
		switch {
		case r.ID == "wh_c" && r.Revision <= 7:
			t.Errorf("a client's revision was taken: %+v", r)
		case r.ID == "wh_g" && (r.Revision != 8000000000000000 || r.Webhook.Secret != "s3cret"):
			t.Errorf("the gateway's record: %+v", r)
		}
	}
	in := `[{"id":"wh_n","revision":5,"webhook":{"id":"wh_n","name":"","url":"http://127.0.0.1:9/n","enabled":true,"events":["sandbox.lifecycle.killed"],"secret":"","createdAt":"2026-12-01T00:00:00Z"}},{"id":"wh_c","revision":1,"deleted":true}]`
	if rec := do("POST", "/events/webhook-records", in, key); rec.Code != http.StatusUnauthorized {
		t.Fatalf("records brought by a client: %d", rec.Code)
	}
	if rec := do("POST", "/events/webhook-records", in, gw); rec.Code != http.StatusOK || !strings.Contains(rec.Body.String(), `"applied":1`) {
		t.Fatalf("records brought by the gateway: %d %s", rec.Code, rec.Body)
	}
	if rec := do("POST", "/events/webhook-records", `[{"id":"bad","revision":1,"deleted":true}]`, gw); rec.Code != http.StatusBadRequest {
		t.Fatalf("an invalid record: %d %s", rec.Code, rec.Body)
	}
	if _, err := store.Get(t.Context(), "wh_c"); err != nil {
		t.Fatalf("an older tombstone deleted a webhook: %v", err)
	}
}
