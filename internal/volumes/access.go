package volumes

import (
	"context"
	"fmt"
	"os"
	"time"

	"github.com/agentenv/agentenv/internal/errkind"
)

// usage is the host's use of one volume: its mount while open, the content
// requests using it, and what holds it closed (a deletion). Guarded by
// Store.mu.
type usage struct {
	mount   *hostMount
	users   int
	opening bool
	closing bool
	// held says why the volume may not be opened now ("" when it may).
	held  string
	timer *time.Timer // closes the mount once idle
}

func (s *Store) usageOf(id string) *usage {
	u := s.usage[id]
	if u == nil {
		u = &usage{}
		s.usage[id] = u
	}
	return u
}

// use runs fn on the root of volume id's filesystem, opening it on the
// host first if no other request has it open. The mount stays open for
// IdleClose after the last request ends.
func (s *Store) use(ctx context.Context, id string, fn func(root *os.Root) error) error {
	s.mu.Lock()
	u := s.usageOf(id)
	for {
		if u.held != "" {
			s.mu.Unlock()
			return fmt.Errorf("%w: volume %s is %s", errkind.ErrConflict, id, u.held)
		}
		if u.opening || u.closing {
			s.cond.Wait()
			continue
		}
		if u.mount == nil {
			u.opening = true
			s.mu.Unlock()
			m, err := openHost(ctx, s.cfg.Tools, s.dir(id))
			s.mu.Lock()
			u.opening = false
			s.cond.Broadcast()
			if err != nil {
				s.mu.Unlock()
				return err
			}
			u.mount = m
		}
		break
	}
	u.users++
	if u.timer != nil {
		u.timer.Stop()
		u.timer = nil
	}
	m := u.mount
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		u.users--
		if u.users == 0 && u.mount != nil && u.held == "" {
			u.timer = time.AfterFunc(s.cfg.IdleClose, func() { s.closeIdle(id, u) })
		}
		s.cond.Broadcast()
		s.mu.Unlock()
	}()
	return fn(m.root)
}

// closeIdle closes u's mount if no request took it up again.
func (s *Store) closeIdle(id string, u *usage) {
	s.mu.Lock()
	if u.users > 0 || u.mount == nil || u.closing || u.opening {
		s.mu.Unlock()
		return
	}
	m := u.mount
	u.mount, u.closing, u.timer = nil, true, nil
	s.mu.Unlock()
	err := m.close(context.Background())
	s.mu.Lock()
	u.closing = false
	s.cond.Broadcast()
	s.mu.Unlock()
	if err != nil {
		s.log.Error("closing an idle volume", "volume", id, "err", err)
	}
}

// closeHost holds volume id closed for why (content requests get
// ErrConflict until release), waiting for the requests using it to end
// and closing its mount. A volume held already is ErrConflict.
func (s *Store) closeHost(ctx context.Context, id, why string) error {
	s.mu.Lock()
	u := s.usageOf(id)
	if u.held != "" {
		s.mu.Unlock()
		return fmt.Errorf("%w: volume %s is %s", errkind.ErrConflict, id, u.held)
	}
	u.held = why
	stop := context.AfterFunc(ctx, func() {
		s.mu.Lock()
		s.cond.Broadcast()
		s.mu.Unlock()
	})
	defer stop()
	for u.users > 0 || u.opening || u.closing {
		if ctx.Err() != nil {
			u.held = ""
			s.mu.Unlock()
			return fmt.Errorf("volume %s: waiting for its content requests: %w", id, ctx.Err())
		}
		s.cond.Wait()
	}
	if u.timer != nil {
		u.timer.Stop()
		u.timer = nil
	}
	m := u.mount
	u.mount = nil
	s.mu.Unlock()
	if m == nil {
		return nil
	}
	if err := m.close(ctx); err != nil {
		s.release(id)
		return err
	}
	return nil
}

// release lets volume id be opened again after closeHost.
func (s *Store) release(id string) {
	s.mu.Lock()
	if u := s.usage[id]; u != nil {
		u.held = ""
		if u.users == 0 && u.mount == nil && !u.opening && !u.closing {
			delete(s.usage, id)
		}
	}
	s.cond.Broadcast()
	s.mu.Unlock()
}
