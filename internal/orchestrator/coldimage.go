package orchestrator

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/agentenv/agentenv/internal/sandboxes"
	"github.com/agentenv/agentenv/internal/storage/image"
	"github.com/agentenv/agentenv/internal/templates"
)

// Sandboxes straight from an OCI image (POST /sandboxes-cold), with no
// template build: the image's layers are converted once into the store's
// shared layers (reused by every later sandbox and template of any image
// that shares them), the E2B user layer goes on top, and the sandbox boots
// from them with the node's kernel and envd. With a repository the
// converted layers go there too, and a node that lacks them (another node
// of the cluster, or this one after evicting them) serves them lazily
// through its chunk cache instead of converting the image again.

// ParseImageRef reads an image reference: a registry reference
// (credentials from the docker config), oci-layout:DIR[:TAG] or
// docker-archive:FILE.
func ParseImageRef(ref string) (image.Source, error) {
	switch {
	case ref == "":
		return image.Source{}, fmt.Errorf("%w: image is required", ErrInvalid)
	case strings.HasPrefix(ref, "oci-layout:"):
		dir := strings.TrimPrefix(ref, "oci-layout:")
		if dir == "" {
			return image.Source{}, fmt.Errorf("%w: oci-layout: needs a directory", ErrInvalid)
		}
		return layoutSource(dir), nil
	case strings.HasPrefix(ref, "docker-archive:"):
		file := strings.TrimPrefix(ref, "docker-archive:")
		if file == "" {
			return image.Source{}, fmt.Errorf("%w: docker-archive: needs a file", ErrInvalid)
		}
		return image.Source{Archive: file}, nil
	case strings.ContainsAny(ref, " \t\n") || len(ref) > 512:
		return image.Source{}, fmt.Errorf("%w: image %q is not an image reference", ErrInvalid, ref)
	}
	return image.Source{Ref: ref}, nil
}

// layoutSource reads DIR[:TAG]: a path that exists is the directory
// whatever it holds; otherwise what follows the last colon is the tag.
func layoutSource(ref string) image.Source {
	if _, err := os.Stat(ref); err == nil {
		return image.Source{Layout: ref}
	}
	if i := strings.LastIndexByte(ref, ':'); i > 0 && i < len(ref)-1 && !strings.Contains(ref[i+1:], "/") {
		return image.Source{Layout: ref[:i], Tag: ref[i+1:]}
	}
	return image.Source{Layout: ref}
}

// imageDiskMiB is the size of the root filesystem of images' sandboxes.
const imageDiskMiB = 4096

// imageImports lets one conversion of an image run at a time per image
// (a second create of it waits and then reuses its layers).
type imageImports struct {
	mu sync.Mutex
	by map[string]*sync.Mutex
}

func (ii *imageImports) lock(key string) func() {
	ii.mu.Lock()
	if ii.by == nil {
		ii.by = map[string]*sync.Mutex{}
	}
	m := ii.by[key]
	if m == nil {
		m = &sync.Mutex{}
		ii.by[key] = m
	}
	ii.mu.Unlock()
	m.Lock()
	return m.Unlock
}

// CreateFromImage makes a sandbox from image (see ParseImageRef) as req
// says (its TemplateID is ignored: the sandbox's template is the image).
func (n *Node) CreateFromImage(ctx context.Context, ref string, req CreateRequest) (*sandboxes.Sandbox, error) {
	src, err := ParseImageRef(ref)
	if err != nil {
		return nil, err
	}
	if err := n.cfg.Images.Check(&src); err != nil {
		if errors.Is(err, image.ErrNotFound) {
			return nil, fmt.Errorf("%w: %v", ErrNotFound, err)
		}
		return nil, fmt.Errorf("%w: %v", ErrInvalid, err)
	}
	if err := n.floor.Check("an image import"); err != nil {
		return nil, err
	}
	unlock := n.imports.lock(src.String())
	// One filesystem size for every image: a layer converted once is
	// shared whatever size a later sandbox asks for (its overlay may be
	// larger).
	t, converted, err := n.remote.ImageLayers(ctx, src, imageDiskMiB, func(f string, a ...any) { n.log.Info(fmt.Sprintf(f, a...)) })
	if err == nil && n.images != nil {
		err = n.images.Used(ctx, t.Layer, src.String())
	}
	unlock()
	if err != nil {
		return nil, err
	}
	if converted && n.cfg.Repository != nil {
		n.pushImage(*t)
	}
	if n.images != nil {
		if evicted, err := n.images.Evict(context.WithoutCancel(ctx), t.Layer); err != nil {
			n.log.Error("image cache eviction", "err", err)
		} else if len(evicted) > 0 {
			n.log.Info("images evicted", "count", len(evicted))
		}
	}
	t.Name, t.DiskMiB = src.String(), imageDiskMiB
	if t.VCPUs == 0 {
		t.VCPUs = 2
	}
	if t.MemoryMiB == 0 {
		t.MemoryMiB = 512
	}
	req.TemplateID, req.template, req.noSnapshot = t.Name, t, true
	return n.Create(ctx, req)
}

// pushImage stores the layers of image template t, just converted, in the
// repository, in the background: the create does not wait for it.
func (n *Node) pushImage(t templates.Template) {
	n.wg.Add(1)
	go func() {
		defer n.wg.Done()
		ctx, cancel := n.stopContext()
		defer cancel()
		start := time.Now()
		unlock := n.imports.lock("push " + t.Layer)
		defer unlock()
		if err := n.remote.PushImage(ctx, &t); err != nil {
			n.log.Error("image layers not stored in the repository", "image", t.Image, "err", err)
			return
		}
		n.log.Info("image layers in the repository", "image", t.Image, "took", time.Since(start).Round(time.Millisecond))
	}()
}
