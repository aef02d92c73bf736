package proxy

import (
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base64"
	"errors"
	"net/http"
	"strconv"
	"strings"
	"time"

	"connectrpc.com/connect"
)

func tokenEqual(a, b string) bool {
	return subtle.ConstantTimeCompare([]byte(a), []byte(b)) == 1
}

// envdAuthorized applies envd's access rules for a secure sandbox at the
// proxy: X-Access-Token must match, except for GET/HEAD /health (the SDK's
// isRunning) and /files requests with a valid signature (the SDK's
// downloadUrl/uploadUrl, which carry no headers). envd checks the same
// rules again behind the proxy.
func envdAuthorized(r *http.Request, token string) bool {
	if tokenEqual(r.Header.Get(HeaderAccessToken), token) {
		return true
	}
	switch r.URL.Path {
	case "/health":
		return r.Method == http.MethodGet || r.Method == http.MethodHead
	case "/files":
		return FileSignatureError(r, token, time.Now()) == nil
	}
	return false
}

// fileSignature is the E2B SDKs' signature of pre-signed /files URLs:
// "v1_" + unpadded base64(sha256("path:operation:user:token[:expiration]")).
func fileSignature(path, op, user, token, exp string) string {
	raw := path + ":" + op + ":" + user + ":" + token
	if exp != "" {
		raw += ":" + exp
	}
	sum := sha256.Sum256([]byte(raw))
	return "v1_" + base64.RawStdEncoding.EncodeToString(sum[:])
}

// The answers to a pre-signed /files URL that does not pass, in E2B's
// envd's words (401): the signature is checked before its expiry, so one
// both wrong and expired is invalid.
var (
	ErrSignatureMissing = errors.New("missing signature query parameter")
	ErrSignatureInvalid = errors.New("invalid signature")
	ErrSignatureExpired = errors.New("signature is already expired")
)

// FileSignatureError checks a pre-signed envd /files URL (the SDKs'
// downloadUrl/uploadUrl) against token at now: nil when it was signed with
// token and has not expired, else one of the ErrSignature errors. Such
// URLs name no sandbox when E2B_SANDBOX_URL is set; the node finds the
// sandbox by the token that signed it.
func FileSignatureError(r *http.Request, token string, now time.Time) error {
	q := r.URL.Query()
	sig := q.Get("signature")
	if sig == "" {
		return ErrSignatureMissing
	}
	var op string
	switch r.Method {
	case http.MethodGet, http.MethodHead:
		op = "read"
	case http.MethodPost:
		op = "write"
	default:
		return ErrSignatureInvalid
	}
	exp := q.Get("signature_expiration")
	if token == "" || r.URL.Path != "/files" || !tokenEqual(sig, fileSignature(q.Get("path"), op, q.Get("username"), token, exp)) {
		return ErrSignatureInvalid
	}
	if exp != "" {
		n, err := strconv.ParseInt(exp, 10, 64)
		if err != nil {
			return ErrSignatureInvalid
		}
		if n < now.Unix() {
			return ErrSignatureExpired
		}
	}
	return nil
}

var connectErrors = connect.NewErrorWriter()

// writeUnauthenticated answers 401: as a Connect error for Connect calls
// (so SDKs raise their authentication error), JSON otherwise.
func writeUnauthenticated(w http.ResponseWriter, r *http.Request) {
	const msg = "missing or invalid X-Access-Token for this sandbox's envd"
	if strings.HasPrefix(r.URL.Path, "/process.") || strings.HasPrefix(r.URL.Path, "/filesystem.") {
		if connectErrors.IsSupported(r) {
			_ = connectErrors.Write(w, r, connect.NewError(connect.CodeUnauthenticated, errors.New(msg)))
			return
		}
	}
	writeError(w, http.StatusUnauthorized, msg)
}
