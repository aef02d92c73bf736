// Package image turns OCI container images (an OCI image layout directory, a
// `docker save` tarball, or a registry reference) into the read-only qcow2
// disk layers templates boot from. Each image layer becomes one qcow2 layer
// holding only the clusters it changes over the layer below, named by the
// layer's OCI chain ID, so a layer shared by several images (same digests
// below it) is built and stored once.
package image

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/remote/transport"
	"github.com/google/go-containerregistry/pkg/v1/tarball"

	"golang.org/x/sys/unix"

	"github.com/agentenv/agentenv/internal/storage"
)

// Source names an image: exactly one of Layout, Archive and Ref is set.
type Source struct {
	Layout  string // an OCI image layout directory
	Tag     string // with Layout: the image's ref.name annotation (default: the only image)
	Archive string // a `docker save` tarball
	Ref     string // a registry reference (credentials from the docker config)

	policy *Policy // set by Policy.Check: what a pull may connect to
}

func (s Source) String() string {
	switch {
	case s.Layout != "" && s.Tag != "":
		return "oci-layout:" + s.Layout + ":" + s.Tag
	case s.Layout != "":
		return "oci-layout:" + s.Layout
	case s.Archive != "":
		return "docker-archive:" + s.Archive
	}
	return s.Ref
}

// Options configure an import.
type Options struct {
	// LayersDir holds the layers (<chain id>.qcow2 and .json), shared by
	// every template of a node.
	LayersDir string
	// SizeMiB is the size of the root filesystem (default 4096).
	SizeMiB int
	// Finish, if set, edits the finished file system in a layer of its
	// own on top of the image's, identified by FinishID.
	Finish   func(fs *Filesystem) error
	FinishID string
	// Log reports progress.
	Log func(format string, args ...any)
}

// Layer is one disk layer of an imported image.
type Layer struct {
	ChainID string `json:"chainID"`
	DiffID  string `json:"diffID"`
	Parent  string `json:"parent,omitempty"` // chain ID below
	Path    string `json:"-"`
	Bytes   int64  `json:"bytes"`
	Reused  bool   `json:"-"`
	// TreeSHA256 checks the model of the layer's tree kept beside it.
	TreeSHA256 string `json:"treeSHA256"`
}

// Result is an imported image: its layers, bottom first, and the runtime
// settings of its config.
type Result struct {
	Layers     []Layer
	Top        string // path of the top layer
	Env        []string
	WorkingDir string
	User       string
	Cmd        []string
}

// ErrImage marks a source that cannot be read as an image, or an image
// whose filesystem cannot hold a sandbox.
var ErrImage = errors.New("cannot read image")

// ErrUnusable marks an image that was read but whose filesystem cannot
// hold a sandbox (what Options.Finish refuses, e.g. no /bin/sh).
var ErrUnusable = errors.New("cannot hold a sandbox")

// ErrNotFound marks an image that is not there: no such file or directory,
// or a registry that does not know the repository or the tag.
var ErrNotFound = errors.New("image not found")

// refNameAnnotation names an image of an OCI layout's index (its tag).
const refNameAnnotation = "org.opencontainers.image.ref.name"

