package repository

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"github.com/minio/minio-go/v7"
	"github.com/minio/minio-go/v7/pkg/credentials"
)

const (
	defaultPartSize = 16 << 20
	minPartSize     = 5 << 20
	maxManifestSize = 64 << 20
)

type ossRepo struct {
	c        *minio.Client
	bucket   string
	prefix   string
	partSize uint64
	hook     faultHook
	now      func() time.Time
}

// OpenOSS returns a repository in an S3-compatible bucket. It checks the
// configuration but does not contact the server.
func OpenOSS(cfg OSSConfig) (Repository, error) {
	ep := cfg.Endpoint
	secure := !cfg.Insecure
	switch {
	case strings.HasPrefix(ep, "http://"):
		ep, secure = strings.TrimPrefix(ep, "http://"), false
	case strings.HasPrefix(ep, "https://"):
		ep, secure = strings.TrimPrefix(ep, "https://"), true
	}
	ep = strings.TrimSuffix(ep, "/")
	if ep == "" {
		return nil, errors.New("oss repository: endpoint is required (host[:port] of the S3 API)")
	}
	if cfg.Bucket == "" {
		return nil, errors.New("oss repository: bucket is required")
	}
	if cfg.Region == "" {
		return nil, errors.New("oss repository: region is required and is never guessed: set it explicitly (e.g. us-east-1, or whatever region your S3-compatible store expects)")
	}
	prefix := strings.Trim(cfg.Prefix, "/")
	if prefix != "" {
		for _, seg := range strings.Split(prefix, "/") {
			if err := validName("prefix segment", seg); err != nil {
				return nil, fmt.Errorf("oss repository: %w", err)
			}
		}
	}
	var creds *credentials.Credentials
	switch {
	case cfg.AccessKey != "":
		if cfg.SecretKey == "" {
			return nil, errors.New("oss repository: access key given without secret key")
		}
		creds = credentials.NewStaticV4(cfg.AccessKey, cfg.SecretKey, cfg.SessionToken)
	case cfg.CredentialsFile != "":
		if _, err := os.Stat(cfg.CredentialsFile); err != nil {
			return nil, fmt.Errorf("oss repository: credentials file: %w", err)
		}
		creds = credentials.NewFileAWSCredentials(cfg.CredentialsFile, cfg.Profile)
		if _, err := creds.GetWithContext(nil); err != nil {
			return nil, fmt.Errorf("oss repository: credentials file %s (profile %q): %w", cfg.CredentialsFile, cfg.Profile, err)
		}
	default:
		return nil, errors.New("oss repository: no credentials: set access_key/secret_key or credentials_file")
	}
	ps := cfg.PartSize
	if ps == 0 {
		ps = defaultPartSize
	}
	if ps < minPartSize {
		return nil, fmt.Errorf("oss repository: part size %d is below the S3 minimum of %d", ps, minPartSize)
	}
	c, err := minio.New(ep, &minio.Options{Creds: creds, Secure: secure, Region: cfg.Region})
	if err != nil {
		return nil, fmt.Errorf("oss repository: %w", err)
	}
	return &ossRepo{c: c, bucket: cfg.Bucket, prefix: prefix, partSize: ps, now: time.Now}, nil
}

func (r *ossRepo) key(parts ...string) string {
	if r.prefix != "" {
		parts = append([]string{r.prefix}, parts...)
	}
	return path.Join(parts...)
}

func isNoSuchKey(err error) bool {
	code := minio.ToErrorResponse(err).Code
	return code == minio.NoSuchKey || code == "NotFound"
}

func (r *ossRepo) Stat(ctx context.Context, kind, id string) (*Manifest, error) {
	if err := validKindID(kind, id); err != nil {
		return nil, err
	}
	obj, err := r.c.GetObject(ctx, r.bucket, r.key(kind, id, ManifestName), minio.GetObjectOptions{})
	if err != nil {
		return nil, fmt.Errorf("stat %s/%s: %w", kind, id, err)
	}
	defer obj.Close()
	data, err := io.ReadAll(io.LimitReader(obj, maxManifestSize))
	if err != nil {
		if isNoSuchKey(err) {
			return nil, fmt.Errorf("%s/%s: %w", kind, id, ErrNotFound)
		}
		return nil, fmt.Errorf("stat %s/%s: %w", kind, id, err)
	}
	return decodeManifest(data, kind, id)
}

