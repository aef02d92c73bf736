//go:build linux

package cli

import (
	"crypto/rand"
	"crypto/sha256"
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

// The node keeps only its API key's SHA-256 (api-key.sha256, hex, 0600):
// the key itself is shown once, when `aenv key --rotate` makes it. A node
// that still has a plaintext api-key file (older versions) gets it replaced
// by its hash on the next start.
const (
	apiKeyHashFile   = "api-key.sha256"
	legacyAPIKeyFile = "api-key"
)

// loadAPIKeyHash returns the SHA-256 of the node's API key: of AENV_API_KEY
// when set, else the stored one.
func loadAPIKeyHash(dataDir string) ([32]byte, error) {
	var sum [32]byte
	if k := os.Getenv("AENV_API_KEY"); k != "" {
		if !api.APIKeyPattern.MatchString(k) {
			return sum, errors.New("AENV_API_KEY must look like e2b_<hex> (the E2B SDKs reject other forms)")
		}
		return sha256.Sum256([]byte(k)), nil
	}
	path := filepath.Join(dataDir, apiKeyHashFile)
	b, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		if err := migrateLegacyKey(dataDir); err != nil {
			return sum, err
		}
		b, err = os.ReadFile(path)
	}
	if errors.Is(err, os.ErrNotExist) {
		return sum, fmt.Errorf("no API key yet: run `aenv key --rotate --data-dir %s` (it prints a new key and stores its hash), or set AENV_API_KEY", dataDir)
	}
	if err != nil {
		return sum, err
	}
	raw, err := hex.DecodeString(strings.TrimSpace(string(b)))
	if err != nil || len(raw) != 32 {
		return sum, fmt.Errorf("%s is not a SHA-256 in hex; make a new key with `aenv key --rotate`", path)
	}
	copy(sum[:], raw)
	return sum, nil
}

// migrateLegacyKey replaces a plaintext key file by its hash.
func migrateLegacyKey(dataDir string) error {
	legacy := filepath.Join(dataDir, legacyAPIKeyFile)
	b, err := os.ReadFile(legacy)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	k := strings.TrimSpace(string(b))
	if !api.APIKeyPattern.MatchString(k) {
		return fmt.Errorf("%s does not hold a valid e2b_<hex> key; delete it and run `aenv key --rotate`", legacy)
	}
	if err := storeKeyHash(dataDir, k); err != nil {
		return err
	}
	return os.Remove(legacy)
}

func storeKeyHash(dataDir, key string) error {
	sum := sha256.Sum256([]byte(key))
	if err := os.MkdirAll(dataDir, 0o700); err != nil {
		return err
	}
	return storage.WriteFileAtomic(filepath.Join(dataDir, apiKeyHashFile), []byte(hex.EncodeToString(sum[:])+"\n"), 0o600)
}

// newAPIKey makes a key of the form the E2B SDKs accept.
func newAPIKey() (string, error) {
	raw := make([]byte, 20)
	if _, err := rand.Read(raw); err != nil {
		return "", err
	}
	return "e2b_" + hex.EncodeToString(raw), nil
}

func keyCmd() *cobra.Command {
	var (
		dataDir        string
		rotate, exists bool
	)
	cmd := &cobra.Command{
		Use:   "key",
		Short: "Make the node's API key (--rotate), or check that it has one",
		Long: `The node stores only the SHA-256 of its API key. ` + "`aenv key --rotate`" + ` makes a new key, stores
its hash and prints the key: the only time it is shown. A running server keeps the key it started with
until it is restarted.`,
		Example: `  export E2B_API_KEY=$(aenv key --rotate)   # then restart the server
  aenv key --exists && echo "this node has a key"`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			switch {
			case rotate:
				k, err := newAPIKey()
				if err != nil {
					return err
				}
				if err := storeKeyHash(dataDir, k); err != nil {
					return err
				}
				os.Remove(filepath.Join(dataDir, legacyAPIKeyFile))
				fmt.Fprintln(cmd.OutOrStdout(), k)
				return nil
			case exists:
				if _, err := loadAPIKeyHash(dataDir); err != nil {
					return silent{err}
				}
				return nil
			}
			if _, err := loadAPIKeyHash(dataDir); err != nil {
				return err
			}
			return errors.New("the node stores only its key's hash, so the key cannot be shown again: `aenv key --rotate` makes a new one (restart the server after)")
		},
	}
	dataDirFlag(cmd, &dataDir)
	cmd.Flags().BoolVar(&rotate, "rotate", false, "make a new key, store its hash, print it")
	cmd.Flags().BoolVar(&exists, "exists", false, "exit 0 when the node has a key, 1 when not")
	return cmd
}
