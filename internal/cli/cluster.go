//go:build linux

package cli

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/signal"
	"regexp"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	"github.com/agentenv/agentenv/internal/api"
	"github.com/agentenv/agentenv/internal/apikeys"
	"github.com/agentenv/agentenv/internal/gateway"
	"github.com/agentenv/agentenv/internal/orchestrator"
	"github.com/agentenv/agentenv/internal/scheduler"
	pb "github.com/agentenv/agentenv/internal/scheduler/gen/schedulerpb"
)

// nodeOptions make a server a cluster node.
type nodeOptions struct {
	key          string // the cluster's API key (AENV_API_KEY)
	nodeToken    string // the cluster's node credential (AENV_NODE_TOKEN)
	scheduler    string
	nodeID       string
	advertise    string
	maxSandboxes int
}

func nodeCmd() *cobra.Command {
	var o serverOptions
	var n nodeOptions
	cmd := &cobra.Command{
		Use:   "node",
		Short: "Run a cluster node: a server that reports to a scheduler and serves the gateway",
		Long: `A node is a server (same flags) that joins a cluster: it reports its capacity, templates and
sandboxes to the scheduler every few seconds, and the gateway routes requests to it. Clients use the
cluster's API key (AENV_API_KEY, or keys made with ` + "`aenv key create`" + `); nodes, the gateway and the scheduler
authenticate to each other with the node credential (AENV_NODE_TOKEN), which no API client has. Paused
sandboxes resume on another node when the nodes share a repository.`,
		Example: `  AENV_API_KEY=e2b_... AENV_NODE_TOKEN=... aenv node --scheduler http://10.0.0.1:9090 --listen 0.0.0.0:8000 \
      --advertise-url http://10.0.0.5:8000 --repository oss://aenv/cluster?endpoint=http://10.0.0.2:7070`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx, stop := signal.NotifyContext(cmd.Context(), os.Interrupt, syscall.SIGTERM)
			defer stop()
			if n.scheduler == "" {
				return errors.New("--scheduler is required (the scheduler's URL, e.g. http://10.0.0.1:9090)")
			}
			if err := n.complete(o.listen); err != nil {
				return err
			}
			key, err := clusterKey()
			if err != nil {
				return err
			}
			if n.nodeToken, err = clusterNodeToken(key); err != nil {
				return err
			}
			n.key = key
			return runServer(ctx, o, &n)
		},
	}
	serverFlags(cmd, &o)
	cmd.Flags().StringVar(&n.scheduler, "scheduler", os.Getenv("AENV_SCHEDULER_URL"), "the scheduler's URL (env AENV_SCHEDULER_URL)")
	cmd.Flags().StringVar(&n.nodeID, "node-id", "", "this node's name in the cluster (default: the host name)")
	cmd.Flags().StringVar(&n.advertise, "advertise-url", "", "URL the gateway and other nodes reach this node's API at (default: http://<listen address>)")
	cmd.Flags().IntVar(&n.maxSandboxes, "max-sandboxes", 0, "running sandboxes this node accepts from the scheduler (0: bounded by memory only)")
	return cmd
}

var nodeIDRE = regexp.MustCompile(`[^a-z0-9._-]+`)

// complete fills in the node id and advertised URL.
func (n *nodeOptions) complete(listen string) error {
	if n.nodeID == "" {
		h, err := os.Hostname()
		if err != nil {
			return err
		}
		n.nodeID = strings.Trim(nodeIDRE.ReplaceAllString(strings.ToLower(h), "-"), "-")
	}
	if n.advertise == "" {
		host, port, err := net.SplitHostPort(listen)
		if err != nil {
			return fmt.Errorf("--listen %q: %w", listen, err)
		}
		if ip := net.ParseIP(host); host == "" || (ip != nil && ip.IsUnspecified()) {
			return fmt.Errorf("listening on all addresses (%s): say where the gateway reaches this node with --advertise-url", listen)
		}
		n.advertise = "http://" + net.JoinHostPort(host, port)
	}
	if u, err := url.Parse(n.advertise); err != nil || u.Host == "" || (u.Scheme != "http" && u.Scheme != "https") {
		return fmt.Errorf("--advertise-url %q: want http(s)://host:port", n.advertise)
	}
	return nil
}

