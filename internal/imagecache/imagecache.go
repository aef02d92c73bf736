// Package imagecache owns a node's cache of converted OCI images: which
// images' layers the node keeps for sandboxes made straight from an image
// (POST /sandboxes-cold), when each was last used, and their eviction,
// least recently used first, when the node's layer store grows past a
// limit. Evicting an image only lets go of its cache holder: a layer that
// a template, a sandbox or another cached image still needs stays (the
// store's references), and the store's GC deletes the rest.
package imagecache

import (
	"context"
	"database/sql"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"time"

	"github.com/agentenv/agentenv/internal/store"
	"github.com/agentenv/agentenv/internal/templates"
)

const schema = `
CREATE TABLE IF NOT EXISTS image_cache (
	top_layer TEXT PRIMARY KEY, -- the image's top layer (its holder: cache/image-layers/<top>)
	source    TEXT NOT NULL,
	used_at   INTEGER NOT NULL  -- Unix ms
);`

// Cache is the node's image cache.
type Cache struct {
	db    *sql.DB
	st    *store.Store
	limit int64 // bytes of the layer store (0: no limit)
	log   *slog.Logger
	now   func() time.Time
}

// Open creates the table if needed; limitBytes bounds the layer store
// (0: no bound).
func Open(ctx context.Context, st *store.Store, limitBytes int64, log *slog.Logger) (*Cache, error) {
	if _, err := st.DB().ExecContext(ctx, schema); err != nil {
		return nil, fmt.Errorf("image cache table: %w", err)
	}
	if log == nil {
		log = slog.Default()
	}
	return &Cache{db: st.DB(), st: st, limit: limitBytes, log: log, now: time.Now}, nil
}

// Used records that an image (its top layer) was used now.
func (c *Cache) Used(ctx context.Context, top, source string) error {
	_, err := c.db.ExecContext(ctx, `INSERT INTO image_cache (top_layer, source, used_at) VALUES (?, ?, ?)
		ON CONFLICT (top_layer) DO UPDATE SET source = excluded.source, used_at = excluded.used_at`, top, source, c.now().UnixMilli())
	return err
}

// Size is the bytes the layer store takes on disk.
func (c *Cache) Size() (int64, error) { return dirBytes(c.st.Abs(store.LayersDir)) }

// DirBytes is what the files under dir take on disk (0 for a dir that
// is not there, and for what cannot be read).
func DirBytes(dir string) int64 {
	n, _ := dirBytes(dir)
	return n
}

func dirBytes(dir string) (int64, error) {
	var total int64
	err := filepath.WalkDir(dir, func(_ string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		if info, err := d.Info(); err == nil {
			total += diskBytes(info)
		}
		return nil
	})
	if os.IsNotExist(err) {
		return 0, nil
	}
	return total, err
}

// Evict lets go of the least recently used images, except keep (the one
// being used now), until the layer store is within its limit or no image
// is left to let go of; it returns the images let go of.
func (c *Cache) Evict(ctx context.Context, keep string) ([]string, error) {
	if c.limit <= 0 {
		return nil, nil
	}
	var evicted []string
	for {
		size, err := c.Size()
		if err != nil {
			return evicted, err
		}
		if size <= c.limit {
			return evicted, nil
		}
		var top, source string
		err = c.db.QueryRowContext(ctx, `SELECT top_layer, source FROM image_cache WHERE top_layer != ? ORDER BY used_at, top_layer LIMIT 1`, keep).
			Scan(&top, &source)
		if err == sql.ErrNoRows {
			c.log.Warn("layer store over its limit with no image left to evict", "bytes", size, "limit", c.limit)
			return evicted, nil
		}
		if err != nil {
			return evicted, err
		}
		if err := c.st.Tx(ctx, func(tx *sql.Tx) error {
			if err := templates.ReleaseImage(tx, top); err != nil {
				return err
			}
			_, err := tx.ExecContext(ctx, `DELETE FROM image_cache WHERE top_layer = ?`, top)
			return err
		}); err != nil {
			return evicted, err
		}
		if _, err := c.st.GC(ctx); err != nil {
			return evicted, err
		}
		evicted = append(evicted, source)
		c.log.Info("image evicted from the layer store", "image", source, "bytes before", size, "limit", c.limit)
	}
}
