package image

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/google/go-containerregistry/pkg/v1/remote/transport"
)

// Policy says where the node takes images from for its API's users, who
// name images the node then reads as root.
type Policy struct {
	// Dirs are the only directories local sources (oci-layout:,
	// docker-archive:) may be under, resolved without following links;
	// none: no local sources at all.
	Dirs []string
	// PrivateRegistries lets registry pulls reach loopback, link-local,
	// private and unspecified addresses (and so this node itself); without
	// it the pull refuses to connect there.
	PrivateRegistries bool
}

// ErrSourceRefused marks a source the policy refuses (an ErrImage). Its
// message says why and tells nothing of the host.
var ErrSourceRefused = fmt.Errorf("%w: refused source", ErrImage)

// maxLayoutEntries bounds the walk that checks a local OCI layout.
const maxLayoutEntries = 100000

// Check refuses a local source outside the policy's directories, or one
// that is not plain files and directories (a symlink anywhere on its path
// or inside a layout, a FIFO, a device node): the message never says
// whether the path exists. Registry sources get the policy attached, for
// the pull to enforce at connect time.
func (p Policy) Check(src *Source) error {
	src.policy = &p
	local := src.Layout
	if local == "" {
		local = src.Archive
	}
	if local == "" {
		return nil
	}
	refused := fmt.Errorf("%w: local image sources are read only under the directories the node names with --image-dir (%d named)", ErrSourceRefused, len(p.Dirs))
	if !filepath.IsAbs(local) {
		return refused
	}
	for _, d := range p.Dirs {
		if !filepath.IsAbs(d) {
			continue
		}
		d = filepath.Clean(d)
		rel, err := filepath.Rel(d, filepath.Clean(local))
		if err != nil || rel == "." || rel == ".." || strings.HasPrefix(rel, "../") {
			continue
		}
		return checkLocal(d, rel, src.Layout != "")
	}
	return refused
}

// checkLocal checks that rel names, under dir, a regular file (an archive)
// or a directory of regular files and directories only (a layout), with
// no symlink on the way.
func checkLocal(dir, rel string, layout bool) error {
	cur := dir
	parts := strings.Split(rel, string(filepath.Separator))
	for i, c := range parts {
		cur = filepath.Join(cur, c)
		fi, err := os.Lstat(cur)
		if errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("%w: %s is not in the image directory", ErrNotFound, rel)
		}
		if err != nil {
			return fmt.Errorf("%w: %s cannot be read", ErrSourceRefused, rel)
		}
		last := i == len(parts)-1
		switch {
		case !last && !fi.IsDir(), last && layout && !fi.IsDir():
			return fmt.Errorf("%w: %s is not a directory of the image directory", ErrSourceRefused, rel)
		case last && !layout && !fi.Mode().IsRegular():
			return fmt.Errorf("%w: %s is not a regular file", ErrSourceRefused, rel)
		}
	}
	if !layout {
		return nil
	}
	n := 0
	return filepath.WalkDir(cur, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return fmt.Errorf("%w: the layout %s cannot be read", ErrSourceRefused, rel)
		}
		if n++; n > maxLayoutEntries {
			return fmt.Errorf("%w: the layout %s holds more than %d files", ErrSourceRefused, rel, maxLayoutEntries)
		}
		if !d.IsDir() && !d.Type().IsRegular() {
			r, _ := filepath.Rel(dir, p)
			return fmt.Errorf("%w: %s is not a regular file", ErrSourceRefused, r)
		}
		return nil
	})
}

// transport is the HTTP transport of registry pulls under the policy: its
// dialer refuses, at connect time (after name resolution, so a name that
// resolves there is refused too), the addresses the policy closes.
func (p *Policy) transport() http.RoundTripper {
	t := http.DefaultTransport.(*http.Transport).Clone()
	if p == nil || p.PrivateRegistries {
		return t
	}
	d := &net.Dialer{Timeout: 30 * time.Second, KeepAlive: 30 * time.Second, Control: refusePrivate}
	t.DialContext = d.DialContext
	t.Proxy = nil // a proxy would connect on our behalf
	return t
}

// errPrivateAddress marks a connection the policy refused.
var errPrivateAddress = errors.New("a registry address the node does not pull from")

// refusePrivate refuses connections to loopback, link-local, private,
// unspecified and multicast addresses and to the node's own addresses.
func refusePrivate(network, address string, _ syscall.RawConn) error {
	host, _, err := net.SplitHostPort(address)
	if err != nil {
		return err
	}
	ip := net.ParseIP(host)
	if ip == nil {
		return errPrivateAddress
	}
	if ip.IsLoopback() || ip.IsLinkLocalUnicast() || ip.IsLinkLocalMulticast() || ip.IsPrivate() ||
		ip.IsUnspecified() || ip.IsMulticast() || ip.IsInterfaceLocalMulticast() || isNodeAddress(ip) {
		return errPrivateAddress
	}
	return nil
}

// isNodeAddress tells whether ip is an address of one of this host's
// interfaces.
func isNodeAddress(ip net.IP) bool {
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return true
	}
	for _, a := range addrs {
		if n, ok := a.(*net.IPNet); ok && n.IP.Equal(ip) {
			return true
		}
	}
	return false
}

// registryError says what went wrong with a pull in the node's own words:
// the HTTP status or that the registry could not be reached, never what the
// remote sent (its body may be anything).
func registryError(ref string, err error) error {
	var terr *transport.Error
	switch {
	case errors.Is(err, errPrivateAddress):
		return fmt.Errorf("%w: pull %s: its registry is at an address the node does not pull from (loopback, link-local, private or the node's own; the node's operator allows them with --allow-private-registries)", ErrSourceRefused, ref)
	case errors.As(err, &terr):
		return fmt.Errorf("%w: pull %s: the registry answered %d %s", ErrImage, ref, terr.StatusCode, http.StatusText(terr.StatusCode))
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		return fmt.Errorf("pull %s: %w", ref, err)
	}
	return fmt.Errorf("%w: pull %s: the registry cannot be reached", ErrImage, ref)
}
