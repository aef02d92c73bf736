package orchestrator

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"github.com/agentenv/agentenv/internal/storage/repository"
)

// A named snapshot freezes a running sandbox (processes, memory, files) under
// a name that POST /sandboxes then accepts as a templateID: each sandbox
// created from it resumes from that instant with an identity of its own.

const namedSnapshotsDir = "named-snapshots"

// NamedSnapshot is a user's snapshot of a sandbox.
type NamedSnapshot struct {
	Name        string    `json:"name"`
	SnapshotID  string    `json:"snapshotID"`
	SandboxID   string    `json:"sandboxID"`
	TemplateID  string    `json:"templateID"`
	VCPUs       int       `json:"vcpus"`
	MemoryMiB   int       `json:"memoryMiB"`
	DiskMiB     int       `json:"diskMiB"`
	DefaultUser string    `json:"defaultUser"`
	CreatedAt   time.Time `json:"createdAt"`
	// accessToken is the token the snapshot's envd holds (kept in the
	// record, which is readable by root only, never returned by the API).
	AccessToken string `json:"accessToken,omitempty"`
	// TemplateLayer identifies the template build the snapshot was made on
	// (in repository copies).
	TemplateLayer string `json:"templateLayer,omitempty"`
	// StateHasRAM: the state holds the pages that differ from the RAM image
	// (in repository copies of incremental snapshots).
	StateHasRAM bool `json:"stateHasRAM,omitempty"`
}

func (n *Node) namedSnapshotPath(name string) string {
	return filepath.Join(n.cfg.DataDir, namedSnapshotsDir, name+".json")
}

// Snapshot captures a running sandbox under name. The sandbox is paused for
// the capture and then runs on.
func (n *Node) Snapshot(ctx context.Context, id, name string) (*NamedSnapshot, error) {
	if !templateNameRE.MatchString(name) {
		return nil, fmt.Errorf("%w: snapshot name %q must match %s", ErrInvalid, name, templateNameRE)
	}
	if _, err := n.Template(name); err == nil {
		return nil, fmt.Errorf("%w: %q is a template's name", ErrConflict, name)
	}
	if _, err := n.namedSnapshot(name); err == nil {
		return nil, fmt.Errorf("%w: snapshot %q exists", ErrConflict, name)
	}
	s, err := n.loadSandbox(ctx, id)
	if err != nil {
		return nil, err
	}
	t, err := n.Template(s.TemplateID)
	defaultUser := s.DefaultUser
	if err == nil && defaultUser == "" {
		defaultUser = t.DefaultUser
	}
	snapID, _, err := n.capture(ctx, id, 0, 0, StateSnapshotting)
	if snapID == "" && err != nil {
		return nil, err
	}
	defer n.unpinSnapshot(snapID) // once the record below refers to it
	ns := &NamedSnapshot{
		Name: name, SnapshotID: snapID, SandboxID: id, TemplateID: s.TemplateID, VCPUs: s.VCPUs,
		MemoryMiB: s.MemoryMiB, DiskMiB: s.DiskMiB, DefaultUser: defaultUser,
		CreatedAt: time.Now().UTC().Truncate(time.Millisecond), AccessToken: s.AccessToken,
	}
	if err := os.MkdirAll(filepath.Join(n.cfg.DataDir, namedSnapshotsDir), 0o700); err != nil {
		return nil, err
	}
	if werr := writeJSONAtomic(n.namedSnapshotPath(name), ns); werr != nil {
		return nil, werr
	}
	if err != nil {
		return ns, err
	}
	if err := n.exportSnapshot(ctx, ns); err != nil {
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
		if _, serr := os.Stat(filepath.Join(n.cfg.DataDir, snapshotsDir, ns.SnapshotID, snapStateName)); serr == nil {
			return ns, nil
		}
		n.log.Warn("local copy of snapshot lost; fetching it from the repository", "snapshot", name)
		_ = os.Remove(n.namedSnapshotPath(name))
	} else if !errors.Is(err, ErrNotFound) {
		return nil, err
	}
	return n.importSnapshot(ctx, name)
}

func (n *Node) namedSnapshot(name string) (*NamedSnapshot, error) {
	if !templateNameRE.MatchString(name) {
		return nil, fmt.Errorf("%w: snapshot %q", ErrNotFound, name)
	}
	b, err := os.ReadFile(n.namedSnapshotPath(name))
	if errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("%w: snapshot %q", ErrNotFound, name)
	}
	if err != nil {
		return nil, err
	}
	var ns NamedSnapshot
	if err := json.Unmarshal(b, &ns); err != nil {
		return nil, fmt.Errorf("%w: snapshot %q record: %v", ErrCorrupt, name, err)
	}
	return &ns, nil
}

// Snapshots lists the named snapshots, oldest first.
func (n *Node) Snapshots() ([]*NamedSnapshot, error) {
	ents, err := os.ReadDir(filepath.Join(n.cfg.DataDir, namedSnapshotsDir))
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var out []*NamedSnapshot
	for _, e := range ents {
		name, ok := strings.CutSuffix(e.Name(), ".json")
		if !ok {
			continue
		}
		if ns, err := n.namedSnapshot(name); err == nil {
			out = append(out, ns)
		}
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
	if err := os.Remove(n.namedSnapshotPath(name)); err != nil {
		return err
	}
	if n.cfg.Repository != nil {
		if err := n.cfg.Repository.Delete(ctx, repoKindSnapshot, name); err != nil && !errors.Is(err, repository.ErrNotFound) {
			return fmt.Errorf("delete snapshot %s from the repository: %w", name, err)
		}
	}
	n.gcSnapshots(ctx)
	return nil
}
