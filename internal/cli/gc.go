package cli

import (
	"fmt"
	"net/url"
	"time"

	"github.com/agentenv/agentenv/internal/apispec"
	"github.com/spf13/cobra"
)

// Client commands for sandboxes nobody looks after: orphans (bound to a
// client lease that expired or is gone), and bulk kills by age and
// metadata; and the leases themselves.

// orphan reports whether a listed sandbox is bound to a lease that
// expired or is gone.
func orphan(sb apispec.ListedSandbox) bool { return sb.Lease != nil && sb.Lease.Expired }

func gcCmd() *cobra.Command {
	var (
		conn      connection
		olderThan time.Duration
		meta      []string
		orphans   bool
		dryRun    bool
	)
	cmd := &cobra.Command{
		Use:   "gc",
		Short: "Kill sandboxes (running or paused) in bulk: older than a duration, with metadata, or orphaned",
		Long: `Kill, in bulk, the sandboxes that match every filter given: started longer ago than --older-than,
with the --metadata given, orphaned (--orphans: bound to a client lease that expired or is gone). At least one
filter is required; --dry-run lists what would be killed.`,
		Example: `  aenv gc --older-than 2h --metadata job=42
  aenv gc --orphans --dry-run`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if olderThan <= 0 && len(meta) == 0 && !orphans {
				return usageError{fmt.Errorf("give at least one of --older-than, --metadata and --orphans")}
			}
			metadata, err := keyValues("metadata", meta)
			if err != nil {
				return err
			}
			c, err := conn.client()
			if err != nil {
				return err
			}
			all, err := listSandboxes(cmd.Context(), c, nil, metadata)
			if err != nil {
				return err
			}
			cutoff := time.Now().Add(-olderThan)
			var victims []apispec.ListedSandbox
			for _, sb := range all {
				if (olderThan > 0 && !sb.StartedAt.Before(cutoff)) || (orphans && !orphan(sb)) {
					continue
				}
				victims = append(victims, sb)
			}
			out := cmd.OutOrStdout()
			failed := 0
			for _, sb := range victims {
				if dryRun {
					fmt.Fprintf(out, "would kill %s (%s, %s, started %s)\n", sb.SandboxID, sb.TemplateID, sb.State, ago(sb.StartedAt))
					continue
				}
				if err := c.do(cmd.Context(), "DELETE", "/sandboxes/"+url.PathEscape(sb.SandboxID), nil, nil); err != nil {
					fmt.Fprintf(cmd.ErrOrStderr(), "%s: %v\n", sb.SandboxID, err)
					failed++
					continue
				}
				fmt.Fprintf(out, "killed %s\n", sb.SandboxID)
			}
			verb := "killed"
			if dryRun {
				verb = "would kill"
			}
			fmt.Fprintf(out, "%s %d of %d sandboxes\n", verb, len(victims)-failed, len(all))
			if failed > 0 {
				return silent{fmt.Errorf("%d kills failed", failed)}
			}
			return nil
		},
	}
	conn.flags(cmd)
	cmd.Flags().DurationVar(&olderThan, "older-than", 0, "only sandboxes started longer ago than this (e.g. 2h)")
	cmd.Flags().StringArrayVar(&meta, "metadata", nil, "only sandboxes with this metadata KEY=VALUE (repeatable)")
	cmd.Flags().BoolVar(&orphans, "orphans", false, "only sandboxes bound to a client lease that expired or is gone")
	cmd.Flags().BoolVar(&dryRun, "dry-run", false, "list what would be killed, kill nothing")
	return cmd
}

func leaseCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "lease",
		Short: "Client leases: sandboxes bound to one end when it is not renewed in time",
	}
	cmd.AddCommand(leaseLsCmd(), leaseKeepaliveCmd(), leaseRmCmd())
	return cmd
}

func leaseLsCmd() *cobra.Command {
	var (
		conn   connection
		asJSON bool
	)
	cmd := &cobra.Command{
		Use:     "ls",
		Short:   "List the client leases and their sandboxes",
		Example: "  aenv lease ls",
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := conn.client()
			if err != nil {
				return err
			}
			var ls []apispec.Lease
			if err := c.do(cmd.Context(), "GET", "/leases", nil, &ls); err != nil {
				return err
			}
			if asJSON {
				return printJSON(cmd.OutOrStdout(), ls)
			}
			rows := make([][]string, 0, len(ls))
			for _, l := range ls {
				state := "live"
				if l.Expired {
					state = "expired"
				}
				rows = append(rows, []string{l.LeaseID, state, fmt.Sprintf("%ds", l.Ttl), ago(l.ExpiresAt), fmt.Sprint(len(l.Sandboxes))})
			}
			return table(cmd.OutOrStdout(), []string{"LEASE", "STATE", "TTL", "EXPIRES", "SANDBOXES"}, rows)
		},
	}
	conn.flags(cmd)
	jsonFlag(cmd, &asJSON)
	return cmd
}

func leaseKeepaliveCmd() *cobra.Command {
	var (
		conn connection
		ttl  time.Duration
	)
	cmd := &cobra.Command{
		Use:     "keepalive LEASE",
		Short:   "Renew a lease for its ttl (or --ttl) from now",
		Example: "  aenv lease keepalive trainer-1 --ttl 10m",
		Args:    cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := conn.client()
			if err != nil {
				return err
			}
			body := map[string]any{}
			if ttl > 0 {
				body["ttl"] = int(ttl / time.Second)
			}
			var l apispec.Lease
			if err := c.do(cmd.Context(), "POST", "/leases/"+url.PathEscape(args[0])+"/keepalive", body, &l); err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "lease %s renewed until %s (%d sandboxes)\n", l.LeaseID, l.ExpiresAt.Local().Format(time.RFC3339), len(l.Sandboxes))
			return nil
		},
	}
	conn.flags(cmd)
	cmd.Flags().DurationVar(&ttl, "ttl", 0, "the lease's new time to live (default: its own)")
	return cmd
}

func leaseRmCmd() *cobra.Command {
	var conn connection
	cmd := &cobra.Command{
		Use:     "rm LEASE",
		Short:   "Kill every sandbox bound to a lease and forget it",
		Example: "  aenv lease rm trainer-1",
		Args:    cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := conn.client()
			if err != nil {
				return err
			}
			var out struct {
				Killed []string `json:"killed"`
			}
			if err := c.do(cmd.Context(), "DELETE", "/leases/"+url.PathEscape(args[0]), nil, &out); err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "lease %s ended: %d sandboxes killed\n", args[0], len(out.Killed))
			return nil
		},
	}
	conn.flags(cmd)
	return cmd
}
