package api

import (
	"context"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/agentenv/agentenv/internal/orchestrator"
)

// MemoryReporter is implemented by nodes that report their memory use;
// they serve GET /metrics (Prometheus text format, same API key as the
// REST API, as X-API-Key or a bearer token).
type MemoryReporter interface {
	Memory(ctx context.Context) (*orchestrator.NodeMemory, error)
}

// memoryCollector reads the node's memory report at each scrape.
type memoryCollector struct {
	node MemoryReporter

	sandboxes, hostTotal, hostAvail         *prometheus.Desc
	guest, rss, pss, anon, sumPSS, sumGuest *prometheus.Desc
}

func newMemoryCollector(node MemoryReporter) *memoryCollector {
	sb := []string{"sandbox_id", "template_id"}
	return &memoryCollector{
		node:      node,
		sandboxes: prometheus.NewDesc("aenv_sandboxes", "Sandboxes on this node by state.", []string{"state"}, nil),
		hostTotal: prometheus.NewDesc("aenv_node_memory_total_bytes", "The host's memory.", nil, nil),
		hostAvail: prometheus.NewDesc("aenv_node_memory_available_bytes", "The host's available memory (MemAvailable).", nil, nil),
		sumPSS:    prometheus.NewDesc("aenv_node_sandbox_memory_pss_bytes", "Host memory all running sandboxes use (sum of their QEMU processes' PSS).", nil, nil),
		sumGuest:  prometheus.NewDesc("aenv_node_sandbox_memory_guest_bytes", "Guest RAM promised to all running sandboxes.", nil, nil),
		guest:     prometheus.NewDesc("aenv_sandbox_memory_guest_bytes", "A sandbox's RAM size as its guest sees it.", sb, nil),
		rss:       prometheus.NewDesc("aenv_sandbox_memory_rss_bytes", "Resident memory of a sandbox's QEMU process.", sb, nil),
		pss:       prometheus.NewDesc("aenv_sandbox_memory_pss_bytes", "Proportional memory of a sandbox's QEMU process (shared pages split among their users).", sb, nil),
		anon:      prometheus.NewDesc("aenv_sandbox_memory_anon_bytes", "Private anonymous memory of a sandbox's QEMU process.", sb, nil),
	}
}

func (c *memoryCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.sandboxes, c.hostTotal, c.hostAvail, c.guest, c.rss, c.pss, c.anon, c.sumPSS, c.sumGuest} {
		ch <- d
	}
}

func (c *memoryCollector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	m, err := c.node.Memory(ctx)
	if err != nil {
		ch <- prometheus.NewInvalidMetric(c.hostTotal, err)
		return
	}
	gauge := func(d *prometheus.Desc, v int64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, float64(v), labels...)
	}
	for _, st := range []orchestrator.State{orchestrator.StateRunning, orchestrator.StatePaused} {
		gauge(c.sandboxes, int64(m.States[st]), string(st))
	}
	gauge(c.hostTotal, m.TotalBytes)
	gauge(c.hostAvail, m.AvailableBytes)
	var pss, guest int64
	for _, s := range m.Sandboxes {
		gauge(c.guest, s.GuestBytes, s.ID, s.TemplateID)
		gauge(c.rss, s.RSSBytes, s.ID, s.TemplateID)
		gauge(c.pss, s.PSSBytes, s.ID, s.TemplateID)
		gauge(c.anon, s.AnonBytes, s.ID, s.TemplateID)
		pss += s.PSSBytes
		guest += s.GuestBytes
	}
	gauge(c.sumPSS, pss)
	gauge(c.sumGuest, guest)
}

// nodeMetrics serves the node's Prometheus metrics, or 501 for nodes that
// do not report memory.
func (s *Server) nodeMetrics() http.Handler {
	mr, ok := s.node.(MemoryReporter)
	if !ok {
		return s.requireKey(func(w http.ResponseWriter, r *http.Request) {
			writeError(w, http.StatusNotImplemented, "this node does not report metrics")
		})
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(newMemoryCollector(mr))
	h := promhttp.HandlerFor(reg, promhttp.HandlerOpts{})
	return s.requireKey(h.ServeHTTP)
}
