package api

import (
	"bytes"
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"strings"
	"time"

	"github.com/agentenv/agentenv/internal/faults"
	"github.com/agentenv/agentenv/internal/idempotency"
	"github.com/agentenv/agentenv/internal/sandboxes"
)

// HeaderClient carries, from the gateway (with the node credential), the
// SHA-256 of the API key its client presented: the client an
// Idempotency-Key belongs to.
const HeaderClient = "X-Aenv-Client"

// ClientOf names who sent a request for idempotency: the SHA-256 of the
// API key it presented (hex).
func ClientOf(r *http.Request) string {
	sum := sha256.Sum256([]byte(presentedKey(r)))
	return hex.EncodeToString(sum[:])
}

// client is the client of a request to this node: the gateway's client
// when the gateway sent it, else the key's.
func (s *Server) client(r *http.Request) string {
	if c := r.Header.Get(HeaderClient); c != "" && s.fromGateway(r) {
		return c
	}
	return ClientOf(r)
}

// fromGateway reports whether r carries this node's node token (the
// gateway sent it).
func (s *Server) fromGateway(r *http.Request) bool {
	t := r.Header.Get(HeaderNodeToken)
	if t == "" || s.cfg.NodeToken == "" {
		return false
	}
	got, want := sha256.Sum256([]byte(t)), sha256.Sum256([]byte(s.cfg.NodeToken))
	return subtle.ConstantTimeCompare(got[:], want[:]) == 1
}

// FindOnlyPrefix before the path of a create or fork with an
// Idempotency-Key asks the node for the answer of the key's first request
// without running anything: that answer (or 409 while it runs, 422 for
// another body) when the node holds the key, 404 when it does not. A
// gateway that lost track of a key's node (it restarted, or another
// gateway placed the first request) asks every node with it before placing
// the request anew. It is a path of its own, not a header, so that a node
// of an earlier version, which knows no such path, answers 404 instead of
// running the create.
const FindOnlyPrefix = "/.idempotency-find"

// HeaderFindOnly on a create or fork asks the same as FindOnlyPrefix (what
// gateways of an earlier version send).
const HeaderFindOnly = "X-Aenv-Idempotency-Find"

type findOnlyKey struct{}

// findOnly routes a request under FindOnlyPrefix to its route, marked as
// find-only; it reports false for any other request.
func (s *Server) findOnly(w http.ResponseWriter, r *http.Request) bool {
	rest, ok := strings.CutPrefix(r.URL.Path, FindOnlyPrefix)
	if !ok {
		return false
	}
	// Only the routes that take an Idempotency-Key: under the prefix
	// nothing may run.
	parts := strings.Split(rest, "/")
	fork := len(parts) == 4 && parts[1] == "sandboxes" && parts[2] != "" && parts[3] == "fork"
	if r.Method != http.MethodPost || !(fork || rest == "/sandboxes" || rest == "/v2/sandboxes" || rest == "/sandboxes-cold") {
		writeError(w, http.StatusNotFound, "find-only requests are for POST /sandboxes, /v2/sandboxes, /sandboxes-cold and /sandboxes/{id}/fork")
		return true
	}
	r2 := r.Clone(context.WithValue(r.Context(), findOnlyKey{}, true))
	r2.URL.Path, r2.URL.RawPath = rest, ""
	s.mux.ServeHTTP(w, r2)
	return true
}

func isFindOnly(r *http.Request) bool {
	return r.Context().Value(findOnlyKey{}) != nil || r.Header.Get(HeaderFindOnly) != ""
}

// idempotentWait is how long a retry waits for its first request to end.
const idempotentWait = 3 * time.Minute

// madeAnswer is the body a create or fork answers (201) for the sandboxes
// it made, given its request body: how a retry answers a first request cut
// off by the node's end from what that made.
type madeAnswer func(w http.ResponseWriter, body []byte, made []*sandboxes.Sandbox) any

// oneSandbox is a create's madeAnswer.
func (s *Server) oneSandbox(_ http.ResponseWriter, _ []byte, made []*sandboxes.Sandbox) any {
	return s.sandboxBody(made[0])
}

