// Package repository owns the snapshot repository: the persistent store into
// which finished artifacts (snapshots, template layers: a flat, named set of
// files) are committed atomically, and from which any node can fetch them
// again. Two backends implement the same [Repository] contract:
//
//   - posix_fs (the default): a directory, local or on a shared mount;
//   - oss: any S3-compatible object store, through minio-go.
//
// An artifact is identified by a kind (e.g. "snapshots", "templates") and an
// id. It becomes visible only when its manifest (format version, file names,
// sizes and SHA-256 checksums) has been written, which happens after every
// file is stored; Get verifies every file against the manifest. The layout
// and the atomicity protocol of each backend are described in
// docs/REPOSITORY.md.
//
// The collector workspace (where artifacts are assembled) and the local
// runtime cache are not part of this package.
package repository

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"regexp"
	"sort"
	"time"
)

// FormatVersion is the manifest format written by this package. Manifests
// with a higher version are rejected as unreadable (ErrCorrupt) rather than
// misinterpreted.
const FormatVersion = 1

// ManifestName is the name of the manifest of an artifact. It is reserved: an
// artifact cannot contain a file of this name.
const ManifestName = "manifest.json"

var (
	// ErrNotFound: the artifact does not exist or is incomplete (no manifest).
	ErrNotFound = errors.New("artifact not found")
	// ErrExists: Put of an artifact that already exists.
	ErrExists = errors.New("artifact already exists")
	// ErrCorrupt: stored data does not match the manifest, or the manifest is
	// unreadable.
	ErrCorrupt = errors.New("artifact corrupt")
	// ErrInvalidName: a kind, id or file name that is not allowed.
	ErrInvalidName = errors.New("invalid name")
)

// Repository stores artifacts: flat sets of regular files committed under
// kind/id. All methods are safe for concurrent use, also from several
// processes or nodes sharing the same store, as long as one artifact id is
// written by one writer (a concurrent Put of the same kind/id either fails
// with ErrExists or, on oss, is not supported).
type Repository interface {
	// Put uploads the regular files of dir (flat; subdirectories, symlinks and
	// a file named manifest.json are rejected) as artifact kind/id. It is
	// atomic: the artifact becomes visible (Get/Stat/List) only after every
	// file and then the manifest have been written; an error, a cancelled
	// context or a crash mid-upload never leaves an artifact that looks
	// complete. Putting an existing artifact fails with ErrExists.
	Put(ctx context.Context, kind, id, dir string) (*Manifest, error)
	// Get downloads artifact kind/id into dir (created if missing), verifying
	// every file's size and SHA-256 against the manifest; a mismatch is an
	// error wrapping ErrCorrupt that names the file. Files are written to
	// temporary names and renamed into place only after all of them have been
	// verified, so a failed Get leaves no partial files behind. Holes of
	// sparse files are preserved.
	Get(ctx context.Context, kind, id, dir string) (*Manifest, error)
	// Stat returns the manifest of kind/id, ErrNotFound when it is absent or
	// incomplete.
	Stat(ctx context.Context, kind, id string) (*Manifest, error)
	// List returns the manifests of all complete artifacts of kind, sorted
	// by id. Incomplete uploads are not listed.
	List(ctx context.Context, kind string) ([]*Manifest, error)
	// Delete removes kind/id: the artifact disappears first (manifest
	// removed), then its files. ErrNotFound when it does not exist.
	Delete(ctx context.Context, kind, id string) error
	// Cleanup removes the leftovers of interrupted uploads and deletions that
	// are older than olderThan, and returns how many it removed. Leftovers are
	// invisible anyway; Cleanup only reclaims their space. Use an age well
	// above the longest upload so a running Put is not disturbed.
	Cleanup(ctx context.Context, olderThan time.Duration) (int, error)
}

// Manifest describes one complete artifact.
type Manifest struct {
	Format  int       `json:"format"`
	Kind    string    `json:"kind"`
	ID      string    `json:"id"`
	Created time.Time `json:"created"`
	Files   []File    `json:"files"`
	// Data is the folder, inside the artifact, that holds its file objects
	// (oss: each Put uploads into a folder of its own, so two Puts of one
	// id never write the same object). Empty: the files sit beside the
	// manifest (posix_fs, and oss artifacts of older releases).
	Data string `json:"data,omitempty"`
}

// File is one file of an artifact. Size and SHA256 (lowercase hex) are those
// of the file's logical content (holes read as zeros), whatever the backend's
// storage encoding.
type File struct {
	Name   string `json:"name"`
	Size   int64  `json:"size"`
	SHA256 string `json:"sha256"`
	// Encoding is how the backend stored the file: "" means verbatim;
	// EncodingExtents (oss only) means the object holds only the data
	// extents listed in Extents, concatenated; everything else is zeros.
	Encoding string `json:"encoding,omitempty"`
	// Extents are [offset, length] pairs, sorted and non-overlapping
	// (EncodingExtents only).
	Extents [][2]int64 `json:"extents,omitempty"`
}

// EncodingExtents: the stored object contains only the non-zero extents of
// the file, back to back (see File.Extents).
const EncodingExtents = "extents"

// File returns the entry of the named file, or nil.
func (m *Manifest) File(name string) *File {
	for i := range m.Files {
		if m.Files[i].Name == name {
			return &m.Files[i]
		}
	}
	return nil
}

// TotalSize is the sum of the logical sizes of the artifact's files.
func (m *Manifest) TotalSize() int64 {
	var n int64
	for _, f := range m.Files {
		n += f.Size
	}
	return n
}

