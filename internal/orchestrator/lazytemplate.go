package orchestrator

import (
	"context"
	"crypto/sha256"
	"database/sql"
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
	"sync"

	"github.com/agentenv/agentenv/internal/storage"
	"github.com/agentenv/agentenv/internal/storage/lazy"
	"github.com/agentenv/agentenv/internal/storage/repository"
	"github.com/agentenv/agentenv/internal/store"
	"github.com/agentenv/agentenv/internal/templates"
)

// Templates in the repository, loaded lazily: PushTemplate stores a
// template's chain of disk layers as chunked layers plus a template record;
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

// layerChain lists a disk image's backing chain, bottom first (the image
// itself last).
func layerChain(ctx context.Context, top string) ([]string, error) {
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

// contentID names a layer file by its content.
func contentID(path string) (string, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return "", err
	}
	return "l-" + hex.EncodeToString(h.Sum(nil))[:40], nil
}

// PushTemplate stores template name (all its layers) in the node's
// repository.
func (n *Node) PushTemplate(ctx context.Context, name string) error {
	if n.cfg.Repository == nil {
		return errors.New("the node has no repository")
	}
	return PushTemplate(ctx, n.templates, n.cfg.Repository, name)
}

// PushTemplate stores template name of a catalog (all its layers) in
// repo, from where any node can run it without downloading it first.
// Layers already there (same content) are not uploaded again.
func PushTemplate(ctx context.Context, cat *templates.Catalog, repo repository.Repository, name string) error {
	t, err := cat.Get(ctx, name)
	if err != nil {
		return err
	}
	chain, err := layerChain(ctx, t.RootDisk)
	if err != nil {
		return err
	}
	rec := templateRecord{Template: *t}
	rec.Template.RootDisk = ""
	for _, p := range chain {
		id, err := contentID(p)
		if err != nil {
			return err
		}
		if _, err := repo.Stat(ctx, "layer", id); err != nil {
			if _, err := lazy.PushLayer(ctx, repo, id, p, 0); err != nil {
				return fmt.Errorf("push layer %s: %w", filepath.Base(p), err)
			}
		}
		rec.Layers = append(rec.Layers, id)
	}
	stage, err := os.MkdirTemp("", "aenv-tpl-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(stage)
	b, _ := json.MarshalIndent(rec, "", "  ")
	if err := os.WriteFile(filepath.Join(stage, templateRecordFile), b, 0o600); err != nil {
		return err
	}
	if err := repo.Delete(ctx, repoKindTemplate, name); err != nil && !errors.Is(err, repository.ErrNotFound) {
		return err
	}
	_, err = repo.Put(ctx, repoKindTemplate, name, stage)
	return err
}

// lazyLayers serves repository layers to this node's QEMUs.
type lazyLayers struct {
	srv   *lazy.Server
	cache *lazy.Cache
	sock  string
}

// lazyLayersOnce holds the node's NBD server and chunk cache, started on
// first use.
type lazyLayersOnce struct {
	mu sync.Mutex
	ll *lazyLayers // guarded by mu
}

func (o *lazyLayersOnce) get() *lazyLayers {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.ll
}

func (o *lazyLayersOnce) close() {
	if ll := o.get(); ll != nil {
		ll.srv.Close()
	}
}

// lazyServer starts the node's NBD server and chunk cache on first use.
func (n *Node) lazyServer() (*lazyLayers, error) {
	n.lazy.mu.Lock()
	defer n.lazy.mu.Unlock()
	if n.lazy.ll != nil {
		return n.lazy.ll, nil
	}
	if n.cfg.Repository == nil {
		return nil, errors.New("the node has no repository")
	}
	run := filepath.Join(n.cfg.DataDir, "run")
	if err := os.MkdirAll(run, 0o700); err != nil {
		return nil, err
	}
	sock := filepath.Join(run, nbdSocketName)
	_ = os.Remove(sock)
	limit := int64(n.cfg.LayerCacheMiB) << 20
	cache, err := lazy.OpenCache(filepath.Join(n.cfg.DataDir, "cache", "chunks"), limit, n.cfg.Repository, n.peers())
	if err != nil {
		return nil, err
	}
	srv, err := lazy.Listen(sock, n.log)
	if err != nil {
		return nil, err
	}
	n.lazy.ll = &lazyLayers{srv: srv, cache: cache, sock: sock}
	return n.lazy.ll, nil
}

// exportLayers registers a template's layers with the NBD server, each
// pointing QEMU at the one below, and returns the top's backing name.
func (n *Node) exportLayers(ctx context.Context, ids []string) (string, error) {
	ll, err := n.lazyServer()
	if err != nil {
		return "", err
	}
	parent := ""
	for _, id := range ids {
		l, err := lazy.FetchLayer(ctx, n.cfg.Repository, id)
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

// pullTemplateLazily makes template name from the repository available on
// this node without downloading its layers.
func (n *Node) pullTemplateLazily(ctx context.Context, name string) (*Template, error) {
	if n.cfg.Repository == nil || !templateNameRE.MatchString(name) {
		return nil, fmt.Errorf("%w: template %q", ErrNotFound, name)
	}
	stage, err := os.MkdirTemp("", "aenv-tpl-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(stage)
	if _, err := n.cfg.Repository.Get(ctx, repoKindTemplate, name, stage); err != nil {
		if errors.Is(err, repository.ErrNotFound) {
			return nil, fmt.Errorf("%w: template %q", ErrNotFound, name)
		}
		return nil, err
	}
	var rec templateRecord
	if err := readJSON(filepath.Join(stage, templateRecordFile), &rec); err != nil || len(rec.Layers) == 0 {
		return nil, fmt.Errorf("%w: template %s record in the repository", ErrCorrupt, name)
	}
	backing, err := n.exportLayers(ctx, rec.Layers)
	if err != nil {
		return nil, err
	}
	// The template's root: a local thin overlay whose backing chain is the
	// exports, a layer of the store named by the layers it stands for.
	sum := sha256.Sum256([]byte(strings.Join(rec.Layers, ",")))
	id := "lazy-" + hex.EncodeToString(sum[:20])
	final := filepath.Join(n.cfg.DataDir, store.LayersDir, id+".qcow2")
	if _, err := os.Stat(final); err != nil {
		tmp := final + ".tmp"
		_ = os.Remove(tmp)
		if out, err := exec.CommandContext(ctx, "qemu-img", "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", backing, tmp).CombinedOutput(); err != nil {
			return nil, fmt.Errorf("template %s overlay: %v: %s", name, err, strings.TrimSpace(string(out)))
		}
		if err := os.Chmod(tmp, 0o444); err != nil {
			return nil, err
		}
		if err := os.Rename(tmp, final); err != nil {
			return nil, err
		}
	}
	t := rec.Template
	t.Name, t.LazyLayers, t.Layer = name, rec.Layers, id
	if err := n.store.Tx(ctx, func(tx *sql.Tx) error {
		if err := n.store.Add(tx, id, store.KindLayer, final); err != nil {
			return err
		}
		return templates.Set(tx, t)
	}); err != nil {
		return nil, err
	}
	n.log.Info("template loaded lazily from the repository", "template", name, "layers", len(rec.Layers))
	return n.Template(name)
}

// exportLazyTemplates re-registers, after a restart, the layers of the
// templates this node loads lazily.
func (n *Node) exportLazyTemplates(ctx context.Context) {
	ts, err := n.Templates()
	if err != nil {
		return
	}
	for _, t := range ts {
		if len(t.LazyLayers) == 0 {
			continue
		}
		if _, err := n.exportLayers(ctx, t.LazyLayers); err != nil {
			n.log.Error("serve the layers of a lazily loaded template", "template", t.Name, "err", err)
		}
	}
}

// peers returns the neighbours the chunk cache asks first (nil: none).
func (n *Node) peers() *lazy.Peers {
	if len(n.cfg.Peers) == 0 || n.cfg.PeerToken == "" {
		return nil
	}
	return &lazy.Peers{URLs: n.cfg.Peers, Token: n.cfg.PeerToken}
}

// PeerChunks serves the chunks this node has cached to neighbours that
// present the shared peer token (route lazy.PeerChunkPath). Without a
// token it refuses everything.
func (n *Node) PeerChunks() http.Handler {
	return lazy.PeerHandler(n.cfg.PeerToken, func() *lazy.Cache {
		if ll := n.lazy.get(); ll != nil {
			return ll.cache
		}
		return nil
	})
}

// LayerCacheStats reports the lazy layer cache's counters (zero before the
// node first loads a template lazily).
func (n *Node) LayerCacheStats() lazy.CacheStats {
	if ll := n.lazy.get(); ll != nil {
		return ll.cache.Stats()
	}
	return lazy.CacheStats{LimitBytes: int64(n.cfg.LayerCacheMiB) << 20}
}
