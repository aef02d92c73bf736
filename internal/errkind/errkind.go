// Package errkind names the kinds of failure the node's packages report
// (wrapped with the details) and the API maps to status codes: a caller
// tests them with errors.Is, whatever package the error came from.
package errkind

import "errors"

// The kinds.
var (
	NotFound = errors.New("not found")               // 404
	Conflict = errors.New("conflict")                // 409: bad timing, or a name in use
	Invalid  = errors.New("invalid request")         // 400
	Capacity = errors.New("no capacity")             // 503
	Setup    = errors.New("node not set up")         // 503: run aenv setup
	Corrupt  = errors.New("stored state is corrupt") // 500, with what was found
)
