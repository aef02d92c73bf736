// Command envd is AgentENV's in-guest daemon. Run as PID 1 (it is /init in
// the initramfs) it boots the guest: loads modules, mounts the root disk,
// configures the network and then starts itself again as `envd serve`, the
// E2B-compatible envd serving process, filesystem and file APIs on port 49983.
package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"strconv"
	"syscall"

	"github.com/agentenv/agentenv/internal/envd"
	"github.com/agentenv/agentenv/internal/guest/pid1"
)

func main() {
	if os.Getpid() == 1 {
		pid1.Main() // never returns
	}
	if len(os.Args) < 2 || os.Args[1] != "serve" {
		fmt.Fprintln(os.Stderr, "usage: envd serve [--port N] [--addr HOST]")
		os.Exit(2)
	}
	fs := flag.NewFlagSet("serve", flag.ExitOnError)
	port := fs.Int("port", envInt("AENV_ENVD_PORT", 49983), "port to listen on")
	addr := fs.String("addr", "0.0.0.0", "address to listen on")
	_ = fs.Parse(os.Args[2:])

	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	srv, err := envd.NewServer(envd.Config{Port: *port, Logger: log, ProtectFromOOM: true})
	if err != nil {
		log.Error("envd", "err", err)
		os.Exit(1)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := srv.ListenAndServe(ctx, fmt.Sprintf("%s:%d", *addr, *port)); err != nil {
		log.Error("envd", "err", err)
		os.Exit(1)
	}
}

func envInt(name string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(name)); err == nil && v > 0 {
		return v
	}
	return def
}
