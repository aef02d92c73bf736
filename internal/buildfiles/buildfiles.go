// Package buildfiles owns the archives that template builds COPY into a
// guest: uploads waiting to be checked, the check of an archive against the
// files hash its client claims (E2B's hash, see Hash), the store of checked
// archives every template shares, and the per-template store of archives
// whose hash cannot be recomputed from their bytes.
//
// An upload is never trusted for what it claims: it waits in pending/ until
// a build names it with its COPY source and destination, which the hash
// covers. A match moves it to verified/, where any template's build (and
// the SDK's "already uploaded" answer) may use it. A mismatch removes it
// and the build is refused. An archive whose hash depends on data the
// archive does not carry (the JS SDK hashes directories' on-disk sizes)
// stays private to the template that uploaded it, so it can never stand in
// for another template's files.
package buildfiles

import (
	"archive/tar"
	"bufio"
	"compress/gzip"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"time"

	"github.com/agentenv/agentenv/internal/errkind"
)

// HashRE is the form of a files hash: lowercase hex, as a SHA-256 is.
var HashRE = regexp.MustCompile(`^[0-9a-f]{16,128}$`)

// templateRE bounds the template ids used as folder names.
var templateRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$`)

// MaxUpload bounds one COPY archive, and the uploads waiting for one
// template's build together.
const MaxUpload = 8 << 30

// MaxPending bounds the uploads waiting for builds on a node together.
const MaxPending = 32 << 30

// pendingTTL is how long an upload no build has named is kept.
const pendingTTL = 24 * time.Hour

// verifiedTTL is how long a checked archive no build has used is kept
// (a client asked for it later uploads it again).
const verifiedTTL = 7 * 24 * time.Hour

// Errors of the store; each is also an errkind (ErrInvalid or ErrNotFound).
var (
	ErrMismatch    = fmt.Errorf("%w: the uploaded files do not match their files hash", errkind.ErrInvalid)
	ErrNotUploaded = fmt.Errorf("%w: files were not uploaded", errkind.ErrInvalid)
	ErrBadArchive  = fmt.Errorf("%w: the uploaded files are not a tar archive", errkind.ErrInvalid)
)

// Store is the build files of a node, under <data>/build-files.
type Store struct {
	dir string

	// maxTemplate and maxNode bound the uploads waiting for builds: for
	// one template, and on the node (MaxUpload and MaxPending).
	maxTemplate, maxNode int64

	// mu guards inflight: the room uploads being received have taken of
	// the bounds, by template.
	mu       sync.Mutex
	inflight map[string]int64
}

// Open opens (creating) the store of a data dir. Uploads older than a day
// that no build named are removed, as are archives of the layout before
// verification (kept under their claimed hash alone): clients upload them
// again when asked.
func Open(dataDir string) (*Store, error) {
	s := &Store{dir: filepath.Join(dataDir, "build-files"), maxTemplate: MaxUpload, maxNode: MaxPending, inflight: map[string]int64{}}
	for _, d := range []string{"pending", "verified", "template"} {
		if err := os.MkdirAll(filepath.Join(s.dir, d), 0o700); err != nil {
			return nil, err
		}
	}
	legacy, _ := filepath.Glob(filepath.Join(s.dir, "*.tar"))
	for _, p := range legacy {
		_ = os.Remove(p)
	}
	s.Sweep(time.Now(), nil)
	return s, nil
}

func (s *Store) verifiedPath(hash string) string {
	return filepath.Join(s.dir, "verified", hash+".tar")
}
func (s *Store) privatePath(template, hash string) string {
	return filepath.Join(s.dir, "template", template, hash+".tar")
}
func (s *Store) pendingPath(template, hash string) string {
	return filepath.Join(s.dir, "pending", template, hash+".tar")
}

func check(template, hash string) error {
	if !templateRE.MatchString(template) {
		return fmt.Errorf("%w: template id %q", errkind.ErrInvalid, template)
	}
	if !HashRE.MatchString(hash) {
		return fmt.Errorf("%w: files hash must be 16 to 128 lowercase hex digits", errkind.ErrInvalid)
	}
	return nil
}

// Present reports whether template's builds can use the files of hash
// without another upload (what the SDK asks before it uploads).
func (s *Store) Present(template, hash string) bool {
	if check(template, hash) != nil {
		return false
	}
	for _, p := range []string{s.verifiedPath(hash), s.privatePath(template, hash)} {
		if _, err := os.Stat(p); err == nil {
			return true
		}
	}
	return false
}

// Receive stores an upload for template under the hash its client claims,
// to be checked when a build names it (see Admit). A second upload of the
// same hash replaces the first. It returns ErrInvalid errors for bad names
// and ErrTooLarge ones for a body past what the bounds leave it: MaxUpload
// for the uploads waiting for one template's build, MaxPending for the
// node's.
func (s *Store) Receive(template, hash string, body io.Reader) error {
	if err := check(template, hash); err != nil {
		return err
	}
	dst := s.pendingPath(template, hash)
	room, err := s.reserve(template, dst)
	if err != nil {
		return err
	}
	defer s.release(template, room)
	if err := os.MkdirAll(filepath.Dir(dst), 0o700); err != nil {
		return err
	}
	tmp, err := os.CreateTemp(filepath.Dir(dst), ".upload-")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	n, err := io.Copy(tmp, io.LimitReader(body, room+1))
	if err != nil {
		tmp.Close()
		if errkind.IsNoSpace(err) {
			return fmt.Errorf("%w: upload: %v", errkind.ErrNoSpace, err)
		}
		return fmt.Errorf("%w: upload: %v", errkind.ErrInvalid, err)
	}
	if n > room {
		tmp.Close()
		return fmt.Errorf("%w: the upload is larger than the %s left for uploads waiting for builds (%s per template, %s on the node)",
			errkind.ErrTooLarge, size(room), size(s.maxTemplate), size(s.maxNode))
	}
	if err := tmp.Sync(); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), dst)
}

// reserve takes, for an upload to template that will replace dst, the room
// the bounds leave it, until release gives it back.
func (s *Store) reserve(template, dst string) (int64, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var replaced int64
	if fi, err := os.Lstat(dst); err == nil {
		replaced = fi.Size()
	}
	mine, all := s.inflight[template], int64(0)
	for _, b := range s.inflight {
		all += b
	}
	root := filepath.Join(s.dir, "pending")
	ents, _ := os.ReadDir(root)
	for _, e := range ents {
		b := dirBytes(filepath.Join(root, e.Name()))
		all += b
		if e.Name() == template {
			mine += b
		}
	}
	room := min(s.maxTemplate-mine, s.maxNode-all) + replaced
	if room <= 0 {
		return 0, fmt.Errorf("%w: the uploads waiting for builds fill their bound (%s per template, %s on the node): start or end those builds first",
			errkind.ErrTooLarge, size(s.maxTemplate), size(s.maxNode))
	}
	s.inflight[template] += room
	return room, nil
}

func (s *Store) release(template string, room int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.inflight[template] -= room; s.inflight[template] <= 0 {
		delete(s.inflight, template)
	}
}

// size says a number of bytes in the largest unit it fills.
func size(b int64) string {
	switch {
	case b >= 1<<30:
		return fmt.Sprintf("%d GiB", b>>30)
	case b >= 1<<20:
		return fmt.Sprintf("%d MiB", b>>20)
	}
	return fmt.Sprintf("%d bytes", b)
}

// dirBytes is the size of the regular files in dir and below.
func dirBytes(dir string) int64 {
	var n int64
	_ = filepath.WalkDir(dir, func(_ string, d fs.DirEntry, err error) error {
		if err == nil && d.Type().IsRegular() {
			if fi, err := d.Info(); err == nil {
				n += fi.Size()
			}
		}
		return nil
	})
	return n
}

// Archive is the files a COPY step uses.
type Archive struct {
	// Path is the archive (a tar, gzip-compressed or not).
	Path string
	// Key stands for the archive's contents in build cache keys: the
	// verified files hash, or the digest of a private archive's bytes.
	Key string
	// Verified says the archive matched its files hash.
	Verified bool
}

// Admit returns the archive a build of template may use for a COPY of src
// to dest with the files hash the client gave. An upload waiting for its
// check is checked now: it is kept if it matches, removed and refused
// (ErrMismatch) if it does not.
func (s *Store) Admit(template, hash, src, dest string) (Archive, error) {
	if err := check(template, hash); err != nil {
		return Archive{}, err
	}
	pending := s.pendingPath(template, hash)
	if _, err := os.Stat(pending); err == nil {
		return s.admitPending(template, hash, src, dest, pending)
	}
	if p := s.verifiedPath(hash); exists(p) {
		touch(p)
		return Archive{Path: p, Key: hash, Verified: true}, nil
	}
	if p := s.privatePath(template, hash); exists(p) {
		key, err := digest(p)
		if err != nil {
			return Archive{}, err
		}
		return Archive{Path: p, Key: key}, nil
	}
	return Archive{}, fmt.Errorf("%w (files hash %s)", ErrNotUploaded, hash)
}

func (s *Store) admitPending(template, hash, src, dest, pending string) (Archive, error) {
	f, err := os.Open(pending)
	if err != nil {
		return Archive{}, err
	}
	sum, checkable, err := Hash(f, src, dest)
	f.Close()
	if err != nil {
		_ = os.Remove(pending)
		return Archive{}, err
	}
	if sum == hash {
		p := s.verifiedPath(hash)
		if err := os.Rename(pending, p); err != nil {
			return Archive{}, err
		}
		touch(p)
		return Archive{Path: p, Key: hash, Verified: true}, nil
	}
	if checkable {
		_ = os.Remove(pending)
		return Archive{}, fmt.Errorf("%w (COPY %s %s claims %s)", ErrMismatch, src, dest, hash)
	}
	key, err := digest(pending)
	if err != nil {
		return Archive{}, err
	}
	p := s.privatePath(template, hash)
	if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
		return Archive{}, err
	}
	if err := os.Rename(pending, p); err != nil {
		return Archive{}, err
	}
	return Archive{Path: p, Key: key}, nil
}

// RemoveTemplate removes a template's private and waiting archives.
func (s *Store) RemoveTemplate(template string) error {
	if !templateRE.MatchString(template) {
		return nil
	}
	return errors.Join(os.RemoveAll(filepath.Join(s.dir, "template", template)),
		os.RemoveAll(filepath.Join(s.dir, "pending", template)))
}

// Sweep collects what no build will use: uploads received over a day ago
// that no build named, checked archives no build used for a week, and,
// when wanted is set, the waiting uploads and private archives of the
// templates it does not want (a template that never came: its builds
// failed or expired before it existed).
func (s *Store) Sweep(now time.Time, wanted func(template string) bool) {
	removeOlder(filepath.Join(s.dir, "pending"), now.Add(-pendingTTL))
	removeOlder(filepath.Join(s.dir, "verified"), now.Add(-verifiedTTL))
	if wanted == nil {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, d := range []string{"pending", "template"} {
		ents, _ := os.ReadDir(filepath.Join(s.dir, d))
		for _, e := range ents {
			if _, receiving := s.inflight[e.Name()]; e.IsDir() && !receiving && !wanted(e.Name()) {
				_ = os.RemoveAll(filepath.Join(s.dir, d, e.Name()))
			}
		}
	}
}

// removeOlder removes the files below root last modified before cutoff.
func removeOlder(root string, cutoff time.Time) {
	_ = filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return nil
		}
		if fi, err := d.Info(); err == nil && fi.ModTime().Before(cutoff) {
			_ = os.Remove(p)
		}
		return nil
	})
}

// touch marks an archive used now (see Sweep).
func touch(p string) {
	now := time.Now()
	_ = os.Chtimes(p, now, now)
}

func exists(p string) bool {
	_, err := os.Stat(p)
	return err == nil
}

// digest is "sha256:" and the hex SHA-256 of a file's bytes. (Not
// store.FileSHA256: this package is part of the aenv client, which builds
// for darwin, and package store is Linux-only.)
func digest(p string) (string, error) {
	f, err := os.Open(p)
	if err != nil {
		return "", err
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return "", err
	}
	return "sha256:" + hex.EncodeToString(h.Sum(nil)), nil
}

// Mode bits of the file types, as stat(2) reports them and the SDKs hash them.
const (
	modeDir     = 0o040000
	modeRegular = 0o100000
	modeSymlink = 0o120000
)

// Hash computes, from a COPY archive (a tar, gzip-compressed or not, as the
// SDKs upload it), the files hash the E2B SDKs compute over the files they
// put in it: SHA-256 over "COPY <src> <dest>" and then, for each entry in
// archive order (the SDKs write entries in the order they hash them), its
// path relative to the build context, its stat mode in decimal, its size
// in decimal unless it is a directory, and its contents (a symlink's
// target). checkable is false when the client's hash may cover data the
// archive does not carry, so a mismatch proves nothing: directories (the
// JS SDK hashes their on-disk sizes), hard links, and special files.
func Hash(r io.Reader, src, dest string) (sum string, checkable bool, err error) {
	br := bufio.NewReader(r)
	var in io.Reader = br
	if magic, _ := br.Peek(2); len(magic) == 2 && magic[0] == 0x1f && magic[1] == 0x8b {
		gz, err := gzip.NewReader(br)
		if err != nil {
			return "", false, fmt.Errorf("%w: %v", ErrBadArchive, err)
		}
		defer gz.Close()
		in = gz
	}
	h := sha256.New()
	fmt.Fprintf(h, "COPY %s %s", src, dest)
	checkable = true
	tr := tar.NewReader(in)
	entries := 0
	for {
		hdr, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return "", false, fmt.Errorf("%w: %v", ErrBadArchive, err)
		}
		entries++
		name := strings.TrimSuffix(hdr.Name, "/")
		if rest, ok := strings.CutPrefix(name, "./"); ok && rest != "" {
			name = rest
		}
		if name == "" {
			name = "."
		}
		io.WriteString(h, name)
		perm := hdr.Mode & 0o7777
		switch hdr.Typeflag {
		case tar.TypeReg:
			fmt.Fprintf(h, "%d%d", modeRegular|perm, hdr.Size)
			if _, err := io.Copy(h, tr); err != nil {
				return "", false, fmt.Errorf("%w: %v", ErrBadArchive, err)
			}
		case tar.TypeDir:
			checkable = false
			fmt.Fprintf(h, "%d", modeDir|perm)
		case tar.TypeSymlink:
			fmt.Fprintf(h, "%d%d%s", modeSymlink|perm, len(hdr.Linkname), hdr.Linkname)
		default:
			checkable = false
		}
	}
	if entries == 0 {
		return "", false, fmt.Errorf("%w: it holds no files", ErrBadArchive)
	}
	return hex.EncodeToString(h.Sum(nil)), checkable, nil
}
