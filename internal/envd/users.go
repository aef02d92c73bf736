package envd

import (
	"encoding/base64"
	"errors"
	"fmt"
	"net/http"
	"os"
	"os/user"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
)

// defaultPath is the PATH processes get when neither the host nor the
// request provides one.
const defaultPath = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

// sysUser is a resolved guest account.
type sysUser struct {
	Name   string
	UID    uint32
	GID    uint32
	Groups []uint32
	Home   string
	Shell  string
}

var errNoUser = errors.New("unknown user")

// lookupUser resolves name (or a numeric uid) to a guest account.
func lookupUser(name string) (*sysUser, error) {
	if name == "" {
		return nil, fmt.Errorf("%w: empty user name", errNoUser)
	}
	u, err := user.Lookup(name)
	if err != nil {
		if _, nerr := strconv.ParseUint(name, 10, 32); nerr == nil {
			u, err = user.LookupId(name)
		}
	}
	if err != nil {
		return nil, fmt.Errorf("%w %q: %v", errNoUser, name, err)
	}
	uid, err := strconv.ParseUint(u.Uid, 10, 32)
	if err != nil {
		return nil, fmt.Errorf("user %q: bad uid %q", name, u.Uid)
	}
	gid, err := strconv.ParseUint(u.Gid, 10, 32)
	if err != nil {
		return nil, fmt.Errorf("user %q: bad gid %q", name, u.Gid)
	}
	su := &sysUser{Name: u.Username, UID: uint32(uid), GID: uint32(gid), Home: u.HomeDir, Shell: "/bin/bash"}
	if su.Home == "" {
		su.Home = "/"
	}
	if ids, err := u.GroupIds(); err == nil {
		for _, g := range ids {
			if n, err := strconv.ParseUint(g, 10, 32); err == nil {
				su.Groups = append(su.Groups, uint32(n))
			}
		}
	}
	if len(su.Groups) == 0 {
		su.Groups = []uint32{su.GID}
	}
	return su, nil
}

// usernameFromAuth extracts the user from "Authorization: Basic
// base64(user:)", the way the E2B SDKs send it. It returns "" when the header
// is absent or not Basic.
func usernameFromAuth(h http.Header) string {
	v := h.Get("Authorization")
	if len(v) < 6 || !strings.EqualFold(v[:6], "basic ") {
		return ""
	}
	raw, err := base64.StdEncoding.DecodeString(strings.TrimSpace(v[6:]))
	if err != nil {
		raw, err = base64.RawStdEncoding.DecodeString(strings.TrimSpace(v[6:]))
		if err != nil {
			return ""
		}
	}
	name, _, _ := strings.Cut(string(raw), ":")
	return name
}

// requestUser picks the user a request acts as: explicit name, else the
// Authorization header, else the default user.
func (s *Server) requestUser(explicit string, h http.Header) (*sysUser, error) {
	name := explicit
	if name == "" {
		name = usernameFromAuth(h)
	}
	if name == "" {
		s.mu.RLock()
		name = s.defaultUser
		s.mu.RUnlock()
	}
	return lookupUser(name)
}

// resolvePath turns p into a clean absolute path: "~" and relative paths
// are taken relative to the user's home directory.
func resolvePath(p string, u *sysUser) (string, error) {
	if strings.IndexByte(p, 0) >= 0 {
		return "", errors.New("path contains a NUL byte")
	}
	switch {
	case p == "~":
		p = u.Home
	case strings.HasPrefix(p, "~/"):
		p = filepath.Join(u.Home, p[2:])
	case p == "":
		p = u.Home
	case !filepath.IsAbs(p):
		p = filepath.Join(u.Home, p)
	}
	return filepath.Clean(p), nil
}

// processEnv builds the environment of a new process for u: the daemon's own
// environment, the account variables, the host-provided variables from /init
// and finally the request's variables.
func (s *Server) processEnv(u *sysUser, extra map[string]string) []string {
	env := map[string]string{}
	for _, kv := range os.Environ() {
		if k, v, ok := strings.Cut(kv, "="); ok {
			env[k] = v
		}
	}
	if env["PATH"] == "" {
		env["PATH"] = defaultPath
	}
	env["HOME"] = u.Home
	env["USER"] = u.Name
	env["LOGNAME"] = u.Name
	delete(env, "PWD")
	delete(env, "OLDPWD")
	s.mu.RLock()
	for k, v := range s.envVars {
		env[k] = v
	}
	s.mu.RUnlock()
	for k, v := range extra {
		env[k] = v
	}
	out := make([]string, 0, len(env))
	for k, v := range env {
		out = append(out, k+"="+v)
	}
	sort.Strings(out)
	return out
}

// credential returns the credential to run as u, or nil when envd cannot or
// need not switch users.
func credential(u *sysUser) *syscall.Credential {
	if os.Geteuid() != 0 {
		return nil
	}
	return &syscall.Credential{Uid: u.UID, Gid: u.GID, Groups: u.Groups}
}

// mkdirAllOwned creates dir and any missing parents, handing every directory
// it creates to u.
func mkdirAllOwned(dir string, u *sysUser) error {
	fi, err := os.Stat(dir)
	if err == nil {
		if !fi.IsDir() {
			return &os.PathError{Op: "mkdir", Path: dir, Err: syscall.ENOTDIR}
		}
		return nil
	}
	if !errors.Is(err, os.ErrNotExist) {
		return err
	}
	parent := filepath.Dir(dir)
	if parent != dir {
		if err := mkdirAllOwned(parent, u); err != nil {
			return err
		}
	}
	if err := os.Mkdir(dir, 0o755); err != nil {
		if errors.Is(err, os.ErrExist) {
			return nil
		}
		return err
	}
	chownTo(dir, u)
	return nil
}

func chownTo(path string, u *sysUser) {
	if os.Geteuid() == 0 {
		_ = os.Lchown(path, int(u.UID), int(u.GID))
	}
}

// accessOK reports whether u may access fi with the wanted permission bits
// (4 read, 2 write, 1 exec), judged from the classic owner/group/other bits.
func accessOK(fi os.FileInfo, u *sysUser, want uint32) bool {
	if u.UID == 0 {
		return true
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return true
	}
	perm := uint32(fi.Mode().Perm())
	switch {
	case st.Uid == u.UID:
		return (perm>>6)&want == want
	case inGroups(st.Gid, u):
		return (perm>>3)&want == want
	default:
		return perm&want == want
	}
}

func inGroups(gid uint32, u *sysUser) bool {
	if gid == u.GID {
		return true
	}
	for _, g := range u.Groups {
		if g == gid {
			return true
		}
	}
	return false
}
