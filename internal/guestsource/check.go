package guestsource

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"
)

// CheckTimeout bounds Check's requests in production (the http.Client's
// Timeout).
const CheckTimeout = 15 * time.Second

// Getter sends Check's requests; *http.Client is one.
type Getter interface {
	Do(req *http.Request) (*http.Response, error)
}

// Check verifies that src's mirror serves src's suite: it fetches
// <mirror>/dists/<suite>/InRelease, or Release when that is missing, and
// wants a Suite or Codename field naming the suite.
func Check(ctx context.Context, src Source, get Getter) error {
	base := strings.TrimRight(src.Mirror, "/") + "/dists/" + src.Suite + "/"
	var tried []string
	for _, name := range []string{"InRelease", "Release"} {
		u := base + name
		ok, err := checkRelease(ctx, get, u, src.Suite)
		if err != nil {
			return fmt.Errorf("guest mirror %s does not answer for suite %s: %w; check --guest-mirror and the network (HTTP_PROXY is honoured)", src.Mirror, src.Suite, err)
		}
		if ok {
			return nil
		}
		tried = append(tried, u)
	}
	return fmt.Errorf("guest mirror %s has no suite %s (no Release file at %s); pass --guest-mirror with the URL of %s",
		src.Mirror, src.Suite, strings.Join(tried, " or "), archiveKind(src.Distro))
}

// checkRelease fetches a Release file: ok when it names suite, false when
// missing, an error when the mirror does not answer or serves something
// else.
func checkRelease(ctx context.Context, get Getter, u, suite string) (bool, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return false, fmt.Errorf("GET %s: %w", u, err)
	}
	resp, err := get.Do(req)
	if err != nil {
		return false, err // names the method and URL
	}
	defer resp.Body.Close()
	switch {
	case resp.StatusCode == http.StatusNotFound:
		return false, nil
	case resp.StatusCode != http.StatusOK:
		return false, fmt.Errorf("GET %s: %s", u, resp.Status)
	}
	// The fields come first; the checksums that follow can be long.
	sc := bufio.NewScanner(io.LimitReader(resp.Body, 64<<10))
	for sc.Scan() {
		k, v, _ := strings.Cut(sc.Text(), ":")
		if (k == "Suite" || k == "Codename") && strings.TrimSpace(v) == suite {
			return true, nil
		}
	}
	return false, fmt.Errorf("GET %s: not the Release file of suite %s (no Suite or Codename %s)", u, suite, suite)
}
