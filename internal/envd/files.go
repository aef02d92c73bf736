package envd

import (
	"compress/gzip"
	"encoding/json"
	"errors"
	"io"
	"mime"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"syscall"
)

// uploadedEntry is one element of the POST /files response.
type uploadedEntry struct {
	Name     string            `json:"name"`
	Type     string            `json:"type"`
	Path     string            `json:"path"`
	Metadata map[string]string `json:"metadata,omitempty"`
}

func (s *Server) handleFiles(w http.ResponseWriter, r *http.Request) {
	switch r.Method {
	case http.MethodGet, http.MethodHead:
		s.handleDownload(w, r)
	case http.MethodPost, http.MethodPut:
		s.handleUpload(w, r)
	default:
		w.Header().Set("Allow", "GET, HEAD, POST")
		writeJSONError(w, http.StatusMethodNotAllowed, "method not allowed")
	}
}

func (s *Server) handleDownload(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	u, err := s.requestUser(q.Get("username"), r.Header)
	if err != nil {
		writeJSONError(w, http.StatusUnauthorized, err.Error())
		return
	}
	if q.Get("path") == "" {
		writeJSONError(w, http.StatusBadRequest, "path is required")
		return
	}
	p, err := resolvePath(q.Get("path"), u)
	if err != nil {
		writeJSONError(w, http.StatusBadRequest, err.Error())
		return
	}
	f, err := os.Open(p)
	if err != nil {
		switch {
		case errors.Is(err, os.ErrNotExist):
			writeJSONError(w, http.StatusNotFound, "file not found: "+p)
		case errors.Is(err, os.ErrPermission):
			writeJSONError(w, http.StatusForbidden, "permission denied: "+p)
		default:
			writeJSONError(w, http.StatusBadRequest, err.Error())
		}
		return
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		writeJSONError(w, http.StatusInternalServerError, err.Error())
		return
	}
	if fi.IsDir() {
		writeJSONError(w, http.StatusBadRequest, "path is a directory: "+p)
		return
	}
	if !accessOK(fi, u, 4) {
		writeJSONError(w, http.StatusForbidden, "permission denied for user "+u.Name+": "+p)
		return
	}
	ctype := mime.TypeByExtension(filepath.Ext(p))
	if ctype == "" {
		ctype = "application/octet-stream"
	}
	w.Header().Set("Content-Type", ctype)
	w.Header().Set("Content-Disposition", mime.FormatMediaType("attachment", map[string]string{"filename": filepath.Base(p)}))
	w.Header().Set("Cache-Control", "no-store")
	if !fi.Mode().IsRegular() || fi.Size() == 0 {
		// Devices, FIFOs, and the files of /proc and /sys (regular,
		// of size 0, some unseekable): stream without a known length.
		w.WriteHeader(http.StatusOK)
		if r.Method != http.MethodHead {
			_, _ = io.Copy(w, f)
		}
		return
	}
	http.ServeContent(w, r, fi.Name(), fi.ModTime(), f)
}

func (s *Server) handleUpload(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	u, err := s.requestUser(q.Get("username"), r.Header)
	if err != nil {
		writeJSONError(w, http.StatusUnauthorized, err.Error())
		return
	}
	md, err := metadataFromHeaders(r.Header)
	if err != nil {
		writeJSONError(w, http.StatusBadRequest, err.Error())
		return
	}
	ctype, _, _ := mime.ParseMediaType(r.Header.Get("Content-Type"))
	var out []uploadedEntry
	switch ctype {
	case "multipart/form-data":
		mr, err := r.MultipartReader()
		if err != nil {
			writeJSONError(w, http.StatusBadRequest, "invalid multipart body: "+err.Error())
			return
		}
		for {
			part, err := mr.NextRawPart()
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				writeJSONError(w, http.StatusBadRequest, "invalid multipart body: "+err.Error())
				return
			}
			if part.FormName() != "file" {
				_ = part.Close()
				continue
			}
			target := q.Get("path")
			if target == "" {
				// Part.FileName strips directories; the SDK sends the full
				// destination path as the file name.
				_, params, _ := mime.ParseMediaType(part.Header.Get("Content-Disposition"))
				target = params["filename"]
			}
			if target == "" {
				_ = part.Close()
				writeJSONError(w, http.StatusBadRequest, "no destination path for uploaded file")
				return
			}
			var src io.Reader = part
			if strings.EqualFold(part.Header.Get("Content-Transfer-Encoding"), "base64") {
				writeJSONError(w, http.StatusBadRequest, "base64 transfer encoding is not supported")
				return
			}
			e, status, err := s.writeUpload(target, src, u, md)
			_ = part.Close()
			if err != nil {
				writeJSONError(w, status, err.Error())
				return
			}
			out = append(out, e)
		}
		if len(out) == 0 {
			writeJSONError(w, http.StatusBadRequest, "no file in multipart body")
			return
		}
	default:
		// application/octet-stream (or anything else): the body is the file.
		target := q.Get("path")
		if target == "" {
			writeJSONError(w, http.StatusBadRequest, "path is required for a raw upload")
			return
		}
		var src io.Reader = r.Body
		if strings.EqualFold(r.Header.Get("Content-Encoding"), "gzip") {
			gz, err := gzip.NewReader(r.Body)
			if err != nil {
				writeJSONError(w, http.StatusBadRequest, "invalid gzip body: "+err.Error())
				return
			}
			defer gz.Close()
			src = gz
		}
		e, status, err := s.writeUpload(target, src, u, md)
		if err != nil {
			writeJSONError(w, status, err.Error())
			return
		}
		out = append(out, e)
	}
	writeJSON(w, http.StatusOK, out)
}

