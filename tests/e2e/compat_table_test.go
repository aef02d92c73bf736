package e2e

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"

	"go.yaml.in/yaml/v3"

	"github.com/agentenv/agentenv/internal/api"
)

// TestCompatibilityTableCoversTheSDKs reads every REST route the pinned
// SDKs' generated clients know (Python: the modules of e2b.api.client.api
// and e2b.volume.client.api; JS: the paths of e2b's typed OpenAPI
// interfaces) and fails for each one docs/COMPATIBILITY.md's route table
// does not list, so a new SDK version's routes cannot go unnoticed.
func TestCompatibilityTableCoversTheSDKs(t *testing.T) {
	table := tableRoutes(t)
	sdk := map[string][]string{}
	for r := range pythonSDKRoutes(t) {
		sdk[r] = append(sdk[r], "Python")
	}
	for r := range jsSDKRoutes(t) {
		sdk[r] = append(sdk[r], "JS")
	}
	if len(sdk) < 40 {
		t.Fatalf("only %d routes found in the SDKs: the extraction is broken", len(sdk))
	}
	var missing []string
	for r, from := range sdk {
		if !table[r] {
			missing = append(missing, r+" ("+strings.Join(from, ", ")+")")
		}
	}
	sort.Strings(missing)
	for _, m := range missing {
		t.Errorf("docs/COMPATIBILITY.md does not list %s", m)
	}
	if len(missing) == 0 {
		t.Logf("%d SDK routes, all in the table", len(sdk))
	}
}

var paramRE = regexp.MustCompile(`\{[^}]*\}`)

// normRoute writes a route with its path parameters unnamed.
func normRoute(method, path string) string {
	return strings.ToUpper(method) + " " + paramRE.ReplaceAllString(path, "{}")
}

// tableRoutes are the routes of the "## Routes" table: every backticked
// `METHOD[/METHOD…] /path` in a row's first cell.
func tableRoutes(t *testing.T) map[string]bool {
	t.Helper()
	doc := compatSection(t, "Routes")
	span := regexp.MustCompile("`((?:GET|POST|PUT|PATCH|DELETE)(?:/(?:GET|POST|PUT|PATCH|DELETE))*) (/[^` ]*)`")
	out := map[string]bool{}
	for _, line := range strings.Split(doc, "\n") {
		if !strings.HasPrefix(line, "| ") {
			continue
		}
		first, _, _ := strings.Cut(line[2:], " | ")
		for _, m := range span.FindAllStringSubmatch(first, -1) {
			for _, method := range strings.Split(m[1], "/") {
				out[normRoute(method, m[2])] = true
			}
		}
	}
	return out
}

