package diskspace

import (
	"errors"
	"strings"
	"testing"

	"github.com/agentenv/agentenv/internal/errkind"
)

func TestFloor(t *testing.T) {
	dir := t.TempDir()
	free, err := Free(dir)
	if err != nil || free <= 0 {
		t.Fatalf("free %d, %v", free, err)
	}
	for _, c := range []struct {
		name    string
		minFree int64
		refused bool
	}{
		{"no floor", 0, false},
		{"negative: no floor", -1, false},
		{"floor below the free space", 1 << 20, false},
		{"floor above the free space", free + 1<<40, true},
	} {
		err := NewFloor(dir, c.minFree).Check("a create")
		var short *Shortage
		switch {
		case !c.refused && err != nil:
			t.Errorf("%s: %v", c.name, err)
		case c.refused && (!errors.As(err, &short) || !errors.Is(err, errkind.ErrNoSpace)):
			t.Errorf("%s: %v", c.name, err)
		case c.refused && (!strings.Contains(err.Error(), "a create needs") || strings.Contains(err.Error(), dir)):
			t.Errorf("%s: message %q", c.name, err)
		}
	}
}
