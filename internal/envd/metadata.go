package envd

import (
	"bytes"
	"errors"
	"fmt"
	"net/http"
	"sort"
	"strings"

	"golang.org/x/sys/unix"
)

// User-defined file metadata (SDK option `metadata`, envd >= 0.6.2) travels
// as X-Metadata-<key> request headers on uploads and is kept in extended
// attributes under metadataXattrPrefix.
const (
	metadataHeaderPrefix = "X-Metadata-"
	metadataXattrPrefix  = "user.e2b."
	maxMetadataKeyLen    = 246
	maxMetadataTotal     = 4096
)

func printableASCII(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] < 0x20 || s[i] > 0x7e {
			return false
		}
	}
	return true
}

// metadataFromHeaders collects X-Metadata-* headers. Keys are lowercased;
// only the first value of a repeated header counts. ok is false (with a
// message) when a key or value is invalid or the total is too large.
func metadataFromHeaders(h http.Header) (map[string]string, error) {
	md := map[string]string{}
	total := 0
	names := make([]string, 0, len(h))
	for name := range h {
		names = append(names, name)
	}
	sort.Strings(names)
	for _, name := range names {
		if len(name) <= len(metadataHeaderPrefix) || !strings.EqualFold(name[:len(metadataHeaderPrefix)], metadataHeaderPrefix) {
			continue
		}
		key := strings.ToLower(name[len(metadataHeaderPrefix):])
		vals := h[name]
		if len(vals) == 0 {
			continue
		}
		if _, dup := md[key]; dup {
			continue
		}
		val := vals[0]
		if !printableASCII(key) || !printableASCII(val) {
			return nil, fmt.Errorf("metadata %q: keys and values must be printable US-ASCII", key)
		}
		if len(key) > maxMetadataKeyLen {
			return nil, fmt.Errorf("metadata key %q is longer than %d bytes", key, maxMetadataKeyLen)
		}
		total += len(metadataXattrPrefix) + len(key) + len(val)
		if total > maxMetadataTotal {
			return nil, fmt.Errorf("metadata exceeds %d bytes in total", maxMetadataTotal)
		}
		md[key] = val
	}
	return md, nil
}

// readMetadata returns the user-defined metadata of path (nil when none or
// when the filesystem has no extended attributes).
func readMetadata(path string) map[string]string {
	names, err := listXattrs(path)
	if err != nil {
		return nil
	}
	var md map[string]string
	for _, n := range names {
		key, ok := strings.CutPrefix(n, metadataXattrPrefix)
		if !ok || key == "" {
			continue
		}
		val, err := getXattr(path, n)
		if err != nil {
			continue
		}
		if md == nil {
			md = map[string]string{}
		}
		md[key] = val
	}
	return md
}

// replaceMetadata makes md the complete metadata of path.
func replaceMetadata(path string, md map[string]string) error {
	names, err := listXattrs(path)
	if err != nil {
		if len(md) == 0 {
			return nil // nothing to set, nothing readable to clear
		}
		return fmt.Errorf("file metadata not supported here: %w", err)
	}
	for _, n := range names {
		key, ok := strings.CutPrefix(n, metadataXattrPrefix)
		if !ok {
			continue
		}
		if _, keep := md[key]; !keep {
			if err := unix.Lremovexattr(path, n); err != nil && !errors.Is(err, unix.ENODATA) {
				return fmt.Errorf("remove metadata %q: %w", key, err)
			}
		}
	}
	for k, v := range md {
		if err := unix.Lsetxattr(path, metadataXattrPrefix+k, []byte(v), 0); err != nil {
			return fmt.Errorf("set metadata %q: %w", k, err)
		}
	}
	return nil
}

func listXattrs(path string) ([]string, error) {
	size, err := unix.Llistxattr(path, nil)
	if err != nil {
		return nil, err
	}
	if size == 0 {
		return nil, nil
	}
	buf := make([]byte, size*2)
	n, err := unix.Llistxattr(path, buf)
	if err != nil {
		return nil, err
	}
	var out []string
	for _, b := range bytes.Split(buf[:n], []byte{0}) {
		if len(b) > 0 {
			out = append(out, string(b))
		}
	}
	return out, nil
}

func getXattr(path, name string) (string, error) {
	size, err := unix.Lgetxattr(path, name, nil)
	if err != nil {
		return "", err
	}
	buf := make([]byte, size+1)
	n, err := unix.Lgetxattr(path, name, buf)
	if err != nil {
		return "", err
	}
	return string(buf[:n]), nil
}