func (r *ossRepo) Put(ctx context.Context, kind, id, dir string) (_ *Manifest, err error) {
	if err := validKindID(kind, id); err != nil {
		return nil, err
	}
	names, err := inputFiles(dir)
	if err != nil {
		return nil, err
	}
	if _, err := r.Stat(ctx, kind, id); err == nil {
		return nil, fmt.Errorf("put %s/%s: %w", kind, id, ErrExists)
	} else if !errors.Is(err, ErrNotFound) {
		return nil, fmt.Errorf("put %s/%s: %w", kind, id, err)
	}
	// This Put's own folder: a concurrent Put of the same id (another node
	// claiming the same paused sandbox) uploads elsewhere, so whichever
	// commits its manifest finds exactly its own files under it.
	data, err := newDataFolder()
	if err != nil {
		return nil, err
	}
	defer func() {
		if err != nil && !errors.Is(err, errSimulatedCrash) {
			cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
			defer cancel()
			r.abandon(cctx, kind, id, data)
		}
	}()
	m, manifest, err := storeFiles(ctx, kind, id, names, r.hook, r.now, func(name string) (File, error) {
		f, err := r.putFile(ctx, filepath.Join(dir, name), r.key(kind, id, data, name), name)
		if err != nil {
			return f, fmt.Errorf("put %s/%s: file %q: %w", kind, id, name, err)
		}
		return f, nil
	}, data)
	if err != nil {
		return nil, err
	}
	// The commit point: the manifest object appears atomically. If-None-Match
	// makes a server that supports conditional writes refuse to replace the
	// manifest of a Put of the same id that committed meanwhile.
	opts := minio.PutObjectOptions{ContentType: "application/json"}
	opts.SetMatchETagExcept("*")
	_, err = r.c.PutObject(ctx, r.bucket, r.key(kind, id, ManifestName), bytes.NewReader(manifest), int64(len(manifest)), opts)
	if err != nil {
		if code := minio.ToErrorResponse(err).Code; code == "PreconditionFailed" || code == "ConditionalRequestConflict" {
			return nil, fmt.Errorf("put %s/%s: %w", kind, id, ErrExists)
		}
		return nil, fmt.Errorf("put %s/%s: manifest: %w", kind, id, err)
	}
	return m, nil
}

// newDataFolder names the folder one Put uploads its files into.
func newDataFolder() (string, error) {
	b := make([]byte, 8)
	if _, err := rand.Read(b); err != nil {
		return "", err
	}
	return "data-" + hex.EncodeToString(b), nil
}

// abandon removes what a failed Put uploaded into its folder data: the
// manifest only when it is this Put's (its PUT may have reached the server
// although the client saw an error), never the artifact of a Put that
// committed meanwhile.
func (r *ossRepo) abandon(ctx context.Context, kind, id, data string) {
	if m, err := r.Stat(ctx, kind, id); err == nil && m.Data == data {
		r.c.RemoveObject(ctx, r.bucket, r.key(kind, id, ManifestName), minio.RemoveObjectOptions{})
	}
	r.removeAll(ctx, r.key(kind, id, data)+"/")
}

// putFile uploads the non-zero extents of a local file as one object and
// returns the file's manifest entry (without name).
func (r *ossRepo) putFile(ctx context.Context, src, key, name string) (File, error) {
	in, err := os.Open(src)
	if err != nil {
		return File{}, err
	}
	defer in.Close()
	st, err := in.Stat()
	if err != nil {
		return File{}, err
	}
	size := st.Size()
	h := sha256.New()
	var extents [][2]int64
	pr, pw := io.Pipe()
	scanDone := make(chan error, 1)
	go func() {
		var streamed uint64
		err := scanFile(ctx, in, size, h, func(off int64, p []byte) error {
			if streamed += uint64(len(p)); streamed > r.partSize && streamed-uint64(len(p)) <= r.partSize {
				// Fault point: a multipart upload is in progress.
				if err := r.hook.at("streaming:" + name); err != nil {
					return err
				}
			}
			if n := len(extents); n > 0 && extents[n-1][0]+extents[n-1][1] == off {
				extents[n-1][1] += int64(len(p))
			} else {
				extents = append(extents, [2]int64{off, int64(len(p))})
			}
			_, err := pw.Write(p)
			return err
		})
		pw.CloseWithError(err)
		scanDone <- err
	}()
	opts := minio.PutObjectOptions{ContentType: "application/octet-stream", PartSize: r.partSize}
	if uint64(size) <= r.partSize {
		// Small: one PUT with a known length.
		var data []byte
		data, err = io.ReadAll(pr)
		if err == nil {
			_, err = r.c.PutObject(ctx, r.bucket, key, bytes.NewReader(data), int64(len(data)), opts)
		}
	} else {
		// Large: multipart upload streamed part by part (the stored length
		// is known only at the end, after zero blocks are skipped).
		_, err = r.c.PutObject(ctx, r.bucket, key, pr, -1, opts)
	}
	pr.CloseWithError(errors.New("upload ended"))
	if serr := <-scanDone; serr != nil && err == nil {
		err = serr
	}
	if err != nil {
		return File{}, err
	}
	f := File{Size: size, SHA256: hex.EncodeToString(h.Sum(nil))}
	if !(len(extents) == 1 && extents[0] == [2]int64{0, size}) && size > 0 {
		f.Encoding = EncodingExtents
		f.Extents = extents
	}
	return f, nil
}

