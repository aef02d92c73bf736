package gateway

import (
	"encoding/json"
	"fmt"
	"net/http"
	"sync"

	"github.com/agentenv/agentenv/internal/httperr"
	pb "github.com/agentenv/agentenv/internal/scheduler/gen/schedulerpb"
)

// Some routes concern every node (listings, client leases, webhooks): the
// gateway sends them to each ready node and merges the answers.

// nodeReply is one node's answer to a request sent to every node.
type nodeReply struct {
	node   *pb.Node
	status int
	hdr    http.Header
	body   []byte
}

// callNodes sends r (with body) to each of nodes at once and returns
// their replies and errors, in the nodes' order.
func (g *Gateway) callNodes(r *http.Request, nodes []*pb.Node, body []byte) ([]nodeReply, []error) {
	out := make([]nodeReply, len(nodes))
	errs := make([]error, len(nodes))
	var wg sync.WaitGroup
	for i, n := range nodes {
		wg.Add(1)
		go func() {
			defer wg.Done()
			status, hdr, b, err := g.call(r, n.Url, body)
			out[i], errs[i] = nodeReply{n, status, hdr, b}, err
		}()
	}
	wg.Wait()
	return out, errs
}

// toEveryNode sends r (with body) to every ready node; false: an answer
// was written (no nodes, or one did not answer).
func (g *Gateway) toEveryNode(w http.ResponseWriter, r *http.Request, body []byte) ([]nodeReply, bool) {
	nodes, err := g.readyNodes(r.Context())
	if err != nil {
		httperr.Internal(w, g.log, http.StatusServiceUnavailable, "the cluster's nodes are unavailable", err)
		return nil, false
	}
	out, errs := g.callNodes(r, nodes, body)
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

// holders are the successes of the nodes that have what a request named;
// false: an answer was written (a node's refusal, or notFound as a 404
// when no node has it).
func holders(w http.ResponseWriter, replies []nodeReply, notFound string) ([]nodeReply, bool) {
	oks, refusal := splitReplies(replies)
	if refusal != nil {
		writeReply(w, *refusal)
		return nil, false
	}
	if len(oks) == 0 {
		httperr.Write(w, http.StatusNotFound, notFound)
		return nil, false
	}
	return oks, true
}

// decodeReplies reads each reply's body as a T; false: one could not be
// read (a 502 saying what was written).
func decodeReplies[T any](g *Gateway, w http.ResponseWriter, replies []nodeReply, what string) ([]T, bool) {
	out := make([]T, 0, len(replies))
	for _, a := range replies {
		var v T
		if json.Unmarshal(a.body, &v) != nil {
			httperr.Internal(w, g.log, http.StatusBadGateway, what+" could not be read", fmt.Errorf("%s", a.body))
			return nil, false
		}
		out = append(out, v)
	}
	return out, true
}
