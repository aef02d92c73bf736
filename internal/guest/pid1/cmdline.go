package pid1

import (
	"errors"
	"fmt"
	"net/netip"
	"strconv"
	"strings"
)

// DefaultEnvdPort is the port envd listens on unless aenv.envd_port= says otherwise.
const DefaultEnvdPort = 49983

// Config is what init takes from the kernel command line (aenv.* parameters).
type Config struct {
	Root       string            // aenv.root=, default /dev/vda
	RootFSType string            // aenv.rootfstype=, default ext4
	RootFlags  string            // aenv.rootflags=, extra mount data
	Hostname   string            // aenv.hostname=
	IP         netip.Prefix      // aenv.ip=, e.g. 169.254.0.21/30
	Gateway    netip.Addr        // aenv.gw=
	DNS        []netip.Addr      // aenv.dns=, comma separated
	EnvdPort   int               // aenv.envd_port=, default 49983
	Params     map[string]string // every key=value parameter (last wins)
}

// Network reports whether enough is given to configure eth0.
func (c Config) Network() bool { return c.IP.IsValid() }

// ParseCmdline parses /proc/cmdline. Malformed aenv.* values are reported in
// the error (joined), and the rest of the configuration is still returned,
// with defaults for what could not be parsed.
func ParseCmdline(s string) (Config, error) {
	c := Config{Root: "/dev/vda", RootFSType: "ext4", EnvdPort: DefaultEnvdPort, Params: map[string]string{}}
	var errs []error
	for _, f := range splitCmdline(s) {
		k, v, ok := strings.Cut(f, "=")
		if !ok {
			c.Params[f] = ""
			continue
		}
		c.Params[k] = v
		switch k {
		case "aenv.root":
			if v != "" {
				c.Root = v
			}
		case "aenv.rootfstype":
			if v != "" {
				c.RootFSType = v
			}
		case "aenv.rootflags":
			c.RootFlags = v
		case "aenv.hostname":
			c.Hostname = v
		case "aenv.ip":
			p, err := netip.ParsePrefix(v)
			if err != nil {
				errs = append(errs, fmt.Errorf("aenv.ip=%q: want an address with prefix length (e.g. 169.254.0.21/30): %w", v, err))
				continue
			}
			c.IP = p
		case "aenv.gw":
			a, err := netip.ParseAddr(v)
			if err != nil {
				errs = append(errs, fmt.Errorf("aenv.gw=%q: %w", v, err))
				continue
			}
			c.Gateway = a
		case "aenv.dns":
			c.DNS = nil
			for _, d := range strings.Split(v, ",") {
				if d = strings.TrimSpace(d); d == "" {
					continue
				}
				a, err := netip.ParseAddr(d)
				if err != nil {
					errs = append(errs, fmt.Errorf("aenv.dns: %q: %w", d, err))
					continue
				}
				c.DNS = append(c.DNS, a)
			}
		case "aenv.envd_port":
			n, err := strconv.Atoi(v)
			if err != nil || n <= 0 || n > 65535 {
				errs = append(errs, fmt.Errorf("aenv.envd_port=%q: not a port number", v))
				continue
			}
			c.EnvdPort = n
		}
	}
	return c, errors.Join(errs...)
}

// splitCmdline splits on spaces, honouring double quotes the way the
// kernel does (param="a b" keeps the space; the quotes are dropped).
func splitCmdline(s string) []string {
	var out []string
	var cur strings.Builder
	inQuote, have := false, false
	for _, r := range s {
		switch {
		case r == '"':
			inQuote = !inQuote
			have = true
		case !inQuote && (r == ' ' || r == '\t' || r == '\n'):
			if have {
				out = append(out, cur.String())
				cur.Reset()
				have = false
			}
		default:
			cur.WriteRune(r)
			have = true
		}
	}
	if have {
		out = append(out, cur.String())
	}
	return out
}
