package network

import (
	"context"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"
)

func TestEndpointAddressing(t *testing.T) {
	m, err := NewManager("10.213.0.0/16", "aenv")
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		slot           int
		host, ns, veth string
	}{
		{0, "10.213.0.1", "10.213.0.2", "aenv-h0"},
		{1, "10.213.0.5", "10.213.0.6", "aenv-h1"},
		{64, "10.213.1.1", "10.213.1.2", "aenv-h64"},
		{16383, "10.213.255.253", "10.213.255.254", "aenv-h16383"},
	}
	for _, tt := range tests {
		ep, err := m.Endpoint("abc", tt.slot, true, Egress{})
		if err != nil {
			t.Fatal(err)
		}
		if ep.HostIP.String() != tt.host || ep.NSIP.String() != tt.ns || ep.HostVeth != tt.veth || ep.Namespace != "aenv-abc" {
			t.Errorf("slot %d: got %s %s %s", tt.slot, ep.HostIP, ep.NSIP, ep.HostVeth)
		}
	}
	if _, err := m.Endpoint("abc", 16384, true, Egress{}); err == nil {
		t.Error("slot past the range accepted")
	}
	if _, err := NewManager("10.213.0.0/16", "Bad-Name"); err == nil {
		t.Error("invalid instance name accepted")
	}
	for _, bad := range []string{"", "10.0.0.0/30", "fd00::/64", "nonsense"} {
		if _, err := NewManager(bad, "aenv"); err == nil {
			t.Errorf("NewManager(%q) accepted", bad)
		}
	}
}

func TestSetupTeardown(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to create network namespaces")
	}
	if _, err := exec.LookPath("nft"); err != nil {
		t.Skip("nft not installed")
	}
	m, err := NewManager("10.219.0.0/24", "aenet") // apart from the orchestrator tests' nodes
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	ep, err := m.Endpoint("nettest", 3, false, Egress{})
	if err != nil {
		t.Fatal(err)
	}
	if err := m.Setup(ctx, ep); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = m.Teardown(ep) })
	tap, err := m.OpenTap(ep, GuestAsks)
	if err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command("ip", "netns", "exec", ep.Namespace, "ip", "-br", "addr").CombinedOutput()
	if err != nil {
		t.Fatal(err, string(out))
	}
	for _, want := range []string{"veth0", "10.219.0.14/30", "tap0", "169.254.0.22/30"} {
		if !strings.Contains(string(out), want) {
			t.Errorf("namespace addresses lack %q:\n%s", want, out)
		}
	}
	rules, err := exec.Command("ip", "netns", "exec", ep.Namespace, "nft", "list", "table", "ip", "aenv").CombinedOutput()
	if err != nil {
		t.Fatal(err, string(rules))
	}
	if strings.Contains(string(rules), `iifname "tap0" oifname "veth0" accept`) {
		t.Errorf("internet disabled but egress rule present:\n%s", rules)
	}
	if err := m.SetEgress(ctx, ep, true, Egress{}); err != nil {
		t.Fatal(err)
	}
	rules, _ = exec.Command("ip", "netns", "exec", ep.Namespace, "nft", "list", "table", "ip", "aenv").CombinedOutput()
	if !strings.Contains(string(rules), `iifname "tap0" oifname "veth0" accept`) {
		t.Errorf("internet enabled but egress rule missing:\n%s", rules)
	}
	tap.Close()
	if err := m.Teardown(ep); err != nil {
		t.Fatal(err)
	}
	nss, _ := m.Namespaces()
	veths, _ := m.HostVeths()
	if slices.Contains(nss, ep.Namespace) || slices.Contains(veths, ep.HostVeth) {
		t.Fatalf("leftovers after teardown: %v %v", nss, veths)
	}
	if err := m.Teardown(ep); err != nil {
		t.Fatalf("second teardown: %v", err)
	}
}

// TestTapModes: every tap has TapMAC (what TapMAC reads back); a tap for
// a guest that knows it has the guest's MAC as a permanent neighbour (no
// ARP before the first packet to the guest), one for a guest that may not
// has none, and the namespace asks. A tap opened again after its QEMU's
// went (a resume) is set up the same way.
func TestTapModes(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to create network namespaces")
	}
	if _, err := exec.LookPath("nft"); err != nil {
		t.Skip("nft not installed")
	}
	m, err := NewManager("10.219.0.0/24", "aenet")
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	ep, err := m.Endpoint("taptest", 4, false, Egress{})
	if err != nil {
		t.Fatal(err)
	}
	if err := m.Setup(ctx, ep); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = m.Teardown(ep) })
	neighbours := func() string {
		out, err := exec.Command("ip", "netns", "exec", ep.Namespace, "ip", "neigh", "show", "dev", TapName).CombinedOutput()
		if err != nil {
			t.Fatal(err, string(out))
		}
		return string(out)
	}
	for _, tt := range []struct {
		name      string
		mode      TapMode
		permanent bool
	}{
		{"the guest knows the tap", GuestKnows, true},
		{"the guest may not", GuestAsks, false},
		{"the guest knows it, a second QEMU", GuestKnows, true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			tap, err := m.OpenTap(ep, tt.mode)
			if err != nil {
				t.Fatal(err)
			}
			defer tap.Close() // the device goes with it, as with QEMU's exit
			if mac, err := m.TapMAC(ep); err != nil || mac != TapMAC {
				t.Fatalf("tap MAC %q (%v), want %s", mac, err, TapMAC)
			}
			want := GuestIP.String() + " lladdr " + GuestMAC + " PERMANENT"
			if got := neighbours(); strings.Contains(got, want) != tt.permanent {
				t.Fatalf("neighbours of the tap:\n%s\nwant %q: %v", got, want, tt.permanent)
			}
		})
	}
}
