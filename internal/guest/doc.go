// Package guest owns the guest side of a sandbox as seen from the host: the
// guest kernel (fetched as the distribution's cloud kernel package and
// unpacked into the data directory), the initramfs (generated here, holding
// our init and the kernel modules it needs) and the root filesystem images
// (template layers built with debootstrap or from busybox, stored as qcow2
// files usable as read-only backing layers).
//
// The guest's PID 1 itself lives in the subpackage pid1.
package guest
