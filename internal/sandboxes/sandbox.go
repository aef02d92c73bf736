// Package sandboxes owns the records of a node's sandboxes and their state
// machine: the sandboxes table of the node's SQLite database (written in the
// same transaction as the store references each record holds), the table
// of states and allowed transitions, the one function that moves a sandbox
// between states, and the allocation of network slots to new records.
//
// It knows nothing of QEMU, networks or files: the orchestrator runs the
// operations and records their outcome here.
package sandboxes

import (
	"time"

	"github.com/agentenv/agentenv/internal/network"
)

// Sandbox is the recorded state of one sandbox.
type Sandbox struct {
	ID            string
	TemplateID    string
	State         State
	VCPUs         int
	MemoryMiB     int
	DiskMiB       int
	Slot          int
	PID           int
	AllowInternet bool
	// Egress is what the guest may reach beyond AllowInternet's default
	// (E2B's network.allowOut and denyOut).
	Egress    network.Egress
	Secure    bool
	AutoPause bool
	// AutoPauseFilesystem: the pause at the end of its time keeps only its
	// file system (E2B's lifecycle mode "filesystem").
	AutoPauseFilesystem bool
	// AutoResume: traffic for the sandbox while paused resumes it.
	AutoResume bool
	// PublicTraffic: ports other than envd's need no traffic token.
	PublicTraffic bool
	// MaskRequestHost, when set, is the Host header the guest's ports other
	// than envd's see (E2B's network.maskRequestHost; "${PORT}" in it
	// stands for the port); the one the client sent is in
	// X-Forwarded-Host.
	MaskRequestHost string
	AccessToken     string
	TrafficToken    string
	DefaultUser     string
	// DefaultWorkdir is where commands run unless they say otherwise ("":
	// the default user's home).
	DefaultWorkdir string
	Metadata       map[string]string
	EnvVars        map[string]string
	CreatedAt      time.Time
	StartedAt      time.Time
	EndAt          time.Time
	// MemFile, when set, is a frozen memory image (of a fork snapshot) the
	// sandbox's RAM is mapped from, copy-on-write when MemPrivate; empty
	// means the sandbox's own RAM file.
	MemFile    string
	MemPrivate bool
	// SnapshotID is the fork snapshot whose disk layer backs this sandbox's
	// overlay (and whose memory image MemFile may be).
	SnapshotID string
	// BaseLayer is the layer a cold-booted sandbox's overlay stacks on (its
	// template's root layer when it was created; the template may have
	// been rebuilt since). Empty when SnapshotID is set.
	BaseLayer string
	// VolumeSlots is how many volume slots the sandbox's machine has (part
	// of its layout: the number of the saved state it runs on), and
	// Volumes the volumes mounted in them.
	VolumeSlots int
	Volumes     []VolumeMount
	// Lease is the client lease the sandbox is bound to ("": none; package
	// leases): when it expires the sandbox ends as AutoPause says.
	Lease string
	// Request is the idempotent request that made it ("": none; package
	// idempotency): a retry after the node's end answers with it.
	Request string
	// PauseMode is what a paused sandbox's pause kept: PauseFull (memory
	// and disk) or PauseFilesystem; "" while unknown (set from the pause's
	// own record by the node; not a column).
	PauseMode string
	// EnvdAddr is host:port where the node reaches the sandbox's envd, and
	// EnvdVersion the version of that envd (the one the node's initramfs
	// carries; not persisted).
	EnvdAddr    string
	EnvdVersion string
	// Phases times the steps of the operation that produced this value
	// (set by a create; not persisted).
	Phases []Phase
}

// Pause modes (E2B's SandboxPauseMode).
const (
	PauseFull       = "full"
	PauseFilesystem = "filesystem"
)

// VolumeMount is a volume mounted in a sandbox.
type VolumeMount struct {
	VolumeID string `json:"volumeID"`
	Name     string `json:"name"`
	// Path is where the guest mounts it.
	Path string `json:"path"`
	// Slot is the machine's volume slot holding its disk.
	Slot int `json:"slot"`
	// Copy: the slot holds the sandbox's own copy-on-write copy of the
	// volume as it was when the sandbox was forked from its parent, not
	// the volume (which the sandbox then does not hold).
	Copy bool `json:"copy,omitempty"`
}

// Phase is one timed step of an operation.
type Phase struct {
	Name     string
	Duration time.Duration
}

// PhaseTimer returns a function that appends to s.Phases a step named by
// its argument, lasting since the previous call (or since now).
func (s *Sandbox) PhaseTimer() func(name string) {
	mark := time.Now()
	return func(name string) {
		now := time.Now()
		s.Phases = append(s.Phases, Phase{name, now.Sub(mark)})
		mark = now
	}
}

// MetaInternal marks, in its metadata, a sandbox the node runs for itself
// (a template build's, a template snapshot's boot): users' listings leave
// it out. Its value says what it is for.
const MetaInternal = "aenv.internal"

// Internal reports whether the node runs s for itself (MetaInternal).
func (s *Sandbox) Internal() bool {
	_, ok := s.Metadata[MetaInternal]
	return ok
}
