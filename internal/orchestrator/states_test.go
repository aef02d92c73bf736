package orchestrator

import "testing"

func TestTransitionTable(t *testing.T) {
	all := []State{StatePooled, StateCreating, StateRunning, StatePausing, StatePaused, StateResuming,
		StateSnapshotting, StateForking, StateKilling}
	for _, s := range all {
		if _, ok := transitions[s]; !ok {
			t.Errorf("state %s is missing from the table", s)
		}
	}
	for from, tos := range transitions {
		for _, to := range tos {
			if _, ok := transitions[to]; !ok {
				t.Errorf("%s → %s leads out of the table", from, to)
			}
		}
	}
	// Every operation in progress can fall back to a resting state, and
	// every resting state but pooled can start one.
	for _, s := range all {
		if s.Resting() || s == StateCreating || s == StateKilling {
			continue
		}
		rests := false
		for _, to := range transitions[s] {
			rests = rests || to.Resting()
		}
		if !rests {
			t.Errorf("%s has no way back to a resting state", s)
		}
	}
	for _, tc := range []struct {
		from, to State
		ok       bool
	}{
		{StateRunning, StatePausing, true},
		{StatePausing, StateRunning, true},
		{StatePaused, StateForking, false}, // fork needs a running sandbox
		{StatePaused, StatePausing, false},
		{StateForking, StatePaused, true}, // the parent rests on its snapshot
		{StateKilling, StateForking, false},
		{StateCreating, StatePaused, false},
	} {
		if got := canMove(tc.from, tc.to); got != tc.ok {
			t.Errorf("%s → %s allowed = %v, want %v", tc.from, tc.to, got, tc.ok)
		}
	}
}
