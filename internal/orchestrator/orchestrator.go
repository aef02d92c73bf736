// Package orchestrator runs the operations on the sandboxes of one node:
// creating a sandbox from a template (disk overlay, network, QEMU, envd
// handshake), pausing, resuming, snapshotting, forking and killing it with
// full teardown, expiry, and recovery of everything after a restart of the
// node process. Each operation records its progress in the sandbox's record
// (package sandboxes, which owns the records and the state machine) before
// it changes anything.
package orchestrator

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"errors"
	"fmt"
	"github.com/agentenv/agentenv/internal/storage/image"
	"log/slog"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"sync"
	"time"

	"github.com/agentenv/agentenv/internal/admission"
	"github.com/agentenv/agentenv/internal/buildfiles"
	"github.com/agentenv/agentenv/internal/builds"
	"github.com/agentenv/agentenv/internal/datadir"
	"github.com/agentenv/agentenv/internal/diskspace"
	"github.com/agentenv/agentenv/internal/envd"
	"github.com/agentenv/agentenv/internal/errkind"
	"github.com/agentenv/agentenv/internal/events"
	"github.com/agentenv/agentenv/internal/imagecache"
	"github.com/agentenv/agentenv/internal/leases"
	"github.com/agentenv/agentenv/internal/network"
	"github.com/agentenv/agentenv/internal/sandboxes"
	"github.com/agentenv/agentenv/internal/sealed"
	"github.com/agentenv/agentenv/internal/sharing"
	"github.com/agentenv/agentenv/internal/statedb"
	"github.com/agentenv/agentenv/internal/storage/lazy"
	"github.com/agentenv/agentenv/internal/storage/repository"
	"github.com/agentenv/agentenv/internal/store"
	"github.com/agentenv/agentenv/internal/templates"
	"github.com/agentenv/agentenv/internal/vmm"
	"github.com/agentenv/agentenv/internal/warmpool"
)

// Errors callers map to API responses; returned wrapped with context.
var (
	ErrNotFound = errkind.ErrNotFound
	ErrConflict = errkind.ErrConflict
	ErrInvalid  = errkind.ErrInvalid
	ErrCapacity = errkind.ErrCapacity
	ErrSetup    = errkind.ErrSetup
	ErrCorrupt  = errkind.ErrCorrupt
)

// EnvdPort is the port envd listens on inside every guest.
const EnvdPort = 49983

