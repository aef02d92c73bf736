package repository

import (
	"fmt"
	"net/url"
	"strconv"
	"strings"
)

// Backend names.
const (
	BackendPosixFS = "posix_fs"
	BackendOSS     = "oss"
)

// Config selects and configures a repository backend.
type Config struct {
	// Backend is "posix_fs" (the default when empty) or "oss".
	Backend string `json:"backend,omitempty"`
	// Root is the posix_fs directory (created if missing).
	Root string `json:"root,omitempty"`
	// OSS configures the oss backend.
	OSS OSSConfig `json:"oss,omitempty"`
}

// OSSConfig configures the S3-compatible backend.
type OSSConfig struct {
	// Endpoint is host[:port] of the S3 API, without scheme.
	Endpoint string `json:"endpoint"`
	Bucket   string `json:"bucket"`
	// Prefix is prepended to every object name ("" or e.g. "aenv/prod").
	Prefix string `json:"prefix,omitempty"`
	// Region is required: S3 request signatures include it, and guessing it
	// (or asking the server) fails in confusing ways on non-AWS stores.
	Region string `json:"region"`
	// Static credentials. Used when AccessKey is set.
	AccessKey    string `json:"access_key,omitempty"`
	SecretKey    string `json:"secret_key,omitempty"`
	SessionToken string `json:"session_token,omitempty"`
	// CredentialsFile is an AWS shared credentials file (INI:
	// aws_access_key_id, aws_secret_access_key, aws_session_token) read with
	// Profile (default: $AWS_PROFILE, then "default"). Used when AccessKey
	// is empty.
	CredentialsFile string `json:"credentials_file,omitempty"`
	Profile         string `json:"profile,omitempty"`
	// Insecure uses plain HTTP instead of HTTPS.
	Insecure bool `json:"insecure,omitempty"`
	// PartSize is the multipart upload part size in bytes (default 16 MiB,
	// minimum 5 MiB).
	PartSize uint64 `json:"part_size,omitempty"`
}

// Open returns the repository described by cfg. It does not contact the
// store; configuration errors (missing root, bucket, region, credentials)
// are reported here.
func Open(cfg Config) (Repository, error) {
	switch cfg.Backend {
	case "", BackendPosixFS:
		return OpenPosixFS(cfg.Root)
	case BackendOSS:
		return OpenOSS(cfg.OSS)
	default:
		return nil, fmt.Errorf("repository: unknown backend %q (want %q or %q)", cfg.Backend, BackendPosixFS, BackendOSS)
	}
}

// ParseURL parses a repository location:
//
//	/var/lib/aenv/repo                     posix_fs (a plain absolute path)
//	posix_fs:///var/lib/aenv/repo          posix_fs
//	oss://BUCKET[/PREFIX]?endpoint=HOST:PORT&region=REGION[&insecure=1]
//	    [&credentials_file=PATH][&profile=NAME]
//	    [&access_key=AK&secret_key=SK]    (static keys; avoid outside tests)
//	    [&part_size=BYTES]
//
// Unknown query parameters are errors, so typos do not pass silently.
func ParseURL(s string) (Config, error) {
	if strings.HasPrefix(s, "/") {
		return Config{Backend: BackendPosixFS, Root: s}, nil
	}
	// "posix_fs" is not a valid URL scheme (underscore), so parse it by hand.
	if rest, ok := strings.CutPrefix(s, BackendPosixFS+"://"); ok {
		if !strings.HasPrefix(rest, "/") || strings.ContainsAny(rest, "?#") {
			return Config{}, fmt.Errorf("repository URL %q: want posix_fs:///absolute/path", s)
		}
		return Config{Backend: BackendPosixFS, Root: rest}, nil
	}
	u, err := url.Parse(s)
	if err != nil {
		return Config{}, fmt.Errorf("repository URL: %w", err)
	}
	switch u.Scheme {
	case "posix-fs", "file":
		if u.Host != "" || u.Path == "" || len(u.Query()) > 0 {
			return Config{}, fmt.Errorf("repository URL %q: want posix_fs:///absolute/path", s)
		}
		return Config{Backend: BackendPosixFS, Root: u.Path}, nil
	case BackendOSS, "s3":
		c := OSSConfig{Bucket: u.Host, Prefix: strings.Trim(u.Path, "/")}
		if c.Bucket == "" {
			return Config{}, fmt.Errorf("repository URL %q: missing bucket (oss://BUCKET/PREFIX?...)", s)
		}
		for k, vs := range u.Query() {
			v := vs[len(vs)-1]
			switch k {
			case "endpoint":
				c.Endpoint = v
			case "region":
				c.Region = v
			case "insecure":
				b, err := strconv.ParseBool(v)
				if err != nil {
					return Config{}, fmt.Errorf("repository URL %q: insecure=%q: %w", s, v, err)
				}
				c.Insecure = b
			case "credentials_file":
				c.CredentialsFile = v
			case "profile":
				c.Profile = v
			case "access_key":
				c.AccessKey = v
			case "secret_key":
				c.SecretKey = v
			case "part_size":
				n, err := strconv.ParseUint(v, 10, 64)
				if err != nil {
					return Config{}, fmt.Errorf("repository URL %q: part_size=%q: %w", s, v, err)
				}
				c.PartSize = n
			default:
				return Config{}, fmt.Errorf("repository URL %q: unknown parameter %q", s, k)
			}
		}
		return Config{Backend: BackendOSS, OSS: c}, nil
	default:
		return Config{}, fmt.Errorf("repository URL %q: unknown scheme (want an absolute path, posix_fs:///path or oss://bucket/prefix?...)", s)
	}
}
