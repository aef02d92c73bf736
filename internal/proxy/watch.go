package proxy

import (
	"context"
	"errors"
	"sync"
	"time"
)

// watchInterval is how often the sandboxes with requests in flight are
// checked; a request to a sandbox that was paused, killed or died is then
// cancelled, so streams and WebSockets end instead of hanging on a guest
// that will never answer.
const watchInterval = time.Second

type inflight struct {
	mu      sync.Mutex
	byID    map[string]map[*context.CancelFunc]struct{}
	running bool
}

// track registers a request to sandbox id; the returned context is
// cancelled when the sandbox stops taking traffic, and done must be called
// when the request ends.
func (p *Proxy) track(ctx context.Context, id string) (context.Context, func()) {
	ctx, cancel := context.WithCancel(ctx)
	key := &cancel
	f := &p.inflight
	f.mu.Lock()
	if f.byID == nil {
		f.byID = map[string]map[*context.CancelFunc]struct{}{}
	}
	if f.byID[id] == nil {
		f.byID[id] = map[*context.CancelFunc]struct{}{}
	}
	f.byID[id][key] = struct{}{}
	if !f.running {
		f.running = true
		go p.watch()
	}
	f.mu.Unlock()
	return ctx, func() {
		f.mu.Lock()
		delete(f.byID[id], key)
		if len(f.byID[id]) == 0 {
			delete(f.byID, id)
		}
		f.mu.Unlock()
		cancel()
	}
}

// watch runs while requests are in flight.
func (p *Proxy) watch() {
	f := &p.inflight
	for {
		time.Sleep(watchInterval)
		f.mu.Lock()
		if len(f.byID) == 0 {
			f.running = false
			f.mu.Unlock()
			return
		}
		ids := make([]string, 0, len(f.byID))
		for id := range f.byID {
			ids = append(ids, id)
		}
		f.mu.Unlock()
		for _, id := range ids {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			route, err := p.resolver.Route(ctx, id)
			timedOut := ctx.Err() != nil
			cancel()
			if err == nil && route.Running {
				continue
			}
			if err != nil && (timedOut || !errors.Is(err, ErrUnknownSandbox)) {
				continue // failed lookup: not proof the sandbox is gone
			}
			p.log.Debug("cutting requests to a sandbox that stopped", "sandbox", id, "running", route.Running, "err", err)
			f.mu.Lock()
			for c := range f.byID[id] {
				(*c)()
			}
			f.mu.Unlock()
		}
	}
}