// Config configures a node.
type Config struct {
	DataDir string
	// Kernel and Initrd boot every guest.
	Kernel string
	Initrd string
	// KernelArgs are appended to every guest's kernel command line.
	KernelArgs []string
	// QEMU is the qemu-system-x86_64 binary (empty: the one in PATH),
	// probed at Open (vmm.ProbeQEMU).
	QEMU  string
	Accel vmm.Accel
	// DiffCapture overrides how incremental snapshots and pauses of
	// copy-on-write sandboxes find the changed RAM (empty: what the probed
	// QEMU allows, QEMUInfo.DiffCapture).
	DiffCapture vmm.DiffCapture
	// CopyDisk makes live snapshots copy the disk's overlay even where
	// QEMU can seal it (QEMUInfo.SealsDisks): the baseline of the
	// snapshot benchmark.
	CopyDisk bool
	// NetworkCIDR numbers the sandboxes' veth pairs (network.DefaultCIDR).
	NetworkCIDR string
	// Instance prefixes host object names (network.DefaultInstance); nodes
	// sharing a host need different instances and CIDRs.
	Instance string
	// DNSResolvers are where the guests' resolver (package egressproxy)
	// forwards the names they may reach; none: every query is refused.
	DNSResolvers []netip.AddrPort
	// EgressOpen are default-denied ranges the node opens to every guest
	// as if they were public (network.GuestServices).
	EgressOpen []netip.Prefix
	// BootTimeout bounds a cold boot until envd answers.
	BootTimeout time.Duration
	// OperationTimeout bounds one operation on a sandbox (pause, resume,
	// snapshot, fork, kill, a create after its boot) once it has started:
	// it runs to its end or rolls back whatever the client does meanwhile.
	OperationTimeout time.Duration
	// DefaultTimeout is a sandbox's time to live when the request gives none.
	DefaultTimeout time.Duration
	// MaxTimeout caps any requested time to live.
	MaxTimeout time.Duration
	// Limits for one sandbox.
	MaxVCPUs     int
	MaxMemoryMiB int
	// MaxDiskMiB bounds a sandbox's disk (diskSizeMB; 0: 64 GiB): what a
	// guest writes grows its overlay on the node's disk up to that.
	MaxDiskMiB int
	// ConsoleLogMiB caps each sandbox's console log (and QEMU log) on the
	// node's disk, kept as a ring of its newest bytes (0: 4 MiB).
	ConsoleLogMiB int
	// MinFreeDiskMiB is the free space on the data dir's file system
	// below which the node refuses what would grow it (starts, builds,
	// uploads, snapshots) with 507 (0: 2048; negative: no floor).
	MinFreeDiskMiB int
	// TemplateSnapshots makes the node build a snapshot of every template
	// in the background after it starts, so creates restore instead of
	// cold-booting.
	TemplateSnapshots bool
	// Repository, when set, receives named snapshots (posix_fs or oss).
	Repository repository.Repository
	// PoolSize is how many pre-started sandboxes wait per template
	// snapshot (0: none).
	PoolSize int
	// ForkPoolSize is how many machines wait pre-started for the children
	// of the next fork of a sandbox forked before, per memory base (for
	// the two most recently forked; 0: none). See forkpool.go.
	ForkPoolSize int
	// ForkRestores bounds how many children of one fork restore at once
	// (0: all of them). Under TCG sixteen guests translating the same code
	// on two cores spend more CPU than the same restores a few at a time.
	ForkRestores int
	// TCGTranslationCacheMiB bounds QEMU's TCG translation cache per sandbox.
	TCGTranslationCacheMiB int
	// LayerCacheMiB bounds the local cache of chunks of templates loaded
	// lazily from the repository (default 10 GiB).
	LayerCacheMiB int
	// Peers are neighbour nodes' API URLs, asked for a chunk of a lazily
	// loaded layer before the repository, and PeerToken is the secret the
	// nodes share for it. Both empty: peer exchange off (the default).
	Peers     []string
	PeerToken string
	// NoCgroups runs QEMUs without per-sandbox cgroup limits (on cgroup v1
	// hosts moving a process into its cgroups costs a resume or fork tens
	// of milliseconds; see docs/RELIABILITY.md).
	NoCgroups bool
	// QEMUUIDBase, when set, jails every sandbox's QEMU under ids of its
	// own: the QEMU of the sandbox in network slot s runs as uid and gid
	// QEMUUIDBase+s (no user need exist), so no QEMU can signal another or
	// open what another owns. QEMUUser instead runs every QEMU as one
	// named user (see vmm.Config.User). Neither: QEMU stays root.
	QEMUUIDBase int
	QEMUUser    string
	// RepositorySecret is the secret the nodes sharing Repository share:
	// the tokens written there are sealed with it. Empty: the node's own
	// (repository.secret in the data dir), for a repository no other node
	// reads.
	RepositorySecret []byte
	// SharePaused uploads every paused sandbox to the Repository (which the
	// nodes of a cluster share), so that any node can resume it.
	SharePaused bool
	// NoFreePageReporting turns off the balloon's free page reporting (for
	// measuring what it saves; see vmm.Config).
	NoFreePageReporting bool
	// Volumes lends the node's volumes to the sandboxes that mount them
	// (nil: creates with volume mounts are refused).
	Volumes VolumeLender
	// MaxStarting bounds the sandbox starts (creates, resumes, fork
	// children) running at once (0: two per CPU; negative: no bound).
	MaxStarting int
	// Overcommit is how much guest memory the node admits to its running
	// and starting sandboxes per byte of host memory (0: 1.5; negative:
	// no bound).
	Overcommit float64
	// AdmissionWait is how long a start beyond those limits waits for its
	// turn before it is refused with a capacity error (0: 30 s).
	AdmissionWait time.Duration
	// Events receives the sandboxes' lifecycle events (nil: none sent).
	Events events.Sink
	// HotPausedMiB is the guest memory the stopped QEMUs of paused
	// sandboxes (hot copies, see hotpause.go) may hold at once, the least
	// recently paused demoted past it (0: 2048; negative: no hot pause).
	// HotPausedFor is how long a hot copy stays (0: 10 minutes).
	HotPausedMiB int
	HotPausedFor time.Duration
	// LayerStoreMiB bounds the layer store: past it the images converted
	// for sandboxes made straight from them are evicted, least recently
	// used first (0: no bound).
	LayerStoreMiB int
	// Images says where sandboxes made straight from images may take them
	// from: local sources only under its directories (none by default),
	// registries on private addresses only if it allows them.
	Images image.Policy
	Logger *slog.Logger
}

