package cli

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/agentenv/agentenv/internal/apispec"
	"github.com/agentenv/agentenv/internal/errkind"
	"github.com/spf13/cobra"
)

// The sandbox commands: create, ls, info, pause, resume, fork, timeout,
// kill, logs (exec, shell and cp are in envdclient.go).

// keyValues parses repeated K=V flags.
func keyValues(flag string, vals []string) (map[string]string, error) {
	if len(vals) == 0 {
		return nil, nil
	}
	out := map[string]string{}
	for _, kv := range vals {
		k, v, ok := strings.Cut(kv, "=")
		if !ok || k == "" {
			return nil, usageError{fmt.Errorf("--%s %q: want KEY=VALUE", flag, kv)}
		}
		out[k] = v
	}
	return out, nil
}

func createCmd() *cobra.Command {
	var (
		conn                 connection
		timeout              time.Duration
		cpu, memMB           int
		env, meta, volumes   []string
		noAutoPause, noInet  bool
		secure, printJSONOut bool
		lease, imageRef      string
		leaseTTL             time.Duration
	)
	cmd := &cobra.Command{
		Use:   "create (TEMPLATE | --image REF)",
		Short: "Create a sandbox and print its id",
		Example: `  aenv create base
  id=$(aenv create base --timeout 1h --env API_URL=http://x --metadata job=42)
  aenv create base --cpu 2 --memory 1024 --no-auto-pause -o json
  aenv create base --volume data:/mnt/data
  aenv create base --lease trainer-1 --lease-ttl 2m
  aenv create --image docker-archive:/srv/images/task-17.tar`,
		Args: cobra.MaximumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if (len(args) == 1) == (imageRef != "") {
				return usageError{errors.New("give a template or --image REF, not both")}
			}
			c, err := conn.client()
			if err != nil {
				return err
			}
			envs, err := keyValues("env", env)
			if err != nil {
				return err
			}
			metadata, err := keyValues("metadata", meta)
			if err != nil {
				return err
			}
			body := map[string]any{"timeout": int64(timeout / time.Second), "autoPause": !noAutoPause, "secure": secure}
			route := "/sandboxes"
			if imageRef != "" {
				body["image"], route = imageRef, "/sandboxes-cold"
			} else {
				body["templateID"] = args[0]
			}
			if envs != nil {
				body["envVars"] = envs
			}
			if metadata != nil {
				body["metadata"] = metadata
			}
			if cpu > 0 {
				body["cpuCount"] = cpu
			}
			if memMB > 0 {
				body["memoryMB"] = memMB
			}
			if noInet {
				body["allow_internet_access"] = false
			}
			if len(volumes) > 0 {
				mounts := make([]apispec.SandboxVolumeMount, 0, len(volumes))
				for _, v := range volumes {
					name, path, ok := strings.Cut(v, ":")
					if !ok || name == "" || path == "" {
						return fmt.Errorf("%w: --volume %q: want NAME:PATH", errkind.ErrInvalid, v)
					}
					mounts = append(mounts, apispec.SandboxVolumeMount{Name: name, Path: path})
				}
				body["volumeMounts"] = mounts
			}
			if lease != "" {
				l := map[string]any{"id": lease}
				if leaseTTL > 0 {
					l["ttl"] = int(leaseTTL / time.Second)
				}
				body["lease"] = l
			}
			var sb apispec.Sandbox
			if err := c.do(cmd.Context(), "POST", route, body, &sb); err != nil {
				return err
			}
			if printJSONOut {
				return printJSON(cmd.OutOrStdout(), sb)
			}
			fmt.Fprintln(cmd.OutOrStdout(), sb.SandboxID)
			return nil
		},
	}
	conn.flags(cmd)
	timeoutFlag(cmd, &timeout, "time to live (seconds, or a duration like 30m); then the sandbox is paused (or killed with --no-auto-pause)")
	cmd.Flags().IntVar(&cpu, "cpu", 0, "vCPUs (default: the template's)")
	cmd.Flags().IntVar(&memMB, "memory", 0, "memory in MiB (default: the template's)")
	cmd.Flags().StringArrayVar(&env, "env", nil, "environment variable KEY=VALUE for every command (repeatable)")
	cmd.Flags().StringArrayVar(&meta, "metadata", nil, "metadata KEY=VALUE (repeatable; `aenv ls --metadata` filters by it)")
	cmd.Flags().BoolVar(&noAutoPause, "no-auto-pause", false, "kill the sandbox when its time runs out instead of pausing it")
	cmd.Flags().BoolVar(&noInet, "no-internet", false, "block all egress from the sandbox")
	cmd.Flags().StringArrayVar(&volumes, "volume", nil, "mount volume NAME at PATH in the guest, as NAME:PATH (repeatable, up to 4)")
	cmd.Flags().BoolVar(&secure, "secure", true, "require the sandbox's access token for envd traffic")
	cmd.Flags().StringVar(&lease, "lease", "", "bind the sandbox to this client lease (made or renewed); when it is not renewed in time (aenv lease keepalive) the sandbox ends")
	cmd.Flags().DurationVar(&leaseTTL, "lease-ttl", 0, "the lease's time to live (default 5m)")
	cmd.Flags().StringVar(&imageRef, "image", "", "make the sandbox straight from an OCI image, no template build: a registry reference, oci-layout:DIR[:TAG] or docker-archive:FILE (on the server)")
	jsonFlag(cmd, &printJSONOut)
	return cmd
}

