package guest

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/agentenv/agentenv/internal/guestsource"
	"github.com/agentenv/agentenv/internal/storage"
)

// DefaultUID is the uid (and gid) of the sandboxes' default user, user.
const DefaultUID = 1000

// Rootfs kinds.
const (
	RootfsBase    = "base"    // Debian bookworm minbase via debootstrap, with python3, git, curl, sudo…
	RootfsMinimal = "minimal" // busybox-static only; builds in seconds, for tests
)

// BasePackages are installed into the base rootfs on top of minbase.
var BasePackages = []string{"bash", "python3", "git", "curl", "ca-certificates", "procps", "sudo", "iproute2"}

// defaultHostname is a rootfs's /etc/hostname when its spec names none.
const defaultHostname = "aenv"

// BaseToolPackages are what E2B's base has beside those, so that code
// ported from E2B finds them: `python` (python3), `pip`, `node` and `npm`,
// Debian's. They are installed with apt in the tree after debootstrap.
var BaseToolPackages = []string{"python-is-python3", "python3-pip", "nodejs", "npm"}

// basePackages is every package of a base rootfs of spec, BasePackages
// first.
func (spec RootfsSpec) basePackages() []string {
	return slices.Concat(BasePackages, BaseToolPackages, spec.ExtraPackages)
}

// baseFiles are the files written into every base rootfs (spec's
// ExtraFiles come after), by path in the tree.
func baseFiles(hostname string) map[string]string {
	return map[string]string{
		"etc/sudoers.d/user": "user ALL=(ALL:ALL) NOPASSWD: ALL\n",
		"etc/hostname":       hostname + "\n",
		"etc/hosts":          "127.0.0.1\tlocalhost\n127.0.1.1\t" + hostname + "\n::1\tlocalhost ip6-localhost ip6-loopback\n",
		"etc/fstab":          "# The root filesystem is mounted by aenv-init (the initramfs).\n/dev/vda\t/\text4\trw,relatime\t0\t1\n",
		"etc/resolv.conf":    "# written by aenv-init from aenv.dns= at boot\n",
		// A sandbox is the user's own machine: `pip install` works there
		// as in E2B's sandboxes (into ~/.local for user), without
		// Debian's refusal to touch an "externally managed" Python.
		"etc/pip.conf": "[global]\nbreak-system-packages = true\n",
	}
}

// RootfsSpec describes a root filesystem image to build.
type RootfsSpec struct {
	Kind          string   // RootfsBase or RootfsMinimal
	Suite         string   // Debian suite for base, default "bookworm"
	Mirror        string   // Debian mirror URL for base; default: read from /etc/apt/sources.list(.d)
	Components    []string // archive components for base (debootstrap --components); default: the suite's own (main)
	ExtraPackages []string // added to BasePackages (base only)
	ExtraFiles    []File   // written into the tree last (base only)
	Hostname      string   // written to /etc/hostname, default "aenv"
	KernelVersion string   // recorded in the manifest
	SizeMiB       int      // filesystem size; default: content*1.3 + 256 MiB
	WorkDir       string   // where the tree and raw image are assembled; default: beside out
}

// Recipe names what an image built from spec holds: its kind, suite,
// packages and extra files (contents and modes), so that a changed recipe
// can be told from the manifest of an older build.
func (spec RootfsSpec) Recipe() string {
	h := sha256.New()
	suite := spec.Suite
	if suite == "" {
		suite = "bookworm"
	}
	fmt.Fprintf(h, "kind %q\nsuite %q\n", spec.Kind, suite)
	if spec.Kind == RootfsBase {
		for _, p := range spec.basePackages() {
			fmt.Fprintf(h, "package %q\n", p)
		}
		// The hostname is not what tells images apart (the guest's is
		// set at boot).
		files := baseFiles(defaultHostname)
		for _, name := range slices.Sorted(maps.Keys(files)) {
			fmt.Fprintf(h, "base file %q %x\n", name, sha256.Sum256([]byte(files[name])))
		}
		for _, f := range spec.ExtraFiles {
			fmt.Fprintf(h, "file %q %o %x\n", f.Path, f.Mode.Perm(), sha256.Sum256(f.Data))
		}
	}
	return hex.EncodeToString(h.Sum(nil))
}

// File is a file added to a root filesystem, owned by root.
type File struct {
	Path string // absolute, in the guest
	Mode fs.FileMode
	Data []byte
}