func (r *ossRepo) Get(ctx context.Context, kind, id, dir string) (_ *Manifest, err error) {
	m, err := r.Stat(ctx, kind, id)
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("get %s/%s: %w", kind, id, err)
	}
	var temps []string
	defer func() {
		if err != nil {
			for _, t := range temps {
				os.Remove(t)
			}
		}
	}()
	for _, f := range m.Files {
		tmp, err := tempName(dir, f.Name)
		if err != nil {
			return nil, fmt.Errorf("get %s/%s: %w", kind, id, err)
		}
		temps = append(temps, tmp)
		size, sum, err := r.getFile(ctx, r.key(kind, id, m.Data, f.Name), f, tmp)
		if err != nil {
			if isNoSuchKey(err) {
				return nil, fmt.Errorf("get %s/%s: %w: file %q is missing", kind, id, ErrCorrupt, f.Name)
			}
			return nil, fmt.Errorf("get %s/%s: file %q: %w", kind, id, f.Name, err)
		}
		if err := checkFile(f, size, sum); err != nil {
			return nil, fmt.Errorf("get %s/%s: %w", kind, id, err)
		}
	}
	if err := renameAll(m, temps, dir); err != nil {
		return nil, fmt.Errorf("get %s/%s: %w", kind, id, err)
	}
	return m, nil
}

// getFile downloads one object into the new file dst, decoding extents and
// leaving holes, and returns the logical size and SHA-256 it wrote.
func (r *ossRepo) getFile(ctx context.Context, key string, f File, dst string) (int64, string, error) {
	obj, err := r.c.GetObject(ctx, r.bucket, key, minio.GetObjectOptions{})
	if err != nil {
		return 0, "", err
	}
	defer obj.Close()
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
	if err != nil {
		return 0, "", err
	}
	defer out.Close()
	w := &sparseWriter{f: out, h: sha256.New()}
	buf := make([]byte, ioChunk)
	src := onlyReader{obj}
	switch f.Encoding {
	case "":
		if _, err := io.CopyBuffer(w, src, buf); err != nil {
			return 0, "", err
		}
	case EncodingExtents:
		for _, e := range f.Extents {
			w.skipTo(e[0])
			if _, err := io.CopyBuffer(w, io.LimitReader(src, e[1]), buf); err != nil {
				return 0, "", err
			}
			if w.off != e[0]+e[1] {
				return 0, "", fmt.Errorf("%w: file %q: stored object is shorter than its extents", ErrCorrupt, f.Name)
			}
		}
		if n, _ := io.ReadFull(src, buf[:1]); n > 0 {
			return 0, "", fmt.Errorf("%w: file %q: stored object is longer than its extents", ErrCorrupt, f.Name)
		}
		w.skipTo(f.Size)
	}
	if err := w.finish(); err != nil {
		return 0, "", err
	}
	if err := out.Close(); err != nil {
		return 0, "", fmt.Errorf("close %s: %w", dst, err)
	}
	return w.off, hex.EncodeToString(w.h.Sum(nil)), nil
}

func (r *ossRepo) List(ctx context.Context, kind string) ([]*Manifest, error) {
	if err := validName("kind", kind); err != nil {
		return nil, err
	}
	pfx := r.key(kind) + "/"
	var ids []string
	for o := range r.c.ListObjects(ctx, r.bucket, minio.ListObjectsOptions{Prefix: pfx, Recursive: true}) {
		if o.Err != nil {
			return nil, fmt.Errorf("list %s: %w", kind, o.Err)
		}
		rest := strings.TrimPrefix(o.Key, pfx)
		id, name, ok := strings.Cut(rest, "/")
		if ok && name == ManifestName && validName("id", id) == nil {
			ids = append(ids, id)
		}
	}
	sort.Strings(ids)
	var out []*Manifest
	for _, id := range ids {
		m, err := r.Stat(ctx, kind, id)
		if errors.Is(err, ErrNotFound) {
			continue // deleted meanwhile
		}
		if err != nil {
			return nil, fmt.Errorf("list %s: %w", kind, err)
		}
		out = append(out, m)
	}
	return out, nil
}

