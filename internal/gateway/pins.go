package gateway

import (
	"net/http"
	"sync"
	"time"

	"github.com/agentenv/agentenv/internal/api"
)

// pins remember which node made the sandbox of a create sent with an
// Idempotency-Key, so that its retry goes to that node (which keeps the
// answer) instead of being placed anew. They live in the gateway's memory;
// a retry this gateway has no pin for (it restarted, or another gateway
// placed the first request) asks every node for the key first
// (findIdempotent), and is placed anew only when no node holds it.
type pins struct {
	ttl time.Duration
	max int

	mu sync.Mutex
	m  map[string]pin
}

type pin struct {
	node  route
	until time.Time
}

func newPins(ttl time.Duration, max int) *pins {
	return &pins{ttl: ttl, max: max, m: map[string]pin{}}
}

// get is the node that made key's sandbox, if remembered.
func (p *pins) get(key string) (route, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	e, ok := p.m[key]
	if !ok || time.Now().After(e.until) {
		return route{}, false
	}
	return e.node, true
}

// put remembers the node of key; past max entries the expired ones go,
// then the soonest to expire.
func (p *pins) put(key string, node route) {
	p.mu.Lock()
	defer p.mu.Unlock()
	now := time.Now()
	if len(p.m) >= p.max {
		var soonest string
		for k, e := range p.m {
			if now.After(e.until) {
				delete(p.m, k)
			} else if soonest == "" || e.until.Before(p.m[soonest].until) {
				soonest = k
			}
		}
		if len(p.m) >= p.max {
			delete(p.m, soonest)
		}
	}
	p.m[key] = pin{node: node, until: now.Add(p.ttl)}
}

// findIdempotent asks every ready node, under api.FindOnlyPrefix, for the
// answer to r's Idempotency-Key: a node that holds the key answers (the
// first request's answer, a 409 while it still runs, a 422 for another
// body), the others 404 and run nothing. False: no node holds it (or the
// nodes are unavailable, and the create is placed as usual). A node that
// holds the key but does not answer cannot be told from one that does not
// hold it; the create is then placed anew.
func (g *Gateway) findIdempotent(r *http.Request, body []byte) (nodeReply, bool) {
	nodes, err := g.readyNodes(r.Context())
	if err != nil || len(nodes) == 0 {
		return nodeReply{}, false
	}
	// A path of its own (api.FindOnlyPrefix): a node too old to know it
	// answers 404 instead of running the create.
	find := r.Clone(r.Context())
	find.URL.Path, find.URL.RawPath = api.FindOnlyPrefix+r.URL.Path, ""
	replies, errs := g.callNodes(find, nodes, body)
	for i, a := range replies {
		switch {
		case errs[i] != nil:
			g.log.Warn("asking a node for an Idempotency-Key", "node", nodes[i].NodeId, "err", errs[i])
		case a.status != http.StatusNotFound:
			return a, true
		}
	}
	return nodeReply{}, false
}
