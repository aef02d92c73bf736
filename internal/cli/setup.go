//go:build linux

package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"os/user"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/agentenv/agentenv/internal/codeinterpreter"
	"github.com/agentenv/agentenv/internal/datadir"
	"github.com/agentenv/agentenv/internal/guestsource"
	"github.com/agentenv/agentenv/internal/store"
	"github.com/agentenv/agentenv/internal/templates"

	"github.com/spf13/cobra"

	"github.com/agentenv/agentenv/internal/guest"
	"github.com/agentenv/agentenv/internal/orchestrator"
)

type setupOptions struct {
	dataDir     string
	envd        string
	templates   []string
	rebuild     bool
	guestDistro string
	guestMirror string
}

func setupCmd() *cobra.Command {
	var o setupOptions
	cmd := &cobra.Command{
		Use:   "setup",
		Short: "Prepare a node: fetch the guest kernel, build the initramfs and the default templates",
		Long: `Prepare a node's data directory. Steps (each skipped when already done):
  1. check the host tools (QEMU, qemu-img, nftables, iproute2, debootstrap)
  2. fetch the guest kernel package (Debian linux-image-cloud-amd64, Ubuntu linux-image-kvm) and unpack it
  3. build the initramfs holding envd (our in-guest daemon and PID 1) and the kernel modules it needs
  4. build the templates (base: Debian bookworm with bash, python3, git, curl; minimal: busybox;
     code-interpreter: base with ipykernel, numpy, pandas, matplotlib and the code-interpreter
     server, as template code-interpreter-v1)

The guest kernel and the base image come from --guest-distro: debian-bookworm by default, ubuntu-noble
by default on an Ubuntu host. Their mirror is --guest-mirror, by default the host's apt source carrying
the suite (a Debian guest on an Ubuntu host needs --guest-mirror). A mirror that is not the host's own
apt source is asked before anything is written, and apt then reads it with a private configuration:
the distribution's archive keyring (debian-archive-keyring, ubuntu-keyring) must be installed. The
choice is recorded in the data dir (` + "`aenv doctor`" + ` shows it).`,
		Example: `  aenv setup --data-dir /var/lib/aenv
  aenv setup --templates base,minimal --envd ./bin/envd
  aenv setup --guest-distro debian-bookworm --guest-mirror http://mirror.example/debian`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			// Interrupted, setup stops its tools and undoes what they
			// mounted (a killed setup's leftovers go at the next).
			ctx, stop := signal.NotifyContext(cmd.Context(), os.Interrupt, syscall.SIGTERM)
			defer stop()
			return runSetup(ctx, cmd.OutOrStdout(), o)
		},
	}
	dataDirFlag(cmd, &o.dataDir)
	cmd.Flags().StringVar(&o.envd, "envd", "", "static envd binary to put in the initramfs (default: envd next to the aenv binary)")
	cmd.Flags().StringSliceVar(&o.templates, "templates", []string{"base"}, "templates to build: base, minimal, code-interpreter")
	cmd.Flags().BoolVar(&o.rebuild, "rebuild", false, "rebuild templates that already exist")
	cmd.Flags().StringVar(&o.guestDistro, "guest-distro", "", "guest kernel and base image distribution: "+
		strings.Join(guestsource.Distros(), " or ")+" (default: debian-bookworm, ubuntu-noble on an Ubuntu host)")
	cmd.Flags().StringVar(&o.guestMirror, "guest-mirror", "", "http(s) archive mirror of the guest distribution (default: the host's apt source carrying its suite)")
	return cmd
}

func step(out io.Writer, n, total int, msg string) func(error) error {
	fmt.Fprintf(out, "[%d/%d] %s\n", n, total, msg)
	start := time.Now()
	return func(err error) error {
		if err != nil {
			fmt.Fprintf(out, "[%d/%d] failed after %s: %v\n", n, total, time.Since(start).Round(time.Millisecond), err)
			return err
		}
		fmt.Fprintf(out, "[%d/%d] done in %s\n", n, total, time.Since(start).Round(time.Millisecond))
		return nil
	}
}

