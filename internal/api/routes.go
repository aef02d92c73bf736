package api

import (
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"slices"
	"strings"

	"go.yaml.in/yaml/v3"

	"github.com/agentenv/agentenv/internal/apispec"
)

// The server is apispec.ServerInterface: each operation of the OpenAPI
// document is a method of Server, registered on the document's path by
// the generated apispec.HandlerWithOptions, which parses its path, query
// and header parameters as the document declares them. An operation the
// document adds without a method here does not compile.
var _ apispec.ServerInterface = (*Server)(nil)

// routes registers the document's operations, each behind the
// authentication the document requires of it, and the answers for what
// the document does not describe.
func (s *Server) routes() error {
	ops, err := Operations()
	if err != nil {
		return err
	}
	table := &routeTable{mux: s.mux}
	table.wrap = func(pattern string, h http.Handler) (http.Handler, error) {
		op, ok := ops[pattern]
		if !ok {
			return nil, fmt.Errorf("route %s is not an operation of openapi.yml", pattern)
		}
		return s.authenticate(pattern, op.Security, strictQuery(h))
	}
	apispec.HandlerWithOptions(s, apispec.StdHTTPServerOptions{
		BaseRouter:       table,
		ErrorHandlerFunc: parameterError,
	})
	if table.err != nil {
		return table.err
	}
	s.patterns = table.patterns
	// E2B's secrets are placeholders its egress proxy swaps for their
	// values; this node refuses those network rules, so it stores none.
	noSecrets := func(w http.ResponseWriter, r *http.Request) {
		writeError(w, http.StatusNotFound, "secrets are not served by this node: E2B resolves them at sandbox egress through network rules with header transforms, which this node refuses (network.rules); pass values as envVars instead")
	}
	s.mux.HandleFunc("/secrets", noSecrets)
	s.mux.HandleFunc("/secrets/", noSecrets)
	s.mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		writeError(w, http.StatusNotFound, fmt.Sprintf("no route for %s %s", r.Method, r.URL.Path))
	})
	return nil
}

// authenticate wraps h with the check of the document's security
// requirement for the operation (any one of schemes suffices).
func (s *Server) authenticate(pattern string, schemes []string, h http.Handler) (http.Handler, error) {
	switch {
	case len(schemes) == 0:
		return h, nil
	case slices.Contains(schemes, "ApiKeyAuth") || slices.Contains(schemes, "BearerAuth"):
		return s.requireKey(h.ServeHTTP), nil
	case slices.Equal(schemes, []string{"VolumeToken"}):
		return s.requireVolumeToken(h.ServeHTTP), nil
	case slices.Equal(schemes, []string{"NodeToken"}):
		return s.requireNodeToken(h.ServeHTTP), nil
	case slices.Equal(schemes, []string{"PeerToken"}):
		return h, nil // the peer chunk handler checks the token itself
	}
	return nil, fmt.Errorf("%s: no check for security schemes %v", pattern, schemes)
}

// Operation is what the OpenAPI document says of one operation besides
// its parameters and bodies.
type Operation struct {
	// Security names the security schemes of which one is required
	// (none: the operation is open).
	Security []string
	// ServedBy is who serves it when not every node does ("gateway",
	// "peers"; "nodes": each node its own; "cluster": a node to its
	// gateway; x-served-by).
	ServedBy string
}

// Operations are the operations of the node's OpenAPI document, by
// "METHOD /path" as the generated code registers them.
func Operations() (map[string]Operation, error) { return operations(OpenAPISpec) }

func operations(spec []byte) (map[string]Operation, error) {
	var doc struct {
		Security []map[string][]string           `yaml:"security"`
		Paths    map[string]map[string]yaml.Node `yaml:"paths"`
	}
	if err := yaml.Unmarshal(spec, &doc); err != nil {
		return nil, fmt.Errorf("openapi.yml: %w", err)
	}
	names := func(reqs []map[string][]string) []string {
		out := []string{}
		for _, req := range reqs {
			for name := range req {
				out = append(out, name)
			}
		}
		slices.Sort(out)
		return out
	}
	out := map[string]Operation{}
	for path, ops := range doc.Paths {
		for method, node := range ops {
			if method == "parameters" {
				continue
			}
			var op struct {
				Security *[]map[string][]string `yaml:"security"`
				ServedBy string                 `yaml:"x-served-by"`
			}
			if err := node.Decode(&op); err != nil {
				return nil, fmt.Errorf("openapi.yml: %s %s: %w", method, path, err)
			}
			reqs := doc.Security
			if op.Security != nil {
				reqs = *op.Security
			}
			out[strings.ToUpper(method)+" "+path] = Operation{Security: names(reqs), ServedBy: op.ServedBy}
		}
	}
	return out, nil
}

