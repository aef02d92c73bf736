package api

import (
	"context"
	"net/http"
	"time"

	"github.com/agentenv/agentenv/internal/apispec"
	"github.com/agentenv/agentenv/internal/orchestrator"
	"github.com/agentenv/agentenv/internal/sandboxes"
)

// leaseBody is a lease as the lease routes answer it.
func leaseBody(l *orchestrator.LeaseInfo) apispec.Lease {
	bound := l.Sandboxes
	if bound == nil {
		bound = []string{}
	}
	return apispec.Lease{LeaseID: l.ID, Ttl: int(l.TTL / time.Second), ExpiresAt: l.ExpiresAt, Expired: l.Expired,
		CreatedAt: l.CreatedAt, Sandboxes: bound}
}

// ListLeases implements GET /leases.
func (s *Server) ListLeases(w http.ResponseWriter, r *http.Request) {
	ls, err := s.node.Leases(r.Context())
	if err != nil {
		s.writeNodeError(w, err)
		return
	}
	out := make([]apispec.Lease, 0, len(ls))
	for _, l := range ls {
		out = append(out, leaseBody(l))
	}
	writeJSON(w, http.StatusOK, out)
}

// GetLease implements GET /leases/{leaseID}.
func (s *Server) GetLease(w http.ResponseWriter, r *http.Request, leaseID string) {
	l, err := s.node.Lease(r.Context(), leaseID)
	if err != nil {
		s.writeNodeError(w, err)
		return
	}
	writeJSON(w, http.StatusOK, leaseBody(l))
}

// KeepLeaseAlive implements POST /leases/{leaseID}/keepalive {ttl}.
func (s *Server) KeepLeaseAlive(w http.ResponseWriter, r *http.Request, leaseID string) {
	var body apispec.KeepLeaseAliveJSONBody
	if err := decodeBody(r, &body); err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	ttl := time.Duration(deref(body.Ttl)) * time.Second
	l, err := s.node.RenewLease(r.Context(), leaseID, ttl)
	if err != nil {
		s.writeNodeError(w, err)
		return
	}
	writeJSON(w, http.StatusOK, leaseBody(l))
}

// DeleteLease implements DELETE /leases/{leaseID}: its sandboxes are
// killed, then it is forgotten.
func (s *Server) DeleteLease(w http.ResponseWriter, r *http.Request, leaseID string) {
	killed, err := s.node.EndLease(r.Context(), leaseID)
	if err != nil {
		s.writeNodeError(w, err)
		return
	}
	if killed == nil {
		killed = []string{}
	}
	s.log.Info("lease ended", "lease", leaseID, "killed", len(killed))
	writeJSON(w, http.StatusOK, map[string]any{"leaseID": leaseID, "killed": killed})
}

// leaseView answers, for the sandboxes of one listing, the state of the
// lease each is bound to (nil: none); a lease that is gone is expired.
func (s *Server) leaseView(ctx context.Context) (func(*sandboxes.Sandbox) *apispec.SandboxLease, error) {
	ls, err := s.node.Leases(ctx)
	if err != nil {
		return nil, err
	}
	byID := make(map[string]*orchestrator.LeaseInfo, len(ls))
	for _, l := range ls {
		byID[l.ID] = l
	}
	return func(sb *sandboxes.Sandbox) *apispec.SandboxLease {
		if sb.Lease == "" {
			return nil
		}
		l, ok := byID[sb.Lease]
		if !ok {
			return &apispec.SandboxLease{LeaseID: sb.Lease, Expired: true}
		}
		exp := l.ExpiresAt
		return &apispec.SandboxLease{LeaseID: l.ID, ExpiresAt: &exp, Expired: l.Expired}
	}, nil
}
