//go:build linux

package cli

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/spf13/cobra"

	"github.com/agentenv/agentenv/internal/api"
	"github.com/agentenv/agentenv/internal/storage"
)

const apiKeyFile = "api-key"

// loadAPIKey returns the node's API key: AENV_API_KEY when set, else the key
// stored in the data dir, generated there on first use when create is true.
func loadAPIKey(dataDir string, create bool) (string, error) {
	if k := os.Getenv("AENV_API_KEY"); k != "" {
		if !api.APIKeyPattern.MatchString(k) {
			return "", errors.New("AENV_API_KEY must look like e2b_<hex> (the E2B SDKs reject other forms)")
		}
		return k, nil
	}
	path := filepath.Join(dataDir, apiKeyFile)
	b, err := os.ReadFile(path)
	if err == nil {
		k := strings.TrimSpace(string(b))
		if !api.APIKeyPattern.MatchString(k) {
			return "", fmt.Errorf("%s does not hold a valid e2b_<hex> key; delete it to generate a new one", path)
		}
		return k, nil
	}
	if !errors.Is(err, os.ErrNotExist) || !create {
		return "", fmt.Errorf("read API key: %w (start `aenv server` once to generate it, or set AENV_API_KEY)", err)
	}
	raw := make([]byte, 20)
	if _, err := rand.Read(raw); err != nil {
		return "", err
	}
	k := "e2b_" + hex.EncodeToString(raw)
	if err := os.MkdirAll(dataDir, 0o700); err != nil {
		return "", err
	}
	if err := storage.WriteFileAtomic(path, []byte(k+"\n"), 0o600); err != nil {
		return "", err
	}
	return k, nil
}

func keyCmd() *cobra.Command {
	var dataDir string
	cmd := &cobra.Command{
		Use:   "key",
		Short: "Print the node's API key",
		Example: `  export E2B_API_KEY=$(aenv key)
  aenv key --data-dir /srv/aenv`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			k, err := loadAPIKey(dataDir, true)
			if err != nil {
				return err
			}
			fmt.Fprintln(cmd.OutOrStdout(), k)
			return nil
		},
	}
	dataDirFlag(cmd, &dataDir)
	return cmd
}
