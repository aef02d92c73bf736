package image

import (
	"archive/tar"
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"
)

// Filesystem is an ext4 image file being built and the model of its tree.
// Layers are applied to it as data: the model decides what each tar entry
// becomes, and e2fsprogs' debugfs writes that into the image file, which
// is never mounted. A device node, FIFO or setuid file of a layer is an
// inode inside the image, never a file of the host, and a symlink of a
// layer is resolved in the model, inside the image.
type Filesystem struct {
	raw   string // the ext4 image file
	work  string // a directory of the builder's own (file contents, scripts)
	tree  *Tree
	limit int64 // bytes the image's files may hold
	runs  int
}

// Stat describes a name of the image, every symlink followed inside it.
func (fs *Filesystem) Stat(name string) (Entry, error) { return fs.tree.Stat(name) }

// ReadFile reads a regular file of the image (symlinks followed inside
// it) of at most max bytes. Anything else is refused (ErrUnusable, naming
// the file) and never read: a device node, a FIFO, a directory, a bigger
// file, a path that does not resolve. A name the image does not have is
// an error IsNotExist tells.
func (fs *Filesystem) ReadFile(ctx context.Context, name string, max int64) ([]byte, error) {
	r, err := fs.tree.resolve(name, true, false)
	if err != nil {
		return nil, fmt.Errorf("%w: its /%s: %v", ErrUnusable, name, err)
	}
	if r.target == nil {
		return nil, fmt.Errorf("%s: %w", name, errNotExist)
	}
	if r.target.typ != tar.TypeReg {
		return nil, fmt.Errorf("%w: its /%s is %s, not a regular file", ErrUnusable, name, typeName(r.target.typ))
	}
	if r.target.size > max {
		return nil, fmt.Errorf("%w: its /%s holds %d bytes (at most %d)", ErrUnusable, name, r.target.size, max)
	}
	var out bytes.Buffer
	stderr := &limitedBuffer{max: 64 << 10}
	cmd := exec.CommandContext(ctx, "debugfs", "-R", "cat "+quote(fullPath(r.dir, r.base)), fs.raw)
	cmd.Stdout, cmd.Stderr = &limitedBuffer{buf: &out, max: max}, stderr
	if err := cmd.Run(); err != nil {
		return nil, fmt.Errorf("debugfs cat %s: %v: %s", name, err, stderr)
	}
	if msg := debugfsErrors(stderr.String()); msg != "" {
		return nil, fmt.Errorf("debugfs cat %s: %s", name, msg)
	}
	if int64(out.Len()) != r.target.size {
		return nil, fmt.Errorf("debugfs cat %s: %d bytes, the image says %d", name, out.Len(), r.target.size)
	}
	return out.Bytes(), nil
}

func typeName(typ byte) string {
	switch typ {
	case tar.TypeDir:
		return "a directory"
	case tar.TypeSymlink:
		return "a symlink"
	case tar.TypeChar:
		return "a character device"
	case tar.TypeBlock:
		return "a block device"
	case tar.TypeFifo:
		return "a FIFO"
	}
	return "a regular file"
}

