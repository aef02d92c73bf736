package guest

import (
	"bytes"
	"compress/gzip"
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

// testCacheDir is where tests keep the fetched kernel between runs.
func testCacheDir(t *testing.T) string {
	t.Helper()
	d := os.Getenv("AENV_TEST_CACHE")
	if d == "" {
		d = "/var/cache/aenv-test"
	}
	if err := os.MkdirAll(d, 0o755); err != nil {
		t.Skipf("no test cache dir: %v", err)
	}
	return d
}

var (
	kernelOnce sync.Once
	kernel     *Kernel
	kernelErr  error
)

// testKernel fetches (once, cached across runs) the guest kernel.
func testKernel(t *testing.T) *Kernel {
	t.Helper()
	for _, tool := range []string{"apt-cache", "apt-get", "dpkg-deb"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("%s not available: %v", tool, err)
		}
	}
	dir := filepath.Join(testCacheDir(t), "kernels")
	kernelOnce.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
		defer cancel()
		kernel, kernelErr = FetchKernel(ctx, dir, t.Logf)
	})
	if kernelErr != nil {
		t.Fatalf("FetchKernel: %v", kernelErr)
	}
	return kernel
}

// staticBinary returns a static ELF to use as /init.
func staticBinary(t *testing.T) string {
	t.Helper()
	for _, p := range []string{"/bin/busybox", "/usr/bin/busybox"} {
		if b, err := os.ReadFile(p); err == nil && checkStatic(b) == nil {
			return p
		}
	}
	t.Skip("no static binary (busybox-static) to use as /init")
	return ""
}

