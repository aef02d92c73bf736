package orchestrator

import (
	"context"
	"fmt"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/agentenv/agentenv/internal/sandboxes"
	"github.com/agentenv/agentenv/internal/storage"
	"github.com/agentenv/agentenv/internal/vmm"
)

// Volumes in sandboxes: every machine has VolumeSlots disk slots beside its
// root disk (empty ones hold nothing a guest could fill). A sandbox created
// with volume mounts borrows each volume from the node's volume store (the
// host closes it: its filesystem has one writer), gets its disk in a slot,
// and has its envd mount it; the sandbox's record holds the volumes, in the
// same transaction as the rest of it, until it is gone. A paused sandbox
// keeps them (its memory has them mounted). A fork copies each volume's
// disk into the snapshot while the parent is stopped (reflinked where the
// filesystem can); every child mounts its own copy-on-write overlay of
// that copy (its writes are its own and go with it), the parent the volume.
// A named snapshot keeps such copies too (and takes them to the
// repository): each sandbox made from it mounts its own overlay of them.

// VolumeSlots is how many volume slots a new machine has.
const VolumeSlots = 4

// VolumeLender lends volumes' disks to sandboxes (package volumes' Store).
type VolumeLender interface {
	// Lend holds volume id for sandbox and returns its disk.
	Lend(ctx context.Context, id, sandbox string) (string, error)
	// Return ends a loan.
	Return(id string)
	// Disk is the disk of volume id.
	Disk(id string) string
}

// VolumeMount asks for a volume in a new sandbox.
type VolumeMount struct {
	VolumeID, Name string
	// Path is where the guest mounts it.
	Path string
}

// forbiddenMountRoots are guest directories no volume may cover.
var forbiddenMountRoots = []string{"/proc", "/sys", "/dev", "/run", "/boot", "/etc", "/bin", "/sbin", "/lib", "/lib64", "/usr"}

// validateMounts checks the volume mounts of a create against each other,
// the node and the machine the sandbox gets (slots of its saved state).
func (n *Node) validateMounts(mounts []VolumeMount, slots int, have []sandboxes.VolumeMount) error {
	if len(mounts) == 0 {
		return nil
	}
	if n.cfg.Volumes == nil {
		return fmt.Errorf("%w: this node has no volumes", ErrInvalid)
	}
	switch free := slots - len(have); {
	case slots == 0:
		return fmt.Errorf("%w: volumeMounts: the sandbox's machine was saved without volume slots (a template snapshot or snapshot made before volumes could be mounted); rebuild the template", ErrInvalid)
	case len(mounts) > free:
		return fmt.Errorf("%w: volumeMounts: %d volumes, the sandbox has room for %d (of %d)", ErrInvalid, len(mounts), free, slots)
	}
	paths, ids := map[string]bool{}, map[string]bool{}
	for _, v := range have { // a snapshot's copies
		paths[v.Path] = true
	}
	for _, m := range mounts {
		if err := checkMountPath(m.Path); err != nil {
			return err
		}
		if ids[m.VolumeID] {
			return fmt.Errorf("%w: volumeMounts: volume %s is named twice", ErrInvalid, m.Name)
		}
		for p := range paths {
			if strings.HasPrefix(m.Path+"/", p+"/") || strings.HasPrefix(p+"/", m.Path+"/") {
				return fmt.Errorf("%w: volumeMounts: %s and %s overlap", ErrInvalid, p, m.Path)
			}
		}
		paths[m.Path], ids[m.VolumeID] = true, true
	}
	return nil
}

// checkMountPath refuses paths a volume may not be mounted at.
func checkMountPath(p string) error {
	if !path.IsAbs(p) || path.Clean(p) != p || p == "/" || len(p) > 1024 || strings.ContainsAny(p, "\x00\n") {
		return fmt.Errorf("%w: volumeMounts: path %q must be a clean absolute path other than /", ErrInvalid, p)
	}
	for _, root := range forbiddenMountRoots {
		if p == root || strings.HasPrefix(p, root+"/") {
			return fmt.Errorf("%w: volumeMounts: path %q is inside %s, which belongs to the system", ErrInvalid, p, root)
		}
	}
	return nil
}

// lendVolumes borrows the volumes of mounts for s, each into the next slot
// s's volumes (a snapshot's copies) leave free, recording in s.Volumes each
// one borrowed (destroy gives those back).
func (n *Node) lendVolumes(ctx context.Context, s *sandboxes.Sandbox, mounts []VolumeMount) error {
	used := map[int]bool{}
	for _, v := range s.Volumes {
		used[v.Slot] = true
	}
	slot := 0
	for _, m := range mounts {
		for used[slot] {
			slot++
		}
		if _, err := n.cfg.Volumes.Lend(ctx, m.VolumeID, s.ID); err != nil {
			return err
		}
		s.Volumes = append(s.Volumes, sandboxes.VolumeMount{VolumeID: m.VolumeID, Name: m.Name, Path: m.Path, Slot: slot})
		used[slot] = true
	}
	return nil
}

// returnVolumes gives back the volumes of a sandbox that is gone.
func (n *Node) returnVolumes(s *sandboxes.Sandbox) {
	for _, v := range s.Volumes {
		if !v.Copy && n.cfg.Volumes != nil {
			n.cfg.Volumes.Return(v.VolumeID)
		}
	}
}