func (c *Config) setDefaults() {
	if c.BootTimeout == 0 {
		c.BootTimeout = 90 * time.Second
	}
	if c.DefaultTimeout == 0 {
		c.DefaultTimeout = 5 * time.Minute
	}
	if c.OperationTimeout == 0 {
		c.OperationTimeout = 5 * time.Minute
	}
	if c.MaxTimeout == 0 {
		c.MaxTimeout = 24 * time.Hour
	}
	if c.MaxVCPUs == 0 {
		c.MaxVCPUs = max(runtime.NumCPU(), 8)
	}
	if c.MaxMemoryMiB == 0 {
		c.MaxMemoryMiB = 16 << 10
	}
	if c.MaxDiskMiB == 0 {
		c.MaxDiskMiB = 64 << 10
	}
	if c.ConsoleLogMiB == 0 {
		c.ConsoleLogMiB = vmm.DefaultLogCap >> 20
	}
	if c.MinFreeDiskMiB == 0 {
		c.MinFreeDiskMiB = 2048
	}
	if c.Instance == "" {
		c.Instance = network.DefaultInstance
	}
	if c.NetworkCIDR == "" {
		c.NetworkCIDR = network.DefaultCIDR
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.LayerCacheMiB == 0 {
		c.LayerCacheMiB = 10 << 10
	}
	if c.TCGTranslationCacheMiB == 0 {
		c.TCGTranslationCacheMiB = 64
	}
	if c.MaxStarting == 0 {
		c.MaxStarting = 2 * runtime.NumCPU()
	}
	if c.Overcommit == 0 {
		c.Overcommit = 1.5
	}
	if c.AdmissionWait == 0 {
		c.AdmissionWait = 30 * time.Second
	}
	if c.HotPausedMiB == 0 {
		c.HotPausedMiB = 2048
	}
	if c.HotPausedFor <= 0 {
		c.HotPausedFor = 10 * time.Minute
	}
	if abs, err := filepath.Abs(c.DataDir); err == nil {
		c.DataDir = abs // the jail names paths inside it (vmm.Jail)
	}
}

// Node manages the sandboxes on this host.
type Node struct {
	cfg       Config
	lock      *datadir.Lock // this process's claim on cfg.DataDir
	db        *sql.DB
	store     *store.Store
	templates *templates.Catalog
	net       *network.Manager
	log       *slog.Logger

	// initrdSum identifies the initramfs (and so the envd) guests boot with.
	initrdSum string

	records *sandboxes.Records
	// admission bounds the starts (creates, resumes, fork children).
	admission *admission.Controller
	// floor is the free space the node keeps on its data dir's file
	// system: what would grow its use there is refused below it.
	floor diskspace.Floor
	// leases are the client leases sandboxes are bound to.
	leases *leases.Store
	// images are the images converted for sandboxes made from them, and
	// imports the conversions under way.
	images  *imagecache.Cache
	imports imageImports
	// preparing are the template snapshots being prepared.
	preparing templatePreps
	qemu      vmm.QEMUInfo // the probed binary
	machines  machineTable
	hot       *hotPaused // stopped QEMUs of paused sandboxes (hotpause.go)
	ops       opLocks
	pool      *warmpool.Pool[*pooledSandbox]
	// forkPool and forkShapes: machines pre-started for forks (forkpool.go).
	forkPool   *warmpool.Pool[*pooledSandbox]
	forkShapes forkShapes
	builds     *builds.Builds
	files      *buildfiles.Store // COPY archives of template builds
	remote     *templates.Remote // templates of the repository, loaded lazily
	// cgroupWarn says once that sandboxes run without cgroup limits.
	cgroupWarn sync.Once
	// shelf holds the paused sandboxes shared with the cluster's other
	// nodes (nil: not shared), and shareErr says why not although
	// Config.SharePaused asks for it (both set once at start).
	shelf    *sharing.Shelf
	shareErr error
	// tokens seals the tokens the node writes to the repository (nil
	// without one).
	tokens *sealed.Key

	stop      chan struct{}
	closeOnce sync.Once
	wg        sync.WaitGroup
}

// Open starts a node on its data directory: it claims the data dir (a
// second process on it is refused), opens the state database, prepares
// host networking, re-adopts or cleans up what a previous process left,
// and starts the expiry loop.
func Open(ctx context.Context, cfg Config) (*Node, error) {
	cfg.setDefaults()
	for name, p := range map[string]string{"guest kernel": cfg.Kernel, "initramfs": cfg.Initrd} {
		if p == "" {
			return nil, fmt.Errorf("%w: %s path not configured: run `aenv setup`", ErrSetup, name)
		}
		if _, err := os.Stat(p); err != nil {
			return nil, fmt.Errorf("%w: %s %s missing: run `aenv setup --data-dir %s`", ErrSetup, name, p, cfg.DataDir)
		}
	}
	// The QEMU binary decides mechanisms (how QEMU drops privileges), and
	// one too old or without what sandboxes use (the machine, devices, QMP
	// commands, migration capability, the accelerator chosen) is refused
	// before anything changes.
	qemu, err := vmm.ProbeQEMU(ctx, cfg.QEMU)
	if err == nil && cfg.Accel != "" {
		err = qemu.Supports(cfg.Accel)
	}
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrSetup, err)
	}
	cfg.QEMU = qemu.Path
	cfg.Logger.Info("QEMU", "path", qemu.Path, "version", qemu.Version.String(), "accelerators", qemu.Accels, "run-with-user", qemu.RunWithUser(), "ram-diff", qemu.DiffCapture(), "seal-disks", qemu.SealsDisks())
	lock, err := datadir.Acquire(cfg.DataDir, "aenv server")
	if err != nil {
		return nil, err
	}
	n, err := open(ctx, cfg, qemu, lock)
	if err != nil {
		lock.Release()
		return nil, err
	}
	return n, nil
}

