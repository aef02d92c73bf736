package volumes

import (
	"context"
	"os"
	"path/filepath"
)

// A volume mounted in a sandbox is lent to it: its disk is the guest's
// alone (one writer for its filesystem), so the host closes it first and
// keeps it closed, content requests and deletion getting ErrConflict,
// until the sandbox gives it back.

// Lend closes volume id on the host (once the content requests using it
// end) and holds it for sandbox, returning its disk. A volume lent or
// being deleted already is ErrConflict.
func (s *Store) Lend(ctx context.Context, id, sandbox string) (disk string, err error) {
	if _, err := s.Get(ctx, id); err != nil {
		return "", err
	}
	if err := s.closeHost(ctx, id, "mounted in sandbox "+sandbox); err != nil {
		return "", err
	}
	return s.Disk(id), nil
}

// Return ends the loan of volume id: the host may open it again.
func (s *Store) Return(id string) {
	// The machine that had it may have owned its disk.
	if err := os.Chown(s.Disk(id), 0, 0); err != nil && !os.IsNotExist(err) {
		s.log.Warn("volume returned: its disk keeps another owner", "volume", id, "err", err)
	}
	s.release(id)
}

// Disk is the disk of volume id.
func (s *Store) Disk(id string) string { return filepath.Join(s.dir(id), diskName) }