// RootfsManifest is written next to a built image as <image>.json.
type RootfsManifest struct {
	Kind          string   `json:"kind"`
	Format        string   `json:"format"`
	KernelVersion string   `json:"kernelVersion,omitempty"`
	Suite         string   `json:"suite,omitempty"`
	Packages      []string `json:"packages,omitempty"`
	// Recipe is the spec's Recipe(): a build of another recipe is out of
	// date.
	Recipe       string    `json:"recipe,omitempty"`
	SizeBytes    int64     `json:"sizeBytes"`
	VirtualBytes int64     `json:"virtualBytes"`
	ContentBytes int64     `json:"contentBytes"`
	SHA256       string    `json:"sha256"`
	Created      time.Time `json:"created"`
	BuildSeconds float64   `json:"buildSeconds"`
}

// ManifestPath is where BuildRootfs records the manifest of image out.
func ManifestPath(out string) string { return out + ".json" }

// ReadManifest reads the manifest of image out.
func ReadManifest(out string) (*RootfsManifest, error) {
	b, err := os.ReadFile(ManifestPath(out))
	if err != nil {
		return nil, fmt.Errorf("read rootfs manifest: %w", err)
	}
	var m RootfsManifest
	if err := json.Unmarshal(b, &m); err != nil {
		return nil, fmt.Errorf("parse rootfs manifest %s: %w", ManifestPath(out), err)
	}
	return &m, nil
}

// BuildRootfs builds a root filesystem of spec.Kind into an ext4 image and
// converts it to the qcow2 file out (written atomically), usable as a
// read-only backing layer, then records its manifest (ManifestPath(out)),
// also atomically and last. It must run as root.
func BuildRootfs(ctx context.Context, spec RootfsSpec, out string, log func(string, ...any)) error {
	if log == nil {
		log = func(string, ...any) {}
	}
	start := time.Now()
	if spec.Suite == "" {
		spec.Suite = "bookworm"
	}
	if spec.Hostname == "" {
		spec.Hostname = defaultHostname
	}
	if os.Geteuid() != 0 {
		return fmt.Errorf("build %s rootfs: must run as root (debootstrap and file ownership)", spec.Kind)
	}
	outDir := filepath.Dir(out)
	if err := os.MkdirAll(outDir, 0o755); err != nil {
		return fmt.Errorf("build rootfs: %w", err)
	}
	workParent := spec.WorkDir
	if workParent == "" {
		workParent = outDir
	}
	if err := os.MkdirAll(workParent, 0o755); err != nil {
		return fmt.Errorf("build rootfs: %w", err)
	}
	removeStaleWorkDirs(workParent, log)
	work, err := os.MkdirTemp(workParent, workPrefix+spec.Kind+"-")
	if err != nil {
		return fmt.Errorf("build rootfs: %w", err)
	}
	defer func() {
		if err := removeWorkDir(work); err != nil {
			log("%v", err)
		}
	}()
	tree := filepath.Join(work, "tree")

	var pkgs []string
	switch spec.Kind {
	case RootfsBase:
		pkgs = spec.basePackages()
		if err := buildBaseTree(ctx, spec, pkgs, tree, log); err != nil {
			return fmt.Errorf("build base rootfs: %w", err)
		}
	case RootfsMinimal:
		if err := buildMinimalTree(ctx, spec, tree); err != nil {
			return fmt.Errorf("build minimal rootfs: %w", err)
		}
	default:
		return fmt.Errorf("build rootfs: unknown kind %q (want %q or %q)", spec.Kind, RootfsBase, RootfsMinimal)
	}
	log("%s rootfs tree ready in %s", spec.Kind, time.Since(start).Round(time.Millisecond))

	content, err := treeSize(tree)
	if err != nil {
		return fmt.Errorf("build rootfs: measure tree: %w", err)
	}
	sizeMiB := spec.SizeMiB
	if sizeMiB <= 0 {
		sizeMiB = int(float64(content)*1.3/(1<<20)) + 256
		sizeMiB = (sizeMiB + 63) / 64 * 64
	}
	raw := filepath.Join(work, "rootfs.ext4")
	log("making ext4 image of %d MiB (content %d MiB)", sizeMiB, content>>20)
	if err := run(ctx, "mkfs.ext4", "-q", "-F", "-L", "aenv-root", "-d", tree,
		"-E", "root_owner=0:0", raw, fmt.Sprintf("%dM", sizeMiB)); err != nil {
		return fmt.Errorf("build rootfs: %w", err)
	}
	// Reclaim the tree's space before conversion doubles the disk usage.
	if err := removeWorkDir(tree); err != nil {
		return fmt.Errorf("build rootfs: %w", err)
	}
	tmpOut := filepath.Join(outDir, "."+filepath.Base(out)+".tmp")
	_ = os.Remove(tmpOut)
	defer os.Remove(tmpOut)
	if err := run(ctx, "qemu-img", "convert", "-q", "-f", "raw", "-O", "qcow2", "-o", "cluster_size=65536", raw, tmpOut); err != nil {
		return fmt.Errorf("build rootfs: %w", err)
	}
	sum, size, err := sha256File(tmpOut)
	if err != nil {
		return fmt.Errorf("build rootfs: %w", err)
	}
	if f, err := os.Open(tmpOut); err == nil {
		_ = f.Sync()
		f.Close()
	}
	if err := os.Chmod(tmpOut, 0o444); err != nil {
		return fmt.Errorf("build rootfs: %w", err)
	}
	if err := os.Rename(tmpOut, out); err != nil {
		return fmt.Errorf("build rootfs: install image: %w", err)
	}
	m := RootfsManifest{
		Kind: spec.Kind, Format: "qcow2", KernelVersion: spec.KernelVersion,
		SizeBytes: size, VirtualBytes: int64(sizeMiB) << 20, ContentBytes: content,
		SHA256: sum, Created: time.Now().UTC().Truncate(time.Second),
		BuildSeconds: time.Since(start).Seconds(), Recipe: spec.Recipe(),
	}
	if spec.Kind == RootfsBase {
		m.Suite, m.Packages = spec.Suite, pkgs
	}
	mb, err := json.MarshalIndent(m, "", "  ")
	if err != nil {
		return fmt.Errorf("build rootfs: manifest: %w", err)
	}
	if err := storage.WriteFileAtomic(ManifestPath(out), append(mb, '\n'), 0o644); err != nil {
		return fmt.Errorf("build rootfs: %w", err)
	}
	log("%s rootfs %s: %d MiB qcow2 (%d MiB virtual) in %s", spec.Kind, out, size>>20, sizeMiB, time.Since(start).Round(time.Millisecond))
	return nil
}

