package cli

import "github.com/spf13/cobra"

func templateCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "template",
		Short: "Build and manage the templates sandboxes are created from",
	}
	cmd.AddCommand(templateImportCmd(), templateBuildCmd(), templatePushCmd(), templateExportCmd(), templateLsCmd(), templateRmCmd())
	return cmd
}
