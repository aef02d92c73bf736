package gateway

import (
	"fmt"
	"net/http"
	"sync"

	"github.com/agentenv/agentenv/internal/httperr"
)

// Some routes concern every node (listings, client leases, webhooks): the
// gateway sends them to each ready node and merges the answers.

// nodeReply is one node's answer to a request sent to every node.
type nodeReply struct {
	node   string
	status int
	hdr    http.Header
	body   []byte
}

// toEveryNode sends r (with body) to every ready node; false: an answer
// was written (no nodes, or one did not answer).
func (g *Gateway) toEveryNode(w http.ResponseWriter, r *http.Request, body []byte) ([]nodeReply, bool) {
	nodes, err := g.readyNodes(r.Context())
	if err != nil {
		httperr.Internal(w, g.log, http.StatusServiceUnavailable, "the cluster's nodes are unavailable", err)
		return nil, false
	}
	out := make([]nodeReply, len(nodes))
	errs := make([]error, len(nodes))
	var wg sync.WaitGroup
	for i, n := range nodes {
		wg.Add(1)
		go func() {
			defer wg.Done()
			status, hdr, b, err := g.call(r, n.Url, body)
			out[i], errs[i] = nodeReply{n.NodeId, status, hdr, b}, err
		}()
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			httperr.Internal(w, g.log, http.StatusBadGateway, fmt.Sprintf("node %s did not answer", nodes[i].NodeId), err)
			return nil, false
		}
	}
	return out, true
}

// writeReply passes a node's answer on.
func writeReply(w http.ResponseWriter, a nodeReply) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(a.status)
	w.Write(a.body)
}

// splitReplies parts the nodes' replies into the successes (2xx) and the
// first refusal other than a 404 (a node that does not have the thing).
func splitReplies(replies []nodeReply) (ok []nodeReply, refusal *nodeReply) {
	for i, a := range replies {
		switch {
		case a.status/100 == 2:
			ok = append(ok, a)
		case a.status != http.StatusNotFound && refusal == nil:
			refusal = &replies[i]
		}
	}
	return ok, refusal
}

// passToEveryNode sends r with its own body to every ready node.
func (g *Gateway) passToEveryNode(w http.ResponseWriter, r *http.Request) ([]nodeReply, bool) {
	body, err := readBody(r)
	if err != nil {
		httperr.Write(w, http.StatusRequestEntityTooLarge, err.Error())
		return nil, false
	}
	return g.toEveryNode(w, r, body)
}