// pythonSDKRoutes reads the generated client modules of the pinned Python
// SDK (E2B_PYTHON's e2b package).
func pythonSDKRoutes(t *testing.T) map[string]bool {
	t.Helper()
	pkg := pythonSDKPackage(t)
	method := regexp.MustCompile(`"method": "([a-z]+)"`)
	url := regexp.MustCompile(`"url": f?"([^"]+)"`)
	routes := map[string]bool{}
	for _, dir := range []string{"api/client/api", "volume/client/api"} {
		err := filepath.WalkDir(filepath.Join(pkg, dir), func(p string, d os.DirEntry, err error) error {
			if err != nil || d.IsDir() || !strings.HasSuffix(p, ".py") || d.Name() == "__init__.py" {
				return err
			}
			b, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			m, u := method.FindSubmatch(b), url.FindSubmatch(b)
			if m == nil || u == nil {
				t.Errorf("%s: no method or url", p)
				return nil
			}
			routes[normRoute(string(m[1]), string(u[1]))] = true
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	return routes
}

// jsSDKRoutes reads the paths of the typed OpenAPI interfaces in the
// pinned JS SDK's index.d.ts.
func jsSDKRoutes(t *testing.T) map[string]bool {
	t.Helper()
	dir := installSDK(t)
	b, err := os.ReadFile(filepath.Join(dir, "node_modules", "e2b", "dist", "index.d.ts"))
	if err != nil {
		t.Fatal(err)
	}
	s := string(b)
	routes := map[string]bool{}
	pathKey := regexp.MustCompile(`\n  "(/[^"]*)": \{`)
	methodKey := regexp.MustCompile(`\n    (get|put|post|delete|patch)\??: (?:\{|operations)`)
	for _, start := range regexp.MustCompile(`interface paths\w* \{`).FindAllStringIndex(s, -1) {
		block := braced(s, start[1])
		for _, pm := range pathKey.FindAllStringSubmatchIndex(block, -1) {
			path := block[pm[2]:pm[3]]
			for _, mm := range methodKey.FindAllStringSubmatch(braced(block, pm[1]), -1) {
				routes[normRoute(mm[1], path)] = true
			}
		}
	}
	return routes
}

// braced returns s from i (just after an opening brace) to its closing
// brace.
func braced(s string, i int) string {
	depth := 1
	for j := i; j < len(s); j++ {
		switch s[j] {
		case '{':
			depth++
		case '}':
			depth--
			if depth == 0 {
				return s[i:j]
			}
		}
	}
	return s[i:]
}

// TestOpenAPIDocumentsTheSDKFields reads the request bodies the pinned
// Python SDK's generated client sends (each endpoint's body model, its
// fields and those of the models nested in them, two levels down) and
// fails for each field of a route the node serves that internal/api's
// OpenAPI document leaves out: the document, which schemathesis holds the
// server to, says what happens to every field an SDK may send (served,
// or refused with the reason in its description).
func TestOpenAPIDocumentsTheSDKFields(t *testing.T) {
	pkg := pythonSDKPackage(t)
	models := readPythonModels(t, filepath.Join(pkg, "api", "client", "models"))
	doc, docPaths := openAPIDocument(t)
	method := regexp.MustCompile(`"method": "([a-z]+)"`)
	url := regexp.MustCompile(`"url": f?"([^"]+)"`)
	body := regexp.MustCompile(`\bbody: (\w+)`)
	checked := 0
	err := filepath.WalkDir(filepath.Join(pkg, "api", "client", "api"), func(p string, d os.DirEntry, err error) error {
		if err != nil || d.IsDir() || !strings.HasSuffix(p, ".py") {
			return err
		}
		b, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		m, u, bm := method.FindSubmatch(b), url.FindSubmatch(b), body.FindSubmatch(b)
		if m == nil || u == nil || bm == nil {
			return nil
		}
		ops, ok := docPaths[paramRE.ReplaceAllString(string(u[1]), "{}")]
		if !ok {
			return nil // a route the node refuses (the route table says so)
		}
		op, ok := ops[string(m[1])].(map[string]any)
		if !ok {
			return nil
		}
		route := strings.ToUpper(string(m[1])) + " " + string(u[1])
		schema := requestSchema(doc, op)
		if schema == nil {
			t.Errorf("%s: the SDK sends a %s body, the document none", route, bm[1])
			return nil
		}
		for _, f := range models.fields(string(bm[1]), "", 0) {
			checked++
			if !hasField(doc, schema, strings.Split(f, ".")) {
				t.Errorf("%s: the document does not describe field %s (the SDK's %s)", route, f, bm[1])
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if checked < 50 {
		t.Fatalf("only %d fields checked: the extraction is broken", checked)
	}
	t.Logf("%d request fields of the SDK checked", checked)
}

// pythonModels are the generated client's models: the JSON keys each
// reads (from_dict) and the model of the keys holding one.
type pythonModels map[string]struct {
	keys   []string
	nested map[string]string
}

func readPythonModels(t *testing.T, dir string) pythonModels {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(dir, "*.py"))
	if err != nil {
		t.Fatal(err)
	}
	class := regexp.MustCompile(`(?m)^class (\w+)`)
	pop := regexp.MustCompile(`_?(\w+) = d\.pop\("(\w+)"`)
	key := regexp.MustCompile(`d\.pop\("(\w+)"`)
	from := regexp.MustCompile(`(\w+) = (\w+)\.from_dict\(_?(\w+)\)`)
	out := pythonModels{}
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		s := string(b)
		c := class.FindStringSubmatch(s)
		i := strings.Index(s, "def from_dict")
		if c == nil || i < 0 {
			continue
		}
		s = s[i:]
		m := out[c[1]]
		m.nested = map[string]string{}
		byVar := map[string]string{}
		for _, p := range pop.FindAllStringSubmatch(s, -1) {
			byVar[p[1]] = p[2]
		}
		// Every key read, also those read inside a call (a union's parser).
		for _, k := range key.FindAllStringSubmatch(s, -1) {
			m.keys = append(m.keys, k[1])
		}
		for _, n := range from.FindAllStringSubmatch(s, -1) {
			if key, ok := byVar[n[3]]; ok {
				m.nested[key] = n[2]
			}
		}
		out[c[1]] = m
	}
	return out
}

// fields are model's JSON fields, dotted for those of nested models.
func (pm pythonModels) fields(model, prefix string, depth int) []string {
	var out []string
	m := pm[model]
	for _, k := range m.keys {
		out = append(out, prefix+k)
		if n, ok := m.nested[k]; ok && depth < 2 {
			out = append(out, pm.fields(n, prefix+k+".", depth+1)...)
		}
	}
	return out
}

// requestSchema is an operation's JSON request body schema (nil: none).
func requestSchema(doc map[string]any, op map[string]any) map[string]any {
	rb, _ := op["requestBody"].(map[string]any)
	rb = resolve(doc, rb)
	content, _ := rb["content"].(map[string]any)
	js, _ := content["application/json"].(map[string]any)
	s, _ := js["schema"].(map[string]any)
	return resolve(doc, s)
}

// resolve follows a local $ref.
func resolve(doc map[string]any, v map[string]any) map[string]any {
	for v != nil {
		ref, ok := v["$ref"].(string)
		if !ok {
			return v
		}
		var cur any = doc
		for _, part := range strings.Split(strings.TrimPrefix(ref, "#/"), "/") {
			m, _ := cur.(map[string]any)
			cur = m[part]
		}
		v, _ = cur.(map[string]any)
	}
	return v
}

// hasField reports whether schema describes the dotted field path (through
// objects, and the items of arrays).
func hasField(doc map[string]any, schema map[string]any, path []string) bool {
	if len(path) == 0 {
		return true
	}
	schema = resolve(doc, schema)
	if items, ok := schema["items"].(map[string]any); ok {
		schema = resolve(doc, items)
	}
	if parts, ok := schema["allOf"].([]any); ok {
		for _, p := range parts {
			if ps, ok := p.(map[string]any); ok && hasField(doc, ps, path) {
				return true
			}
		}
		return false
	}
	props, _ := schema["properties"].(map[string]any)
	next, ok := props[path[0]].(map[string]any)
	return ok && hasField(doc, next, path[1:])
}

// TestSDKResponseFieldsAreDocumented reads the answers the pinned Python
// SDK's generated client parses (each endpoint's 200/201 model and the
// models nested in it) and fails for each field of a route the node
// serves that the OpenAPI document's answer leaves out, unless
// docs/COMPATIBILITY.md's "Answer fields not sent" section lists it (as
// `Model.field`); a field listed there that the document now describes
// fails too, so the list stays true.
func TestSDKResponseFieldsAreDocumented(t *testing.T) {
	pkg := pythonSDKPackage(t)
	models := readPythonModels(t, filepath.Join(pkg, "api", "client", "models"))
	doc, docPaths := openAPIDocument(t)
	notSent := notSentFields(t)
	method := regexp.MustCompile(`"method": "([a-z]+)"`)
	url := regexp.MustCompile(`"url": f?"([^"]+)"`)
	parsed := regexp.MustCompile(`response_(20[01])(?:_item)? = (\w+)\.from_dict\(`)
	checked, used := 0, map[string]bool{}
	err := filepath.WalkDir(filepath.Join(pkg, "api", "client", "api"), func(p string, d os.DirEntry, err error) error {
		if err != nil || d.IsDir() || !strings.HasSuffix(p, ".py") {
			return err
		}
		b, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		m, u := method.FindSubmatch(b), url.FindSubmatch(b)
		if m == nil || u == nil {
			return nil
		}
		ops, ok := docPaths[paramRE.ReplaceAllString(string(u[1]), "{}")]
		if !ok {
			return nil
		}
		op, ok := ops[string(m[1])].(map[string]any)
		if !ok {
			return nil
		}
		route := strings.ToUpper(string(m[1])) + " " + string(u[1])
		for _, pm := range parsed.FindAllSubmatch(b, -1) {
			status, model := string(pm[1]), string(pm[2])
			schema := responseSchema(doc, op, status)
			if schema == nil {
				t.Errorf("%s: the SDK parses a %s answer (%s) the document does not describe", route, status, model)
				continue
			}
			if items, ok := schema["items"].(map[string]any); ok {
				schema = resolve(doc, items)
			}
			for _, f := range models.fields(model, "", 1) {
				checked++
				key := model + "." + f
				switch documented := hasField(doc, schema, strings.Split(f, ".")); {
				case !documented && !notSent[key]:
					t.Errorf("%s: the document's %s answer lacks %s (list it under \"Answer fields not sent\" if the node does not send it)", route, status, key)
				case documented && notSent[key]:
					t.Errorf("%s: docs/COMPATIBILITY.md lists %s as not sent, but the document describes it", route, key)
				}
				used[key] = true
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	for k := range notSent {
		if !used[k] {
			t.Errorf("docs/COMPATIBILITY.md lists %s as not sent, but no SDK answer of a served route has it", k)
		}
	}
	if checked < 50 {
		t.Fatalf("only %d answer fields checked: the extraction is broken", checked)
	}
	t.Logf("%d answer fields of the SDK checked", checked)
}

// notSentFields are the `Model.field` entries of COMPATIBILITY.md's
// "Answer fields not sent" section.
func notSentFields(t *testing.T) map[string]bool {
	t.Helper()
	doc := compatSection(t, "Answer fields not sent")
	out := map[string]bool{}
	for _, m := range regexp.MustCompile("`([A-Z]\\w*\\.[\\w.]+)`").FindAllStringSubmatch(doc, -1) {
		out[m[1]] = true
	}
	return out
}

// responseSchema is an operation's JSON answer schema for status.
func responseSchema(doc map[string]any, op map[string]any, status string) map[string]any {
	responses, _ := op["responses"].(map[string]any)
	r, _ := responses[status].(map[string]any)
	r = resolve(doc, r)
	content, _ := r["content"].(map[string]any)
	js, _ := content["application/json"].(map[string]any)
	s, _ := js["schema"].(map[string]any)
	return resolve(doc, s)
}

// TestOpenAPIDocumentsTheJSSDKFields is TestOpenAPIDocumentsTheSDKFields
// for the pinned JS SDK: the request body schemas of its typed OpenAPI
// paths (each field, and those of the schemas they name, one level down).
func TestOpenAPIDocumentsTheJSSDKFields(t *testing.T) {
	dir := installSDK(t)
	b, err := os.ReadFile(filepath.Join(dir, "node_modules", "e2b", "dist", "index.d.ts"))
	if err != nil {
		t.Fatal(err)
	}
	s := string(b)
	doc, docPaths := openAPIDocument(t)
	pathKey := regexp.MustCompile(`\n  "(/[^"]*)": \{`)
	methodKey := regexp.MustCompile(`\n    (get|put|post|delete|patch)\??: \{`)
	bodyRef := regexp.MustCompile(`requestBody\??: \{\s*content: \{\s*"application/json": components\["schemas"\]\["(\w+)"\]`)
	checked := 0
	for _, start := range regexp.MustCompile(`interface paths\w* \{`).FindAllStringIndex(s, -1) {
		block := braced(s, start[1])
		for _, pm := range pathKey.FindAllStringSubmatchIndex(block, -1) {
			path := block[pm[2]:pm[3]]
			pathBlock := braced(block, pm[1])
			for _, mm := range methodKey.FindAllStringSubmatchIndex(pathBlock, -1) {
				method := pathBlock[mm[2]:mm[3]]
				br := bodyRef.FindStringSubmatch(braced(pathBlock, mm[1]))
				if br == nil {
					continue
				}
				ops, ok := docPaths[paramRE.ReplaceAllString(path, "{}")]
				if !ok {
					continue
				}
				op, ok := ops[method].(map[string]any)
				if !ok {
					continue
				}
				schema := requestSchema(doc, op)
				route := strings.ToUpper(method) + " " + path
				if schema == nil {
					t.Errorf("%s: the JS SDK sends a %s body, the document none", route, br[1])
					continue
				}
				for _, f := range jsSchemaFields(s, br[1], "", 0) {
					checked++
					if !hasField(doc, schema, strings.Split(f, ".")) {
						t.Errorf("%s: the document does not describe field %s (the JS SDK's %s)", route, f, br[1])
					}
				}
			}
		}
	}
	if checked < 30 {
		t.Fatalf("only %d fields checked: the extraction is broken", checked)
	}
	t.Logf("%d request fields of the JS SDK checked", checked)
}

// jsSchemaFields are the fields of components.schemas[name] in a d.ts,
// dotted for those of the schemas they name (one level down).
func jsSchemaFields(s, name, prefix string, depth int) []string {
	i := strings.Index(s, "\n    "+name+": {")
	if i < 0 {
		return nil
	}
	body := braced(s, i+len("\n    "+name+": {"))
	field := regexp.MustCompile(`\n      (\w+)\??: ([^;\n]*)`)
	ref := regexp.MustCompile(`^components\["schemas"\]\["(\w+)"\]`)
	var out []string
	for _, m := range field.FindAllStringSubmatch(body, -1) {
		out = append(out, prefix+m[1])
		if r := ref.FindStringSubmatch(m[2]); r != nil && depth < 1 {
			out = append(out, jsSchemaFields(s, r[1], prefix+m[1]+".", depth+1)...)
		}
	}
	return out
}

// pythonSDKPackage is the directory of the pinned Python SDK's e2b
// package (E2B_PYTHON's).
func pythonSDKPackage(t *testing.T) string {
	t.Helper()
	python := os.Getenv("E2B_PYTHON")
	if python == "" {
		if os.Getenv("CI") == "true" {
			t.Fatal("E2B_PYTHON is not set: scripts/test installs the pinned Python SDKs and sets it")
		}
		t.Skip("E2B_PYTHON is not set")
	}
	out, err := exec.Command(python, "-c", "import e2b, os; print(os.path.dirname(e2b.__file__))").Output()
	if err != nil {
		t.Fatalf("find the e2b package: %v", err)
	}
	return strings.TrimSpace(string(out))
}

// openAPIDocument is the node's OpenAPI document, and its paths'
// operations by path with the parameters unnamed.
func openAPIDocument(t *testing.T) (map[string]any, map[string]map[string]any) {
	t.Helper()
	var doc map[string]any
	if err := yaml.Unmarshal(api.OpenAPISpec, &doc); err != nil {
		t.Fatal(err)
	}
	paths := map[string]map[string]any{}
	for p, ops := range doc["paths"].(map[string]any) {
		paths[paramRE.ReplaceAllString(p, "{}")] = ops.(map[string]any)
	}
	return doc, paths
}

// compatSection is the text of docs/COMPATIBILITY.md's "## heading"
// section.
func compatSection(t *testing.T, heading string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("..", "..", "docs", "COMPATIBILITY.md"))
	if err != nil {
		t.Fatal(err)
	}
	doc := string(b)
	i := strings.Index(doc, "\n## "+heading+"\n")
	if i < 0 {
		t.Fatalf("docs/COMPATIBILITY.md has no ## %s section", heading)
	}
	doc = doc[i+1:]
	if j := strings.Index(doc[3:], "\n## "); j >= 0 {
		doc = doc[:j+3]
	}
	return doc
}