// buildBaseTree runs debootstrap and configures the result.
func buildBaseTree(ctx context.Context, spec RootfsSpec, pkgs []string, tree string, log func(string, ...any)) error {
	mirror := spec.Mirror
	if mirror == "" {
		var err error
		if mirror, err = DebianMirror(spec.Suite); err != nil {
			return err
		}
	}
	// debootstrap resolves --include's dependencies only roughly (packages
	// such as python3-zmq fail to configure when pulled in there): it
	// installs the base packages, apt-get in the tree the extra ones.
	base, extra := pkgs, []string(nil)
	if len(pkgs) > len(BasePackages) {
		base, extra = pkgs[:len(BasePackages)], pkgs[len(BasePackages):]
	}
	log("debootstrap %s (packages: %s)", spec.Suite, strings.Join(base, ","))
	args := []string{"--variant=minbase", "--include=" + strings.Join(base, ",")}
	if len(spec.Components) > 0 {
		args = append(args, "--components="+strings.Join(spec.Components, ","))
	}
	cmd := exec.CommandContext(ctx, "debootstrap", append(args, spec.Suite, tree, mirror)...)
	// Cut short, debootstrap is asked to stop (and unmounts what it
	// mounted in the tree) before it is killed; removeWorkDir detaches
	// whatever it leaves.
	cmd.Cancel = func() error { return cmd.Process.Signal(syscall.SIGTERM) }
	cmd.WaitDelay = 10 * time.Second
	if err := runLogged(cmd, log, 2*time.Second); err != nil {
		return err
	}
	if len(extra) > 0 {
		if err := aptInstall(ctx, tree, extra, log); err != nil {
			return err
		}
	}
	uid := strconv.Itoa(DefaultUID)
	steps := [][]string{
		{"groupadd", "-g", uid, "user"},
		{"useradd", "-m", "-u", uid, "-g", uid, "-d", "/home/user", "-s", "/bin/bash", "-G", "sudo", "user"},
		{"passwd", "-d", "user"},
		{"apt-get", "clean"},
	}
	for _, s := range steps {
		if err := run(ctx, "chroot", append([]string{tree}, s...)...); err != nil {
			return err
		}
	}
	for name, content := range baseFiles(spec.Hostname) {
		p := filepath.Join(tree, name)
		_ = os.Remove(p)
		if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
			return fmt.Errorf("write %s: %w", name, err)
		}
	}
	if err := os.Chmod(filepath.Join(tree, "etc/sudoers.d/user"), 0o440); err != nil {
		return err
	}
	for _, f := range spec.ExtraFiles {
		rel := filepath.Clean(strings.TrimPrefix(f.Path, "/"))
		if !filepath.IsAbs(f.Path) || rel == "." || strings.HasPrefix(rel, "..") {
			return fmt.Errorf("extra file %q: want an absolute path in the guest", f.Path)
		}
		p := filepath.Join(tree, rel)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			return err
		}
		if err := os.WriteFile(p, f.Data, f.Mode.Perm()); err != nil {
			return fmt.Errorf("write %s: %w", f.Path, err)
		}
		if err := os.Chmod(p, f.Mode.Perm()); err != nil {
			return err
		}
	}
	// Per-machine identity and caches that must not be shared by every sandbox.
	_ = os.WriteFile(filepath.Join(tree, "etc/machine-id"), nil, 0o444)
	for _, g := range []string{"var/lib/apt/lists/*_*", "var/cache/apt/*.bin", "var/log/*.log", "var/log/apt/*"} {
		ms, _ := filepath.Glob(filepath.Join(tree, g))
		for _, m := range ms {
			_ = os.RemoveAll(m)
		}
	}
	return nil
}

