package lazy

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
)

// QEMU follows a qcow2 layer's backing file by the name in its header, a
// path on the node that made it. A layer served over NBD gets a header
// whose backing name is a QEMU `json:` description of its parent's NBD
// export instead, so QEMU fetches the whole chain lazily.

// NBDBacking is the `json:` backing name of a qcow2 layer served as export
// by the NBD server on socket.
func NBDBacking(socket, export string) string {
	b, _ := json.Marshal(map[string]any{
		"driver": "qcow2",
		"file":   map[string]any{"driver": "nbd", "server": map[string]any{"type": "unix", "path": socket}, "export": export},
	})
	return "json:" + string(b)
}

// QcowBackingHeader reads a qcow2 layer's header through e and returns the
// layer's first bytes with the backing file name replaced by backing ("" for
// a layer that has none: nil, nothing to replace).
func QcowBackingHeader(ctx context.Context, e *LayerExport, backing string) ([]byte, error) {
	head := make([]byte, min(int64(64<<10), e.Size()))
	if err := e.readChunks(ctx, head, 0); err != nil {
		return nil, err
	}
	if len(head) < 104 || string(head[:4]) != "QFI\xfb" {
		return nil, errors.New("not a qcow2 image")
	}
	off := binary.BigEndian.Uint64(head[8:])
	size := binary.BigEndian.Uint32(head[16:])
	clusterSize := uint64(1) << binary.BigEndian.Uint32(head[20:])
	if off == 0 {
		if backing != "" {
			return nil, errors.New("the layer has no backing file to point elsewhere")
		}
		return nil, nil
	}
	end := off + uint64(len(backing))
	if end > clusterSize || end > uint64(len(head)) {
		return nil, fmt.Errorf("backing name of %d bytes does not fit the header cluster", len(backing))
	}
	for _, b := range head[off+uint64(size) : max(end, off+uint64(size))] {
		if b != 0 {
			return nil, errors.New("the header has data after its backing file name")
		}
	}
	out := append([]byte(nil), head[:max(end, off+uint64(size))]...)
	binary.BigEndian.PutUint32(out[16:], uint32(len(backing)))
	copy(out[off:], backing)
	clear(out[end:])
	return out, nil
}