// reportNode runs the node's heartbeats to the scheduler until ctx ends.
func reportNode(ctx context.Context, node *orchestrator.Node, n *nodeOptions, logf func(string, ...any)) {
	client := scheduler.NewClient(&http.Client{Timeout: 10 * time.Second}, n.scheduler, n.nodeToken)
	r := &scheduler.Reporter{Client: client, Report: func(ctx context.Context) (*pb.NodeReport, error) {
		c, err := node.Capacity(ctx)
		if err != nil {
			return nil, err
		}
		rep := &pb.NodeReport{NodeId: n.nodeID, Url: n.advertise, Cpus: int32(c.CPUs), MemoryTotalBytes: c.MemoryTotalBytes,
			MemoryAvailableBytes: c.MemoryAvailableBytes, SandboxMemoryBytes: c.SandboxMemoryBytes, DiskFreeBytes: c.DiskFreeBytes,
			Running: int32(c.Running), Paused: int32(c.Paused), Templates: c.Templates, Version: Version,
			MaxSandboxes: int32(n.maxSandboxes), SharedPaused: c.SharedPaused}
		for _, s := range c.Sandboxes {
			rep.Sandboxes = append(rep.Sandboxes, &pb.SandboxReport{SandboxId: s.ID, State: string(s.State), TemplateId: s.TemplateID})
		}
		return rep, nil
	}}
	logf("reporting to the scheduler", "scheduler", n.scheduler, "node", n.nodeID, "url", n.advertise)
	r.Run(ctx)
}

func schedulerCmd() *cobra.Command {
	var listen, logLevel string
	var interval, lostAfter time.Duration
	cmd := &cobra.Command{
		Use:   "scheduler",
		Short: "Run the cluster scheduler (Connect/gRPC): node heartbeats, placement, sandbox location",
		Long: `The scheduler keeps the latest report of every node in memory and nothing else: restarting it
loses nothing, the nodes report again within one interval. Nodes and the gateway authenticate with the
cluster's node credential (AENV_NODE_TOKEN); the client API key is refused.`,
		Example: `  AENV_NODE_TOKEN=$(cat /etc/aenv/node-token) aenv scheduler --listen :9090`,
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx, stop := signal.NotifyContext(cmd.Context(), os.Interrupt, syscall.SIGTERM)
			defer stop()
			token, err := clusterNodeToken(os.Getenv("AENV_API_KEY"))
			if err != nil {
				return err
			}
			log := newLogger(logLevel)
			s := scheduler.New(scheduler.Config{Token: token, Interval: interval, LostAfter: lostAfter, Logger: log})
			mux := http.NewServeMux()
			mux.Handle(s.Handler())
			mux.HandleFunc("GET /health", func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusOK) })
			return serve(ctx, listen, mux, log.Info, "aenv scheduler listening")
		},
	}
	cmd.Flags().StringVar(&listen, "listen", ":9090", "address of the scheduler's Connect/gRPC service")
	cmd.Flags().DurationVar(&interval, "heartbeat-interval", 2*time.Second, "how often nodes report")
	cmd.Flags().DurationVar(&lostAfter, "lost-after", 10*time.Second, "silence after which a node is lost")
	cmd.Flags().StringVar(&logLevel, "log-level", "info", "debug, info, warn or error")
	return cmd
}

var nodeTokenRE = regexp.MustCompile(`^[A-Za-z0-9._~+/=-]{32,256}$`)

// clusterNodeToken is the cluster's node credential, from AENV_NODE_TOKEN:
// what nodes and gateways present to the scheduler, the gateway to nodes,
// and nodes to each other. It must differ from the client API key, so that
// no API client can register a node or pass for the gateway.
func clusterNodeToken(apiKey string) (string, error) {
	t := os.Getenv("AENV_NODE_TOKEN")
	switch {
	case t == "":
		return "", errors.New("set AENV_NODE_TOKEN to the cluster's node credential (the same on every node, gateway and scheduler, and not the API key; e.g. $(openssl rand -hex 32))")
	case !nodeTokenRE.MatchString(t):
		return "", errors.New("AENV_NODE_TOKEN must be 32-256 characters of [A-Za-z0-9._~+/=-]")
	case t == apiKey:
		return "", errors.New("AENV_NODE_TOKEN must not be the API key: API clients would pass for nodes")
	}
	return t, nil
}

