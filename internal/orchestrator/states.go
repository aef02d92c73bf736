package orchestrator

import (
	"context"
	"fmt"
	"strings"
	"time"
)

// The sandbox state machine: every change of a sandbox's recorded state
// goes through move, which allows exactly the transitions of this table.
// Running, paused and pooled are resting states; the others mark an
// operation in progress, and a sandbox in one of them accepts no other
// operation (ErrConflict). A sandbox leaves the machine by having its
// record deleted: a failed create (from creating), a kill (from killing),
// an unclaimed pool entry (from pooled).
var transitions = map[State][]State{
	StatePooled:       {StateCreating},                                               // a create claims it
	StateCreating:     {StateRunning},                                                // or its record goes
	StateRunning:      {StatePausing, StateSnapshotting, StateForking, StateKilling}, //
	StatePausing:      {StatePaused, StateRunning},                                   // done, or rolled back
	StatePaused:       {StateResuming, StateKilling},                                 //
	StateResuming:     {StateRunning, StatePaused},                                   // done, or rolled back
	StateSnapshotting: {StateRunning, StatePaused},                                   // the sandbox runs on, or rests paused on the snapshot
	StateForking:      {StateRunning, StatePaused},                                   // likewise
	StateKilling:      {StateRunning, StatePaused},                                   // rolled back before anything stopped; else its record goes
}

// Resting reports whether a sandbox in state s is between operations.
func (s State) Resting() bool {
	return s == StateRunning || s == StatePaused || s == StatePooled
}

// canMove reports whether the table allows from → to.
func canMove(from, to State) bool {
	for _, t := range transitions[from] {
		if t == to {
			return true
		}
	}
	return false
}

// move changes sandbox id from state from to state to, atomically with the
// extra column assignments in set (e.g. "pid = ?") and their args: it
// fails with ErrConflict when the sandbox is not in state from (another
// operation got there first), and refuses a transition the table does not
// allow.
func (n *Node) move(ctx context.Context, id string, from, to State, set string, args ...any) error {
	if !canMove(from, to) {
		return fmt.Errorf("sandbox %s: no transition from %s to %s", id, from, to)
	}
	q := `UPDATE sandboxes SET state = ?, updated_at = ?`
	if set = strings.TrimSpace(set); set != "" {
		q += ", " + set
	}
	q += ` WHERE id = ? AND state = ?`
	all := append([]any{string(to), time.Now().UnixMilli()}, args...)
	all = append(all, id, string(from))
	res, err := n.db.ExecContext(ctx, q, all...)
	if err != nil {
		return fmt.Errorf("update sandbox %s state: %w", id, err)
	}
	if c, _ := res.RowsAffected(); c == 1 {
		return nil
	}
	s, err := n.loadSandbox(ctx, id)
	if err != nil {
		return err
	}
	return fmt.Errorf("%w: sandbox %s is %s", ErrConflict, id, s.State)
}

// busy is the error for an operation asked of a sandbox in the middle of
// another.
func busy(s *Sandbox) error {
	return fmt.Errorf("%w: sandbox %s is %s; try again when that has finished", ErrConflict, s.ID, s.State)
}
