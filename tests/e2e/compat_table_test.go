package e2e

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"
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
	b, err := os.ReadFile(filepath.Join("..", "..", "docs", "COMPATIBILITY.md"))
	if err != nil {
		t.Fatal(err)
	}
	doc := string(b)
	i := strings.Index(doc, "\n## Routes")
	if i < 0 {
		t.Fatal("docs/COMPATIBILITY.md has no ## Routes section")
	}
	doc = doc[i+1:]
	if j := strings.Index(doc[3:], "\n## "); j >= 0 {
		doc = doc[:j+3]
	}
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
	pkg := strings.TrimSpace(string(out))
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
