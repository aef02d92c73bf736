package vmm

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"time"
)

// Guest memory lives in the memory-backend-file, so saving a machine's state
// only has to write its device state: the x-ignore-shared migration
// capability makes QEMU skip RAM that is a shared file mapping. A stopped
// machine's RAM file plus this device state is a complete snapshot.

// caps are the migration capabilities of a save or load; both ends must
// agree.
func caps(ignoreShared bool) map[string]any {
	return map[string]any{
		"capabilities": []map[string]any{{"capability": "x-ignore-shared", "state": ignoreShared}},
	}
}

// SaveState writes the device state of a paused machine to path. The caller
// pauses the machine first and decides afterwards whether it resumes or quits.
func (m *Machine) SaveState(ctx context.Context, path string) error {
	return m.saveState(ctx, path, true)
}

// SaveFullState writes device state and all of guest RAM to path, whatever
// the memory mapping. LoadFullState reads it into a machine whose RAM is a
// shared file mapping, which so receives the RAM: the way to turn a machine
// with private (copy-on-write) RAM back into a RAM file plus device state.
func (m *Machine) SaveFullState(ctx context.Context, path string) error {
	return m.saveState(ctx, path, false)
}

// The migration stream goes over a unix socket between QEMU and this
// process (never "exec:", which would need QEMU to spawn a program: its
// seccomp filter forbids that).

// migrationSocket returns a fresh socket path short enough for a socket
// address, in a directory the machine's QEMU may use (it runs as another
// user), and a function removing it.
func (m *Machine) migrationSocket() (string, func(), error) {
	dir, err := os.MkdirTemp("", "aenv-mig-")
	if err != nil {
		return "", nil, err
	}
	if m.uid >= 0 {
		if err := os.Chown(dir, m.uid, m.gid); err != nil {
			os.RemoveAll(dir)
			return "", nil, err
		}
	}
	return filepath.Join(dir, "s"), func() { os.RemoveAll(dir) }, nil
}

// listenMigration listens on sock for QEMU to connect to.
func (m *Machine) listenMigration(sock string) (*net.UnixListener, error) {
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
	if err != nil {
		return nil, err
	}
	if m.uid >= 0 {
		if err := os.Chown(sock, m.uid, m.gid); err != nil {
			ln.Close()
			return nil, err
		}
	}
	return ln, nil
}

func (m *Machine) saveState(ctx context.Context, path string, ignoreShared bool) error {
	out, err := os.OpenFile(path, os.O_CREATE|os.O_TRUNC|os.O_WRONLY, 0o600)
	if err != nil {
		return err
	}
	defer out.Close()
	sock, cleanup, err := m.migrationSocket()
	if err != nil {
		return err
	}
	defer cleanup()
	ln, err := m.listenMigration(sock)
	if err != nil {
		return err
	}
	defer ln.Close()
	if err := m.prepareSave(ctx, ignoreShared); err != nil {
		return err
	}
	done := make(chan error, 1)
	go func() {
		conn, err := ln.AcceptUnix()
		if err != nil {
			done <- err
			return
		}
		defer conn.Close()
		_, err = io.Copy(out, conn)
		done <- err
	}()
	if _, err := m.qmp.Execute(ctx, "migrate", map[string]any{"uri": "unix:" + sock}); err != nil {
		return err
	}
	merr := m.waitMigration(ctx, "save state")
	if merr != nil {
		ln.Close()
		return fmt.Errorf("%w%s", merr, m.logTail())
	}
	select {
	case err = <-done:
	case <-ctx.Done():
		return ctx.Err()
	}
	if err != nil {
		return fmt.Errorf("write state: %w", err)
	}
	return out.Close()
}

// prepareSave sets the capabilities of a save and lifts QEMU's default cap
// of 32 MiB/s on migration bandwidth: the machine is stopped, so the stream
// should go as fast as it can be written.
func (m *Machine) prepareSave(ctx context.Context, ignoreShared bool) error {
	if _, err := m.qmp.Execute(ctx, "migrate-set-capabilities", caps(ignoreShared)); err != nil {
		return err
	}
	_, err := m.qmp.Execute(ctx, "migrate-set-parameters", map[string]any{"max-bandwidth": int64(64) << 30})
	return err
}

// SaveStateDiff writes an incremental snapshot of a paused machine to path:
// its device state and the pages of guest RAM that differ from base, the RAM
// image the machine's memory started from (see ramdiff.go). LoadFullState
// restores it into a machine started on the same base with PrivateMemory,
// or on a copy of the base. The file is synced before SaveStateDiff returns.
func (m *Machine) SaveStateDiff(ctx context.Context, path, base string) (RAMDiffStats, error) {
	img, err := openBaseImage(base)
	if err != nil {
		return RAMDiffStats{}, err
	}
	defer img.close()
	out, err := os.OpenFile(path, os.O_CREATE|os.O_TRUNC|os.O_WRONLY, 0o600)
	if err != nil {
		return RAMDiffStats{}, err
	}
	defer out.Close()
	// QEMU connects to a socket of ours.
	sock, cleanup, err := m.migrationSocket()
	if err != nil {
		return RAMDiffStats{}, err
	}
	defer cleanup()
	ln, err := m.listenMigration(sock)
	if err != nil {
		return RAMDiffStats{}, err
	}
	defer ln.Close()
	if err := m.prepareSave(ctx, false); err != nil {
		return RAMDiffStats{}, err
	}
	type result struct {
		stats RAMDiffStats
		err   error
	}
	done := make(chan result, 1)
	go func() {
		conn, err := ln.AcceptUnix()
		if err != nil {
			done <- result{err: err}
			return
		}
		defer conn.Close()
		st, err := filterRAMDiff(out, conn, ramBlockName, img)
		if err != nil {
			// Unblock QEMU; the migration then fails too.
			_, _ = io.Copy(io.Discard, conn)
		}
		done <- result{st, err}
	}()
	if _, err := m.qmp.Execute(ctx, "migrate", map[string]any{"uri": "unix:" + sock}); err != nil {
		return RAMDiffStats{}, err
	}
	merr := m.waitMigration(ctx, "save incremental state")
	if merr != nil {
		ln.Close()
	}
	var r result
	select {
	case r = <-done:
	case <-ctx.Done():
		return RAMDiffStats{}, ctx.Err()
	}
	if merr != nil {
		if r.err != nil {
			merr = fmt.Errorf("%w (stream: %v)", merr, r.err)
		}
		return r.stats, fmt.Errorf("%w%s", merr, m.logTail())
	}
	if r.err != nil {
		return r.stats, fmt.Errorf("write incremental state: %w", r.err)
	}
	if err := out.Sync(); err != nil {
		return r.stats, err
	}
	if err := releaseHoles(m.pid, base, img.holes); err != nil {
		return r.stats, fmt.Errorf("release the zero pages the save faulted in: %w", err)
	}
	return r.stats, out.Close()
}

