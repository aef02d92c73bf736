package envd

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"net/http"
	"os"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/agentenv/agentenv/internal/envd/gen/filesystempb"
	"github.com/agentenv/agentenv/internal/envd/gen/filesystempb/filesystempbconnect"
)

// filesystemService implements filesystem.Filesystem.
type filesystemService struct {
	filesystempbconnect.UnimplementedFilesystemHandler
	s *Server
}

// fsError maps an OS error to the Connect code the SDK expects.
func fsError(err error, what string) error {
	var ce *connect.Error
	if errors.As(err, &ce) {
		return err
	}
	code := connect.CodeInternal
	switch {
	case errors.Is(err, fs.ErrNotExist):
		code = connect.CodeNotFound
	case errors.Is(err, fs.ErrExist), errors.Is(err, syscall.ENOTEMPTY):
		code = connect.CodeAlreadyExists
	case errors.Is(err, fs.ErrPermission), errors.Is(err, syscall.EROFS):
		code = connect.CodePermissionDenied
	case errors.Is(err, syscall.ENOTDIR), errors.Is(err, syscall.EISDIR), errors.Is(err, syscall.ENAMETOOLONG),
		errors.Is(err, syscall.EINVAL), errors.Is(err, syscall.ELOOP):
		code = connect.CodeInvalidArgument
	case errors.Is(err, syscall.ENOSPC), errors.Is(err, syscall.EDQUOT):
		code = connect.CodeResourceExhausted
	}
	return connect.NewError(code, fmt.Errorf("%s: %w", what, err))
}

var (
	nameCacheMu sync.Mutex
	userNames   = map[uint32]string{}
	groupNames  = map[uint32]string{}
)

func ownerNames(uid, gid uint32) (string, string) {
	nameCacheMu.Lock()
	defer nameCacheMu.Unlock()
	un, ok := userNames[uid]
	if !ok {
		un = strconv.FormatUint(uint64(uid), 10)
		if u, err := user.LookupId(un); err == nil {
			un = u.Username
		}
		userNames[uid] = un
	}
	gn, ok := groupNames[gid]
	if !ok {
		gn = strconv.FormatUint(uint64(gid), 10)
		if g, err := user.LookupGroupId(gn); err == nil {
			gn = g.Name
		}
		groupNames[gid] = gn
	}
	return un, gn
}

// entryFromInfo describes path from its lstat result. A symlink is
// described as E2B's envd does: the type and permission bits of what it
// leads to (unspecified and 0 when that is missing), the fully resolved
// path it leads to as symlink_target (its own path when it leads nowhere),
// and the link's own size, time, owner and mode string ("Lrwxrwxrwx").
func entryFromInfo(path string, fi os.FileInfo) *filesystempb.EntryInfo {
	e := &filesystempb.EntryInfo{
		Name:         filepath.Base(path),
		Path:         path,
		Size:         fi.Size(),
		Mode:         uint32(fi.Mode().Perm()),
		Permissions:  fi.Mode().String(),
		ModifiedTime: timestamppb.New(fi.ModTime()),
		Type:         fileType(fi),
	}
	if fi.Mode()&os.ModeSymlink != 0 {
		e.Type, e.Mode = filesystempb.FileType_FILE_TYPE_UNSPECIFIED, 0
		if to, err := os.Stat(path); err == nil {
			e.Type, e.Mode = fileType(to), uint32(to.Mode().Perm())
		}
		target, err := filepath.EvalSymlinks(path)
		if err != nil {
			target = path
		}
		e.SymlinkTarget = proto.String(target)
	}
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		e.Owner, e.Group = ownerNames(st.Uid, st.Gid)
	}
	e.Metadata = readMetadata(path)
	return e
}

// fileType is the entry type of a file that is not a symlink.
func fileType(fi os.FileInfo) filesystempb.FileType {
	switch {
	case fi.IsDir():
		return filesystempb.FileType_FILE_TYPE_DIRECTORY
	case fi.Mode().IsRegular():
		return filesystempb.FileType_FILE_TYPE_FILE
	}
	return filesystempb.FileType_FILE_TYPE_UNSPECIFIED
}

func entryInfo(path string) (*filesystempb.EntryInfo, error) {
	fi, err := os.Lstat(path)
	if err != nil {
		return nil, fsError(err, "stat "+path)
	}
	return entryFromInfo(path, fi), nil
}

func (f *filesystemService) resolve(h http.Header, p string) (*sysUser, string, error) {
	u, err := f.s.requestUser("", h)
	if err != nil {
		return nil, "", connect.NewError(connect.CodeUnauthenticated, err)
	}
	rp, err := resolvePath(p, u)
	if err != nil {
		return nil, "", connect.NewError(connect.CodeInvalidArgument, err)
	}
	return u, rp, nil
}

