// Package sharing owns the copies of paused sandboxes that the nodes of a
// cluster keep in their shared repository, so that any node can resume a
// sandbox another paused: the format of an upload (the sandbox's record
// beside its files), the mark a node leaves in a local sandbox directory
// that is in the repository, and the claims that settle which node owns a
// shared sandbox.
//
// Who owns a shared sandbox is settled by the repository's atomic Put:
// resuming (or killing) a shared sandbox, on any node, first puts a claim
// named after the sandbox and the generation of its upload; of two nodes
// racing, one gets repository.ErrExists and backs off. Claims therefore need
// a repository that refuses concurrent Puts atomically (probed by Open). How
// the files of an upload are made (the disk flattened over its template,
// the saved state, the RAM) is the node's business.
package sharing

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/agentenv/agentenv/internal/errkind"
	"github.com/agentenv/agentenv/internal/sandboxes"
	"github.com/agentenv/agentenv/internal/sealed"
	"github.com/agentenv/agentenv/internal/storage"
	"github.com/agentenv/agentenv/internal/storage/repository"
)

// The repository kinds of shared sandboxes.
const (
	kindPaused = "paused" // an upload: a paused sandbox's files and record
	kindRAM    = "ram"    // a RAM image uploads are relative to, shared by them
	kindClaim  = "claim"  // a claim on one generation of an upload
)

const (
	// RecordFile is the upload's record, beside its files.
	RecordFile = "sandbox.json"
	// MarkFile, in a local sandbox directory, says the paused sandbox is in
	// the repository.
	MarkFile      = "shared.json"
	claimFileName = "claim"
)

// Record is a paused sandbox as stored in the repository.
type Record struct {
	Sandbox sandboxes.Sandbox `json:"sandbox"`
	// Pause is the node's record of the pause (how to load the state).
	Pause json.RawMessage `json:"pause"`
	// Generation names this upload; claims name it.
	Generation string `json:"generation"`
	// Template is the template whose root layer the disk layer stacks on,
	// and TemplateIdentity that layer chain's content.
	Template         string `json:"template"`
	TemplateIdentity string `json:"templateIdentity"`
	// RAM is the repository id of the RAM image the state is relative to
	// ("": the RAM file is in the upload).
	RAM      string    `json:"ram,omitempty"`
	SharedAt time.Time `json:"sharedAt"`
	Node     string    `json:"node"`
}

// Mark says a local paused sandbox is in the repository as generation
// Generation.
type Mark struct {
	Generation string    `json:"generation"`
	SharedAt   time.Time `json:"sharedAt"`
}

// ReadMark returns the mark in sandbox directory dir, if there is one.
func ReadMark(dir string) (*Mark, bool) {
	var m Mark
	if err := storage.ReadJSON(filepath.Join(dir, MarkFile), &m); err != nil || m.Generation == "" {
		return nil, false
	}
	return &m, true
}

// WriteMark marks sandbox directory dir as shared as the generation of rec.
func WriteMark(dir string, rec *Record) error {
	return storage.WriteJSONAtomic(filepath.Join(dir, MarkFile), Mark{Generation: rec.Generation, SharedAt: rec.SharedAt}, 0o600)
}

