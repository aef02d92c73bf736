package pid1

import (
	"encoding/binary"
	"os"
	"path/filepath"
	"strings"
)

// Linux input event constants (linux/input-event-codes.h).
const (
	evKey    = 0x01
	keyPower = 116
	// struct input_event on 64-bit: struct timeval (16 bytes), type u16,
	// code u16, value s32.
	inputEventSize = 24
)

// watchPowerButton reports on power when an input device called "Power
// Button" (the ACPI button driver, fed by QEMU's system_powerdown) sends
// KEY_POWER. It needs the button and evdev modules; without them it does
// nothing.
func watchPowerButton(power chan<- string) {
	devs, _ := filepath.Glob("/sys/class/input/event*")
	n := 0
	for _, d := range devs {
		name, err := os.ReadFile(filepath.Join(d, "device", "name"))
		if err != nil || !strings.Contains(strings.ToLower(string(name)), "power button") {
			continue
		}
		f, err := os.Open(filepath.Join("/dev/input", filepath.Base(d)))
		if err != nil {
			logf("power button %s: %v", filepath.Base(d), err)
			continue
		}
		n++
		goSafe("power button reader", func() {
			defer f.Close()
			buf := make([]byte, inputEventSize*16)
			for {
				m, err := f.Read(buf)
				if err != nil {
					return
				}
				for off := 0; off+inputEventSize <= m; off += inputEventSize {
					ev := buf[off : off+inputEventSize]
					typ := binary.LittleEndian.Uint16(ev[16:])
					code := binary.LittleEndian.Uint16(ev[18:])
					val := int32(binary.LittleEndian.Uint32(ev[20:]))
					if typ == evKey && code == keyPower && val == 1 {
						select {
						case power <- "ACPI power button":
						default:
						}
					}
				}
			}
		})
	}
	if n == 0 {
		logf("no ACPI power button found; power off with SIGTERM to init instead")
	}
}
