//go:build linux

package cli

import (
	"context"
	"errors"
	"fmt"
	"github.com/agentenv/agentenv/internal/storage/image"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/signal"
	"os/user"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	"github.com/agentenv/agentenv/internal/api"
	"github.com/agentenv/agentenv/internal/apikeys"
	"github.com/agentenv/agentenv/internal/guest"
	"github.com/agentenv/agentenv/internal/idempotency"
	"github.com/agentenv/agentenv/internal/network"
	"github.com/agentenv/agentenv/internal/orchestrator"
	"github.com/agentenv/agentenv/internal/proxy"
	"github.com/agentenv/agentenv/internal/statedb"
	"github.com/agentenv/agentenv/internal/storage/repository"
	"github.com/agentenv/agentenv/internal/vmm"
	"github.com/agentenv/agentenv/internal/volumes"
	"github.com/agentenv/agentenv/internal/webhooks"
)

// nodePaths are the derived files under a data dir (the runtime cache: all of
// it can be deleted and rebuilt by `aenv setup`).
type nodePaths struct {
	KernelDir string
	Initrd    string
}

func pathsOf(dataDir string) nodePaths {
	return nodePaths{
		KernelDir: filepath.Join(dataDir, "cache", "kernel"),
		Initrd:    filepath.Join(dataDir, "cache", "initramfs.img"),
	}
}

type serverOptions struct {
	dataDir        string
	listen         string
	domain         string
	networkCIDR    string
	instance       string
	poolSize       int
	forkPoolSize   int
	forkRestores   int
	layerCache     int
	volumeSizeGiB  int
	peers          []string
	peerTokenFile  string
	repository     string
	qemuUser       string
	qemuUIDBase    int
	insecureNoJail bool
	noCgroups      bool
	logLevel       string
	dns            string
	egressOpen     []string
	maxStarting    int
	overcommit     float64
	admissionWait  time.Duration
	// idempotencyWindow is how long the answer of a request with an
	// Idempotency-Key is kept.
	idempotencyWindow time.Duration
	layerStore        int
	maxDiskMiB        int
	consoleLogMiB     int
	minFreeDiskMiB    int
	imageDirs         []string
	privateRegistries bool
	hotPausedMiB      int
	qemu              string
	hotPausedFor      time.Duration
}

func serverCmd() *cobra.Command {
	var o serverOptions
	cmd := &cobra.Command{
		Use:   "server",
		Short: "Run a single-node server: E2B-compatible REST API and sandbox proxy",
		Example: `  aenv server --data-dir /var/lib/aenv --listen 127.0.0.1:8000
  E2B_API_URL=http://127.0.0.1:8000 E2B_SANDBOX_URL=http://127.0.0.1:8000 E2B_API_KEY=e2b_... node app.js   # the key aenv key --rotate printed`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx, stop := signal.NotifyContext(cmd.Context(), os.Interrupt, syscall.SIGTERM)
			defer stop()
			return runServer(ctx, o, nil)
		},
	}
	serverFlags(cmd, &o)
	return cmd
}

