package api

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"
)

// Creates bound to a lease show it; the lease lists its sandboxes, renews,
// and its deletion kills them; bad input changes nothing.
func TestLeaseRoutes(t *testing.T) {
	a := newTestAPI(t)
	one := a.create(`{"templateID":"base","lease":{"id":"trainer-1","ttl":60}}`)["sandboxID"].(string)
	two := a.create(`{"templateID":"base","lease":{"id":"trainer-1"}}`)["sandboxID"].(string)
	free := a.create(`{"templateID":"base"}`)["sandboxID"].(string)

	rec := a.do("GET", "/sandboxes/"+one, "")
	var detail struct {
		Lease *struct {
			LeaseID   string
			ExpiresAt string
			Expired   bool
		}
	}
	if json.Unmarshal(rec.Body.Bytes(), &detail) != nil || detail.Lease == nil || detail.Lease.LeaseID != "trainer-1" ||
		detail.Lease.ExpiresAt == "" || detail.Lease.Expired {
		t.Fatalf("detail: %s", rec.Body)
	}
	if rec := a.do("GET", "/sandboxes/"+free, ""); strings.Contains(rec.Body.String(), `"lease"`) {
		t.Fatalf("unbound detail: %s", rec.Body)
	}
	var listed []struct {
		SandboxID string
		Lease     *struct{ LeaseID string }
	}
	rec = a.do("GET", "/v2/sandboxes", "")
	json.Unmarshal(rec.Body.Bytes(), &listed)
	bound := 0
	for _, l := range listed {
		if l.Lease != nil && l.Lease.LeaseID == "trainer-1" {
			bound++
		}
	}
	if bound != 2 {
		t.Fatalf("listed: %s", rec.Body)
	}
	var lease struct {
		LeaseID   string
		TTL       int `json:"ttl"`
		Sandboxes []string
	}
	rec = a.do("POST", "/leases/trainer-1/keepalive", `{"ttl":120}`)
	if rec.Code != http.StatusOK || json.Unmarshal(rec.Body.Bytes(), &lease) != nil || lease.TTL != 120 || len(lease.Sandboxes) != 2 {
		t.Fatalf("keepalive: %d %s", rec.Code, rec.Body)
	}
	if rec := a.do("POST", "/leases/trainer-1/keepalive", ""); rec.Code != http.StatusOK {
		t.Fatalf("keepalive without a body: %d %s", rec.Code, rec.Body)
	}
	if rec := a.do("GET", "/leases", ""); rec.Code != http.StatusOK || !strings.Contains(rec.Body.String(), `"leaseID":"trainer-1"`) {
		t.Fatalf("list: %d %s", rec.Code, rec.Body)
	}
	// Bad input: a clear 400 or 404, nothing made.
	before := len(a.node.creates)
	for _, body := range []string{
		`{"templateID":"base","lease":{"id":"has space"}}`,
		`{"templateID":"base","lease":{"id":"ok","ttl":1}}`,
		`{"templateID":"base","lease":{"id":"ok","ttl":"long"}}`,
		`{"templateID":"base","lease":"trainer-1"}`,
	} {
		rec := a.do("POST", "/v2/sandboxes", body)
		assertError(t, rec, http.StatusBadRequest)
		if !strings.Contains(rec.Body.String(), "lease") {
			t.Errorf("%s: %s", body, rec.Body)
		}
	}
	if len(a.node.creates) != before {
		t.Fatalf("bad leases reached the node")
	}
	assertError(t, a.do("POST", "/leases/nosuch/keepalive", ""), http.StatusNotFound)
	assertError(t, a.do("POST", "/leases/trainer-1/keepalive", `{"ttl":100000}`), http.StatusBadRequest)
	assertError(t, a.do("DELETE", "/leases/nosuch", ""), http.StatusNotFound)

	rec = a.do("DELETE", "/leases/trainer-1", "")
	var ended struct{ Killed []string }
	if rec.Code != http.StatusOK || json.Unmarshal(rec.Body.Bytes(), &ended) != nil || len(ended.Killed) != 2 {
		t.Fatalf("delete: %d %s", rec.Code, rec.Body)
	}
	for _, id := range []string{one, two} {
		assertError(t, a.do("GET", "/sandboxes/"+id, ""), http.StatusNotFound)
	}
	if rec := a.do("GET", "/sandboxes/"+free, ""); rec.Code != http.StatusOK {
		t.Fatalf("the unbound sandbox: %d", rec.Code)
	}
	assertError(t, a.do("GET", "/leases/trainer-1", ""), http.StatusNotFound)
}