func runSetup(ctx context.Context, out io.Writer, o setupOptions) error {
	if os.Geteuid() != 0 {
		return errors.New("aenv setup must run as root")
	}
	for _, t := range o.templates {
		if _, ok := setupTemplates[t]; !ok {
			return fmt.Errorf("unknown template kind %q (want base, minimal or code-interpreter)", t)
		}
	}
	src, err := resolveGuestSource(ctx, o)
	if err != nil {
		return err
	}
	lock, err := datadir.Acquire(o.dataDir, "aenv setup")
	if err != nil {
		return err
	}
	defer lock.Release()
	total := 3 + len(o.templates)
	logf := func(format string, args ...any) { fmt.Fprintf(out, "      "+format+"\n", args...) }

	done := step(out, 1, total, "checking host tools and QEMU's unprivileged user")
	if err := done(checkTools(o.templates)); err != nil {
		return err
	}
	if err := ensureQEMUUser(ctx); err != nil {
		return err
	}

	paths := pathsOf(o.dataDir)
	done = step(out, 2, total, "fetching the guest kernel ("+src.KernelPackage+")")
	logf("guest source: %s", src)
	logf("chosen because: %s", src.Reason)
	k, err := guest.FetchKernelFrom(ctx, paths.KernelDir, src, logf)
	if err == nil {
		err = guestsource.Save(filepath.Join(paths.KernelDir, guestsource.FileName), src)
	}
	if err = done(err); err != nil {
		return err
	}
	logf("kernel %s", k.Version)

	envd := o.envd
	if envd == "" {
		exe, err := os.Executable()
		if err != nil {
			return err
		}
		envd = filepath.Join(filepath.Dir(exe), "envd")
	}
	done = step(out, 3, total, "building the initramfs with "+envd)
	if _, err := os.Stat(envd); err != nil {
		return done(fmt.Errorf("envd binary %s: %w (build it with `CGO_ENABLED=0 go build -o bin/envd ./cmd/envd`)", envd, err))
	}
	if err := os.MkdirAll(filepath.Dir(paths.Initrd), 0o755); err != nil {
		return done(err)
	}
	if err := done(guest.BuildInitramfs(k, envd, paths.Initrd)); err != nil {
		return err
	}

	cat, closeCat, err := templates.OpenOffline(ctx, o.dataDir, nil)
	if err != nil {
		return err
	}
	defer closeCat()
	for i, kind := range o.templates {
		st := setupTemplates[kind]
		if st.rootfs.Kind == guest.RootfsBase {
			st.rootfs.Suite, st.rootfs.Mirror, st.rootfs.Components = src.Suite, src.Mirror, src.Components
		}
		done = step(out, 4+i, total, "building template "+st.template.Name)
		if t, err := cat.Get(ctx, st.template.Name); err == nil && !o.rebuild {
			if m, err := guest.ReadManifest(strings.TrimSuffix(t.RootDisk, ".qcow2")); err == nil && m.Recipe == st.rootfs.Recipe() {
				logf("template %s already built (use --rebuild to build it again)", st.template.Name)
				_ = done(nil)
				continue
			}
			logf("template %s was built from another recipe (packages or files changed): building it again", st.template.Name)
		}
		if err := done(buildTemplate(ctx, cat, st, k.Version, logf)); err != nil {
			return err
		}
	}
	fmt.Fprintf(out, "setup complete: data dir %s\n", o.dataDir)
	return nil
}

// resolveGuestSource chooses where the guest kernel and base image come
// from (guestsource.Resolve over the flags and the host's files) and checks
// the host has what that needs. The mirror is asked too, unless nothing was
// asked for and it is the host's own apt source: then setup works as it
// always has, offline too when everything is in place.
func resolveGuestSource(ctx context.Context, o setupOptions) (guestsource.Source, error) {
	opts := guestsource.ReadHost("/")
	opts.Distro, opts.Mirror = o.guestDistro, o.guestMirror
	src, err := guestsource.Resolve(opts)
	if err != nil {
		return src, err
	}
	// A missing debootstrap is step 1's to report, with the other tools.
	debootstrap := false
	if _, err := exec.LookPath("debootstrap"); err == nil {
		for _, t := range o.templates {
			debootstrap = debootstrap || setupTemplates[t].rootfs.Kind == guest.RootfsBase
		}
	}
	if err := src.CheckHostFiles(debootstrap, pathExists); err != nil {
		return src, err
	}
	if o.guestDistro == "" && o.guestMirror == "" && src.HostMirror {
		return src, nil
	}
	checkCtx, cancel := context.WithTimeout(ctx, guestsource.CheckTimeout)
	defer cancel()
	return src, guestsource.Check(checkCtx, src, &http.Client{Timeout: guestsource.CheckTimeout})
}

func pathExists(p string) bool {
	_, err := os.Stat(p)
	return err == nil
}

// setupTemplate is a template aenv setup builds: its root file system and
// its definition.
type setupTemplate struct {
	rootfs   guest.RootfsSpec
	template templates.Template
}

