// Command standin is a tiny envd stand-in used by the guest boot tests: as
// PID 1 it runs pid1.Main; with the argument "serve" it serves GET /health
// and GET /exec?cmd=… (runs the command with /bin/sh -c and returns its
// combined output) on $AENV_ENVD_PORT.
package main

import (
	"fmt"
	"net/http"
	"os"
	"os/exec"

	"github.com/agentenv/agentenv/internal/guest/pid1"
)

func main() {
	if pid1.IsInit() {
		pid1.Main()
	}
	if len(os.Args) < 2 || os.Args[1] != "serve" {
		fmt.Fprintln(os.Stderr, "usage: standin serve")
		os.Exit(2)
	}
	port := os.Getenv("AENV_ENVD_PORT")
	if port == "" {
		port = "49983"
	}
	http.HandleFunc("/health", func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusNoContent)
	})
	http.HandleFunc("/exec", func(w http.ResponseWriter, r *http.Request) {
		out, err := exec.CommandContext(r.Context(), "/bin/sh", "-c", r.URL.Query().Get("cmd")).CombinedOutput()
		if err != nil {
			w.Header().Set("X-Exit-Error", err.Error())
		}
		_, _ = w.Write(out)
	})
	fmt.Fprintf(os.Stderr, "standin envd listening on :%s\n", port)
	if err := http.ListenAndServe(":"+port, nil); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}
