package api

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"slices"
	"time"

	"github.com/agentenv/agentenv/internal/apispec"
	"github.com/agentenv/agentenv/internal/buildfiles"
	"github.com/agentenv/agentenv/internal/builds"
	"github.com/agentenv/agentenv/internal/errkind"
	"github.com/agentenv/agentenv/internal/orchestrator"
)

// AssignTemplateTags implements POST /templates/tags: tags point at the
// build target ("name" or "name:tag") is.
func (s *Server) AssignTemplateTags(w http.ResponseWriter, r *http.Request) {
	var req struct {
		Target string   `json:"target"`
		Tags   []string `json:"tags"`
	}
	if err := decodeBody(r, &req); err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	if req.Target == "" {
		writeError(w, http.StatusBadRequest, "target is required (\"name\" or \"name:tag\")")
		return
	}
	t, err := s.node.Catalog().AssignTags(r.Context(), req.Target, req.Tags)
	if err != nil {
		s.writeNodeError(w, err)
		return
	}
	writeJSON(w, http.StatusCreated, map[string]any{"tags": req.Tags, "buildID": t.BuildRef()})
}

// RemoveTemplateTags implements DELETE /templates/tags.
func (s *Server) RemoveTemplateTags(w http.ResponseWriter, r *http.Request) {
	var req struct {
		Name string   `json:"name"`
		Tags []string `json:"tags"`
	}
	if err := decodeBody(r, &req); err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	if req.Name == "" {
		writeError(w, http.StatusBadRequest, "name is required")
		return
	}
	if err := s.node.Catalog().RemoveTags(r.Context(), req.Name, req.Tags); err != nil {
		s.writeNodeError(w, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// ListTemplateTags implements GET /templates/{templateID}/tags.
func (s *Server) ListTemplateTags(w http.ResponseWriter, r *http.Request, templateID string) {
	tags, err := s.node.Catalog().Tags(r.Context(), templateID)
	if err != nil {
		s.writeNodeError(w, err)
		return
	}
	out := make([]map[string]any, 0, len(tags))
	for _, t := range tags {
		out = append(out, map[string]any{"tag": t.Tag, "buildID": t.BuildRef(), "createdAt": t.UpdatedAt})
	}
	writeJSON(w, http.StatusOK, out)
}

// RequestTemplateBuild implements POST /v3/templates.
func (s *Server) RequestTemplateBuild(w http.ResponseWriter, r *http.Request) {
	var req struct {
		Name          string   `json:"name"`
		Alias         string   `json:"alias"`
		Tags          []string `json:"tags"`
		CPUCount      *int     `json:"cpuCount"`
		MemoryMB      *int     `json:"memoryMB"`
		MinFreeDiskMB *int     `json:"minFreeDiskMb"`
		// TeamID is E2B cloud's; read only to refuse one of the wrong type.
		TeamID *string `json:"teamID"`
	}
	if err := decodeBody(r, &req); err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	name := req.Name
	if name == "" {
		name = req.Alias
	}
	if name == "" {
		writeError(w, http.StatusBadRequest, "name is required")
		return
	}
	cpu, mem := 0, 0 // 0: the node's defaults
	if req.CPUCount != nil {
		if cpu = *req.CPUCount; cpu < 1 {
			writeError(w, http.StatusBadRequest, "cpuCount must be at least 1")
			return
		}
	}
	if req.MemoryMB != nil {
		if mem = *req.MemoryMB; mem < 128 {
			writeError(w, http.StatusBadRequest, "memoryMB must be at least 128")
			return
		}
	}
	rec, err := s.node.RequestBuild(name, req.Tags, cpu, mem)
	if err != nil {
		s.writeNodeError(w, err)
		return
	}
	tags := rec.Tags
	if tags == nil {
		tags = []string{}
	}
	writeJSON(w, http.StatusAccepted, map[string]any{
		"templateID": rec.TemplateID, "buildID": rec.BuildID, "public": false,
		"aliases": []string{rec.TemplateID}, "names": []string{rec.TemplateID}, "tags": tags,
	})
}

// buildStepJSON is a build step as the SDK sends it.
type buildStepJSON struct {
	Type      string   `json:"type"`
	Args      []string `json:"args"`
	Force     bool     `json:"force"`
	FilesHash string   `json:"filesHash"`
}

// StartTemplateBuild implements POST /v2/templates/{templateID}/builds/{buildID}.
func (s *Server) StartTemplateBuild(w http.ResponseWriter, r *http.Request, templateID, buildID string) {
	var req struct {
		FromTemplate string          `json:"fromTemplate"`
		FromImage    string          `json:"fromImage"`
		StartCmd     string          `json:"startCmd"`
		ReadyCmd     string          `json:"readyCmd"`
		Force        bool            `json:"force"`
		Steps        []buildStepJSON `json:"steps"`
		// fromImageRegistry (credentials) is accepted and not used: images
		// come from the node's docker config.
		FromImageRegistry any `json:"fromImageRegistry"`
	}
	if err := decodeBody(r, &req); err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	if (req.FromTemplate == "") == (req.FromImage == "") {
		writeError(w, http.StatusBadRequest, "give exactly one of fromTemplate and fromImage")
		return
	}
	spec := builds.Spec{FromTemplate: req.FromTemplate, FromImage: req.FromImage,
		StartCmd: req.StartCmd, ReadyCmd: req.ReadyCmd, Force: req.Force}
	for _, st := range req.Steps {
		spec.Steps = append(spec.Steps, builds.Step{Type: st.Type, Args: st.Args, FilesHash: st.FilesHash, Force: st.Force})
	}
	if err := s.node.StartBuild(templateID, buildID, spec); err != nil {
		s.writeNodeError(w, err)
		return
	}
	w.WriteHeader(http.StatusAccepted)
}

type buildLogJSON struct {
	Timestamp time.Time `json:"timestamp"`
	Level     string    `json:"level"`
	Message   string    `json:"message"`
	Step      string    `json:"step,omitempty"`
}

// GetTemplateBuildStatus implements GET /templates/{templateID}/builds/{buildID}/status.
func (s *Server) GetTemplateBuildStatus(w http.ResponseWriter, r *http.Request, templateID, buildID string, params apispec.GetTemplateBuildStatusParams) {
	offset, err := intParam("logsOffset", params.LogsOffset, 0, 1<<31, 0)
	if err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	rec, err := s.node.Build(templateID, buildID)
	if err != nil {
		s.writeNodeError(w, err)
		return
	}
	entries, lines := []buildLogJSON{}, []string{}
	for i, e := range rec.Logs {
		if i < offset {
			continue
		}
		entries = append(entries, buildLogJSON(e))
		lines = append(lines, e.Timestamp.Format(time.RFC3339)+" "+e.Message)
	}
	status := rec.Status
	body := map[string]any{"templateID": rec.TemplateID, "buildID": rec.BuildID, "status": status,
		"logEntries": entries, "logs": lines}
	if status == builds.Failed {
		reason := map[string]any{"message": rec.Reason, "logEntries": []buildLogJSON{}}
		if rec.ReasonStep != "" {
			reason["step"] = rec.ReasonStep
		}
		body["reason"] = reason
	}
	writeJSON(w, http.StatusOK, body)
}

// uploadSignature authorises a build-file upload link.
func (s *Server) uploadSignature(templateID, hash string) string {
	m := hmac.New(sha256.New, s.uploadKey)
	fmt.Fprintf(m, "build-files\n%s\n%s", templateID, hash)
	return hex.EncodeToString(m.Sum(nil))
}

// GetTemplateFilesUploadLink implements GET /templates/{templateID}/files/{hash}:
// whether the template's builds already have the files (checked, see
// package buildfiles), and a signed link to upload them.
func (s *Server) GetTemplateFilesUploadLink(w http.ResponseWriter, r *http.Request, id, hash string) {
	if !buildfiles.HashRE.MatchString(hash) {
		writeError(w, http.StatusBadRequest, "files hash must be 16 to 128 lowercase hex digits")
		return
	}
	if err := s.buildWaitsForFiles(id); err != nil {
		s.writeNodeError(w, err)
		return
	}
	present := s.node.BuildFiles().Present(id, hash)
	scheme := "http"
	if r.TLS != nil || r.Header.Get("X-Forwarded-Proto") == "https" {
		scheme = "https"
	}
	link := url.URL{Scheme: scheme, Host: r.Host, Path: "/templates/" + url.PathEscape(id) + "/files/" + hash + "/upload",
		RawQuery: url.Values{"signature": {s.uploadSignature(id, hash)}}.Encode()}
	writeJSON(w, http.StatusCreated, map[string]any{"present": present, "url": link.String()})
}

// UploadTemplateFiles implements the upload link: the body (a tar archive,
// gzip-compressed or not) waits until a build names it with its COPY
// source and destination, when it is checked against its hash.
func (s *Server) UploadTemplateFiles(w http.ResponseWriter, r *http.Request, id, hash string, params apispec.UploadTemplateFilesParams) {
	if !buildfiles.HashRE.MatchString(hash) {
		writeError(w, http.StatusBadRequest, "files hash must be 16 to 128 lowercase hex digits")
		return
	}
	if !hmac.Equal([]byte(params.Signature), []byte(s.uploadSignature(id, hash))) {
		writeError(w, http.StatusUnauthorized, "invalid upload signature")
		return
	}
	if err := s.buildWaitsForFiles(id); err != nil {
		s.writeNodeError(w, err)
		return
	}
	if err := s.node.DiskRoom("an upload"); err != nil {
		s.writeNodeError(w, err)
		return
	}
	if err := s.node.BuildFiles().Receive(id, hash, r.Body); err != nil {
		s.writeNodeError(w, err)
		return
	}
	w.WriteHeader(http.StatusOK)
}

// buildWaitsForFiles refuses (404) the files of a template none of whose
// builds waits for its start or runs: uploads are taken for a requested
// build (POST /v3/templates first, as the SDKs do), not kept for
// templates that may never come.
func (s *Server) buildWaitsForFiles(id string) error {
	bs, err := s.node.TemplateBuilds(id)
	if err != nil {
		return err
	}
	if builds.WaitsOrRuns(bs) {
		return nil
	}
	return fmt.Errorf("%w: template %q has no build waiting for its files (request one first: POST /v3/templates)", errkind.ErrNotFound, id)
}

// GetTemplateAlias implements GET /templates/aliases/{alias}.
func (s *Server) GetTemplateAlias(w http.ResponseWriter, r *http.Request, alias string) {
	t, err := s.node.Template(alias)
	if err != nil {
		s.writeNodeError(w, err)
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"templateID": t.Name, "public": false})
}

// ListTemplates implements GET /templates.
func (s *Server) ListTemplates(w http.ResponseWriter, r *http.Request) { s.listTemplates(w, r) }

// ListTemplatesV2 implements GET /v2/templates, as GET /templates.
func (s *Server) ListTemplatesV2(w http.ResponseWriter, r *http.Request) { s.listTemplates(w, r) }

// DeleteTemplate implements DELETE /templates/{templateID}: 204, 404, or
// 409 while sandboxes or snapshots use the template. A snapshot's id is a
// template id too (the SDKs' delete_snapshot calls this): it deletes the
// snapshot.
func (s *Server) DeleteTemplate(w http.ResponseWriter, r *http.Request, id string) {
	err := s.node.DeleteTemplate(r.Context(), id)
	if errors.Is(err, orchestrator.ErrNotFound) {
		if serr := s.node.DeleteSnapshot(r.Context(), id); !errors.Is(serr, orchestrator.ErrNotFound) {
			err = serr
		}
	}
	if err != nil {
		s.writeNodeError(w, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

func (s *Server) listTemplates(w http.ResponseWriter, r *http.Request) {
	all, err := s.node.Templates()
	if err != nil {
		s.writeNodeError(w, err)
		return
	}
	out := []apispec.Template{}
	for _, t := range all {
		recs, err := s.node.TemplateBuilds(t.Name)
		if err != nil {
			s.writeNodeError(w, err)
			return
		}
		out = append(out, templateBody(t, recs))
	}
	writeJSON(w, http.StatusOK, out)
}

// templateBody describes template t, whose builds are recs.
func templateBody(t *orchestrator.Template, recs []*builds.Record) apispec.Template {
	created, updated := time.Time{}, time.Time{}
	for _, b := range recs {
		if created.IsZero() || b.CreatedAt.Before(created) {
			created = b.CreatedAt
		}
		if b.FinishedAt.After(updated) {
			updated = b.FinishedAt
		}
	}
	if created.IsZero() {
		created, updated = time.Unix(0, 0).UTC(), time.Unix(0, 0).UTC() // made by aenv setup or an import: no build record
	}
	return apispec.Template{
		TemplateID: t.Name, BuildID: t.BuildRef(), CpuCount: t.VCPUs, MemoryMB: t.MemoryMiB, DiskSizeMB: t.DiskMiB,
		Aliases: []string{t.Name}, Names: []string{t.Name}, CreatedAt: created, UpdatedAt: latest(created, updated),
		BuildCount: len(recs), EnvdVersion: t.EnvdVersion, BuildStatus: apispec.TemplateBuildStatusReady,
	}
}

// GetTemplate implements GET /templates/{templateID}: the template and
// its builds (newest first, in pages of limit with nextToken). The node
// counts no spawns (E2B cloud accounting): spawnCount is 0.
func (s *Server) GetTemplate(w http.ResponseWriter, r *http.Request, name string, params apispec.GetTemplateParams) {
	limit, err := intParam("limit", params.Limit, 1, 1000, 100)
	if err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	t, err := s.node.Template(name)
	if err != nil {
		s.writeNodeError(w, err)
		return
	}
	recs, err := s.node.TemplateBuilds(t.Name)
	if err != nil {
		s.writeNodeError(w, err)
		return
	}
	after := deref(params.NextToken)
	if after != "" && !slices.ContainsFunc(recs, func(b *builds.Record) bool { return b.BuildID == after }) {
		writeError(w, http.StatusBadRequest, "invalid nextToken")
		return
	}
	buildsOut := []apispec.TemplateBuild{}
	skipping := after != ""
	for _, b := range recs {
		if skipping {
			skipping = b.BuildID != after
			continue
		}
		if len(buildsOut) == limit {
			w.Header().Set("X-Next-Token", buildsOut[len(buildsOut)-1].BuildID)
			continue
		}
		entry := apispec.TemplateBuild{BuildID: b.BuildID, Status: apispec.BuildStatus(b.Status), CreatedAt: b.CreatedAt,
			UpdatedAt: latest(b.CreatedAt, b.FinishedAt), CpuCount: max(b.VCPUs, 1), MemoryMB: b.MemoryMiB,
			EnvdVersion: &t.EnvdVersion}
		if !b.FinishedAt.IsZero() {
			f := b.FinishedAt
			entry.FinishedAt = &f
		}
		buildsOut = append(buildsOut, entry)
	}
	tb := templateBody(t, recs)
	writeJSON(w, http.StatusOK, apispec.TemplateWithBuilds{
		TemplateID: tb.TemplateID, BuildID: tb.BuildID, CpuCount: tb.CpuCount, MemoryMB: tb.MemoryMB, DiskSizeMB: tb.DiskSizeMB,
		Aliases: tb.Aliases, Names: tb.Names, CreatedAt: tb.CreatedAt, UpdatedAt: tb.UpdatedAt, BuildCount: tb.BuildCount,
		EnvdVersion: tb.EnvdVersion, BuildStatus: apispec.TemplateWithBuildsBuildStatus(tb.BuildStatus), Builds: buildsOut,
	})
}

func latest(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}

// logLevels orders build log levels; a level filter keeps that level and
// the ones above it.
var logLevels = map[string]int{"debug": 0, "info": 1, "warn": 2, "error": 3}

// logQuery reads the direction (forward, backward) and level (the
// lowest kept) of a log request.
func logQuery(direction, level string) (string, int, error) {
	if direction != "" && direction != "forward" && direction != "backward" {
		return "", 0, errors.New("direction must be forward or backward")
	}
	minLevel := 0
	if l := level; l != "" {
		var ok bool
		if minLevel, ok = logLevels[l]; !ok {
			return "", 0, errors.New("level must be debug, info, warn or error")
		}
	}
	return direction, minLevel, nil
}

// GetBuildLogs implements GET /templates/{templateID}/builds/{buildID}/logs:
// the build's log from cursor (Unix milliseconds; forward from it, or
// backward up to it), at most limit entries, at level and above.
func (s *Server) GetBuildLogs(w http.ResponseWriter, r *http.Request, templateID, buildID string, params apispec.GetBuildLogsParams) {
	cursor, err := intParam("cursor", params.Cursor, 0, 1<<62, 0)
	var limit int
	if err == nil {
		limit, err = intParam("limit", params.Limit, 0, 10000, 100)
	}
	if err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	direction, minLevel, err := logQuery(string(deref(params.Direction)), string(deref(params.Level)))
	if err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	if src := deref(params.Source); src != "" && src != "persistent" && src != "temporary" {
		writeError(w, http.StatusBadRequest, "source must be persistent or temporary")
		return
	}
	rec, err := s.node.Build(templateID, buildID)
	if err != nil {
		s.writeNodeError(w, err)
		return
	}
	entries := rec.Logs
	if direction == "backward" {
		entries = slices.Clone(entries)
		slices.Reverse(entries)
	}
	out := []buildLogJSON{}
	for _, e := range entries {
		ms := e.Timestamp.UnixMilli()
		if (direction == "backward" && cursor > 0 && ms > int64(cursor)) || (direction != "backward" && ms < int64(cursor)) ||
			logLevels[e.Level] < minLevel {
			continue
		}
		if len(out) == limit {
			break
		}
		out = append(out, buildLogJSON(e))
	}
	writeJSON(w, http.StatusOK, map[string]any{"logs": out})
}
