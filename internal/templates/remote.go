package templates

import (
	"context"
	"crypto/sha256"
	"database/sql"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"

	"github.com/agentenv/agentenv/internal/errkind"
	"github.com/agentenv/agentenv/internal/storage"
	"github.com/agentenv/agentenv/internal/storage/lazy"
	"github.com/agentenv/agentenv/internal/storage/repository"
	"github.com/agentenv/agentenv/internal/store"
)

// Templates in the repository, loaded lazily: Push stores a template's
// chain of disk layers as chunked layers plus a template record;
// a node that does not have the template registers each layer as an export
// of its NBD server (reading chunks through its bounded cache) and boots
// sandboxes from a local thin overlay whose backing chain is those exports.
// Nothing of the layers is downloaded before the guest reads it.

const (
	repoKindTemplate   = "template"
	templateRecordFile = "template.json"
	nbdSocketName      = "nbd.sock"
)

// templateRecord is a template as stored in the repository.
type templateRecord struct {
	Template Template `json:"template"`
	// Layers are layer ids, bottom first.
	Layers []string `json:"layers"`
}

// LayerChain lists a disk image's backing chain, bottom first (the image
// itself last).
func LayerChain(ctx context.Context, top string) ([]string, error) {
	var chain []string
	for p := top; p != ""; {
		chain = append([]string{p}, chain...)
		info, err := storage.Info(ctx, p)
		if err != nil {
			return nil, err
		}
		next := info.BackingFilename
		if next != "" && !filepath.IsAbs(next) {
			next = filepath.Join(filepath.Dir(p), next)
		}
		p = next
		if len(chain) > 64 {
			return nil, errors.New("backing chain deeper than 64")
		}
	}
	return chain, nil
}

// ContentID names a layer file by its content, as the repository names
// layers.
func ContentID(path string) (string, error) {
	sum, err := store.FileSHA256(path)
	if err != nil {
		return "", err
	}
	return "l-" + sum[:40], nil
}

// Push stores template name of a catalog (all its layers) in repo, from
// where any node can run it without downloading it first. Layers already
// there (same content) are not uploaded again.
func Push(ctx context.Context, cat *Catalog, repo repository.Repository, name string) error {
	t, err := cat.Get(ctx, name)
	if err != nil {
		return err
	}
	chain, err := LayerChain(ctx, t.RootDisk)
	if err != nil {
		return err
	}
	rec := templateRecord{Template: *t}
	rec.Template.RootDisk = ""
	if rec.Layers, err = pushChain(ctx, repo, chain); err != nil {
		return err
	}
	return putRecord(ctx, repo, repoKindTemplate, name, rec)
}

// pushChain stores the layer files of chain (bottom first) in repo as
// chunked layers named by their content, and returns those names. Layers
// already there are not uploaded again.
func pushChain(ctx context.Context, repo repository.Repository, chain []string) ([]string, error) {
	ids := make([]string, 0, len(chain))
	for _, p := range chain {
		id, err := ContentID(p)
		if err != nil {
			return nil, err
		}
		if _, err := repo.Stat(ctx, "layer", id); err != nil {
			if _, err := lazy.PushLayer(ctx, repo, id, p, 0); err != nil {
				return nil, fmt.Errorf("push layer %s: %w", filepath.Base(p), err)
			}
		}
		ids = append(ids, id)
	}
	return ids, nil
}