// RemoveMark makes sandbox directory dir local only.
func RemoveMark(dir string) error {
	if err := os.Remove(filepath.Join(dir, MarkFile)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return nil
}

// NewGeneration names a new upload.
func NewGeneration() string {
	b := make([]byte, 8)
	if _, err := rand.Read(b); err != nil {
		panic(err)
	}
	return hex.EncodeToString(b)
}

// Shelf is the cluster's shared repository seen as a shelf of paused
// sandboxes, by one node.
type Shelf struct {
	repo   repository.Repository
	node   string      // the node's name, written into its uploads and claims
	tokens *sealed.Key // seals the sandboxes' tokens in the repository
}

// Open returns the shelf of repo for node, or an error wrapping
// errkind.ErrSetup that says why paused sandboxes cannot be shared over it
// (the repository does not refuse concurrent Puts atomically). The
// sandboxes' envd access and traffic tokens are written sealed with
// tokens, which every node of the cluster must share.
func Open(ctx context.Context, repo repository.Repository, node string, tokens *sealed.Key) (*Shelf, error) {
	if tokens == nil {
		return nil, fmt.Errorf("%w: paused sandboxes are not shared between nodes: no sealing secret", errkind.ErrSetup)
	}
	if err := repository.CheckAtomicPut(ctx, repo); err != nil {
		return nil, fmt.Errorf("%w: paused sandboxes are not shared between nodes: %v", errkind.ErrSetup, err)
	}
	return &Shelf{repo: repo, node: node, tokens: tokens}, nil
}

// Put uploads the files in stage as the paused sandbox of rec (replacing an
// older upload of it), with rec written beside them. The caller marks the
// local copy (WriteMark) before, so that a claim can never be made for an
// upload the node does not know it made.
func (sh *Shelf) Put(ctx context.Context, stage string, rec *Record) error {
	rec.Node = sh.node
	rec.Sandbox.Phases = nil
	stored := *rec
	stored.Sandbox.AccessToken = sh.tokens.Seal(rec.Sandbox.AccessToken)
	stored.Sandbox.TrafficToken = sh.tokens.Seal(rec.Sandbox.TrafficToken)
	if err := storage.WriteJSONAtomic(filepath.Join(stage, RecordFile), &stored, 0o600); err != nil {
		return err
	}
	if err := sh.Remove(ctx, rec.Sandbox.ID); err != nil {
		return err
	}
	_, err := sh.repo.Put(ctx, kindPaused, rec.Sandbox.ID, stage)
	return err
}

// Get downloads the paused sandbox id into stage and returns its record
// (removed from stage): errkind.ErrNotFound when the repository has none.
func (sh *Shelf) Get(ctx context.Context, id, stage string) (*Record, error) {
	if _, err := sh.repo.Get(ctx, kindPaused, id, stage); err != nil {
		if errors.Is(err, repository.ErrNotFound) {
			return nil, fmt.Errorf("%w: sandbox %q", errkind.ErrNotFound, id)
		}
		return nil, fmt.Errorf("fetch paused sandbox %s: %w", id, err)
	}
	var rec Record
	if err := storage.ReadJSON(filepath.Join(stage, RecordFile), &rec); err != nil || rec.Sandbox.ID != id || rec.Generation == "" {
		return nil, fmt.Errorf("%w: shared paused sandbox %s record", errkind.ErrCorrupt, id)
	}
	for _, tok := range []*string{&rec.Sandbox.AccessToken, &rec.Sandbox.TrafficToken} {
		plain, _, err := sh.tokens.Open(*tok)
		if err != nil {
			return nil, fmt.Errorf("%w: shared paused sandbox %s: its tokens were sealed with another secret than this node's (AENV_NODE_TOKEN differs)", errkind.ErrCorrupt, id)
		}
		*tok = plain
	}
	os.Remove(filepath.Join(stage, RecordFile))
	return &rec, nil
}

// Remove deletes the upload of sandbox id, if any.
func (sh *Shelf) Remove(ctx context.Context, id string) error {
	if err := sh.repo.Delete(ctx, kindPaused, id); err != nil && !errors.Is(err, repository.ErrNotFound) {
		return err
	}
	return nil
}

// HasRAM reports whether RAM image id is in the repository.
func (sh *Shelf) HasRAM(ctx context.Context, id string) bool {
	_, err := sh.repo.Stat(ctx, kindRAM, id)
	return err == nil
}

// PutRAM uploads the files of dir as RAM image id (once: an image already
// there is kept).
func (sh *Shelf) PutRAM(ctx context.Context, id, dir string) error {
	if _, err := sh.repo.Put(ctx, kindRAM, id, dir); err != nil && !errors.Is(err, repository.ErrExists) {
		return fmt.Errorf("upload RAM image: %w", err)
	}
	return nil
}

// GetRAM downloads RAM image id into dir.
func (sh *Shelf) GetRAM(ctx context.Context, id, dir string) error {
	if _, err := sh.repo.Get(ctx, kindRAM, id, dir); err != nil {
		return fmt.Errorf("fetch RAM image %s: %w", id, err)
	}
	return nil
}

// Claim takes ownership of generation gen of shared sandbox id:
// errkind.ErrConflict when another node (or this one, earlier) has it.
func (sh *Shelf) Claim(ctx context.Context, id, gen string) error {
	dir, err := os.MkdirTemp("", "aenv-claim-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	if err := os.WriteFile(filepath.Join(dir, claimFileName), []byte(sh.node+"\n"), 0o600); err != nil {
		return err
	}
	_, err = sh.repo.Put(ctx, kindClaim, id+"-"+gen, dir)
	if errors.Is(err, repository.ErrExists) {
		return fmt.Errorf("%w: sandbox %s was taken by another node", errkind.ErrConflict, id)
	}
	return err
}

// Claimed reports whether generation gen of shared sandbox id has an owner.
func (sh *Shelf) Claimed(ctx context.Context, id, gen string) (bool, error) {
	_, err := sh.repo.Stat(ctx, kindClaim, id+"-"+gen)
	if errors.Is(err, repository.ErrNotFound) {
		return false, nil
	}
	return err == nil, err
}

// Forget removes generation gen of shared sandbox id for good (it was
// killed): it is claimed, so no node adopts a copy of it, and its upload
// goes.
func (sh *Shelf) Forget(ctx context.Context, id, gen string) error {
	if err := sh.Claim(ctx, id, gen); err != nil && !errors.Is(err, errkind.ErrConflict) {
		return fmt.Errorf("claim killed sandbox %s: %w", id, err)
	}
	return sh.Remove(ctx, id)
}

// Kill kills shared sandbox id, which no node holds: errkind.ErrNotFound
// when the repository has no such sandbox, ErrConflict when a node claimed
// it meanwhile (it runs there now).
func (sh *Shelf) Kill(ctx context.Context, id string) error {
	stage, err := os.MkdirTemp("", "aenv-kill-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(stage)
	// Only the record is needed, but a Get is all-or-nothing; its size is
	// the state and disk layer, which a kill of a moved sandbox can afford.
	rec, err := sh.Get(ctx, id, stage)
	if err != nil {
		return err
	}
	if err := sh.Claim(ctx, id, rec.Generation); err != nil {
		return err
	}
	return sh.Forget(ctx, id, rec.Generation)
}
