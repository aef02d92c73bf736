// Package codeinterpreter owns the code-interpreter template: the Debian
// packages it adds to the base image, the in-guest server (server.py,
// AgentENV's own) that speaks E2B's code-interpreter protocol on port
// 49999 for the official code-interpreter SDKs, and how the template
// starts that server and knows it is ready.
package codeinterpreter

import (
	_ "embed"
	"strconv"
)

// Server is the in-guest server's source (Python, standard library and
// jupyter_client only).
//
//go:embed server.py
var Server []byte

const (
	// TemplateName is the name the code-interpreter SDKs create sandboxes
	// from by default.
	TemplateName = "code-interpreter-v1"
	// Port is where the server listens in the guest (the SDKs' JUPYTER_PORT).
	Port = 49999
	// ServerPath is where the server is installed in the image.
	ServerPath = "/usr/local/lib/aenv/code_interpreter.py"
	// User and Cwd are whom the server and its kernels run as, and where.
	User = "user"
	Cwd  = "/home/user"
	// MemoryMiB and VCPUs size the template's sandboxes: an IPython kernel
	// with numpy, pandas and matplotlib loaded needs about 200 MiB.
	MemoryMiB = 1024
	VCPUs     = 2
)

// Packages are the Debian packages the template adds to the base image.
var Packages = []string{
	"python3-ipykernel", "python3-jupyter-client",
	"python3-numpy", "python3-pandas", "python3-matplotlib",
}

// StartCmd starts the server; the template is snapshotted once ReadyCmd
// exits 0, so sandboxes resume with the default Python context running and
// the libraries imported.
var (
	StartCmd = "/usr/bin/python3 " + ServerPath
	ReadyCmd = "curl -sf -o /dev/null http://127.0.0.1:" + strconv.Itoa(Port) + "/health"
)
