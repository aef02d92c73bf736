package cli

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/spf13/cobra"
)

func authCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "auth",
		Short: "Log in to a server or gateway (saves its URL and API key for the other commands)",
	}
	cmd.AddCommand(authLoginCmd(), authLogoutCmd(), authStatusCmd())
	return cmd
}

func authLoginCmd() *cobra.Command {
	var url, key string
	cmd := &cobra.Command{
		Use:   "login",
		Short: "Check a server's URL and API key and save them in ~/.config/aenv/credentials (mode 0600)",
		Example: `  aenv auth login --url http://127.0.0.1:8000 --api-key e2b_...
  echo e2b_... | aenv auth login --url http://gateway:8080   # the key from stdin`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if url == "" {
				return usageError{errors.New("--url is required")}
			}
			if key == "" {
				if isTerminal(os.Stdin) {
					fmt.Fprint(cmd.ErrOrStderr(), "API key: ")
				}
				line, err := bufio.NewReader(cmd.InOrStdin()).ReadString('\n')
				if err != nil && line == "" {
					return usageError{errors.New("no API key: pass --api-key or write it to stdin")}
				}
				key = strings.TrimSpace(line)
			}
			url = strings.TrimRight(url, "/")
			c := &apiClient{base: url, key: key, http: httpClient(15 * time.Second)}
			ctx, cancel := context.WithTimeout(cmd.Context(), 15*time.Second)
			defer cancel()
			if err := c.do(ctx, "GET", "/v2/sandboxes?limit=1", nil, nil); err != nil {
				return fmt.Errorf("the server refused the login: %w", err)
			}
			p, err := credentialsPath()
			if err != nil {
				return err
			}
			if err := writeCredentials(p, credentials{URL: url, APIKey: key}); err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "logged in to %s (saved in %s)\n", url, p)
			return nil
		},
	}
	cmd.Flags().StringVar(&url, "url", "", "the server's or gateway's URL, e.g. http://127.0.0.1:8000")
	cmd.Flags().StringVar(&key, "api-key", "", "the API key (e2b_...; default: read from stdin)")
	return cmd
}

// writeCredentials saves the credentials atomically, readable only by the
// user.
func writeCredentials(p string, c credentials) error {
	if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
		return err
	}
	b, _ := json.MarshalIndent(c, "", "  ")
	f, err := os.CreateTemp(filepath.Dir(p), ".credentials-")
	if err != nil {
		return err
	}
	defer os.Remove(f.Name())
	if err := f.Chmod(0o600); err != nil {
		f.Close()
		return err
	}
	if _, err := f.Write(append(b, '\n')); err != nil {
		f.Close()
		return err
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	return os.Rename(f.Name(), p)
}

func authLogoutCmd() *cobra.Command {
	return &cobra.Command{
		Use:     "logout",
		Short:   "Forget the saved URL and API key",
		Example: `  aenv auth logout`,
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			p, err := credentialsPath()
			if err != nil {
				return err
			}
			if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
				return err
			}
			fmt.Fprintln(cmd.OutOrStdout(), "logged out")
			return nil
		},
	}
}

func authStatusCmd() *cobra.Command {
	var conn connection
	cmd := &cobra.Command{
		Use:   "status",
		Short: "Show which server the commands use, where that comes from, and whether the key works",
		Example: `  aenv auth status
  AENV_URL=http://other:8000 AENV_API_KEY=e2b_... aenv auth status`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			url, key, source := conn.where()
			out := cmd.OutOrStdout()
			if url == "" || key == "" {
				fmt.Fprintln(out, "not logged in (run `aenv auth login --url URL --api-key KEY`)")
				return exitCode(1)
			}
			fmt.Fprintf(out, "server:  %s\nfrom:    %s\napi key: %s\n", url, source, maskKey(key))
			c := &apiClient{base: url, key: key, http: httpClient(15 * time.Second)}
			ctx, cancel := context.WithTimeout(cmd.Context(), 15*time.Second)
			defer cancel()
			if err := c.do(ctx, "GET", "/v2/sandboxes?limit=1", nil, nil); err != nil {
				fmt.Fprintf(out, "status:  %v\n", err)
				return exitCode(1)
			}
			fmt.Fprintln(out, "status:  ok")
			return nil
		},
	}
	conn.flags(cmd)
	return cmd
}

// maskKey shows a key's start and end only.
func maskKey(k string) string {
	if len(k) <= 10 {
		return strings.Repeat("*", len(k))
	}
	return k[:6] + strings.Repeat("*", len(k)-10) + k[len(k)-4:]
}