// clusterKey is the API key a cluster shares, from AENV_API_KEY.
func clusterKey() (string, error) {
	k := os.Getenv("AENV_API_KEY")
	if k == "" {
		return "", errors.New("set AENV_API_KEY to the cluster's API key (the same on every node, gateway and scheduler; `aenv key --rotate` makes one)")
	}
	if !apikeys.Pattern.MatchString(k) {
		return "", errors.New("AENV_API_KEY must look like e2b_<hex>")
	}
	return k, nil
}

// serve runs an HTTP server on listen until ctx ends.
func serve(ctx context.Context, listen string, h http.Handler, logf func(string, ...any), msg string) error {
	ln, err := net.Listen("tcp", listen)
	if err != nil {
		return fmt.Errorf("listen on %s: %w", listen, err)
	}
	srv := newHTTPServer(h)
	logf(msg, "addr", ln.Addr().String())
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	return srv.Shutdown(sctx)
}

func gatewayCmd() *cobra.Command {
	var listen, sched, domain, logLevel, keysFile string
	cmd := &cobra.Command{
		Use:   "gateway",
		Short: "Run the cluster gateway: one E2B-compatible endpoint (REST + sandbox proxy) in front of all nodes",
		Long: `The gateway serves the same API as a node. It places new sandboxes through the scheduler, sends
every request about a sandbox to the node that holds it, and gathers lists from all nodes. While the
scheduler is down it keeps routing from what it remembers. Clients use the cluster's API key
(AENV_API_KEY) or a named key of --keys-file (made and revoked with aenv key --file, seen by a
running gateway within a second); the gateway presents the node credential (AENV_NODE_TOKEN) to the
nodes and the scheduler instead.`,
		Example: `  AENV_API_KEY=e2b_... AENV_NODE_TOKEN=... aenv gateway --scheduler http://10.0.0.1:9090 --listen :8080
  E2B_API_URL=http://10.0.0.1:8080 E2B_SANDBOX_URL=http://10.0.0.1:8080 E2B_API_KEY=e2b_... node app.js`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx, stop := signal.NotifyContext(cmd.Context(), os.Interrupt, syscall.SIGTERM)
			defer stop()
			var key string
			if keysFile == "" || os.Getenv("AENV_API_KEY") != "" {
				var err error
				if key, err = clusterKey(); err != nil {
					return err
				}
			}
			token, err := clusterNodeToken(key)
			if err != nil {
				return err
			}
			var keys api.KeyChecker
			if keysFile != "" {
				f := apikeys.OpenFile(keysFile)
				if _, err := f.List(cmd.Context()); err != nil {
					return err
				}
				keys = f
			}
			if sched == "" {
				return errors.New("--scheduler is required (the scheduler's URL, e.g. http://10.0.0.1:9090)")
			}
			log := newLogger(logLevel)
			g := gateway.New(gateway.Config{
				Scheduler: scheduler.NewClient(&http.Client{Timeout: 10 * time.Second}, sched, token),
				APIKey:    key, NodeToken: token, Keys: keys, Domain: domain, Logger: log,
			})
			go g.Run(ctx) // the nodes' webhooks kept the same
			return serve(ctx, listen, g, log.Info, "aenv gateway listening")
		},
	}
	cmd.Flags().StringVar(&listen, "listen", ":8080", "address of the REST API and sandbox proxy")
	cmd.Flags().StringVar(&sched, "scheduler", os.Getenv("AENV_SCHEDULER_URL"), "the scheduler's URL (env AENV_SCHEDULER_URL)")
	cmd.Flags().StringVar(&domain, "domain", "", "sandbox domain for {port}-{sandboxID}.{domain} hosts (empty: any)")
	cmd.Flags().StringVar(&logLevel, "log-level", "info", "debug, info, warn or error")
	cmd.Flags().StringVar(&keysFile, "keys-file", "", "named client keys (aenv key create NAME --file PATH), accepted besides AENV_API_KEY, which becomes optional")
	return cmd
}