// seconds is a time to live given as whole seconds (as the E2B API counts
// them) or as a Go duration.
type seconds struct{ d *time.Duration }

func (s seconds) String() string {
	if s.d == nil {
		return ""
	}
	return s.d.String()
}
func (s seconds) Type() string { return "seconds|duration" }
func (s seconds) Set(v string) error {
	if n, err := strconv.ParseInt(v, 10, 64); err == nil {
		*s.d = time.Duration(n) * time.Second
	} else if d, err := time.ParseDuration(v); err == nil {
		*s.d = d
	} else {
		return fmt.Errorf("want seconds (300) or a duration (5m)")
	}
	if *s.d < time.Second {
		return fmt.Errorf("at least one second")
	}
	return nil
}

// timeoutFlag adds --timeout (default 5 minutes).
func timeoutFlag(cmd *cobra.Command, d *time.Duration, usage string) {
	*d = 5 * time.Minute
	cmd.Flags().Var(seconds{d}, "timeout", usage)
}

// jsonFlag adds -o json (table is the default) as a bool.
func jsonFlag(cmd *cobra.Command, asJSON *bool) {
	var f outputFormat = "table"
	cmd.Flags().VarP(&f, "output", "o", "output format: table or json")
	prev := cmd.PreRunE
	cmd.PreRunE = func(c *cobra.Command, args []string) error {
		*asJSON = f == "json"
		if prev != nil {
			return prev(c, args)
		}
		return nil
	}
}

// metadataQuery encodes a metadata filter as the E2B SDKs do: each key and
// value URI-encoded, the pairs form-encoded.
func metadataQuery(m map[string]string) string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	inner := url.Values{}
	for _, k := range keys {
		inner.Add(url.QueryEscape(k), url.QueryEscape(m[k]))
	}
	return inner.Encode()
}

// listSandboxes reads every page of GET /v2/sandboxes.
func listSandboxes(ctx context.Context, c *apiClient, states []string, metadata map[string]string) ([]apispec.ListedSandbox, error) {
	var all []apispec.ListedSandbox
	token := ""
	for page := 0; page < 10000; page++ {
		q := url.Values{"limit": {"100"}}
		if len(states) > 0 {
			q.Set("state", strings.Join(states, ","))
		}
		if len(metadata) > 0 {
			q.Set("metadata", metadataQuery(metadata))
		}
		if token != "" {
			q.Set("nextToken", token)
		}
		resp, err := c.send(ctx, "GET", "/v2/sandboxes?"+q.Encode(), nil)
		if err != nil {
			return nil, err
		}
		var items []apispec.ListedSandbox
		if err := decodeResponse(resp, "GET", "/v2/sandboxes", &items); err != nil {
			return nil, err
		}
		all = append(all, items...)
		if token = resp.Header.Get("X-Next-Token"); token == "" {
			return all, nil
		}
	}
	return nil, errors.New("the sandbox list does not end")
}

