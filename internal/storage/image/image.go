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
	"runtime"
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
	// Finish, if set, edits the finished tree (mounted at root) in a layer
	// of its own on top of the image's, identified by FinishID.
	Finish   func(root string) error
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
			remote.WithPlatform(v1.Platform{OS: "linux", Architecture: "amd64"}))
		if registryNotFound(err) {
			return nil, fmt.Errorf("%w: pull %s: the registry has no such image: %v", ErrNotFound, src.Ref, err)
		}
		if err != nil {
			return nil, fmt.Errorf("%w: pull %s: %v", ErrImage, src.Ref, err)
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
	lock, err := os.OpenFile(filepath.Join(opt.LayersDir, ".lock"), os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return nil, err
	}
	defer lock.Close()
	if err := unix.Flock(int(lock.Fd()), unix.LOCK_EX); err != nil {
		return nil, err
	}
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
	parent := ""
	for i, l := range layers {
		diffID, err := l.DiffID()
		if err != nil {
			return nil, fmt.Errorf("%w: layer %d: %v", ErrImage, i, err)
		}
		chain := chainID(parent, diffID.String())
		built, err := buildLayer(ctx, opt, chain, parent, diffID.String(), func(root string) error {
			rc, err := l.Uncompressed()
			if err != nil {
				return err
			}
			defer rc.Close()
			h := sha256.New()
			if err := applyLayer(root, io.TeeReader(rc, h)); err != nil {
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
		parent = chain
	}
	if opt.Finish != nil {
		chain := chainID(parent, "finish:"+opt.FinishID)
		built, err := buildLayer(ctx, opt, chain, parent, "finish:"+opt.FinishID, opt.Finish)
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

// chainID is the OCI chain ID of a layer: its diff ID over the chain below.
func chainID(parent, diffID string) string {
	if parent == "" && strings.HasPrefix(diffID, "sha256:") {
		return diffID
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

// buildLayer makes the layer chain over parent by applying change to a
// writable copy of the parent's filesystem, unless it exists already.
func buildLayer(ctx context.Context, opt Options, chain, parent, diffID string, change func(root string) error) (*Layer, error) {
	out := LayerPath(opt.LayersDir, chain)
	meta := strings.TrimSuffix(out, ".qcow2") + ".json"
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
	if parent == "" {
		if err := run(ctx, "mkfs.ext4", "-q", "-F", "-L", "aenv-root", "-E", "root_owner=0:0", raw, fmt.Sprintf("%dM", opt.SizeMiB)); err != nil {
			return nil, err
		}
	} else if err := run(ctx, "qemu-img", "convert", "-q", "-f", "qcow2", "-O", "raw", LayerPath(opt.LayersDir, parent), raw); err != nil {
		return nil, err
	}
	mnt := filepath.Join(work, "mnt")
	if err := os.Mkdir(mnt, 0o755); err != nil {
		return nil, err
	}
	if err := onPrivateMount(ctx, raw, mnt, change); err != nil {
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
	l := Layer{ChainID: chain, DiffID: diffID, Parent: parent, Path: out, Bytes: st.Size()}
	if err := os.Rename(tmp, out); err != nil {
		return nil, err
	}
	// The record is written last: a layer without one is rebuilt.
	b, _ := json.MarshalIndent(l, "", "  ")
	if err := storage.WriteFileAtomic(meta, append(b, '\n'), 0o644); err != nil {
		return nil, err
	}
	opt.Log("layer %s: built in %s (%d KiB)", short(chain), time.Since(start).Round(time.Millisecond), st.Size()>>10)
	return &l, nil
}

// onPrivateMount mounts the ext4 file raw at mnt, runs change on the
// mounted tree and unmounts it, in a mount namespace of its own that lives
// on one OS thread for the call and dies with it. In the node's namespace
// the mount would be copied into every mount namespace made while it
// exists (each QEMU gets one, see internal/vmm): the copy keeps the
// filesystem mounted after the umount here, so what change wrote would
// never reach raw and the layer would be built without it. A loop device
// still bound to raw after the umount (a copy made some other way) is an
// error for the same reason.
func onPrivateMount(ctx context.Context, raw, mnt string, change func(root string) error) error {
	done := make(chan error, 1)
	go onThreadOfItsOwn(done, func() error {
		if err := unix.Unshare(unix.CLONE_NEWNS); err != nil {
			return fmt.Errorf("a mount namespace for the layer build: %w", err)
		}
		// Private, so the mount does not propagate back to the node.
		if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
			return fmt.Errorf("making the layer build's mounts private: %w", err)
		}
		if err := run(ctx, "mount", "-o", "loop", raw, mnt); err != nil {
			return err
		}
		cerr := change(mnt)
		if err := run(context.WithoutCancel(ctx), "umount", mnt); err != nil {
			return errors.Join(cerr, err)
		}
		return cerr
	})
	if err := <-done; err != nil {
		return err
	}
	return waitLoopReleased(raw, loopReleaseWait)
}

// onThreadOfItsOwn runs fn, which may change its thread's namespaces, on an
// OS thread that ends with it, and sends its error to done. Never on the
// main thread: that one cannot end (Go parks it for good instead), and its
// namespaces are what /proc/self shows every thread of the process.
func onThreadOfItsOwn(done chan<- error, fn func() error) {
	runtime.LockOSThread()
	if unix.Gettid() == unix.Getpid() {
		// While this goroutine holds the main thread, no other runs
		// on it.
		inner := make(chan error, 1)
		go onThreadOfItsOwn(inner, fn)
		done <- <-inner
		runtime.UnlockOSThread()
		return
	}
	// Never unlocked: the thread ends with this goroutine. Go starts
	// new threads from a clean template thread while one is locked, so
	// none inherits its namespace.
	done <- fn()
}

// loopReleaseWait bounds the wait for a layer's loop device to go.
var loopReleaseWait = 10 * time.Second

// waitLoopReleased waits until no loop device is bound to the file (the
// kernel releases a mount's auto-clearing loop device once the filesystem
// is unmounted everywhere).
func waitLoopReleased(file string, within time.Duration) error {
	want, err := os.Stat(file)
	if err != nil {
		return err
	}
	for deadline := time.Now().Add(within); ; {
		dev := loopDeviceOf(want)
		if dev == "" {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the layer's filesystem is still mounted somewhere after its unmount (%s still bound to it): "+
				"its writes may not have reached the layer", dev)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// loopDeviceOf names a loop device whose backing file is want, or "".
func loopDeviceOf(want os.FileInfo) string {
	files, _ := filepath.Glob("/sys/block/loop*/loop/backing_file")
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			continue // released meanwhile
		}
		if st, err := os.Stat(strings.TrimSpace(string(b))); err == nil && os.SameFile(st, want) {
			return filepath.Base(filepath.Dir(filepath.Dir(f)))
		}
	}
	return ""
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
