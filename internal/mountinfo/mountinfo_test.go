package mountinfo

import (
	"slices"
	"testing"
)

func TestPoints(t *testing.T) {
	table := "22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n" +
		"40 22 0:35 / /var/lib/aenv/volumes/v\\0401/mnt rw - fuse.fuse2fs fuse2fs rw\n" +
		"41 22 0:4 net:[4026532] /run/netns/ae0-3 rw - nsfs nsfs rw\n" +
		"short line\n"
	got := Points([]byte(table))
	want := []string{"/", "/var/lib/aenv/volumes/v 1/mnt", "/run/netns/ae0-3"}
	if !slices.Equal(got, want) {
		t.Fatalf("%q, want %q", got, want)
	}
}

func TestUnescape(t *testing.T) {
	for in, want := range map[string]string{
		`/plain`: "/plain", `/a\040b`: "/a b", `/tab\011x`: "/tab\tx", `/back\134slash`: `/back\slash`,
		`/trailing\04`: `/trailing\04`, `/not\9999octal`: `/not\9999octal`,
	} {
		if got := Unescape(in); got != want {
			t.Errorf("Unescape(%q) = %q, want %q", in, got, want)
		}
	}
}

func TestIsMountPoint(t *testing.T) {
	if ok, err := IsMountPoint("/"); err != nil || !ok {
		t.Fatalf("/ is not a mount point: %v", err)
	}
	if ok, err := IsMountPoint("/no/such/mount/point"); err != nil || ok {
		t.Fatalf("a missing path is a mount point: %v %v", ok, err)
	}
}
