package pid1

import (
	"net/netip"
	"reflect"
	"strings"
	"testing"
)

func TestParseCmdline(t *testing.T) {
	def := Config{Root: "/dev/vda", RootFSType: "ext4", EnvdPort: DefaultEnvdPort}
	with := func(f func(*Config)) Config { c := def; f(&c); return c }
	tests := []struct {
		name string
		in   string
		want Config
		err  string
	}{
		{name: "empty", in: "", want: def},
		{name: "unrelated", in: "console=ttyS0 quiet panic=-1\n", want: def},
		{name: "full", in: "console=ttyS0 aenv.root=/dev/vdb aenv.hostname=sbx-1 aenv.ip=169.254.0.21/30 aenv.gw=169.254.0.22 aenv.dns=1.1.1.1,8.8.8.8 aenv.envd_port=5000\n",
			want: with(func(c *Config) {
				c.Root, c.Hostname, c.EnvdPort = "/dev/vdb", "sbx-1", 5000
				c.IP = netip.MustParsePrefix("169.254.0.21/30")
				c.Gateway = netip.MustParseAddr("169.254.0.22")
				c.DNS = []netip.Addr{netip.MustParseAddr("1.1.1.1"), netip.MustParseAddr("8.8.8.8")}
			})},
		{name: "quoted", in: `aenv.hostname="my box" aenv.rootflags="discard,errors=remount-ro"`,
			want: with(func(c *Config) { c.Hostname, c.RootFlags = "my box", "discard,errors=remount-ro" })},
		{name: "last wins", in: "aenv.ip=10.0.0.2/24 aenv.ip=10.0.0.3/24",
			want: with(func(c *Config) { c.IP = netip.MustParsePrefix("10.0.0.3/24") })},
		{name: "ipv6", in: "aenv.ip=fd00::2/64 aenv.gw=fd00::1",
			want: with(func(c *Config) {
				c.IP, c.Gateway = netip.MustParsePrefix("fd00::2/64"), netip.MustParseAddr("fd00::1")
			})},
		{name: "ip without prefix", in: "aenv.ip=10.0.0.2 aenv.hostname=h", want: with(func(c *Config) { c.Hostname = "h" }), err: "aenv.ip"},
		{name: "bad gw", in: "aenv.ip=10.0.0.2/24 aenv.gw=nope",
			want: with(func(c *Config) { c.IP = netip.MustParsePrefix("10.0.0.2/24") }), err: "aenv.gw"},
		{name: "bad dns entry kept others", in: "aenv.dns=1.1.1.1,,x,9.9.9.9",
			want: with(func(c *Config) {
				c.DNS = []netip.Addr{netip.MustParseAddr("1.1.1.1"), netip.MustParseAddr("9.9.9.9")}
			}), err: "aenv.dns"},
		{name: "bad port", in: "aenv.envd_port=70000", want: def, err: "envd_port"},
		{name: "empty root keeps default", in: "aenv.root= aenv.rootfstype=", want: def},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := ParseCmdline(tt.in)
			if tt.err == "" && err != nil {
				t.Fatalf("unexpected error: %v", err)
			}
			if tt.err != "" && (err == nil || !strings.Contains(err.Error(), tt.err)) {
				t.Fatalf("error = %v, want containing %q", err, tt.err)
			}
			got.Params = nil
			if !reflect.DeepEqual(got, tt.want) {
				t.Errorf("got  %+v\nwant %+v", got, tt.want)
			}
		})
	}
}

func TestParseCmdlineParams(t *testing.T) {
	c, err := ParseCmdline(`console=ttyS0 quiet aenv.x="a b"`)
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]string{"console": "ttyS0", "quiet": "", "aenv.x": "a b"}
	if !reflect.DeepEqual(c.Params, want) {
		t.Errorf("Params = %v, want %v", c.Params, want)
	}
	if c.Network() {
		t.Error("Network() true without aenv.ip")
	}
}
