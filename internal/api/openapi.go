package api

import (
	_ "embed"
	"net/http"
)

// OpenAPISpec is the OpenAPI 3 description of the REST surface, served at
// GET /openapi.yml.
//
//go:embed openapi.yml
var OpenAPISpec []byte

// ServeOpenAPI answers GET /openapi.yml (a node's and the gateway's).
func ServeOpenAPI(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Content-Type", "application/yaml")
	w.Header().Set("Cache-Control", "no-cache")
	_, _ = w.Write(OpenAPISpec)
}
