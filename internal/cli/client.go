package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/spf13/cobra"
)

// The client commands talk to a server's (or gateway's) REST API. Where
// they find it, first to last: --url/--api-key, AENV_URL/AENV_API_KEY,
// E2B_API_URL/E2B_API_KEY, then the credentials `aenv auth login` saved.

// apiClient talks to a server's REST API.
type apiClient struct {
	base, key string
	http      *http.Client
}

// apiError is a non-2xx answer: {code, message}.
type apiError struct {
	Method, Path string
	Status       int
	Message      string
}

func (e *apiError) Error() string {
	if e.Message != "" {
		return fmt.Sprintf("%s %s: %d: %s", e.Method, e.Path, e.Status, e.Message)
	}
	return fmt.Sprintf("%s %s: %d %s", e.Method, e.Path, e.Status, http.StatusText(e.Status))
}

func (c *apiClient) do(ctx context.Context, method, p string, in, out any) error {
	resp, err := c.send(ctx, method, p, in)
	if err != nil {
		return err
	}
	return decodeResponse(resp, method, p, out)
}

// decodeResponse reads an answer into out (JSON), or its {code, message}
// into an *apiError; it closes the body.
func decodeResponse(resp *http.Response, method, p string, out any) error {
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<20))
	if resp.StatusCode/100 != 2 {
		e := &apiError{Method: method, Path: p, Status: resp.StatusCode}
		var body struct {
			Message string `json:"message"`
		}
		if json.Unmarshal(b, &body) == nil {
			e.Message = body.Message
		}
		return e
	}
	if out != nil && len(b) > 0 {
		return json.Unmarshal(b, out)
	}
	return nil
}

// send makes a request and returns the raw answer (the caller closes it).
func (c *apiClient) send(ctx context.Context, method, p string, in any) (*http.Response, error) {
	var body io.Reader
	if in != nil {
		b, err := json.Marshal(in)
		if err != nil {
			return nil, err
		}
		body = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, c.base+p, body)
	if err != nil {
		return nil, err
	}
	req.Header.Set("X-API-Key", c.key)
	if in != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := c.http.Do(req)
	if err != nil {
		return nil, fmt.Errorf("%s %s: %w", method, p, err)
	}
	return resp, nil
}

// credentials are what `aenv auth login` stores.
type credentials struct {
	URL    string `json:"url"`
	APIKey string `json:"api_key"`
}

// credentialsPath is ~/.config/aenv/credentials (XDG_CONFIG_HOME honoured).
func credentialsPath() (string, error) {
	dir, err := os.UserConfigDir()
	if err != nil {
		return "", err
	}
	return filepath.Join(dir, "aenv", "credentials"), nil
}

func loadCredentials() (*credentials, error) {
	p, err := credentialsPath()
	if err != nil {
		return nil, err
	}
	b, err := os.ReadFile(p)
	if err != nil {
		return nil, err
	}
	var c credentials
	if err := json.Unmarshal(b, &c); err != nil {
		return nil, fmt.Errorf("%s: %w (run `aenv auth login` again)", p, err)
	}
	return &c, nil
}

// connection holds the flags every client command has.
type connection struct {
	url, key string
}

func (o *connection) flags(cmd *cobra.Command) {
	cmd.PersistentFlags().StringVar(&o.url, "url", "", "server or gateway URL (env AENV_URL; default: from `aenv auth login`)")
	cmd.PersistentFlags().StringVar(&o.key, "api-key", "", "API key (env AENV_API_KEY; default: from `aenv auth login`)")
}

// where resolves the server URL and key, and says where they came from.
func (o *connection) where() (url, key, source string) {
	url, key = o.url, o.key
	source = "flags"
	fill := func(u, k, from string) {
		if url == "" && u != "" {
			url, source = u, from
		}
		if key == "" {
			key = k
		}
	}
	fill(os.Getenv("AENV_URL"), os.Getenv("AENV_API_KEY"), "AENV_URL")
	fill(os.Getenv("E2B_API_URL"), os.Getenv("E2B_API_KEY"), "E2B_API_URL")
	if c, err := loadCredentials(); err == nil {
		p, _ := credentialsPath()
		fill(c.URL, c.APIKey, p)
	}
	return strings.TrimRight(url, "/"), key, source
}

// client returns the API client, or a usage error saying how to log in.
func (o *connection) client() (*apiClient, error) {
	url, key, _ := o.where()
	if url == "" || key == "" {
		return nil, usageError{errors.New("no server: run `aenv auth login --url URL --api-key KEY`, or set AENV_URL and AENV_API_KEY")}
	}
	return &apiClient{base: url, key: key, http: &http.Client{Timeout: 10 * time.Minute}}, nil
}

// usageError marks mistakes in how a command was called (exit code 2).
type usageError struct{ error }

func (e usageError) Unwrap() error { return e.error }
