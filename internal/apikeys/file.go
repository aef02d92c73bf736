package apikeys

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/agentenv/agentenv/internal/errkind"
	"github.com/agentenv/agentenv/internal/storage"
)

// File is a set of named keys kept in a file, for a gateway (which has no
// database): one line per key, "name sha256-hex created-unix-ms", the file
// 0600 and rewritten atomically by Create and Revoke (under an exclusive
// lock, so two edits never lose one another). Check sees edits made by
// other processes within a second: revocation is live on a running gateway.
// A cluster's operators manage it with `aenv key ... --file PATH` and give
// it to the gateway (`aenv gateway --keys-file PATH`, or a mounted secret).
type File struct {
	path string

	mu      sync.Mutex
	checked time.Time // when the file was last looked at; guarded by mu
	stamp   string    // its size and mtime then
	keys    []fileKey // what it held
	loadErr error
}

type fileKey struct {
	name    string
	sum     [32]byte
	created time.Time
}

// OpenFile returns the keys kept in path (the file need not exist yet).
func OpenFile(path string) *File { return &File{path: path} }

// Path is the file's path.
func (f *File) Path() string { return f.path }

// reloadEvery bounds how stale Check's view of the file may be.
const reloadEvery = time.Second

// current returns the keys, reading the file again if it changed.
func (f *File) current() ([]fileKey, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if !f.checked.IsZero() && time.Since(f.checked) < reloadEvery {
		return f.keys, f.loadErr
	}
	f.checked = time.Now()
	fi, err := os.Stat(f.path)
	stamp := ""
	if err == nil {
		var ino uint64
		if st, ok := fi.Sys().(*syscall.Stat_t); ok {
			ino = st.Ino // a rewrite is a new file
		}
		stamp = fmt.Sprint(ino, fi.Size(), fi.ModTime().UnixNano())
	}
	if stamp == f.stamp && f.stamp != "" {
		return f.keys, f.loadErr
	}
	f.stamp = stamp
	f.keys, f.loadErr = readKeyFile(f.path)
	return f.keys, f.loadErr
}

func readKeyFile(path string) ([]fileKey, error) {
	b, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read keys file: %w", err)
	}
	var out []fileKey
	for i, line := range strings.Split(string(b), "\n") {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		f := strings.Fields(line)
		var k fileKey
		sum, err := hex.DecodeString(f[min(1, len(f)-1)])
		if len(f) != 3 || ValidName(f[0]) != nil || err != nil || len(sum) != 32 {
			return nil, fmt.Errorf("keys file %s line %d: want \"name sha256-hex created-ms\"", path, i+1)
		}
		ms, err := strconv.ParseInt(f[2], 10, 64)
		if err != nil {
			return nil, fmt.Errorf("keys file %s line %d: bad creation time", path, i+1)
		}
		k.name, k.created = f[0], time.UnixMilli(ms).UTC()
		copy(k.sum[:], sum)
		out = append(out, k)
	}
	return out, nil
}

// Check returns the name of the key key is, comparing its hash with every
// kept one in constant time; ok is false for an unknown key.
func (f *File) Check(ctx context.Context, key string) (name string, ok bool, err error) {
	keys, err := f.current()
	if err != nil {
		return "", false, err
	}
	sum := sha256.Sum256([]byte(key))
	for _, k := range keys {
		if subtle.ConstantTimeCompare(sum[:], k.sum[:]) == 1 && !ok {
			name, ok = k.name, true
		}
	}
	return name, ok, nil
}

// List returns the kept keys by name.
func (f *File) List(ctx context.Context) ([]Key, error) {
	keys, err := readKeyFile(f.path)
	if err != nil {
		return nil, err
	}
	out := make([]Key, 0, len(keys))
	for _, k := range keys {
		out = append(out, Key{Name: k.name, Created: k.created, Hint: hex.EncodeToString(k.sum[:])[:8]})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out, nil
}

// Create makes a new key named name, keeps its hash and returns it. A name
// in use is ErrConflict.
func (f *File) Create(ctx context.Context, name string) (string, error) {
	key, err := newKey(name)
	if err != nil {
		return "", err
	}
	err = f.edit(func(keys []fileKey) ([]fileKey, error) {
		for _, k := range keys {
			if k.name == name {
				return nil, fmt.Errorf("%w: a key named %q exists", errkind.ErrConflict, name)
			}
		}
		return append(keys, fileKey{name: name, sum: sha256.Sum256([]byte(key)), created: time.Now().UTC()}), nil
	})
	if err != nil {
		return "", err
	}
	return key, nil
}

// Revoke removes key name: a gateway refuses it within a second.
func (f *File) Revoke(ctx context.Context, name string) error {
	return f.edit(func(keys []fileKey) ([]fileKey, error) {
		for i, k := range keys {
			if k.name == name {
				return append(keys[:i], keys[i+1:]...), nil
			}
		}
		return nil, fmt.Errorf("%w: no key named %q", errkind.ErrNotFound, name)
	})
}

// edit rewrites the file with what change makes of its keys, holding an
// exclusive lock (a ".lock" file beside it) meanwhile.
func (f *File) edit(change func([]fileKey) ([]fileKey, error)) error {
	if err := os.MkdirAll(filepath.Dir(f.path), 0o700); err != nil {
		return err
	}
	lock, err := os.OpenFile(f.path+".lock", os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return err
	}
	defer lock.Close()
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX); err != nil {
		return err
	}
	keys, err := readKeyFile(f.path)
	if err != nil {
		return err
	}
	if keys, err = change(keys); err != nil {
		return err
	}
	var b strings.Builder
	b.WriteString("# aenv API keys: name, SHA-256 of the key, creation (unix ms). Edit with `aenv key --file`.\n")
	for _, k := range keys {
		fmt.Fprintf(&b, "%s %s %d\n", k.name, hex.EncodeToString(k.sum[:]), k.created.UnixMilli())
	}
	if err := storage.WriteFileAtomic(f.path, []byte(b.String()), 0o600); err != nil {
		return err
	}
	f.mu.Lock()
	f.checked = time.Time{} // this process sees its own edit at once
	f.mu.Unlock()
	return nil
}
