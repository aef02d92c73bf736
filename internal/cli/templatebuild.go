package cli

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"net/url"
	"os"
	"os/signal"
	"path"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"github.com/agentenv/agentenv/internal/buildfiles"
	"github.com/schollz/progressbar/v3"
	"github.com/spf13/cobra"
)

// `aenv template build` sends a Dockerfile's steps to a server's E2B
// template API, the way the E2B SDK's Template.build does, and shows the
// build's log as it goes.

func templateBuildCmd() *cobra.Command {
	var (
		conn                                 connection
		file, contextDir, startCmd, readyCmd string
		cpu, memMiB                          int
		noCache                              bool
	)
	cmd := &cobra.Command{
		Use:   "build NAME",
		Short: "Build a template on a server from a Dockerfile (FROM, RUN, ENV, WORKDIR, USER, COPY)",
		Example: `  aenv template build mytools -f Dockerfile --start-cmd 'python3 -m http.server 8080' \
      --ready-cmd 'curl -sf localhost:8080'`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			f, err := os.Open(file)
			if err != nil {
				return err
			}
			df, err := parseDockerfile(f)
			f.Close()
			if err != nil {
				return fmt.Errorf("%s: %w", file, err)
			}
			if contextDir == "" {
				contextDir = filepath.Dir(file)
			}
			c, err := conn.client()
			if err != nil {
				return err
			}
			ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
			defer stop()
			return remoteBuild(ctx, c, cmd.OutOrStdout(), args[0], df, contextDir, startCmd, readyCmd, cpu, memMiB, noCache)
		},
	}
	conn.flags(cmd)
	cmd.Flags().StringVar(&conn.url, "api-url", "", "the same as --url")
	_ = cmd.Flags().MarkHidden("api-url")
	cmd.Flags().StringVarP(&file, "file", "f", "Dockerfile", "the Dockerfile")
	cmd.Flags().StringVar(&contextDir, "context", "", "directory COPY sources are relative to (default: the Dockerfile's)")
	cmd.Flags().StringVar(&startCmd, "start-cmd", "", "command started before the template is snapshotted")
	cmd.Flags().StringVar(&readyCmd, "ready-cmd", "", "command that exits 0 once the start command is ready")
	cmd.Flags().IntVar(&cpu, "cpu", 0, "vCPUs of the template's sandboxes (default: the base template's)")
	cmd.Flags().IntVar(&memMiB, "memory-mb", 0, "memory of the template's sandboxes in MiB (default: the base template's)")
	cmd.Flags().BoolVar(&noCache, "no-cache", false, "run every step, ignoring cached layers")
	return cmd
}