func open(ctx context.Context, cfg Config, qemu vmm.QEMUInfo, lock *datadir.Lock) (*Node, error) {
	if err := os.MkdirAll(filepath.Join(cfg.DataDir, "sandboxes"), 0o700); err != nil {
		return nil, fmt.Errorf("create data dir: %w", err)
	}
	netm, err := network.NewManager(cfg.NetworkCIDR, cfg.Instance)
	if err != nil {
		return nil, err
	}
	netm.SetGuestServices(network.GuestServices{Resolvers: cfg.DNSResolvers, Open: cfg.EgressOpen, Log: cfg.Logger})
	if err := netm.EnsureHost(ctx); err != nil {
		return nil, fmt.Errorf("prepare host network: %w", err)
	}
	db, err := statedb.Open(filepath.Join(cfg.DataDir, statedb.FileName))
	if err != nil {
		return nil, err
	}
	fail := func(err error) (*Node, error) {
		db.Close()
		return nil, err
	}
	st, err := store.Open(db, cfg.DataDir, cfg.Logger)
	if err != nil {
		return fail(err)
	}
	n := &Node{
		cfg:       cfg,
		lock:      lock,
		db:        db,
		store:     st,
		templates: templates.NewCatalog(st, cfg.DataDir),
		net:       netm,
		log:       cfg.Logger,
		stop:      make(chan struct{}),
		hot:       newHotPaused(cfg.HotPausedMiB, cfg.HotPausedFor),
		qemu:      qemu,
	}
	n.pool = warmpool.New(cfg.PoolSize, poolStarter{n}, n.log)
	n.forkPool = warmpool.New(cfg.ForkPoolSize, forkStarter{n}, n.log)
	n.floor = diskspace.NewFloor(cfg.DataDir, int64(cfg.MinFreeDiskMiB)<<20)
	if n.admission, err = newAdmission(cfg, n.committedMemory); err != nil {
		return fail(err)
	}
	if n.leases, err = leases.Open(ctx, db); err != nil {
		return fail(err)
	}
	if n.images, err = imagecache.Open(ctx, st, int64(cfg.LayerStoreMiB)<<20, n.log); err != nil {
		return fail(err)
	}
	if n.records, err = sandboxes.Open(db, st, netm.Slots(), n.storeRefs); err != nil {
		return fail(err)
	}
	if n.initrdSum, err = store.FileSHA256(cfg.Initrd); err != nil {
		return fail(err)
	}
	if err := n.templates.AdoptLegacy(ctx, n.log); err != nil {
		return fail(fmt.Errorf("adopt the templates of an older release: %w", err))
	}
	if err := n.adoptLegacySnapshots(ctx); err != nil {
		return fail(fmt.Errorf("adopt the snapshots of an older release: %w", err))
	}
	if cfg.Repository != nil {
		secret := cfg.RepositorySecret
		if len(secret) == 0 {
			if secret, err = sealed.LocalSecret(cfg.DataDir); err != nil {
				return fail(fmt.Errorf("repository secret: %w", err))
			}
		}
		if n.tokens, err = sealed.NewKey(secret, "repository tokens"); err != nil {
			return fail(fmt.Errorf("repository secret: %w", err))
		}
	}
	if cfg.SharePaused && cfg.Repository != nil {
		if n.shelf, n.shareErr = sharing.Open(ctx, cfg.Repository, cfg.Instance, n.tokens); n.shareErr != nil {
			n.log.Error("cluster resume is off", "err", n.shareErr)
		}
	}
	if n.files, err = buildfiles.Open(cfg.DataDir); err != nil {
		return fail(fmt.Errorf("build files: %w", err))
	}
	n.builds = builds.New(builds.Config{DataDir: cfg.DataDir, Files: n.files, Store: st, Catalog: n.templates, Host: buildHost{n}, Log: n.log,
		MaxVCPUs: cfg.MaxVCPUs, MaxMemoryMiB: cfg.MaxMemoryMiB, Images: cfg.Images})
	n.builds.Recover()
	n.remote = templates.NewRemote(n.templates, cfg.Repository, cfg.DataDir, cfg.LayerCacheMiB, cfg.Peers, cfg.PeerToken, n.log)
	n.remote.Reexport(ctx)
	if err := n.recover(ctx); err != nil {
		return fail(fmt.Errorf("recover node state: %w", err))
	}
	n.endInterruptedInternal(ctx)
	n.wg.Add(1)
	go n.expiryLoop()
	buildHost{n}.Go(n.builds.Collect)
	n.wg.Add(1)
	go n.hotExpiryLoop()
	if cfg.TemplateSnapshots {
		n.wg.Add(1)
		go n.prepareTemplateSnapshots()
	}
	if n.sharesPaused() {
		n.wg.Add(1)
		go n.reapMovedLoop()
	}
	return n, nil
}