func (r *ossRepo) Delete(ctx context.Context, kind, id string) error {
	if _, err := r.Stat(ctx, kind, id); err != nil {
		return err
	}
	// Manifest first: from here on the artifact is invisible.
	if err := r.c.RemoveObject(ctx, r.bucket, r.key(kind, id, ManifestName), minio.RemoveObjectOptions{}); err != nil {
		return fmt.Errorf("delete %s/%s: manifest: %w", kind, id, err)
	}
	if err := r.removeAll(ctx, r.key(kind, id)+"/"); err != nil {
		return fmt.Errorf("delete %s/%s: %w", kind, id, err)
	}
	return nil
}

// removeAll removes every object under prefix.
func (r *ossRepo) removeAll(ctx context.Context, prefix string) error {
	var keys []string
	for o := range r.c.ListObjects(ctx, r.bucket, minio.ListObjectsOptions{Prefix: prefix, Recursive: true}) {
		if o.Err != nil {
			return fmt.Errorf("list %s: %w", prefix, o.Err)
		}
		keys = append(keys, o.Key)
	}
	return r.removeKeys(ctx, keys)
}

func (r *ossRepo) removeKeys(ctx context.Context, keys []string) error {
	for _, k := range keys {
		if err := r.c.RemoveObject(ctx, r.bucket, k, minio.RemoveObjectOptions{}); err != nil && !isNoSuchKey(err) {
			return fmt.Errorf("remove %s: %w", k, err)
		}
	}
	return nil
}

func (r *ossRepo) Cleanup(ctx context.Context, olderThan time.Duration) (int, error) {
	cutoff := time.Now().Add(-olderThan)
	// One group per upload: the files of one Put's data folder (or, for
	// artifacts of older releases, the files beside the manifest).
	type group struct {
		kind, id, data string
		keys           []string
		newest         time.Time
	}
	groups := map[string]*group{}
	manifests := map[string]bool{} // kind/id with a manifest
	pfx := ""
	if r.prefix != "" {
		pfx = r.prefix + "/"
	}
	for o := range r.c.ListObjects(ctx, r.bucket, minio.ListObjectsOptions{Prefix: pfx, Recursive: true}) {
		if o.Err != nil {
			return 0, fmt.Errorf("cleanup: %w", o.Err)
		}
		parts := strings.Split(strings.TrimPrefix(o.Key, pfx), "/")
		if len(parts) < 3 || len(parts) > 4 || validKindID(parts[0], parts[1]) != nil {
			continue // not ours
		}
		artifact := parts[0] + "/" + parts[1]
		if len(parts) == 3 && parts[2] == ManifestName {
			manifests[artifact] = true
			continue
		}
		data := ""
		if len(parts) == 4 {
			data = parts[2]
		}
		g := groups[artifact+"/"+data]
		if g == nil {
			g = &group{kind: parts[0], id: parts[1], data: data}
			groups[artifact+"/"+data] = g
		}
		g.keys = append(g.keys, o.Key)
		if o.LastModified.After(g.newest) {
			g.newest = o.LastModified
		}
	}
	n := 0
	for _, g := range groups {
		if g.newest.After(cutoff) {
			continue
		}
		if manifests[g.kind+"/"+g.id] {
			m, err := r.Stat(ctx, g.kind, g.id)
			if err != nil && !errors.Is(err, ErrNotFound) {
				continue // unreadable: keep everything
			}
			if err == nil && m.Data == g.data {
				continue // the committed upload
			}
		}
		if err := r.removeKeys(ctx, g.keys); err != nil {
			return n, fmt.Errorf("cleanup: %w", err)
		}
		n++
	}
	// Multipart uploads abandoned by a crashed Put.
	for u := range r.c.ListIncompleteUploads(ctx, r.bucket, pfx, true) {
		if u.Err != nil {
			return n, fmt.Errorf("cleanup: list incomplete uploads: %w", u.Err)
		}
		if u.Initiated.After(cutoff) {
			continue
		}
		if err := r.c.RemoveIncompleteUpload(ctx, r.bucket, u.Key); err != nil {
			return n, fmt.Errorf("cleanup: abort upload of %s: %w", u.Key, err)
		}
		n++
	}
	return n, nil
}