// aptInstall installs pkgs into a debootstrapped tree with its own apt
// (the sources debootstrap wrote, the host's resolver), starting no
// services.
func aptInstall(ctx context.Context, tree string, pkgs []string, log func(string, ...any)) error {
	log("apt-get install in the tree: %s", strings.Join(pkgs, ","))
	policy := filepath.Join(tree, "usr/sbin/policy-rc.d")
	if err := os.WriteFile(policy, []byte("#!/bin/sh\nexit 101\n"), 0o755); err != nil {
		return err
	}
	defer os.Remove(policy)
	if b, err := os.ReadFile("/etc/resolv.conf"); err == nil {
		resolv := filepath.Join(tree, "etc/resolv.conf")
		_ = os.Remove(resolv)
		if err := os.WriteFile(resolv, b, 0o644); err != nil {
			return err
		}
	}
	env := append(os.Environ(), "DEBIAN_FRONTEND=noninteractive", "LC_ALL=C")
	for _, args := range [][]string{
		{"apt-get", "update", "-q"},
		append([]string{"apt-get", "install", "-y", "-q", "--no-install-recommends"}, pkgs...),
	} {
		cmd := exec.CommandContext(ctx, "chroot", append([]string{tree}, args...)...)
		cmd.Env = env
		if err := runLogged(cmd, log, 5*time.Second); err != nil {
			return fmt.Errorf("%s: %w", strings.Join(args[:2], " "), err)
		}
	}
	return nil
}

// buildMinimalTree makes a busybox-only tree.
func buildMinimalTree(ctx context.Context, spec RootfsSpec, tree string) error {
	bb := "/bin/busybox"
	if _, err := os.Stat(bb); err != nil {
		return fmt.Errorf("busybox not found (apt-get install busybox-static): %w", err)
	}
	if err := checkStaticFile(bb); err != nil {
		return fmt.Errorf("%s: %w (install busybox-static)", bb, err)
	}
	for _, d := range []string{"bin", "etc", "dev", "proc", "sys", "run", "root", "home/user", "tmp", "var/tmp", "mnt", "lib"} {
		if err := os.MkdirAll(filepath.Join(tree, d), 0o755); err != nil {
			return err
		}
	}
	for _, d := range []string{"tmp", "var/tmp"} {
		if err := os.Chmod(filepath.Join(tree, d), 0o1777|fs.ModeSticky); err != nil {
			return err
		}
	}
	if err := os.Chmod(filepath.Join(tree, "root"), 0o700); err != nil {
		return err
	}
	if err := os.Chown(filepath.Join(tree, "home/user"), DefaultUID, DefaultUID); err != nil {
		return err
	}
	for link, target := range map[string]string{"sbin": "bin", "usr/bin": "../bin", "usr/sbin": "../bin"} {
		_ = os.MkdirAll(filepath.Dir(filepath.Join(tree, link)), 0o755)
		if err := os.Symlink(target, filepath.Join(tree, link)); err != nil {
			return err
		}
	}
	if err := copyFile(bb, filepath.Join(tree, "bin/busybox"), 0o755); err != nil {
		return err
	}
	list, err := exec.CommandContext(ctx, bb, "--list").Output()
	if err != nil {
		return fmt.Errorf("busybox --list: %w", err)
	}
	for _, applet := range strings.Fields(string(list)) {
		if applet == "busybox" || strings.Contains(applet, "/") {
			continue
		}
		if err := os.Symlink("busybox", filepath.Join(tree, "bin", applet)); err != nil && !errors.Is(err, fs.ErrExist) {
			return err
		}
	}
	files := map[string]string{
		"etc/passwd":      "root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000:user:/home/user:/bin/sh\n",
		"etc/group":       "root:x:0:\nsudo:x:27:user\ntty:x:5:\nuser:x:1000:\n",
		"etc/shadow":      "root:*:19000:0:99999:7:::\nuser::19000:0:99999:7:::\n",
		"etc/hostname":    spec.Hostname + "\n",
		"etc/hosts":       "127.0.0.1\tlocalhost\n127.0.1.1\t" + spec.Hostname + "\n",
		"etc/fstab":       "/dev/vda\t/\text4\trw,relatime\t0\t1\n",
		"etc/resolv.conf": "",
		"etc/os-release":  "NAME=\"aenv minimal\"\nID=aenv-minimal\nPRETTY_NAME=\"aenv minimal (busybox)\"\n",
	}
	for name, content := range files {
		mode := fs.FileMode(0o644)
		if name == "etc/shadow" {
			mode = 0o640
		}
		if err := os.WriteFile(filepath.Join(tree, name), []byte(content), mode); err != nil {
			return err
		}
	}
	return nil
}

