package api

import (
	"net/http"

	"github.com/agentenv/agentenv/internal/apispec"
)

// coldRequest is the body of POST /sandboxes-cold: a create's fields with
// an image in place of a template.
type coldRequest struct {
	createSandboxRequest
	Image      string `json:"image"`
	DiskSizeMB *int   `json:"diskSizeMB"`
}

// CreateSandboxFromImage implements POST /sandboxes-cold.
func (s *Server) CreateSandboxFromImage(w http.ResponseWriter, r *http.Request, params apispec.CreateSandboxFromImageParams) {
	s.idempotent(w, r, "POST /sandboxes-cold", params.IdempotencyKey, s.oneSandbox, s.createFromImage)
}

func (s *Server) createFromImage(w http.ResponseWriter, r *http.Request) {
	var req coldRequest
	if err := decodeBody(r, &req); err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	if req.Image == "" {
		writeError(w, http.StatusBadRequest, `field "image" is required`)
		return
	}
	if req.TemplateID != "" || len(req.VolumeMounts) > 0 {
		writeError(w, http.StatusBadRequest, "a sandbox from an image takes no templateID and no volumeMounts")
		return
	}
	req.TemplateID = "image" // validated as a create; the image is the template
	cr, err := req.toCreateRequest(true)
	if err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	if req.DiskSizeMB != nil {
		cr.DiskMiB = *req.DiskSizeMB
	}
	sb, err := s.node.CreateFromImage(r.Context(), req.Image, cr)
	if err != nil {
		s.writeNodeError(w, err)
		return
	}
	writeJSON(w, http.StatusCreated, s.sandboxBody(sb))
}
