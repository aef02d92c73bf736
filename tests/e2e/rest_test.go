package e2e

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestRESTBadInputRealNode sends malformed requests to a real node: each is
// refused with a 4xx {code,message} and no sandbox (record, directory, VM)
// is created or changed.
func TestRESTBadInputRealNode(t *testing.T) {
	s := needServer(t)
	sb := s.createSandbox(t, map[string]any{"templateID": "minimal", "timeout": 600})
	ctx := context.Background()
	detail := func() map[string]any {
		var d map[string]any
		if err := s.rest(ctx, "GET", "/sandboxes/"+sb.SandboxID, nil, &d); err != nil {
			t.Fatal(err)
		}
		return d
	}
	countDirs := func() int { // users' sandboxes; the pool refills in the background
		entries, _ := os.ReadDir(filepath.Join(s.dataDir, "sandboxes"))
		n := 0
		for _, e := range entries {
			if strings.HasPrefix(e.Name(), ".") {
				continue // being made
			}
			if _, err := os.Stat(filepath.Join(s.dataDir, "sandboxes", e.Name(), "pooled")); err != nil {
				n++
			}
		}
		return n
	}
	before, dirsBefore := detail(), countDirs()
	var listBefore []map[string]any
	_ = s.rest(ctx, "GET", "/v2/sandboxes", nil, &listBefore)
	id := sb.SandboxID
	for _, tc := range []struct {
		name, method, path, body string
		status                   int
	}{
		{"malformed JSON", "POST", "/v2/sandboxes", `{"templateID":"minimal"`, 400},
		{"wrong type", "POST", "/v2/sandboxes", `{"templateID":["minimal"]}`, 400},
		{"typed unknown-to-us field of wrong type", "POST", "/v2/sandboxes", `{"templateID":"minimal","network":42}`, 400},
		{"negative timeout", "POST", "/v2/sandboxes", `{"templateID":"minimal","timeout":-10}`, 400},
		{"huge timeout", "POST", "/v2/sandboxes", `{"templateID":"minimal","timeout":864000000}`, 400},
		{"metadata too large", "POST", "/v2/sandboxes", `{"templateID":"minimal","metadata":{"k":"` + strings.Repeat("v", 17000) + `"}}`, 400},
		{"template path traversal", "POST", "/v2/sandboxes", `{"templateID":"../minimal"}`, 400},
		{"unknown template", "POST", "/v2/sandboxes", `{"templateID":"no-such-template"}`, 404},
		{"too much memory", "POST", "/v2/sandboxes", `{"templateID":"minimal","memoryMB":1000000}`, 400},
		{"invalid sandbox id", "GET", "/sandboxes/NOT-VALID!", ``, 400},
		{"unknown sandbox", "DELETE", "/sandboxes/abcdefghij0123456789", ``, 404},
		{"timeout wrong type", "POST", "/sandboxes/" + id + "/timeout", `{"timeout":"1"}`, 400},
		{"timeout negative", "POST", "/sandboxes/" + id + "/timeout", `{"timeout":-1}`, 400},
		{"timeout huge", "POST", "/sandboxes/" + id + "/timeout", `{"timeout":1e12}`, 400},
		{"refresh malformed", "POST", "/sandboxes/" + id + "/refreshes", `{"duration":}`, 400},
		{"pause memory wrong type", "POST", "/sandboxes/" + id + "/pause", `{"memory":"no"}`, 400},
		{"resume a running sandbox", "POST", "/sandboxes/" + id + "/resume", `{}`, 409},
		{"fork too many", "POST", "/sandboxes/" + id + "/fork", `{"count":17}`, 400},
		{"fork wrong type", "POST", "/sandboxes/" + id + "/fork", `{"count":"2"}`, 400},
		{"snapshot name traversal", "POST", "/sandboxes/" + id + "/snapshots", `{"name":"../etc"}`, 400},
		{"snapshot named like a template", "POST", "/sandboxes/" + id + "/snapshots", `{"name":"minimal"}`, 409},
		{"snapshot name wrong type", "POST", "/sandboxes/" + id + "/snapshots", `{"name":7}`, 400},
		{"delete unknown snapshot", "DELETE", "/snapshots/nope", ``, 404},
		{"list bad limit", "GET", "/v2/sandboxes?limit=-1", ``, 400},
		{"list bad token", "GET", "/v2/sandboxes?nextToken=garbage!", ``, 400},
		{"files without sandbox", "GET", "/files?path=../../../../etc/shadow", ``, 404},
		{"files with forged signature", "GET", "/files?path=/etc/shadow&signature=v1_abc", ``, 401},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := s.rest(ctx, tc.method, tc.path, tc.body, nil)
			var ae *apiError
			if !errors.As(err, &ae) {
				t.Fatalf("want HTTP %d, got %v", tc.status, err)
			}
			var e struct {
				Code    int    `json:"code"`
				Message string `json:"message"`
			}
			if ae.Status != tc.status || json.Unmarshal([]byte(ae.Body), &e) != nil || e.Code != tc.status || e.Message == "" {
				t.Fatalf("got %v, want %d with {code,message}", err, tc.status)
			}
		})
	}
	after := detail()
	if after["endAt"] != before["endAt"] || after["state"] != "running" {
		t.Fatalf("sandbox changed: %v -> %v", before, after)
	}
	var listAfter []map[string]any
	_ = s.rest(ctx, "GET", "/v2/sandboxes", nil, &listAfter)
	if len(listAfter) != len(listBefore) || countDirs() != dirsBefore {
		t.Fatalf("sandboxes %d -> %d, dirs %d -> %d", len(listBefore), len(listAfter), dirsBefore, countDirs())
	}
}

