package orchestrator

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"time"

	"github.com/agentenv/agentenv/internal/network"
	"github.com/agentenv/agentenv/internal/sandboxes"
	"github.com/agentenv/agentenv/internal/storage/repository"
	"github.com/agentenv/agentenv/internal/store"
)

// A named snapshot freezes a running sandbox (processes, memory, files) under
// a name that POST /sandboxes then accepts as a templateID: each sandbox
// created from it resumes from that instant with an identity of its own.

// namedSnapshotLabel is the store label kind of named snapshots (data:
// the NamedSnapshot record).
const namedSnapshotLabel = store.LabelSnapshot

// NamedSnapshot is a user's snapshot of a sandbox.
type NamedSnapshot struct {
	Name        string `json:"name"`
	SnapshotID  string `json:"snapshotID"`
	SandboxID   string `json:"sandboxID"`
	TemplateID  string `json:"templateID"`
	VCPUs       int    `json:"vcpus"`
	MemoryMiB   int    `json:"memoryMiB"`
	DiskMiB     int    `json:"diskMiB"`
	DefaultUser string `json:"defaultUser"`
	// DefaultWorkdir is the snapshotted sandbox's default directory.
	DefaultWorkdir string    `json:"defaultWorkdir,omitempty"`
	CreatedAt      time.Time `json:"createdAt"`
	// accessToken is the token the snapshot's envd holds (kept in the
	// record, which is readable by root only, never returned by the API).
	AccessToken string `json:"accessToken,omitempty"`
	// TemplateLayer identifies the template build the snapshot was made on
	// (in repository copies).
	TemplateLayer string `json:"templateLayer,omitempty"`
	// StateHasRAM: the state holds the pages that differ from the RAM image
	// (in repository copies of incremental snapshots).
	StateHasRAM bool `json:"stateHasRAM,omitempty"`
	// GatewayMAC is the MAC of the tap the snapshot's guest ran behind (in
	// repository copies; see tapModeFor).
	GatewayMAC string `json:"gatewayMAC,omitempty"`
	// GuestStopped is how long taking this snapshot stopped the sandbox's
	// vCPUs, when it was taken live (not stored).
	GuestStopped time.Duration `json:"-"`
	// NoInternet and Egress are the snapshotted sandbox's network rules,
	// which sandboxes created from the snapshot keep unless their create
	// gives rules of its own.
	NoInternet bool           `json:"noInternet,omitempty"`
	Egress     network.Egress `json:"egress,omitzero"`
	// FilesystemOnly: the snapshot is the sandbox's disk (and volumes)
	// alone; sandboxes made from it boot.
	FilesystemOnly bool `json:"filesystemOnly,omitempty"`
	// VolumeSlots is the snapshotted machine's number of volume slots, and
	// Volumes the volumes it had mounted, whose disks as they were are in
	// the snapshot (sandboxes made from it mount copy-on-write copies).
	VolumeSlots int                     `json:"volumeSlots,omitempty"`
	Volumes     []sandboxes.VolumeMount `json:"volumes,omitempty"`
}

// setNamedSnapshot points label ns.Name at snapshot ns.SnapshotID, in tx;
// a name that exists is refused (ErrConflict).
func setNamedSnapshot(tx *sql.Tx, ns *NamedSnapshot) error {
	switch kind, err := store.NameTaken(tx, ns.Name); {
	case err != nil:
		return err
	case kind == store.LabelSnapshot:
		return fmt.Errorf("%w: snapshot %q exists", ErrConflict, ns.Name)
	case kind == store.LabelTemplate:
		return fmt.Errorf("%w: %q is a template's name", ErrConflict, ns.Name)
	}
	b, err := json.Marshal(ns)
	if err != nil {
		return err
	}
	return store.SetLabel(tx, namedSnapshotLabel, ns.Name, ns.SnapshotID, string(b))
}

// forgetSnapshotName removes the label of named snapshot name (its files
// go once nothing else reaches them).
func (n *Node) forgetSnapshotName(ctx context.Context, name string) error {
	return n.store.Tx(ctx, func(tx *sql.Tx) error { return store.DeleteLabel(tx, namedSnapshotLabel, name) })
}

