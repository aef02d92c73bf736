package envd

import (
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"path"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"
)

// The node mounts a sandbox's volumes through POST /aenv/mounts (an
// AgentENV route, behind the access token): each volume is a disk the
// node put in one of the machine's volume slots, found by its serial
// number, holding an ext4 filesystem that is mounted at the path the
// sandbox's creator named.

type volumeMount struct {
	Serial string `json:"serial"`
	Path   string `json:"path"`
}

type mountsRequest struct {
	Mounts []volumeMount `json:"mounts"`
}

// sysBlock is where the guest's block devices are listed (a variable for
// tests).
var sysBlock = "/sys/block"

func (s *Server) handleMounts(w http.ResponseWriter, r *http.Request) {
	if !allowMethods(w, r, http.MethodPost) {
		return
	}
	var req mountsRequest
	if err := json.NewDecoder(http.MaxBytesReader(w, r.Body, 1<<20)).Decode(&req); err != nil {
		writeJSONError(w, http.StatusBadRequest, "invalid JSON body: "+err.Error())
		return
	}
	for _, m := range req.Mounts {
		if m.Serial == "" || !path.IsAbs(m.Path) || path.Clean(m.Path) != m.Path || m.Path == "/" {
			writeJSONError(w, http.StatusBadRequest, fmt.Sprintf("mount %q at %q: want a serial and a clean absolute path other than /", m.Serial, m.Path))
			return
		}
	}
	for _, m := range req.Mounts {
		if err := mountVolume(m); err != nil {
			s.log.Warn("mount volume", "serial", m.Serial, "path", m.Path, "err", err)
			writeJSONError(w, http.StatusInternalServerError, err.Error())
			return
		}
	}
	w.WriteHeader(http.StatusNoContent)
}

// deviceBySerial is the /dev node of the block device with serial.
func deviceBySerial(serial string) (string, error) {
	entries, err := os.ReadDir(sysBlock)
	if err != nil {
		return "", err
	}
	for _, e := range entries {
		b, err := os.ReadFile(filepath.Join(sysBlock, e.Name(), "serial"))
		if err == nil && strings.TrimSpace(string(b)) == serial {
			return "/dev/" + e.Name(), nil
		}
	}
	return "", fmt.Errorf("no disk with serial %s", serial)
}

// mountVolume mounts the disk with m's serial at m.Path, unless it is
// mounted there already (a resumed sandbox keeps its mounts).
func mountVolume(m volumeMount) error {
	dev, err := deviceBySerial(m.Serial)
	if err != nil {
		return err
	}
	if mountedAt(dev, m.Path) {
		return nil
	}
	f, err := os.OpenFile(dev, os.O_RDONLY, 0)
	if err != nil {
		return err
	}
	// The slot was empty when the guest booted: its kernel may hold blocks
	// it read then (zeros), which must not stand for the volume's.
	err = unix.IoctlSetInt(int(f.Fd()), unix.BLKFLSBUF, 0)
	f.Close()
	if err != nil {
		return fmt.Errorf("%s: drop cached blocks: %w", dev, err)
	}
	if err := os.MkdirAll(m.Path, 0o755); err != nil {
		return err
	}
	if err := unix.Mount(dev, m.Path, "ext4", unix.MS_NOSUID|unix.MS_NODEV, ""); err != nil {
		return fmt.Errorf("mount %s at %s: %w", dev, m.Path, err)
	}
	return nil
}

// mountedAt reports whether dev is mounted at dir.
func mountedAt(dev, dir string) bool {
	b, err := os.ReadFile("/proc/self/mounts")
	if err != nil {
		return false
	}
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) >= 2 && f[0] == dev && unescapeOctal(f[1]) == dir {
			return true
		}
	}
	return false
}

// unescapeOctal undoes /proc/mounts' \ooo escapes (spaces, tabs...).
func unescapeOctal(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+4 <= len(s) {
			var v int
			if _, err := fmt.Sscanf(s[i+1:i+4], "%o", &v); err == nil {
				b.WriteByte(byte(v))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}
