package orchestrator

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"github.com/agentenv/agentenv/internal/idempotency"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/agentenv/agentenv/internal/faults"
	"github.com/agentenv/agentenv/internal/leases"
	"github.com/agentenv/agentenv/internal/network"
	"github.com/agentenv/agentenv/internal/operation"
	"github.com/agentenv/agentenv/internal/sandboxes"
	"github.com/agentenv/agentenv/internal/sharing"
	"github.com/agentenv/agentenv/internal/storage"
	"github.com/agentenv/agentenv/internal/vmm"
)

// CreateRequest asks for a new sandbox.
type CreateRequest struct {
	TemplateID string
	VCPUs      int // 0: the template's default
	MemoryMiB  int // 0: the template's default
	DiskMiB    int // 0: the template's disk size
	Timeout    time.Duration
	AutoPause  bool
	// AutoPauseFilesystem: the pause at the end of its time keeps only its
	// file system.
	AutoPauseFilesystem bool
	AutoResume          bool
	// PrivateTraffic requires the sandbox's traffic token on ports other
	// than envd's (E2B's allowPublicTraffic: false).
	PrivateTraffic bool
	// MaskRequestHost is the Host header the guest's ports other than
	// envd's see (see sandboxes.Sandbox).
	MaskRequestHost string
	Secure          bool
	// AllowInternet nil means allowed (or, for a named snapshot, as the
	// snapshotted sandbox was).
	AllowInternet *bool
	// Egress, when set, opens and closes ranges beyond AllowInternet's
	// default; nil means none (or the named snapshot's).
	Egress   *network.Egress
	Metadata map[string]string
	EnvVars  map[string]string
	// Volumes are mounted in the sandbox, each in a slot of its machine.
	Volumes []VolumeMount
	// Lease, when set, binds the sandbox to a client lease.
	Lease *LeaseRequest
	// noSnapshot forces a cold boot even when a template snapshot exists.
	noSnapshot bool
	// template, when set, is booted instead of the template TemplateID
	// names (template builds boot unregistered layers).
	template *Template
}

// Files of a sandbox's directory.
const (
	overlayName = "overlay.qcow2"
	memFileName = "memory"
)

func (n *Node) validate(req *CreateRequest, t *Template) error {
	if req.VCPUs == 0 {
		req.VCPUs = t.VCPUs
	}
	if req.MemoryMiB == 0 {
		req.MemoryMiB = t.MemoryMiB
	}
	if req.VCPUs < 1 || req.VCPUs > n.cfg.MaxVCPUs {
		return fmt.Errorf("%w: cpuCount %d is outside 1..%d", ErrInvalid, req.VCPUs, n.cfg.MaxVCPUs)
	}
	if req.MemoryMiB < 128 || req.MemoryMiB > n.cfg.MaxMemoryMiB {
		return fmt.Errorf("%w: memoryMB %d is outside 128..%d", ErrInvalid, req.MemoryMiB, n.cfg.MaxMemoryMiB)
	}
	if req.DiskMiB < 0 || req.DiskMiB > n.cfg.MaxDiskMiB {
		return fmt.Errorf("%w: diskSizeMB %d is outside 0..%d (this node's limit)", ErrInvalid, req.DiskMiB, n.cfg.MaxDiskMiB)
	}
	if req.Timeout == 0 {
		req.Timeout = n.cfg.DefaultTimeout
	}
	if req.Timeout < 0 || req.Timeout > n.cfg.MaxTimeout {
		return fmt.Errorf("%w: timeout must be between 1s and %s", ErrInvalid, n.cfg.MaxTimeout)
	}
	return nil
}

