// Package errkind names the kinds of failure the node's packages report
// (wrapped with the details) and the API maps to status codes: a caller
// tests them with errors.Is, whatever package the error came from.
package errkind

import "errors"

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
)