// volumeCopyName is the file of a copy of the volume in slot i (in a
// snapshot, and a child's overlay of it in the child's directory).
func volumeCopyName(slot int) string { return fmt.Sprintf("volume-%d.qcow2", slot) }

// copyVolumes copies the disks of a stopped sandbox's volume slots into
// dir (a snapshot being made), read-only.
func (n *Node) copyVolumes(s *sandboxes.Sandbox, dir string) error {
	for slot, disk := range n.volumeDisks(s) {
		if disk == "" {
			continue
		}
		dst := filepath.Join(dir, volumeCopyName(slot))
		tmp := dst + ".tmp"
		if _, err := storage.CloneFile(disk, tmp); err != nil {
			os.Remove(tmp)
			return fmt.Errorf("copy volume slot %d: %w", slot, err)
		}
		if err := storage.SyncFile(tmp); err != nil {
			return err
		}
		if err := os.Chmod(tmp, 0o400); err != nil {
			return err
		}
		if err := os.Rename(tmp, dst); err != nil {
			return err
		}
	}
	return nil
}

// volumeOverlays gives a sandbox restored from snapshot snapID its own
// overlays of the snapshot's copies of the volumes it has copies of.
func (n *Node) volumeOverlays(ctx context.Context, s *sandboxes.Sandbox, snapID string) error {
	for _, v := range s.Volumes {
		if !v.Copy {
			continue
		}
		overlay := filepath.Join(n.sandboxDir(s.ID), volumeCopyName(v.Slot))
		_ = os.Remove(overlay)
		if err := storage.CreateOverlay(ctx, filepath.Join(n.snapshotDir(snapID), volumeCopyName(v.Slot)), overlay, 0); err != nil {
			return fmt.Errorf("volume %s: %w", v.Name, err)
		}
	}
	return nil
}

// asCopies are the volume mounts of a child of a sandbox mounting vols.
func asCopies(vols []sandboxes.VolumeMount) []sandboxes.VolumeMount {
	if len(vols) == 0 {
		return nil
	}
	out := slices.Clone(vols)
	for i := range out {
		out[i].Copy = true
	}
	return out
}

// volumeDisks are the disks of s's volume slots, by slot ("": empty; a
// slot out of range is left for vmm to refuse).
func (n *Node) volumeDisks(s *sandboxes.Sandbox) []string {
	var disks []string
	for _, v := range s.Volumes {
		for len(disks) <= v.Slot {
			disks = append(disks, "")
		}
		switch {
		case v.Copy:
			disks[v.Slot] = filepath.Join(n.sandboxDir(s.ID), volumeCopyName(v.Slot))
		case n.cfg.Volumes != nil: // (without, the slot stays empty and the mount fails)
			disks[v.Slot] = n.cfg.Volumes.Disk(v.VolumeID)
		}
	}
	return disks
}

// mountVolumes has s's envd mount its volumes (those mounted already, as
// in a resumed sandbox, stay).
func (n *Node) mountVolumes(ctx context.Context, s *sandboxes.Sandbox) error {
	if len(s.Volumes) == 0 {
		return nil
	}
	type mount struct {
		Serial string `json:"serial"`
		Path   string `json:"path"`
	}
	var body struct {
		Mounts []mount `json:"mounts"`
	}
	for _, v := range s.Volumes {
		body.Mounts = append(body.Mounts, mount{Serial: vmm.VolumeSerial(v.Slot), Path: v.Path})
	}
	if err := postEnvd(ctx, n.withAddr(s).EnvdAddr, "/aenv/mounts", s.AccessToken, body); err != nil {
		return fmt.Errorf("mount volumes: %w", err)
	}
	return nil
}

// volumeFlushTimeout bounds the guest's sync before a sandbox with volumes
// is killed.
const volumeFlushTimeout = 10 * time.Second

// flushVolumes makes what a running sandbox wrote to its volumes durable
// before its machine is killed: the guest syncs its filesystems (best
// effort: a guest that does not answer loses what it had not written, as
// a machine losing power does), then the machine stops, which writes out
// everything QEMU holds of its disks.
func (n *Node) flushVolumes(ctx context.Context, s *sandboxes.Sandbox) {
	m := n.machines.get(s.ID)
	if !slices.ContainsFunc(s.Volumes, func(v sandboxes.VolumeMount) bool { return !v.Copy }) || !alive(m) {
		return // (a copy goes with the sandbox)
	}
	if s.State == sandboxes.Running || s.State == sandboxes.Killing {
		if err := n.guestSync(ctx, s, volumeFlushTimeout); err != nil {
			n.log.Warn("the guest did not sync its volumes before its end", "sandbox", s.ID, "err", err)
		}
	}
	if err := m.Pause(ctx); err != nil {
		n.log.Warn("stopping the machine to write out its volumes", "sandbox", s.ID, "err", err)
	}
}

// holdRecordedVolumes borrows again, at start, the volumes the recorded
// sandboxes hold.
func (n *Node) holdRecordedVolumes(ctx context.Context, all []*sandboxes.Sandbox) {
	if n.cfg.Volumes == nil {
		return
	}
	for _, s := range all {
		for _, v := range s.Volumes {
			if v.Copy {
				continue
			}
			if _, err := n.cfg.Volumes.Lend(ctx, v.VolumeID, s.ID); err != nil {
				n.log.Error("a sandbox's volume could not be held", "sandbox", s.ID, "volume", v.Name, "err", err)
			}
		}
	}
}
