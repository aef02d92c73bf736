package lazy

import (
	"bytes"
	"container/list"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/agentenv/agentenv/internal/storage/repository"
)

// A layer file is stored in the repository as content-addressed chunks
// (kind "chunk", id = the chunk's SHA-256, one file "data"; chunks of zeros
// are not stored) and a chunk list (kind "layer", file "layer.json"). A
// chunk shared by several layers is stored once.

const (
	repoKindChunk = "chunk"
	repoKindLayer = "layer"
	chunkFileName = "data"
	layerFileName = "layer.json"

	// DefaultChunkSize is the chunk size of pushed layers.
	DefaultChunkSize = 1 << 20
)

// ErrCorruptChunk marks a fetched chunk whose content does not match its
// hash; it is never cached.
var ErrCorruptChunk = errors.New("chunk does not match its hash")

var sumRE = regexp.MustCompile(`^[0-9a-f]{64}$`)

// Layer is a layer file as a list of chunks.
type Layer struct {
	Size      int64    `json:"size"`
	ChunkSize int64    `json:"chunkSize"`
	Chunks    []string `json:"chunks"` // SHA-256 hex; "" for a chunk of zeros
}

// PushLayer stores the file at path in the repository as layer id.
// Chunks already there are not uploaded again.
func PushLayer(ctx context.Context, repo repository.Repository, id, path string, chunkSize int64) (*Layer, error) {
	if chunkSize <= 0 {
		chunkSize = DefaultChunkSize
	}
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, err
	}
	l := &Layer{Size: st.Size(), ChunkSize: chunkSize}
	stage, err := os.MkdirTemp("", "aenv-chunk-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(stage)
	buf := make([]byte, chunkSize)
	zero := make([]byte, chunkSize)
	for off := int64(0); off < l.Size; off += chunkSize {
		n, err := f.ReadAt(buf, off)
		if err != nil && !errors.Is(err, io.EOF) {
			return nil, err
		}
		chunk := buf[:n]
		if bytes.Equal(chunk, zero[:n]) {
			l.Chunks = append(l.Chunks, "")
			continue
		}
		sum := sha256.Sum256(chunk)
		id := hex.EncodeToString(sum[:])
		l.Chunks = append(l.Chunks, id)
		if _, err := repo.Stat(ctx, repoKindChunk, id); err == nil {
			continue
		}
		dir := filepath.Join(stage, id)
		if err := os.Mkdir(dir, 0o700); err != nil {
			return nil, err
		}
		if err := os.WriteFile(filepath.Join(dir, chunkFileName), chunk, 0o600); err != nil {
			return nil, err
		}
		if _, err := repo.Put(ctx, repoKindChunk, id, dir); err != nil && !errors.Is(err, repository.ErrExists) {
			return nil, fmt.Errorf("push chunk %s: %w", id[:12], err)
		}
		os.RemoveAll(dir)
	}
	dir := filepath.Join(stage, "layer")
	if err := os.Mkdir(dir, 0o700); err != nil {
		return nil, err
	}
	b, _ := json.Marshal(l)
	if err := os.WriteFile(filepath.Join(dir, layerFileName), b, 0o600); err != nil {
		return nil, err
	}
	if _, err := repo.Put(ctx, repoKindLayer, id, dir); err != nil && !errors.Is(err, repository.ErrExists) {
		return nil, fmt.Errorf("push layer %s: %w", id, err)
	}
	return l, nil
}

// FetchLayer reads layer id's chunk list from the repository.
func FetchLayer(ctx context.Context, repo repository.Repository, id string) (*Layer, error) {
	dir, err := os.MkdirTemp("", "aenv-layer-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	if _, err := repo.Get(ctx, repoKindLayer, id, dir); err != nil {
		return nil, fmt.Errorf("layer %s: %w", id, err)
	}
	var l Layer
	b, err := os.ReadFile(filepath.Join(dir, layerFileName))
	if err != nil {
		return nil, err
	}
	if err := json.Unmarshal(b, &l); err != nil || l.ChunkSize <= 0 || int64(len(l.Chunks)) != (l.Size+l.ChunkSize-1)/l.ChunkSize {
		return nil, fmt.Errorf("%w: layer %s chunk list", repository.ErrCorrupt, id)
	}
	for _, c := range l.Chunks {
		if c != "" && !sumRE.MatchString(c) {
			return nil, fmt.Errorf("%w: layer %s: bad chunk id %q", repository.ErrCorrupt, id, c)
		}
	}
	return &l, nil
}

// CacheStats counts a cache's work.
type CacheStats struct {
	Hits, Misses, Evictions int64
	// FetchedBytes counts bytes downloaded (from the repository or a
	// neighbour), PeerBytes the part of it that came from neighbours, and
	// PeerServedBytes what neighbours read from this cache.
	FetchedBytes, PeerBytes, PeerServedBytes int64
	UsedBytes, LimitBytes                    int64
	// StoreErrors counts chunks that could not be written to the cache
	// (a full disk): they were served without being kept.
	StoreErrors int64
}