func load(ctx context.Context, src Source) (v1.Image, error) {
	missing := func(path string) bool {
		_, err := os.Stat(path)
		return errors.Is(err, os.ErrNotExist)
	}
	switch {
	case src.Layout != "":
		if missing(src.Layout) {
			return nil, fmt.Errorf("%w: %s: no such OCI layout directory", ErrNotFound, src)
		}
		idx, err := layout.ImageIndexFromPath(src.Layout)
		if err != nil {
			return nil, fmt.Errorf("%w: OCI layout %s: %v", ErrImage, src.Layout, err)
		}
		im, err := idx.IndexManifest()
		if err != nil {
			return nil, fmt.Errorf("%w: OCI layout %s: %v", ErrImage, src.Layout, err)
		}
		for _, d := range im.Manifests {
			if d.Platform != nil && (d.Platform.OS != "linux" || d.Platform.Architecture != "amd64") {
				continue
			}
			if d.MediaType.IsIndex() {
				continue
			}
			if src.Tag != "" && d.Annotations[refNameAnnotation] != src.Tag {
				continue
			}
			img, err := idx.Image(d.Digest)
			if err != nil {
				return nil, fmt.Errorf("%w: OCI layout %s: %v", ErrImage, src.Layout, err)
			}
			return img, nil
		}
		if src.Tag != "" {
			return nil, fmt.Errorf("%w: %s: the OCI layout has no linux/amd64 image tagged %q", ErrNotFound, src, src.Tag)
		}
		return nil, fmt.Errorf("%w: OCI layout %s has no linux/amd64 image", ErrImage, src.Layout)
	case src.Archive != "":
		if missing(src.Archive) {
			return nil, fmt.Errorf("%w: %s: no such archive", ErrNotFound, src)
		}
		img, err := tarball.ImageFromPath(src.Archive, nil)
		if err != nil {
			return nil, fmt.Errorf("%w: archive %s: %v", ErrImage, src.Archive, err)
		}
		return img, nil
	case src.Ref != "":
		ref, err := name.ParseReference(src.Ref)
		if err != nil {
			return nil, fmt.Errorf("%w: reference %q: %v", ErrImage, src.Ref, err)
		}
		img, err := remote.Image(ref, remote.WithContext(ctx), remote.WithAuthFromKeychain(authn.DefaultKeychain),
			remote.WithPlatform(v1.Platform{OS: "linux", Architecture: "amd64"}), remote.WithTransport(src.policy.transport()))
		if registryNotFound(err) {
			return nil, fmt.Errorf("%w: pull %s: the registry has no such image", ErrNotFound, src.Ref)
		}
		if err != nil {
			return nil, registryError(src.Ref, err)
		}
		return img, nil
	}
	return nil, fmt.Errorf("%w: no source given", ErrImage)
}

// registryNotFound tells whether a registry's answer means the repository
// or the manifest does not exist.
func registryNotFound(err error) bool {
	var terr *transport.Error
	if !errors.As(err, &terr) {
		return false
	}
	if terr.StatusCode == http.StatusNotFound {
		return true
	}
	for _, d := range terr.Errors {
		if d.Code == transport.ManifestUnknownErrorCode || d.Code == transport.NameUnknownErrorCode {
			return true
		}
	}
	return false
}

// Import builds (or reuses) the disk layers of an image.
func Import(ctx context.Context, src Source, opt Options) (*Result, error) {
	if opt.Log == nil {
		opt.Log = func(string, ...any) {}
	}
	if opt.SizeMiB == 0 {
		opt.SizeMiB = 4096
	}
	if err := os.MkdirAll(opt.LayersDir, 0o755); err != nil {
		return nil, err
	}
	// One import at a time builds layers: a layer built twice would differ
	// (file system UUIDs, times) from the one the layers above rest on.
	lock, err := lockLayers(ctx, opt.LayersDir)
	if err != nil {
		return nil, err
	}
	defer lock.Close()
	img, err := load(ctx, src)
	if err != nil {
		return nil, err
	}
	cfg, err := img.ConfigFile()
	if err != nil {
		return nil, fmt.Errorf("%w: config: %v", ErrImage, err)
	}
	layers, err := img.Layers()
	if err != nil {
		return nil, fmt.Errorf("%w: layers: %v", ErrImage, err)
	}
	res := &Result{Env: cfg.Config.Env, WorkingDir: cfg.Config.WorkingDir, User: cfg.Config.User,
		Cmd: append(append([]string{}, cfg.Config.Entrypoint...), cfg.Config.Cmd...)}
	var below *Layer // the layer built last
	for i, l := range layers {
		diffID, err := l.DiffID()
		if err != nil {
			return nil, fmt.Errorf("%w: layer %d: %v", ErrImage, i, err)
		}
		built, err := buildLayer(ctx, opt, below, diffID.String(), func(fs *Filesystem) error {
			rc, err := l.Uncompressed()
			if err != nil {
				if src.Ref != "" {
					return registryError(src.Ref, err)
				}
				return err
			}
			defer rc.Close()
			h := sha256.New()
			if err := fs.Apply(ctx, io.TeeReader(rc, h)); err != nil {
				return err
			}
			// The rest of the stream (tar padding) counts towards the digest.
			if _, err := io.Copy(h, rc); err != nil {
				return err
			}
			if got := "sha256:" + hex.EncodeToString(h.Sum(nil)); got != diffID.String() {
				return fmt.Errorf("layer content is %s, the image says %s", got, diffID)
			}
			return nil
		})
		if err != nil {
			return nil, fmt.Errorf("layer %d/%d (%s): %w", i+1, len(layers), short(diffID.String()), err)
		}
		res.Layers = append(res.Layers, *built)
		below = built
	}
	if opt.Finish != nil {
		built, err := buildLayer(ctx, opt, below, "finish:"+opt.FinishID, opt.Finish)
		if err != nil {
			if errors.Is(err, ErrUnusable) {
				return nil, fmt.Errorf("%s %w", src, err)
			}
			return nil, fmt.Errorf("final layer: %w", err)
		}
		res.Layers = append(res.Layers, *built)
	}
	if len(res.Layers) == 0 {
		return nil, fmt.Errorf("%w: the image has no layers", ErrImage)
	}
	res.Top = res.Layers[len(res.Layers)-1].Path
	return res, nil
}

