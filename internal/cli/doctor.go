//go:build linux

package cli

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/spf13/cobra"
	"golang.org/x/sys/unix"

	"github.com/agentenv/agentenv/internal/guestsource"
	tpl "github.com/agentenv/agentenv/internal/templates"
	"github.com/agentenv/agentenv/internal/vmm"
)

// check is one line of `aenv doctor`.
type check struct {
	name, status, detail, fix string
}

const (
	checkOK   = "ok"
	checkWarn = "warn"
	checkFail = "FAIL"
)

func doctorCmd() *cobra.Command {
	var dataDir string
	cmd := &cobra.Command{
		Use:   "doctor",
		Short: "Check this machine for running a server or node, and say how to fix each problem",
		Long: `Checks: KVM or TCG, QEMU and its version, the host kernel, root and network permissions
(network namespaces, tap devices, nftables), free disk space, the data dir's kernel and templates, and
where the guest kernel and base image come from (recorded by aenv setup, or what it would choose here).
Exits 1 when a check fails (warnings do not fail).`,
		Example: `  sudo aenv doctor
  sudo aenv doctor --data-dir /srv/aenv`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			checks := runChecks(dataDir)
			rows := [][]string{}
			failed := false
			for _, c := range checks {
				rows = append(rows, []string{c.name, c.status, c.detail})
				failed = failed || c.status == checkFail
			}
			out := cmd.OutOrStdout()
			if err := table(out, []string{"CHECK", "STATUS", "DETAIL"}, rows); err != nil {
				return err
			}
			printedFix := false
			for _, c := range checks {
				if c.status != checkOK && c.fix != "" {
					if !printedFix {
						fmt.Fprintln(out, "\nTo fix:")
						printedFix = true
					}
					fmt.Fprintf(out, "  %s: %s\n", c.name, c.fix)
				}
			}
			if failed {
				return exitCode(ExitFailure)
			}
			return nil
		},
	}
	dataDirFlag(cmd, &dataDir)
	return cmd
}

func runChecks(dataDir string) []check {
	var out []check
	add := func(c check) { out = append(out, c) }

	if os.Geteuid() == 0 {
		add(check{"root", checkOK, "running as root", ""})
	} else {
		add(check{"root", checkFail, "not root: servers create network namespaces, tap devices and nftables rules", "run aenv server/node as root (sudo, or the systemd unit from deploy/install.sh)"})
	}

	p := vmm.ProbeAccel()
	if p.Accel == vmm.AccelKVM {
		add(check{"accelerator", checkOK, "KVM: " + p.Reason, ""})
	} else {
		add(check{"accelerator", checkWarn, "TCG software emulation (10-20x slower): " + p.Reason,
			"enable VT-x/AMD-V in the firmware, load kvm_intel or kvm_amd (modprobe), or enable nested virtualization on the VM"})
	}

	add(qemuCheck())
	if _, err := exec.LookPath("qemu-img"); err != nil {
		add(check{"qemu-img", checkFail, "not installed", "apt-get install qemu-utils"})
	} else {
		add(check{"qemu-img", checkOK, "installed", ""})
	}

	var u unix.Utsname
	if err := unix.Uname(&u); err == nil {
		rel := unix.ByteSliceToString(u.Release[:])
		major, minor := kernelVersion(rel)
		if major > 5 || (major == 5 && minor >= 10) {
			add(check{"host kernel", checkOK, rel, ""})
		} else {
			add(check{"host kernel", checkFail, rel + " (5.10 or newer needed: openat2, process_madvise)", "upgrade the host kernel (Debian 12 and Ubuntu 24.04 ship 6.x)"})
		}
	}

	if _, err := os.Stat("/dev/net/tun"); err != nil {
		add(check{"tap devices", checkFail, "/dev/net/tun is missing", "modprobe tun; in a container, pass /dev/net/tun (or run privileged)"})
	} else {
		add(check{"tap devices", checkOK, "/dev/net/tun present", ""})
	}
	for _, tool := range []string{"nft", "ip"} {
		if _, err := exec.LookPath(tool); err != nil {
			add(check{tool, checkFail, "not installed", "apt-get install nftables iproute2"})
		}
	}
	if os.Geteuid() == 0 {
		if b, err := exec.Command("nft", "list", "tables").CombinedOutput(); err != nil {
			add(check{"nftables", checkFail, strings.TrimSpace(string(b)), "load the nf_tables module (modprobe nf_tables); in a container, run privileged"})
		} else {
			add(check{"nftables", checkOK, "usable", ""})
		}
		if err := exec.Command("unshare", "--net", "true").Run(); err != nil {
			add(check{"network namespaces", checkFail, err.Error(), "allow network namespaces (in a container: privileged or CAP_SYS_ADMIN)"})
		} else {
			add(check{"network namespaces", checkOK, "can create one", ""})
		}
	}
	if b, err := os.ReadFile("/proc/sys/net/ipv4/ip_forward"); err == nil && strings.TrimSpace(string(b)) != "1" {
		add(check{"ip forwarding", checkWarn, "off now; the server turns it on at start", ""})
	}

	var st unix.Statfs_t
	dir := dataDir
	for dir != "/" {
		if _, err := os.Stat(dir); err == nil {
			break
		}
		dir = filepath.Dir(dir)
	}
	if err := unix.Statfs(dir, &st); err == nil {
		free := int64(st.Bavail) * int64(st.Bsize)
		switch {
		case free < 4<<30:
			add(check{"disk space", checkFail, fmt.Sprintf("%.1f GiB free under %s", float64(free)/(1<<30), dir), "free space or use --data-dir on a larger disk (templates and paused sandboxes need several GiB)"})
		case free < 20<<30:
			add(check{"disk space", checkWarn, fmt.Sprintf("%.1f GiB free under %s", float64(free)/(1<<30), dir), "20 GiB or more is comfortable for templates, snapshots and the layer cache"})
		default:
			add(check{"disk space", checkOK, fmt.Sprintf("%.1f GiB free under %s", float64(free)/(1<<30), dir), ""})
		}
	}

	paths := pathsOf(dataDir)
	_, kerr := os.Stat(filepath.Join(paths.KernelDir))
	_, ierr := os.Stat(paths.Initrd)
	var tpls []*tpl.Template
	if cat, closeCat, err := tpl.OpenReadOnly(dataDir); err == nil {
		tpls, _ = cat.List(context.Background())
		closeCat()
	}
	legacy, _ := filepath.Glob(filepath.Join(dataDir, tpl.LegacyDir, "*", "template.json"))
	tpls = append(tpls, make([]*tpl.Template, len(legacy))...) // adopted at the next start
	switch {
	case kerr != nil || ierr != nil:
		add(check{"data dir", checkFail, dataDir + " has no guest kernel or initramfs", "aenv setup --data-dir " + dataDir})
	case len(tpls) == 0:
		add(check{"data dir", checkFail, dataDir + " has no template", "aenv setup --data-dir " + dataDir + " --templates base"})
	default:
		add(check{"data dir", checkOK, fmt.Sprintf("%s: kernel, initramfs, %d template(s)", dataDir, len(tpls)), ""})
	}
	add(guestSourceCheck(dataDir, paths.KernelDir))
	return out
}