func lsCmd() *cobra.Command {
	var (
		conn    connection
		states  []string
		meta    []string
		asJSON  bool
		orphans bool
	)
	cmd := &cobra.Command{
		Use:     "ls",
		Aliases: []string{"list"},
		Short:   "List sandboxes (running and paused), newest first",
		Example: `  aenv ls
  aenv ls --state paused
  aenv ls --metadata job=42 -o json
  aenv ls --orphans`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := conn.client()
			if err != nil {
				return err
			}
			for _, s := range states {
				if s != "running" && s != "paused" {
					return usageError{fmt.Errorf("--state %q: want running or paused", s)}
				}
			}
			metadata, err := keyValues("metadata", meta)
			if err != nil {
				return err
			}
			all, err := listSandboxes(cmd.Context(), c, states, metadata)
			if err != nil {
				return err
			}
			if orphans {
				all = slices.DeleteFunc(all, func(sb apispec.ListedSandbox) bool { return !orphan(sb) })
			}
			if asJSON {
				if all == nil {
					all = []apispec.ListedSandbox{}
				}
				return printJSON(cmd.OutOrStdout(), all)
			}
			rows := make([][]string, 0, len(all))
			for _, sb := range all {
				rows = append(rows, []string{sb.SandboxID, sb.TemplateID, string(sb.State), ago(sb.StartedAt), ago(sb.EndAt),
					fmt.Sprint(sb.CpuCount), fmt.Sprintf("%d MiB", sb.MemoryMB), formatMetadata(sb.Metadata)})
			}
			return table(cmd.OutOrStdout(), []string{"SANDBOX", "TEMPLATE", "STATE", "STARTED", "ENDS", "CPU", "MEMORY", "METADATA"}, rows)
		},
	}
	conn.flags(cmd)
	cmd.Flags().StringSliceVar(&states, "state", nil, "only sandboxes in these states (running, paused)")
	cmd.Flags().StringArrayVar(&meta, "metadata", nil, "only sandboxes with this metadata KEY=VALUE (repeatable)")
	cmd.Flags().BoolVar(&orphans, "orphans", false, "only sandboxes bound to a client lease that expired or is gone")
	jsonFlag(cmd, &asJSON)
	return cmd
}

func formatMetadata(m map[string]string) string {
	if len(m) == 0 {
		return "-"
	}
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	parts := make([]string, 0, len(keys))
	for _, k := range keys {
		parts = append(parts, k+"="+m[k])
	}
	return strings.Join(parts, ",")
}

func infoCmd() *cobra.Command {
	var (
		conn   connection
		asJSON bool
	)
	cmd := &cobra.Command{
		Use:   "info SANDBOX",
		Short: "Show a sandbox",
		Example: `  aenv info i1a2b3c4d5e6f7g8h9j0
  aenv info i1a2b3c4d5e6f7g8h9j0 -o json | jq .endAt`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := conn.client()
			if err != nil {
				return err
			}
			var sb apispec.SandboxDetail
			if err := c.do(cmd.Context(), "GET", "/sandboxes/"+url.PathEscape(args[0]), nil, &sb); err != nil {
				return err
			}
			if asJSON {
				return printJSON(cmd.OutOrStdout(), sb)
			}
			w := cmd.OutOrStdout()
			for _, kv := range [][2]string{
				{"sandbox", sb.SandboxID}, {"template", sb.TemplateID}, {"state", string(sb.State)},
				{"started", sb.StartedAt.Local().Format(time.RFC3339) + " (" + ago(sb.StartedAt) + ")"},
				{"ends", sb.EndAt.Local().Format(time.RFC3339) + " (" + ago(sb.EndAt) + ")"},
				{"cpu", fmt.Sprint(sb.CpuCount)}, {"memory", fmt.Sprintf("%d MiB", sb.MemoryMB)},
				{"disk", fmt.Sprintf("%d MiB", sb.DiskSizeMB)}, {"envd", sb.EnvdVersion}, {"metadata", formatMetadata(sb.Metadata)},
			} {
				fmt.Fprintf(w, "%-9s %s\n", kv[0]+":", kv[1])
			}
			return nil
		},
	}
	conn.flags(cmd)
	jsonFlag(cmd, &asJSON)
	return cmd
}

// simpleSandboxCmd is a command that POSTs to one sandbox and prints a
// line.
func simpleSandboxCmd(use, short, example, path string, body func(args []string) (any, error), done string) *cobra.Command {
	var conn connection
	cmd := &cobra.Command{
		Use: use, Short: short, Example: example,
		Args: cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := conn.client()
			if err != nil {
				return err
			}
			var in any
			if body != nil {
				if in, err = body(args); err != nil {
					return err
				}
			}
			if err := c.do(cmd.Context(), "POST", "/sandboxes/"+url.PathEscape(args[0])+path, in, nil); err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), done+"\n", args[0])
			return nil
		},
	}
	conn.flags(cmd)
	return cmd
}

func pauseCmd() *cobra.Command {
	cmd := simpleSandboxCmd("pause SANDBOX", "Pause a sandbox: its memory and disk are kept, its CPU and RAM freed",
		"  aenv pause i1a2b3c4d5e6f7g8h9j0", "/pause", nil, "paused %s")
	cmd.Args = cobra.ExactArgs(1)
	return cmd
}

func resumeCmd() *cobra.Command {
	var timeout time.Duration
	cmd := simpleSandboxCmd("resume SANDBOX", "Resume a paused sandbox where it stopped",
		"  aenv resume i1a2b3c4d5e6f7g8h9j0 --timeout 30m", "/resume",
		func([]string) (any, error) { return map[string]any{"timeout": int64(timeout / time.Second)}, nil }, "resumed %s")
	cmd.Args = cobra.ExactArgs(1)
	timeoutFlag(cmd, &timeout, "new time to live (seconds, or a duration like 30m)")
	return cmd
}

