package api

import (
	"crypto/sha256"
	"crypto/subtle"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"strings"

	"github.com/agentenv/agentenv/internal/apispec"
	"github.com/agentenv/agentenv/internal/errkind"
	"github.com/agentenv/agentenv/internal/volumes"
)

func (s *Server) volumeRoutes() {
	auth := s.requireKey
	s.route("POST /volumes", auth(s.createVolume))
	s.route("GET /volumes", auth(s.listVolumes))
	s.route("GET /volumes/{volumeID}", auth(s.getVolume))
	s.route("DELETE /volumes/{volumeID}", auth(s.deleteVolume))
	// The content routes take the volume's own token (Authorization:
	// Bearer), which the SDKs send to E2B_VOLUME_API_URL.
	content := s.requireVolumeToken
	s.route("GET /volumecontent/{volumeID}/path", content(s.statVolumePath))
	s.route("PATCH /volumecontent/{volumeID}/path", content(s.patchVolumePath))
	s.route("DELETE /volumecontent/{volumeID}/path", content(s.removeVolumePath))
	s.route("GET /volumecontent/{volumeID}/dir", content(s.listVolumeDir))
	s.route("POST /volumecontent/{volumeID}/dir", content(s.makeVolumeDir))
	s.route("GET /volumecontent/{volumeID}/file", content(s.readVolumeFile))
	s.route("PUT /volumecontent/{volumeID}/file", content(s.writeVolumeFile))
}

// jsonBody refuses (415) a body declared as anything but JSON.
func jsonBody(w http.ResponseWriter, r *http.Request) bool {
	ct := r.Header.Get("Content-Type")
	if ct == "" {
		return true
	}
	if mt, _, _ := strings.Cut(ct, ";"); strings.TrimSpace(strings.ToLower(mt)) != "application/json" {
		writeError(w, http.StatusUnsupportedMediaType, fmt.Sprintf("the body must be application/json, not %q", ct))
		return false
	}
	return true
}

// volumesOff answers when the node serves no volumes.
func (s *Server) volumesOff(w http.ResponseWriter) bool {
	if s.cfg.Volumes == nil {
		writeError(w, http.StatusNotFound, "this node serves no volumes")
		return true
	}
	return false
}

func (s *Server) createVolume(w http.ResponseWriter, r *http.Request) {
	if s.volumesOff(w) {
		return
	}
	var req struct {
		Name *string `json:"name"`
	}
	if !jsonBody(w, r) {
		return
	}
	if err := decodeBody(r, &req); err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	if req.Name == nil {
		writeError(w, http.StatusBadRequest, `field "name" is required`)
		return
	}
	v, err := s.cfg.Volumes.Create(r.Context(), *req.Name)
	if err != nil {
		s.writeNodeError(w, err)
		return
	}
	s.log.Info("volume created", "volume", v.ID, "name", v.Name)
	writeJSON(w, http.StatusCreated, apispec.VolumeAndToken{VolumeID: v.ID, Name: v.Name, Token: v.Token})
}

func (s *Server) listVolumes(w http.ResponseWriter, r *http.Request) {
	if s.volumesOff(w) {
		return
	}
	l, err := s.cfg.Volumes.List(r.Context())
	if err != nil {
		s.writeNodeError(w, err)
		return
	}
	out := make([]apispec.Volume, 0, len(l))
	for _, v := range l {
		out = append(out, apispec.Volume{VolumeID: v.ID, Name: v.Name})
	}
	writeJSON(w, http.StatusOK, out)
}

func (s *Server) getVolume(w http.ResponseWriter, r *http.Request) {
	if s.volumesOff(w) {
		return
	}
	v, err := s.cfg.Volumes.Get(r.Context(), r.PathValue("volumeID"))
	if err != nil {
		s.writeNodeError(w, err)
		return
	}
	writeJSON(w, http.StatusOK, apispec.VolumeAndToken{VolumeID: v.ID, Name: v.Name, Token: v.Token})
}

