package pid1

import (
	"fmt"
	"os"
	"strings"
	"sync"

	"golang.org/x/sys/unix"
)

var (
	console   *os.File
	consoleMu sync.Mutex
)

// openConsole switches logging to /dev/console (or /dev/kmsg) once /dev is
// mounted.
func openConsole() {
	for _, p := range []string{"/dev/console", "/dev/kmsg"} {
		if f, err := os.OpenFile(p, os.O_WRONLY|unix.O_NOCTTY, 0); err == nil {
			consoleMu.Lock()
			console = f
			consoleMu.Unlock()
			return
		}
	}
}

// logf writes one line to the console, prefixed with the time since boot
// and "aenv-init:".
func logf(format string, args ...any) {
	var ts unix.Timespec
	_ = unix.ClockGettime(unix.CLOCK_BOOTTIME, &ts)
	msg := strings.TrimRight(fmt.Sprintf(format, args...), "\n")
	line := fmt.Sprintf("[%5d.%06d] aenv-init: %s\n", ts.Sec, ts.Nsec/1000, msg)
	consoleMu.Lock()
	defer consoleMu.Unlock()
	if console != nil {
		_, _ = console.WriteString(line)
	}
}
