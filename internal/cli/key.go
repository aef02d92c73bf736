//go:build linux

package cli

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"github.com/agentenv/agentenv/internal/apikeys"
	"github.com/agentenv/agentenv/internal/datadir"
	"github.com/agentenv/agentenv/internal/errkind"
	"github.com/agentenv/agentenv/internal/statedb"
)

// A node's client API keys are named and stored as SHA-256 in its database
// (package apikeys); a key is shown once, when it is made. Older nodes kept
// one key, as a hash (api-key.sha256) or in plaintext (api-key): it becomes
// the key named "default" on the next start.
const (
	apiKeyHashFile   = "api-key.sha256"
	legacyAPIKeyFile = "api-key"
	defaultKeyName   = "default"
)

// adoptLegacyKey moves an older node's only key into keys, as "default".
func adoptLegacyKey(ctx context.Context, keys *apikeys.Keys, dataDir string) error {
	var sum [32]byte
	hashFile, plainFile := filepath.Join(dataDir, apiKeyHashFile), filepath.Join(dataDir, legacyAPIKeyFile)
	if b, err := os.ReadFile(hashFile); err == nil {
		raw, err := hex.DecodeString(strings.TrimSpace(string(b)))
		if err != nil || len(raw) != 32 {
			return fmt.Errorf("%s is not a SHA-256 in hex; remove it and make a key with `aenv key create NAME`", hashFile)
		}
		copy(sum[:], raw)
	} else if b, err := os.ReadFile(plainFile); err == nil {
		k := strings.TrimSpace(string(b))
		if !apikeys.Pattern.MatchString(k) {
			return fmt.Errorf("%s does not hold a valid e2b_<hex> key; remove it and make a key with `aenv key create NAME`", plainFile)
		}
		sum = sha256.Sum256([]byte(k))
	} else {
		return nil
	}
	if err := keys.Add(ctx, defaultKeyName, sum); err != nil && !errors.Is(err, errkind.ErrConflict) {
		return err
	}
	os.Remove(hashFile)
	os.Remove(plainFile)
	return nil
}

// envAPIKey is the key AENV_API_KEY gives (a cluster's shared key), if any.
func envAPIKey() ([32]byte, bool, error) {
	k := os.Getenv("AENV_API_KEY")
	if k == "" {
		return [32]byte{}, false, nil
	}
	if !apikeys.Pattern.MatchString(k) {
		return [32]byte{}, false, errors.New("AENV_API_KEY must look like e2b_<hex> (the E2B SDKs reject other forms)")
	}
	return sha256.Sum256([]byte(k)), true, nil
}

// keyManager is what `aenv key` works with: the running node's admin socket,
// or the data dir itself when no node runs on it.
type keyManager interface {
	Create(ctx context.Context, name string) (string, error)
	List(ctx context.Context) ([]apikeys.Key, error)
	Revoke(ctx context.Context, name string) error
}

func openKeys(ctx context.Context, dataDir string) (keyManager, func(), error) {
	if a, ok := apikeys.DialAdmin(dataDir); ok {
		return a, func() {}, nil
	}
	lock, err := datadir.Acquire(dataDir, "aenv key")
	if err != nil {
		return nil, nil, err
	}
	db, err := statedb.Open(filepath.Join(dataDir, statedb.FileName))
	if err != nil {
		lock.Release()
		return nil, nil, err
	}
	closeAll := func() { db.Close(); lock.Release() }
	keys, err := apikeys.Open(db)
	if err == nil {
		err = adoptLegacyKey(ctx, keys, dataDir)
	}
	if err != nil {
		closeAll()
		return nil, nil, err
	}
	return keys, closeAll, nil
}