// Apply applies a layer (an uncompressed tar stream) to the image: entries
// are created or replaced, `.wh.NAME` whiteouts delete NAME from the
// layers below, and `.wh..wh..opq` empties a directory of what the layers
// below put there. An entry the image cannot hold is refused (ErrEntry,
// naming it); the build then discards the image and its model.
func (fs *Filesystem) Apply(ctx context.Context, r io.Reader) error {
	fs.runs++
	dir := filepath.Join(fs.work, fmt.Sprintf("apply-%d", fs.runs))
	if err := os.Mkdir(dir, 0o700); err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	scriptPath := filepath.Join(dir, "script")
	f, err := os.OpenFile(scriptPath, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return err
	}
	defer f.Close()
	a := &applier{fs: fs, dir: dir, out: bufio.NewWriterSize(f, 1<<20), written: map[string]bool{}}
	if err := a.layer(ctx, tar.NewReader(r)); err != nil {
		return err
	}
	if err := a.out.Flush(); err != nil {
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	if testHookApplied != nil {
		testHookApplied(dir)
	}
	return fs.runScript(ctx, scriptPath, dir)
}

// testHookApplied, set by tests, sees the builder's directory once a
// layer's data and script are written.
var testHookApplied func(dir string)

// runScript runs a debugfs script on the image and checks the image after.
func (fs *Filesystem) runScript(ctx context.Context, script, dir string) error {
	out := &limitedBuffer{max: 1 << 20}
	cmd := exec.CommandContext(ctx, "debugfs", "-w", "-f", script, fs.raw)
	cmd.Stdout, cmd.Stderr = io.Discard, out
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("debugfs: %v: %s", err, out)
	}
	if msg := debugfsErrors(out.String()); msg != "" {
		msg = strings.ReplaceAll(msg, dir+"/", "")
		if strings.Contains(msg, "Could not allocate") || strings.Contains(msg, "No free space") {
			return fmt.Errorf("%w: the image's file system is full: %s", ErrEntry, firstLine(msg))
		}
		return fmt.Errorf("debugfs: %s", msg)
	}
	return checkFS(ctx, fs.raw)
}

// checkFS runs e2fsck on the image without changing it: a layer is only
// kept when its file system checks clean.
func checkFS(ctx context.Context, raw string) error {
	if err := run(ctx, "e2fsck", "-fn", raw); err != nil {
		return fmt.Errorf("the layer's file system does not check clean: %w", err)
	}
	return nil
}

func firstLine(s string) string {
	s, _, _ = strings.Cut(s, "\n")
	return s
}

// debugfsErrors is what debugfs wrote to its standard error besides its
// banner: every such line is an error of a command.
func debugfsErrors(stderr string) string {
	var errs []string
	for _, l := range strings.Split(stderr, "\n") {
		if l == "" || (strings.HasPrefix(l, "debugfs ") && strings.Contains(l, "(")) {
			continue
		}
		errs = append(errs, l)
	}
	return strings.Join(errs, "\n")
}

// limitedBuffer keeps at most max bytes and fails the write past them.
type limitedBuffer struct {
	buf *bytes.Buffer
	max int64
}

func (b *limitedBuffer) Write(p []byte) (int, error) {
	if b.buf == nil {
		b.buf = &bytes.Buffer{}
	}
	if int64(b.buf.Len()+len(p)) > b.max {
		return 0, errors.New("too much output")
	}
	return b.buf.Write(p)
}

func (b *limitedBuffer) String() string {
	if b.buf == nil {
		return ""
	}
	return strings.TrimSpace(b.buf.String())
}

// quote makes s one argument of a debugfs command: debugfs's parser takes
// a double-quoted string as one argument and "" inside it as a quote.
// Names reach here without control characters (checkName), so a command
// is always one line.
func quote(s string) string { return `"` + strings.ReplaceAll(s, `"`, `""`) + `"` }

// fullPath is the image path of name base in directory dir.
func fullPath(dir []string, base string) string { return path.Join(absPath(dir), base) }

// applier turns one layer into a debugfs script over the model.
type applier struct {
	fs      *Filesystem
	dir     string
	out     *bufio.Writer
	cwd     []string
	cwdSet  bool
	files   int
	written map[string]bool // paths this layer made (an opaque whiteout spares them)
}

func (a *applier) cmd(args ...string) {
	a.out.WriteString(strings.Join(args, " "))
	a.out.WriteByte('\n')
}

// cd makes dir debugfs's working directory, moving down from the current
// one when dir is below it (a path from the root costs a lookup per
// component).
func (a *applier) cd(dir []string) {
	if a.cwdSet && slices.Equal(a.cwd, dir) {
		return
	}
	if a.cwdSet && len(dir) > len(a.cwd) && slices.Equal(a.cwd, dir[:len(a.cwd)]) {
		a.cmd("cd", quote("./"+strings.Join(dir[len(a.cwd):], "/")))
	} else {
		a.cmd("cd", quote(absPath(dir)))
	}
	a.cwd, a.cwdSet = append([]string(nil), dir...), true
}

