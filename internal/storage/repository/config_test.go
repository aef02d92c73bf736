package repository

import (
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

func TestParseURL(t *testing.T) {
	for _, c := range []struct {
		in   string
		want Config
		err  string
	}{
		{in: "/var/lib/aenv/repo", want: Config{Backend: BackendPosixFS, Root: "/var/lib/aenv/repo"}},
		{in: "posix_fs:///var/lib/aenv/repo", want: Config{Backend: BackendPosixFS, Root: "/var/lib/aenv/repo"}},
		{in: "oss://bkt/a/b?endpoint=127.0.0.1:9000&region=us-east-1&insecure=1", want: Config{Backend: BackendOSS,
			OSS: OSSConfig{Bucket: "bkt", Prefix: "a/b", Endpoint: "127.0.0.1:9000", Region: "us-east-1", Insecure: true}}},
		{in: "oss://bkt?endpoint=s3.example.com&region=eu-1&credentials_file=/etc/aenv/creds&profile=p", want: Config{Backend: BackendOSS,
			OSS: OSSConfig{Bucket: "bkt", Endpoint: "s3.example.com", Region: "eu-1", CredentialsFile: "/etc/aenv/creds", Profile: "p"}}},
		{in: "oss:///prefix?region=x", err: "missing bucket"},
		{in: "oss://b?regoin=x", err: "unknown parameter"},
		{in: "posix_fs://host/path", err: "posix_fs:///absolute/path"},
		{in: "ftp://x", err: "unknown scheme"},
		{in: "relative/path", err: "unknown scheme"},
	} {
		got, err := ParseURL(c.in)
		if c.err != "" {
			if err == nil || !strings.Contains(err.Error(), c.err) {
				t.Errorf("ParseURL(%q): %v, want error containing %q", c.in, err, c.err)
			}
			continue
		}
		if err != nil || !reflect.DeepEqual(got, c.want) {
			t.Errorf("ParseURL(%q) = %+v, %v; want %+v", c.in, got, err, c.want)
		}
	}
}

func TestOpenErrors(t *testing.T) {
	credFile := filepath.Join(t.TempDir(), "credentials")
	os.WriteFile(credFile, []byte("[default]\naws_access_key_id = AK\naws_secret_access_key = SK\n[other]\naws_access_key_id = AK2\naws_secret_access_key = SK2\n"), 0o600)
	good := OSSConfig{Endpoint: "127.0.0.1:9000", Bucket: "b", Region: "us-east-1", AccessKey: "a", SecretKey: "s", Insecure: true}
	for _, c := range []struct {
		name string
		cfg  Config
		err  string
	}{
		{"posix without root", Config{}, "root directory not set"},
		{"unknown backend", Config{Backend: "nfs"}, "unknown backend"},
		{"missing region", Config{Backend: BackendOSS, OSS: func() OSSConfig { c := good; c.Region = ""; return c }()}, "region is required"},
		{"missing bucket", Config{Backend: BackendOSS, OSS: func() OSSConfig { c := good; c.Bucket = ""; return c }()}, "bucket is required"},
		{"missing endpoint", Config{Backend: BackendOSS, OSS: func() OSSConfig { c := good; c.Endpoint = ""; return c }()}, "endpoint is required"},
		{"no credentials", Config{Backend: BackendOSS, OSS: func() OSSConfig { c := good; c.AccessKey, c.SecretKey = "", ""; return c }()}, "no credentials"},
		{"missing credentials file", Config{Backend: BackendOSS, OSS: func() OSSConfig {
			c := good
			c.AccessKey, c.SecretKey, c.CredentialsFile = "", "", "/nonexistent/creds"
			return c
		}()}, "credentials file"},
		{"bad prefix", Config{Backend: BackendOSS, OSS: func() OSSConfig { c := good; c.Prefix = "a/../b"; return c }()}, "prefix segment"},
		{"small part size", Config{Backend: BackendOSS, OSS: func() OSSConfig { c := good; c.PartSize = 1 << 20; return c }()}, "part size"},
		{"ok static", Config{Backend: BackendOSS, OSS: good}, ""},
		{"ok credentials file", Config{Backend: BackendOSS, OSS: func() OSSConfig {
			c := good
			c.AccessKey, c.SecretKey, c.CredentialsFile, c.Profile = "", "", credFile, "other"
			return c
		}()}, ""},
	} {
		_, err := Open(c.cfg)
		if c.err == "" {
			if err != nil {
				t.Errorf("%s: %v", c.name, err)
			}
			continue
		}
		if err == nil || !strings.Contains(err.Error(), c.err) {
			t.Errorf("%s: %v, want error containing %q", c.name, err, c.err)
		}
	}
}
