package scheduler

import (
	"context"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"

	pb "github.com/agentenv/agentenv/internal/scheduler/gen/schedulerpb"
	"github.com/agentenv/agentenv/internal/scheduler/gen/schedulerpb/schedulerpbconnect"
)

const token = "e2b_0123456789abcdef"

// clock is a settable time source.
type clock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *clock) now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.t }
func (c *clock) add(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

// start serves a scheduler over loopback HTTP and returns a client.
func start(t *testing.T, c *clock) (*Scheduler, schedulerpbconnect.SchedulerClient) {
	t.Helper()
	s := New(Config{Token: token, Interval: time.Second, Now: c.now, Logger: slog.New(slog.DiscardHandler)})
	mux := http.NewServeMux()
	mux.Handle(s.Handler())
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return s, NewClient(srv.Client(), srv.URL, token)
}

func report(id string, memGiB int64, templates []string, sandboxes ...*pb.SandboxReport) *pb.NodeReport {
	r := &pb.NodeReport{NodeId: id, Url: "http://127.0.0.1:1/" + id, Cpus: 2, MemoryTotalBytes: memGiB << 30,
		MemoryAvailableBytes: memGiB << 30, DiskFreeBytes: 10 << 30, Templates: templates, Sandboxes: sandboxes}
	for _, sb := range sandboxes {
		if sb.State == "running" {
			r.Running++
			r.SandboxMemoryBytes += 512 << 20
		} else {
			r.Paused++
		}
	}
	return r
}

func beat(t *testing.T, c schedulerpbconnect.SchedulerClient, r *pb.NodeReport) {
	t.Helper()
	if _, err := c.Heartbeat(context.Background(), connect.NewRequest(&pb.HeartbeatRequest{Node: r})); err != nil {
		t.Fatal(err)
	}
}

func place(c schedulerpbconnect.SchedulerClient, req *pb.PlaceRequest) (string, error) {
	resp, err := c.Place(context.Background(), connect.NewRequest(req))
	if err != nil {
		return "", err
	}
	return resp.Msg.Node.NodeId, nil
}

func TestGarbageReportsAreRefused(t *testing.T) {
	_, c := start(t, &clock{t: time.Unix(1e9, 0)})
	good := func() *pb.NodeReport { return report("n1", 4, []string{"base"}) }
	for _, tc := range []struct {
		name string
		edit func(r *pb.NodeReport) *pb.NodeReport
	}{
		{"no report", func(*pb.NodeReport) *pb.NodeReport { return nil }},
		{"empty id", func(r *pb.NodeReport) *pb.NodeReport { r.NodeId = ""; return r }},
		{"id with slash", func(r *pb.NodeReport) *pb.NodeReport { r.NodeId = "../n"; return r }},
		{"no url", func(r *pb.NodeReport) *pb.NodeReport { r.Url = ""; return r }},
		{"ftp url", func(r *pb.NodeReport) *pb.NodeReport { r.Url = "ftp://h:1"; return r }},
		{"negative memory", func(r *pb.NodeReport) *pb.NodeReport { r.MemoryAvailableBytes = -1; return r }},
		{"available above total", func(r *pb.NodeReport) *pb.NodeReport { r.MemoryAvailableBytes = r.MemoryTotalBytes + 1; return r }},
		{"no cpus", func(r *pb.NodeReport) *pb.NodeReport { r.Cpus = 0; return r }},
		{"bad sandbox id", func(r *pb.NodeReport) *pb.NodeReport {
			r.Sandboxes = []*pb.SandboxReport{{SandboxId: "A B", State: "running"}}
			return r
		}},
		{"bad state", func(r *pb.NodeReport) *pb.NodeReport {
			r.Sandboxes = []*pb.SandboxReport{{SandboxId: "abc", State: "exploded"}}
			return r
		}},
		{"bad template", func(r *pb.NodeReport) *pb.NodeReport { r.Templates = []string{"a b"}; return r }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := c.Heartbeat(context.Background(), connect.NewRequest(&pb.HeartbeatRequest{Node: tc.edit(good())}))
			if connect.CodeOf(err) != connect.CodeInvalidArgument {
				t.Fatalf("garbage report: %v", err)
			}
		})
	}
	nodes, err := c.ListNodes(context.Background(), connect.NewRequest(&pb.ListNodesRequest{}))
	if err != nil || len(nodes.Msg.Nodes) != 0 {
		t.Fatalf("garbage changed the node list: %v %v", nodes, err)
	}
}

