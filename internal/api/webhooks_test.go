package api

import (
	"encoding/json"
	"net/http"
	"path/filepath"
	"strings"
	"testing"

	"go.yaml.in/yaml/v3"

	"github.com/agentenv/agentenv/internal/events"
	"github.com/agentenv/agentenv/internal/statedb"
	"github.com/agentenv/agentenv/internal/webhooks"
)

// The webhook routes register, list, change and unregister webhooks,
// never send a secret back, refuse bad input, list deliveries; every
// answer is as the document describes it.
func TestWebhookRoutes(t *testing.T) {
	db, err := statedb.Open(filepath.Join(t.TempDir(), "aenv.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	store, err := webhooks.Open(t.Context(), db, nil)
	if err != nil {
		t.Fatal(err)
	}
	srv, err := New(newFakeNode(), Config{APIKey: testKey, SandboxProxy: http.NotFoundHandler(), Webhooks: store})
	if err != nil {
		t.Fatal(err)
	}
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
