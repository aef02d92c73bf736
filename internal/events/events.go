// Package events names the lifecycle events of sandboxes that a node
// emits (created, paused, resumed, forked, snapshotted, killed, expired,
// failed, updated) and the sink they go to: the orchestrator emits them,
// package webhooks delivers them. The type names are E2B's where E2B has
// the event (sandbox.lifecycle.*; a snapshot is E2B's "checkpointed").
package events

import (
	"crypto/rand"
	"encoding/hex"
	"time"
)

// Type is the kind of an event.
type Type string

// The event types.
const (
	Created  Type = "sandbox.lifecycle.created"
	Killed   Type = "sandbox.lifecycle.killed"
	Updated  Type = "sandbox.lifecycle.updated" // its timeout or network changed
	Paused   Type = "sandbox.lifecycle.paused"
	Resumed  Type = "sandbox.lifecycle.resumed"
	Snapshot Type = "sandbox.lifecycle.checkpointed"
	Forked   Type = "sandbox.lifecycle.forked"  // AgentENV: a child of a fork was made
	Expired  Type = "sandbox.lifecycle.expired" // AgentENV: its time or lease ran out (paused or killed follows)
	Failed   Type = "sandbox.lifecycle.failed"  // AgentENV: a create, resume or fork child failed
)

// All are every event type, in a stable order.
var All = []Type{Created, Killed, Updated, Paused, Resumed, Snapshot, Forked, Expired, Failed}

// Known reports whether t is an event type.
func Known(t Type) bool {
	for _, k := range All {
		if k == t {
			return true
		}
	}
	return false
}

// Event is one lifecycle event of a sandbox.
type Event struct {
	ID         string
	Type       Type
	SandboxID  string
	TemplateID string
	Metadata   map[string]string
	Time       time.Time
	// Execution is the sandbox's run so far (on killed and paused).
	Execution *Execution
	// Detail is what else the event says: the error of a failure, the
	// parent of a fork child, the name of a snapshot.
	Detail map[string]string
}

// Execution is a sandbox's current run.
type Execution struct {
	StartedAt time.Time
	VCPUs     int
	MemoryMiB int
	// Duration is how long it has run.
	Duration time.Duration
}

// New is an event of type t about a sandbox, now, with a fresh id.
func New(t Type, sandboxID, templateID string, metadata map[string]string) Event {
	b := make([]byte, 16)
	_, _ = rand.Read(b)
	return Event{ID: hex.EncodeToString(b), Type: t, SandboxID: sandboxID, TemplateID: templateID, Metadata: metadata,
		Time: time.Now().UTC()}
}

// Sink receives events. Emit must not block for long: it runs on the
// path of the operation that made the event.
type Sink interface {
	Emit(Event)
}
