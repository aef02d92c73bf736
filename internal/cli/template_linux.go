//go:build linux

package cli

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"time"

	"github.com/spf13/cobra"

	"github.com/agentenv/agentenv/internal/datadir"
	"github.com/agentenv/agentenv/internal/storage/image"
	"github.com/agentenv/agentenv/internal/storage/repository"
	"github.com/agentenv/agentenv/internal/templates"
)

func templateImportCmd() *cobra.Command {
	var (
		dataDir string
		src     image.Source
		sizeMiB int
	)
	cmd := &cobra.Command{
		Use:   "import NAME (--oci-layout DIR | --docker-archive FILE | --image REF)",
		Short: "Make a template from an OCI image; its layers are stored once per node and shared",
		Example: `  aenv template import py --docker-archive python.tar
  aenv template import tools --oci-layout ./layout`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			n := 0
			for _, s := range []string{src.Layout, src.Archive, src.Ref} {
				if s != "" {
					n++
				}
			}
			if n != 1 {
				return errors.New("give exactly one of --oci-layout, --docker-archive, --image")
			}
			if os.Geteuid() != 0 {
				return errors.New("template import must run as root (it mounts file system images)")
			}
			lock, err := datadir.Acquire(dataDir, "aenv template import")
			if err != nil {
				return fmt.Errorf("%w (a running server imports images through its template API: aenv template build)", err)
			}
			defer lock.Release()
			ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
			defer stop()
			out := cmd.OutOrStdout()
			cat, closeCat, err := templates.OpenOffline(ctx, dataDir, nil)
			if err != nil {
				return err
			}
			defer closeCat()
			t, err := cat.ImportImage(ctx, args[0], src, sizeMiB, func(format string, a ...any) {
				fmt.Fprintf(out, "  "+format+"\n", a...)
			})
			if err != nil {
				return err
			}
			fmt.Fprintf(out, "template %s ready (default user %s); create sandboxes with templateID %q\n", t.Name, t.DefaultUser, t.Name)
			return nil
		},
	}
	dataDirFlag(cmd, &dataDir)
	cmd.Flags().StringVar(&src.Layout, "oci-layout", "", "an OCI image layout directory")
	cmd.Flags().StringVar(&src.Archive, "docker-archive", "", "a `docker save` tarball")
	cmd.Flags().StringVar(&src.Ref, "image", "", "a registry reference (credentials from ~/.docker/config.json)")
	cmd.Flags().IntVar(&sizeMiB, "size-mib", 4096, "size of the template's root file system")
	return cmd
}

func templatePushCmd() *cobra.Command {
	var dataDir, repoURL string
	cmd := &cobra.Command{
		Use:   "push NAME",
		Short: "Store a template in the repository; nodes sharing it run the template without downloading it first",
		Example: `  aenv template push mytools
  aenv template push mytools --repository oss://aenv/cluster?endpoint=s3:9000&region=us-east-1&credentials_file=/etc/aenv/s3`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if repoURL == "" {
				repoURL = filepath.Join(dataDir, "repository")
			}
			cfg, err := repository.ParseURL(repoURL)
			if err != nil {
				return err
			}
			repo, err := repository.Open(cfg)
			if err != nil {
				return err
			}
			ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
			defer stop()
			cat, closeCat, err := templates.OpenReadOnly(dataDir)
			if err != nil {
				return err
			}
			defer closeCat()
			start := time.Now()
			if err := templates.Push(ctx, cat, repo, args[0]); err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "template %s stored in %s in %s\n", args[0], repoURL, time.Since(start).Round(time.Millisecond))
			return nil
		},
	}
	dataDirFlag(cmd, &dataDir)
	cmd.Flags().StringVar(&repoURL, "repository", "", "repository: /path, posix_fs:///path or oss://bucket/prefix?endpoint=…&region=… (default: <data-dir>/repository)")
	return cmd
}

func templateExportCmd() *cobra.Command {
	var dataDir string
	cmd := &cobra.Command{
		Use:   "export NAME DIR",
		Short: "Write a template as a directory (template.json + rootfs.qcow2) another data dir adopts at start",
		Long: `Writes template NAME of the data dir as DIR/template.json and DIR/rootfs.qcow2 (a hard link to its root
layer, a copy across file systems; the layers below it are referred to where they are). A server whose
<data-dir>/templates/NAME is such a directory, or a link to one, adopts it into its layer store when it
starts. It only reads the data dir, so it works beside a running server.`,
		Example: `  aenv template export base /srv/shared/templates/base
  ln -s /srv/shared/templates/base /var/lib/aenv-2/templates/base   # adopted when that node starts`,
		Args: cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			cat, closeCat, err := templates.OpenReadOnly(dataDir)
			if err != nil {
				return err
			}
			defer closeCat()
			if err := cat.Export(cmd.Context(), args[0], args[1]); err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "template %s written to %s\n", args[0], args[1])
			return nil
		},
	}
	dataDirFlag(cmd, &dataDir)
	return cmd
}