// TestLogsAndMetricsRealNode reads a real guest's console log and metrics.
func TestLogsAndMetricsRealNode(t *testing.T) {
	s := needServer(t)
	sb := s.createSandbox(t, map[string]any{"templateID": "minimal"})
	ctx := context.Background()
	var metrics []map[string]any
	if err := s.rest(ctx, "GET", "/sandboxes/"+sb.SandboxID+"/metrics", nil, &metrics); err != nil {
		t.Fatal(err)
	}
	if len(metrics) != 1 || metrics[0]["memTotal"].(float64) <= 0 || metrics[0]["cpuCount"].(float64) < 1 {
		t.Fatalf("metrics %v", metrics)
	}
	// Several at once: a running sandbox's, and none for one that is not.
	var many struct {
		Sandboxes map[string]map[string]any `json:"sandboxes"`
	}
	if err := s.rest(ctx, "GET", "/sandboxes/metrics?sandbox_ids="+sb.SandboxID+",nosuchsandbox00000000", nil, &many); err != nil {
		t.Fatal(err)
	}
	if m := many.Sandboxes[sb.SandboxID]; len(many.Sandboxes) != 1 || m == nil || m["memTotal"].(float64) <= 0 {
		t.Fatalf("GET /sandboxes/metrics: %v", many.Sandboxes)
	}
	req, _ := http.NewRequest("GET", s.url+"/sandboxes/"+sb.SandboxID+"/logs?limit=5000", nil)
	req.Header.Set("X-API-Key", apiKey)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode == http.StatusNotImplemented {
		t.Skipf("the orchestrator does not implement api.ConsoleLogReader yet: %s", body)
	}
	var logs struct {
		Logs []struct {
			Line string `json:"line"`
		} `json:"logs"`
	}
	if resp.StatusCode != 200 || json.Unmarshal(body, &logs) != nil || len(logs.Logs) == 0 {
		t.Fatalf("logs: %d %.500s", resp.StatusCode, body)
	}
	t.Logf("%d console lines; first %q", len(logs.Logs), logs.Logs[0].Line)
}

// TestNodeMetricsRealNode scrapes the node's Prometheus metrics: memory of
// the host and of each running sandbox's QEMU, sandboxes by state; the key
// is required.
func TestNodeMetricsRealNode(t *testing.T) {
	s := needServer(t)
	sb := s.createSandbox(t, map[string]any{"templateID": "minimal"})
	get := func(key string) (int, string) {
		req, _ := http.NewRequest("GET", s.url+"/metrics", nil)
		if key != "" {
			req.Header.Set("Authorization", "Bearer "+key)
		}
		req.Close = true
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	if code, _ := get(""); code != http.StatusUnauthorized {
		t.Fatalf("metrics without a key: %d", code)
	}
	code, body := get(apiKey)
	if code != 200 {
		t.Fatalf("metrics: %d %.300s", code, body)
	}
	for _, want := range []string{
		`aenv_sandbox_memory_pss_bytes{sandbox_id="` + sb.SandboxID + `",template_id="minimal"}`,
		`aenv_sandbox_memory_guest_bytes{sandbox_id="` + sb.SandboxID + `",template_id="minimal"} 2.68435456e+08`,
		`aenv_sandboxes{state="running"}`,
		"aenv_node_memory_available_bytes ",
		"aenv_node_sandbox_memory_pss_bytes ",
		"aenv_layer_cache_limit_bytes ",
		"aenv_layer_cache_hits_total ",
	} {
		if !strings.Contains(body, want) {
			t.Errorf("metrics lack %q", want)
		}
	}
}