// serverFlags are the flags of a node, standalone (server) or in a cluster
// (node).
func serverFlags(cmd *cobra.Command, o *serverOptions) {
	dataDirFlag(cmd, &o.dataDir)
	cmd.Flags().StringVar(&o.listen, "listen", "127.0.0.1:8000", "address of the REST API and sandbox proxy")
	cmd.Flags().StringVar(&o.domain, "domain", "", "sandbox domain for {port}-{sandboxID}.{domain} hosts (empty: any)")
	cmd.Flags().StringVar(&o.networkCIDR, "network-cidr", "", "IPv4 range for sandbox veth pairs (default 10.213.0.0/16)")
	cmd.Flags().StringVar(&o.instance, "instance", "aenv", "prefix of host objects (netns, veth, nftables); nodes sharing a host need distinct ones")
	cmd.Flags().IntVar(&o.poolSize, "pool-size", 2, "pre-started sandboxes kept waiting per template snapshot")
	cmd.Flags().IntVar(&o.forkRestores, "fork-restores", 0, "children of one fork restored at once (0: all)")
	cmd.Flags().IntVar(&o.forkPoolSize, "fork-pool-size", 0, "machines kept pre-started for the children of the next fork of a forked sandbox, per memory base (two most recent); 0: none")
	cmd.Flags().IntVar(&o.layerCache, "layer-cache-mib", 10240, "local cache for chunks of templates run lazily from the repository, in MiB")
	cmd.Flags().IntVar(&o.volumeSizeGiB, "volume-size-gib", volumes.DefaultSize>>30, "size of the filesystem of a new volume, in GiB (sparse: a volume takes the room its files take)")
	cmd.Flags().StringSliceVar(&o.peers, "p2p-peers", nil, "neighbour nodes' API URLs asked for layer chunks before the repository (peer exchange is off unless set, with a token)")
	cmd.Flags().StringVar(&o.peerTokenFile, "p2p-token-file", "", "file holding the secret token the nodes of a peer group share (env AENV_P2P_TOKEN also works)")
	cmd.Flags().StringVar(&o.repository, "repository", "", "snapshot repository: /path, posix_fs:///path or oss://bucket/prefix?endpoint=…&region=… (default: <data-dir>/repository)")
	cmd.Flags().BoolVar(&o.noCgroups, "no-cgroups", false, "run QEMUs without per-sandbox cgroup limits (CPU, memory, tasks): faster resumes and forks on cgroup v1 hosts")
	cmd.Flags().IntVar(&o.qemuUIDBase, "qemu-uid-base", orchestrator.DefaultQEMUUIDBase, "the QEMU of the sandbox in network slot s runs as uid and gid BASE+s (no user need exist); 0: --qemu-user instead")
	cmd.Flags().StringVar(&o.qemuUser, "qemu-user", "", "with --qemu-uid-base 0: the one unprivileged user every QEMU switches to (aenv setup makes aenv-qemu)")
	cmd.Flags().BoolVar(&o.insecureNoJail, "insecure-no-jail", false, "run QEMU as root when its unprivileged user is missing or --qemu-user is \"\" (a guest that escapes QEMU then owns the host)")
	cmd.Flags().StringVar(&o.logLevel, "log-level", "info", "debug, info, warn or error")
	cmd.Flags().StringVar(&o.dns, "dns", "", "nameservers (ip or ip:port, comma-separated) the guests' resolver forwards to; \"none\": guests resolve nothing (default: the host's /etc/resolv.conf)")
	cmd.Flags().StringSliceVar(&o.egressOpen, "egress-open", nil, "private ranges (CIDRs) every guest with internet access may reach, e.g. an internal package mirror (default: none)")
	cmd.Flags().IntVar(&o.maxStarting, "max-starting", 0, "sandbox starts (creates, resumes, fork children) run at once; beyond it they wait their turn (default: 2 per CPU; -1: no limit)")
	cmd.Flags().Float64Var(&o.overcommit, "overcommit", 1.5, "guest memory the running and starting sandboxes may have per byte of host memory; a start beyond it waits its turn (-1: no limit)")
	cmd.Flags().StringArrayVar(&o.imageDirs, "image-dir", nil, "a directory whose OCI layouts and docker archives POST /sandboxes-cold may name (oci-layout:DIR, docker-archive:FILE); repeatable; none by default: no local image sources")
	cmd.Flags().BoolVar(&o.privateRegistries, "allow-private-registries", false, "let POST /sandboxes-cold pull from registries on loopback, link-local and private addresses and the node's own (refused by default)")
	cmd.Flags().IntVar(&o.layerStore, "layer-store-mib", 0, "bound on the layer store in MiB: past it the images converted for sandboxes made from them (POST /sandboxes-cold) are evicted, least recently used first (0: no bound)")
	cmd.Flags().IntVar(&o.maxDiskMiB, "max-disk-mib", 64<<10, "largest disk a sandbox may ask for (diskSizeMB), in MiB: a guest's writes grow its overlay on the node's disk up to its size")
	cmd.Flags().IntVar(&o.consoleLogMiB, "console-log-mib", 4, "cap of each sandbox's console log on the node's disk, in MiB: past it the oldest bytes are dropped")
	cmd.Flags().IntVar(&o.minFreeDiskMiB, "min-free-disk-mib", 2048, "free space on the data dir's file system below which starts, builds, uploads and snapshots are refused with 507, in MiB (-1: no floor)")
	cmd.Flags().DurationVar(&o.idempotencyWindow, "idempotency-window", 24*time.Hour, "how long the answer of a create or fork sent with an Idempotency-Key is kept for its retries")
	cmd.Flags().StringVar(&o.qemu, "qemu", os.Getenv("AENV_QEMU"), "the qemu-system-x86_64 binary sandboxes run in, probed at start (7.2 or newer; env AENV_QEMU; default: the one in PATH)")
	cmd.Flags().IntVar(&o.hotPausedMiB, "hot-paused-mib", 2048, "guest memory the stopped QEMUs of paused sandboxes may hold, for resumes that only continue them (the state is on disk as for any pause); the least recently paused are demoted past it (-1: no hot pause)")
	cmd.Flags().DurationVar(&o.hotPausedFor, "hot-paused-for", 10*time.Minute, "how long a paused sandbox's QEMU stays stopped for a hot resume before it exits")
	cmd.Flags().DurationVar(&o.admissionWait, "admission-wait", 30*time.Second, "how long a start beyond --max-starting or --overcommit waits before it is refused with 429 and Retry-After")
}