// DebianMirror returns the URI of the first Debian apt source that carries
// suite, from /etc/apt/sources.list and /etc/apt/sources.list.d (both the
// one-line and the deb822 formats).
func DebianMirror(suite string) (string, error) {
	if m, _ := guestsource.MirrorFor(guestsource.ReadHost("/").AptSources, suite); m != "" {
		return m, nil
	}
	return "", fmt.Errorf("no apt source for suite %q in /etc/apt/sources.list(.d); set the mirror explicitly", suite)
}

func run(ctx context.Context, name string, args ...string) error {
	out, err := exec.CommandContext(ctx, name, args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, guestsource.LastLines(out, 8))
	}
	return nil
}

// runLogged runs cmd, passing its output lines to log at most once per
// every interval (plus every line starting with "E:" or "W:"), and keeps the
// tail for the error message.
func runLogged(cmd *exec.Cmd, log func(string, ...any), every time.Duration) error {
	pr, pw := io.Pipe()
	cmd.Stdout, cmd.Stderr = pw, pw
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start %s: %w", cmd.Path, err)
	}
	var (
		wg   sync.WaitGroup
		tail []string
		n    int
	)
	wg.Add(1)
	go func() {
		defer wg.Done()
		var last time.Time
		sc := bufio.NewScanner(pr)
		for sc.Scan() {
			l := sc.Text()
			n++
			tail = append(tail, l)
			if len(tail) > 10 {
				tail = tail[1:]
			}
			if time.Since(last) >= every || strings.HasPrefix(l, "E:") || strings.HasPrefix(l, "W:") {
				log("%s: %s", filepath.Base(cmd.Path), l)
				last = time.Now()
			}
		}
		_, _ = io.Copy(io.Discard, pr)
	}()
	err := cmd.Wait()
	pw.Close()
	wg.Wait()
	if err != nil {
		return fmt.Errorf("%s: %w: %s", strings.Join(cmd.Args, " "), err, strings.Join(tail, "\n"))
	}
	return nil
}

func treeSize(root string) (int64, error) {
	var total int64
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		info, err := d.Info()
		if err != nil {
			return err
		}
		// Round to 4 KiB blocks, as the filesystem will.
		total += (info.Size() + 4095) &^ 4095
		if d.IsDir() {
			total += 4096
		}
		return nil
	})
	return total, err
}

func copyFile(src, dst string, mode fs.FileMode) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, mode)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return fmt.Errorf("copy %s: %w", src, err)
	}
	return out.Close()
}

func checkStaticFile(p string) error {
	b, err := os.ReadFile(p)
	if err != nil {
		return err
	}
	return checkStatic(b)
}

func sha256File(p string) (string, int64, error) {
	f, err := os.Open(p)
	if err != nil {
		return "", 0, err
	}
	defer f.Close()
	h := sha256.New()
	n, err := io.Copy(h, f)
	if err != nil {
		return "", 0, fmt.Errorf("hash %s: %w", p, err)
	}
	return hex.EncodeToString(h.Sum(nil)), n, nil
}