// Close stops background work. Running sandboxes keep running: a later Open
// re-adopts them.
func (n *Node) Close() error {
	first := false
	n.closeOnce.Do(func() { first = true })
	if !first {
		return nil
	}
	close(n.stop)
	n.wg.Wait()
	n.pool.Close(context.Background())
	n.forkPool.Close(context.Background())
	n.remote.Close()
	n.net.Close() // the guests' resolvers and proxies: a next node attaches again
	// Running QEMUs stay for the next node to re-adopt; hot paused ones
	// are stopped by its recovery (their sandboxes resume from disk).
	for _, m := range append(n.machines.all(), n.hot.machines()...) {
		if q := m.QMP(); q != nil {
			q.Close()
		}
	}
	err := n.db.Close()
	n.lock.Release()
	return err
}

// Accel is the accelerator sandboxes on this node use.
func (n *Node) Accel() vmm.Accel { return n.cfg.Accel }

func (n *Node) sandboxDir(id string) string { return filepath.Join(n.cfg.DataDir, "sandboxes", id) }

// lockOp serializes operations on one sandbox.
func (n *Node) lockOp(id string) func() { return n.ops.lock(id) }

func (n *Node) endpoint(s *sandboxes.Sandbox) (*network.Endpoint, error) {
	return n.net.Endpoint(s.ID, s.Slot, s.AllowInternet, s.Egress)
}