func timeoutCmd() *cobra.Command {
	cmd := simpleSandboxCmd("timeout SANDBOX SECONDS", "Set a sandbox's time to live, counted from now",
		"  aenv timeout i1a2b3c4d5e6f7g8h9j0 3600", "/timeout",
		func(args []string) (any, error) {
			var secs int64
			if _, err := fmt.Sscan(args[1], &secs); err != nil || secs < 1 {
				return nil, usageError{fmt.Errorf("SECONDS %q: want a positive number", args[1])}
			}
			return map[string]any{"timeout": secs}, nil
		}, "timeout of %s set")
	cmd.Args = cobra.ExactArgs(2)
	return cmd
}

func forkCmd() *cobra.Command {
	var (
		conn    connection
		count   int
		timeout time.Duration
		asJSON  bool
	)
	cmd := &cobra.Command{
		Use:   "fork SANDBOX",
		Short: "Clone a running sandbox into N children (memory shared copy-on-write); prints their ids",
		Example: `  aenv fork i1a2b3c4d5e6f7g8h9j0 -n 4
  for id in $(aenv fork $parent -n 8); do aenv exec $id -- ./rollout.sh & done`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if count < 1 || count > 16 {
				return usageError{fmt.Errorf("-n %d: want 1 to 16 children", count)}
			}
			c, err := conn.client()
			if err != nil {
				return err
			}
			var out []struct {
				Sandbox *apispec.Sandbox `json:"sandbox"`
				Error   *struct {
					Message string `json:"message"`
				} `json:"error"`
			}
			body := map[string]any{"count": count, "timeout": int64(timeout / time.Second)}
			if err := c.do(cmd.Context(), "POST", "/sandboxes/"+url.PathEscape(args[0])+"/fork", body, &out); err != nil {
				return err
			}
			if asJSON {
				return printJSON(cmd.OutOrStdout(), out)
			}
			failed := 0
			for _, r := range out {
				if r.Sandbox != nil {
					fmt.Fprintln(cmd.OutOrStdout(), r.Sandbox.SandboxID)
				} else if r.Error != nil {
					failed++
					fmt.Fprintln(cmd.ErrOrStderr(), "a child failed:", r.Error.Message)
				}
			}
			if failed > 0 {
				return exitCode(1)
			}
			return nil
		},
	}
	conn.flags(cmd)
	cmd.Flags().IntVarP(&count, "count", "n", 1, "number of children (1-16)")
	timeoutFlag(cmd, &timeout, "the children's time to live (seconds, or a duration like 30m)")
	jsonFlag(cmd, &asJSON)
	return cmd
}

func killCmd() *cobra.Command {
	return deleteCmd("kill SANDBOX...", "Kill sandboxes (running or paused): everything of them is deleted",
		`  aenv kill i1a2b3c4d5e6f7g8h9j0
  aenv ls --metadata job=42 -o json | jq -r '.[].sandboxID' | xargs aenv kill`, "/sandboxes/", "killed")
}

// silent is an error already reported to the user; only its exit code
// matters.
type silent struct{ error }

func (s silent) Unwrap() error { return s.error }

func logsCmd() *cobra.Command {
	var (
		conn   connection
		follow bool
	)
	cmd := &cobra.Command{
		Use:   "logs SANDBOX",
		Short: "Print a sandbox's console log (kernel, init, envd)",
		Example: `  aenv logs i1a2b3c4d5e6f7g8h9j0
  aenv logs -f i1a2b3c4d5e6f7g8h9j0`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := conn.client()
			if err != nil {
				return err
			}
			printed := 0
			for {
				var out struct {
					Logs []struct {
						Line string `json:"line"`
					} `json:"logs"`
				}
				if err := c.do(cmd.Context(), "GET", "/sandboxes/"+url.PathEscape(args[0])+"/logs?limit=10000", nil, &out); err != nil {
					var ae *apiError
					if follow && printed > 0 && errors.As(err, &ae) && ae.Status == 404 {
						return nil // the sandbox ended
					}
					return err
				}
				if len(out.Logs) < printed {
					printed = 0 // the log was cut at its start
				}
				for _, l := range out.Logs[printed:] {
					fmt.Fprintln(cmd.OutOrStdout(), l.Line)
				}
				printed = len(out.Logs)
				if !follow {
					return nil
				}
				select {
				case <-cmd.Context().Done():
					return nil
				case <-time.After(time.Second):
				}
			}
		},
	}
	conn.flags(cmd)
	cmd.Flags().BoolVarP(&follow, "follow", "f", false, "keep printing new lines until the sandbox ends or Ctrl-C")
	return cmd
}
