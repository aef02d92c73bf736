package e2e

import (
	"context"

	"connectrpc.com/connect"

	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/agentenv/agentenv/internal/scheduler"
	pb "github.com/agentenv/agentenv/internal/scheduler/gen/schedulerpb"
)

// A cluster on loopback: `aenv scheduler`, `aenv gateway` and three
// `aenv node` processes, each node with its own data dir, host object
// prefix and address range, all sharing one posix_fs repository.

// proc is one aenv process of the cluster.
type proc struct {
	name string
	args []string
	env  []string // added to the environment at start
	url  string
	log  string
	cmd  *exec.Cmd
}

func freeAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

// start runs the process (again, with the same arguments and log) and
// waits for its /health.
func (p *proc) start(t *testing.T, bin string) {
	t.Helper()
	logf, err := os.OpenFile(p.log, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer logf.Close()
	p.cmd = exec.Command(bin, p.args...)
	p.cmd.Env = append(append(os.Environ(), "AENV_API_KEY="+apiKey, "AENV_NODE_TOKEN="+nodeToken), p.env...)
	p.cmd.Stdout, p.cmd.Stderr = logf, logf
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGTERM}
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		resp, err := http.Get(p.url + "/health")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s did not come up: %v\n%s", p.name, err, p.tail())
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// kill stops the process at once (SIGKILL: a crash).
func (p *proc) kill() {
	if p.cmd != nil && p.cmd.Process != nil {
		p.cmd.Process.Kill()
		p.cmd.Wait()
		p.cmd = nil
	}
}

// stop asks the process to stop.
func (p *proc) stop() {
	if p.cmd == nil || p.cmd.Process == nil {
		return
	}
	p.cmd.Process.Signal(syscall.SIGTERM)
	done := make(chan struct{})
	go func() { p.cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(15 * time.Second):
		p.cmd.Process.Kill()
		<-done
	}
	p.cmd = nil
}

func readAll(path string) string {
	b, _ := os.ReadFile(path)
	return string(b)
}

func (p *proc) tail() string {
	b, _ := os.ReadFile(p.log)
	if len(b) > 6000 {
		b = b[len(b)-6000:]
	}
	return string(b)
}

type cluster struct {
	bin   string
	repo  string // the nodes' shared posix_fs repository
	sched *proc
	gw    *proc
	nodes []*proc
}

func (c *cluster) logs() string {
	var b strings.Builder
	for _, p := range append([]*proc{c.sched, c.gw}, c.nodes...) {
		fmt.Fprintf(&b, "--- %s ---\n%s\n", p.name, p.tail())
	}
	return b.String()
}

func startCluster(t *testing.T, bin string) *cluster {
	t.Helper()
	testData := os.Getenv("AENV_TEST_DATA_DIR")
	root := t.TempDir()
	repo := filepath.Join(root, "repository")
	c := &cluster{bin: bin, repo: repo}
	schedAddr := freeAddr(t)
	c.sched = &proc{name: "scheduler", url: "http://" + schedAddr, log: filepath.Join(root, "scheduler.log"),
		args: []string{"scheduler", "--listen", schedAddr, "--heartbeat-interval", "1s", "--lost-after", "4s", "--log-level", "debug"}}
	c.sched.start(t, bin)
	for i := 1; i <= 3; i++ {
		dataDir := filepath.Join(root, fmt.Sprintf("node%d", i))
		if err := prepareDataDir(testData, dataDir, false); err != nil {
			t.Fatal(err)
		}
		addr := freeAddr(t)
		c.nodes = append(c.nodes, &proc{name: fmt.Sprintf("n%d", i), url: "http://" + addr, log: filepath.Join(root, fmt.Sprintf("node%d.log", i)),
			args: []string{"node", "--data-dir", dataDir, "--listen", addr, "--node-id", fmt.Sprintf("n%d", i),
				"--scheduler", c.sched.url, "--dns", "none", "--instance", fmt.Sprintf("cln%d", i), "--network-cidr", fmt.Sprintf("10.218.%d.0/20", 16*i),
				"--pool-size", "0", "--repository", repo, "--log-level", "debug"}})
	}
	for _, n := range c.nodes {
		n.start(t, bin)
	}
	gwAddr := freeAddr(t)
	c.gw = &proc{name: "gateway", url: "http://" + gwAddr, log: filepath.Join(root, "gateway.log"),
		args: []string{"gateway", "--listen", gwAddr, "--scheduler", c.sched.url, "--log-level", "debug"}}
	c.gw.start(t, bin)
	t.Cleanup(func() {
		for _, n := range c.nodes {
			if n.cmd == nil {
				n.start(t, bin) // re-adopts what a killed node left running
			}
			var list []map[string]any
			if err := call(n.url, "GET", "/v2/sandboxes", nil, &list); err == nil {
				for _, sb := range list {
					call(n.url, "DELETE", "/sandboxes/"+sb["sandboxID"].(string), nil, nil)
				}
			}
			n.stop()
		}
		c.gw.stop()
		c.sched.stop()
	})
	return c
}

// call is a REST call with the cluster's key.
func call(base, method, path string, in, out any) error {
	s := &server{url: base}
	return s.rest(context.Background(), method, path, in, out)
}

type nodeInfo struct {
	NodeID    string   `json:"nodeID"`
	Status    string   `json:"status"`
	Running   int      `json:"running"`
	Templates []string `json:"templates"`
}

// waitNodes waits until the gateway lists the nodes with the statuses in
// want (node id → status).
func (c *cluster) waitNodes(t *testing.T, want map[string]string, within time.Duration) {
	t.Helper()
	deadline := time.Now().Add(within)
	var got []nodeInfo
	for {
		got = nil
		err := call(c.gw.url, "GET", "/nodes", nil, &got)
		ok := err == nil && len(got) == len(want)
		for _, n := range got {
			if want[n.NodeID] != n.Status {
				ok = false
			}
		}
		if ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("nodes %+v (%v), want %v\n%s", got, err, want, c.logs())
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// holder returns the node whose own list has sandbox id.
func (c *cluster) holder(t *testing.T, id string) string {
	t.Helper()
	for _, n := range c.nodes {
		if n.cmd == nil {
			continue
		}
		if err := call(n.url, "GET", "/sandboxes/"+id, nil, nil); err == nil {
			return n.name
		}
	}
	return ""
}

func status(err error) int {
	var ae *apiError
	if errors.As(err, &ae) {
		return ae.Status
	}
	if err == nil {
		return 200
	}
	return -1
}

// TestCluster: placement, routing (REST and sandbox traffic), aggregated
// lists with pagination, forks beside their parent, the official SDK
// through the gateway, a scheduler restart and a node loss.
func TestCluster(t *testing.T) {
	s := needServer(t) // builds the binary; its node is not part of the cluster
	c := startCluster(t, s.bin)
	c.waitNodes(t, map[string]string{"n1": "ready", "n2": "ready", "n3": "ready"}, 15*time.Second)
	// Each node boots its templates once at start to snapshot them; wait
	// for that, so creates restore (and a loaded CI machine does not time
	// a cold boot out).
	for _, n := range c.nodes {
		for deadline := time.Now().Add(4 * time.Minute); ; time.Sleep(250 * time.Millisecond) {
			if strings.Contains(readAll(n.log), `msg="template snapshot ready" template=minimal`) {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s never snapshotted template minimal\n%s", n.name, n.tail())
			}
		}
	}

	// Placement: with the template on every node, three creates in a row
	// land on three nodes (the scheduler counts its own placements).
	var ids []string
	where := map[string]string{}
	for i := 0; i < 3; i++ {
		var sb sandbox
		if err := call(c.gw.url, "POST", "/sandboxes", map[string]any{"templateID": "minimal", "timeout": 600}, &sb); err != nil {
			t.Fatalf("create through the gateway: %v\n%s", err, c.logs())
		}
		ids = append(ids, sb.SandboxID)
		where[sb.SandboxID] = c.holder(t, sb.SandboxID)
	}
	if len(map[string]bool{where[ids[0]]: true, where[ids[1]]: true, where[ids[2]]: true}) != 3 {
		t.Fatalf("three creates placed on %v\n%s", where, c.logs())
	}
	t.Logf("placed: %v", where)

	// The node credential is not the API key: a client with the key cannot
	// pass for a node (the scheduler refuses its heartbeats and calls) or
	// for the gateway (nodes refuse it as a node token).
	t.Run("credentials", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		asClient := scheduler.NewClient(http.DefaultClient, c.sched.url, apiKey)
		if _, err := asClient.Heartbeat(ctx, connect.NewRequest(&pb.HeartbeatRequest{Node: &pb.NodeReport{NodeId: "intruder", Url: "http://127.0.0.1:1"}})); connect.CodeOf(err) != connect.CodeUnauthenticated {
			t.Fatalf("a heartbeat with the API key: %v, want unauthenticated", err)
		}
		if _, err := asClient.ListNodes(ctx, connect.NewRequest(&pb.ListNodesRequest{})); connect.CodeOf(err) != connect.CodeUnauthenticated {
			t.Fatalf("listing nodes with the API key: %v, want unauthenticated", err)
		}
		asNode := scheduler.NewClient(http.DefaultClient, c.sched.url, nodeToken)
		resp, err := asNode.ListNodes(ctx, connect.NewRequest(&pb.ListNodesRequest{}))
		if err != nil || len(resp.Msg.Nodes) != 3 {
			t.Fatalf("listing nodes with the node token: %v", err)
		}
		for _, tc := range []struct {
			name, token string
			want        int
		}{
			{"the node token", nodeToken, http.StatusOK},
			{"the API key as a node token", apiKey, http.StatusUnauthorized},
			{"a wrong node token", strings.Repeat("x", 64), http.StatusUnauthorized},
		} {
			req, _ := http.NewRequestWithContext(ctx, "GET", c.nodes[0].url+"/sandboxes", nil)
			req.Header.Set("X-Aenv-Node-Token", tc.token)
			r, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			r.Body.Close()
			if r.StatusCode != tc.want {
				t.Errorf("a node asked with %s: %d, want %d", tc.name, r.StatusCode, tc.want)
			}
		}
	})

	t.Run("routing", func(t *testing.T) {
		for _, id := range ids {
			var d struct {
				SandboxID string `json:"sandboxID"`
				State     string `json:"state"`
			}
			if err := call(c.gw.url, "GET", "/sandboxes/"+id, nil, &d); err != nil || d.SandboxID != id || d.State != "running" {
				t.Fatalf("GET /sandboxes/%s through the gateway: %+v %v", id, d, err)
			}
			// Sandbox traffic: envd's /health through the gateway's proxy.
			req, _ := http.NewRequest("GET", c.gw.url+"/health", nil)
			req.Header.Set("E2b-Sandbox-Id", id)
			req.Header.Set("E2b-Sandbox-Port", fmt.Sprint(envdPort))
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			if resp.StatusCode/100 != 2 {
				t.Fatalf("envd through the gateway: %d", resp.StatusCode)
			}
		}
		for _, tc := range []struct {
			name, method, path string
			want               int
		}{
			{"unknown sandbox", "GET", "/sandboxes/nosuchsandbox0000000", 404},
			{"unknown sandbox timeout", "POST", "/sandboxes/nosuchsandbox0000000/timeout", 404},
			{"bad create body", "POST", "/sandboxes", 400},
		} {
			if got := status(call(c.gw.url, tc.method, tc.path, "{not json", nil)); got != tc.want {
				t.Errorf("%s: %d, want %d", tc.name, got, tc.want)
			}
		}
		req, _ := http.NewRequest("GET", c.gw.url+"/health", nil)
		req.Header.Set("E2b-Sandbox-Id", "nosuchsandbox0000000")
		req.Header.Set("E2b-Sandbox-Port", fmt.Sprint(envdPort))
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		assertJSONError(t, resp, 502)
		r2, _ := http.NewRequest("GET", c.gw.url+"/nodes", nil)
		if resp, err := http.DefaultClient.Do(r2); err != nil || resp.StatusCode != 401 {
			t.Fatalf("GET /nodes without a key: %v %v", resp, err)
		}
	})

	t.Run("pagination", func(t *testing.T) {
		for _, limit := range []int{1, 2} {
			seen := map[string]bool{}
			token := ""
			for page := 0; page < 5; page++ {
				path := fmt.Sprintf("/v2/sandboxes?limit=%d", limit)
				if token != "" {
					path += "&nextToken=" + token
				}
				req, _ := http.NewRequest("GET", c.gw.url+path, nil)
				req.Header.Set("X-API-Key", apiKey)
				resp, err := http.DefaultClient.Do(req)
				if err != nil {
					t.Fatal(err)
				}
				var items []sandbox
				json.NewDecoder(resp.Body).Decode(&items)
				resp.Body.Close()
				if len(items) > limit {
					t.Fatalf("page of %d with limit %d", len(items), limit)
				}
				for _, it := range items {
					if seen[it.SandboxID] {
						t.Fatalf("limit %d: %s listed twice", limit, it.SandboxID)
					}
					seen[it.SandboxID] = true
				}
				token = resp.Header.Get("X-Next-Token")
				if token == "" {
					break
				}
			}
			for _, id := range ids {
				if !seen[id] {
					t.Fatalf("limit %d: %s never listed (%v)", limit, id, seen)
				}
			}
		}
		var v1 []sandbox
		if err := call(c.gw.url, "GET", "/sandboxes", nil, &v1); err != nil || len(v1) < 3 {
			t.Fatalf("GET /sandboxes: %d %v", len(v1), err)
		}
	})

	t.Run("fork stays on the parent's node", func(t *testing.T) {
		parent := ids[0]
		var out []struct {
			Sandbox *sandbox `json:"sandbox"`
		}
		if err := call(c.gw.url, "POST", "/sandboxes/"+parent+"/fork", map[string]any{"count": 2}, &out); err != nil {
			t.Fatalf("fork: %v", err)
		}
		for _, ch := range out {
			if ch.Sandbox == nil {
				t.Fatalf("fork: %+v", out)
			}
			if got := c.holder(t, ch.Sandbox.SandboxID); got != where[parent] {
				t.Fatalf("child %s on %s, parent on %s", ch.Sandbox.SandboxID, got, where[parent])
			}
			// Reachable through the gateway at once (before any report).
			if err := call(c.gw.url, "DELETE", "/sandboxes/"+ch.Sandbox.SandboxID, nil, nil); err != nil {
				t.Fatalf("kill a child through the gateway: %v", err)
			}
		}
	})

	t.Run("official SDK through the gateway", func(t *testing.T) {
		node, err := exec.LookPath("node")
		if err != nil {
			t.Skip("node is not installed")
		}
		sdkDir := installSDK(t)
		for _, f := range []string{"sdk/commands.test.cjs", "sdk/lifecycle.test.cjs"} {
			runSDKFile(t, node, sdkDir, f, c.gw.url, c.logs)
		}
	})

	t.Run("scheduler restart", func(t *testing.T) {
		c.sched.kill()
		// Routing goes on from the gateway's memory; nothing can be placed.
		time.Sleep(11 * time.Second) // past the gateway's route TTL
		for _, id := range ids {
			if err := call(c.gw.url, "GET", "/sandboxes/"+id, nil, nil); err != nil {
				t.Fatalf("routing without a scheduler: %v", err)
			}
		}
		var list []sandbox
		if err := call(c.gw.url, "GET", "/v2/sandboxes", nil, &list); err != nil || len(list) < 3 {
			t.Fatalf("listing without a scheduler: %d %v", len(list), err)
		}
		if got := status(call(c.gw.url, "POST", "/sandboxes", map[string]any{"templateID": "minimal"}, nil)); got != 503 {
			t.Fatalf("create without a scheduler: %d", got)
		}
		start := time.Now()
		c.sched.start(t, c.bin)
		c.waitNodes(t, map[string]string{"n1": "ready", "n2": "ready", "n3": "ready"}, 10*time.Second)
		t.Logf("a restarted scheduler knew all nodes again after %s", time.Since(start).Round(time.Millisecond))
		for _, id := range ids {
			if err := call(c.gw.url, "GET", "/sandboxes/"+id, nil, nil); err != nil {
				t.Fatalf("after the scheduler restart: %v", err)
			}
		}
	})

	t.Run("cross-node resume", func(t *testing.T) {
		gw := &server{url: c.gw.url, logPath: c.gw.log}
		var sb sandbox
		if err := call(c.gw.url, "POST", "/sandboxes", map[string]any{"templateID": "minimal", "timeout": 600}, &sb); err != nil {
			t.Fatal(err)
		}
		// State in RAM (/dev/shm is tmpfs) and on disk.
		if out, code := gw.run(t, &sb, "/bin/sh", "-c", "echo in-ram > /dev/shm/r; echo on-disk > /home/user/d; sync; cat /dev/shm/r /home/user/d"); code != 0 || out != "in-ram\non-disk\n" {
			t.Fatalf("write state: %q %d", out, code)
		}
		home := c.holder(t, sb.SandboxID)
		start := time.Now()
		if err := call(c.gw.url, "POST", "/sandboxes/"+sb.SandboxID+"/pause", nil, nil); err != nil {
			t.Fatalf("pause: %v", err)
		}
		paused := time.Since(start)
		manifest := filepath.Join(c.repo, "paused", sb.SandboxID, "manifest.json")
		for deadline := time.Now().Add(2 * time.Minute); ; time.Sleep(100 * time.Millisecond) {
			if _, err := os.Stat(manifest); err == nil {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("the paused sandbox never reached shared storage\n%s", c.logs())
			}
		}
		t.Logf("paused on %s in %s, in shared storage after %s", home, paused.Round(time.Millisecond), time.Since(start).Round(time.Millisecond))
		for _, kind := range []string{"paused", "ram"} {
			filepath.WalkDir(filepath.Join(c.repo, kind), func(p string, d os.DirEntry, err error) error {
				if err == nil && !d.IsDir() {
					if info, err := d.Info(); err == nil {
						st := info.Sys().(*syscall.Stat_t)
						t.Logf("repository %s: %s %.1f MB (%.1f MB allocated)", kind, strings.TrimPrefix(p, c.repo), float64(info.Size())/1e6, float64(st.Blocks*512)/1e6)
					}
				}
				return nil
			})
		}
		var homeNode *proc
		for _, n := range c.nodes {
			if n.name == home {
				homeNode = n
			}
		}
		homeNode.kill()
		want := map[string]string{"n1": "ready", "n2": "ready", "n3": "ready"}
		want[home] = "lost"
		c.waitNodes(t, want, 10*time.Second)
		time.Sleep(11 * time.Second) // past the gateway's route TTL
		start = time.Now()
		// As the SDKs' Sandbox.connect does it (it answered 404 from the
		// other node while only /resume took from shared storage).
		if err := call(c.gw.url, "POST", "/v2/sandboxes/"+sb.SandboxID+"/connect", map[string]any{"timeout": 600}, nil); err != nil {
			t.Fatalf("connect to a paused sandbox of a lost node: %v\n%s", err, c.logs())
		}
		t.Logf("resumed on another node in %s", time.Since(start).Round(time.Millisecond))
		if now := c.holder(t, sb.SandboxID); now == home || now == "" {
			t.Fatalf("resumed on %q (was on %s)", now, home)
		}
		if out, code := gw.run(t, &sb, "/bin/sh", "-c", "cat /dev/shm/r /home/user/d"); code != 0 || out != "in-ram\non-disk\n" {
			t.Fatalf("state after the move: %q %d", out, code)
		}
		// The old node comes back and drops its stale copy.
		homeNode.start(t, c.bin)
		c.waitNodes(t, map[string]string{"n1": "ready", "n2": "ready", "n3": "ready"}, 10*time.Second)
		for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(500 * time.Millisecond) {
			if status(call(homeNode.url, "GET", "/sandboxes/"+sb.SandboxID, nil, nil)) == 404 {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("the old node kept its copy of the moved sandbox\n%s", homeNode.tail())
			}
		}
		if err := call(c.gw.url, "GET", "/sandboxes/"+sb.SandboxID, nil, nil); err != nil {
			t.Fatalf("the moved sandbox through the gateway: %v", err)
		}
		if err := call(c.gw.url, "DELETE", "/sandboxes/"+sb.SandboxID, nil, nil); err != nil {
			t.Fatal(err)
		}
	})

	t.Run("node loss", func(t *testing.T) {
		var lostNode *proc
		var lostID string
		for _, id := range ids {
			for _, n := range c.nodes {
				if n.name == where[id] && n.name != where[ids[0]] {
					lostNode, lostID = n, id
				}
			}
		}
		lostNode.kill()
		start := time.Now()
		want := map[string]string{"n1": "ready", "n2": "ready", "n3": "ready"}
		want[lostNode.name] = "lost"
		c.waitNodes(t, want, 10*time.Second)
		t.Logf("node %s reported lost %s after it died", lostNode.name, time.Since(start).Round(time.Millisecond))
		time.Sleep(11 * time.Second) // past the gateway's route TTL
		err := call(c.gw.url, "GET", "/sandboxes/"+lostID, nil, nil)
		if status(err) != 503 || !strings.Contains(err.Error(), "lost") {
			t.Fatalf("a running sandbox of a lost node: %v", err)
		}
		var list []sandbox
		if err := call(c.gw.url, "GET", "/v2/sandboxes", nil, &list); err != nil {
			t.Fatalf("listing with a lost node: %v", err)
		}
		// The node comes back and re-adopts its sandbox.
		lostNode.start(t, c.bin)
		c.waitNodes(t, map[string]string{"n1": "ready", "n2": "ready", "n3": "ready"}, 10*time.Second)
		if err := call(c.gw.url, "GET", "/sandboxes/"+lostID, nil, nil); err != nil {
			t.Fatalf("after the node came back: %v", err)
		}
	})
}
