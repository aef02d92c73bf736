package cli

import (
	"fmt"
	"net/url"
	"strings"

	"github.com/agentenv/agentenv/internal/apispec"
	"github.com/spf13/cobra"
)

// Client commands for named snapshots and templates on a server.

func snapshotCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "snapshot",
		Short: "Named snapshots of running sandboxes: new sandboxes start from them (as a template id)",
	}
	cmd.AddCommand(snapshotCreateCmd(), snapshotLsCmd(), snapshotRmCmd())
	return cmd
}

func snapshotCreateCmd() *cobra.Command {
	var (
		conn   connection
		asJSON bool
	)
	cmd := &cobra.Command{
		Use:   "create SANDBOX NAME",
		Short: "Snapshot a running sandbox under a name (it keeps running)",
		Example: `  aenv snapshot create i1a2b3c4d5e6f7g8h9j0 warm-env
  aenv create warm-env      # a new sandbox from the snapshot`,
		Args: cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := conn.client()
			if err != nil {
				return err
			}
			var s apispec.Snapshot
			if err := c.do(cmd.Context(), "POST", "/sandboxes/"+url.PathEscape(args[0])+"/snapshots", map[string]any{"name": args[1]}, &s); err != nil {
				return err
			}
			if asJSON {
				return printJSON(cmd.OutOrStdout(), s)
			}
			fmt.Fprintf(cmd.OutOrStdout(), "snapshot %s of %s\n", args[1], args[0])
			return nil
		},
	}
	conn.flags(cmd)
	jsonFlag(cmd, &asJSON)
	return cmd
}

func snapshotLsCmd() *cobra.Command {
	return listingCmd("List named snapshots", "  aenv snapshot ls\n  aenv snapshot ls -o json", "/snapshots",
		[]string{"NAME", "TEMPLATE", "FROM SANDBOX", "CPU", "MEMORY", "CREATED"},
		func(s apispec.Snapshot) []string {
			return []string{strings.Join(s.Names, ","), s.TemplateID, s.SandboxID, fmt.Sprint(s.CpuCount),
				fmt.Sprintf("%d MiB", s.MemoryMB), ago(s.CreatedAt)}
		})
}

// listingCmd is an `ls` that GETs path, a JSON list of T, and prints it as
// a table (one row per item) or, with -o json, as JSON.
func listingCmd[T any](short, example, path string, header []string, row func(T) []string) *cobra.Command {
	var (
		conn   connection
		asJSON bool
	)
	cmd := &cobra.Command{
		Use:     "ls",
		Aliases: []string{"list"},
		Short:   short,
		Example: example,
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := conn.client()
			if err != nil {
				return err
			}
			all := []T{}
			if err := c.do(cmd.Context(), "GET", path, nil, &all); err != nil {
				return err
			}
			if asJSON {
				return printJSON(cmd.OutOrStdout(), all)
			}
			rows := make([][]string, 0, len(all))
			for _, it := range all {
				rows = append(rows, row(it))
			}
			return table(cmd.OutOrStdout(), header, rows)
		},
	}
	conn.flags(cmd)
	jsonFlag(cmd, &asJSON)
	return cmd
}

func snapshotRmCmd() *cobra.Command {
	cmd := deleteCmd("rm NAME...", "Delete named snapshots", "  aenv snapshot rm warm-env", "/snapshots/", "deleted snapshot")
	cmd.Aliases = []string{"delete"}
	return cmd
}

// deleteCmd DELETEs prefix+name for every argument (all of them, even
// after a failure, which sets the exit code).
func deleteCmd(use, short, example, prefix, done string) *cobra.Command {
	var conn connection
	cmd := &cobra.Command{
		Use: use, Short: short, Example: example,
		Args: cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := conn.client()
			if err != nil {
				return err
			}
			var firstErr error
			for _, name := range args {
				if err := c.do(cmd.Context(), "DELETE", prefix+url.PathEscape(name), nil, nil); err != nil {
					fmt.Fprintln(cmd.ErrOrStderr(), "aenv:", err)
					if firstErr == nil {
						firstErr = err
					}
					continue
				}
				fmt.Fprintln(cmd.OutOrStdout(), done, name)
			}
			if firstErr != nil {
				return silent{firstErr}
			}
			return nil
		},
	}
	conn.flags(cmd)
	return cmd
}

func templateLsCmd() *cobra.Command {
	return listingCmd("List a server's templates", "  aenv template ls\n  aenv template ls -o json", "/templates",
		[]string{"TEMPLATE", "CPU", "MEMORY", "STATUS"},
		func(t apispec.Template) []string {
			return []string{t.TemplateID, fmt.Sprint(t.CpuCount), fmt.Sprintf("%d MiB", t.MemoryMB), string(t.BuildStatus)}
		})
}

func templateRmCmd() *cobra.Command {
	cmd := deleteCmd("rm TEMPLATE...", "Delete templates no sandbox or snapshot uses", "  aenv template rm mytools", "/templates/", "deleted template")
	cmd.Aliases = []string{"delete"}
	return cmd
}
