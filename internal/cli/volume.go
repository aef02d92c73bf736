package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"strconv"

	"github.com/agentenv/agentenv/internal/apispec"
	"github.com/spf13/cobra"
)

// Client commands for a server's volumes: the volumes themselves with the
// API key, their files through the volume content API with each volume's
// own token (which the commands fetch with the API key).

func volumeCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "volume",
		Short: "Volumes: persistent filesystems, read and written from outside any sandbox",
	}
	cmd.AddCommand(volumeCreateCmd(), volumeLsCmd(), volumeRmCmd(), volumeFilesCmd(), volumePutCmd(), volumeGetCmd(),
		volumeMkdirCmd(), volumeDeletePathCmd())
	return cmd
}

func volumeCreateCmd() *cobra.Command {
	var (
		conn   connection
		asJSON bool
	)
	cmd := &cobra.Command{
		Use:     "create NAME",
		Short:   "Make a volume (an empty filesystem)",
		Example: "  aenv volume create data",
		Args:    cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := conn.client()
			if err != nil {
				return err
			}
			var v apispec.VolumeAndToken
			if err := c.do(cmd.Context(), "POST", "/volumes", map[string]string{"name": args[0]}, &v); err != nil {
				return err
			}
			if asJSON {
				return printJSON(cmd.OutOrStdout(), v)
			}
			fmt.Fprintf(cmd.OutOrStdout(), "volume %s (%s)\n", v.Name, v.VolumeID)
			return nil
		},
	}
	conn.flags(cmd)
	jsonFlag(cmd, &asJSON)
	return cmd
}

func volumeLsCmd() *cobra.Command {
	return listingCmd("List the volumes", "  aenv volume ls\n  aenv volume ls -o json", "/volumes",
		[]string{"NAME", "ID"}, func(v apispec.Volume) []string { return []string{v.Name, v.VolumeID} })
}

func volumeRmCmd() *cobra.Command {
	var conn connection
	cmd := &cobra.Command{
		Use:     "rm VOLUME...",
		Aliases: []string{"delete"},
		Short:   "Delete volumes (by name or id) and what they hold",
		Example: "  aenv volume rm data",
		Args:    cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := conn.client()
			if err != nil {
				return err
			}
			var firstErr error
			for _, ref := range args {
				err := func() error {
					v, err := findVolume(cmd.Context(), c, ref)
					if err != nil {
						return err
					}
					return c.do(cmd.Context(), "DELETE", "/volumes/"+url.PathEscape(v.VolumeID), nil, nil)
				}()
				if err != nil {
					fmt.Fprintln(cmd.ErrOrStderr(), "aenv:", err)
					if firstErr == nil {
						firstErr = err
					}
					continue
				}
				fmt.Fprintln(cmd.OutOrStdout(), "deleted volume", ref)
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

// findVolume resolves a volume's name or id to the volume, with its token.
func findVolume(ctx context.Context, c *apiClient, ref string) (*apispec.VolumeAndToken, error) {
	var v apispec.VolumeAndToken
	err := c.do(ctx, "GET", "/volumes/"+url.PathEscape(ref), nil, &v)
	var ae *apiError
	if err == nil || !errors.As(err, &ae) || ae.Status != http.StatusNotFound {
		return &v, err
	}
	var all []apispec.Volume
	if err := c.do(ctx, "GET", "/volumes", nil, &all); err != nil {
		return nil, err
	}
	for _, v := range all {
		if v.Name == ref {
			return findVolume(ctx, c, v.VolumeID)
		}
	}
	return nil, fmt.Errorf("no volume named or with id %q", ref)
}

// volumeContent sends a content request for volume ref with its token;
// the caller closes the answer (a 2xx).
func volumeContent(ctx context.Context, c *apiClient, ref, method, route string, query url.Values, body io.Reader) (*http.Response, error) {
	v, err := findVolume(ctx, c, ref)
	if err != nil {
		return nil, err
	}
	p := "/volumecontent/" + url.PathEscape(v.VolumeID) + "/" + route + "?" + query.Encode()
	req, err := http.NewRequestWithContext(ctx, method, c.base+p, body)
	if err != nil {
		return nil, err
	}
	req.Header.Set("Authorization", "Bearer "+v.Token)
	if body != nil {
		req.Header.Set("Content-Type", "application/octet-stream")
	}
	resp, err := c.http.Do(req)
	if err != nil {
		return nil, fmt.Errorf("%s %s: %w", method, route, err)
	}
	if resp.StatusCode/100 != 2 {
		return nil, decodeResponse(resp, method, "/volumecontent/…/"+route+"?path="+query.Get("path"), nil)
	}
	return resp, nil
}

func volumeFilesCmd() *cobra.Command {
	var (
		conn   connection
		asJSON bool
		depth  int
	)
	cmd := &cobra.Command{
		Use:     "files VOLUME [PATH]",
		Short:   "List a directory of a volume (default its root)",
		Example: "  aenv volume files data\n  aenv volume files data /results --depth 3",
		Args:    cobra.RangeArgs(1, 2),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := conn.client()
			if err != nil {
				return err
			}
			p := "/"
			if len(args) == 2 {
				p = args[1]
			}
			resp, err := volumeContent(cmd.Context(), c, args[0], "GET", "dir", url.Values{"path": {p}, "depth": {strconv.Itoa(depth)}}, nil)
			if err != nil {
				return err
			}
			var entries []apispec.VolumeEntryStat
			if err := decodeResponse(resp, "GET", "dir", &entries); err != nil {
				return err
			}
			if asJSON {
				return printJSON(cmd.OutOrStdout(), entries)
			}
			rows := make([][]string, 0, len(entries))
			for _, e := range entries {
				name := e.Path
				if e.Target != nil {
					name += " -> " + *e.Target
				}
				rows = append(rows, []string{fmt.Sprintf("%s %04o", e.Type, e.Mode), fmt.Sprintf("%d:%d", e.Uid, e.Gid),
					strconv.FormatInt(e.Size, 10), ago(e.Mtime), name})
			}
			return table(cmd.OutOrStdout(), []string{"TYPE MODE", "OWNER", "SIZE", "MODIFIED", "PATH"}, rows)
		},
	}
	conn.flags(cmd)
	jsonFlag(cmd, &asJSON)
	cmd.Flags().IntVar(&depth, "depth", 1, "levels to list (1: the directory's entries)")
	return cmd
}

func volumePutCmd() *cobra.Command {
	var (
		conn  connection
		mode  string
		force bool
	)
	cmd := &cobra.Command{
		Use:   "put VOLUME LOCAL-FILE PATH",
		Short: "Write a local file (- for stdin) to a path of a volume, at once (its parents are made)",
		Example: `  aenv volume put data ./train.jsonl /datasets/train.jsonl
  echo hi | aenv volume put data - /notes/hi.txt --mode 0600`,
		Args: cobra.ExactArgs(3),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := conn.client()
			if err != nil {
				return err
			}
			var body io.Reader = cmd.InOrStdin()
			if args[1] != "-" {
				f, err := os.Open(args[1])
				if err != nil {
					return err
				}
				defer f.Close()
				body = f
			}
			q := url.Values{"path": {args[2]}}
			if mode != "" {
				m, err := strconv.ParseUint(mode, 8, 32)
				if err != nil {
					return usageError{fmt.Errorf("--mode %q: want octal permission bits, e.g. 0644", mode)}
				}
				q.Set("mode", strconv.FormatUint(m, 10))
			}
			if force {
				q.Set("force", "true")
			}
			resp, err := volumeContent(cmd.Context(), c, args[0], "PUT", "file", q, body)
			if err != nil {
				return err
			}
			var e apispec.VolumeEntryStat
			if err := decodeResponse(resp, "PUT", "file", &e); err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "wrote %s (%d bytes)\n", e.Path, e.Size)
			return nil
		},
	}
	conn.flags(cmd)
	cmd.Flags().StringVar(&mode, "mode", "", "permission bits of the file, octal (default 0644)")
	cmd.Flags().BoolVar(&force, "force", false, "replace a directory or link at PATH")
	return cmd
}

