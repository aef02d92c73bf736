package gateway

import (
	"sync"
	"time"
)

// pins remember which node made the sandbox of a create sent with an
// Idempotency-Key, so that its retry goes to that node (which keeps the
// answer) instead of being placed anew. They live in the gateway's memory:
// after a gateway restart a retry is placed again, and only a retry that
// lands on the same node is answered from its record.
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
