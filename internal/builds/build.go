// Package builds owns template builds: a template made from another
// template (or an imported image) by steps run in a builder sandbox the
// node boots for it. Every step that changes files leaves a disk layer
// holding what it changed over the layer below, a layer of the store named
// by a key hashed from the layer below and the step (and, for COPY, the
// copied files), kept as the build cache: a rebuild reuses every layer up
// to the first changed step and runs only the rest. The finished template's
// label moves to the last layer, and the node snapshots it. Build records
// (status, logs, the failing step) are kept per template and build.
package builds

import (
	"context"
	"crypto/sha256"
	"database/sql"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"strings"
	"time"

	"github.com/agentenv/agentenv/internal/buildfiles"
	"github.com/agentenv/agentenv/internal/errkind"
	"github.com/agentenv/agentenv/internal/guestexec"
	"github.com/agentenv/agentenv/internal/operation"
	"github.com/agentenv/agentenv/internal/storage"
	"github.com/agentenv/agentenv/internal/storage/image"
	"github.com/agentenv/agentenv/internal/store"
	"github.com/agentenv/agentenv/internal/templates"
)

// Host is what a build needs from the node.
type Host interface {
	// StartBuilder boots a sandbox of template from whose root disk is
	// the layer layerID at layerPath instead (the layer the first uncached
	// step builds on), labelled for the build of template name.
	StartBuilder(ctx context.Context, from *templates.Template, layerPath, layerID string, vcpus, memMiB int, name string) (Builder, error)
	// PrepareTemplateSnapshot boots the finished template and freezes it;
	// RefillTemplatePool starts its pre-started sandboxes.
	PrepareTemplateSnapshot(ctx context.Context, name string) error
	RefillTemplatePool(name string)
	// SnapshotExists reports whether a named snapshot has this name
	// (templates and snapshots share one namespace).
	SnapshotExists(name string) bool
	// Go runs fn in the background, cancelled when the node closes, which
	// waits for it.
	Go(fn func(ctx context.Context))
}

// Builder is the sandbox a build's steps run in.
type Builder interface {
	Target() guestexec.Target
	// Frozen runs fn with the builder's vCPUs stopped; fn gets the path of
	// its disk overlay.
	Frozen(ctx context.Context, fn func(overlay string) error) error
	Close()
}

// Step is one instruction of a build.
type Step struct {
	Type string   `json:"type"` // RUN, ENV, WORKDIR, USER, COPY
	Args []string `json:"args"`
	// FilesHash names the uploaded files of a COPY (see package buildfiles).
	FilesHash string `json:"filesHash,omitempty"`
	// Files is the archive a COPY uses, once admitted (see Builds.admit).
	Files buildfiles.Archive `json:"-"`
	// Force runs the step (and all after it) even if cached.
	Force bool `json:"force,omitempty"`
}

// Spec describes a template build.
type Spec struct {
	Template     string // the name of the template built
	FromTemplate string // the template it starts from, or
	FromImage    string // an OCI image (registry reference) it starts from
	Steps        []Step
	StartCmd     string // started in the background before the snapshot
	ReadyCmd     string // polled until it exits 0 (default: none)
	VCPUs        int
	MemoryMiB    int
	// Force ignores every cached layer.
	Force bool
	// BuildID is the build's record, and Tags the tags pointed at it once
	// it is ready.
	BuildID string
	Tags    []string
}

// Logger receives a build's log lines.
type Logger func(level, step, msg string)

// CacheHolder holds the layers builds made, for later builds.
const CacheHolder = "cache/build-layers"

// buildState is what steps change besides files.
type buildState struct {
	env  map[string]string
	user string
	cwd  string
	// userSet and cwdSet: a USER or WORKDIR step ran, so the template's
	// sandboxes get that user and directory by default (as E2B's do).
	userSet, cwdSet bool
}

// workdir is where WORKDIR dir leads from cwd.
func workdir(cwd, dir string) string {
	if !path.IsAbs(dir) {
		return path.Join(cwd, dir)
	}
	return path.Clean(dir)
}

