// Package apispec owns the Go types of the node's REST API, generated from
// its OpenAPI document (internal/api/openapi.yml) by oapi-codegen: the
// bodies the node, the gateway and the aenv client exchange are these
// types, so that what they send is what the document says.
// TestGeneratedFromTheDocument fails when the document changed and the
// types were not generated again (go generate ./internal/apispec).
package apispec

//go:generate go run github.com/oapi-codegen/oapi-codegen/v2/cmd/oapi-codegen@v2.8.2 -config oapi-codegen.yaml ../api/openapi.yml
