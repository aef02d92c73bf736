package sandboxes

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/agentenv/agentenv/internal/errkind"
)

// State is a sandbox's lifecycle state.
type State string

// The lifecycle states. Running, paused and pooled are resting; the others
// mark an operation in progress, and a sandbox in one of them accepts no
// other operation.
const (
	// Pooled: pre-started by the warm pool, owned by no user yet (hidden
	// from listings).
	Pooled       State = "pooled"
	Creating     State = "creating"
	Running      State = "running"
	Pausing      State = "pausing"
	Paused       State = "paused"
	Resuming     State = "resuming"
	Snapshotting State = "snapshotting"
	Forking      State = "forking"
	Killing      State = "killing"
)

// The state machine: every change of a sandbox's recorded state goes
// through Move, which allows exactly the transitions of this table. A
// sandbox leaves the machine by having its record deleted: a failed create
// (from creating), a kill (from killing), an unclaimed pool entry (from
// pooled).
var transitions = map[State][]State{
	Pooled:       {Creating},                                // a create claims it
	Creating:     {Running},                                 // or its record goes
	Running:      {Pausing, Snapshotting, Forking, Killing}, //
	Pausing:      {Paused, Running},                         // done, or rolled back
	Paused:       {Resuming, Killing},                       //
	Resuming:     {Running, Paused},                         // done, or rolled back
	Snapshotting: {Running, Paused},                         // the sandbox runs on, or rests paused on the snapshot
	Forking:      {Running, Paused},                         // likewise
	Killing:      {Running, Paused},                         // rolled back before anything stopped; else its record goes
}

// Resting reports whether a sandbox in state s is between operations.
func (s State) Resting() bool {
	return s == Running || s == Paused || s == Pooled
}

// CanMove reports whether the table allows from → to.
func CanMove(from, to State) bool {
	for _, t := range transitions[from] {
		if t == to {
			return true
		}
	}
	return false
}

// Move changes sandbox id from state from to state to, atomically with the
// extra column assignments in set (e.g. "pid = ?") and their args: it
// fails with errkind.ErrConflict when the sandbox is not in state from
// (another operation got there first), and refuses a transition the table
// does not allow.
func (r *Records) Move(ctx context.Context, id string, from, to State, set string, args ...any) error {
	if !CanMove(from, to) {
		return fmt.Errorf("sandbox %s: no transition from %s to %s", id, from, to)
	}
	q := `UPDATE sandboxes SET state = ?, updated_at = ?`
	if set = strings.TrimSpace(set); set != "" {
		q += ", " + set
	}
	q += ` WHERE id = ? AND state = ?`
	all := append([]any{string(to), time.Now().UnixMilli()}, args...)
	all = append(all, id, string(from))
	res, err := r.db.ExecContext(ctx, q, all...)
	if err != nil {
		return fmt.Errorf("update sandbox %s state: %w", id, err)
	}
	if c, _ := res.RowsAffected(); c == 1 {
		return nil
	}
	s, err := r.Get(ctx, id)
	if err != nil {
		return err
	}
	return fmt.Errorf("%w: sandbox %s is %s", errkind.ErrConflict, id, s.State)
}

// Busy is the error for an operation asked of a sandbox in the middle of
// another.
func Busy(s *Sandbox) error {
	return fmt.Errorf("%w: sandbox %s is %s; try again when that has finished", errkind.ErrConflict, s.ID, s.State)
}
