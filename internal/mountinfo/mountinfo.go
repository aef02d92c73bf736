// Package mountinfo reads the kernel's table of mounts (/proc/PID/mountinfo,
// and /proc/PID/mounts where a path is all that is needed): which paths are
// mount points of a mount namespace.
package mountinfo

import (
	"os"
	"strconv"
	"strings"
)

// Points lists the mount points of a mountinfo table (its fifth field),
// with the kernel's octal escapes undone.
func Points(table []byte) []string {
	var out []string
	for _, line := range strings.Split(string(table), "\n") {
		if f := strings.Fields(line); len(f) > 4 {
			out = append(out, Unescape(f[4]))
		}
	}
	return out
}

// Own lists the mount points of this process's mount namespace.
func Own() ([]string, error) {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return nil, err
	}
	return Points(b), nil
}

// IsMountPoint reports whether path is the target of a mount in this
// process's mount namespace.
func IsMountPoint(path string) (bool, error) {
	points, err := Own()
	if err != nil {
		return false, err
	}
	for _, p := range points {
		if p == path {
			return true, nil
		}
	}
	return false, nil
}

// Unescape undoes the octal escapes of a path in the kernel's mount
// tables (\040 for a space, \011, \012, \134).
func Unescape(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			if n, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(n))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}