// LoadState restores the state saved by SaveState into a machine started
// with Config.Incoming. When the saved machine's RAM was a private mapping,
// its RAM is in the state file too, and this machine must also use private
// memory to receive it; otherwise RAM comes from the memory file. The guest
// stays paused until Resume.
func (m *Machine) LoadState(ctx context.Context, path string) error {
	return m.loadState(ctx, path, true)
}

// LoadFullState loads a SaveFullState file (see there).
func (m *Machine) LoadFullState(ctx context.Context, path string) error {
	return m.loadState(ctx, path, false)
}

func (m *Machine) loadState(ctx context.Context, path string, ignoreShared bool) error {
	in, err := os.Open(path)
	if err != nil {
		return err
	}
	defer in.Close()
	// The capability must match the saving side's.
	if _, err := m.qmp.Execute(ctx, "migrate-set-capabilities", caps(ignoreShared)); err != nil {
		return err
	}
	// No announcements once the state is in: QEMU would send RARPs into
	// the tap and have the guest's virtio-net driver announce itself
	// (gratuitous ARP, IPv6 neighbour advertisements, rtnetlink events), in
	// rounds, which a point-to-point tap in a namespace of its own has no
	// switch to tell. Under TCG that was a third of the guest code a cold
	// resume translated before envd answered.
	if _, err := m.qmp.Execute(ctx, "migrate-set-parameters", map[string]any{"announce-rounds": 0}); err != nil {
		return err
	}
	sock, cleanup, err := m.migrationSocket()
	if err != nil {
		return err
	}
	defer cleanup()
	// QEMU listens; this process connects once the socket is there and
	// streams the file in.
	if _, err := m.qmp.Execute(ctx, "migrate-incoming", map[string]any{"uri": "unix:" + sock}); err != nil {
		return m.withLog(err)
	}
	var conn *net.UnixConn
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
		conn, err = net.DialUnix("unix", nil, &net.UnixAddr{Name: sock, Net: "unix"})
		if err == nil {
			break
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return m.withLog(fmt.Errorf("connect to QEMU's incoming migration socket: %w", err))
		}
	}
	copied := make(chan error, 1)
	go func() {
		_, err := io.Copy(conn, in)
		conn.CloseWrite()
		copied <- err
	}()
	merr := m.withLog(m.waitMigration(ctx, "load state"))
	conn.Close()
	if cerr := <-copied; merr == nil && cerr != nil {
		return fmt.Errorf("stream state into QEMU: %w", cerr)
	}
	return merr
}

// withLog adds QEMU's last words to err when QEMU has exited.
func (m *Machine) withLog(err error) error {
	if err == nil {
		return nil
	}
	select {
	case <-m.exited:
	case <-time.After(500 * time.Millisecond):
		return err
	}
	return fmt.Errorf("%w%s", err, m.logTail())
}

// waitMigration polls query-migrate until the migration completes or fails.
// Polling (every 500 µs) keeps the wait tight without depending on event
// delivery order.
func (m *Machine) waitMigration(ctx context.Context, what string) error {
	delay := 200 * time.Microsecond
	for {
		raw, err := m.qmp.Execute(ctx, "query-migrate", nil)
		if err != nil {
			return fmt.Errorf("%s: %w", what, err)
		}
		var st struct {
			Status    string `json:"status"`
			ErrorDesc string `json:"error-desc"`
		}
		if err := json.Unmarshal(raw, &st); err != nil {
			return fmt.Errorf("%s: parse query-migrate: %w", what, err)
		}
		switch st.Status {
		case "completed":
			return nil
		case "failed", "cancelled":
			return fmt.Errorf("%s: migration %s: %s", what, st.Status, st.ErrorDesc)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%s: %w", what, ctx.Err())
		case <-m.exited:
			return fmt.Errorf("%s: qemu exited: %v", what, m.ExitErr())
		case <-time.After(delay):
		}
		if delay < 2*time.Millisecond {
			delay *= 2
		}
	}
}

// Quit asks QEMU to exit (after SaveState, say) and waits for it.
func (m *Machine) Quit(ctx context.Context) error {
	_, err := m.qmp.Execute(ctx, "quit", nil)
	select {
	case <-m.exited:
		return nil
	case <-ctx.Done():
	case <-time.After(5 * time.Second):
	}
	if err != nil {
		err = fmt.Errorf("quit: %w", err)
	}
	if kerr := m.Kill(); kerr != nil {
		return kerr
	}
	return err
}