func (n *Node) snapshot(ctx context.Context, id, name string, memory bool) (*NamedSnapshot, error) {
	if !templateNameRE.MatchString(name) {
		return nil, fmt.Errorf("%w: snapshot name %q must match %s", ErrInvalid, name, templateNameRE)
	}
	if _, err := n.Template(name); err == nil {
		return nil, fmt.Errorf("%w: %q is a template's name", ErrConflict, name)
	}
	if _, err := n.namedSnapshot(name); err == nil {
		return nil, fmt.Errorf("%w: snapshot %q exists", ErrConflict, name)
	}
	if err := n.floor.Check("a snapshot"); err != nil {
		return nil, err
	}
	if n.cfg.Repository != nil {
		if _, err := n.cfg.Repository.Stat(ctx, repoKindSnapshot, name); err == nil {
			return nil, fmt.Errorf("%w: the repository holds a snapshot named %q (made on another node)", ErrConflict, name)
		}
	}
	s, err := n.records.Get(ctx, id)
	if err != nil {
		return nil, err
	}
	// A sandbox made from a named snapshot names that snapshot as its
	// template; a snapshot of it is made on the snapshot's own template
	// (what its disk chain and a repository copy stand on).
	templateID := s.TemplateID
	t, err := n.Template(templateID)
	if errors.Is(err, ErrNotFound) {
		if base, berr := n.namedSnapshot(templateID); berr == nil {
			templateID = base.TemplateID
			t, err = n.Template(templateID)
		}
	}
	defaultUser := s.DefaultUser
	if err == nil && defaultUser == "" {
		defaultUser = t.DefaultUser
	}
	var snapID string
	var lease *store.Lease
	var stopped time.Duration
	if memory {
		c, cerr := n.capture(ctx, "snapshot", id, 0, 0, sandboxes.Snapshotting)
		if c == nil || c.snapID == "" {
			return nil, cerr
		}
		snapID, lease, err, stopped = c.snapID, c.lease, cerr, c.guestStopped
	} else if snapID, lease, err = n.captureFilesystem(ctx, id); err != nil {
		return nil, err
	}
	defer lease.Drop(context.WithoutCancel(ctx)) // once the label below holds it
	ns := &NamedSnapshot{
		Name: name, SnapshotID: snapID, SandboxID: id, FilesystemOnly: !memory, TemplateID: templateID, VCPUs: s.VCPUs,
		MemoryMiB: s.MemoryMiB, DiskMiB: s.DiskMiB, DefaultUser: defaultUser, DefaultWorkdir: s.DefaultWorkdir, VolumeSlots: s.VolumeSlots,
		CreatedAt: time.Now().UTC().Truncate(time.Millisecond), AccessToken: s.AccessToken,
		NoInternet: !s.AllowInternet, Egress: s.Egress, Volumes: asCopies(s.Volumes), GuestStopped: stopped,
	}
	if werr := n.store.Tx(context.WithoutCancel(ctx), func(tx *sql.Tx) error { return setNamedSnapshot(tx, ns) }); werr != nil {
		return nil, werr
	}
	if err != nil {
		return ns, err
	}
	if err := n.exportSnapshot(context.WithoutCancel(ctx), ns); err != nil {
		if errors.Is(err, ErrConflict) {
			// Another node took the name meanwhile: this one is withdrawn.
			n.forgetSnapshotName(context.WithoutCancel(ctx), name)
			n.gc(ctx)
			return nil, err
		}
		// The local snapshot is complete and usable; only its durable copy failed.
		n.log.Error("commit snapshot to the repository", "snapshot", name, "err", err)
		return ns, fmt.Errorf("snapshot %s was taken but not committed to the repository: %w", name, err)
	}
	return ns, nil
}

// lookupSnapshot finds a named snapshot locally or, failing that, in the
// repository (importing it).
func (n *Node) lookupSnapshot(ctx context.Context, name string) (*NamedSnapshot, error) {
	ns, err := n.namedSnapshot(name)
	if err == nil {
		whole := snapStateName
		if ns.FilesystemOnly {
			whole = snapDiskName
		}
		if _, serr := os.Stat(filepath.Join(n.snapshotDir(ns.SnapshotID), whole)); serr == nil || n.cfg.Repository == nil {
			return ns, nil
		}
		n.log.Warn("local copy of snapshot lost; fetching it from the repository", "snapshot", name)
		if err := n.forgetSnapshotName(ctx, name); err != nil {
			return nil, err
		}
	} else if !errors.Is(err, ErrNotFound) {
		return nil, err
	}
	return n.importSnapshot(ctx, name)
}

func (n *Node) namedSnapshot(name string) (*NamedSnapshot, error) {
	if !templateNameRE.MatchString(name) {
		return nil, fmt.Errorf("%w: snapshot %q", ErrNotFound, name)
	}
	l, err := n.store.Label(context.Background(), namedSnapshotLabel, name)
	if err != nil {
		return nil, err
	}
	return decodeNamedSnapshot(l)
}

func decodeNamedSnapshot(l *store.Label) (*NamedSnapshot, error) {
	var ns NamedSnapshot
	if err := json.Unmarshal([]byte(l.Data), &ns); err != nil {
		return nil, fmt.Errorf("%w: snapshot %q record: %v", ErrCorrupt, l.Name, err)
	}
	ns.Name, ns.SnapshotID = l.Name, l.Object
	return &ns, nil
}

// Snapshots lists the named snapshots, oldest first.
func (n *Node) Snapshots() ([]*NamedSnapshot, error) {
	ls, err := n.store.Labels(context.Background(), namedSnapshotLabel)
	if err != nil {
		return nil, err
	}
	var out []*NamedSnapshot
	for i := range ls {
		ns, err := decodeNamedSnapshot(&ls[i])
		if err != nil {
			return nil, err
		}
		out = append(out, ns)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].CreatedAt.Before(out[j].CreatedAt) })
	return out, nil
}

// DeleteSnapshot forgets a named snapshot; its files go once no sandbox
// created from it needs them.
func (n *Node) DeleteSnapshot(ctx context.Context, name string) error {
	if _, err := n.namedSnapshot(name); err != nil {
		return err
	}
	if n.cfg.Repository != nil {
		if err := n.cfg.Repository.Delete(ctx, repoKindSnapshot, name); err != nil && !errors.Is(err, repository.ErrNotFound) {
			return fmt.Errorf("delete snapshot %s from the repository: %w", name, err)
		}
	}
	if err := n.forgetSnapshotName(ctx, name); err != nil {
		return err
	}
	n.gc(ctx)
	return nil
}
