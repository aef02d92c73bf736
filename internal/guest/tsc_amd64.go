package guest

func rdtsc() uint64

const haveTSC = true
