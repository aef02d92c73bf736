// Package errkind names the kinds of failure the node's packages report
// (wrapped with the details) and the API maps to status codes: a caller
// tests them with errors.Is, whatever package the error came from.
package errkind

import (
	"errors"
	"strings"
	"syscall"
)

// The kinds.
var (
	ErrNotFound = errors.New("not found")       // 404
	ErrConflict = errors.New("conflict")        // 409: bad timing, or a name in use
	ErrInvalid  = errors.New("invalid request") // 400
	// ErrMismatch is a request well formed but at odds with what the node
	// holds for it, e.g. an Idempotency-Key reused with another body.
	ErrMismatch = errors.New("request does not match")  // 422
	ErrCapacity = errors.New("no capacity")             // 503
	ErrSetup    = errors.New("node not set up")         // 503: run aenv setup
	ErrCorrupt  = errors.New("stored state is corrupt") // 500, with what was found
	ErrTooLarge = errors.New("too large")               // 413: e.g. a volume that is full
	// ErrNoSpace is the node's own disk full, or below its floor of free
	// space (package diskspace).
	ErrNoSpace = errors.New("insufficient storage") // 507
)

// IsNoSpace reports whether err is the node's disk being full: an
// ErrNoSpace, or an ENOSPC or EDQUOT from the kernel, wrapped or as the
// words a tool (qemu-img, QEMU over QMP, debugfs) printed them in.
func IsNoSpace(err error) bool {
	if err == nil {
		return false
	}
	if errors.Is(err, ErrNoSpace) || errors.Is(err, syscall.ENOSPC) || errors.Is(err, syscall.EDQUOT) {
		return true
	}
	msg := strings.ToLower(err.Error())
	return strings.Contains(msg, "no space left on device") || strings.Contains(msg, "disk quota exceeded") ||
		strings.Contains(msg, "database or disk is full") // SQLite's SQLITE_FULL
}