// here names base in the working directory for commands that take a path
// (./NAME: never read as an inode number or an option).
func here(base string) string { return quote("./" + base) }

func (a *applier) layer(ctx context.Context, tr *tar.Reader) error {
	for n := 0; ; n++ {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("%w: read layer: %v", ErrEntry, err)
		}
		if n%256 == 0 {
			if err := ctx.Err(); err != nil {
				return err
			}
		}
		if err := a.entry(h, tr); err != nil {
			if errors.Is(err, errHost) {
				return fmt.Errorf("layer entry %q: %w", h.Name, err)
			}
			return fmt.Errorf("%w %q: %v", ErrEntry, h.Name, err)
		}
	}
}

// errHost marks a failure of the node itself (its disk), not of the entry.
var errHost = errors.New("writing the layer's data")

func (a *applier) entry(h *tar.Header, r io.Reader) error {
	if err := checkName(h.Name, maxNameBytes); err != nil {
		return err
	}
	t := a.fs.tree
	dirName, base := splitLast(h.Name)
	switch {
	case base == ".wh..wh..opq":
		res, err := t.resolve(dirName+"/.", true, true)
		if err != nil {
			return err
		}
		a.made(res)
		if res.target == nil || !res.target.isDir() {
			return fmt.Errorf("an opaque whiteout in %q, which is not a directory", dirName)
		}
		dir := res.path()
		for _, n := range sortedNames(res.target) {
			if !a.written[fullPath(dir, n)] {
				a.remove(dir, res.target, n)
			}
		}
		return nil
	case strings.HasPrefix(base, ".wh."):
		gone := strings.TrimPrefix(base, ".wh.")
		if gone == "" || gone == "." || gone == ".." {
			return fmt.Errorf("a whiteout of %q", gone)
		}
		res, err := t.resolve(dirName+"/.", true, false)
		if err != nil || res.target == nil || !res.target.isDir() {
			return nil // nothing there to hide
		}
		a.remove(res.path(), res.target, gone)
		return nil
	}
	switch h.Typeflag {
	case tar.TypeDir, tar.TypeReg, tar.TypeGNUSparse, tar.TypeSymlink, tar.TypeLink, tar.TypeChar, tar.TypeBlock, tar.TypeFifo:
	default:
		return nil // pax globals and the like carry no file
	}
	res, err := t.resolve(h.Name, false, true)
	if err != nil {
		return err
	}
	a.made(res)
	if res.base == "" {
		return nil // the root's own attributes are the base file system's
	}
	full := fullPath(res.dir, res.base)
	a.written[full] = true
	if h.Typeflag == tar.TypeLink {
		return a.hardLink(h, res, full)
	}
	isDir := h.Typeflag == tar.TypeDir
	if res.target != nil && !(isDir && res.target.isDir()) {
		a.remove(res.dir, res.dirEnt, res.base)
		res.target = nil
	}
	e := res.target
	if e == nil {
		if t.entries >= maxEntries {
			return fmt.Errorf("more than %d names in the image", maxEntries)
		}
		e = &entry{nlink: 1}
	}
	e.mode, e.uid, e.gid = h.Mode&0o7777, h.Uid, h.Gid
	if h.Uid < 0 || h.Gid < 0 || h.Uid > 1<<32-2 || h.Gid > 1<<32-2 {
		return fmt.Errorf("owner %d:%d", h.Uid, h.Gid)
	}
	fresh := res.target == nil
	a.cd(res.dir)
	switch h.Typeflag {
	case tar.TypeDir:
		e.typ = tar.TypeDir
		if fresh {
			e.children = map[string]*entry{}
			a.cmd("mkdir", quote(res.base))
		}
	case tar.TypeReg, tar.TypeGNUSparse:
		if h.Size < 0 || h.Size > a.fs.limit-t.bytes {
			return fmt.Errorf("%d bytes would take the image's files past its size (%d MiB)", h.Size, a.fs.limit>>20)
		}
		src, err := a.data(r, h.Size)
		if err != nil {
			return err
		}
		e.typ, e.size = tar.TypeReg, h.Size
		t.bytes += h.Size
		a.cmd("write", quote(src), quote(res.base))
	case tar.TypeSymlink:
		if err := checkName(h.Linkname, maxLinkTarget); err != nil {
			return fmt.Errorf("symlink target: %v", err)
		}
		if h.Linkname == "" {
			return errors.New("a symlink with no target")
		}
		e.typ, e.link = tar.TypeSymlink, h.Linkname
		a.cmd("symlink", quote(res.base), quote(h.Linkname))
	case tar.TypeChar, tar.TypeBlock, tar.TypeFifo:
		e.typ = h.Typeflag
		switch h.Typeflag {
		case tar.TypeFifo:
			a.cmd("mknod", quote(res.base), "p")
		default:
			if h.Devmajor < 0 || h.Devminor < 0 || h.Devmajor > 0xfff || h.Devminor > 0xfffff {
				return fmt.Errorf("device number %d:%d", h.Devmajor, h.Devminor)
			}
			kind := map[byte]string{tar.TypeChar: "c", tar.TypeBlock: "b"}[h.Typeflag]
			a.cmd("mknod", quote(res.base), kind, strconv.FormatInt(h.Devmajor, 10), strconv.FormatInt(h.Devminor, 10))
		}
	}
	if fresh {
		res.dirEnt.children[res.base] = e
		t.entries++
	}
	p := here(res.base)
	if e.typ != tar.TypeSymlink {
		a.cmd("sif", p, "mode", "0"+strconv.FormatInt(int64(typeBits[e.typ])|e.mode, 8))
	}
	a.cmd("sif", p, "uid", strconv.Itoa(h.Uid))
	a.cmd("sif", p, "gid", strconv.Itoa(h.Gid))
	mtime := fsTime(h.ModTime)
	atime := mtime
	if !h.AccessTime.IsZero() {
		atime = fsTime(h.AccessTime)
	}
	a.cmd("sif", p, "mtime", mtime)
	a.cmd("sif", p, "atime", atime)
	a.cmd("sif", p, "ctime", mtime)
	return a.xattrs(h, p)
}