func TestTokenRequired(t *testing.T) {
	s := New(Config{Token: token, Logger: slog.New(slog.DiscardHandler)})
	mux := http.NewServeMux()
	mux.Handle(s.Handler())
	srv := httptest.NewServer(mux)
	defer srv.Close()
	for _, tok := range []string{"", "e2b_wrong"} {
		c := NewClient(srv.Client(), srv.URL, tok)
		_, err := c.ListNodes(context.Background(), connect.NewRequest(&pb.ListNodesRequest{}))
		if connect.CodeOf(err) != connect.CodeUnauthenticated {
			t.Fatalf("token %q: %v", tok, err)
		}
	}
}

func TestPlacement(t *testing.T) {
	clk := &clock{t: time.Unix(1e9, 0)}
	_, c := start(t, clk)
	running := &pb.SandboxReport{SandboxId: "parent1", State: "running", TemplateId: "base"}
	beat(t, c, report("big", 64, nil))
	beat(t, c, report("cached", 8, []string{"base"}, running))
	beat(t, c, report("tiny", 1, []string{"tiny-only"}))

	for _, tc := range []struct {
		name string
		req  *pb.PlaceRequest
		want string
		code connect.Code
	}{
		{"template cached wins over free memory", &pb.PlaceRequest{TemplateId: "base", MemoryBytes: 512 << 20}, "cached", 0},
		{"no node has it: most free memory", &pb.PlaceRequest{TemplateId: "other", MemoryBytes: 512 << 20}, "big", 0},
		{"cached and fits", &pb.PlaceRequest{TemplateId: "tiny-only", MemoryBytes: 512 << 20}, "tiny", 0},
		{"cached but full: next best", &pb.PlaceRequest{TemplateId: "tiny-only", MemoryBytes: 4 << 30}, "big", 0},
		{"excluded node skipped", &pb.PlaceRequest{TemplateId: "base", MemoryBytes: 512 << 20, ExcludeNodes: []string{"cached", "big"}}, "tiny", 0},
		{"fork child beside its parent", &pb.PlaceRequest{TemplateId: "zzz", ParentSandboxId: "parent1"}, "cached", 0},
		{"fork of an unknown parent", &pb.PlaceRequest{ParentSandboxId: "nosuch"}, "", connect.CodeNotFound},
		{"more memory than any node", &pb.PlaceRequest{TemplateId: "base", MemoryBytes: 1 << 40}, "", connect.CodeResourceExhausted},
		{"negative memory", &pb.PlaceRequest{MemoryBytes: -1}, "", connect.CodeInvalidArgument},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := place(c, tc.req)
			if connect.CodeOf(err) != tc.code && !(tc.code == 0 && err == nil) {
				t.Fatalf("code %v (%v), want %v", connect.CodeOf(err), err, tc.code)
			}
			if got != tc.want {
				t.Fatalf("placed on %q, want %q", got, tc.want)
			}
		})
	}
}

// TestReservationsSpreadBursts: placements made between two reports count
// against the node, so a burst fills one node and then goes to the next.
func TestReservationsSpreadBursts(t *testing.T) {
	_, c := start(t, &clock{t: time.Unix(1e9, 0)})
	a, b := report("a", 2, []string{"base"}), report("b", 2, []string{"base"})
	a.MaxSandboxes, b.MaxSandboxes = 3, 3
	beat(t, c, a)
	beat(t, c, b)
	count := map[string]int{}
	for i := 0; i < 6; i++ {
		n, err := place(c, &pb.PlaceRequest{TemplateId: "base", MemoryBytes: 256 << 20})
		if err != nil {
			t.Fatal(err)
		}
		count[n]++
	}
	if count["a"] != 3 || count["b"] != 3 {
		t.Fatalf("burst placed %v", count)
	}
	if _, err := place(c, &pb.PlaceRequest{TemplateId: "base"}); connect.CodeOf(err) != connect.CodeResourceExhausted || !strings.Contains(err.Error(), "limit of 3") {
		t.Fatalf("seventh placement: %v", err)
	}
}

