// Package cli owns the `aenv` command line: the server roles (server, setup,
// key, ...) and the client commands, built with cobra.
package cli

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"strings"

	"github.com/spf13/cobra"

	"github.com/agentenv/agentenv/internal/errkind"
)

// DefaultDataDir is where a node keeps its state unless told otherwise.
const DefaultDataDir = "/var/lib/aenv"

// Version is set at build time with -ldflags "-X .../cli.Version=...".
var Version = "dev"

// Execute runs the command line and returns the process exit code.
func Execute() int {
	err := newRoot().Execute()
	return exitStatus(err, os.Stderr)
}

// newRoot builds the whole command tree.
func newRoot() *cobra.Command {
	root := &cobra.Command{
		Use:           "aenv",
		Short:         "AgentENV: micro-VM sandboxes for AI agents, E2B-compatible",
		SilenceUsage:  true,
		SilenceErrors: true,
		Version:       Version,
	}
	root.AddCommand(
		// Client commands (any OS).
		authCmd(), createCmd(), lsCmd(), infoCmd(), execCmd(), shellCmd(), cpCmd(), pauseCmd(), resumeCmd(),
		forkCmd(), timeoutCmd(), killCmd(), gcCmd(), leaseCmd(), logsCmd(), snapshotCmd(), templateCmd(), volumeCmd(),
		// Server roles and machine setup (Linux).
		serverCmd(), nodeCmd(), schedulerCmd(), gatewayCmd(), setupCmd(), keyCmd(), benchCmd(), doctorCmd(), qemuCmd(),
	)
	root.SetFlagErrorFunc(func(_ *cobra.Command, err error) error { return usageError{err} })
	wrapArgs(root)
	return root
}

// Exit codes, the same for every command.
const (
	ExitOK       = 0
	ExitFailure  = 1 // the operation failed (the server refused, the network, ...)
	ExitUsage    = 2 // the command line is wrong
	ExitNotFound = 3 // the sandbox, template or snapshot does not exist
)

// exitStatus reports err and maps it to an exit code (`aenv exec` exits
// with its command's code).
func exitStatus(err error, stderr io.Writer) int {
	if err == nil {
		return ExitOK
	}
	var code exitCode
	if errors.As(err, &code) {
		return int(code)
	}
	var s silent
	if !errors.As(err, &s) {
		fmt.Fprintln(stderr, "aenv:", err)
	}
	var ue usageError
	var ae *apiError
	switch {
	case errors.As(err, &ue) || strings.HasPrefix(err.Error(), "unknown command") || strings.HasPrefix(err.Error(), "unknown shorthand flag"):
		return ExitUsage
	case errors.As(err, &ae) && ae.Status == http.StatusNotFound, errors.Is(err, errkind.ErrNotFound):
		return ExitNotFound
	}
	return ExitFailure
}

// wrapArgs makes argument-count errors usage errors in every command.
func wrapArgs(cmd *cobra.Command) {
	if check := cmd.Args; check != nil {
		cmd.Args = func(c *cobra.Command, args []string) error {
			if err := check(c, args); err != nil {
				return usageError{fmt.Errorf("%w (see `%s --help`)", err, c.CommandPath())}
			}
			return nil
		}
	}
	for _, sub := range cmd.Commands() {
		wrapArgs(sub)
	}
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