// Cache keeps chunks on local disk, at most limit bytes, evicting the least
// recently used; missing chunks come from the repository and are verified.
type Cache struct {
	dir   string
	limit int64
	repo  repository.Repository
	peers *Peers

	mu       sync.Mutex
	lru      *list.List // of *cached, most recent first
	items    map[string]*list.Element
	inflight map[string]*fetch
	stats    CacheStats
}

type cached struct {
	sum  string
	size int64
}

type fetch struct {
	done chan struct{}
	data []byte
	err  error
}

// OpenCache opens (or creates) a chunk cache in dir; chunks already there
// are kept, oldest first to go. Missing chunks are asked of peers (nil: no
// peers), then fetched from repo.
func OpenCache(dir string, limit int64, repo repository.Repository, peers *Peers) (*Cache, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	c := &Cache{dir: dir, limit: limit, repo: repo, peers: peers, lru: list.New(), items: map[string]*list.Element{}, inflight: map[string]*fetch{}}
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	type old struct {
		sum  string
		size int64
		mod  int64
	}
	var have []old
	for _, e := range ents {
		info, err := e.Info()
		if err != nil || !sumRE.MatchString(e.Name()) || !info.Mode().IsRegular() {
			os.Remove(filepath.Join(dir, e.Name())) // temporary files of an interrupted fetch
			continue
		}
		have = append(have, old{e.Name(), info.Size(), info.ModTime().UnixNano()})
	}
	sort.Slice(have, func(i, j int) bool { return have[i].mod > have[j].mod })
	for _, h := range have {
		c.items[h.sum] = c.lru.PushBack(&cached{h.sum, h.size})
		c.stats.UsedBytes += h.size
	}
	c.mu.Lock()
	c.evict("")
	c.mu.Unlock()
	return c, nil
}

// Stats reports the cache's counters.
func (c *Cache) Stats() CacheStats {
	c.mu.Lock()
	defer c.mu.Unlock()
	s := c.stats
	s.LimitBytes = c.limit
	return s
}

// evict drops least recently used chunks (never keep) until the cache fits
// its limit. Called with mu held.
func (c *Cache) evict(keep string) {
	for c.stats.UsedBytes > c.limit {
		el := c.lru.Back()
		if el == nil {
			return
		}
		if el.Value.(*cached).sum == keep {
			if el.Prev() == nil {
				return
			}
			el = el.Prev()
		}
		c.drop(el)
	}
}

// drop evicts one cached chunk. Called with mu held.
func (c *Cache) drop(el *list.Element) {
	it := el.Value.(*cached)
	c.lru.Remove(el)
	delete(c.items, it.sum)
	c.stats.UsedBytes -= it.size
	c.stats.Evictions++
	os.Remove(filepath.Join(c.dir, it.sum))
}

// Chunk returns a chunk's content.
func (c *Cache) Chunk(ctx context.Context, sum string) ([]byte, error) {
	c.mu.Lock()
	if el, ok := c.items[sum]; ok {
		c.lru.MoveToFront(el)
		c.stats.Hits++
		c.mu.Unlock()
		b, err := os.ReadFile(filepath.Join(c.dir, sum))
		if err == nil {
			return b, nil
		}
		// Lost meanwhile (evicted by another reader): fetch it again.
		c.mu.Lock()
		c.stats.Hits--
	}
	if f, ok := c.inflight[sum]; ok {
		c.mu.Unlock()
		<-f.done
		return f.data, f.err
	}
	c.stats.Misses++
	f := &fetch{done: make(chan struct{})}
	c.inflight[sum] = f
	c.mu.Unlock()

	var fromPeer, stored bool
	f.data, fromPeer, f.err = c.download(ctx, sum)
	if f.err == nil {
		stored = c.store(sum, f.data)
	}
	c.mu.Lock()
	delete(c.inflight, sum)
	if f.err == nil {
		if _, ok := c.items[sum]; !ok && stored {
			c.items[sum] = c.lru.PushFront(&cached{sum, int64(len(f.data))})
			c.stats.UsedBytes += int64(len(f.data))
		}
		c.stats.FetchedBytes += int64(len(f.data))
		if fromPeer {
			c.stats.PeerBytes += int64(len(f.data))
		}
		c.evict(sum)
	}
	c.mu.Unlock()
	close(f.done)
	return f.data, f.err
}

// download gets a chunk from a neighbour that has it or else from the
// repository, and verifies it.
func (c *Cache) download(ctx context.Context, sum string) (data []byte, fromPeer bool, err error) {
	if c.peers != nil {
		if data, err := c.peers.fetch(ctx, sum); err == nil {
			return data, true, nil
		}
	}
	tmp, err := os.MkdirTemp("", "aenv-chunk-")
	if err != nil {
		return nil, false, err
	}
	defer os.RemoveAll(tmp)
	if _, err := c.repo.Get(ctx, repoKindChunk, sum, tmp); err != nil {
		return nil, false, fmt.Errorf("fetch chunk %s: %w", sum[:12], err)
	}
	data, err = os.ReadFile(filepath.Join(tmp, chunkFileName))
	if err != nil {
		return nil, false, err
	}
	if err := verifyChunk(sum, data); err != nil {
		return nil, false, err
	}
	return data, false, nil
}

