// Command guestbuild drives package guest by hand:
//
//	guestbuild kernel DIR
//	guestbuild initramfs KERNELDIR INIT OUT
//	guestbuild rootfs KIND OUT [KERNELDIR]
package main

import (
	"context"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/agentenv/agentenv/internal/guest"
)

func logf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, time.Now().Format("15:04:05.000 ")+format+"\n", args...)
}

func main() {
	ctx := context.Background()
	if err := run(ctx, os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, "error:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, args []string) error {
	if len(args) < 2 {
		return fmt.Errorf("usage: guestbuild kernel|initramfs|rootfs …")
	}
	start := time.Now()
	defer func() { logf("done in %s", time.Since(start).Round(time.Millisecond)) }()
	switch args[0] {
	case "kernel":
		k, err := guest.FetchKernel(ctx, args[1], logf)
		if err != nil {
			return err
		}
		fmt.Printf("%+v\n", *k)
	case "initramfs":
		k, err := guest.LoadKernel(args[1])
		if err != nil {
			return err
		}
		order, err := guest.BuildInitramfsModules(k, args[2], args[3], guest.DefaultModules)
		if err != nil {
			return err
		}
		fmt.Println(k.Version, strings.Join(order, " "))
	case "rootfs":
		spec := guest.RootfsSpec{Kind: args[1]}
		if len(args) > 3 {
			if k, err := guest.LoadKernel(args[3]); err == nil {
				spec.KernelVersion = k.Version
			}
		}
		return guest.BuildRootfs(ctx, spec, args[2], func(f string, a ...any) { logf(f, a...) })
	default:
		return fmt.Errorf("unknown command %q", args[0])
	}
	return nil
}