func (n *Node) withAddr(s *sandboxes.Sandbox) *sandboxes.Sandbox {
	if ep, err := n.endpoint(s); err == nil {
		s.EnvdAddr = ep.GuestAddr(EnvdPort)
	}
	s.EnvdVersion = envd.DefaultVersion
	return s
}

// Get returns one sandbox.
func (n *Node) Get(ctx context.Context, id string) (*sandboxes.Sandbox, error) {
	s, err := n.records.Get(ctx, id)
	if err != nil {
		return nil, err
	}
	if s.State == sandboxes.Pooled {
		return nil, fmt.Errorf("%w: sandbox %q", ErrNotFound, id)
	}
	if s.State == sandboxes.Paused {
		if rec, err := readPauseRecord(n.sandboxDir(id)); err == nil {
			s.PauseMode = sandboxes.PauseFull
			if rec.FilesystemOnly {
				s.PauseMode = sandboxes.PauseFilesystem
			}
		}
	}
	return n.withAddr(s), nil
}

// List returns all sandboxes, oldest first.
func (n *Node) List(ctx context.Context) ([]*sandboxes.Sandbox, error) {
	all, err := n.records.List(ctx, "state != ?", sandboxes.Pooled)
	if err != nil {
		return nil, err
	}
	for _, s := range all {
		n.withAddr(s)
	}
	return all, nil
}

// SandboxesOf lists the sandboxes the idempotent request id made that
// are made (not half-made), oldest first: a retry of the request after the
// node's end answers with them.
func (n *Node) SandboxesOf(ctx context.Context, request string) ([]*sandboxes.Sandbox, error) {
	if request == "" {
		return nil, nil
	}
	made, err := n.records.List(ctx, "request = ? AND state NOT IN (?, ?)", request, sandboxes.Pooled, sandboxes.Creating)
	if err != nil {
		return nil, err
	}
	for _, s := range made {
		n.withAddr(s)
	}
	return made, nil
}

// SetTimeout sets a running sandbox's end time to now + d.
func (n *Node) SetTimeout(ctx context.Context, id string, d time.Duration) (*sandboxes.Sandbox, error) {
	if d <= 0 || d > n.cfg.MaxTimeout {
		return nil, fmt.Errorf("%w: timeout must be between 1s and %s", ErrInvalid, n.cfg.MaxTimeout)
	}
	s, err := n.records.Get(ctx, id)
	if err != nil {
		return nil, err
	}
	if s.State != sandboxes.Running {
		return nil, fmt.Errorf("%w: sandbox %s is %s", ErrConflict, id, s.State)
	}
	end := time.Now().Add(d).Truncate(time.Millisecond)
	if err := n.records.Set(ctx, id, "end_at = ?", end.UnixMilli()); err != nil {
		return nil, err
	}
	s.EndAt = end.UTC()
	n.emit(events.Updated, s, map[string]string{"endAt": s.EndAt.Format(time.RFC3339)})
	return n.withAddr(s), nil
}