// setupTemplates are the templates aenv setup builds, by kind.
var setupTemplates = map[string]setupTemplate{
	"base": {
		rootfs:   guest.RootfsSpec{Kind: guest.RootfsBase},
		template: templates.Template{Name: "base", DefaultUser: "user", VCPUs: 2, MemoryMiB: 512},
	},
	"minimal": {
		rootfs:   guest.RootfsSpec{Kind: guest.RootfsMinimal},
		template: templates.Template{Name: "minimal", DefaultUser: "user", VCPUs: 1, MemoryMiB: 256},
	},
	// The code-interpreter SDKs' default template: base with Jupyter's
	// kernel and the data libraries, and AgentENV's server on port 49999
	// running (and warmed up) in the template's snapshot.
	"code-interpreter": {
		rootfs: guest.RootfsSpec{Kind: guest.RootfsBase, ExtraPackages: codeinterpreter.Packages,
			ExtraFiles: []guest.File{{Path: codeinterpreter.ServerPath, Mode: 0o644, Data: codeinterpreter.Server}}},
		template: templates.Template{Name: codeinterpreter.TemplateName, DefaultUser: codeinterpreter.User,
			VCPUs: codeinterpreter.VCPUs, MemoryMiB: codeinterpreter.MemoryMiB,
			StartCmd: codeinterpreter.StartCmd, ReadyCmd: codeinterpreter.ReadyCmd,
			StartUser: codeinterpreter.User, StartCwd: codeinterpreter.Cwd},
	},
}

// buildTemplate builds a template's root file system and installs it as a
// layer named by its content (a rebuild moves the template's label; what
// used the old build keeps it).
func buildTemplate(ctx context.Context, cat *templates.Catalog, st setupTemplate, kernelVersion string, logf func(string, ...any)) error {
	name := st.template.Name
	tmp, err := os.CreateTemp(cat.Store().Abs(store.LayersDir), ".setup-"+name+"-*.qcow2")
	if err != nil {
		return err
	}
	layer := tmp.Name()
	tmp.Close()
	os.Remove(layer)
	defer os.Remove(layer)
	defer os.Remove(guest.ManifestPath(layer))
	spec := st.rootfs
	spec.KernelVersion = kernelVersion
	if err := guest.BuildRootfs(ctx, spec, layer, logf); err != nil {
		return err
	}
	installed, err := cat.InstallFile(ctx, st.template, layer)
	if err != nil {
		return err
	}
	// The build's manifest stays beside the layer.
	_ = os.Rename(guest.ManifestPath(layer), strings.TrimSuffix(installed.RootDisk, ".qcow2")+".json")
	logf("template %s: layer %s", name, installed.Layer)
	return nil
}

// checkTools reports every missing host tool at once, with the package to install.
func checkTools(templates []string) error {
	need := map[string]string{
		"qemu-system-x86_64": "qemu-system-x86",
		"qemu-img":           "qemu-utils",
		"nft":                "nftables",
		"ip":                 "iproute2",
		"dpkg-deb":           "dpkg",
		"apt-get":            "apt",
		"mkfs.ext4":          "e2fsprogs",
	}
	for _, t := range templates {
		switch setupTemplates[t].rootfs.Kind {
		case guest.RootfsBase:
			need["debootstrap"] = "debootstrap"
		case guest.RootfsMinimal:
			need["busybox"] = "busybox-static"
		}
	}
	var missing, pkgs []string
	for bin, pkg := range need {
		if _, err := exec.LookPath(bin); err != nil {
			missing = append(missing, bin)
			pkgs = append(pkgs, pkg)
		}
	}
	if len(missing) > 0 {
		return fmt.Errorf("missing host tools: %s; install them with `apt-get install %s`",
			strings.Join(missing, ", "), strings.Join(pkgs, " "))
	}
	return nil
}

// ensureQEMUUser makes the system user QEMU runs as (no home, no shell).
func ensureQEMUUser(ctx context.Context) error {
	if _, err := user.Lookup(orchestrator.DefaultQEMUUser); err == nil {
		return nil
	}
	out, err := exec.CommandContext(ctx, "useradd", "--system", "--no-create-home", "--home-dir", "/nonexistent",
		"--shell", "/usr/sbin/nologin", "--comment", "AgentENV QEMU", orchestrator.DefaultQEMUUser).CombinedOutput()
	if err != nil {
		return fmt.Errorf("make user %s: %v: %s", orchestrator.DefaultQEMUUser, err, strings.TrimSpace(string(out)))
	}
	return nil
}