// putRecord stores rec as kind/name in repo (replacing what was there).
func putRecord(ctx context.Context, repo repository.Repository, kind, name string, rec templateRecord) error {
	stage, err := os.MkdirTemp("", "aenv-tpl-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(stage)
	b, _ := json.MarshalIndent(rec, "", "  ")
	if err := os.WriteFile(filepath.Join(stage, templateRecordFile), b, 0o600); err != nil {
		return err
	}
	if err := repo.Delete(ctx, kind, name); err != nil && !errors.Is(err, repository.ErrNotFound) {
		return err
	}
	_, err = repo.Put(ctx, kind, name, stage)
	return err
}

// getRecord reads kind/name from repo (errkind.ErrNotFound when it is not
// there).
func getRecord(ctx context.Context, repo repository.Repository, kind, name string) (*templateRecord, error) {
	stage, err := os.MkdirTemp("", "aenv-tpl-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(stage)
	if _, err := repo.Get(ctx, kind, name, stage); err != nil {
		if errors.Is(err, repository.ErrNotFound) {
			return nil, fmt.Errorf("%w: %s %q in the repository", errkind.ErrNotFound, kind, name)
		}
		return nil, err
	}
	var rec templateRecord
	if err := storage.ReadJSON(filepath.Join(stage, templateRecordFile), &rec); err != nil || len(rec.Layers) == 0 {
		return nil, fmt.Errorf("%w: %s %s record in the repository", errkind.ErrCorrupt, kind, name)
	}
	return &rec, nil
}

// Remote is the templates of a node's repository, loaded lazily: the NBD
// server its QEMUs read layers from and the chunk cache in front of the
// repository (started on first use).
type Remote struct {
	cat      *Catalog
	repo     repository.Repository // nil: the node has no repository
	dataDir  string
	cacheMiB int
	peers    []string
	token    string
	log      *slog.Logger

	mu sync.Mutex
	ll *lazyLayers // guarded by mu
}

// lazyLayers serves repository layers to this node's QEMUs.
type lazyLayers struct {
	srv   *lazy.Server
	cache *lazy.Cache
	sock  string
}

// NewRemote returns the lazily loaded templates of repo (nil: none) for
// catalog cat, with a chunk cache of cacheMiB under dataDir and, when
// peers and token are set, neighbours asked for chunks first.
func NewRemote(cat *Catalog, repo repository.Repository, dataDir string, cacheMiB int, peers []string, token string, log *slog.Logger) *Remote {
	return &Remote{cat: cat, repo: repo, dataDir: dataDir, cacheMiB: cacheMiB, peers: peers, token: token, log: log}
}

// Push stores template name in the repository.
func (r *Remote) Push(ctx context.Context, name string) error {
	if r.repo == nil {
		return errors.New("the node has no repository")
	}
	return Push(ctx, r.cat, r.repo, name)
}

func (r *Remote) loaded() *lazyLayers {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.ll
}

// Close stops the NBD server.
func (r *Remote) Close() {
	if ll := r.loaded(); ll != nil {
		ll.srv.Close()
	}
}

// Cache is the chunk cache (nil before the first template loads lazily).
func (r *Remote) Cache() *lazy.Cache {
	if ll := r.loaded(); ll != nil {
		return ll.cache
	}
	return nil
}

// server starts the NBD server and chunk cache on first use.
func (r *Remote) server() (*lazyLayers, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.ll != nil {
		return r.ll, nil
	}
	if r.repo == nil {
		return nil, errors.New("the node has no repository")
	}
	run := filepath.Join(r.dataDir, "run")
	if err := os.MkdirAll(run, 0o700); err != nil {
		return nil, err
	}
	sock := filepath.Join(run, nbdSocketName)
	_ = os.Remove(sock)
	limit := int64(r.cacheMiB) << 20
	cache, err := lazy.OpenCache(filepath.Join(r.dataDir, "cache", "chunks"), limit, r.repo, r.peerSet())
	if err != nil {
		return nil, err
	}
	srv, err := lazy.Listen(sock, r.log)
	if err != nil {
		return nil, err
	}
	r.ll = &lazyLayers{srv: srv, cache: cache, sock: sock}
	return r.ll, nil
}

// exportLayers registers a template's layers with the NBD server, each
// pointing QEMU at the one below, and returns the top's backing name.
func (r *Remote) exportLayers(ctx context.Context, ids []string) (string, error) {
	ll, err := r.server()
	if err != nil {
		return "", err
	}
	parent := ""
	for _, id := range ids {
		l, err := lazy.FetchLayer(ctx, r.repo, id)
		if err != nil {
			return "", err
		}
		e := &lazy.LayerExport{Layer: l, Cache: ll.cache}
		backing := ""
		if parent != "" {
			backing = lazy.NBDBacking(ll.sock, parent)
		}
		if e.Header, err = lazy.QcowBackingHeader(ctx, e, backing); err != nil {
			return "", fmt.Errorf("layer %s: %w", id, err)
		}
		ll.srv.Add(id, e)
		parent = id
	}
	return lazy.NBDBacking(ll.sock, parent), nil
}

// Pull makes template name from the repository available on this node
// without downloading its layers.
func (r *Remote) Pull(ctx context.Context, name string) (*Template, error) {
	if r.repo == nil || !NameRE.MatchString(name) {
		return nil, fmt.Errorf("%w: template %q", errkind.ErrNotFound, name)
	}
	rec, err := getRecord(ctx, r.repo, repoKindTemplate, name)
	if err != nil {
		if errors.Is(err, errkind.ErrNotFound) {
			return nil, fmt.Errorf("%w: template %q", errkind.ErrNotFound, name)
		}
		return nil, err
	}
	t := rec.Template
	t.Name, t.LazyLayers = name, rec.Layers
	if _, err := r.lazyRoot(ctx, rec.Layers, func(tx *sql.Tx, id string) error {
		t.Layer = id
		return Set(tx, t)
	}); err != nil {
		return nil, fmt.Errorf("template %s: %w", name, err)
	}
	r.log.Info("template loaded lazily from the repository", "template", name, "layers", len(rec.Layers))
	return r.cat.Get(ctx, name)
}

// lazyRoot serves layers (bottom first) through the NBD server and makes
// (if missing) the local thin overlay over them that sandboxes boot from:
// a layer of the store named by the layers it stands for, recorded with
// what record adds (that holds it) in one transaction. It returns the
// overlay's path.
func (r *Remote) lazyRoot(ctx context.Context, layers []string, record func(tx *sql.Tx, id string) error) (string, error) {
	backing, err := r.exportLayers(ctx, layers)
	if err != nil {
		return "", err
	}
	sum := sha256.Sum256([]byte(strings.Join(layers, ",")))
	id := "lazy-" + hex.EncodeToString(sum[:20])
	final := r.cat.st.Abs(filepath.Join(store.LayersDir, id+".qcow2"))
	// Made (if missing) and recorded where garbage collection cannot
	// overlap: the name is fixed, and GC may be removing an earlier copy.
	err = r.cat.st.Reuse(ctx, func(tx *sql.Tx) error {
		if _, err := os.Stat(final); err != nil {
			tmp := filepath.Join(filepath.Dir(final), ".pull-"+id+".qcow2")
			_ = os.Remove(tmp)
			if out, err := exec.CommandContext(ctx, "qemu-img", "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", backing, tmp).CombinedOutput(); err != nil {
				return fmt.Errorf("overlay: %v: %s", err, strings.TrimSpace(string(out)))
			}
			if err := os.Chmod(tmp, 0o444); err != nil {
				return err
			}
			if err := os.Rename(tmp, final); err != nil {
				return err
			}
		}
		if err := r.cat.st.Add(tx, id, store.KindLayer, final); err != nil {
			return err
		}
		return record(tx, id)
	})
	return final, err
}

// Reexport registers again, after a restart, the layers of the templates
// this node loads lazily.
func (r *Remote) Reexport(ctx context.Context) {
	if r.repo == nil {
		return
	}
	ts, err := r.cat.List(ctx)
	if err != nil {
		return
	}
	for _, t := range ts {
		if len(t.LazyLayers) == 0 {
			continue
		}
		if _, err := r.exportLayers(ctx, t.LazyLayers); err != nil {
			r.log.Error("serve the layers of a lazily loaded template", "template", t.Name, "err", err)
		}
	}
	r.reexportImages(ctx)
}

// peerSet returns the neighbours the chunk cache asks first (nil: none).
func (r *Remote) peerSet() *lazy.Peers {
	if len(r.peers) == 0 || r.token == "" {
		return nil
	}
	return &lazy.Peers{URLs: r.peers, Token: r.token}
}

// PeerChunks serves the chunks this node has cached to neighbours that
// present the shared peer token (route lazy.PeerChunkPath). Without a
// token it refuses everything.
func (r *Remote) PeerChunks() http.Handler { return lazy.PeerHandler(r.token, r.Cache) }

// CacheStats reports the chunk cache's counters (zero before the node
// first loads a template lazily).
func (r *Remote) CacheStats() lazy.CacheStats {
	if c := r.Cache(); c != nil {
		return c.Stats()
	}
	return lazy.CacheStats{LimitBytes: int64(r.cacheMiB) << 20}
}

// identityCache maps a layer file's version (path, inode, size, mtime) to
// its content id, so that a chain is hashed once per process.
var identityCache sync.Map

// fileVersion names a file's current version (inode, size, mtime).
func fileVersion(path string) string {
	var st syscall.Stat_t
	if err := syscall.Stat(path, &st); err != nil {
		return ""
	}
	return fmt.Sprintf("%d-%d-%d", st.Ino, st.Size, st.Mtim.Nano())
}

// Identity names the content of a template's layer chain: the same on
// every node that has the same layers (built, pushed or loaded lazily).
func Identity(ctx context.Context, t *Template) (string, error) {
	if len(t.LazyLayers) > 0 {
		return strings.Join(t.LazyLayers, ","), nil
	}
	chain, err := LayerChain(ctx, t.RootDisk)
	if err != nil {
		return "", err
	}
	ids := make([]string, 0, len(chain))
	for _, p := range chain {
		key := p + "|" + fileVersion(p)
		if v, ok := identityCache.Load(key); ok {
			ids = append(ids, v.(string))
			continue
		}
		id, err := ContentID(p)
		if err != nil {
			return "", err
		}
		identityCache.Store(key, id)
		ids = append(ids, id)
	}
	return strings.Join(ids, ","), nil
}
