package vmm

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"strconv"
	"strings"
	"syscall"
)

// Sealing a disk: with the vCPUs stopped, QEMU stacks a new, empty qcow2
// image on the root disk's top (QMP blockdev-add, blockdev-snapshot) and
// writes only to it from then on, so the old top is
// frozen as it is at that instant, in place, without a copy. The new image
// reaches QEMU (which cannot open the sandbox's files itself) as an fdset
// of two descriptors, one per access mode, as the root disk does at Start;
// its header names the backing file the caller chose (QEMU attaches the
// old top below it and does not open that name). Once the guest runs
// again, ReleaseSealed closes QEMU's writable descriptors of the images
// below the top: a QEMU taken over by its guest can no longer write what
// was sealed.

// Seal stacks the qcow2 image at next on the root disk (m stopped). On
// failure the disk is as it was.
func (m *Machine) Seal(ctx context.Context, next string) error {
	rw, err := os.OpenFile(next, os.O_RDWR, 0)
	if err != nil {
		return err
	}
	defer rw.Close()
	ro, err := os.Open(next)
	if err != nil {
		return err
	}
	defer ro.Close()
	top, err := m.rootTop(ctx)
	if err != nil {
		return err
	}
	sets, err := m.fdsets(ctx)
	if err != nil {
		return err
	}
	// A set of its own, numbered above every other (and above the root
	// disk's, which Sealed tells apart).
	id := rootFdset + 1
	for _, set := range sets {
		id = max(id, set.FdsetID+1)
	}
	forget := func() { _, _ = m.qmp.Execute(context.WithoutCancel(ctx), "remove-fd", map[string]any{"fdset-id": id}) }
	for _, f := range []struct {
		file   *os.File
		opaque string
	}{{rw, fdRW}, {ro, fdRO}} {
		if _, err := m.qmp.ExecuteWithFile(ctx, "add-fd", map[string]any{"fdset-id": id, "opaque": f.opaque}, f.file); err != nil {
			forget()
			return fmt.Errorf("seal: pass the new image: %w", err)
		}
	}
	// Added as a node of its own, without the backing its header names
	// and without image locking (see Config.rootDiskLocking), then put
	// over the top.
	node := "seal-" + strconv.Itoa(id)
	if _, err := m.qmp.Execute(ctx, "blockdev-add", map[string]any{"driver": "qcow2", "node-name": node,
		"file":    map[string]any{"driver": "file", "filename": "/dev/fdset/" + strconv.Itoa(id), "locking": "off"},
		"backing": nil, "cache": map[string]any{"direct": false, "no-flush": false}, "discard": "unmap"}); err != nil {
		forget()
		return fmt.Errorf("seal: open the new image: %w", err)
	}
	if _, err := m.qmp.Execute(ctx, "blockdev-snapshot", map[string]any{"node": top.node, "overlay": node}); err != nil {
		_, _ = m.qmp.Execute(context.WithoutCancel(ctx), "blockdev-del", map[string]any{"node-name": node})
		forget()
		return fmt.Errorf("seal: %w", err)
	}
	return nil
}

// ReleaseSealed closes QEMU's writable descriptors of the root disk's
// images below its top (call it with the vCPUs running: QEMU closes a
// removed descriptor only then). It returns how many it closed.
func (m *Machine) ReleaseSealed(ctx context.Context) (int, error) {
	top, err := m.rootTop(ctx)
	if err != nil {
		return 0, err
	}
	sets, err := m.fdsets(ctx)
	if err != nil {
		return 0, err
	}
	closed := 0
	for _, set := range sets {
		if "/dev/fdset/"+strconv.Itoa(set.FdsetID) == top.file {
			continue
		}
		for _, fd := range set.Fds {
			if fd.Opaque != fdRW {
				continue
			}
			if _, err := m.qmp.Execute(ctx, "remove-fd", map[string]any{"fdset-id": set.FdsetID, "fd": fd.Fd}); err != nil {
				return closed, fmt.Errorf("close the writable descriptor of a sealed image: %w", err)
			}
			closed++
		}
	}
	return closed, nil
}

// fdset is one of QEMU's sets of passed descriptors.
type fdset struct {
	FdsetID int `json:"fdset-id"`
	Fds     []struct {
		Fd     int    `json:"fd"`
		Opaque string `json:"opaque"`
	} `json:"fds"`
}

func (m *Machine) fdsets(ctx context.Context) ([]fdset, error) {
	raw, err := m.qmp.Execute(ctx, "query-fdsets", nil)
	if err != nil {
		return nil, err
	}
	var sets []fdset
	if err := json.Unmarshal(raw, &sets); err != nil {
		return nil, fmt.Errorf("query-fdsets answered %s: %w", raw, err)
	}
	return sets, nil
}

