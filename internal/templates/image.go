package templates

import (
	"archive/tar"
	"bytes"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"time"

	"github.com/agentenv/agentenv/internal/errkind"
	"github.com/agentenv/agentenv/internal/storage/image"
	"github.com/agentenv/agentenv/internal/store"
)

// Templates from OCI images: the image's layers become shared disk layers
// in the store (one per chain ID, see internal/storage/image), kept as a
// cache for every later import that shares them; one more layer adds what
// E2B sandboxes expect (the user `user` with uid 1000 and a home); the
// template's label points at that top layer.

// finishLayerID versions the E2B conventions layer: changing what
// e2bConventions does must change it.
const finishLayerID = "aenv-user-v1"

// ImageCacheHolder holds the layers of imported images.
const ImageCacheHolder = "cache/image-layers"

// ImportImage builds (or rebuilds, moving the label) template name from an
// OCI image.
func (c *Catalog) ImportImage(ctx context.Context, name string, src image.Source, sizeMiB int, log func(string, ...any)) (*Template, error) {
	if !NameRE.MatchString(name) {
		return nil, fmt.Errorf("%w: template name %q must match %s", errkind.ErrInvalid, name, NameRE)
	}
	t, err := c.imageLayers(ctx, src, sizeMiB, log, func(tx *sql.Tx, t *Template) error {
		t.Name = name
		return Set(tx, *t)
	})
	if err != nil {
		return nil, err
	}
	log("template %s from %s", t.Name, src)
	return c.Get(ctx, name)
}

// ImageLayers converts an OCI image into the node's shared layers (those
// it has already are reused) and returns what a sandbox boots from it:
// an unregistered template (no name) whose Layer is the image's top
// layer, with the E2B user layer on it and the image's environment. The
// layers are held by the image cache (ImageCacheHolder/<top>) until it
// lets them go.
func (c *Catalog) ImageLayers(ctx context.Context, src image.Source, sizeMiB int, log func(string, ...any)) (*Template, error) {
	return c.imageLayers(ctx, src, sizeMiB, log, nil)
}