// TestLostNodeAndRestart: a node that stops reporting is lost (its
// sandboxes still located, flagged with the node's status, never placed
// on); a new scheduler knows a node again after its next report.
func TestLostNodeAndRestart(t *testing.T) {
	clk := &clock{t: time.Unix(1e9, 0)}
	_, c := start(t, clk)
	beat(t, c, report("a", 4, nil, &pb.SandboxReport{SandboxId: "s1", State: "running"}))
	r := report("b", 4, nil, &pb.SandboxReport{SandboxId: "s2", State: "paused"})
	r.SharedPaused = []string{"s2"}
	beat(t, c, r)
	clk.add(4 * time.Second)
	beat(t, c, report("a", 4, nil, &pb.SandboxReport{SandboxId: "s1", State: "running"}))
	clk.add(2 * time.Second) // b silent for 6 s > 5 intervals
	loc, err := c.Locate(context.Background(), connect.NewRequest(&pb.LocateRequest{SandboxId: "s2"}))
	if err != nil || loc.Msg.Node.Status != StatusLost || !loc.Msg.Shared || loc.Msg.State != "paused" {
		t.Fatalf("locate on a lost node: %v %v", loc, err)
	}
	for i := 0; i < 3; i++ {
		if n, err := place(c, &pb.PlaceRequest{}); err != nil || n != "a" {
			t.Fatalf("placed on %q: %v", n, err)
		}
	}
	if _, err := place(c, &pb.PlaceRequest{ParentSandboxId: "s2"}); connect.CodeOf(err) != connect.CodeUnavailable {
		t.Fatalf("fork on a lost node: %v", err)
	}
	if _, err := c.Locate(context.Background(), connect.NewRequest(&pb.LocateRequest{SandboxId: "nope"})); connect.CodeOf(err) != connect.CodeNotFound {
		t.Fatalf("unknown sandbox: %v", err)
	}
	// The sandbox resumed elsewhere: the running copy wins over the stale
	// paused record of the lost node.
	beat(t, c, report("a", 4, nil, &pb.SandboxReport{SandboxId: "s1", State: "running"}, &pb.SandboxReport{SandboxId: "s2", State: "running"}))
	loc, err = c.Locate(context.Background(), connect.NewRequest(&pb.LocateRequest{SandboxId: "s2"}))
	if err != nil || loc.Msg.Node.NodeId != "a" || loc.Msg.State != "running" {
		t.Fatalf("locate after resume elsewhere: %v %v", loc, err)
	}

	// Restart: a fresh scheduler is empty until the nodes report again.
	_, c2 := start(t, clk)
	if _, err := c2.Locate(context.Background(), connect.NewRequest(&pb.LocateRequest{SandboxId: "s1"})); connect.CodeOf(err) != connect.CodeNotFound {
		t.Fatalf("a new scheduler knew a sandbox: %v", err)
	}
	beat(t, c2, report("a", 4, nil, &pb.SandboxReport{SandboxId: "s1", State: "running"}))
	if loc, err := c2.Locate(context.Background(), connect.NewRequest(&pb.LocateRequest{SandboxId: "s1"})); err != nil || loc.Msg.Node.NodeId != "a" {
		t.Fatalf("after one report: %v %v", loc, err)
	}
	// A node lost for longer than ForgetAfter is dropped.
	clk.add(2 * time.Hour)
	nodes, _ := c.ListNodes(context.Background(), connect.NewRequest(&pb.ListNodesRequest{}))
	if len(nodes.Msg.Nodes) != 0 {
		t.Fatalf("forgotten nodes still listed: %v", nodes.Msg.Nodes)
	}
}