// Create makes a new sandbox from a template (restoring its template
// snapshot, taking a pre-started one from the pool, or cold-booting) or
// from a named snapshot, and waits until its envd answers. Once the
// request is checked the create runs to its end whatever the caller does;
// on failure nothing of it is left behind.
func (n *Node) create(ctx context.Context, req CreateRequest) (*sandboxes.Sandbox, error) {
	t, err := req.template, error(nil)
	if t == nil {
		t, err = n.Template(req.TemplateID)
	}
	var named *NamedSnapshot
	if errors.Is(err, ErrNotFound) {
		// Not a template: maybe a named snapshot, whose size is fixed.
		ns, nerr := n.lookupSnapshot(ctx, req.TemplateID)
		if nerr != nil && !errors.Is(nerr, ErrNotFound) {
			err = nerr
		}
		if nerr == nil {
			named, err = ns, nil
			t = &Template{Name: ns.Name, VCPUs: ns.VCPUs, MemoryMiB: ns.MemoryMiB, DiskMiB: ns.DiskMiB, DefaultUser: ns.DefaultUser,
				DefaultWorkdir: ns.DefaultWorkdir}
			if ns.FilesystemOnly {
				// Booted from the snapshot's disk: any size will do.
				t.RootDisk = filepath.Join(n.snapshotDir(ns.SnapshotID), snapDiskName)
			} else if (req.VCPUs != 0 && req.VCPUs != ns.VCPUs) || (req.MemoryMiB != 0 && req.MemoryMiB != ns.MemoryMiB) {
				return nil, fmt.Errorf("%w: snapshot %s has %d vCPUs and %d MiB; its size cannot change", ErrInvalid, ns.Name, ns.VCPUs, ns.MemoryMiB)
			}
		}
	}
	if errors.Is(err, ErrNotFound) && req.template == nil && n.cfg.Repository != nil {
		// Neither a local template nor a snapshot: maybe a template in the
		// repository, which this node then loads lazily.
		if lt, lerr := n.remote.Pull(ctx, req.TemplateID); lerr == nil {
			t, err = lt, nil
		} else if !errors.Is(lerr, ErrNotFound) {
			err = lerr
		}
	}
	if err != nil {
		return nil, err
	}
	if err := n.validate(&req, t); err != nil {
		return nil, err
	}
	internet, egress := true, network.Egress{}
	if named != nil && req.AllowInternet == nil && req.Egress == nil {
		internet, egress = !named.NoInternet, named.Egress
	}
	if req.AllowInternet != nil {
		internet = *req.AllowInternet
	}
	if req.Egress != nil {
		egress = *req.Egress
	}
	now := time.Now().UTC().Truncate(time.Millisecond) // the precision stored
	s := &sandboxes.Sandbox{
		ID:         NewSandboxID(),
		TemplateID: t.Name,
		State:      sandboxes.Creating,
		// None until the record takes one: a create refused before that
		// must not tear down the network of the sandbox in slot 0.
		Slot:                -1,
		VCPUs:               req.VCPUs,
		MemoryMiB:           req.MemoryMiB,
		DiskMiB:             max(req.DiskMiB, t.DiskMiB),
		AllowInternet:       internet,
		Egress:              egress,
		Secure:              req.Secure,
		AutoPause:           req.AutoPause,
		AutoPauseFilesystem: req.AutoPause && req.AutoPauseFilesystem,
		AutoResume:          req.AutoResume,
		PublicTraffic:       !req.PrivateTraffic,
		MaskRequestHost:     req.MaskRequestHost,
		TrafficToken:        newToken(),
		DefaultUser:         t.DefaultUser,
		DefaultWorkdir:      t.DefaultWorkdir,
		Metadata:            req.Metadata,
		EnvVars:             mergeEnv(t.EnvVars, req.EnvVars),
		Lease:               leaseID(req.Lease),
		Request:             idempotency.RequestOf(ctx),
		CreatedAt:           now,
		StartedAt:           now,
		EndAt:               now.Add(req.Timeout),
	}
	if req.Secure {
		s.AccessToken = newToken()
	}
	var ts *templateSnapshot
	tsErr := errors.New("named snapshot")
	if named == nil {
		ts, tsErr = n.currentTemplateSnapshot(t)
		if tsErr != nil && t.StartCmd != "" && !req.noSnapshot && req.template == nil {
			// Its snapshot is being prepared: restoring it once ready
			// beats a cold boot that runs the slow start command again
			// beside the preparation (waited on the caller's context:
			// nothing has changed yet).
			if done := n.preparing.underWay(t.Name); done != nil {
				select {
				case <-done:
				case <-ctx.Done():
					return nil, ctx.Err()
				}
				ts, tsErr = n.currentTemplateSnapshot(t)
			}
		}
	}
	fromTemplateSnapshot := named == nil && !req.noSnapshot && tsErr == nil &&
		ts.VCPUs == s.VCPUs && ts.MemoryMiB == s.MemoryMiB && s.DiskMiB == t.DiskMiB
	switch {
	case named != nil:
		// Copies of its volumes: its memory has them mounted, or (a
		// filesystem snapshot, booted in a new machine) it mounts them.
		s.SnapshotID, s.VolumeSlots = named.SnapshotID, named.VolumeSlots
		if named.FilesystemOnly {
			s.VolumeSlots = VolumeSlots
		}
		s.Volumes = slices.Clone(named.Volumes)
	case fromTemplateSnapshot:
		s.SnapshotID, s.VolumeSlots = ts.SnapshotID, ts.VolumeSlots
	default:
		s.BaseLayer, s.VolumeSlots = t.Layer, VolumeSlots
	}
	if err := n.validateMounts(req.Volumes, s.VolumeSlots, s.Volumes); err != nil {
		return nil, err
	}
	if req.Lease != nil {
		if _, err := leases.Check(req.Lease.ID, req.Lease.TTL); err != nil {
			return nil, err
		}
	}
	// Its turn within the node's limits, waited for on the caller's
	// context: nothing has changed yet.
	ticket, err := n.admit(ctx, "a create", 1, s.MemoryMiB)
	if err != nil {
		return nil, err
	}
	defer ticket.Done()

	o := operation.Start(ctx, "create", n.cfg.BootTimeout+n.cfg.OperationTimeout, n.log)
	// A pre-started sandbox of the template snapshot, if one waits, becomes
	// this sandbox: it keeps its id and network slot, takes everything else.
	var pooled *pooledSandbox
	if fromTemplateSnapshot && len(req.Volumes) == 0 { // a pooled machine's slots are empty
		if p, ok := n.pool.Take(poolKey(t, ts), s.VCPUs, s.MemoryMiB); ok {
			pooled = p
			s.ID, s.Slot, s.PID = pooled.s.ID, pooled.s.Slot, pooled.s.PID
		}
		defer n.pool.Refill(poolKey(t, ts))
	}
	unlock := n.lockOp(s.ID)
	defer unlock()
	// Record first, then act: a crash from here on leaves a row that
	// recovery cleans up; a failure, a sandbox that goes again.
	o.OnFailure("remove the new sandbox", func(ctx context.Context) error {
		if os.Getenv("AENV_DEBUG_KEEP_FAILED") != "" {
			n.log.Warn("AENV_DEBUG_KEEP_FAILED set: leaving the failed sandbox in place", "dir", n.sandboxDir(s.ID))
			return nil
		}
		n.destroy(ctx, s)
		return nil
	})
	// The lease is taken (made, or renewed) before the record binds the
	// sandbox to it; a create that fails leaves it renewed, which is what
	// its client asked anyway.
	if req.Lease != nil {
		if err := o.Do("take lease", func(ctx context.Context) error {
			_, err := n.leases.Take(ctx, req.Lease.ID, req.Lease.TTL)
			return err
		}); err != nil {
			return nil, o.Finish(err)
		}
	}
	// Borrowed before the record holds them; the removal on failure gives
	// back what was borrowed.
	if err := o.Do("lend volumes", func(ctx context.Context) error { return n.lendVolumes(ctx, s, req.Volumes) }); err != nil {
		return nil, o.Finish(err)
	}
	if err := o.Do("record", func(ctx context.Context) error {
		if pooled != nil {
			if err := n.records.Move(ctx, s.ID, sandboxes.Pooled, sandboxes.Creating, ""); err != nil {
				return err
			}
			return n.records.Save(ctx, s)
		}
		return n.records.InsertNew(ctx, s)
	}); err != nil {
		if pooled != nil {
			n.destroy(context.WithoutCancel(ctx), pooled.s)
		}
		return nil, o.Finish(err)
	}
	faults.Point(faults.CreateRecorded)
	how := "cold boot"
	switch {
	case pooled != nil:
		how = "pre-started template snapshot"
		err = o.Do("claim-pooled", func(ctx context.Context) error { return n.claimPooled(ctx, s) })
	case named != nil && named.FilesystemOnly:
		how = "filesystem snapshot " + named.Name
		err = o.Do("boot", func(ctx context.Context) error { return n.boot(ctx, s, t) })
	case named != nil:
		how = "snapshot " + named.Name
		// The sandbox maps the snapshot's RAM image copy-on-write, sharing
		// its page cache with every other sandbox made from it.
		err = o.Do("restore", func(ctx context.Context) error {
			if err := n.runOnSnapshot(ctx, s, named.SnapshotID); err != nil {
				return err
			}
			return n.restoreFromSnapshot(ctx, s, named.SnapshotID, named.AccessToken, true)
		})
	case fromTemplateSnapshot:
		how = "template snapshot"
		err = o.Do("restore", func(ctx context.Context) error { return n.restoreTemplate(ctx, s, ts, "") })
	default:
		err = o.Do("boot", func(ctx context.Context) error { return n.boot(ctx, s, t) })
		if err == nil && t.StartCmd != "" && !req.noSnapshot {
			// Its template snapshot has the start command running; a
			// sandbox booted cold (another size, or no snapshot yet)
			// starts it itself.
			err = o.Do("start command", func(ctx context.Context) error { return n.startAndWaitReady(ctx, n.withAddr(s), t) })
		}
	}
	if err != nil {
		n.log.Warn("create failed, cleaning up", "sandbox", s.ID, "err", err)
		return nil, o.Finish(err)
	}
	if err := o.Do("mount volumes", func(ctx context.Context) error { return n.mountVolumes(ctx, s) }); err != nil {
		return nil, o.Finish(err)
	}
	faults.Point(faults.CreateStarted)
	if err := o.Do("commit", func(ctx context.Context) error {
		return n.records.Move(ctx, s.ID, sandboxes.Creating, sandboxes.Running, "")
	}); err != nil {
		return nil, o.Finish(err)
	}
	o.Finish(nil)
	s.State = sandboxes.Running
	n.log.Info("sandbox created", "sandbox", s.ID, "template", t.Name, "from", how, "took", o.Elapsed().Round(time.Millisecond))
	return n.withAddr(s), nil
}