// guestDNS reads --dns: the nameservers the guests' resolver forwards to.
func guestDNS(flag string) ([]netip.AddrPort, error) {
	switch flag {
	case "none":
		return nil, nil
	case "":
		return network.ReadResolvConf("/etc/resolv.conf")
	}
	var out []netip.AddrPort
	for _, s := range strings.Split(flag, ",") {
		a, err := network.ParseNameserver(strings.TrimSpace(s))
		if err != nil {
			return nil, fmt.Errorf("--dns: %w", err)
		}
		out = append(out, a)
	}
	return out, nil
}

func runServer(ctx context.Context, o serverOptions, cluster *nodeOptions) error {
	log := newLogger(o.logLevel)
	if os.Geteuid() != 0 {
		return errors.New("aenv server must run as root (it creates network namespaces and tap devices)")
	}
	envKey, hasEnvKey, err := envAPIKey()
	if err != nil {
		return err
	}
	paths := pathsOf(o.dataDir)
	k, err := guest.LoadKernel(paths.KernelDir)
	if err != nil {
		return err
	}
	repoURL := o.repository
	if repoURL == "" {
		repoURL = filepath.Join(o.dataDir, "repository")
	}
	repoCfg, err := repository.ParseURL(repoURL)
	if err != nil {
		return err
	}
	repo, err := repository.Open(repoCfg)
	if err != nil {
		return err
	}
	peerToken, err := loadPeerToken(o.peerTokenFile)
	if err != nil {
		return err
	}
	if peerToken == "" && cluster != nil {
		peerToken = cluster.nodeToken // the nodes' credential serves their peer traffic too
	}
	if len(o.peers) > 0 && peerToken == "" {
		return errors.New("--p2p-peers needs the peer group's token: --p2p-token-file or AENV_P2P_TOKEN")
	}
	qemuUser := o.qemuUser
	switch {
	case o.qemuUIDBase < 0 || o.qemuUIDBase > 1<<31-1<<16:
		return fmt.Errorf("--qemu-uid-base %d: want 0, or a base that leaves room for every slot below 2^31", o.qemuUIDBase)
	case o.qemuUIDBase > 0 && qemuUser != "":
		return errors.New("--qemu-uid-base and --qemu-user exclude each other (set --qemu-uid-base 0 to use one shared user)")
	case o.qemuUIDBase > 0:
	case qemuUser != "":
		if _, err := user.Lookup(qemuUser); err != nil {
			if !o.insecureNoJail {
				return fmt.Errorf("QEMU's unprivileged user %q does not exist: run `aenv setup` (it makes aenv-qemu), or pass --insecure-no-jail to run QEMU as root", qemuUser)
			}
			qemuUser = ""
		}
	case !o.insecureNoJail:
		return errors.New("--qemu-uid-base 0 without --qemu-user runs QEMU as root: pass --insecure-no-jail as well to accept that")
	}
	if o.qemuUIDBase == 0 && qemuUser == "" {
		log.Warn("INSECURE: QEMU runs as root (--insecure-no-jail): a guest that escapes QEMU owns this host")
		fmt.Fprintln(os.Stderr, "aenv server: WARNING: --insecure-no-jail: QEMU runs as root; a guest that escapes QEMU owns this host")
	}
	probe := vmm.ProbeAccel()
	if w := probe.Warning(); w != "" {
		log.Warn(w)
	} else {
		log.Info("accelerator", "accel", probe.Accel, "reason", probe.Reason)
	}
	resolvers, err := guestDNS(o.dns)
	if err != nil {
		return err
	}
	var open []netip.Prefix
	for _, c := range o.egressOpen {
		p, err := netip.ParsePrefix(c)
		if err != nil || !p.Addr().Is4() {
			return fmt.Errorf("--egress-open %q: not an IPv4 CIDR", c)
		}
		open = append(open, p.Masked())
	}
	log.Info("guest DNS", "resolvers", resolvers, "egress_open", open)
	var repoSecret []byte // a single server seals with a secret of its own
	if cluster != nil {
		repoSecret = []byte(cluster.nodeToken) // the nodes share the repository and this
	}
	// The node's database also holds the client API keys (beside its
	// records; `aenv key` manages them through the admin socket while the
	// node runs) and the volumes.
	keysDB, err := statedb.Open(filepath.Join(o.dataDir, statedb.FileName))
	if err != nil {
		return err
	}
	defer keysDB.Close()
	// The volumes (disks in the data dir, owned by the sandboxes' default
	// user), which the node lends to the sandboxes that mount them: open
	// before the node, whose start holds again those its sandboxes have.
	if o.volumeSizeGiB < 1 || int64(o.volumeSizeGiB)<<30 > vmm.SlotCapacity {
		return fmt.Errorf("--volume-size-gib %d: want 1..%d", o.volumeSizeGiB, vmm.SlotCapacity>>30)
	}
	vols, err := volumes.Open(ctx, keysDB, volumes.Config{
		Dir: filepath.Join(o.dataDir, "volumes"), Size: int64(o.volumeSizeGiB) << 30,
		UID: guest.DefaultUID, GID: guest.DefaultUID, Logger: log,
	})
	if err != nil {
		return err
	}
	defer vols.Close()
	hooks, err := webhooks.Open(ctx, keysDB, log)
	if err != nil {
		return err
	}
	deliverCtx, stopDelivering := context.WithCancel(context.WithoutCancel(ctx))
	defer stopDelivering()
	go hooks.Run(deliverCtx, webhooks.DeliverOptions{})
	node, err := orchestrator.Open(ctx, orchestrator.Config{
		DataDir:           o.dataDir,
		Kernel:            k.BootImage(),
		KernelArgs:        k.BootArgs(probe.Accel == vmm.AccelTCG),
		Initrd:            paths.Initrd,
		Accel:             probe.Accel,
		NetworkCIDR:       o.networkCIDR,
		Instance:          o.instance,
		DNSResolvers:      resolvers,
		EgressOpen:        open,
		TemplateSnapshots: true,
		PoolSize:          o.poolSize,
		ForkPoolSize:      o.forkPoolSize,
		ForkRestores:      o.forkRestores,
		LayerCacheMiB:     o.layerCache,
		SharePaused:       cluster != nil && o.repository != "",
		QEMUUIDBase:       o.qemuUIDBase,
		QEMUUser:          qemuUser,
		NoCgroups:         o.noCgroups,
		Peers:             o.peers,
		PeerToken:         peerToken,
		Repository:        repo,
		RepositorySecret:  repoSecret,
		Volumes:           vols,
		MaxStarting:       o.maxStarting,
		Overcommit:        o.overcommit,
		AdmissionWait:     o.admissionWait,
		Events:            hooks,
		LayerStoreMiB:     o.layerStore,
		MaxDiskMiB:        o.maxDiskMiB,
		ConsoleLogMiB:     o.consoleLogMiB,
		MinFreeDiskMiB:    o.minFreeDiskMiB,
		Images:            image.Policy{Dirs: o.imageDirs, PrivateRegistries: o.privateRegistries},
		HotPausedMiB:      o.hotPausedMiB,
		QEMU:              o.qemu,
		HotPausedFor:      o.hotPausedFor,
		Logger:            log,
	})
	if err != nil {
		return err
	}
	defer node.Close()
	keys, err := apikeys.Open(keysDB)
	if err != nil {
		return err
	}
	if err := adoptLegacyKey(ctx, keys, o.dataDir); err != nil {
		return err
	}
	if l, err := keys.List(ctx); err != nil {
		return err
	} else if len(l) == 0 && !hasEnvKey {
		return fmt.Errorf("%w (or set AENV_API_KEY)", apikeys.ErrNoKeys)
	}
	admin, err := apikeys.ListenAdmin(o.dataDir)
	if err != nil {
		return err
	}
	adminSrv := &http.Server{Handler: keys.Handler(log), ReadHeaderTimeout: 10 * time.Second}
	go adminSrv.Serve(admin)
	defer adminSrv.Close()
	px := proxy.New(api.Resolver{Node: node}, o.domain, orchestrator.EnvdPort, log)
	idem, err := idempotency.Open(ctx, keysDB, o.idempotencyWindow)
	if err != nil {
		return err
	}
	acfg := api.Config{Keys: keys, APIKeySHA256: envKey, Domain: o.domain, SandboxProxy: px, PeerChunks: node.PeerChunks(),
		Volumes: vols, Idempotency: idem, Webhooks: hooks, Logger: log}
	if cluster != nil {
		acfg.NodeToken = cluster.nodeToken
	}
	handler, err := api.New(node, acfg)
	if err != nil {
		return err
	}
	ln, err := net.Listen("tcp", o.listen)
	if err != nil {
		return fmt.Errorf("listen on %s: %w", o.listen, err)
	}
	srv := newHTTPServer(handler)
	log.Info("aenv server listening", "addr", ln.Addr().String(), "data_dir", o.dataDir)
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	if cluster != nil {
		go reportNode(ctx, node, cluster, log.Info)
	}
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	log.Info("shutting down; running sandboxes keep running and are re-adopted on the next start")
	sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	return srv.Shutdown(sctx)
}

// newHTTPServer returns a server speaking HTTP/1.1 and cleartext HTTP/2, with
// timeouts that stop slow clients without cutting long streams.
func newHTTPServer(h http.Handler) *http.Server {
	var protos http.Protocols
	protos.SetHTTP1(true)
	protos.SetUnencryptedHTTP2(true)
	return &http.Server{
		Handler:           h,
		Protocols:         &protos,
		ReadHeaderTimeout: 10 * time.Second,
		IdleTimeout:       120 * time.Second,
		MaxHeaderBytes:    64 << 10,
	}
}

// The node is what the API serves.
var _ api.Node = (*orchestrator.Node)(nil)

// loadPeerToken reads the peer group's token from file, else from
// AENV_P2P_TOKEN ("" when neither is set: peer exchange off).
func loadPeerToken(file string) (string, error) {
	if file == "" {
		return os.Getenv("AENV_P2P_TOKEN"), nil
	}
	b, err := os.ReadFile(file)
	if err != nil {
		return "", fmt.Errorf("p2p token: %w", err)
	}
	tok := strings.TrimSpace(string(b))
	if len(tok) < 16 {
		return "", fmt.Errorf("p2p token in %s is shorter than 16 characters", file)
	}
	return tok, nil
}