func remoteBuild(ctx context.Context, c *apiClient, out io.Writer, name string, df *dockerfile, contextDir, startCmd, readyCmd string, cpu, memMiB int, noCache bool) error {
	var created struct {
		TemplateID string `json:"templateID"`
		BuildID    string `json:"buildID"`
	}
	req := map[string]any{"name": name}
	if cpu > 0 {
		req["cpuCount"] = cpu
	}
	if memMiB > 0 {
		req["memoryMB"] = memMiB
	}
	if err := c.do(ctx, "POST", "/v3/templates", req, &created); err != nil {
		return err
	}
	fmt.Fprintf(out, "build %s of template %s\n", created.BuildID, created.TemplateID)
	type step struct {
		Type      string   `json:"type"`
		Args      []string `json:"args"`
		FilesHash string   `json:"filesHash,omitempty"`
		Force     bool     `json:"force,omitempty"`
	}
	var steps []step
	for _, s := range df.Steps {
		st := step{Type: s.Type, Args: s.Args}
		if s.Type == "COPY" {
			archive, hash, err := copyArchive(contextDir, s.Args[0], s.Args[1])
			if err != nil {
				return fmt.Errorf("line %d: COPY %s: %w", s.Line, s.Args[0], err)
			}
			var link struct {
				Present bool   `json:"present"`
				URL     string `json:"url"`
			}
			if err := c.do(ctx, "GET", "/templates/"+url.PathEscape(created.TemplateID)+"/files/"+hash, nil, &link); err != nil {
				return err
			}
			if link.Present {
				fmt.Fprintf(out, "  %s: already uploaded\n", s.Args[0])
			} else {
				preq, err := http.NewRequestWithContext(ctx, "PUT", link.URL, bytes.NewReader(archive))
				if err != nil {
					return err
				}
				resp, err := c.http.Do(preq)
				if err != nil {
					return err
				}
				resp.Body.Close()
				if resp.StatusCode/100 != 2 {
					return fmt.Errorf("upload %s: %s", s.Args[0], resp.Status)
				}
				fmt.Fprintf(out, "  %s: uploaded (%d bytes)\n", s.Args[0], len(archive))
			}
			st.FilesHash = hash
		}
		steps = append(steps, st)
	}
	spec := map[string]any{"steps": steps, "startCmd": startCmd, "readyCmd": readyCmd, "force": noCache}
	if strings.ContainsAny(df.From, "/:") {
		spec["fromImage"] = df.From
	} else {
		spec["fromTemplate"] = df.From
	}
	if err := c.do(ctx, "POST", "/v2/templates/"+url.PathEscape(created.TemplateID)+"/builds/"+url.PathEscape(created.BuildID), spec, nil); err != nil {
		return err
	}
	// On a terminal a progress bar (one tick per step, one for the final
	// boot and snapshot) stays under the log; piped output is plain lines.
	var bar *progressbar.ProgressBar
	if stdoutIsTerminal(out) {
		bar = progressbar.NewOptions(len(df.Steps)+1, progressbar.OptionSetWriter(out),
			progressbar.OptionSetDescription("building "+name), progressbar.OptionShowCount(),
			progressbar.OptionSetElapsedTime(true), progressbar.OptionClearOnFinish())
		defer bar.Close()
	}
	say := func(format string, args ...any) {
		if bar != nil {
			bar.Clear()
		}
		fmt.Fprintf(out, format, args...)
		if bar != nil {
			bar.RenderBlank()
		}
	}
	offset := 0
	for {
		var st struct {
			Status     string `json:"status"`
			LogEntries []struct {
				Message string `json:"message"`
				Step    string `json:"step"`
				Level   string `json:"level"`
			} `json:"logEntries"`
			Reason *struct {
				Message string `json:"message"`
			} `json:"reason"`
		}
		p := fmt.Sprintf("/templates/%s/builds/%s/status?logsOffset=%d", url.PathEscape(created.TemplateID), url.PathEscape(created.BuildID), offset)
		if err := c.do(ctx, "GET", p, nil, &st); err != nil {
			return err
		}
		for _, e := range st.LogEntries {
			prefix := ""
			if e.Step != "" {
				prefix = "[" + e.Step + "] "
				var i int
				if _, err := fmt.Sscan(e.Step, &i); err == nil && bar != nil {
					bar.Set(i)
				}
			}
			say("  %s%s\n", prefix, e.Message)
		}
		offset += len(st.LogEntries)
		switch st.Status {
		case "ready":
			if bar != nil {
				bar.Finish()
			}
			fmt.Fprintf(out, "template %s ready: create sandboxes with templateID %q\n", created.TemplateID, created.TemplateID)
			return nil
		case "error":
			msg := "unknown error"
			if st.Reason != nil {
				msg = st.Reason.Message
			}
			return fmt.Errorf("build failed: %s", msg)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(500 * time.Millisecond):
		}
	}
}

// copyArchive packs a COPY source (a file or a directory, relative to the
// context) as a gzip-compressed tar holding it under its context path, and
// returns the files hash the E2B SDKs would send for it (paths, modes,
// contents and the destination; see buildfiles.Hash), which the server
// checks the upload against, so an unchanged COPY is uploaded and built once.
func copyArchive(contextDir, src, dest string) ([]byte, string, error) {
	rel := path.Clean("/" + filepath.ToSlash(src))[1:]
	if rel == "" {
		rel = "."
	}
	root := filepath.Join(contextDir, filepath.FromSlash(rel))
	if _, err := os.Lstat(root); err != nil {
		return nil, "", err
	}
	var files []string
	if err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		files = append(files, p)
		return nil
	}); err != nil {
		return nil, "", err
	}
	sort.Strings(files)
	var buf bytes.Buffer
	gz := gzip.NewWriter(&buf)
	tw := tar.NewWriter(gz)
	for _, p := range files {
		fi, err := os.Lstat(p)
		if err != nil {
			return nil, "", err
		}
		name, _ := filepath.Rel(contextDir, p)
		name = filepath.ToSlash(name)
		link := ""
		if fi.Mode()&fs.ModeSymlink != 0 {
			if link, err = os.Readlink(p); err != nil {
				return nil, "", err
			}
		}
		hdr, err := tar.FileInfoHeader(fi, link)
		if err != nil {
			return nil, "", err
		}
		hdr.Name = name
		hdr.Uid, hdr.Gid, hdr.Uname, hdr.Gname = 0, 0, "", ""
		hdr.ModTime = time.Unix(0, 0)
		if fi.IsDir() {
			hdr.Name += "/"
		}
		if err := tw.WriteHeader(hdr); err != nil {
			return nil, "", err
		}
		if fi.Mode().IsRegular() {
			f, err := os.Open(p)
			if err != nil {
				return nil, "", err
			}
			_, err = io.Copy(tw, f)
			f.Close()
			if err != nil {
				return nil, "", err
			}
		}
	}
	if err := tw.Close(); err != nil {
		return nil, "", err
	}
	if err := gz.Close(); err != nil {
		return nil, "", err
	}
	if len(files) == 0 {
		return nil, "", errors.New("nothing to copy")
	}
	// The hash the E2B SDKs send, which the server checks the archive against.
	hash, _, err := buildfiles.Hash(bytes.NewReader(buf.Bytes()), src, dest)
	if err != nil {
		return nil, "", err
	}
	return buf.Bytes(), hash, nil
}