// leaseID is the id of the lease a create binds to ("": none).
func leaseID(l *LeaseRequest) string {
	if l == nil {
		return ""
	}
	return l.ID
}

func (n *Node) boot(ctx context.Context, s *sandboxes.Sandbox, t *Template) error {
	dir := n.sandboxDir(s.ID)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("create sandbox dir: %w", err)
	}
	phase := s.PhaseTimer()
	overlay := filepath.Join(dir, overlayName)
	if err := storage.CreateOverlay(ctx, t.RootDisk, overlay, s.DiskMiB); err != nil {
		return err
	}
	if err := n.volumeOverlays(ctx, s, s.SnapshotID); err != nil { // a filesystem snapshot's copies
		return err
	}
	phase("disk overlay")
	ep, err := n.endpoint(s)
	if err != nil {
		return err
	}
	if err := n.net.Setup(ctx, ep); err != nil {
		return err
	}
	tap, err := n.net.OpenTap(ep, network.GuestKnows) // a boot: the guest asks for its gateway
	if err != nil {
		return err
	}
	defer tap.Close() // QEMU holds its own copy
	phase("network")
	m, err := vmm.Start(ctx, n.vmConfig(s, tap, false))
	if err != nil {
		return err
	}
	n.adopt(s.ID, m)
	if err := n.records.Set(ctx, s.ID, "pid = ?", m.PID()); err != nil {
		return err
	}
	s.PID = m.PID()
	phase("qemu start")
	bctx, cancel := context.WithTimeout(ctx, n.cfg.BootTimeout)
	defer cancel()
	addr := ep.GuestAddr(EnvdPort)
	if err := waitEnvd(bctx, m, addr); err != nil {
		return fmt.Errorf("%w%s", err, consoleTail(dir))
	}
	phase("guest boot to envd")
	if err := initEnvd(bctx, addr, s); err != nil {
		return err
	}
	phase("envd init")
	return nil
}