// buildTimeout bounds one template build.
const buildTimeout = 2 * time.Hour

// BuildTemplate runs a build to the end, as an operation of named steps:
// the template's label moves to the new build (and its template snapshot
// is made) only if every step succeeds; a build that fails leaves the
// template as it was (the layers its finished steps made stay in the build
// cache).
func (bs *Builds) Run(ctx context.Context, spec Spec, logf Logger) (err error) {
	if !templates.NameRE.MatchString(spec.Template) {
		return fmt.Errorf("%w: template name %q must match %s", errkind.ErrInvalid, spec.Template, templates.NameRE)
	}
	o := operation.Start(ctx, "build", buildTimeout, bs.log)
	defer func() { err = o.Finish(err) }()
	ctx = o.Context()
	if spec.FromImage != "" {
		// The image becomes a template of its own (its layers shared and
		// cached like any import), which the steps then build on.
		sum := sha256.Sum256([]byte(spec.FromImage))
		spec.FromTemplate = "image-" + hex.EncodeToString(sum[:8])
		logf("info", "", "pulling image "+spec.FromImage)
		src := image.Source{Ref: spec.FromImage}
		if err := bs.images.Check(&src); err != nil {
			return fmt.Errorf("%w: base image %s: %v", errkind.ErrInvalid, spec.FromImage, err)
		}
		if err := o.Do("pull-image", func(ctx context.Context) error {
			_, err := bs.cat.ImportImage(ctx, spec.FromTemplate, src, 0,
				func(format string, a ...any) { logf("info", "", fmt.Sprintf(format, a...)) })
			return err
		}); err != nil {
			return fmt.Errorf("base image %s: %w", spec.FromImage, err)
		}
	}
	from, err := bs.cat.Get(ctx, spec.FromTemplate)
	if err != nil {
		return fmt.Errorf("base template: %w", err)
	}
	if err := bs.admit(&spec); err != nil {
		return err
	}
	start := time.Now()
	layers := bs.st.Abs(store.LayersDir)
	state := buildState{env: map[string]string{}, user: "root", cwd: "/"}
	for k, v := range from.EnvVars {
		state.env[k] = v
	}
	parent, parentID := from.RootDisk, from.Layer
	key := "from:" + from.Layer
	var b *builder
	defer func() {
		if b != nil {
			b.Close()
		}
	}()
	cached := !spec.Force
	for i, st := range spec.Steps {
		name := fmt.Sprintf("%d/%d %s %s", i+1, len(spec.Steps), st.Type, strings.Join(st.Args, " "))
		if st.Force {
			cached = false
		}
		switch st.Type {
		case "ENV":
			for j := 0; j+1 < len(st.Args); j += 2 {
				state.env[st.Args[j]] = st.Args[j+1]
			}
			key = hashKey(key, st)
			logf("info", name, "environment set")
			continue
		case "USER":
			state.user, state.userSet = st.Args[0], true
			key = hashKey(key, st)
			logf("info", name, "user set")
			continue
		}
		key = hashKey(key, st)
		layerID := "build-" + key
		layer := filepath.Join(layers, layerID+".qcow2")
		if cached {
			if _, err := bs.st.Get(ctx, layerID); err == nil {
				logf("info", name, "CACHED")
				parent, parentID = layer, layerID
				if st.Type == "WORKDIR" {
					state.cwd, state.cwdSet = workdir(state.cwd, st.Args[0]), true
				}
				continue
			}
		}
		cached = false
		if _, err := bs.st.Get(ctx, layerID); err == nil {
			// Run again although its layer exists (forced): a layer is
			// immutable, so the new one gets a name of its own, and the
			// steps after it chain from that.
			key = hashKey(key+":rerun:"+newID(), st)
			layerID = "build-" + key
			layer = filepath.Join(layers, layerID+".qcow2")
		}
		if b == nil {
			if err := o.Do("start-builder", func(ctx context.Context) error {
				sb, err := bs.host.StartBuilder(ctx, from, parent, parentID, spec.VCPUs, spec.MemoryMiB, spec.Template)
				if err != nil {
					return err
				}
				b = &builder{Builder: sb}
				return nil
			}); err != nil {
				return fmt.Errorf("start the builder: %w", err)
			}
		}
		logf("info", name, "running")
		if err := o.Do("run-step", func(ctx context.Context) error {
			return b.run(ctx, st, &state, func(line string) { logf("info", name, line) })
		}); err != nil {
			logf("error", name, err.Error())
			return &stepError{index: i + 1, err: fmt.Errorf("step %s: %w", name, err)}
		}
		if err := o.Do("capture-layer", func(ctx context.Context) error { return b.capture(ctx, parent, layer) }); err != nil {
			return fmt.Errorf("step %s: save its layer: %w", name, err)
		}
		// A layer of the store, kept as the build cache.
		if err := o.Do("record-layer", func(ctx context.Context) error {
			return bs.st.Tx(ctx, func(tx *sql.Tx) error {
				if err := bs.st.Add(tx, layerID, store.KindLayer, layer, parentID); err != nil {
					return err
				}
				_, err := tx.ExecContext(ctx, `INSERT INTO refs (holder, object) VALUES (?, ?) ON CONFLICT DO NOTHING`, CacheHolder, layerID)
				return err
			})
		}); err != nil {
			os.Remove(layer)
			return fmt.Errorf("step %s: record its layer: %w", name, err)
		}
		parent, parentID = layer, layerID
	}
	if b != nil {
		b.Close()
		b = nil
	}
	// The template: its label moves to the last layer (sandboxes and
	// snapshots of an earlier build keep theirs).
	t := templates.Template{Name: spec.Template, Layer: parentID, VCPUs: spec.VCPUs, MemoryMiB: spec.MemoryMiB, DiskMiB: from.DiskMiB,
		DefaultUser: from.DefaultUser, DefaultWorkdir: from.DefaultWorkdir, EnvVars: state.env, StartCmd: spec.StartCmd,
		ReadyCmd: spec.ReadyCmd, StartUser: state.user, StartCwd: state.cwd, BuildID: spec.BuildID}
	if state.userSet {
		t.DefaultUser = state.user
		if !state.cwdSet {
			t.DefaultWorkdir = "" // the new user's home
		}
	}
	if state.cwdSet {
		t.DefaultWorkdir = state.cwd
	}
	if t.VCPUs == 0 {
		t.VCPUs = from.VCPUs
	}
	if t.MemoryMiB == 0 {
		t.MemoryMiB = from.MemoryMiB
	}
	prev, prevErr := bs.cat.Get(ctx, spec.Template)
	if prevErr == nil {
		// The build it replaces stays whole until this one has finished
		// (the label may have to move back to it).
		lease, err := bs.st.NewLease(ctx, "build of "+spec.Template, buildTimeout)
		if err != nil {
			return err
		}
		defer lease.Drop(context.WithoutCancel(ctx))
		if err := bs.st.Tx(ctx, func(tx *sql.Tx) error { return lease.Hold(tx, prev.Layer) }); err != nil {
			return err
		}
	}
	if err := o.Do("install", func(ctx context.Context) error { return bs.cat.Install(ctx, t) }); err != nil {
		return err
	}
	o.OnFailure("the template as it was", func(ctx context.Context) error {
		if prevErr == nil {
			return bs.cat.Install(ctx, *prev)
		}
		return bs.st.Tx(ctx, func(tx *sql.Tx) error { return templates.Delete(tx, spec.Template) })
	})
	logf("info", "", fmt.Sprintf("template %s built in %s; snapshotting it", spec.Template, time.Since(start).Round(time.Millisecond)))
	if err := o.Do("template-snapshot", func(ctx context.Context) error { return bs.host.PrepareTemplateSnapshot(ctx, spec.Template) }); err != nil {
		return fmt.Errorf("snapshot the built template: %w", err)
	}
	if len(spec.Tags) > 0 {
		if err := o.Do("tags", func(ctx context.Context) error {
			built, err := bs.cat.Get(ctx, spec.Template)
			if err != nil {
				return err
			}
			return bs.st.Tx(ctx, func(tx *sql.Tx) error { return templates.SetTags(tx, *built, spec.Tags) })
		}); err != nil {
			return err
		}
		logf("info", "", fmt.Sprintf("tagged %s", strings.Join(spec.Tags, ", ")))
	}
	bs.host.RefillTemplatePool(spec.Template)
	logf("info", "", fmt.Sprintf("template %s ready in %s", spec.Template, time.Since(start).Round(time.Millisecond)))
	return nil
}