// typeBits are the file type bits of an inode's mode.
var typeBits = map[byte]uint32{
	tar.TypeDir: 0o040000, tar.TypeReg: 0o100000, tar.TypeSymlink: 0o120000,
	tar.TypeChar: 0o020000, tar.TypeBlock: 0o060000, tar.TypeFifo: 0o010000,
}

// fsTime is a time as debugfs takes it, within what ext4 stores.
func fsTime(t time.Time) string {
	s := t.Unix()
	if t.IsZero() || s < 0 {
		s = 0
	}
	if s > 1<<32-1 {
		s = 1<<32 - 1
	}
	return "@" + strconv.FormatInt(s, 10)
}

// xattrAllowed tells whether an extended attribute of a layer is kept:
// the user, security and trusted namespaces and POSIX ACLs.
func xattrAllowed(name string) bool {
	for _, p := range []string{"user.", "security.", "trusted."} {
		if strings.HasPrefix(name, p) && len(name) > len(p) {
			return true
		}
	}
	return name == "system.posix_acl_access" || name == "system.posix_acl_default"
}

// xattrs sets the entry's extended attributes; p names it in the working
// directory.
func (a *applier) xattrs(h *tar.Header, p string) error {
	keys := make([]string, 0, len(h.PAXRecords))
	for k := range h.PAXRecords {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		name, ok := strings.CutPrefix(k, "SCHILY.xattr.")
		if !ok || !xattrAllowed(name) {
			continue
		}
		if err := checkName(name, maxComponent); err != nil {
			return fmt.Errorf("xattr name: %v", err)
		}
		v := h.PAXRecords[k]
		if len(v) > maxXattrBytes {
			return fmt.Errorf("xattr %s of %d bytes", name, len(v))
		}
		src, err := a.data(strings.NewReader(v), int64(len(v)))
		if err != nil {
			return err
		}
		a.cmd("ea_set", "-f", quote(src), p, quote(name))
	}
	return nil
}

