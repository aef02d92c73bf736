package cli

import (
	"reflect"
	"strings"
	"testing"
)

func TestParseDockerfile(t *testing.T) {
	for _, tc := range []struct {
		name, text string
		from       string
		steps      []dockerStep
		err        string
	}{
		{name: "all supported", text: `# tools
FROM base
ENV A=1 B="two words"
ENV C three
WORKDIR /app
USER user
RUN apt-get update && \
    echo done
RUN ["echo", "it's"]
COPY --chown=user src/ a.txt /app/
`, from: "base", steps: []dockerStep{
			{Type: "ENV", Args: []string{"A", "1", "B", "two words"}, Line: 3},
			{Type: "ENV", Args: []string{"C", "three"}, Line: 4},
			{Type: "WORKDIR", Args: []string{"/app"}, Line: 5},
			{Type: "USER", Args: []string{"user"}, Line: 6},
			{Type: "RUN", Args: []string{"apt-get update &&  echo done"}, Line: 7},
			{Type: "RUN", Args: []string{`'echo' 'it'\''s'`}, Line: 9},
			{Type: "COPY", Args: []string{"src/", "/app/", "user", ""}, Line: 10},
			{Type: "COPY", Args: []string{"a.txt", "/app/", "user", ""}, Line: 10},
		}},
		{name: "image", text: "from registry.example/library/python:3.12\nrun true\n", from: "registry.example/library/python:3.12",
			steps: []dockerStep{{Type: "RUN", Args: []string{"true"}, Line: 2}}},
		{name: "no FROM", text: "RUN true\n", err: "line 1: RUN before FROM"},
		{name: "empty", text: "# nothing\n", err: "no FROM"},
		{name: "unsupported", text: "FROM base\nCMD [\"x\"]\n", err: "line 2: CMD is not supported"},
		{name: "two FROMs", text: "FROM base\nFROM minimal\n", err: "only one FROM"},
		{name: "bad ENV", text: "FROM base\nENV =x\n", err: "not KEY=VALUE"},
		{name: "bad exec form", text: "FROM base\nRUN [\"x\"\n", err: "exec form"},
		{name: "unterminated quote", text: "FROM base\nCOPY \"a b /x\n", err: "unterminated quote"},
		{name: "COPY options", text: "FROM base\nCOPY --from=x a /b\n", err: "--from=x is not supported"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			df, err := parseDockerfile(strings.NewReader(tc.text))
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("got %v, want error with %q", err, tc.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if df.From != tc.from || !reflect.DeepEqual(df.Steps, tc.steps) {
				t.Fatalf("got %q %#v", df.From, df.Steps)
			}
		})
	}
}