// imageLayers imports src and records its layers and their cache holder,
// and what also (a label) in the same transaction.
func (c *Catalog) imageLayers(ctx context.Context, src image.Source, sizeMiB int, log func(string, ...any), also func(*sql.Tx, *Template) error) (*Template, error) {
	if log == nil {
		log = func(string, ...any) {}
	}
	start := time.Now()
	res, err := image.Import(ctx, src, image.Options{
		LayersDir: c.st.Abs(store.LayersDir), SizeMiB: sizeMiB, Log: log,
		Finish: func(fs *image.Filesystem) error { return e2bConventions(ctx, fs) }, FinishID: finishLayerID,
	})
	if err != nil {
		if errors.Is(err, image.ErrNotFound) {
			return nil, fmt.Errorf("%w: %v", errkind.ErrNotFound, err)
		}
		if errors.Is(err, image.ErrImage) || errors.Is(err, image.ErrUnusable) {
			return nil, fmt.Errorf("%w: %v", errkind.ErrInvalid, err)
		}
		return nil, fmt.Errorf("import %s: %w", src, err)
	}
	env := map[string]string{}
	for _, kv := range res.Env {
		if k, v, ok := strings.Cut(kv, "="); ok && k != "" {
			env[k] = v
		}
	}
	t := &Template{DefaultUser: "user", EnvVars: env, Image: src.String()}
	err = c.st.Tx(ctx, func(tx *sql.Tx) error {
		ids := make([]string, 0, len(res.Layers))
		parent := ""
		for _, l := range res.Layers {
			id := layerID(l.Path)
			if err := c.st.Add(tx, id, store.KindLayer, l.Path, parent); err != nil {
				return err
			}
			ids, parent = append(ids, id), id
		}
		if err := store.SetRefs(tx, ImageCacheHolder+"/"+parent, ids...); err != nil {
			return err
		}
		t.Layer = parent
		if also != nil {
			return also(tx, t)
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	reused := 0
	for _, l := range res.Layers {
		if l.Reused {
			reused++
		}
	}
	log("image %s: %d layers (%d reused) in %s", src, len(res.Layers), reused, time.Since(start).Round(time.Millisecond))
	t.RootDisk = c.st.Abs(res.Top)
	return t, nil
}

// layerID names a layer file of the store by its file name (layers are
// named by content: chain IDs, content checksums, build keys).
func layerID(path string) string { return strings.TrimSuffix(filepath.Base(path), ".qcow2") }

// maxAccountsFile bounds what the conventions read of /etc/passwd and
// /etc/group.
const maxAccountsFile = 1 << 20

// e2bConventions adds the user `user` (uid and gid 1000, home /home/user)
// that E2B sandboxes run commands as, unless the image has it. The image's
// files are read as data: only regular files of bounded size, their paths
// resolved inside the image.
func e2bConventions(ctx context.Context, fs *image.Filesystem) error {
	// Commands, the SDKs' and envd's own, run through /bin/sh.
	if err := hasShell(fs); err != nil {
		return err
	}
	passwd, err := accountsFile(ctx, fs, "etc/passwd")
	if err != nil {
		return err
	}
	group, err := accountsFile(ctx, fs, "etc/group")
	if err != nil {
		return err
	}
	if len(passwd) == 0 {
		passwd = []byte("root:x:0:0:root:/root:/bin/sh\n")
	}
	if len(group) == 0 {
		group = []byte("root:x:0:\n")
	}
	shell := "/bin/sh"
	if e, err := fs.Stat("bin/bash"); err == nil && e.Type == tar.TypeReg {
		shell = "/bin/bash"
	}
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	now := time.Now()
	file := func(name string, data []byte, mode int64) {
		_ = tw.WriteHeader(&tar.Header{Name: name, Typeflag: tar.TypeReg, Mode: mode, Size: int64(len(data)), ModTime: now})
		_, _ = tw.Write(data)
	}
	if !hasEntry(passwd, "user") {
		file("etc/passwd", append(withNewline(passwd), "user:x:1000:1000:user:/home/user:"+shell+"\n"...), 0o644)
	}
	if !hasEntry(group, "user") {
		file("etc/group", append(withNewline(group), "user:x:1000:\n"...), 0o644)
	}
	_ = tw.WriteHeader(&tar.Header{Name: "home/user/", Typeflag: tar.TypeDir, Mode: 0o755, Uid: 1000, Gid: 1000, ModTime: now})
	if err := tw.Close(); err != nil {
		return err
	}
	return fs.Apply(ctx, &buf)
}

// accountsFile reads /etc/passwd or /etc/group of the image: nothing if it
// has none; anything but a regular file of at most maxAccountsFile bytes
// refuses the import (ReadFile's ErrUnusable, naming the file).
func accountsFile(ctx context.Context, fs *image.Filesystem, name string) ([]byte, error) {
	b, err := fs.ReadFile(ctx, name, maxAccountsFile)
	if image.IsNotExist(err) {
		return nil, nil
	}
	return b, err
}

// hasShell tells whether the image has an executable /bin/sh (resolved
// inside the image, as busybox's and Debian's symlinks are).
func hasShell(fs *image.Filesystem) error {
	e, err := fs.Stat("bin/sh")
	if err != nil {
		return fmt.Errorf("%w: it has no /bin/sh, which a sandbox runs its commands with", image.ErrUnusable)
	}
	if e.Type != tar.TypeReg || e.Mode&0o111 == 0 {
		return fmt.Errorf("%w: its /bin/sh is not an executable file, which a sandbox runs its commands with", image.ErrUnusable)
	}
	return nil
}

func hasEntry(db []byte, name string) bool {
	for _, line := range strings.Split(string(db), "\n") {
		if strings.HasPrefix(line, name+":") {
			return true
		}
	}
	return false
}

func withNewline(b []byte) []byte {
	if len(b) > 0 && b[len(b)-1] != '\n' {
		return append(b, '\n')
	}
	return b
}
