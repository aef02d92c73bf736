//go:build linux

package cli

import (
	"fmt"

	"github.com/spf13/cobra"

	"github.com/agentenv/agentenv/internal/guestsource"
	"github.com/agentenv/agentenv/internal/qemupkg"
)

func qemuCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "qemu",
		Short: "Install another QEMU beside the system's for sandboxes to run on (--qemu, AENV_QEMU)",
	}
	o := qemupkg.Options{}
	install := &cobra.Command{
		Use:   "install",
		Short: "Install QEMU from a Debian suite's packages into a private prefix and print its launcher's path",
		Long: `Downloads qemu-system-x86, qemu-system-common and qemu-system-data of the newest version VERSION.* in
SUITE with a private apt configuration (the host's packages stay as they are), unpacks them into
DIR/<version>/ and prints the path of a launcher that runs that QEMU on its own data files. Point a
server or node at it with --qemu PATH or AENV_QEMU=PATH. Run again, it reuses a complete install.`,
		Example: "  aenv qemu install --suite bookworm-backports --version 10.0 --dir /var/lib/aenv/qemu",
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if o.Dir == "" {
				return usageError{fmt.Errorf("--dir is required")}
			}
			o.AptSources = guestsource.ReadHost("/").AptSources
			o.Log = func(format string, args ...any) { fmt.Fprintf(cmd.ErrOrStderr(), format+"\n", args...) }
			path, err := qemupkg.Install(cmd.Context(), o)
			if err != nil {
				return err
			}
			fmt.Fprintln(cmd.OutOrStdout(), path)
			return nil
		},
	}
	install.Flags().StringVar(&o.Dir, "dir", "", "where installs go (DIR/<version>/)")
	install.Flags().StringVar(&o.Suite, "suite", "bookworm-backports", "the Debian suite to take QEMU from")
	install.Flags().StringVar(&o.Version, "version", "10.0", "the upstream QEMU version wanted (a prefix, e.g. 10.0)")
	install.Flags().StringVar(&o.Mirror, "mirror", "", "a Debian archive URL (default: the host's apt source of the suite's release)")
	cmd.AddCommand(install)
	return cmd
}
