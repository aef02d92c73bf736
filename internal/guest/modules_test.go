package guest

import (
	"reflect"
	"strings"
	"testing"
)

func TestModName(t *testing.T) {
	for in, want := range map[string]string{
		"virtio-rng.ko": "virtio_rng",
		"kernel/drivers/char/hw_random/virtio-rng.ko": "virtio_rng",
		"ext4.ko.xz":     "ext4",
		"overlay.ko.zst": "overlay",
		"vsock":          "vsock",
	} {
		if got := ModName(in); got != want {
			t.Errorf("ModName(%q) = %q, want %q", in, got, want)
		}
	}
}

func TestParseModulesDep(t *testing.T) {
	const dep = `kernel/drivers/virtio/virtio_mmio.ko: kernel/drivers/virtio/virtio_ring.ko kernel/drivers/virtio/virtio.ko
kernel/drivers/virtio/virtio.ko:
kernel/drivers/virtio/virtio_ring.ko:
kernel/drivers/char/hw_random/virtio-rng.ko.xz: kernel/drivers/virtio/virtio_ring.ko kernel/drivers/virtio/virtio.ko
`
	paths, deps, err := ParseModulesDep(strings.NewReader(dep))
	if err != nil {
		t.Fatal(err)
	}
	if paths["virtio_rng"] != "kernel/drivers/char/hw_random/virtio-rng.ko.xz" {
		t.Errorf("path of virtio_rng = %q", paths["virtio_rng"])
	}
	if want := []string{"virtio_ring", "virtio"}; !reflect.DeepEqual(deps["virtio_mmio"], want) {
		t.Errorf("deps of virtio_mmio = %v, want %v", deps["virtio_mmio"], want)
	}
	if len(deps["virtio"]) != 0 {
		t.Errorf("deps of virtio = %v", deps["virtio"])
	}
	if _, _, err := ParseModulesDep(strings.NewReader("garbage line\n")); err == nil {
		t.Error("malformed modules.dep accepted")
	}
}

func TestResolveModules(t *testing.T) {
	// Shaped like the Debian cloud kernel's modules (direct dependencies,
	// as .modinfo gives them).
	deps := map[string][]string{
		"virtio_ring":                       nil,
		"virtio":                            nil,
		"virtio_mmio":                       {"virtio", "virtio_ring"},
		"virtio_blk":                        {"virtio", "virtio_ring"},
		"failover":                          nil,
		"net_failover":                      {"failover"},
		"virtio_net":                        {"virtio_ring", "virtio", "net_failover"},
		"vsock":                             nil,
		"vmw_vsock_virtio_transport_common": {"vsock"},
		"vmw_vsock_virtio_transport":        {"virtio", "vmw_vsock_virtio_transport_common", "virtio_ring", "vsock"},
		"overlay":                           nil,
		"cyc_a":                             {"cyc_b"},
		"cyc_b":                             {"cyc_a"},
		"needs_missing":                     {"nowhere"},
		"needs_builtin":                     {"ext4"},
	}
	builtin := map[string]bool{"ext4": true, "jbd2": true}
	exists := func(n string) bool { _, ok := deps[n]; return ok }
	depf := func(n string) ([]string, error) { return deps[n], nil }
	w := func(names ...string) []WantedModule {
		var ws []WantedModule
		for _, n := range names {
			opt := strings.HasSuffix(n, "?")
			ws = append(ws, WantedModule{Name: strings.TrimSuffix(n, "?"), Optional: opt})
		}
		return ws
	}
	tests := []struct {
		name    string
		wanted  []WantedModule
		order   []string
		builtin []string
		err     string
	}{
		{name: "single", wanted: w("virtio_mmio"), order: []string{"virtio", "virtio_ring", "virtio_mmio"}},
		{name: "shared deps once", wanted: w("virtio_mmio", "virtio_blk", "virtio_net"),
			order: []string{"virtio", "virtio_ring", "virtio_mmio", "virtio_blk", "failover", "net_failover", "virtio_net"}},
		{name: "transitive", wanted: w("vmw_vsock_virtio_transport"),
			order: []string{"virtio", "vsock", "vmw_vsock_virtio_transport_common", "virtio_ring", "vmw_vsock_virtio_transport"}},
		{name: "builtin skipped", wanted: w("ext4", "overlay", "ext4"), order: []string{"overlay"}, builtin: []string{"ext4"}},
		{name: "dash name", wanted: w("net-failover"), order: []string{"failover", "net_failover"}},
		{name: "optional missing", wanted: w("virtio_rng?", "overlay"), order: []string{"overlay"}},
		{name: "required missing", wanted: w("virtio_rng"), err: "virtio_rng not found"},
		{name: "dependency missing", wanted: w("needs_missing"), err: "nowhere (needed by needs_missing) not found"},
		{name: "dependency builtin", wanted: w("needs_builtin"), order: []string{"needs_builtin"}},
		{name: "cycle", wanted: w("cyc_a"), err: "cycle"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			order, bi, err := ResolveModules(tt.wanted, exists, builtin, depf)
			if tt.err != "" {
				if err == nil || !strings.Contains(err.Error(), tt.err) {
					t.Fatalf("err = %v, want containing %q", err, tt.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(order, tt.order) {
				t.Errorf("order = %v, want %v", order, tt.order)
			}
			if !reflect.DeepEqual(bi, tt.builtin) {
				t.Errorf("builtin = %v, want %v", bi, tt.builtin)
			}
		})
	}
}