// admit checks a build's steps and admits the files of its COPY steps
// (checked against their files hash, see buildfiles.Store.Admit) for
// spec.Template. Errors are ErrInvalid, naming the step.
func (bs *Builds) admit(spec *Spec) error {
	for i := range spec.Steps {
		st := &spec.Steps[i]
		if err := CheckStep(*st); err != nil {
			return fmt.Errorf("%w: step %d: %v", errkind.ErrInvalid, i+1, err)
		}
		if st.Type != "COPY" || st.Files.Path != "" {
			continue
		}
		a, err := bs.files.Admit(spec.Template, st.FilesHash, st.Args[0], st.Args[1])
		if err != nil {
			return fmt.Errorf("step %d (COPY %s): %w", i+1, st.Args[0], err)
		}
		st.Files = a
	}
	return nil
}

// CheckStep refuses a step that cannot run (bad arguments).
func CheckStep(st Step) error {
	switch st.Type {
	case "RUN", "WORKDIR", "USER":
		if len(st.Args) < 1 || st.Args[0] == "" {
			return fmt.Errorf("%s needs an argument", st.Type)
		}
	case "ENV":
		if len(st.Args) == 0 || len(st.Args)%2 != 0 {
			return errors.New("ENV needs key/value pairs")
		}
	case "COPY":
		if len(st.Args) < 2 || st.Args[1] == "" {
			return errors.New("COPY needs a source and a destination")
		}
		if !buildfiles.HashRE.MatchString(st.FilesHash) {
			return fmt.Errorf("COPY files hash %q is not valid", st.FilesHash)
		}
	default:
		return fmt.Errorf("unknown step type %q", st.Type)
	}
	return nil
}