// guestSourceCheck reports where the guest kernel and base image come
// from: what aenv setup recorded in the data dir or, before any setup, what
// it would choose on this host, and why.
func guestSourceCheck(dataDir, kernelDir string) check {
	const name = "guest source"
	src, err := guestsource.Load(filepath.Join(kernelDir, guestsource.FileName))
	var detail string
	switch {
	case err == nil:
		detail = fmt.Sprintf("%s (recorded by aenv setup): %s", src, src.Reason)
	case errors.Is(err, fs.ErrNotExist):
		if src, err = guestsource.Resolve(guestsource.ReadHost("/")); err != nil {
			return check{name, checkWarn, "none recorded, and aenv setup cannot choose one on this host: " + err.Error(),
				"aenv setup --data-dir " + dataDir + " --guest-distro DISTRO --guest-mirror URL"}
		}
		detail = fmt.Sprintf("none recorded; aenv setup would use %s: %s", src, src.Reason)
	default:
		return check{name, checkWarn, err.Error(), "aenv setup --data-dir " + dataDir}
	}
	if err := src.CheckHostFiles(false, pathExists); err != nil {
		return check{name, checkWarn, detail + "; " + err.Error(), "apt-get install " + src.KeyringPackage}
	}
	return check{name, checkOK, detail, ""}
}

func qemuCheck() check {
	if _, err := vmm.FindQEMU(os.Getenv("AENV_QEMU")); err != nil {
		return check{"qemu", checkFail, err.Error(), "apt-get install qemu-system-x86"}
	}
	info, err := vmm.ProbeQEMU(context.Background(), os.Getenv("AENV_QEMU"))
	if err != nil {
		return check{"qemu", checkFail, err.Error(), "install QEMU 7.2+ (Debian 12's qemu-system-x86)"}
	}
	drop := "-runas"
	if info.RunWithUser() {
		drop = "-run-with user="
	}
	diff := "the mapping's private pages (xen-save-devices-state)"
	if info.DiffCapture() == vmm.CaptureMigration {
		diff = "a full migration, filtered (no xen-save-devices-state)"
	}
	disk := "sealed in place"
	if !info.SealsDisks() {
		disk = "copied (no blockdev-snapshot or add-fd)"
	}
	detail := fmt.Sprintf("QEMU %s at %s (accelerators %s; drops privileges with %s; incremental snapshots from %s, the disk %s)",
		info.Version, info.Path, strings.Join(info.Accels, ", "), drop, diff, disk)
	if err := info.Supports(vmm.ProbeAccel().Accel); err != nil {
		return check{"qemu", checkFail, detail + ": " + err.Error(), "install Debian's qemu-system-x86, or name a full build with AENV_QEMU"}
	}
	return check{"qemu", checkOK, detail, ""}
}

// kernelVersion parses "6.1.0-18-amd64" into 6, 1.
func kernelVersion(rel string) (int, int) {
	parts := strings.SplitN(rel, ".", 3)
	if len(parts) < 2 {
		return 0, 0
	}
	major, _ := strconv.Atoi(parts[0])
	minor, _ := strconv.Atoi(strings.TrimFunc(parts[1], func(r rune) bool { return r < '0' || r > '9' }))
	return major, minor
}
