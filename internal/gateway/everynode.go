package gateway

import (
	"fmt"
	"net/http"
	"sync"

	"github.com/agentenv/agentenv/internal/httperr"
)

// Some routes concern every node (client leases, webhooks): the gateway
// sends them to each ready node and merges the answers.

// nodeReply is one node's answer to a request sent to every node.
type nodeReply struct {
	status int
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
			status, _, b, err := g.call(r, n.Url, body)
			out[i], errs[i] = nodeReply{status, b}, err
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
