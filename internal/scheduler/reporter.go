package scheduler

import (
	"context"
	"log/slog"
	"time"

	"connectrpc.com/connect"

	pb "github.com/agentenv/agentenv/internal/scheduler/gen/schedulerpb"
	"github.com/agentenv/agentenv/internal/scheduler/gen/schedulerpb/schedulerpbconnect"
)

// Reporter sends a node's report to the scheduler at the interval the
// scheduler asks for, for as long as its context lives. A scheduler that is
// down is retried at the same pace; the node works on meanwhile.
type Reporter struct {
	Client schedulerpbconnect.SchedulerClient
	// Report builds the node's current report.
	Report func(ctx context.Context) (*pb.NodeReport, error)
	Logger *slog.Logger
}

// Run reports until ctx ends.
func (r *Reporter) Run(ctx context.Context) {
	log := r.Logger
	if log == nil {
		log = slog.Default()
	}
	interval := 2 * time.Second
	failing := false
	for {
		if d, err := r.once(ctx); err != nil {
			if !failing && ctx.Err() == nil {
				log.Warn("cannot report to the scheduler; retrying", "err", err)
			}
			failing = true
		} else {
			if failing {
				log.Info("reporting to the scheduler again")
			}
			failing = false
			if d > 0 {
				interval = d
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(interval):
		}
	}
}

func (r *Reporter) once(ctx context.Context) (time.Duration, error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	rep, err := r.Report(ctx)
	if err != nil {
		return 0, err
	}
	resp, err := r.Client.Heartbeat(ctx, connect.NewRequest(&pb.HeartbeatRequest{Node: rep}))
	if err != nil {
		return 0, err
	}
	return time.Duration(resp.Msg.IntervalMs) * time.Millisecond, nil
}
