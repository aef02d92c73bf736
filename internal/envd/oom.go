package envd

import (
	"os"
	"os/exec"
	"strconv"
	"sync"
)

// The guest's OOM killer must never pick envd: a guest whose envd is gone
// answers nothing until PID 1 has started it again, and the processes it
// ran lose their output streams. So envd runs with oom_score_adj -1000
// (Config.ProtectFromOOM). A child inherits its parent's oom_score_adj at
// fork, and the processes envd starts for users must stay the OOM killer's
// candidates as any other process is: envd drops its own protection for
// the instant of each fork (to 0, the guest's default), one start at a
// time, and takes it back once the child runs.

const (
	oomScoreProtected = -1000
	oomScoreDefault   = 0
)

// oomGuard starts processes so that they do not inherit envd's protection.
type oomGuard struct {
	// mu makes the starts that drop the protection one at a time; nil:
	// envd is not protected (nothing to drop).
	mu *sync.Mutex
}

// protectFromOOM gives this process oom_score_adj -1000; the guard it
// returns starts children at the default.
func protectFromOOM() (oomGuard, error) {
	if err := setOOMScoreAdj(oomScoreProtected); err != nil {
		return oomGuard{}, err
	}
	return oomGuard{mu: &sync.Mutex{}}, nil
}

// start starts cmd, which runs with oom_score_adj 0 whatever envd's.
func (g oomGuard) start(cmd *exec.Cmd) error {
	if g.mu == nil {
		return cmd.Start()
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if err := setOOMScoreAdj(oomScoreDefault); err != nil {
		return err
	}
	err := cmd.Start()
	// The child has its copy (Start returns once it has exec'd); a
	// failure to take the protection back leaves envd as killable as
	// any process, which the next start retries.
	_ = setOOMScoreAdj(oomScoreProtected)
	return err
}

func setOOMScoreAdj(v int) error {
	return os.WriteFile("/proc/self/oom_score_adj", []byte(strconv.Itoa(v)), 0)
}