// TopChain is the chain ID of the top layer Import of src makes with a
// Finish layer identified by finishID ("": none), read from the image's
// config alone: no layer is downloaded or unpacked. Import verifies each
// layer against the diff IDs it is computed from.
func TopChain(ctx context.Context, src Source, finishID string) (string, error) {
	img, err := load(ctx, src)
	if err != nil {
		return "", err
	}
	cfg, err := img.ConfigFile()
	if err != nil {
		return "", fmt.Errorf("%w: config: %v", ErrImage, err)
	}
	top := ""
	for _, d := range cfg.RootFS.DiffIDs {
		top = chainID(top, d.String())
	}
	if finishID != "" {
		top = chainID(top, "finish:"+finishID)
	}
	if top == "" {
		return "", fmt.Errorf("%w: the image has no layers", ErrImage)
	}
	return top, nil
}

// layerFormat names how layers are built: a change of the builder that
// changes what a layer holds must change it, so layers built before are
// never taken for new ones (they stay for what uses them).
const layerFormat = "aenv-layer-v2"

// chainID names a layer: its diff ID over the chain below, as OCI chain
// IDs are made, starting from layerFormat.
func chainID(parent, diffID string) string {
	if parent == "" {
		parent = layerFormat
	}
	sum := sha256.Sum256([]byte(parent + " " + diffID))
	return "sha256:" + hex.EncodeToString(sum[:])
}

func short(digest string) string {
	d := strings.TrimPrefix(digest, "sha256:")
	if len(d) > 12 {
		d = d[:12]
	}
	return d
}

// LayerPath is where the layer with a chain ID is kept.
func LayerPath(layersDir, chain string) string {
	return filepath.Join(layersDir, strings.TrimPrefix(chain, "sha256:")+".qcow2")
}