func (f *filesystemService) Stat(ctx context.Context, req *connect.Request[filesystempb.StatRequest]) (*connect.Response[filesystempb.StatResponse], error) {
	_, p, err := f.resolve(req.Header(), req.Msg.GetPath())
	if err != nil {
		return nil, err
	}
	e, err := entryInfo(p)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&filesystempb.StatResponse{Entry: e}), nil
}

func (f *filesystemService) MakeDir(ctx context.Context, req *connect.Request[filesystempb.MakeDirRequest]) (*connect.Response[filesystempb.MakeDirResponse], error) {
	u, p, err := f.resolve(req.Header(), req.Msg.GetPath())
	if err != nil {
		return nil, err
	}
	if fi, err := os.Stat(p); err == nil {
		if fi.IsDir() {
			return nil, connect.NewError(connect.CodeAlreadyExists, fmt.Errorf("directory already exists: %s", p))
		}
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("path exists and is not a directory: %s", p))
	} else if !errors.Is(err, fs.ErrNotExist) {
		return nil, fsError(err, "stat "+p)
	}
	if err := mkdirAllOwned(p, u); err != nil {
		return nil, fsError(err, "mkdir "+p)
	}
	e, err := entryInfo(p)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&filesystempb.MakeDirResponse{Entry: e}), nil
}

func (f *filesystemService) Move(ctx context.Context, req *connect.Request[filesystempb.MoveRequest]) (*connect.Response[filesystempb.MoveResponse], error) {
	if req.Msg.GetSource() == "" || req.Msg.GetDestination() == "" {
		return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("source and destination are required"))
	}
	u, src, err := f.resolve(req.Header(), req.Msg.GetSource())
	if err != nil {
		return nil, err
	}
	dst, err := resolvePath(req.Msg.GetDestination(), u)
	if err != nil {
		return nil, connect.NewError(connect.CodeInvalidArgument, err)
	}
	if _, err := os.Lstat(src); err != nil {
		return nil, fsError(err, "source "+src)
	}
	if err := mkdirAllOwned(filepath.Dir(dst), u); err != nil {
		return nil, fsError(err, "create parent of "+dst)
	}
	if err := os.Rename(src, dst); err != nil {
		return nil, fsError(err, "move "+src+" to "+dst)
	}
	e, err := entryInfo(dst)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&filesystempb.MoveResponse{Entry: e}), nil
}

func (f *filesystemService) ListDir(ctx context.Context, req *connect.Request[filesystempb.ListDirRequest]) (*connect.Response[filesystempb.ListDirResponse], error) {
	_, p, err := f.resolve(req.Header(), req.Msg.GetPath())
	if err != nil {
		return nil, err
	}
	depth := int(req.Msg.GetDepth())
	if depth <= 0 {
		depth = 1
	}
	real, err := filepath.EvalSymlinks(p)
	if err != nil {
		return nil, fsError(err, "resolve "+p)
	}
	fi, err := os.Stat(real)
	if err != nil {
		return nil, fsError(err, "stat "+p)
	}
	if !fi.IsDir() {
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("path is not a directory: %s", p))
	}
	var entries []*filesystempb.EntryInfo
	err = filepath.WalkDir(real, func(path string, d fs.DirEntry, werr error) error {
		if werr != nil {
			if path == real {
				return werr
			}
			return nil // unreadable subtree: skip it
		}
		if path == real {
			return nil
		}
		rel, err := filepath.Rel(real, path)
		if err != nil {
			return nil
		}
		level := strings.Count(rel, string(filepath.Separator)) + 1
		if level > depth {
			if d.IsDir() {
				return filepath.SkipDir
			}
			return nil
		}
		info, err := d.Info()
		if err != nil {
			return nil // vanished meanwhile
		}
		entries = append(entries, entryFromInfo(filepath.Join(p, rel), info))
		if d.IsDir() && level == depth {
			return filepath.SkipDir
		}
		return nil
	})
	if err != nil {
		return nil, fsError(err, "list "+p)
	}
	return connect.NewResponse(&filesystempb.ListDirResponse{Entries: entries}), nil
}

func (f *filesystemService) Remove(ctx context.Context, req *connect.Request[filesystempb.RemoveRequest]) (*connect.Response[filesystempb.RemoveResponse], error) {
	if req.Msg.GetPath() == "" {
		return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("path is required"))
	}
	_, p, err := f.resolve(req.Header(), req.Msg.GetPath())
	if err != nil {
		return nil, err
	}
	if p == "/" {
		return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("refusing to remove /"))
	}
	// As E2B's envd: a path that is not there is removed already.
	if err := os.RemoveAll(p); err != nil {
		return nil, fsError(err, "remove "+p)
	}
	return connect.NewResponse(&filesystempb.RemoveResponse{}), nil
}