func TestNewcRoundTrip(t *testing.T) {
	var buf bytes.Buffer
	w := newNewcWriter(&buf)
	in := []newcEntry{
		{Name: "dev", Mode: cpioTypeDir | 0o755},
		{Name: "dev/console", Mode: cpioTypeChar | 0o600, RdevMajor: 5, RdevMinor: 1},
		{Name: "init", Mode: cpioTypeReg | 0o755, Data: []byte("hello")},
		{Name: "bin/sh", Mode: cpioTypeSymlink | 0o777, Data: []byte("busybox")},
	}
	for _, e := range in {
		if err := w.Add(e); err != nil {
			t.Fatal(err)
		}
	}
	if err := w.Add(newcEntry{Name: "init", Mode: cpioTypeReg}); err == nil {
		t.Error("duplicate accepted")
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	if buf.Len()%4 != 0 {
		t.Errorf("archive length %d not 4-aligned", buf.Len())
	}
	out, err := readNewc(&buf)
	if err != nil {
		t.Fatal(err)
	}
	if len(out) != len(in) {
		t.Fatalf("read %d entries, want %d", len(out), len(in))
	}
	for i := range in {
		if in[i].Name != out[i].Name || in[i].Mode != out[i].Mode || !bytes.Equal(in[i].Data, out[i].Data) ||
			in[i].RdevMajor != out[i].RdevMajor || in[i].RdevMinor != out[i].RdevMinor {
			t.Errorf("entry %d: got %+v, want %+v", i, out[i], in[i])
		}
	}
	// The system cpio must agree.
	if _, err := exec.LookPath("cpio"); err == nil {
		var again bytes.Buffer
		w := newNewcWriter(&again)
		for _, e := range in {
			_ = w.Add(e)
		}
		_ = w.Close()
		cmd := exec.Command("cpio", "-t", "--quiet")
		cmd.Stdin = &again
		list, err := cmd.Output()
		if err != nil {
			t.Fatalf("cpio -t: %v", err)
		}
		if got := strings.Fields(string(list)); strings.Join(got, " ") != "dev dev/console init bin/sh" {
			t.Errorf("cpio -t lists %v", got)
		}
	}
}

func TestKernelAndInitramfs(t *testing.T) {
	k := testKernel(t)
	if k.Version == "" || !strings.HasSuffix(k.Version, "-cloud-amd64") {
		t.Errorf("kernel version %q", k.Version)
	}
	for _, p := range []string{k.Vmlinuz, k.ModulesDir} {
		if _, err := os.Stat(p); err != nil {
			t.Error(err)
		}
	}
	if k.Vmlinux == "" || !HasPVHEntry(k.Vmlinux) {
		t.Errorf("no PVH-bootable vmlinux extracted (%q)", k.Vmlinux)
	}
	if HasPVHEntry(k.Vmlinuz) {
		t.Error("bzImage reported as PVH ELF")
	}
	loaded, err := LoadKernel(filepath.Dir(filepath.Dir(filepath.Dir(filepath.Dir(k.ModulesDir)))))
	if err != nil {
		t.Fatalf("LoadKernel: %v", err)
	}
	if *loaded != *k {
		t.Errorf("LoadKernel = %+v, want %+v", *loaded, *k)
	}
	if _, err := LoadKernel(t.TempDir()); err == nil || !strings.Contains(err.Error(), "aenv setup") {
		t.Errorf("LoadKernel of empty dir: %v", err)
	}

	init := staticBinary(t)
	out := filepath.Join(t.TempDir(), "initrd.img")
	order, err := BuildInitramfsModules(k, init, out, DefaultModules)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("modules: %v", order)
	f, err := os.Open(out)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	gz, err := gzip.NewReader(f)
	if err != nil {
		t.Fatal(err)
	}
	entries, err := readNewc(gz)
	if err != nil {
		t.Fatal(err)
	}
	byName := map[string]newcEntry{}
	for _, e := range entries {
		byName[e.Name] = e
	}
	initData, _ := os.ReadFile(init)
	if e, ok := byName["init"]; !ok || !bytes.Equal(e.Data, initData) || e.Mode != cpioTypeReg|0o755 {
		t.Errorf("/init missing or wrong (mode %o)", e.Mode)
	}
	for _, d := range []string{"dev", "proc", "sys", "newroot", "etc", "tmp", "run"} {
		if e, ok := byName[d]; !ok || e.Mode&^0o7777 != cpioTypeDir {
			t.Errorf("directory /%s missing", d)
		}
	}
	if e := byName["dev/console"]; e.Mode&^0o7777 != cpioTypeChar || e.RdevMajor != 5 || e.RdevMinor != 1 {
		t.Errorf("/dev/console wrong: %+v", e)
	}
	orderFile := strings.Fields(string(byName[InitramfsModuleOrder[1:]].Data))
	if len(orderFile) != len(order) {
		t.Fatalf("modules.order has %d entries, resolved %d", len(orderFile), len(order))
	}
	pos := map[string]int{}
	ms, err := LoadModuleSet(k.ModulesDir)
	if err != nil {
		t.Fatal(err)
	}
	for i, p := range orderFile {
		name := ModName(p)
		pos[name] = i
		e, ok := byName[strings.TrimPrefix(p, "/")]
		if !ok {
			t.Errorf("%s listed but not in the archive", p)
			continue
		}
		info, err := ModInfo(e.Data)
		if err != nil {
			t.Errorf("%s: %v", p, err)
			continue
		}
		if ModName(info["name"]) != name {
			t.Errorf("%s: modinfo name %q", p, info["name"])
		}
		// Every dependency is either built in or loaded earlier.
		for _, d := range strings.Split(info["depends"], ",") {
			if d == "" || ms.Builtin[ModName(d)] {
				continue
			}
			if j, ok := pos[ModName(d)]; !ok || j >= i {
				t.Errorf("%s depends on %s, which is not loaded before it", name, d)
			}
		}
	}
	for _, w := range DefaultModules {
		n := ModName(w.Name)
		if _, ok := pos[n]; !ok && !ms.Builtin[n] && !w.Optional {
			t.Errorf("wanted module %s neither loaded nor built in", n)
		}
	}
	for _, n := range []string{"virtio_mmio", "virtio_blk", "virtio_net"} {
		if _, ok := pos[n]; !ok && !ms.Builtin[n] {
			t.Errorf("%s missing", n)
		}
	}
	if pos["virtio_ring"] > pos["virtio_mmio"] || pos["net_failover"] > pos["virtio_net"] {
		t.Errorf("bad order: %v", orderFile)
	}

	// Reproducible.
	out2 := filepath.Join(t.TempDir(), "initrd2.img")
	if err := BuildInitramfs(k, init, out2); err != nil {
		t.Fatal(err)
	}
	a, _ := os.ReadFile(out)
	b, _ := os.ReadFile(out2)
	if !bytes.Equal(a, b) {
		t.Error("initramfs not reproducible")
	}

	// A dynamically linked /init is refused.
	if _, err := os.Stat("/bin/ls"); err == nil {
		if err := BuildInitramfs(k, "/bin/ls", out2); err == nil || !strings.Contains(err.Error(), "dynamically linked") {
			t.Errorf("dynamic init: %v", err)
		}
	}
}

func TestBuildRootfsMinimal(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root")
	}
	for _, tool := range []string{"mkfs.ext4", "qemu-img"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("%s not available", tool)
		}
	}
	staticBinary(t)
	dir := t.TempDir()
	out := filepath.Join(dir, "minimal.qcow2")
	start := time.Now()
	if err := BuildRootfs(context.Background(), RootfsSpec{Kind: RootfsMinimal, KernelVersion: "test"}, out, t.Logf); err != nil {
		t.Fatal(err)
	}
	t.Logf("minimal rootfs built in %s", time.Since(start))
	info, err := exec.Command("qemu-img", "info", "--output=json", out).Output()
	if err != nil {
		t.Fatalf("qemu-img info: %v", err)
	}
	var qi struct {
		Format      string `json:"format"`
		VirtualSize int64  `json:"virtual-size"`
	}
	if err := json.Unmarshal(info, &qi); err != nil {
		t.Fatal(err)
	}
	if qi.Format != "qcow2" || qi.VirtualSize < 64<<20 {
		t.Errorf("qemu-img info: %s", info)
	}
	m, err := ReadManifest(out)
	if err != nil {
		t.Fatal(err)
	}
	sum, size, err := sha256File(out)
	if err != nil {
		t.Fatal(err)
	}
	if m.Kind != RootfsMinimal || m.SHA256 != sum || m.SizeBytes != size || m.KernelVersion != "test" || m.VirtualBytes != qi.VirtualSize {
		t.Errorf("manifest %+v does not match image (sha %s size %d virtual %d)", m, sum, size, qi.VirtualSize)
	}
	// Inspect the filesystem with debugfs when available.
	raw := filepath.Join(dir, "raw.img")
	if err := exec.Command("qemu-img", "convert", "-O", "raw", out, raw).Run(); err != nil {
		t.Fatal(err)
	}
	if _, err := exec.LookPath("debugfs"); err == nil {
		ls, err := exec.Command("debugfs", "-R", "ls -l /bin", raw).CombinedOutput()
		if err != nil {
			t.Fatalf("debugfs: %v: %s", err, ls)
		}
		for _, want := range []string{"busybox", " sh", " ls", " cat", " sleep"} {
			if !strings.Contains(string(ls), want) {
				t.Errorf("/bin lacks %q", want)
			}
		}
		home, _ := exec.Command("debugfs", "-R", "stat /home/user", raw).CombinedOutput()
		if !strings.Contains(string(home), "User:  1000") {
			t.Errorf("/home/user not owned by 1000: %s", home)
		}
		passwd, _ := exec.Command("debugfs", "-R", "cat /etc/passwd", raw).CombinedOutput()
		if !strings.Contains(string(passwd), "user:x:1000:1000") {
			t.Errorf("/etc/passwd: %s", passwd)
		}
	}
	if err := BuildRootfs(context.Background(), RootfsSpec{Kind: "nope"}, out, nil); err == nil {
		t.Error("unknown kind accepted")
	}
}

