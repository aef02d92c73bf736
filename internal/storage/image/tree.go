package image

import (
	"archive/tar"
	"bytes"
	"encoding/gob"
	"errors"
	"fmt"
	"path"
	"sort"
	"strings"
)

// The tree is the node's model of an image's file system: every name, its
// type, attributes and, for symlinks, target. A layer is applied to the
// model first; what the model decides (which names to create, replace or
// remove, where a path resolves) is then written into the image file as
// data (see ext4.go). Nothing of an image is ever made a file of the host.

// Bounds on what one image may hold.
const (
	maxNameBytes   = 4095    // a path inside the image (PATH_MAX less the NUL)
	maxComponent   = 255     // one name in a directory (ext4's limit)
	maxLinkTarget  = 4095    // a symlink's target
	maxEntries     = 1 << 20 // names in one image
	maxLinks       = 65000   // names of one inode (ext4's limit)
	maxSymlinkHops = 40      // symlinks followed resolving one path (Linux's limit)
	maxXattrBytes  = 64 << 10
)

// ErrEntry marks a layer entry the node refuses (an ErrImage): its message
// names the entry and why.
var ErrEntry = fmt.Errorf("%w: refused layer entry", ErrImage)

// entry is one inode of the tree; the names of a hard-linked file share one.
type entry struct {
	typ      byte // tar.TypeDir, TypeReg, TypeSymlink, TypeChar, TypeBlock or TypeFifo
	mode     int64
	uid, gid int
	size     int64  // regular files
	link     string // symlinks
	nlink    int    // names (non-directories)
	children map[string]*entry
}

func (e *entry) isDir() bool { return e.typ == tar.TypeDir }

// Tree is the model of one image's file system.
type Tree struct {
	root    *entry
	entries int   // names
	bytes   int64 // bytes of regular files, each inode once
}

// newTree is the model of a file system fresh from mkfs.ext4: the root and
// lost+found.
func newTree() *Tree {
	t := &Tree{root: &entry{typ: tar.TypeDir, mode: 0o755, children: map[string]*entry{}}}
	t.root.children["lost+found"] = &entry{typ: tar.TypeDir, mode: 0o700, children: map[string]*entry{}}
	t.entries = 1
	return t
}

// Entry describes a name of the tree, for callers that look inside an
// image (the E2B conventions).
type Entry struct {
	Type byte // a tar type flag
	Mode int64
	Size int64
}

// Entries is how many names the image holds.
func (t *Tree) Entries() int { return t.entries }

// absPath is the image path of the components.
func absPath(comps []string) string { return "/" + strings.Join(comps, "/") }

// split turns a path into its components, leaving out empty ones.
func split(p string) []string {
	var out []string
	for _, c := range strings.Split(p, "/") {
		if c != "" {
			out = append(out, c)
		}
	}
	return out
}

// checkName refuses a name the image cannot hold or the writer cannot pass
// on as data: too long, a component over 255 bytes, control characters.
func checkName(name string, max int) error {
	if len(name) > max {
		return fmt.Errorf("a name of %d bytes (at most %d)", len(name), max)
	}
	for i := 0; i < len(name); i++ {
		if c := name[i]; c < 0x20 || c == 0x7f {
			return fmt.Errorf("a control character (%#02x) in a name", c)
		}
	}
	return nil
}

// resolved is where a path leads: the directory holding its last name
// (canonical components, no symlink among them) and that name ("" for the
// root itself).
type resolved struct {
	dir     []string
	dirEnt  *entry
	base    string
	target  *entry // the entry at base, nil if none
	created [][]string
}

// path is the components of the resolved name itself (nil: the root).
func (r *resolved) path() []string {
	if r.base == "" {
		return nil
	}
	return append(append([]string(nil), r.dir...), r.base)
}