// idempotent runs a create or fork (run) once per Idempotency-Key: a retry
// gets the first answer (package idempotency), or, when the node ended
// before it kept that, an answer (made) from the sandboxes the first
// request made. Without a key, or on a node that keeps no keys, it just
// runs.
func (s *Server) idempotent(w http.ResponseWriter, r *http.Request, route string, key *string, made madeAnswer, run func(http.ResponseWriter, *http.Request)) {
	if isFindOnly(r) {
		s.findIdempotent(w, r, route, key, made)
		return
	}
	if key == nil || s.cfg.Idempotency == nil {
		run(w, r)
		return
	}
	body, err := readBody(r)
	if err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	answer, claim, err := s.cfg.Idempotency.Begin(r.Context(), idempotency.Request{
		Client: s.client(r), Route: route, Key: *key, Body: body}, idempotentWait)
	if err != nil {
		s.writeNodeError(w, err)
		return
	}
	if answer != nil {
		answer.Write(w)
		return
	}
	if answer, err := s.resumeCutOff(w, r, claim, body, made); err != nil || answer != nil {
		if err != nil {
			s.writeNodeError(w, err)
			return
		}
		answer.Write(w)
		return
	}
	rec := &keptAnswer{ResponseWriter: w, status: http.StatusOK}
	r.Body = io.NopCloser(bytes.NewReader(body))
	// What it makes carries the request's id: a retry after the node's
	// end finds it (resumeCutOff).
	run(rec, r.WithContext(idempotency.WithRequest(r.Context(), claim.ID())))
	faults.Point(faults.IdempotentAnswered)
	// Kept even when the client went: its retry gets this sandbox.
	ctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), 10*time.Second)
	defer cancel()
	if err := claim.Finish(ctx, idempotency.Answer{Status: rec.status, ContentType: rec.Header().Get("Content-Type"), Body: rec.body.Bytes()}); err != nil {
		s.log.Error("keeping the answer of an idempotent request", "route", route, "err", err)
	}
}

// resumeCutOff answers a claim that took over a first request cut off by
// the node's end (claim.Interrupted) from the sandboxes that request made,
// and keeps that answer; nil when it made none (or the claim is a plain
// first request), and then the request runs (anew).
func (s *Server) resumeCutOff(w http.ResponseWriter, r *http.Request, claim *idempotency.Claim, body []byte, made madeAnswer) (*idempotency.Answer, error) {
	if !claim.Interrupted() {
		return nil, nil
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), 10*time.Second)
	defer cancel()
	sbs, err := s.node.SandboxesOf(ctx, claim.ID())
	if err != nil || len(sbs) == 0 {
		if err != nil {
			_ = claim.Release(ctx) // its retry looks again
		}
		return nil, err
	}
	b, err := json.Marshal(made(w, body, sbs))
	if err != nil {
		return nil, err
	}
	answer := &idempotency.Answer{Status: http.StatusCreated, ContentType: "application/json", Body: append(b, '\n')}
	if err := claim.Finish(ctx, *answer); err != nil {
		return nil, err
	}
	s.log.Info("idempotent request cut off by the node's end answered from what it made", "sandboxes", len(sbs))
	return answer, nil
}

// findIdempotent answers a find-only request: nothing runs.
func (s *Server) findIdempotent(w http.ResponseWriter, r *http.Request, route string, key *string, made madeAnswer) {
	if key == nil || s.cfg.Idempotency == nil {
		writeError(w, http.StatusNotFound, idempotency.ErrUnknown.Error())
		return
	}
	body, err := readBody(r)
	if err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	answer, claim, err := s.cfg.Idempotency.Find(r.Context(), idempotency.Request{
		Client: s.client(r), Route: route, Key: *key, Body: body}, idempotentWait)
	if claim != nil {
		// Cut off by the node's end: answered from what it made, or (made
		// nothing) forgotten here, so the gateway places it anew.
		if answer, err = s.resumeCutOff(w, r, claim, body, made); err == nil && answer == nil {
			ctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), 10*time.Second)
			defer cancel()
			if err = claim.Release(ctx); err == nil {
				err = idempotency.ErrUnknown
			}
		}
	}
	switch {
	case errors.Is(err, idempotency.ErrUnknown):
		writeError(w, http.StatusNotFound, err.Error())
	case err != nil:
		s.writeNodeError(w, err)
	default:
		answer.Write(w)
	}
}

// readBody reads a request body of at most maxBodyBytes.
func readBody(r *http.Request) ([]byte, error) {
	body, err := io.ReadAll(io.LimitReader(r.Body, maxBodyBytes+1))
	if err != nil {
		return nil, err
	}
	if len(body) > maxBodyBytes {
		return nil, errBodyTooLarge
	}
	return body, nil
}

// keptAnswer writes an answer through and keeps a copy of it.
type keptAnswer struct {
	http.ResponseWriter
	status int
	wrote  bool
	body   bytes.Buffer
}

func (k *keptAnswer) WriteHeader(status int) {
	if !k.wrote {
		k.status, k.wrote = status, true
	}
	k.ResponseWriter.WriteHeader(status)
}

func (k *keptAnswer) Write(b []byte) (int, error) {
	k.wrote = true
	k.body.Write(b)
	return k.ResponseWriter.Write(b)
}