// strictQuery refuses a malformed query string rather than letting the
// parameters in it go missing silently.
func strictQuery(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if _, err := url.ParseQuery(r.URL.RawQuery); err != nil {
			writeError(w, http.StatusBadRequest, fmt.Sprintf("malformed query string: %v", err))
			return
		}
		h.ServeHTTP(w, r)
	})
}

// parameterError answers a parameter the generated code could not parse
// (a missing required one, or one of the wrong type), naming it.
func parameterError(w http.ResponseWriter, r *http.Request, err error) {
	var (
		format   *apispec.InvalidParamFormatError
		required *apispec.RequiredParamError
		header   *apispec.RequiredHeaderError
		many     *apispec.TooManyValuesForParamError
	)
	msg := err.Error()
	switch {
	case errors.As(err, &format):
		msg = fmt.Sprintf("parameter %q is not valid: %v", format.ParamName, format.Err)
	case errors.As(err, &required):
		msg = fmt.Sprintf("query parameter %q is required", required.ParamName)
	case errors.As(err, &header):
		msg = fmt.Sprintf("header %q is required", header.ParamName)
	case errors.As(err, &many):
		msg = fmt.Sprintf("parameter %q is given %d times; it takes one value", many.ParamName, many.Count)
	}
	writeError(w, http.StatusBadRequest, msg)
}

// routeTable is the router the generated code registers the operations
// on (apispec.ServeMux). Go's ServeMux refuses two patterns that match
// some path alike with neither more specific (GET /templates/aliases/{alias}
// and GET /templates/{templateID}/tags both match /templates/aliases/tags):
// the one registered second is served through a pattern of its first
// segment and wildcards, which checks its literal segments itself, so the
// pattern registered first wins where both match (a template named
// "aliases" has its tags route; an alias "tags" cannot be resolved).
type routeTable struct {
	mux      *http.ServeMux
	wrap     func(pattern string, h http.Handler) (http.Handler, error)
	patterns []string
	// general holds the patterns served through a wildcard pattern, by it.
	general map[string]*overlapping
	err     error
}

func (t *routeTable) HandleFunc(pattern string, h func(http.ResponseWriter, *http.Request)) {
	if t.err != nil {
		return
	}
	handler, err := t.wrap(pattern, http.HandlerFunc(h))
	if err != nil {
		t.err = err
		return
	}
	t.patterns = append(t.patterns, pattern)
	if register(t.mux, pattern, handler) == nil {
		return
	}
	// Every segment after the first becomes a wildcard.
	method, path, _ := strings.Cut(pattern, " ")
	segs := strings.Split(strings.TrimPrefix(path, "/"), "/")
	wild := slices.Clone(segs)
	for i := 1; i < len(wild); i++ {
		wild[i] = fmt.Sprintf("{s%d}", i)
	}
	general := method + " /" + strings.Join(wild, "/")
	if t.general == nil {
		t.general = map[string]*overlapping{}
	}
	o := t.general[general]
	if o == nil {
		o = &overlapping{segs: wild}
		if err := register(t.mux, general, o); err != nil {
			t.err = fmt.Errorf("route %s: %w", pattern, err)
			return
		}
		t.general[general] = o
	}
	o.routes = append(o.routes, overlapRoute{segs: segs, h: handler})
}

func (t *routeTable) ServeHTTP(w http.ResponseWriter, r *http.Request) { t.mux.ServeHTTP(w, r) }

// register is mux.Handle, with a conflicting pattern as an error.
func register(mux *http.ServeMux, pattern string, h http.Handler) (err error) {
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("%v", p)
		}
	}()
	mux.Handle(pattern, h)
	return nil
}

// overlapping serves the patterns that share one general pattern (segs),
// in the order they were registered.
type overlapping struct {
	segs   []string
	routes []overlapRoute
}

type overlapRoute struct {
	segs []string // the pattern's segments: literals and {wildcards}
	h    http.Handler
}

func (o *overlapping) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	got := make([]string, len(o.segs))
	for i, seg := range o.segs {
		got[i] = seg
		if strings.HasPrefix(seg, "{") {
			got[i] = r.PathValue(strings.Trim(seg, "{}"))
		}
	}
next:
	for _, rt := range o.routes {
		for i, seg := range rt.segs {
			if !strings.HasPrefix(seg, "{") && got[i] != seg {
				continue next
			}
		}
		for i, seg := range rt.segs {
			if strings.HasPrefix(seg, "{") {
				r.SetPathValue(strings.Trim(seg, "{}"), got[i])
			}
		}
		rt.h.ServeHTTP(w, r)
		return
	}
	writeError(w, http.StatusNotFound, fmt.Sprintf("no route for %s %s", r.Method, r.URL.Path))
}
