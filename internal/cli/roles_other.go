//go:build !linux

package cli

import (
	"fmt"

	"github.com/spf13/cobra"
)

// On other systems than Linux the client commands work; the server roles
// and machine setup explain that they need Linux.

func linuxOnly(use, short string) *cobra.Command {
	return &cobra.Command{
		Use:                use,
		Short:              short + " (Linux only)",
		DisableFlagParsing: true,
		Example:            "  # on a Linux host: aenv " + use + " --help",
		RunE: func(cmd *cobra.Command, args []string) error {
			return fmt.Errorf("aenv %s runs on Linux only: it drives QEMU, network namespaces and nftables. "+
				"Run it on a Linux host; the client commands (create, exec, ls, ...) work from here", cmd.Name())
		},
	}
}

func serverCmd() *cobra.Command {
	return linuxOnly("server", "Run a single-node server")
}
func nodeCmd() *cobra.Command      { return linuxOnly("node", "Run a cluster node") }
func schedulerCmd() *cobra.Command { return linuxOnly("scheduler", "Run the cluster scheduler") }
func gatewayCmd() *cobra.Command   { return linuxOnly("gateway", "Run the cluster gateway") }
func setupCmd() *cobra.Command     { return linuxOnly("setup", "Prepare a node's data dir") }
func keyCmd() *cobra.Command       { return linuxOnly("key", "Print a node's API key") }
func doctorCmd() *cobra.Command {
	return linuxOnly("doctor", "Check this machine for running a server")
}
func templateImportCmd() *cobra.Command {
	return linuxOnly("import", "Make a template from an OCI image")
}
func templatePushCmd() *cobra.Command {
	return linuxOnly("push", "Store a template in the repository")
}
func templateExportCmd() *cobra.Command {
	return linuxOnly("export", "Write a template as a directory another data dir adopts")
}
func qemuCmd() *cobra.Command { return linuxOnly("qemu", "Install another QEMU beside the system's") }
