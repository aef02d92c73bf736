// Package httperr owns the error answers of AgentENV's HTTP surfaces (the
// node API, the sandbox proxy, the gateway): the {code,message} body, the
// request id every request gets, and the rule that a 5xx body says only
// what failed and under which request id. The error itself, with its host
// paths, addresses and QEMU output, goes to the server log under that id.
package httperr

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"regexp"

	"github.com/agentenv/agentenv/internal/errkind"
)

// Header carries the request id, in both directions: a caller (a gateway)
// may pass its own on, and every answer names the id it was logged under.
const Header = "X-Request-Id"

// Body is the JSON body of every error answer.
type Body struct {
	Code    int    `json:"code"`
	Message string `json:"message"`
}

var validID = regexp.MustCompile(`^[A-Za-z0-9._-]{8,64}$`)

// WithIDs gives every request an id before h sees it: the caller's
// X-Request-Id when it is well-formed, else a new one. The id is set on
// the response (so it is in every answer) and on the request.
func WithIDs(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		id := r.Header.Get(Header)
		if !validID.MatchString(id) {
			id = newID()
			r.Header.Set(Header, id)
		}
		w.Header().Set(Header, id)
		h.ServeHTTP(w, r)
	})
}

func newID() string {
	b := make([]byte, 8)
	if _, err := rand.Read(b); err != nil {
		panic(err)
	}
	return hex.EncodeToString(b)
}

// ID is the request id of the answer being written to w ("" outside
// WithIDs).
func ID(w http.ResponseWriter) string { return w.Header().Get(Header) }

// Write answers with status and the error body. msg is shown to the
// client as it is: for a failure of the server's own, use Internal.
func Write(w http.ResponseWriter, status int, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	enc := json.NewEncoder(w)
	enc.SetEscapeHTML(false) // messages are read by people and SDKs, not put in HTML
	_ = enc.Encode(Body{Code: status, Message: msg})
}

// StatusOf is the HTTP status of an error of the kinds of package errkind
// (500 for any other; 504 for a context that ended).
func StatusOf(err error) int {
	switch {
	case errkind.IsNoSpace(err):
		return http.StatusInsufficientStorage
	case errors.Is(err, errkind.ErrNotFound):
		return http.StatusNotFound
	case errors.Is(err, errkind.ErrInvalid):
		return http.StatusBadRequest
	case errors.Is(err, errkind.ErrConflict):
		return http.StatusConflict
	case errors.Is(err, errkind.ErrMismatch):
		return http.StatusUnprocessableEntity
	case errors.Is(err, errkind.ErrCapacity):
		return http.StatusTooManyRequests
	case errors.Is(err, errkind.ErrTooLarge):
		return http.StatusRequestEntityTooLarge
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		return http.StatusGatewayTimeout
	}
	return http.StatusInternalServerError
}

// Internal answers a failure of the server's own (a 5xx status): the body
// is msg, short and free of internal detail, with the request id; err goes
// to log under that id.
func Internal(w http.ResponseWriter, log *slog.Logger, status int, msg string, err error) {
	id := ID(w)
	if log == nil {
		log = slog.Default()
	}
	log.Error(msg, "request", id, "status", status, "err", err)
	if id != "" {
		msg = fmt.Sprintf("%s (request id %s; the server's log has the details)", msg, id)
	}
	Write(w, status, msg)
}
