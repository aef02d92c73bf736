package cli

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"strings"
)

// dockerfile is the subset of a Dockerfile `aenv template build` takes:
// FROM (a template name, or an image reference), RUN, ENV, WORKDIR, USER,
// COPY, as E2B build steps.
type dockerfile struct {
	From  string
	Steps []dockerStep
}

type dockerStep struct {
	Type string
	Args []string
	// COPY: sources relative to the build context, and --chown.
	Line int
}

// parseDockerfile reads the subset; anything else is an error naming the
// line.
func parseDockerfile(r io.Reader) (*dockerfile, error) {
	var df dockerfile
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	lineNo, start := 0, 0
	var cur strings.Builder
	flush := func() error {
		text := strings.TrimSpace(cur.String())
		cur.Reset()
		if text == "" {
			return nil
		}
		kw, rest, _ := strings.Cut(text, " ")
		rest = strings.TrimSpace(rest)
		if err := df.add(strings.ToUpper(kw), rest, start); err != nil {
			return fmt.Errorf("line %d: %w", start, err)
		}
		return nil
	}
	for sc.Scan() {
		lineNo++
		line := sc.Text()
		trimmed := strings.TrimSpace(line)
		if cur.Len() == 0 {
			if trimmed == "" || strings.HasPrefix(trimmed, "#") {
				continue
			}
			start = lineNo
		}
		if strings.HasSuffix(trimmed, "\\") {
			cur.WriteString(strings.TrimSuffix(trimmed, "\\") + " ")
			continue
		}
		cur.WriteString(trimmed)
		if err := flush(); err != nil {
			return nil, err
		}
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	if err := flush(); err != nil {
		return nil, err
	}
	if df.From == "" {
		return nil, fmt.Errorf("no FROM line")
	}
	return &df, nil
}

func (df *dockerfile) add(kw, rest string, line int) error {
	if kw != "FROM" && df.From == "" {
		return fmt.Errorf("%s before FROM", kw)
	}
	if rest == "" {
		return fmt.Errorf("%s needs arguments", kw)
	}
	switch kw {
	case "FROM":
		if df.From != "" {
			return fmt.Errorf("only one FROM is supported")
		}
		df.From = strings.Fields(rest)[0]
	case "RUN":
		cmd := rest
		if strings.HasPrefix(rest, "[") {
			var argv []string
			if err := json.Unmarshal([]byte(rest), &argv); err != nil {
				return fmt.Errorf("RUN: exec form: %v", err)
			}
			quoted := make([]string, len(argv))
			for i, a := range argv {
				quoted[i] = shellQuote(a)
			}
			cmd = strings.Join(quoted, " ")
		}
		df.Steps = append(df.Steps, dockerStep{Type: "RUN", Args: []string{cmd}, Line: line})
	case "ENV":
		kv, err := parseEnv(rest)
		if err != nil {
			return err
		}
		df.Steps = append(df.Steps, dockerStep{Type: "ENV", Args: kv, Line: line})
	case "WORKDIR", "USER":
		df.Steps = append(df.Steps, dockerStep{Type: kw, Args: []string{unquote(rest)}, Line: line})
	case "COPY":
		words, err := shellWords(rest)
		if err != nil {
			return err
		}
		owner := ""
		for len(words) > 0 && strings.HasPrefix(words[0], "--") {
			if v, ok := strings.CutPrefix(words[0], "--chown="); ok {
				owner = v
			} else {
				return fmt.Errorf("COPY option %s is not supported", words[0])
			}
			words = words[1:]
		}
		if len(words) < 2 {
			return fmt.Errorf("COPY needs a source and a destination")
		}
		dest := words[len(words)-1]
		srcs := words[:len(words)-1]
		if len(srcs) > 1 && !strings.HasSuffix(dest, "/") {
			dest += "/"
		}
		for _, src := range srcs {
			df.Steps = append(df.Steps, dockerStep{Type: "COPY", Args: []string{src, dest, owner, ""}, Line: line})
		}
	default:
		return fmt.Errorf("%s is not supported (FROM, RUN, ENV, WORKDIR, USER and COPY are)", kw)
	}
	return nil
}

// parseEnv reads `ENV k=v k2="v 2"` or `ENV k v`.
func parseEnv(rest string) ([]string, error) {
	words, err := shellWords(rest)
	if err != nil {
		return nil, err
	}
	if len(words) > 0 && !strings.Contains(words[0], "=") {
		k, v, _ := strings.Cut(rest, " ")
		return []string{k, unquote(strings.TrimSpace(v))}, nil
	}
	var kv []string
	for _, w := range words {
		k, v, ok := strings.Cut(w, "=")
		if !ok || k == "" {
			return nil, fmt.Errorf("ENV: %q is not KEY=VALUE", w)
		}
		kv = append(kv, k, v)
	}
	return kv, nil
}

// shellWords splits on blanks, honouring single and double quotes and
// backslash escapes.
func shellWords(s string) ([]string, error) {
	var words []string
	var cur strings.Builder
	in, quote, esc := false, rune(0), false
	for _, r := range s {
		switch {
		case esc:
			cur.WriteRune(r)
			esc, in = false, true
		case r == '\\' && quote != '\'':
			esc = true
		case quote != 0:
			if r == quote {
				quote = 0
			} else {
				cur.WriteRune(r)
			}
		case r == '\'' || r == '"':
			quote, in = r, true
		case r == ' ' || r == '\t':
			if in {
				words = append(words, cur.String())
				cur.Reset()
				in = false
			}
		default:
			cur.WriteRune(r)
			in = true
		}
	}
	if quote != 0 {
		return nil, fmt.Errorf("unterminated quote in %q", s)
	}
	if in {
		words = append(words, cur.String())
	}
	return words, nil
}

func unquote(s string) string {
	if w, err := shellWords(s); err == nil && len(w) == 1 {
		return w[0]
	}
	return s
}

func shellQuote(s string) string { return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'" }