func keyCmd() *cobra.Command {
	var (
		dataDir, file  string
		rotate, exists bool
	)
	// open is the keys the command works on: a gateway's keys file
	// (--file), or the node of the data dir.
	open := func(ctx context.Context) (keyManager, func(), error) {
		if file != "" {
			return apikeys.OpenFile(file), func() {}, nil
		}
		return openKeys(ctx, dataDir)
	}
	cmd := &cobra.Command{
		Use:   "key",
		Short: "Manage the node's client API keys: create, ls, revoke",
		Long: `A node accepts the API keys made with ` + "`aenv key create NAME`" + `, each with a name. It stores only their
SHA-256: a key is printed once, when it is made. ` + "`aenv key revoke NAME`" + ` refuses the key from the next request on,
also on a running node (the commands reach it through its admin socket in the data dir, which only root can
open). ` + "`--rotate`" + ` replaces the key named "default". With ` + "`--file PATH`" + ` the commands work on a
keys file instead, the gateway's named keys (` + "`aenv gateway --keys-file PATH`" + `).`,
		Example: `  export E2B_API_KEY=$(aenv key create trainer-1)
  aenv key ls
  aenv key revoke trainer-1
  aenv key create trainer-2 --file /etc/aenv/gateway-keys   # a key the cluster's gateway accepts
  aenv key --exists && echo "this node has a key"`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx := cmd.Context()
			if ctx == nil {
				ctx = context.Background()
			}
			if !rotate && !exists {
				return cmd.Help()
			}
			m, done, err := open(ctx)
			if err != nil {
				return err
			}
			defer done()
			if exists {
				l, err := m.List(ctx)
				if err != nil {
					return err
				}
				if _, env, _ := envAPIKey(); len(l) == 0 && !env {
					return silent{apikeys.ErrNoKeys}
				}
				return nil
			}
			if err := m.Revoke(ctx, defaultKeyName); err != nil && !errors.Is(err, errkind.ErrNotFound) {
				return err
			}
			k, err := m.Create(ctx, defaultKeyName)
			if err != nil {
				return err
			}
			fmt.Fprintln(cmd.OutOrStdout(), k)
			return nil
		},
	}
	def := os.Getenv("AENV_DATA_DIR")
	if def == "" {
		def = DefaultDataDir
	}
	cmd.PersistentFlags().StringVar(&dataDir, "data-dir", def, "node data directory (env AENV_DATA_DIR)")
	cmd.PersistentFlags().StringVar(&file, "file", "", "work on this keys file (a gateway's --keys-file) instead of a node's keys")
	cmd.Flags().BoolVar(&rotate, "rotate", false, `replace the key named "default" and print the new one`)
	cmd.Flags().BoolVar(&exists, "exists", false, "exit 0 when the node has a key, 1 when not")
	withKeys := func(run func(ctx context.Context, m keyManager, args []string) error) func(*cobra.Command, []string) error {
		return func(c *cobra.Command, args []string) error {
			ctx := c.Context()
			if ctx == nil {
				ctx = context.Background()
			}
			m, done, err := open(ctx)
			if err != nil {
				return err
			}
			defer done()
			return run(ctx, m, args)
		}
	}
	cmd.AddCommand(&cobra.Command{
		Use:     "create NAME",
		Short:   "Make a key named NAME and print it (the only time it is shown)",
		Example: "  export E2B_API_KEY=$(aenv key create trainer-1)",
		Args:    cobra.ExactArgs(1),
		RunE: withKeys(func(ctx context.Context, m keyManager, args []string) error {
			k, err := m.Create(ctx, args[0])
			if err != nil {
				return err
			}
			fmt.Fprintln(cmd.OutOrStdout(), k)
			return nil
		}),
	}, &cobra.Command{
		Use:     "ls",
		Short:   "List the node's keys (names, when made, the start of each key's hash)",
		Example: "  aenv key ls --data-dir /var/lib/aenv",
		Args:    cobra.NoArgs,
		RunE: withKeys(func(ctx context.Context, m keyManager, _ []string) error {
			l, err := m.List(ctx)
			if err != nil {
				return err
			}
			tw := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "NAME\tCREATED\tHASH")
			for _, k := range l {
				fmt.Fprintf(tw, "%s\t%s\t%s…\n", k.Name, k.Created.Format("2006-01-02 15:04:05"), k.Hint)
			}
			return tw.Flush()
		}),
	}, &cobra.Command{
		Use:     "revoke NAME",
		Short:   "Revoke the key named NAME: refused from the next request on",
		Example: "  aenv key revoke trainer-1",
		Args:    cobra.ExactArgs(1),
		RunE: withKeys(func(ctx context.Context, m keyManager, args []string) error {
			return m.Revoke(ctx, args[0])
		}),
	})
	return cmd
}
