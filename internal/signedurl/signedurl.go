// Package signedurl owns the E2B SDKs' pre-signed envd /files URLs (their
// downloadUrl and uploadUrl, which carry no headers): the signature, and
// its check in E2B's envd's order and words. envd checks them in the
// guest; the node's API and proxy check them before routing to it.
package signedurl

import (
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base64"
	"errors"
	"net/http"
	"strconv"
	"time"
)

// The answers to a signed URL that does not pass (401). The signature is
// checked before its expiry, so one both wrong and expired is invalid.
var (
	ErrMissing = errors.New("missing signature query parameter")
	ErrMethod  = errors.New("signature not valid for this method")
	ErrInvalid = errors.New("invalid signature")
	ErrExpired = errors.New("signature is already expired")
)

// Sign is the SDKs' signature of a /files URL for path, op ("read" or
// "write"), user ("" for the default) and the sandbox's envd access
// token, with exp (Unix seconds, "" for none): "v1_" and the unpadded
// base64 of sha256("path:op:user:token[:exp]").
func Sign(path, op, user, token, exp string) string {
	raw := path + ":" + op + ":" + user + ":" + token
	if exp != "" {
		raw += ":" + exp
	}
	sum := sha256.Sum256([]byte(raw))
	return "v1_" + base64.RawStdEncoding.EncodeToString(sum[:])
}

// Check checks the signature of r, a /files request (GET and HEAD read,
// POST writes), against token at now: nil when token signed it and it has
// not expired, else one of the errors above.
func Check(r *http.Request, token string, now time.Time) error {
	q := r.URL.Query()
	sig := q.Get("signature")
	if sig == "" {
		return ErrMissing
	}
	var op string
	switch r.Method {
	case http.MethodGet, http.MethodHead:
		op = "read"
	case http.MethodPost:
		op = "write"
	default:
		return ErrMethod
	}
	exp := q.Get("signature_expiration")
	want := Sign(q.Get("path"), op, q.Get("username"), token, exp)
	if subtle.ConstantTimeCompare([]byte(sig), []byte(want)) != 1 {
		return ErrInvalid
	}
	if exp != "" {
		n, err := strconv.ParseInt(exp, 10, 64)
		if err != nil {
			return ErrInvalid
		}
		if n < now.Unix() {
			return ErrExpired
		}
	}
	return nil
}
