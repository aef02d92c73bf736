package vmm

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"runtime"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// Event is an asynchronous QMP event such as STOP, RESUME or SHUTDOWN.
type Event struct {
	Name      string          `json:"event"`
	Data      json.RawMessage `json:"data,omitempty"`
	Timestamp struct {
		Seconds      int64 `json:"seconds"`
		Microseconds int64 `json:"microseconds"`
	} `json:"timestamp"`
}

// QMPError is an error answered by QEMU to a command.
type QMPError struct {
	Command string
	Class   string `json:"class"`
	Desc    string `json:"desc"`
}

func (e *QMPError) Error() string {
	return fmt.Sprintf("qmp %s: %s: %s", e.Command, e.Class, e.Desc)
}

// ErrQMPClosed is returned for commands issued after the QMP connection ended
// (normally because QEMU exited).
var ErrQMPClosed = errors.New("qmp connection closed")

type qmpReply struct {
	ID     uint64          `json:"id"`
	Return json.RawMessage `json:"return"`
	Error  *QMPError       `json:"error"`
}

// QMP is a client for the QEMU Machine Protocol over a Unix socket. Commands
// may be issued concurrently; events are delivered in order to the channel
// returned by Events.
type QMP struct {
	conn net.Conn

	writeMu sync.Mutex
	mu      sync.Mutex
	nextID  uint64
	pending map[uint64]chan qmpReply
	closed  bool

	events chan Event
	done   chan struct{}
}

// DialQMP connects to a QMP socket, waiting up to the context's deadline for
// QEMU to create it, and negotiates capabilities.
func DialQMP(ctx context.Context, socket string) (*QMP, error) {
	var conn net.Conn
	var err error
	for {
		var d net.Dialer
		conn, err = d.DialContext(ctx, "unix", socket)
		if err == nil {
			break
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("connect to QMP socket %s: %w", socket, err)
		case <-time.After(5 * time.Millisecond):
		}
	}
	q := &QMP{
		conn:    conn,
		pending: map[uint64]chan qmpReply{},
		events:  make(chan Event, 64),
		done:    make(chan struct{}),
	}
	r := bufio.NewReader(conn)
	if dl, ok := ctx.Deadline(); ok {
		_ = conn.SetReadDeadline(dl)
	}
	greeting, err := r.ReadBytes('\n')
	if err != nil {
		conn.Close()
		return nil, fmt.Errorf("read QMP greeting: %w", err)
	}
	var g struct {
		QMP json.RawMessage `json:"QMP"`
	}
	if err := json.Unmarshal(greeting, &g); err != nil || g.QMP == nil {
		conn.Close()
		return nil, fmt.Errorf("unexpected QMP greeting %q", greeting)
	}
	_ = conn.SetReadDeadline(time.Time{})
	go q.readLoop(r)
	if _, err := q.Execute(ctx, "qmp_capabilities", nil); err != nil {
		q.Close()
		return nil, err
	}
	return q, nil
}

func (q *QMP) readLoop(r *bufio.Reader) {
	defer func() {
		q.mu.Lock()
		q.closed = true
		for id, ch := range q.pending {
			close(ch)
			delete(q.pending, id)
		}
		q.mu.Unlock()
		close(q.events)
		close(q.done)
	}()
	for {
		line, err := r.ReadBytes('\n')
		if err != nil {
			return
		}
		var probe struct {
			Event string `json:"event"`
		}
		if json.Unmarshal(line, &probe) != nil {
			continue
		}
		if probe.Event != "" {
			var ev Event
			if json.Unmarshal(line, &ev) == nil {
				select {
				case q.events <- ev:
				default: // nobody listening fast enough; drop rather than block replies
				}
			}
			continue
		}
		var rep qmpReply
		if json.Unmarshal(line, &rep) != nil {
			continue
		}
		q.mu.Lock()
		ch := q.pending[rep.ID]
		delete(q.pending, rep.ID)
		q.mu.Unlock()
		if ch != nil {
			ch <- rep
		}
	}
}

// Execute runs one QMP command and returns its "return" value.
func (q *QMP) Execute(ctx context.Context, command string, args any) (json.RawMessage, error) {
	return q.execute(ctx, command, args, nil)
}

// ExecuteWithFile runs a command that takes a file descriptor (add-fd,
// getfd): f's descriptor travels with the command (SCM_RIGHTS), so QEMU
// gets a file it could not open itself (it runs unprivileged, confined).
func (q *QMP) ExecuteWithFile(ctx context.Context, command string, args any, f *os.File) (json.RawMessage, error) {
	if _, ok := q.conn.(*net.UnixConn); !ok {
		return nil, fmt.Errorf("qmp %s: passing a descriptor needs a unix socket", command)
	}
	ret, err := q.execute(ctx, command, args, unix.UnixRights(int(f.Fd())))
	runtime.KeepAlive(f) // open until sent
	return ret, err
}

func (q *QMP) execute(ctx context.Context, command string, args any, oob []byte) (json.RawMessage, error) {
	q.mu.Lock()
	if q.closed {
		q.mu.Unlock()
		return nil, ErrQMPClosed
	}
	q.nextID++
	id := q.nextID
	ch := make(chan qmpReply, 1)
	q.pending[id] = ch
	q.mu.Unlock()

	msg := map[string]any{"execute": command, "id": id}
	if args != nil {
		msg["arguments"] = args
	}
	b, err := json.Marshal(msg)
	if err != nil {
		return nil, fmt.Errorf("encode qmp %s: %w", command, err)
	}
	q.writeMu.Lock()
	if oob != nil {
		_, _, err = q.conn.(*net.UnixConn).WriteMsgUnix(append(b, '\n'), oob, nil)
	} else {
		_, err = q.conn.Write(append(b, '\n'))
	}
	q.writeMu.Unlock()
	if err != nil {
		q.mu.Lock()
		delete(q.pending, id)
		q.mu.Unlock()
		return nil, fmt.Errorf("send qmp %s: %w", command, err)
	}
	select {
	case rep, ok := <-ch:
		if !ok {
			return nil, fmt.Errorf("qmp %s: %w", command, ErrQMPClosed)
		}
		if rep.Error != nil {
			rep.Error.Command = command
			return nil, rep.Error
		}
		return rep.Return, nil
	case <-ctx.Done():
		q.mu.Lock()
		delete(q.pending, id)
		q.mu.Unlock()
		return nil, fmt.Errorf("qmp %s: %w", command, ctx.Err())
	}
}

// Events returns the channel of asynchronous events. It is closed when the
// connection ends.
func (q *QMP) Events() <-chan Event { return q.events }

// Done is closed when the connection has ended.
func (q *QMP) Done() <-chan struct{} { return q.done }

// Close ends the connection.
func (q *QMP) Close() error { return q.conn.Close() }