func TestHostTSCkHz(t *testing.T) {
	khz, err := HostTSCkHz()
	if err != nil {
		t.Skipf("no usable TSC: %v", err)
	}
	t.Logf("host TSC %d kHz", khz)
	k := &Kernel{Version: "x", Vmlinuz: "/nonexistent/vmlinuz-x"}
	p := k.TimingParams(2596130)
	want := []string{"tsc_early_khz=2596130", "tsc=reliable", "lpj=10384520"}
	if strings.Join(p, " ") != strings.Join(want, " ") {
		t.Errorf("TimingParams = %v, want %v", p, want)
	}
	if k.TimingParams(0) != nil {
		t.Error("TimingParams(0) not empty")
	}
}

func TestRecipeTellsBuildsApart(t *testing.T) {
	file := File{Path: "/usr/local/bin/x", Mode: 0o755, Data: []byte("v1")}
	base := RootfsSpec{Kind: RootfsBase, ExtraPackages: []string{"jq"}, ExtraFiles: []File{file}}
	same := base
	same.Suite, same.Hostname, same.SizeMiB = "bookworm", "other", 4096 // not what the image holds
	if base.Recipe() != same.Recipe() {
		t.Fatal("settings that do not change the image changed the recipe")
	}
	changed := map[string]RootfsSpec{
		"kind":         {Kind: RootfsMinimal},
		"suite":        {Kind: RootfsBase, Suite: "trixie", ExtraPackages: []string{"jq"}, ExtraFiles: []File{file}},
		"package":      {Kind: RootfsBase, ExtraPackages: []string{"jq", "git"}, ExtraFiles: []File{file}},
		"file content": {Kind: RootfsBase, ExtraPackages: []string{"jq"}, ExtraFiles: []File{{Path: file.Path, Mode: file.Mode, Data: []byte("v2")}}},
		"file mode":    {Kind: RootfsBase, ExtraPackages: []string{"jq"}, ExtraFiles: []File{{Path: file.Path, Mode: 0o644, Data: file.Data}}},
		"file path":    {Kind: RootfsBase, ExtraPackages: []string{"jq"}, ExtraFiles: []File{{Path: "/y", Mode: file.Mode, Data: file.Data}}},
	}
	for what, spec := range changed {
		if spec.Recipe() == base.Recipe() {
			t.Errorf("another %s, same recipe", what)
		}
	}
}