func volumeGetCmd() *cobra.Command {
	var conn connection
	cmd := &cobra.Command{
		Use:     "get VOLUME PATH [LOCAL-FILE]",
		Short:   "Read a file of a volume (to stdout, or to a local file)",
		Example: "  aenv volume get data /notes/hi.txt\n  aenv volume get data /datasets/train.jsonl ./train.jsonl",
		Args:    cobra.RangeArgs(2, 3),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := conn.client()
			if err != nil {
				return err
			}
			resp, err := volumeContent(cmd.Context(), c, args[0], "GET", "file", url.Values{"path": {args[1]}}, nil)
			if err != nil {
				return err
			}
			defer resp.Body.Close()
			if len(args) == 2 {
				_, err = io.Copy(cmd.OutOrStdout(), resp.Body)
				return err
			}
			return writeFileAtomically(args[2], resp.Body)
		},
	}
	conn.flags(cmd)
	return cmd
}

// writeFileAtomically writes r to path through a temporary file renamed
// over it once complete and synced.
func writeFileAtomically(path string, r io.Reader) error {
	tmp := path + ".aenv-tmp"
	f, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o644)
	if err != nil {
		return err
	}
	_, err = io.Copy(f, r)
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, path)
	}
	if err != nil {
		os.Remove(tmp)
	}
	return err
}

func volumeMkdirCmd() *cobra.Command {
	var (
		conn    connection
		parents bool
	)
	cmd := &cobra.Command{
		Use:     "mkdir VOLUME PATH",
		Short:   "Make a directory in a volume",
		Example: "  aenv volume mkdir data /results/run-1 -p",
		Args:    cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := conn.client()
			if err != nil {
				return err
			}
			q := url.Values{"path": {args[1]}}
			if parents {
				q.Set("force", "true")
			}
			resp, err := volumeContent(cmd.Context(), c, args[0], "POST", "dir", q, nil)
			if err != nil {
				return err
			}
			return decodeResponse(resp, "POST", "dir", nil)
		},
	}
	conn.flags(cmd)
	cmd.Flags().BoolVarP(&parents, "parents", "p", false, "make missing parents too (an existing directory is then fine)")
	return cmd
}

func volumeDeletePathCmd() *cobra.Command {
	var conn connection
	cmd := &cobra.Command{
		Use:     "delete-path VOLUME PATH",
		Short:   "Remove a file, link or directory (with what it holds) from a volume",
		Example: "  aenv volume delete-path data /results/run-1",
		Args:    cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := conn.client()
			if err != nil {
				return err
			}
			resp, err := volumeContent(cmd.Context(), c, args[0], "DELETE", "path", url.Values{"path": {args[1]}}, nil)
			if err != nil {
				return err
			}
			return decodeResponse(resp, "DELETE", "path", nil)
		},
	}
	conn.flags(cmd)
	return cmd
}