// kernelCmdline is the same for every sandbox: clones of one sandbox must
// boot identically, and the guest's identity comes from envd's /init.
func kernelCmdline(extra []string) string {
	return strings.Join(append([]string{
		"console=ttyS0", "quiet", "panic=-1", "reboot=t",
		"aenv.ip=" + network.GuestIP.String() + "/30",
		"aenv.gw=" + network.TapIP.String(),
		"aenv.dns=" + network.TapIP.String(), // the node's resolver for the guest
		"aenv.hostname=sandbox",
		fmt.Sprintf("aenv.envd_port=%d", EnvdPort),
	}, extra...), " ")
}

// waitEnvd polls envd's /health until it answers 204, the machine dies or ctx ends.
func waitEnvd(ctx context.Context, m *vmm.Machine, addr string) error {
	// No kept-alive connections: the guest may be killed or paused at any
	// time, and an idle connection to it would linger (and hold goroutines).
	client := &http.Client{Timeout: 2 * time.Second, Transport: envdHTTP.Transport}
	url := "http://" + addr + "/health"
	for {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		resp, err := client.Do(req)
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusNoContent || resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		select {
		case <-m.Exited():
			return fmt.Errorf("guest stopped before envd answered: %v", m.ExitErr())
		case <-ctx.Done():
			return fmt.Errorf("envd at %s did not answer in time: %w", addr, ctx.Err())
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// initEnvd hands envd the sandbox's environment, access token, default user
// and the current time, as E2B's orchestrator does after every boot or resume.
func initEnvd(ctx context.Context, addr string, s *sandboxes.Sandbox) error {
	return initEnvdAs(ctx, addr, s, s.AccessToken, false)
}

// envdHTTP is the client the node talks to guests' envd with. It keeps no
// idle connections: guest addresses are reused by later sandboxes, and a
// pooled connection to a gone guest would be reset by its successor.
var envdHTTP = &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}

// initEnvdAs is initEnvd authenticated with authToken, the token the guest's
// envd currently holds (a fork child's envd still holds its parent's). With
// reseed it also sends fresh host entropy, for guests restored from a
// snapshot other guests were restored from too.
func initEnvdAs(ctx context.Context, addr string, s *sandboxes.Sandbox, authToken string, reseed bool) error {
	envVars := s.EnvVars
	if envVars == nil {
		envVars = map[string]string{}
	}
	body := map[string]any{
		"envVars":   envVars,
		"timestamp": time.Now().UTC().Format(time.RFC3339Nano),
	}
	if reseed {
		body["entropySeed"] = randomHex(64)
	}
	if s.AccessToken != "" || authToken != "" {
		body["accessToken"] = s.AccessToken // "" clears the token the guest held
	}
	if s.DefaultUser != "" {
		body["defaultUser"] = s.DefaultUser
		if s.DefaultUser == "root" {
			body["defaultWorkdir"] = "/root"
		} else {
			body["defaultWorkdir"] = "/home/" + s.DefaultUser
		}
	}
	if s.DefaultWorkdir != "" { // the template's last WORKDIR
		body["defaultWorkdir"] = s.DefaultWorkdir
	}
	return postEnvd(ctx, addr, "/init", authToken, body)
}

// postEnvd POSTs body as JSON to path of the envd at addr (with token, if
// any) and fails unless it answers 2xx.
func postEnvd(ctx context.Context, addr, path, token string, body any) error {
	b, _ := json.Marshal(body)
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+addr+path, bytes.NewReader(b))
	req.Header.Set("Content-Type", "application/json")
	if token != "" {
		req.Header.Set("X-Access-Token", token)
	}
	resp, err := envdHTTP.Do(req)
	if err != nil {
		return fmt.Errorf("envd %s: %w", path, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode/100 != 2 {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		return fmt.Errorf("envd %s answered %d: %s", path, resp.StatusCode, strings.TrimSpace(string(msg)))
	}
	return nil
}

func consoleTail(dir string) string {
	b, err := vmm.ReadLogTail(filepath.Join(dir, vmm.ConsoleName), 1500)
	if err != nil || len(b) == 0 {
		return ""
	}
	return "; guest console: " + strings.TrimSpace(string(b))
}

// adopt records a live machine and watches for its unexpected exit.
func (n *Node) adopt(id string, m *vmm.Machine) {
	if m.CgroupErr != nil {
		n.cgroupWarn.Do(func() {
			n.log.Warn("sandboxes run without cgroup limits (CPU, memory, pids)", "err", m.CgroupErr)
		})
	}
	n.machines.set(id, m)
	go func() {
		<-m.Exited()
		// Expected exits (kill, pause) take the machine out of the table
		// first.
		if !n.machines.is(id, m) {
			return
		}
		ctx := context.Background()
		s, err := n.records.Get(ctx, id)
		if err != nil {
			return
		}
		switch s.State {
		case sandboxes.Pooled:
			if !n.pool.Lost(id) {
				n.forkPool.Lost(id)
			}
		case sandboxes.Running:
			n.log.Warn("sandbox's QEMU exited unexpectedly; removing the sandbox", "sandbox", id, "exit", m.ExitErr())
			n.removeDead(ctx, id)
		}
		// Mid-operation, the operation sees the machine gone and settles.
	}()
}

// removeDead removes a sandbox whose QEMU died, trying again (every few
// seconds, up to half a minute apart) while the removal fails, e.g. on a
// full disk: a dead sandbox listed running would answer nothing until the
// node restarts. It gives up when the node stops (its recovery finishes
// the removal) or another operation has the sandbox.
func (n *Node) removeDead(ctx context.Context, id string) {
	wait := time.Second
	for {
		err := n.Kill(ctx, id)
		if err == nil || errors.Is(err, ErrNotFound) || errors.Is(err, ErrConflict) {
			return
		}
		n.log.Error("clean up dead sandbox (trying again)", "sandbox", id, "in", wait, "err", err)
		select {
		case <-n.stop:
			return
		case <-time.After(wait):
		}
		wait = min(2*wait, 30*time.Second)
	}
}

// Kill stops a sandbox and removes everything it had: QEMU, network, files,
// record; what its files were made of goes once nothing else needs it.
// A sandbox in the middle of another operation is refused (ErrConflict);
// a kill that was cut short is finished.
func (n *Node) kill(ctx context.Context, id string) error {
	s, err := n.records.Get(ctx, id)
	if err == nil && !s.State.Resting() && s.State != sandboxes.Killing {
		return sandboxes.Busy(s)
	}
	if err != nil && (!errors.Is(err, ErrNotFound) || !n.sharesPaused()) {
		return n.notHere(err)
	}
	unlock := n.lockOp(id)
	defer unlock()
	o := operation.Start(ctx, "kill", n.cfg.OperationTimeout, n.log)
	octx := o.Context()
	s, err = n.records.Get(octx, id)
	if errors.Is(err, ErrNotFound) && n.sharesPaused() {
		// Paused on another node, in shared storage.
		if err := n.shelf.Kill(octx, id); err != nil {
			return o.Finish(err)
		}
		n.log.Info("killed a paused sandbox of another node from shared storage", "sandbox", id)
		return o.Finish(nil)
	}
	if err != nil {
		return o.Finish(err)
	}
	if s.State != sandboxes.Killing {
		from := s.State
		if from != sandboxes.Running && from != sandboxes.Paused {
			return o.Finish(sandboxes.Busy(s))
		}
		if err := o.Do("record", func(ctx context.Context) error { return n.records.Move(ctx, id, from, sandboxes.Killing, "") }); err != nil {
			return o.Finish(err)
		}
		o.OnFailure("keep the sandbox", func(ctx context.Context) error {
			return n.records.Move(ctx, id, sandboxes.Killing, from, "")
		})
	}
	// QEMU stops: from here the kill only goes forward (every step below
	// tolerates what is gone already, and a kill retried finishes it).
	n.flushVolumes(octx, s)
	if err := o.Do("stop-qemu", func(context.Context) error { return n.stopMachine(id) }); err != nil {
		return o.Finish(err)
	}
	o.Settle()
	if m, ok := sharing.ReadMark(n.sandboxDir(id)); ok {
		if err := n.shelf.Forget(octx, id, m.Generation); err != nil {
			n.log.Warn("remove a killed sandbox from shared storage", "sandbox", id, "err", err)
		}
	}
	n.destroy(octx, s)
	n.ops.forget(id)
	n.gc(octx)
	return o.Finish(nil)
}

// destroy tears a sandbox down completely; every step tolerates pieces that
// are already gone, so it also serves failed creates and recovery.
func (n *Node) destroy(ctx context.Context, s *sandboxes.Sandbox) {
	if err := n.stopMachine(s.ID); err != nil {
		n.log.Error("kill qemu", "sandbox", s.ID, "err", err)
	}
	if s.PID > 0 { // a QEMU the node does not hold (recovery)
		vmm.KillStray(s.PID, n.sandboxDir(s.ID))
	}
	if err := vmm.RemoveCgroup(n.cgroupName(s.ID)); err != nil {
		n.log.Error("remove cgroup", "sandbox", s.ID, "err", err)
	}
	if ep, err := n.endpoint(s); err == nil {
		if err := n.net.Teardown(ep); err != nil {
			n.log.Error("tear down network", "sandbox", s.ID, "err", err)
		}
	}
	// Renamed out of the way first: the removal is never seen half done.
	dir := n.sandboxDir(s.ID)
	gone := filepath.Join(filepath.Dir(dir), "."+s.ID+".gone")
	if err := os.Rename(dir, gone); err == nil {
		dir = gone
	}
	if err := os.RemoveAll(dir); err != nil {
		n.log.Error("remove sandbox files", "sandbox", s.ID, "err", err)
	}
	if err := n.records.Delete(ctx, s.ID); err != nil {
		// Its volumes stay held with the record; the next start finishes.
		n.log.Error("forget sandbox", "sandbox", s.ID, "err", err)
		return
	}
	n.returnVolumes(s)
}

// ConsoleLog returns up to the last maxBytes of a sandbox's guest console
// (kernel, init and envd messages).
func (n *Node) ConsoleLog(ctx context.Context, id string, maxBytes int64) ([]byte, error) {
	if _, err := n.Get(ctx, id); err != nil {
		return nil, err
	}
	return vmm.ReadLogTail(filepath.Join(n.sandboxDir(id), vmm.ConsoleName), maxBytes)
}

// mergeEnv is a template's env vars overridden by a create's.
func mergeEnv(template, request map[string]string) map[string]string {
	if len(template) == 0 {
		return request
	}
	out := make(map[string]string, len(template)+len(request))
	for k, v := range template {
		out[k] = v
	}
	for k, v := range request {
		out[k] = v
	}
	return out
}

// cgroupName names a sandbox's QEMU cgroup (the instance keeps nodes
// sharing a host apart).
func (n *Node) cgroupName(id string) string { return n.net.Instance() + "-" + id }

// qemuCgroup is the cgroup a sandbox's QEMU starts in ("": none).
func (n *Node) qemuCgroup(id string) string {
	if n.cfg.NoCgroups {
		return ""
	}
	return n.cgroupName(id)
}

// limits bound a sandbox's QEMU: CPU time for its vCPUs plus one CPU for
// QEMU's own threads (I/O, migration, and under TCG the translation work),
// memory for twice its guest RAM plus 1 GiB (the cgroup is charged for the
// page cache of the guest's RAM file and of its disk layers, and a tight
// bound would make the kernel write guest memory back under the sandbox's
// feet), and a generous number of threads. They stop a runaway QEMU from
// taking the host, not a guest from using what it was given.
func (n *Node) limits(s *sandboxes.Sandbox) vmm.Limits {
	return vmm.Limits{CPUs: float64(s.VCPUs + 1), MemoryBytes: int64(2*s.MemoryMiB)<<20 + 1<<30, Pids: 1024}
}

// DefaultQEMUUser is the unprivileged user `aenv setup` makes for QEMU
// (used when QEMUs share one user instead of ids of their own).
const DefaultQEMUUser = "aenv-qemu"

// DefaultQEMUUIDBase numbers the ids sandboxes' QEMUs run as: far above
// the users and subordinate id ranges a host hands out.
const DefaultQEMUUIDBase = 1_700_000_000

// logCap is the bound of each sandbox's console and QEMU logs on the
// node's disk.
func (n *Node) logCap() int64 { return int64(n.cfg.ConsoleLogMiB) << 20 }
