package orchestrator

import (
	"sync"

	"github.com/agentenv/agentenv/internal/vmm"
)

// machineTable is the QEMU machines the node holds, by sandbox.
type machineTable struct {
	mu sync.Mutex
	m  map[string]*vmm.Machine
}

func (t *machineTable) get(id string) *vmm.Machine {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.m[id]
}

func (t *machineTable) set(id string, m *vmm.Machine) {
	t.mu.Lock()
	if t.m == nil {
		t.m = map[string]*vmm.Machine{}
	}
	t.m[id] = m
	t.mu.Unlock()
}

// take removes and returns the machine of id (nil if none).
func (t *machineTable) take(id string) *vmm.Machine {
	t.mu.Lock()
	defer t.mu.Unlock()
	m := t.m[id]
	delete(t.m, id)
	return m
}

// is reports whether m is the machine held for id.
func (t *machineTable) is(id string, m *vmm.Machine) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.m[id] == m
}

func (t *machineTable) all() []*vmm.Machine {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := make([]*vmm.Machine, 0, len(t.m))
	for _, m := range t.m {
		out = append(out, m)
	}
	return out
}

// opLocks serializes the operations on each sandbox.
type opLocks struct {
	mu sync.Mutex
	m  map[string]*sync.Mutex
}

// lock takes sandbox id's lock and returns its release.
func (l *opLocks) lock(id string) func() {
	l.mu.Lock()
	if l.m == nil {
		l.m = map[string]*sync.Mutex{}
	}
	mu, ok := l.m[id]
	if !ok {
		mu = &sync.Mutex{}
		l.m[id] = mu
	}
	l.mu.Unlock()
	mu.Lock()
	return mu.Unlock
}

// forget drops the lock of a sandbox that is gone.
func (l *opLocks) forget(id string) {
	l.mu.Lock()
	delete(l.m, id)
	l.mu.Unlock()
}