// hashKey is the cache key of a step over the key below it. A COPY's files
// enter it by their admitted key (the verified hash, or the digest of the
// bytes of files no hash vouches for), never by the hash a client claims.
func hashKey(below string, st Step) string {
	files := st.FilesHash
	if st.Files.Key != "" {
		files = st.Files.Key
	}
	b, _ := json.Marshal(struct {
		Type, FilesHash string
		Args            []string
	}{st.Type, files, st.Args})
	sum := sha256.Sum256([]byte(below + "\n" + string(b)))
	return hex.EncodeToString(sum[:])
}

// builder runs a build's steps in its builder sandbox.
type builder struct {
	Builder
}

func (b *builder) sh(ctx context.Context, user, cwd string, env map[string]string, script string, out func(string)) error {
	code, err := guestexec.Run(ctx, b.Target(), guestexec.Command{User: user, Cwd: cwd, Env: env, Script: script,
		Output: func(line string, _ bool) { out(line) }})
	if err != nil {
		return err
	}
	if code != 0 {
		return fmt.Errorf("exited with code %d", code)
	}
	return nil
}

// run executes one file-changing step.
func (b *builder) run(ctx context.Context, st Step, state *buildState, out func(string)) error {
	switch st.Type {
	case "RUN":
		user := state.user
		if len(st.Args) > 1 && st.Args[1] != "" {
			user = st.Args[1] // RUN's own user, for this step only
		}
		return b.sh(ctx, user, state.cwd, state.env, st.Args[0], out)
	case "WORKDIR":
		dir := workdir(state.cwd, st.Args[0])
		if err := b.sh(ctx, state.user, "/", nil, "mkdir -p "+guestexec.Quote(dir), out); err != nil {
			return err
		}
		state.cwd, state.cwdSet = dir, true
		return nil
	case "COPY":
		return b.copyFiles(ctx, st, state, out)
	}
	return fmt.Errorf("unknown step %s", st.Type)
}