// writeUpload stores src at target on behalf of u. It returns the HTTP
// status to use on failure.
func (s *Server) writeUpload(target string, src io.Reader, u *sysUser, md map[string]string) (uploadedEntry, int, error) {
	p, err := resolvePath(target, u)
	if err != nil {
		return uploadedEntry{}, http.StatusBadRequest, err
	}
	if fi, err := os.Stat(p); err == nil {
		if fi.IsDir() {
			return uploadedEntry{}, http.StatusBadRequest, errors.New("path is a directory: " + p)
		}
		if !accessOK(fi, u, 2) {
			return uploadedEntry{}, http.StatusForbidden, errors.New("permission denied for user " + u.Name + ": " + p)
		}
	}
	if err := mkdirAllOwned(filepath.Dir(p), u); err != nil {
		return uploadedEntry{}, uploadStatus(err), err
	}
	_, statErr := os.Lstat(p)
	created := errors.Is(statErr, os.ErrNotExist)
	f, err := os.OpenFile(p, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o644)
	if err != nil {
		return uploadedEntry{}, uploadStatus(err), err
	}
	if created {
		chownTo(p, u)
	}
	_, err = io.Copy(f, src)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return uploadedEntry{}, uploadStatus(err), err
	}
	if err := replaceMetadata(p, md); err != nil {
		return uploadedEntry{}, http.StatusInternalServerError, err
	}
	e := uploadedEntry{Name: filepath.Base(p), Type: "file", Path: p}
	if len(md) > 0 {
		e.Metadata = md
	}
	return e, 0, nil
}

func uploadStatus(err error) int {
	switch {
	case errors.Is(err, syscall.ENOSPC), errors.Is(err, syscall.EDQUOT):
		return http.StatusInsufficientStorage
	case errors.Is(err, os.ErrPermission):
		return http.StatusForbidden
	case errors.Is(err, syscall.ENOTDIR), errors.Is(err, syscall.EISDIR), errors.Is(err, syscall.ENAMETOOLONG):
		return http.StatusBadRequest
	default:
		return http.StatusInternalServerError
	}
}

// composeRequest is the body of POST /files/compose.
type composeRequest struct {
	Destination string   `json:"destination"`
	SourcePaths []string `json:"source_paths"`
	Username    string   `json:"username"`
}

// handleCompose concatenates source files, in order, into destination and
// deletes the sources once the result is in place.
func (s *Server) handleCompose(w http.ResponseWriter, r *http.Request) {
	if !allowMethods(w, r, http.MethodPost) {
		return
	}
	var req composeRequest
	if err := json.NewDecoder(http.MaxBytesReader(w, r.Body, 4<<20)).Decode(&req); err != nil {
		writeJSONError(w, http.StatusBadRequest, "invalid JSON body: "+err.Error())
		return
	}
	u, err := s.requestUser(req.Username, r.Header)
	if err != nil {
		writeJSONError(w, http.StatusUnauthorized, err.Error())
		return
	}
	if req.Destination == "" || len(req.SourcePaths) == 0 {
		writeJSONError(w, http.StatusBadRequest, "destination and source_paths are required")
		return
	}
	dst, err := resolvePath(req.Destination, u)
	if err != nil {
		writeJSONError(w, http.StatusBadRequest, err.Error())
		return
	}
	srcs := make([]string, 0, len(req.SourcePaths))
	for _, sp := range req.SourcePaths {
		p, err := resolvePath(sp, u)
		if err != nil {
			writeJSONError(w, http.StatusBadRequest, err.Error())
			return
		}
		fi, err := os.Stat(p)
		switch {
		case errors.Is(err, os.ErrNotExist):
			writeJSONError(w, http.StatusNotFound, "source not found: "+p)
			return
		case err != nil:
			writeJSONError(w, http.StatusBadRequest, err.Error())
			return
		case !fi.Mode().IsRegular():
			writeJSONError(w, http.StatusBadRequest, "source is not a regular file: "+p)
			return
		case !accessOK(fi, u, 4):
			writeJSONError(w, http.StatusForbidden, "permission denied for user "+u.Name+": "+p)
			return
		}
		srcs = append(srcs, p)
	}
	if fi, err := os.Stat(dst); err == nil && fi.IsDir() {
		writeJSONError(w, http.StatusBadRequest, "destination is a directory: "+dst)
		return
	}
	if err := mkdirAllOwned(filepath.Dir(dst), u); err != nil {
		writeJSONError(w, uploadStatus(err), err.Error())
		return
	}
	tmp, err := os.CreateTemp(filepath.Dir(dst), ".compose-*")
	if err != nil {
		writeJSONError(w, uploadStatus(err), err.Error())
		return
	}
	fail := func(err error) {
		_ = tmp.Close()
		_ = os.Remove(tmp.Name())
		writeJSONError(w, uploadStatus(err), err.Error())
	}
	for _, p := range srcs {
		f, err := os.Open(p)
		if err != nil {
			fail(err)
			return
		}
		_, err = io.Copy(tmp, f) // copy_file_range where the kernel allows
		_ = f.Close()
		if err != nil {
			fail(err)
			return
		}
	}
	if err := tmp.Chmod(0o644); err != nil {
		fail(err)
		return
	}
	if err := tmp.Close(); err != nil {
		fail(err)
		return
	}
	chownTo(tmp.Name(), u)
	if err := os.Rename(tmp.Name(), dst); err != nil {
		_ = os.Remove(tmp.Name())
		writeJSONError(w, uploadStatus(err), err.Error())
		return
	}
	for _, p := range srcs {
		if p != dst {
			_ = os.Remove(p)
		}
	}
	writeJSON(w, http.StatusOK, uploadedEntry{Name: filepath.Base(dst), Type: "file", Path: dst})
}
