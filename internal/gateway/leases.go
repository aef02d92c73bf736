package gateway

import (
	"encoding/json"
	"fmt"
	"net/http"
	"slices"

	"github.com/agentenv/agentenv/internal/apispec"
	"github.com/agentenv/agentenv/internal/httperr"
)

// A client lease binds sandboxes on whichever nodes made them: the lease
// routes go to every ready node, and their answers are merged (a lease a
// node does not know is that node's 404).

// mergeLeases merges the nodes' views of leases by id: the sandboxes of
// all of them, the latest expiry, expired only where every node says so.
func mergeLeases(views []apispec.Lease) []apispec.Lease {
	var out []apispec.Lease
	at := map[string]int{}
	for _, l := range views {
		i, ok := at[l.LeaseID]
		if !ok {
			at[l.LeaseID] = len(out)
			out = append(out, l)
			continue
		}
		m := &out[i]
		m.Sandboxes = append(m.Sandboxes, l.Sandboxes...)
		if l.ExpiresAt.After(m.ExpiresAt) {
			m.ExpiresAt, m.Ttl = l.ExpiresAt, l.Ttl
		}
		m.Expired = m.Expired && l.Expired
		if l.CreatedAt.Before(m.CreatedAt) {
			m.CreatedAt = l.CreatedAt
		}
	}
	for i := range out {
		slices.Sort(out[i].Sandboxes)
	}
	return out
}

// listLeases serves GET /leases: every node's, merged.
func (g *Gateway) listLeases(w http.ResponseWriter, r *http.Request) {
	answers, ok := g.toEveryNode(w, r, nil)
	if !ok {
		return
	}
	var all []apispec.Lease
	for _, a := range answers {
		var ls []apispec.Lease
		if a.status != http.StatusOK || json.Unmarshal(a.body, &ls) != nil {
			httperr.Internal(w, g.log, http.StatusBadGateway, "a node's lease list could not be read", fmt.Errorf("%d %s", a.status, a.body))
			return
		}
		all = append(all, ls...)
	}
	out := mergeLeases(all)
	if out == nil {
		out = []apispec.Lease{}
	}
	writeJSONBody(w, http.StatusOK, out)
}

// leaseOnNodes serves GET /leases/{id} and POST /leases/{id}/keepalive:
// the lease as the nodes that know it answer; 404 when none does, and a
// node's refusal (an expired lease's 409, a bad ttl's 400) when none
// answered 200.
func (g *Gateway) leaseOnNodes(w http.ResponseWriter, r *http.Request) {
	answers, ok := g.passToEveryNode(w, r)
	if !ok {
		return
	}
	oks, refusal := splitReplies(answers)
	views, ok := decodeReplies[apispec.Lease](g, w, oks, "a node's lease")
	if !ok {
		return
	}
	switch {
	case len(views) > 0:
		writeJSONBody(w, http.StatusOK, mergeLeases(views)[0])
	case refusal != nil:
		writeReply(w, *refusal)
	default:
		httperr.Write(w, http.StatusNotFound, fmt.Sprintf("no node has lease %q", r.PathValue("leaseID")))
	}
}

// deleteLease serves DELETE /leases/{id}: every node kills the sandboxes
// the lease binds there.
func (g *Gateway) deleteLease(w http.ResponseWriter, r *http.Request) {
	answers, ok := g.toEveryNode(w, r, nil)
	if !ok {
		return
	}
	// A refusal: a sandbox it binds could not be killed there.
	oks, ok := holders(w, answers, fmt.Sprintf("no node has lease %q", r.PathValue("leaseID")))
	if !ok {
		return
	}
	ended, ok := decodeReplies[struct{ Killed []string }](g, w, oks, "a node's answer")
	if !ok {
		return
	}
	killed := []string{}
	for _, e := range ended {
		killed = append(killed, e.Killed...)
	}
	slices.Sort(killed)
	writeJSONBody(w, http.StatusOK, map[string]any{"leaseID": r.PathValue("leaseID"), "killed": killed})
}

func writeJSONBody(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}
