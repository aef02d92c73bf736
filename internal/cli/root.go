// Package cli owns the `aenv` command line: the server roles (server, setup,
// key, ...) and the client commands, built with cobra.
package cli

import (
	"fmt"
	"log/slog"
	"os"

	"github.com/spf13/cobra"
)

// DefaultDataDir is where a node keeps its state unless told otherwise.
const DefaultDataDir = "/var/lib/aenv"

// Version is set at build time with -ldflags "-X .../cli.Version=...".
var Version = "dev"

// Execute runs the command line and returns the process exit code.
func Execute() int {
	root := &cobra.Command{
		Use:           "aenv",
		Short:         "AgentENV: micro-VM sandboxes for AI agents, E2B-compatible",
		SilenceUsage:  true,
		SilenceErrors: true,
		Version:       Version,
	}
	root.AddCommand(serverCmd(), nodeCmd(), schedulerCmd(), gatewayCmd(), setupCmd(), keyCmd(), templateCmd())
	if err := root.Execute(); err != nil {
		fmt.Fprintln(os.Stderr, "aenv:", err)
		return 1
	}
	return 0
}

func dataDirFlag(cmd *cobra.Command, p *string) {
	def := os.Getenv("AENV_DATA_DIR")
	if def == "" {
		def = DefaultDataDir
	}
	cmd.Flags().StringVar(p, "data-dir", def, "node data directory (env AENV_DATA_DIR)")
}

func newLogger(level string) *slog.Logger {
	var l slog.Level
	if err := l.UnmarshalText([]byte(level)); err != nil {
		l = slog.LevelInfo
	}
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: l}))
}