// sortedNames lists a directory's names in order.
func sortedNames(dir *entry) []string {
	names := make([]string, 0, len(dir.children))
	for n := range dir.children {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

// resolve finds name in the tree as the kernel would with the tree as the
// root directory: ".." stops at the root, symlinks (absolute ones from the
// root) are followed on the way, and the last name too if followLast.
// Missing directories on the way are created in the model when mkdirs is
// set (their components are returned in created, in order); otherwise a
// missing directory leaves target nil.
func (t *Tree) resolve(name string, followLast, mkdirs bool) (*resolved, error) {
	todo := split(name)
	var comps []string
	stack := []*entry{t.root}
	r := &resolved{}
	hops := 0
	for len(todo) > 0 {
		c := todo[0]
		todo = todo[1:]
		cur := stack[len(stack)-1]
		switch c {
		case ".":
			continue
		case "..":
			if len(comps) > 0 {
				comps, stack = comps[:len(comps)-1], stack[:len(stack)-1]
			}
			continue
		}
		if len(c) > maxComponent {
			return nil, fmt.Errorf("a name of %d bytes (at most %d)", len(c), maxComponent)
		}
		last := len(todo) == 0
		child := cur.children[c]
		if last && (!followLast || child == nil || child.typ != tar.TypeSymlink) {
			r.dir, r.dirEnt, r.base, r.target = append([]string(nil), comps...), cur, c, child
			return r, nil
		}
		if child == nil {
			if !mkdirs {
				return r, nil // a missing directory: nothing there
			}
			if t.entries >= maxEntries {
				return nil, fmt.Errorf("more than %d names", maxEntries)
			}
			child = &entry{typ: tar.TypeDir, mode: 0o755, children: map[string]*entry{}}
			cur.children[c] = child
			t.entries++
			r.created = append(r.created, append(append([]string(nil), comps...), c))
		}
		if child.typ == tar.TypeSymlink {
			if hops++; hops > maxSymlinkHops {
				return nil, fmt.Errorf("more than %d symlinks resolving %q", maxSymlinkHops, name)
			}
			if strings.HasPrefix(child.link, "/") {
				comps, stack = nil, stack[:1]
			}
			todo = append(split(child.link), todo...)
			continue
		}
		if !child.isDir() {
			return nil, fmt.Errorf("%q is not a directory", absPath(append(comps, c)))
		}
		comps, stack = append(comps, c), append(stack, child)
	}
	// The path ends in the root (or a directory reached through "..").
	r.dir, r.dirEnt, r.target = comps, stack[len(stack)-1], stack[len(stack)-1]
	if len(comps) > 0 {
		r.dir, r.dirEnt, r.base = comps[:len(comps)-1], stack[len(stack)-2], comps[len(comps)-1]
	}
	return r, nil
}

// Stat describes name, resolved inside the tree with every symlink
// followed (as open(2) would in the guest).
func (t *Tree) Stat(name string) (Entry, error) {
	r, err := t.resolve(name, true, false)
	if err != nil {
		return Entry{}, err
	}
	if r.target == nil {
		return Entry{}, fmt.Errorf("%s: %w", name, errNotExist)
	}
	return Entry{Type: r.target.typ, Mode: r.target.mode, Size: r.target.size}, nil
}

var errNotExist = errors.New("no such file or directory")

// IsNotExist tells whether err says a name is not in the image.
func IsNotExist(err error) bool { return errors.Is(err, errNotExist) }

// remove takes the name out of its directory, with everything below it,
// calling gone for each name in the order the names must be deleted
// (children first).
func (t *Tree) remove(dir []string, dirEnt *entry, base string, gone func(comps []string, e *entry)) {
	e := dirEnt.children[base]
	if e == nil {
		return
	}
	comps := append(append([]string(nil), dir...), base)
	if e.isDir() {
		for _, n := range sortedNames(e) {
			t.remove(comps, e, n, gone)
		}
	} else {
		e.nlink--
		if e.nlink == 0 && e.typ == tar.TypeReg {
			t.bytes -= e.size
		}
	}
	delete(dirEnt.children, base)
	t.entries--
	gone(comps, e)
}

// treeRecord is one name of a saved tree; names of one inode share Inode.
type treeRecord struct {
	Path     string
	Type     byte
	Mode     int64
	UID, GID int
	Size     int64
	Link     string
	Inode    int
}

// marshal saves the tree (names sorted, parents first).
func (t *Tree) marshal() ([]byte, error) {
	var recs []treeRecord
	ids := map[*entry]int{}
	var walk func(comps []string, e *entry)
	walk = func(comps []string, e *entry) {
		for _, n := range sortedNames(e) {
			c := e.children[n]
			id, ok := ids[c]
			if !ok {
				id = len(ids) + 1
				ids[c] = id
			}
			p := append(append([]string(nil), comps...), n)
			recs = append(recs, treeRecord{Path: absPath(p), Type: c.typ, Mode: c.mode, UID: c.uid, GID: c.gid,
				Size: c.size, Link: c.link, Inode: id})
			if c.isDir() {
				walk(p, c)
			}
		}
	}
	walk(nil, t.root)
	var buf bytes.Buffer
	err := gob.NewEncoder(&buf).Encode(struct {
		Root treeRecord
		Recs []treeRecord
	}{treeRecord{Mode: t.root.mode, UID: t.root.uid, GID: t.root.gid}, recs})
	return buf.Bytes(), err
}

// unmarshalTree loads a tree saved by marshal.
func unmarshalTree(b []byte) (*Tree, error) {
	var saved struct {
		Root treeRecord
		Recs []treeRecord
	}
	if err := gob.NewDecoder(bytes.NewReader(b)).Decode(&saved); err != nil {
		return nil, fmt.Errorf("layer tree: %w", err)
	}
	t := &Tree{root: &entry{typ: tar.TypeDir, mode: saved.Root.Mode, uid: saved.Root.UID, gid: saved.Root.GID, children: map[string]*entry{}}}
	inodes := map[int]*entry{}
	for _, r := range saved.Recs {
		dir, base := path.Split(r.Path)
		res, err := t.resolve(dir, false, false)
		if err != nil || res.target == nil || !res.target.isDir() || base == "" {
			return nil, fmt.Errorf("layer tree: %q has no directory", r.Path)
		}
		parent := res.target
		e := inodes[r.Inode]
		if e == nil {
			e = &entry{typ: r.Type, mode: r.Mode, uid: r.UID, gid: r.GID, size: r.Size, link: r.Link}
			if e.isDir() {
				e.children = map[string]*entry{}
			} else if e.typ == tar.TypeReg {
				t.bytes += e.size
			}
			inodes[r.Inode] = e
		}
		if !e.isDir() {
			e.nlink++
		}
		parent.children[base] = e
		t.entries++
	}
	return t, nil
}