func (s *Server) deleteVolume(w http.ResponseWriter, r *http.Request) {
	if s.volumesOff(w) {
		return
	}
	id := r.PathValue("volumeID")
	if err := s.cfg.Volumes.Delete(r.Context(), id); err != nil {
		s.writeNodeError(w, err)
		return
	}
	s.log.Info("volume deleted", "volume", id)
	w.WriteHeader(http.StatusNoContent)
}

// requireVolumeToken admits a content request that presents the volume's
// token as a bearer token (compared in constant time). An unknown volume
// is 404 whatever the token.
func (s *Server) requireVolumeToken(h func(http.ResponseWriter, *http.Request)) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if s.volumesOff(w) {
			return
		}
		a := r.Header.Get("Authorization")
		token, ok := strings.CutPrefix(a, "Bearer ")
		if !ok || token == "" {
			writeError(w, http.StatusUnauthorized, "missing volume token: send it as Authorization: Bearer <token> (GET /volumes/{volumeID} has it)")
			return
		}
		v, err := s.cfg.Volumes.Get(r.Context(), r.PathValue("volumeID"))
		if err != nil {
			s.writeNodeError(w, err)
			return
		}
		got, want := sha256.Sum256([]byte(token)), sha256.Sum256([]byte(v.Token))
		if subtle.ConstantTimeCompare(got[:], want[:]) != 1 {
			writeError(w, http.StatusUnauthorized, "invalid volume token")
			return
		}
		h(w, r)
	})
}

// entryBody is a volume entry as the content routes answer it.
func entryBody(e *volumes.Entry) apispec.VolumeEntryStat {
	out := apispec.VolumeEntryStat{
		Name: e.Name, Type: apispec.VolumeEntryStatType(e.Type), Path: e.Path, Size: e.Size, Mode: int(e.Mode),
		Uid: int(e.UID), Gid: int(e.GID), Atime: e.Atime, Mtime: e.Mtime, Ctime: e.Ctime,
	}
	if e.Target != "" {
		t := e.Target
		out.Target = &t
	}
	return out
}

// volumeQuery reads the content routes' query: path (required), the
// owner fields (uid, gid, mode) and the flags (force) and numbers (depth)
// each route takes; anything else is refused.
type volumeQuery struct {
	path  string
	owner volumes.Owner
	force bool
	depth int
}

func parseVolumeQuery(r *http.Request, allowed ...string) (volumeQuery, error) {
	q := volumeQuery{depth: 1}
	vals := r.URL.Query()
	for k := range vals {
		if k != "path" && !slices.Contains(allowed, k) {
			return q, fmt.Errorf("%w: unknown query parameter %q", errkind.ErrInvalid, k)
		}
	}
	if !vals.Has("path") {
		return q, fmt.Errorf("%w: query parameter \"path\" is required", errkind.ErrInvalid)
	}
	q.path = vals.Get("path")
	intParam := func(name string, min, max int64, dst **int) error {
		if !vals.Has(name) {
			return nil
		}
		n, err := strconv.ParseInt(vals.Get(name), 10, 64)
		if err != nil || n < min || n > max {
			return fmt.Errorf("%w: query parameter %q must be an integer from %d to %d", errkind.ErrInvalid, name, min, max)
		}
		v := int(n)
		*dst = &v
		return nil
	}
	if err := intParam("uid", 0, 1<<31-2, &q.owner.UID); err != nil {
		return q, err
	}
	if err := intParam("gid", 0, 1<<31-2, &q.owner.GID); err != nil {
		return q, err
	}
	var mode *int
	if err := intParam("mode", 0, 0o7777, &mode); err != nil {
		return q, err
	}
	if mode != nil {
		m := uint32(*mode)
		q.owner.Mode = &m
	}
	var depth *int
	if err := intParam("depth", 1, volumes.MaxDepth, &depth); err != nil {
		return q, err
	}
	if depth != nil {
		q.depth = *depth
	}
	if vals.Has("force") {
		f, err := strconv.ParseBool(vals.Get("force"))
		if err != nil {
			return q, fmt.Errorf("%w: query parameter \"force\" must be true or false", errkind.ErrInvalid)
		}
		q.force = f
	}
	return q, nil
}

