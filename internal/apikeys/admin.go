package apikeys

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"time"

	"github.com/agentenv/agentenv/internal/errkind"
	"github.com/agentenv/agentenv/internal/httperr"
)

// SocketName is the node's admin socket in its data dir: a unix socket only
// root can open (the data dir is 0700), through which `aenv key` manages
// the keys of a running node.
const SocketName = "admin.sock"

// Handler serves key management on the admin socket: GET /keys, POST /keys
// {"name"} (201 {"name","key"}), DELETE /keys/{name} (204).
func (k *Keys) Handler(log *slog.Logger) http.Handler {
	if log == nil {
		log = slog.Default()
	}
	mux := http.NewServeMux()
	fail := func(w http.ResponseWriter, err error) {
		if status := httperr.StatusOf(err); status < 500 {
			httperr.Write(w, status, err.Error())
		} else {
			httperr.Internal(w, log, status, "internal error", err)
		}
	}
	mux.HandleFunc("GET /keys", func(w http.ResponseWriter, r *http.Request) {
		l, err := k.List(r.Context())
		if err != nil {
			fail(w, err)
			return
		}
		writeJSON(w, http.StatusOK, l)
	})
	mux.HandleFunc("POST /keys", func(w http.ResponseWriter, r *http.Request) {
		var body struct{ Name string }
		if err := json.NewDecoder(io.LimitReader(r.Body, 4096)).Decode(&body); err != nil {
			fail(w, fmt.Errorf("%w: body must be {\"name\": ...}", errkind.ErrInvalid))
			return
		}
		key, err := k.Create(r.Context(), body.Name)
		if err != nil {
			fail(w, err)
			return
		}
		log.Info("api key created", "name", body.Name)
		writeJSON(w, http.StatusCreated, map[string]string{"name": body.Name, "key": key})
	})
	mux.HandleFunc("DELETE /keys/{name}", func(w http.ResponseWriter, r *http.Request) {
		if err := k.Revoke(r.Context(), r.PathValue("name")); err != nil {
			fail(w, err)
			return
		}
		log.Info("api key revoked", "name", r.PathValue("name"))
		w.WriteHeader(http.StatusNoContent)
	})
	return httperr.WithIDs(mux)
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

// ListenAdmin opens the admin socket in dataDir (replacing a stale one),
// readable and writable by its owner only.
func ListenAdmin(dataDir string) (net.Listener, error) {
	path := filepath.Join(dataDir, SocketName)
	os.Remove(path) // a crashed server's; the data dir lock says none runs
	ln, err := net.Listen("unix", path)
	if err != nil {
		return nil, fmt.Errorf("admin socket: %w", err)
	}
	if err := os.Chmod(path, 0o600); err != nil {
		ln.Close()
		return nil, fmt.Errorf("admin socket: %w", err)
	}
	return ln, nil
}

// Admin manages the keys of a running node through its admin socket.
type Admin struct {
	c *http.Client
}

// DialAdmin returns the admin client of the node running on dataDir, or
// false when no node answers there.
func DialAdmin(dataDir string) (*Admin, bool) {
	path := filepath.Join(dataDir, SocketName)
	conn, err := net.DialTimeout("unix", path, time.Second)
	if err != nil {
		return nil, false
	}
	conn.Close()
	dial := func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", path)
	}
	return &Admin{c: &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{DialContext: dial}}}, true
}

func (a *Admin) call(ctx context.Context, method, path string, in, out any) error {
	var body io.Reader
	if in != nil {
		b, _ := json.Marshal(in)
		body = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, "http://admin"+path, body)
	if err != nil {
		return err
	}
	resp, err := a.c.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if resp.StatusCode/100 != 2 {
		var e httperr.Body
		json.Unmarshal(b, &e)
		kind := errors.New("the node refused")
		switch resp.StatusCode {
		case http.StatusBadRequest:
			kind = errkind.ErrInvalid
		case http.StatusConflict:
			kind = errkind.ErrConflict
		case http.StatusNotFound:
			kind = errkind.ErrNotFound
		}
		return fmt.Errorf("%w (%s)", kind, e.Message)
	}
	if out != nil {
		return json.Unmarshal(b, out)
	}
	return nil
}

// Create makes a key on the running node.
func (a *Admin) Create(ctx context.Context, name string) (string, error) {
	var out struct{ Key string }
	err := a.call(ctx, "POST", "/keys", map[string]string{"name": name}, &out)
	return out.Key, err
}

// List lists the running node's keys.
func (a *Admin) List(ctx context.Context) ([]Key, error) {
	var out []Key
	err := a.call(ctx, "GET", "/keys", nil, &out)
	return out, err
}

// Revoke revokes a key of the running node.
func (a *Admin) Revoke(ctx context.Context, name string) error {
	return a.call(ctx, "DELETE", "/keys/"+url.PathEscape(name), nil, nil)
}
