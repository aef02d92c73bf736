package guestexec

import (
	"os/exec"
	"slices"
	"testing"
)

func TestQuote(t *testing.T) {
	for _, s := range []string{"", "plain", "with space", "it's", `"double" $HOME ; rm -rf / #`, "new\nline", `back\slash`} {
		out, err := exec.Command("/bin/sh", "-c", "printf %s "+Quote(s)).Output()
		if err != nil || string(out) != s {
			t.Errorf("Quote(%q) through sh: %q %v", s, out, err)
		}
	}
}

func TestLineSplitter(t *testing.T) {
	for _, tc := range []struct {
		chunks []string
		want   []string
	}{
		{[]string{"a\nb\n"}, []string{"a", "b"}},
		{[]string{"par", "tial\nrest"}, []string{"partial", "rest"}},
		{[]string{"\n\n"}, []string{"", ""}},
		{[]string{"no newline"}, []string{"no newline"}},
	} {
		var got []string
		l := lineSplitter{emit: func(s string) { got = append(got, s) }}
		for _, c := range tc.chunks {
			l.write([]byte(c))
		}
		l.flush()
		if !slices.Equal(got, tc.want) {
			t.Errorf("%q: got %q, want %q", tc.chunks, got, tc.want)
		}
	}
}