// nameRE: kinds, ids and file names. A leading letter or digit keeps "." and
// ".." out and reserves dot-names (.incoming, temporary files) for the
// backends; no '/' or '\\' means no path traversal and one object-name level.
var nameRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$`)

func validName(what, s string) error {
	if !nameRE.MatchString(s) {
		return fmt.Errorf("%w: %s %q (want 1-128 chars of [A-Za-z0-9._-], starting with a letter or digit)", ErrInvalidName, what, s)
	}
	return nil
}

func validKindID(kind, id string) error {
	if err := validName("kind", kind); err != nil {
		return err
	}
	return validName("id", id)
}

func validFileName(name string) error {
	if err := validName("file name", name); err != nil {
		return err
	}
	if name == ManifestName {
		return fmt.Errorf("%w: file name %q is reserved for the manifest", ErrInvalidName, name)
	}
	return nil
}

var sha256HexRE = regexp.MustCompile(`^[0-9a-f]{64}$`)

// decodeManifest parses and checks a stored manifest against the kind/id it
// was found under.
func decodeManifest(data []byte, kind, id string) (*Manifest, error) {
	var m Manifest
	if err := json.Unmarshal(data, &m); err != nil {
		return nil, fmt.Errorf("%w: %s/%s: manifest: %v", ErrCorrupt, kind, id, err)
	}
	if m.Format < 1 || m.Format > FormatVersion {
		return nil, fmt.Errorf("%w: %s/%s: manifest format %d not supported (this build reads up to %d)", ErrCorrupt, kind, id, m.Format, FormatVersion)
	}
	if m.Kind != kind || m.ID != id {
		return nil, fmt.Errorf("%w: %s/%s: manifest names %s/%s", ErrCorrupt, kind, id, m.Kind, m.ID)
	}
	if m.Data != "" {
		if err := validName("data folder", m.Data); err != nil || m.Data == ManifestName {
			return nil, fmt.Errorf("%w: %s/%s: manifest names data folder %q", ErrCorrupt, kind, id, m.Data)
		}
	}
	seen := map[string]bool{}
	for _, f := range m.Files {
		if err := validFileName(f.Name); err != nil {
			return nil, fmt.Errorf("%w: %s/%s: manifest: %v", ErrCorrupt, kind, id, err)
		}
		if seen[f.Name] {
			return nil, fmt.Errorf("%w: %s/%s: manifest lists %q twice", ErrCorrupt, kind, id, f.Name)
		}
		seen[f.Name] = true
		if f.Size < 0 || !sha256HexRE.MatchString(f.SHA256) {
			return nil, fmt.Errorf("%w: %s/%s: manifest entry for %q is malformed", ErrCorrupt, kind, id, f.Name)
		}
		switch f.Encoding {
		case "":
			if len(f.Extents) > 0 {
				return nil, fmt.Errorf("%w: %s/%s: manifest gives extents for plain file %q", ErrCorrupt, kind, id, f.Name)
			}
		case EncodingExtents:
			var end int64
			for _, e := range f.Extents {
				if e[0] < end || e[1] <= 0 || e[0]+e[1] > f.Size {
					return nil, fmt.Errorf("%w: %s/%s: manifest extents of %q are malformed", ErrCorrupt, kind, id, f.Name)
				}
				end = e[0] + e[1]
			}
		default:
			return nil, fmt.Errorf("%w: %s/%s: file %q has unknown encoding %q", ErrCorrupt, kind, id, f.Name, f.Encoding)
		}
	}
	return &m, nil
}

func encodeManifest(m *Manifest) ([]byte, error) {
	sort.Slice(m.Files, func(i, j int) bool { return m.Files[i].Name < m.Files[j].Name })
	b, err := json.MarshalIndent(m, "", "  ")
	if err != nil {
		return nil, fmt.Errorf("encode manifest: %w", err)
	}
	return append(b, '\n'), nil
}

// faultHook lets tests stop an operation at a named point ("file:<name>"
// after a file is stored, "manifest" before the manifest is written,
// "commit" before the final rename of posix_fs). Returning errSimulatedCrash
// makes the operation return at once without its usual cleanup, as if the
// process had died there.
// storeFiles stores each named file with store (in order, passing the fault
// points "file:<name>" after each and "manifest" before the commit) and
// returns the artifact's manifest (naming data, the folder the files were
// stored in), encoded too, ready to be committed.
func storeFiles(ctx context.Context, kind, id string, names []string, hook faultHook, now func() time.Time,
	store func(name string) (File, error), data string) (*Manifest, []byte, error) {
	m := &Manifest{Format: FormatVersion, Kind: kind, ID: id, Data: data}
	for _, name := range names {
		f, err := store(name)
		if err != nil {
			return nil, nil, err
		}
		f.Name = name
		m.Files = append(m.Files, f)
		if err := hook.at("file:" + name); err != nil {
			return nil, nil, err
		}
	}
	if err := hook.at("manifest"); err != nil {
		return nil, nil, err
	}
	if err := ctx.Err(); err != nil {
		return nil, nil, fmt.Errorf("put %s/%s: %w", kind, id, err)
	}
	m.Created = now().UTC()
	encoded, err := encodeManifest(m)
	if err != nil {
		return nil, nil, err
	}
	return m, encoded, nil
}

type faultHook func(point string) error

var errSimulatedCrash = errors.New("simulated crash")

func (h faultHook) at(point string) error {
	if h == nil {
		return nil
	}
	return h(point)
}
