package lazy

import (
	"context"
	"crypto/subtle"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"
)

// Peer-to-peer chunk exchange (off unless configured): a node asks its
// neighbours for a chunk it lacks before going to the repository. A node
// serves only chunks its cache already holds, never fetching on a
// neighbour's behalf, so requests cannot bounce between nodes. Every chunk
// a neighbour sends is verified against its hash like any other; a wrong,
// slow or absent neighbour only sends the request on to the next one and
// finally to the repository. Requests carry a token shared by the nodes.

// PeerTokenHeader carries the shared token of peer requests.
const PeerTokenHeader = "X-Aenv-Peer-Token"

// PeerChunkPath is the route of a chunk on a node's API (GET, the chunk's
// SHA-256 in hex in place of {sum}).
const PeerChunkPath = "/v1/chunks/{sum}"

// Peers are the neighbour nodes a cache asks for chunks.
type Peers struct {
	// URLs are the neighbours' API base URLs (http://host:port).
	URLs  []string
	Token string
	// Timeout bounds one request to one neighbour (default 2 s).
	Timeout time.Duration
	Client  *http.Client
}

// fetch asks each neighbour in turn; the first verified chunk wins.
func (p *Peers) fetch(ctx context.Context, sum string) ([]byte, error) {
	client := p.Client
	if client == nil {
		client = http.DefaultClient
	}
	timeout := p.Timeout
	if timeout <= 0 {
		timeout = 2 * time.Second
	}
	var errs []string
	for _, base := range p.URLs {
		data, err := p.fetchFrom(ctx, client, timeout, strings.TrimRight(base, "/"), sum)
		if err == nil {
			return data, nil
		}
		errs = append(errs, err.Error())
	}
	return nil, fmt.Errorf("no neighbour has chunk %s: %s", sum[:12], strings.Join(errs, "; "))
}

func (p *Peers) fetchFrom(ctx context.Context, client *http.Client, timeout time.Duration, base, sum string) ([]byte, error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, base+strings.Replace(PeerChunkPath, "{sum}", sum, 1), nil)
	if err != nil {
		return nil, err
	}
	req.Header.Set(PeerTokenHeader, p.Token)
	resp, err := client.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("%s: %s", base, resp.Status)
	}
	data, err := io.ReadAll(io.LimitReader(resp.Body, maxChunkSize+1))
	if err != nil {
		return nil, fmt.Errorf("%s: %w", base, err)
	}
	if len(data) > maxChunkSize {
		return nil, fmt.Errorf("%s: chunk larger than %d bytes", base, maxChunkSize)
	}
	if err := verifyChunk(sum, data); err != nil {
		return nil, fmt.Errorf("%s: %w", base, err)
	}
	return data, nil
}

// peerError answers like the rest of the node API: {code, message}.
func peerError(w http.ResponseWriter, msg string, code int) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	json.NewEncoder(w).Encode(map[string]any{"code": code, "message": msg})
}

// maxChunkSize bounds what a neighbour may send for one chunk.
const maxChunkSize = 64 << 20

// PeerHandler serves the chunks of the cache that cache returns (nil while
// the node has none) to neighbours presenting token. With an empty token
// it refuses every request: peer serving is off.
func PeerHandler(token string, cache func() *Cache) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if token == "" {
			peerError(w, "peer chunk exchange is off on this node", http.StatusNotFound)
			return
		}
		if subtle.ConstantTimeCompare([]byte(r.Header.Get(PeerTokenHeader)), []byte(token)) != 1 {
			peerError(w, "bad peer token", http.StatusUnauthorized)
			return
		}
		sum := r.PathValue("sum")
		if !sumRE.MatchString(sum) {
			peerError(w, "a chunk is named by its SHA-256 in lower-case hex", http.StatusBadRequest)
			return
		}
		c := cache()
		if c == nil {
			peerError(w, "no chunk cache on this node", http.StatusNotFound)
			return
		}
		data, ok := c.cachedChunk(sum)
		if !ok {
			peerError(w, "chunk not cached here", http.StatusNotFound)
			return
		}
		w.Header().Set("Content-Type", "application/octet-stream")
		w.Header().Set("Content-Length", fmt.Sprint(len(data)))
		w.Write(data)
	})
}
