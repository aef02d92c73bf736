package imagecache

import (
	"io/fs"
	"syscall"
)

// diskBytes is what a file takes on disk (layers are sparse qcow2).
func diskBytes(info fs.FileInfo) int64 {
	if st, ok := info.Sys().(*syscall.Stat_t); ok {
		return st.Blocks * 512
	}
	return info.Size()
}