func (s *Server) statVolumePath(w http.ResponseWriter, r *http.Request) {
	q, err := parseVolumeQuery(r)
	if err != nil {
		s.writeNodeError(w, err)
		return
	}
	e, err := s.cfg.Volumes.Stat(r.Context(), r.PathValue("volumeID"), q.path)
	if err != nil {
		s.writeNodeError(w, err)
		return
	}
	writeJSON(w, http.StatusOK, entryBody(e))
}

func (s *Server) patchVolumePath(w http.ResponseWriter, r *http.Request) {
	q, err := parseVolumeQuery(r)
	if err != nil {
		s.writeNodeError(w, err)
		return
	}
	var body struct {
		UID  *int    `json:"uid"`
		GID  *int    `json:"gid"`
		Mode *uint32 `json:"mode"`
	}
	if !jsonBody(w, r) {
		return
	}
	if err := decodeBody(r, &body); err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	e, err := s.cfg.Volumes.SetMetadata(r.Context(), r.PathValue("volumeID"), q.path, volumes.Owner{UID: body.UID, GID: body.GID, Mode: body.Mode})
	if err != nil {
		s.writeNodeError(w, err)
		return
	}
	writeJSON(w, http.StatusOK, entryBody(e))
}

func (s *Server) removeVolumePath(w http.ResponseWriter, r *http.Request) {
	q, err := parseVolumeQuery(r)
	if err != nil {
		s.writeNodeError(w, err)
		return
	}
	if err := s.cfg.Volumes.Remove(r.Context(), r.PathValue("volumeID"), q.path); err != nil {
		s.writeNodeError(w, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

func (s *Server) listVolumeDir(w http.ResponseWriter, r *http.Request) {
	q, err := parseVolumeQuery(r, "depth")
	if err != nil {
		s.writeNodeError(w, err)
		return
	}
	l, err := s.cfg.Volumes.ListDir(r.Context(), r.PathValue("volumeID"), q.path, q.depth)
	if err != nil {
		s.writeNodeError(w, err)
		return
	}
	out := make([]apispec.VolumeEntryStat, 0, len(l))
	for i := range l {
		out = append(out, entryBody(&l[i]))
	}
	writeJSON(w, http.StatusOK, out)
}

func (s *Server) makeVolumeDir(w http.ResponseWriter, r *http.Request) {
	q, err := parseVolumeQuery(r, "uid", "gid", "mode", "force")
	if err != nil {
		s.writeNodeError(w, err)
		return
	}
	e, err := s.cfg.Volumes.MakeDir(r.Context(), r.PathValue("volumeID"), q.path, q.owner, q.force)
	if err != nil {
		s.writeNodeError(w, err)
		return
	}
	writeJSON(w, http.StatusCreated, entryBody(e))
}

func (s *Server) readVolumeFile(w http.ResponseWriter, r *http.Request) {
	q, err := parseVolumeQuery(r)
	if err != nil {
		s.writeNodeError(w, err)
		return
	}
	started := false
	err = s.cfg.Volumes.ReadFile(r.Context(), r.PathValue("volumeID"), q.path, func(size int64) {
		w.Header().Set("Content-Type", "application/octet-stream")
		w.Header().Set("Content-Length", strconv.FormatInt(size, 10))
		w.WriteHeader(http.StatusOK)
		started = true
	}, w)
	if err != nil && !started {
		s.writeNodeError(w, err)
	} else if err != nil {
		s.log.Warn("volume read ended early", "volume", r.PathValue("volumeID"), "err", err)
	}
}

func (s *Server) writeVolumeFile(w http.ResponseWriter, r *http.Request) {
	q, err := parseVolumeQuery(r, "uid", "gid", "mode", "force")
	if err != nil {
		s.writeNodeError(w, err)
		return
	}
	e, err := s.cfg.Volumes.WriteFile(r.Context(), r.PathValue("volumeID"), q.path, q.owner, q.force, r.Body)
	var tooBig *http.MaxBytesError
	switch {
	case errors.As(err, &tooBig):
		writeError(w, http.StatusRequestEntityTooLarge, err.Error())
	case err != nil:
		s.writeNodeError(w, err)
	default:
		writeJSON(w, http.StatusCreated, entryBody(e))
	}
}
