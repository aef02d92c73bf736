//go:build !amd64

package guest

func rdtsc() uint64 { return 0 }

const haveTSC = false
