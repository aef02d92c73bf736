package proxy

import (
	"crypto/subtle"
	"errors"
	"net/http"
	"strings"
	"time"

	"connectrpc.com/connect"

	"github.com/agentenv/agentenv/internal/signedurl"
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

// FileSignatureError checks a pre-signed envd /files URL (the SDKs'
// downloadUrl/uploadUrl) against token at now: nil when it was signed with
// token and has not expired, else one of signedurl's errors. Such URLs
// name no sandbox when E2B_SANDBOX_URL is set; the node finds the sandbox
// by the token that signed it.
func FileSignatureError(r *http.Request, token string, now time.Time) error {
	if token == "" || r.URL.Path != "/files" {
		if r.URL.Query().Get("signature") == "" {
			return signedurl.ErrMissing
		}
		return signedurl.ErrInvalid
	}
	return signedurl.Check(r, token, now)
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