// copyFiles puts a COPY step's files into the guest with Docker's rules:
// the uploaded archive holds the source path as it is in the client's
// build context; a directory's contents go into the destination, a file
// becomes the destination (or goes into it, if it ends in / or is a
// directory). Args: source, destination, then optional owner and mode.
func (b *builder) copyFiles(ctx context.Context, st Step, state *buildState, out func(string)) error {
	archive := st.Files.Path
	guestTmp := "/tmp/.aenv-copy-" + st.FilesHash + ".tar"
	if err := guestexec.Upload(ctx, b.Target(), archive, guestTmp); err != nil {
		return err
	}
	src, dest := path.Clean("/" + st.Args[0])[1:], st.Args[1]
	if !path.IsAbs(dest) {
		trailing := strings.HasSuffix(dest, "/")
		dest = path.Join(state.cwd, dest)
		if trailing {
			dest += "/"
		}
	}
	owner, mode := "", ""
	if len(st.Args) > 2 {
		owner = st.Args[2]
	}
	if len(st.Args) > 3 {
		mode = st.Args[3]
	}
	script := `set -e
t=$(mktemp -d)
chmod 755 "$t"
tar -xf ` + guestTmp + ` -C "$t"
rm -f ` + guestTmp + `
s="$t/"` + guestexec.Quote(src) + `
d=` + guestexec.Quote(dest) + `
if [ -d "$s" ]; then
  mkdir -p "$d"; cp -a "$s"/. "$d"/; target="$d"
else
  case "$d" in
  */) mkdir -p "$d"; cp -a "$s" "$d"; target="$d$(basename "$s")" ;;
  *) if [ -d "$d" ]; then cp -a "$s" "$d"/; target="$d/$(basename "$s")"; else mkdir -p "$(dirname "$d")"; cp -a "$s" "$d"; target="$d"; fi ;;
  esac
fi
rm -rf "$t"
owner=` + guestexec.Quote(owner) + `
mode=` + guestexec.Quote(mode) + `
if [ -n "$owner" ]; then chown -R "$owner" "$target"; fi
if [ -n "$mode" ]; then chmod "$mode" "$target"; fi
`
	return b.sh(ctx, "root", "/", nil, script, out)
}

// capture saves what the steps so far changed over parent as layer: the
// guest's caches are flushed, its vCPUs stopped while its overlay is copied,
// and the copy is rewritten with only the clusters that differ from parent.
func (b *builder) capture(ctx context.Context, parent, layer string) error {
	if err := b.sh(ctx, "root", "/", nil, "sync", func(string) {}); err != nil {
		return err
	}
	work, err := os.MkdirTemp(filepath.Dir(layer), ".capture-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(work)
	if err := b.Frozen(ctx, func(overlay string) error {
		_, err := storage.CloneFile(overlay, filepath.Join(work, "overlay.qcow2"))
		return err
	}); err != nil {
		return err
	}
	tmp := filepath.Join(work, "layer.qcow2")
	out, err := exec.CommandContext(ctx, "qemu-img", "convert", "-q", "-O", "qcow2", "-o", "cluster_size=65536",
		"-B", parent, "-F", "qcow2", filepath.Join(work, "overlay.qcow2"), tmp).CombinedOutput()
	if err != nil {
		return fmt.Errorf("qemu-img convert: %v: %s", err, strings.TrimSpace(string(out)))
	}
	if err := storage.SyncFile(tmp); err != nil {
		return err
	}
	if err := os.Chmod(tmp, 0o444); err != nil {
		return err
	}
	return os.Rename(tmp, layer)
}