// stopContext is a context cancelled when the node closes, for background
// work; the caller releases it with cancel.
func (n *Node) stopContext() (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithCancel(context.Background())
	go func() {
		select {
		case <-n.stop:
			cancel()
		case <-ctx.Done():
		}
	}()
	return ctx, cancel
}

// expiryLoop ends sandboxes whose time to live has run out: paused when they
// were created with autoPause (the default), killed otherwise.
func (n *Node) expiryLoop() {
	defer n.wg.Done()
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		select {
		case <-n.stop:
			return
		case <-t.C:
		}
		ctx := context.Background()
		expired, err := n.records.List(ctx, "state = ? AND end_at <= ?", sandboxes.Running, time.Now().UnixMilli())
		if err != nil {
			n.log.Error("expiry scan", "err", err)
			continue
		}
		for _, s := range expired {
			n.log.Info("sandbox expired", "sandbox", s.ID, "end", s.EndAt, "autoPause", s.AutoPause)
			n.endExpired(ctx, s, "timeout")
		}
		n.expireLeases(ctx)
		n.drainForkPool(ctx)
	}
}

// endExpired ends a running sandbox whose time (or lease: reason) ran
// out: paused when it auto-pauses, else killed.
func (n *Node) endExpired(ctx context.Context, s *sandboxes.Sandbox, reason string) {
	n.emit(events.Expired, s, map[string]string{"reason": reason})
	var err error
	switch {
	case s.AutoPause && s.AutoPauseFilesystem:
		// Its file system only; with memory when the guest cannot
		// sync (what it stored is kept either way).
		if _, err = n.PauseFilesystem(ctx, s.ID); err != nil {
			n.log.Warn("pause without memory failed; pausing with memory", "sandbox", s.ID, "err", err)
			_, err = n.Pause(ctx, s.ID)
		}
	case s.AutoPause:
		_, err = n.Pause(ctx, s.ID)
	default:
		err = n.Kill(ctx, s.ID)
	}
	if err != nil && !errors.Is(err, ErrNotFound) && !errors.Is(err, ErrConflict) {
		n.log.Error("end expired sandbox", "sandbox", s.ID, "err", err)
	}
}

// NewSandboxID returns a fresh 20-character [a-z0-9] identifier.
// validSandboxID reports whether id has the form of NewSandboxID's ids.
func validSandboxID(id string) bool {
	if id == "" || len(id) > 64 {
		return false
	}
	for _, c := range id {
		if (c < 'a' || c > 'z') && (c < '0' || c > '9') {
			return false
		}
	}
	return true
}

func NewSandboxID() string {
	const alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
	out := make([]byte, 0, 20)
	buf := make([]byte, 32)
	for len(out) < 20 {
		if _, err := rand.Read(buf); err != nil {
			panic(err)
		}
		for _, c := range buf {
			// 252 = 7*36: rejecting the rest keeps every letter equally likely.
			if c < 252 && len(out) < 20 {
				out = append(out, alphabet[int(c)%len(alphabet)])
			}
		}
	}
	return string(out)
}

func newToken() string {
	b := make([]byte, 24)
	if _, err := rand.Read(b); err != nil {
		panic(err)
	}
	return hex.EncodeToString(b)
}

// PushTemplate stores template name (all its layers) in the node's
// repository.
func (n *Node) PushTemplate(ctx context.Context, name string) error { return n.remote.Push(ctx, name) }

// PeerChunks serves the chunks this node has cached to neighbours that
// present the shared peer token.
func (n *Node) PeerChunks() http.Handler { return n.remote.PeerChunks() }

// LayerCacheStats reports the lazy layer cache's counters.
func (n *Node) LayerCacheStats() lazy.CacheStats { return n.remote.CacheStats() }
