// Package faults holds the fault injection points of the crash tests: when
// the environment variable AENV_FAULT names a point, the process kills
// itself there with SIGKILL, exactly as `kill -9` would, so the tests can
// check what a restart recovers. Unset (always, outside those tests) a
// point costs one string comparison.
package faults

import (
	"os"
	"syscall"
)

var armed = os.Getenv("AENV_FAULT")

// Point crashes the process if AENV_FAULT names this point.
func Point(name string) {
	if armed != "" && armed == name {
		syscall.Kill(os.Getpid(), syscall.SIGKILL)
		select {} // the signal is on its way
	}
}

// Points are the names the code uses (documented for the tests).
const (
	CreateRecorded = "create-recorded" // a sandbox's record is written, nothing started
	CreateStarted  = "create-started"  // its QEMU runs, the record still says creating
	PauseSaved     = "pause-saved"     // the saved state is complete, the record says pausing
	RepoPutFile    = "repo-put-file"   // a repository upload has copied its first file
	ForkFrozen     = "fork-frozen"     // a fork's snapshot is taken, no child exists yet
)
