// Command aenv is AgentENV's single binary: the node server, setup, and the
// client CLI.
package main

import (
	"os"

	"github.com/agentenv/agentenv/internal/cli"
)

func main() { os.Exit(cli.Execute()) }
