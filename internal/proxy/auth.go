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
		return validFileSignature(r, token, time.Now())
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

// SignedFileRequest reports whether r is a pre-signed envd /files URL (the
// SDKs' downloadUrl/uploadUrl) whose signature was made with token. Such URLs
// name no sandbox when E2B_SANDBOX_URL is set; the node finds the sandbox by
// the token that signed it.
func SignedFileRequest(r *http.Request, token string) bool {
	return token != "" && r.URL.Path == "/files" && validFileSignature(r, token, time.Now())
}

func validFileSignature(r *http.Request, token string, now time.Time) bool {
	q := r.URL.Query()
	sig := q.Get("signature")
	if sig == "" {
		return false
	}
	var op string
	switch r.Method {
	case http.MethodGet, http.MethodHead:
		op = "read"
	case http.MethodPost:
		op = "write"
	default:
		return false
	}
	exp := q.Get("signature_expiration")
	if exp != "" {
		n, err := strconv.ParseInt(exp, 10, 64)
		if err != nil || now.Unix() > n {
			return false
		}
	}
	return tokenEqual(sig, fileSignature(q.Get("path"), op, q.Get("username"), token, exp))
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