func verifyChunk(sum string, data []byte) error {
	got := sha256.Sum256(data)
	if hex.EncodeToString(got[:]) != sum {
		return fmt.Errorf("%w: chunk %s", ErrCorruptChunk, sum[:12])
	}
	return nil
}

// store writes a verified chunk into the cache dir. When the disk under it
// is full the coldest chunks are dropped to make room; if that is not
// enough the chunk is served without being kept (reads go on working, the
// next read fetches it again). It reports whether the chunk was kept.
func (c *Cache) store(sum string, data []byte) bool {
	for attempt := 0; ; attempt++ {
		err := writeFileAtomic(filepath.Join(c.dir, sum), data)
		if err == nil {
			return true
		}
		c.mu.Lock()
		c.stats.StoreErrors++
		c.mu.Unlock()
		if !errors.Is(err, syscall.ENOSPC) && !errors.Is(err, syscall.EDQUOT) || attempt > 0 {
			return false
		}
		c.makeRoom(int64(len(data)))
	}
}

// makeRoom evicts least recently used chunks until the file system under
// the cache has room for need more bytes (twice over), or nothing is left.
func (c *Cache) makeRoom(need int64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for {
		var st unix.Statfs_t
		if err := unix.Statfs(c.dir, &st); err == nil && int64(st.Bavail)*int64(st.Bsize) >= 2*need {
			return
		}
		el := c.lru.Back()
		if el == nil {
			return
		}
		c.drop(el)
	}
}

func writeFileAtomic(path string, data []byte) error {
	f, err := os.CreateTemp(filepath.Dir(path), ".fetch-")
	if err != nil {
		return err
	}
	_, err = f.Write(data)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(f.Name(), path)
	}
	if err != nil {
		os.Remove(f.Name())
	}
	return err
}

// cachedChunk returns a chunk only if the cache holds it (what a neighbour
// is served: never fetched on its behalf).
func (c *Cache) cachedChunk(sum string) ([]byte, bool) {
	c.mu.Lock()
	_, ok := c.items[sum]
	c.mu.Unlock()
	if !ok {
		return nil, false
	}
	b, err := os.ReadFile(filepath.Join(c.dir, sum))
	if err != nil {
		return nil, false
	}
	c.mu.Lock()
	c.stats.PeerServedBytes += int64(len(b))
	c.mu.Unlock()
	return b, true
}

// LayerExport serves a layer's bytes from the cache (an NBD Export).
type LayerExport struct {
	Layer *Layer
	Cache *Cache
	// Header, if set, replaces the layer's first bytes (see
	// QcowBackingHeader).
	Header []byte
}

// Size is the layer's size.
func (e *LayerExport) Size() int64 { return e.Layer.Size }

// ReadAt assembles p from the chunks it spans.
func (e *LayerExport) ReadAt(ctx context.Context, p []byte, off int64) error {
	if err := e.readChunks(ctx, p, off); err != nil {
		return err
	}
	e.patch(p, off)
	return nil
}

func (e *LayerExport) readChunks(ctx context.Context, p []byte, off int64) error {
	cs := e.Layer.ChunkSize
	for len(p) > 0 {
		idx := off / cs
		if idx >= int64(len(e.Layer.Chunks)) {
			return io.ErrUnexpectedEOF
		}
		within := off - idx*cs
		n := min(int64(len(p)), cs-within)
		sum := e.Layer.Chunks[idx]
		if sum == "" {
			clear(p[:n])
		} else {
			data, err := e.Cache.Chunk(ctx, sum)
			if err != nil {
				return err
			}
			if within+n > int64(len(data)) {
				return fmt.Errorf("%w: chunk %s is %d bytes, read needs %d", ErrCorruptChunk, sum[:12], len(data), within+n)
			}
			copy(p[:n], data[within:within+n])
		}
		p, off = p[n:], off+n
	}
	return nil
}

// Patch overlays bytes on an export's content (from offset 0): a layer's
// qcow2 header is served with its backing file name replaced.
func (e *LayerExport) patch(p []byte, off int64) {
	if off < int64(len(e.Header)) {
		copy(p, e.Header[off:])
	}
}

// Purge empties the cache (for measurements of cold reads).
func (c *Cache) Purge() {
	c.mu.Lock()
	defer c.mu.Unlock()
	for sum, el := range c.items {
		c.lru.Remove(el)
		delete(c.items, sum)
		os.Remove(filepath.Join(c.dir, sum))
	}
	c.stats.UsedBytes = 0
}