// hardLink makes the entry a second name of an earlier one.
func (a *applier) hardLink(h *tar.Header, res *resolved, full string) error {
	t := a.fs.tree
	if err := checkName(h.Linkname, maxNameBytes); err != nil {
		return fmt.Errorf("hard link target: %v", err)
	}
	tres, err := t.resolve(h.Linkname, false, false)
	if err != nil {
		return fmt.Errorf("hard link target: %v", err)
	}
	if tres.target == nil || tres.base == "" {
		return fmt.Errorf("a hard link to %q, which the image does not have", h.Linkname)
	}
	if tres.target.isDir() {
		return fmt.Errorf("a hard link to the directory %q", h.Linkname)
	}
	target := fullPath(tres.dir, tres.base)
	if target == full {
		return nil // a link to itself
	}
	if res.target == tres.target {
		return nil // already a name of it
	}
	if tres.target.nlink >= maxLinks {
		return fmt.Errorf("more than %d names of %q", maxLinks, h.Linkname)
	}
	if res.target != nil {
		a.remove(res.dir, res.dirEnt, res.base)
	}
	if t.entries >= maxEntries {
		return fmt.Errorf("more than %d names in the image", maxEntries)
	}
	a.cd(res.dir)
	a.cmd("ln", quote(target), quote(res.base))
	tres.target.nlink++
	a.cmd("sif", here(res.base), "links_count", strconv.Itoa(tres.target.nlink))
	res.dirEnt.children[res.base] = tres.target
	t.entries++
	return nil
}

// made writes the directories resolve created in the model.
func (a *applier) made(res *resolved) {
	for _, c := range res.created {
		a.cd(c[:len(c)-1])
		a.cmd("mkdir", quote(c[len(c)-1]))
		a.cmd("sif", here(c[len(c)-1]), "mode", "040755")
		a.written[fullPath(c[:len(c)-1], c[len(c)-1])] = true
	}
}

// remove deletes a name and everything below it, in the model and the
// image.
func (a *applier) remove(dir []string, dirEnt *entry, base string) {
	a.fs.tree.remove(dir, dirEnt, base, func(comps []string, e *entry) {
		dir, base := comps[:len(comps)-1], comps[len(comps)-1]
		delete(a.written, fullPath(dir, base))
		a.cd(dir)
		if e.isDir() {
			a.cmd("rmdir", here(base))
		} else {
			a.cmd("rm", here(base))
		}
	})
}

// data writes n bytes of an entry to a file of the builder's own, for
// debugfs to copy into the image. Runs of zeros become holes, so a sparse
// entry costs the host's disk only what it holds.
func (a *applier) data(r io.Reader, n int64) (string, error) {
	a.files++
	name := filepath.Join(a.dir, strconv.Itoa(a.files))
	f, err := os.OpenFile(name, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return "", fmt.Errorf("%w: %v", errHost, err)
	}
	defer f.Close()
	buf := make([]byte, 64<<10)
	var off int64
	for off < n {
		chunk := buf[:min(int64(len(buf)), n-off)]
		if _, err := io.ReadFull(r, chunk); err != nil {
			return "", fmt.Errorf("read: %v", err)
		}
		if !allZero(chunk) {
			if _, err := f.WriteAt(chunk, off); err != nil {
				return "", fmt.Errorf("%w: %v", errHost, err)
			}
		}
		off += int64(len(chunk))
	}
	if err := f.Truncate(n); err != nil {
		return "", fmt.Errorf("%w: %v", errHost, err)
	}
	if err := f.Close(); err != nil {
		return "", fmt.Errorf("%w: %v", errHost, err)
	}
	return name, nil
}

func allZero(b []byte) bool {
	for _, c := range b {
		if c != 0 {
			return false
		}
	}
	return true
}

// splitLast splits a tar name into its directory and last name, as
// written (resolve cleans them).
func splitLast(name string) (string, string) {
	name = strings.TrimRight(name, "/")
	i := strings.LastIndex(name, "/")
	if i < 0 {
		return "", name
	}
	return name[:i], name[i+1:]
}
