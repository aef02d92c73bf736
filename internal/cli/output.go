package cli

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"text/tabwriter"
	"time"

	"golang.org/x/term"
)

// isTerminal reports whether f is a terminal (progress and colour only
// then; plain lines when piped).
func isTerminal(f *os.File) bool { return term.IsTerminal(int(f.Fd())) }

// stdoutIsTerminal reports whether w is a terminal.
func stdoutIsTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	return ok && isTerminal(f)
}

func httpClient(timeout time.Duration) *http.Client { return &http.Client{Timeout: timeout} }

// exitCode ends a command with a given exit code and no message.
type exitCode int

func (e exitCode) Error() string { return fmt.Sprintf("exit code %d", int(e)) }

// outputFormat is the -o flag of listing commands.
type outputFormat string

func (o *outputFormat) String() string { return string(*o) }
func (o *outputFormat) Type() string   { return "table|json" }
func (o *outputFormat) Set(v string) error {
	if v != "table" && v != "json" {
		return fmt.Errorf("want table or json")
	}
	*o = outputFormat(v)
	return nil
}

func printJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

// table writes rows under a header, columns aligned.
func table(w io.Writer, header []string, rows [][]string) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	line := func(cells []string) {
		for i, c := range cells {
			if i > 0 {
				fmt.Fprint(tw, "\t")
			}
			fmt.Fprint(tw, c)
		}
		fmt.Fprintln(tw)
	}
	line(header)
	for _, r := range rows {
		line(r)
	}
	return tw.Flush()
}

// ago renders a time relative to now (in the past or the future).
func ago(t time.Time) string {
	if t.IsZero() {
		return "-"
	}
	d := time.Until(t)
	suffix := ""
	if d < 0 {
		d, suffix = -d, " ago"
	} else {
		suffix = " from now"
	}
	switch {
	case d < time.Minute:
		return fmt.Sprintf("%ds%s", int(d.Seconds()), suffix)
	case d < time.Hour:
		return fmt.Sprintf("%dm%s", int(d.Minutes()), suffix)
	case d < 48*time.Hour:
		return fmt.Sprintf("%dh%s", int(d.Hours()), suffix)
	}
	return t.Local().Format("2006-01-02 15:04")
}
