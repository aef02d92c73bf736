package api

import (
	"context"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/agentenv/agentenv/internal/orchestrator"
	"github.com/agentenv/agentenv/internal/sandboxes"
	"github.com/agentenv/agentenv/internal/storage/lazy"
)

// memorySource is what the memory collector reads at each scrape of GET
// /metrics (Prometheus text format, same API key as the REST API, as
// X-API-Key or a bearer token).
type memorySource interface {
	Memory(ctx context.Context) (*orchestrator.NodeMemory, error)
}

// memoryCollector reads the node's memory report at each scrape.
type memoryCollector struct {
	node memorySource

	sandboxes, hostTotal, hostAvail         *prometheus.Desc
	guest, rss, pss, anon, sumPSS, sumGuest *prometheus.Desc
	cpu                                     *prometheus.Desc
}

func newMemoryCollector(node memorySource) *memoryCollector {
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
		cpu:       prometheus.NewDesc("aenv_sandbox_cpu_seconds_total", "CPU time (user and system) a sandbox's QEMU process has used.", sb, nil),
	}
}

func (c *memoryCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.sandboxes, c.hostTotal, c.hostAvail, c.guest, c.rss, c.pss, c.anon, c.sumPSS, c.sumGuest, c.cpu} {
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
	for _, st := range []sandboxes.State{sandboxes.Running, sandboxes.Paused} {
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
		ch <- prometheus.MustNewConstMetric(c.cpu, prometheus.CounterValue, s.CPUSeconds, s.ID, s.TemplateID)
		pss += s.PSSBytes
		guest += s.GuestBytes
	}
	gauge(c.sumPSS, pss)
	gauge(c.sumGuest, guest)
}

// layerCacheSource is what the layer cache collector reads: the counters
// of the chunk cache of lazily loaded layers.
type layerCacheSource interface {
	LayerCacheStats() lazy.CacheStats
}

// layerCacheCollector reads the chunk cache's counters at each scrape.
type layerCacheCollector struct {
	node  layerCacheSource
	descs map[string]*prometheus.Desc
}

var layerCacheMetrics = []struct {
	name, help string
	counter    bool
	value      func(lazy.CacheStats) int64
}{
	{"aenv_layer_cache_hits_total", "Chunk reads served from the local layer cache.", true, func(s lazy.CacheStats) int64 { return s.Hits }},
	{"aenv_layer_cache_misses_total", "Chunk reads that had to fetch the chunk.", true, func(s lazy.CacheStats) int64 { return s.Misses }},
	{"aenv_layer_cache_evictions_total", "Chunks dropped from the cache to respect its limit or a full disk.", true, func(s lazy.CacheStats) int64 { return s.Evictions }},
	{"aenv_layer_cache_fetched_bytes_total", "Bytes of chunks fetched (repository and neighbours).", true, func(s lazy.CacheStats) int64 { return s.FetchedBytes }},
	{"aenv_layer_cache_peer_bytes_total", "Bytes of chunks fetched from neighbour nodes.", true, func(s lazy.CacheStats) int64 { return s.PeerBytes }},
	{"aenv_layer_cache_peer_served_bytes_total", "Bytes of chunks this node served to neighbours.", true, func(s lazy.CacheStats) int64 { return s.PeerServedBytes }},
	{"aenv_layer_cache_store_errors_total", "Chunks that could not be kept in the cache (full disk).", true, func(s lazy.CacheStats) int64 { return s.StoreErrors }},
	{"aenv_layer_cache_used_bytes", "Bytes the layer cache holds on disk.", false, func(s lazy.CacheStats) int64 { return s.UsedBytes }},
	{"aenv_layer_cache_limit_bytes", "The layer cache's configured limit.", false, func(s lazy.CacheStats) int64 { return s.LimitBytes }},
}

func newLayerCacheCollector(node layerCacheSource) *layerCacheCollector {
	c := &layerCacheCollector{node: node, descs: map[string]*prometheus.Desc{}}
	for _, m := range layerCacheMetrics {
		c.descs[m.name] = prometheus.NewDesc(m.name, m.help, nil, nil)
	}
	return c
}

func (c *layerCacheCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range c.descs {
		ch <- d
	}
}

func (c *layerCacheCollector) Collect(ch chan<- prometheus.Metric) {
	st := c.node.LayerCacheStats()
	for _, m := range layerCacheMetrics {
		kind := prometheus.GaugeValue
		if m.counter {
			kind = prometheus.CounterValue
		}
		ch <- prometheus.MustNewConstMetric(c.descs[m.name], kind, float64(m.value(st)))
	}
}

// nodeMetrics serves the node's Prometheus metrics, or 501 for nodes that
// do not report memory.
func (s *Server) nodeMetrics() http.Handler {
	reg := prometheus.NewRegistry()
	// The server process itself: goroutines, open files, memory (what a
	// load test checks for leaks).
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	reg.MustRegister(newMemoryCollector(s.node))
	reg.MustRegister(newLayerCacheCollector(s.node))
	return promhttp.HandlerFor(reg, promhttp.HandlerOpts{})
}

// NodeMetrics serves GET /metrics.
func (s *Server) NodeMetrics(w http.ResponseWriter, r *http.Request) { s.metrics.ServeHTTP(w, r) }