// buildLayer makes the layer of diffID over below (nil: none) by applying
// change to a copy of below's file system image, unless it exists
// already. The image is never mounted: change works on it as data (see
// Filesystem).
func buildLayer(ctx context.Context, opt Options, below *Layer, diffID string, change func(fs *Filesystem) error) (*Layer, error) {
	parent := ""
	if below != nil {
		parent = below.ChainID
	}
	chain := chainID(parent, diffID)
	out := LayerPath(opt.LayersDir, chain)
	meta := metaPath(opt.LayersDir, chain)
	var have Layer
	if b, err := os.ReadFile(meta); err == nil && json.Unmarshal(b, &have) == nil && have.ChainID == chain {
		if st, err := os.Stat(out); err == nil {
			have.Path, have.Reused, have.Bytes = out, true, st.Size()
			opt.Log("layer %s: already built", short(chain))
			return &have, nil
		}
	}
	start := time.Now()
	work, err := os.MkdirTemp(opt.LayersDir, ".build-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(work)
	raw := filepath.Join(work, "fs.raw")
	var tree *Tree
	if below == nil {
		if err := run(ctx, "mkfs.ext4", "-q", "-F", "-L", "aenv-root", "-E", "root_owner=0:0", raw, fmt.Sprintf("%dM", opt.SizeMiB)); err != nil {
			return nil, err
		}
		tree = newTree()
	} else {
		if tree, err = loadTree(opt.LayersDir, below); err != nil {
			return nil, err
		}
		if err := run(ctx, "qemu-img", "convert", "-q", "-f", "qcow2", "-O", "raw", LayerPath(opt.LayersDir, parent), raw); err != nil {
			return nil, err
		}
	}
	fs := &Filesystem{raw: raw, work: work, tree: tree, limit: int64(opt.SizeMiB) << 20}
	if err := change(fs); err != nil {
		return nil, err
	}
	tmp := filepath.Join(work, "layer.qcow2")
	args := []string{"convert", "-q", "-f", "raw", "-O", "qcow2", "-o", "cluster_size=65536"}
	if parent != "" {
		// Only the clusters that differ from the layer below.
		args = append(args, "-B", LayerPath(opt.LayersDir, parent), "-F", "qcow2")
	}
	if err := run(ctx, "qemu-img", append(args, raw, tmp)...); err != nil {
		return nil, err
	}
	if err := syncFile(tmp); err != nil {
		return nil, err
	}
	if err := os.Chmod(tmp, 0o444); err != nil {
		return nil, err
	}
	st, err := os.Stat(tmp)
	if err != nil {
		return nil, err
	}
	treeBytes, err := fs.tree.marshal()
	if err != nil {
		return nil, err
	}
	sum := sha256.Sum256(treeBytes)
	l := Layer{ChainID: chain, DiffID: diffID, Parent: parent, Path: out, Bytes: st.Size(), TreeSHA256: hex.EncodeToString(sum[:])}
	if err := storage.WriteFileAtomic(treePath(opt.LayersDir, chain), treeBytes, 0o444); err != nil {
		return nil, err
	}
	if err := os.Rename(tmp, out); err != nil {
		return nil, err
	}
	// The record is written last: a layer without one is rebuilt.
	b, _ := json.MarshalIndent(l, "", "  ")
	if err := storage.WriteFileAtomic(meta, append(b, '\n'), 0o644); err != nil {
		return nil, err
	}
	opt.Log("layer %s: built in %s (%d KiB, %d names)", short(chain), time.Since(start).Round(time.Millisecond), st.Size()>>10, fs.tree.Entries())
	return &l, nil
}

// metaPath is where a layer's record is kept (written last).
func metaPath(layersDir, chain string) string {
	return strings.TrimSuffix(LayerPath(layersDir, chain), ".qcow2") + ".json"
}

// treePath is where the model of a layer's tree is kept.
func treePath(layersDir, chain string) string {
	return strings.TrimSuffix(LayerPath(layersDir, chain), ".qcow2") + ".tree"
}

// loadTree reads the model of layer l's tree, checked against l's record.
func loadTree(layersDir string, l *Layer) (*Tree, error) {
	b, err := os.ReadFile(treePath(layersDir, l.ChainID))
	if err != nil {
		return nil, fmt.Errorf("layer %s: %w", short(l.ChainID), err)
	}
	if sum := sha256.Sum256(b); hex.EncodeToString(sum[:]) != l.TreeSHA256 {
		return nil, fmt.Errorf("layer %s: its tree does not match its record", short(l.ChainID))
	}
	return unmarshalTree(b)
}

// lockLayers takes the layers directory's lock, giving up when ctx ends.
func lockLayers(ctx context.Context, dir string) (*os.File, error) {
	lock, err := os.OpenFile(filepath.Join(dir, ".lock"), os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return nil, err
	}
	for {
		err := unix.Flock(int(lock.Fd()), unix.LOCK_EX|unix.LOCK_NB)
		if err == nil {
			return lock, nil
		}
		if !errors.Is(err, unix.EWOULDBLOCK) {
			lock.Close()
			return nil, err
		}
		select {
		case <-ctx.Done():
			lock.Close()
			return nil, fmt.Errorf("waiting for another image import: %w", ctx.Err())
		case <-time.After(50 * time.Millisecond):
		}
	}
}

func syncFile(path string) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	return f.Sync()
}

func run(ctx context.Context, name string, args ...string) error {
	out, err := exec.CommandContext(ctx, name, args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s %s: %v: %s", name, strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return nil
}