// rootTop is the root disk's top image as QEMU has it: its node and the
// name of the file it opened.
type rootTop struct{ node, file string }

func (m *Machine) rootTop(ctx context.Context) (rootTop, error) {
	raw, err := m.qmp.Execute(ctx, "query-block", nil)
	if err != nil {
		return rootTop{}, err
	}
	var devs []struct {
		Device   string `json:"device"`
		Inserted *struct {
			File     string `json:"file"`
			NodeName string `json:"node-name"`
		} `json:"inserted"`
	}
	if err := json.Unmarshal(raw, &devs); err != nil {
		return rootTop{}, fmt.Errorf("query-block answered %s: %w", raw, err)
	}
	for _, d := range devs {
		if d.Device == rootDriveID && d.Inserted != nil {
			f, err := protocolFile(d.Inserted.File)
			return rootTop{node: d.Inserted.NodeName, file: f}, err
		}
	}
	return rootTop{}, fmt.Errorf("QEMU has no root disk (query-block: %s)", strings.TrimSpace(string(raw)))
}

// Sealed reports whether the root disk's top is an image a seal stacked
// (its name is an fdset other than the one the disk was started on).
func (m *Machine) Sealed(ctx context.Context) (bool, error) {
	top, err := m.rootTop(ctx)
	if err != nil {
		return false, err
	}
	set, ok := strings.CutPrefix(top.file, "/dev/fdset/")
	return ok && set != strconv.Itoa(rootFdset), nil
}

// protocolFile is the file a qcow2 image's name opens: the name itself, or
// where QEMU names the image by its options (a top whose backing is not
// the one its header names), the "json:" name's file.
func protocolFile(name string) (string, error) {
	opts, ok := strings.CutPrefix(name, "json:")
	if !ok {
		return name, nil
	}
	var o struct {
		File struct {
			Filename string `json:"filename"`
		} `json:"file"`
	}
	if err := json.Unmarshal([]byte(opts), &o); err != nil || o.File.Filename == "" {
		return "", fmt.Errorf("QEMU names the root disk %q: no file in it", name)
	}
	return o.File.Filename, nil
}

// Sealable reports whether m's root disk can be sealed and released: it
// was inherited as an fdset (machines started by older nodes opened it
// through /proc/self/fd, a descriptor no QMP command closes).
func (m *Machine) Sealable(ctx context.Context) (bool, error) {
	top, err := m.rootTop(ctx)
	if err != nil {
		return false, err
	}
	return strings.HasPrefix(top.file, "/dev/fdset/"), nil
}

// TopIs reports whether the root disk's top is the file at path (the same
// inode, whatever QEMU calls it).
func (m *Machine) TopIs(ctx context.Context, path string) (bool, error) {
	var want syscall.Stat_t
	if err := syscall.Stat(path, &want); err != nil {
		return false, err
	}
	top, err := m.rootTop(ctx)
	if err != nil {
		return false, err
	}
	files := []string{top.file}
	if id, ok := strings.CutPrefix(top.file, "/dev/fdset/"); ok {
		sets, err := m.fdsets(ctx)
		if err != nil {
			return false, err
		}
		files = nil
		for _, set := range sets {
			if strconv.Itoa(set.FdsetID) == id {
				for _, fd := range set.Fds {
					files = append(files, "/proc/"+strconv.Itoa(m.pid)+"/fd/"+strconv.Itoa(fd.Fd))
				}
			}
		}
	}
	for _, f := range files {
		var st syscall.Stat_t
		if syscall.Stat(f, &st) == nil && st.Dev == want.Dev && st.Ino == want.Ino {
			return true, nil
		}
	}
	return false, nil
}

// WritableDescriptors counts the descriptors process pid holds open for
// writing on the file at path.
func WritableDescriptors(pid int, path string) (int, error) {
	var want syscall.Stat_t
	if err := syscall.Stat(path, &want); err != nil {
		return 0, err
	}
	dir := "/proc/" + strconv.Itoa(pid)
	ents, err := os.ReadDir(dir + "/fd")
	if err != nil {
		return 0, err
	}
	count := 0
	for _, e := range ents {
		var st syscall.Stat_t
		if syscall.Stat(dir+"/fd/"+e.Name(), &st) != nil || st.Ino != want.Ino || st.Dev != want.Dev {
			continue
		}
		info, err := os.ReadFile(dir + "/fdinfo/" + e.Name())
		if err != nil {
			continue // closed meanwhile
		}
		for _, line := range strings.Split(string(info), "\n") {
			if v, ok := strings.CutPrefix(line, "flags:"); ok {
				if f, err := strconv.ParseInt(strings.TrimSpace(v), 8, 64); err == nil && f&syscall.O_ACCMODE != syscall.O_RDONLY {
					count++
				}
			}
		}
	}
	return count, nil
}
