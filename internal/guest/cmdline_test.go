package guest

import (
	"net/netip"
	"reflect"
	"testing"

	"github.com/agentenv/agentenv/internal/guest/pid1"
)

func TestKernelCmdlineRoundTrip(t *testing.T) {
	p := BootParams{
		Hostname: "sbx-1",
		IP:       netip.MustParsePrefix("169.254.0.21/30"),
		Gateway:  netip.MustParseAddr("169.254.0.22"),
		DNS:      []netip.Addr{netip.MustParseAddr("1.1.1.1"), netip.MustParseAddr("8.8.8.8")},
		EnvdPort: 5000,
		Extra:    []string{"foo=bar"},
	}
	s, err := p.KernelCmdline()
	if err != nil {
		t.Fatal(err)
	}
	want := "console=ttyS0 quiet panic=-1 pci=off aenv.hostname=sbx-1 aenv.ip=169.254.0.21/30 aenv.gw=169.254.0.22 aenv.dns=1.1.1.1,8.8.8.8 aenv.envd_port=5000 foo=bar"
	if s != want {
		t.Errorf("cmdline\n got %s\nwant %s", s, want)
	}
	c, err := pid1.ParseCmdline(s)
	if err != nil {
		t.Fatal(err)
	}
	if c.Root != "/dev/vda" || c.Hostname != p.Hostname || c.IP != p.IP || c.Gateway != p.Gateway ||
		!reflect.DeepEqual(c.DNS, p.DNS) || c.EnvdPort != p.EnvdPort || c.Params["foo"] != "bar" {
		t.Errorf("round trip: %+v", c)
	}

	if _, err := (BootParams{Hostname: "a b"}).KernelCmdline(); err == nil {
		t.Error("hostname with a space accepted")
	}
	if _, err := (BootParams{Gateway: netip.MustParseAddr("10.0.0.1")}).KernelCmdline(); err == nil {
		t.Error("gateway without address accepted")
	}
	s, err = BootParams{Console: "none"}.KernelCmdline()
	if err != nil || s != "quiet panic=-1 pci=off" {
		t.Errorf("minimal cmdline %q, %v", s, err)
	}
}
