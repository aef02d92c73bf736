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

// CreateVolume implements POST /volumes.
func (s *Server) CreateVolume(w http.ResponseWriter, r *http.Request) {
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

// ListVolumes implements GET /volumes.
func (s *Server) ListVolumes(w http.ResponseWriter, r *http.Request) {
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

// GetVolume implements GET /volumes/{volumeID}.
func (s *Server) GetVolume(w http.ResponseWriter, r *http.Request, volumeID apispec.VolumeID) {
	if s.volumesOff(w) {
		return
	}
	v, err := s.cfg.Volumes.Get(r.Context(), volumeID)
	if err != nil {
		s.writeNodeError(w, err)
		return
	}
	writeJSON(w, http.StatusOK, apispec.VolumeAndToken{VolumeID: v.ID, Name: v.Name, Token: v.Token})
}

// DeleteVolume implements DELETE /volumes/{volumeID}.
func (s *Server) DeleteVolume(w http.ResponseWriter, r *http.Request, id apispec.VolumeID) {
	if s.volumesOff(w) {
		return
	}
	if err := s.cfg.Volumes.Delete(r.Context(), id); err != nil {
		s.writeNodeError(w, err)
		return
	}
	s.log.Info("volume deleted", "volume", id)
	w.WriteHeader(http.StatusNoContent)
}

// requireVolumeToken admits a content request that presents the volume's
// token as a bearer token (compared in constant time; the SDKs send it to
// E2B_VOLUME_API_URL). An unknown volume is 404 whatever the token.
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

// onlyParams refuses a query parameter the content route does not take
// (the generated parameter parsing leaves unknown ones out silently).
func onlyParams(r *http.Request, allowed ...string) error {
	for k := range r.URL.Query() {
		if k != "path" && !slices.Contains(allowed, k) {
			return fmt.Errorf("%w: unknown query parameter %q", errkind.ErrInvalid, k)
		}
	}
	return nil
}

// ownerParams are the owner a content route gives what it makes.
func ownerParams(uid, gid, mode *int) (volumes.Owner, error) {
	var o volumes.Owner
	for _, p := range []struct {
		name   string
		v      *int
		max    int
		dst    **int
		isMode bool
	}{{"uid", uid, 1<<31 - 2, &o.UID, false}, {"gid", gid, 1<<31 - 2, &o.GID, false}, {"mode", mode, 0o7777, nil, true}} {
		if p.v == nil {
			continue
		}
		if *p.v < 0 || *p.v > p.max {
			return o, fmt.Errorf("%w: query parameter %q must be an integer from 0 to %d", errkind.ErrInvalid, p.name, p.max)
		}
		if p.isMode {
			m := uint32(*p.v)
			o.Mode = &m
		} else {
			v := *p.v
			*p.dst = &v
		}
	}
	return o, nil
}

// StatVolumePath implements GET /volumecontent/{volumeID}/path.
func (s *Server) StatVolumePath(w http.ResponseWriter, r *http.Request, volumeID apispec.VolumeID, params apispec.StatVolumePathParams) {
	if err := onlyParams(r); err != nil {
		s.writeNodeError(w, err)
		return
	}
	e, err := s.cfg.Volumes.Stat(r.Context(), volumeID, params.Path)
	if err != nil {
		s.writeNodeError(w, err)
		return
	}
	writeJSON(w, http.StatusOK, entryBody(e))
}

// PatchVolumePath implements PATCH /volumecontent/{volumeID}/path.
func (s *Server) PatchVolumePath(w http.ResponseWriter, r *http.Request, volumeID apispec.VolumeID, params apispec.PatchVolumePathParams) {
	if err := onlyParams(r); err != nil {
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
	e, err := s.cfg.Volumes.SetMetadata(r.Context(), volumeID, params.Path, volumes.Owner{UID: body.UID, GID: body.GID, Mode: body.Mode})
	if err != nil {
		s.writeNodeError(w, err)
		return
	}
	writeJSON(w, http.StatusOK, entryBody(e))
}

// RemoveVolumePath implements DELETE /volumecontent/{volumeID}/path.
func (s *Server) RemoveVolumePath(w http.ResponseWriter, r *http.Request, volumeID apispec.VolumeID, params apispec.RemoveVolumePathParams) {
	if err := onlyParams(r); err != nil {
		s.writeNodeError(w, err)
		return
	}
	if err := s.cfg.Volumes.Remove(r.Context(), volumeID, params.Path); err != nil {
		s.writeNodeError(w, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// ListVolumeDir implements GET /volumecontent/{volumeID}/dir.
func (s *Server) ListVolumeDir(w http.ResponseWriter, r *http.Request, volumeID apispec.VolumeID, params apispec.ListVolumeDirParams) {
	err := onlyParams(r, "depth")
	depth := 1
	if err == nil {
		if depth, err = intParam("depth", params.Depth, 1, volumes.MaxDepth, 1); err != nil {
			err = fmt.Errorf("%w: query %w", errkind.ErrInvalid, err)
		}
	}
	if err != nil {
		s.writeNodeError(w, err)
		return
	}
	l, err := s.cfg.Volumes.ListDir(r.Context(), volumeID, params.Path, depth)
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

// MakeVolumeDir implements POST /volumecontent/{volumeID}/dir.
func (s *Server) MakeVolumeDir(w http.ResponseWriter, r *http.Request, volumeID apispec.VolumeID, params apispec.MakeVolumeDirParams) {
	owner, err := ownerParams(params.Uid, params.Gid, params.Mode)
	if err == nil {
		err = onlyParams(r, "uid", "gid", "mode", "force")
	}
	if err != nil {
		s.writeNodeError(w, err)
		return
	}
	e, err := s.cfg.Volumes.MakeDir(r.Context(), volumeID, params.Path, owner, deref(params.Force))
	if err != nil {
		s.writeNodeError(w, err)
		return
	}
	writeJSON(w, http.StatusCreated, entryBody(e))
}

// ReadVolumeFile implements GET /volumecontent/{volumeID}/file.
func (s *Server) ReadVolumeFile(w http.ResponseWriter, r *http.Request, volumeID apispec.VolumeID, params apispec.ReadVolumeFileParams) {
	if err := onlyParams(r); err != nil {
		s.writeNodeError(w, err)
		return
	}
	started := false
	err := s.cfg.Volumes.ReadFile(r.Context(), volumeID, params.Path, func(size int64) {
		w.Header().Set("Content-Type", "application/octet-stream")
		w.Header().Set("Content-Length", strconv.FormatInt(size, 10))
		w.WriteHeader(http.StatusOK)
		started = true
	}, w)
	if err != nil && !started {
		s.writeNodeError(w, err)
	} else if err != nil {
		s.log.Warn("volume read ended early", "volume", volumeID, "err", err)
	}
}

// WriteVolumeFile implements PUT /volumecontent/{volumeID}/file.
func (s *Server) WriteVolumeFile(w http.ResponseWriter, r *http.Request, volumeID apispec.VolumeID, params apispec.WriteVolumeFileParams) {
	owner, err := ownerParams(params.Uid, params.Gid, params.Mode)
	if err == nil {
		err = onlyParams(r, "uid", "gid", "mode", "force")
	}
	if err != nil {
		s.writeNodeError(w, err)
		return
	}
	e, err := s.cfg.Volumes.WriteFile(r.Context(), volumeID, params.Path, owner, deref(params.Force), r.Body)
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
