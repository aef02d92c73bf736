package templates

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"strings"

	"github.com/agentenv/agentenv/internal/errkind"
	"github.com/agentenv/agentenv/internal/storage/image"
	"github.com/agentenv/agentenv/internal/store"
)

// Images in the repository, loaded lazily. The layers a node converts
// from an image for sandboxes made straight from it (ImageLayers) go to
// its repository (PushImage) under a record named by the image's top
// chain ID, which the image's config alone gives. A node that does not have
// those layers (it never converted the image, or evicted it) serves them
// through its NBD server and chunk cache, as it does a lazily loaded
// template's, instead of pulling and converting the image; its label
// (store.LabelLazyImage) holds the local overlay until the image cache lets
// the image go (ReleaseImage).

const repoKindImage = "image"

// ImageLayers is Catalog.ImageLayers on a node with a repository: an image
// whose layers the node lacks but the repository holds is loaded lazily
// (converted false); any other is converted (or its layers reused) here.
func (r *Remote) ImageLayers(ctx context.Context, src image.Source, sizeMiB int, log func(string, ...any)) (t *Template, converted bool, err error) {
	if r.repo != nil {
		if t, err := r.pullImage(ctx, src); err == nil {
			return t, false, nil
		} else if !errors.Is(err, errkind.ErrNotFound) {
			// The repository is a cache here: convert the image instead.
			r.log.Warn("image not loaded from the repository", "image", src.String(), "err", err)
		}
	}
	t, err = r.cat.ImageLayers(ctx, src, sizeMiB, log)
	return t, err == nil, err
}

// pullImage loads image src lazily from the repository. It is an
// errkind.ErrNotFound when the node has the image's layers itself (there
// is nothing to load) or the repository does not hold them.
func (r *Remote) pullImage(ctx context.Context, src image.Source) (*Template, error) {
	top, err := image.TopChain(ctx, src, finishLayerID)
	if err != nil {
		// What cannot be read here the conversion reports.
		return nil, fmt.Errorf("%w: %v", errkind.ErrNotFound, err)
	}
	top = strings.TrimPrefix(top, "sha256:")
	if _, err := os.Stat(image.LayerPath(r.cat.st.Abs(store.LayersDir), top)); err == nil {
		return nil, fmt.Errorf("%w: the node has the layers of %s", errkind.ErrNotFound, src)
	}
	rec, err := getRecord(ctx, r.repo, repoKindImage, top)
	if err != nil {
		return nil, err
	}
	t := rec.Template
	t.Name, t.Image, t.LazyLayers = "", src.String(), rec.Layers
	final, err := r.lazyRoot(ctx, rec.Layers, func(tx *sql.Tx, id string) error {
		t.Layer = id
		b, err := json.Marshal(t)
		if err != nil {
			return err
		}
		return store.SetLabel(tx, store.LabelLazyImage, top, id, string(b))
	})
	if err != nil {
		return nil, fmt.Errorf("image %s: %w", src, err)
	}
	t.RootDisk = final
	r.log.Info("image loaded lazily from the repository", "image", src.String(), "layers", len(rec.Layers))
	return &t, nil
}

// PushImage stores the layers of an image this node converted (t, from
// ImageLayers) in the repository, for every node to load lazily. An image
// the repository holds already is left as it is.
func (r *Remote) PushImage(ctx context.Context, t *Template) error {
	if r.repo == nil || len(t.LazyLayers) > 0 {
		return nil
	}
	if _, err := r.repo.Stat(ctx, repoKindImage, t.Layer); err == nil {
		return nil
	}
	chain, err := LayerChain(ctx, t.RootDisk)
	if err != nil {
		return err
	}
	rec := templateRecord{Template: *t}
	rec.Template.Name, rec.Template.RootDisk, rec.Template.Layer = "", "", ""
	if rec.Layers, err = pushChain(ctx, r.repo, chain); err != nil {
		return err
	}
	return putRecord(ctx, r.repo, repoKindImage, t.Layer, rec)
}

// ReleaseImage lets go, in tx, of what holds the layers of a cached image
// whose top layer (ImageLayers' Template.Layer) is top: its image cache
// holder, or the label of an image loaded lazily.
func ReleaseImage(tx *sql.Tx, top string) error {
	if err := store.DropRefs(tx, ImageCacheHolder+"/"+top); err != nil {
		return err
	}
	return store.DeleteLabelsOf(tx, store.LabelLazyImage, top)
}

// reexportImages serves again, after a restart, the layers of the images
// this node loads lazily.
func (r *Remote) reexportImages(ctx context.Context) {
	ls, err := r.cat.st.Labels(ctx, store.LabelLazyImage)
	if err != nil {
		r.log.Error("list lazily loaded images", "err", err)
		return
	}
	for _, l := range ls {
		var t Template
		if err := json.Unmarshal([]byte(l.Data), &t); err != nil || len(t.LazyLayers) == 0 {
			r.log.Error("lazily loaded image record", "image", l.Name, "err", err)
			continue
		}
		if _, err := r.exportLayers(ctx, t.LazyLayers); err != nil {
			r.log.Error("serve the layers of a lazily loaded image", "image", t.Image, "err", err)
		}
	}
}
