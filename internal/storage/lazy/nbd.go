// Package lazy serves disk layers to QEMU on demand: a read-only userspace
// NBD server (QEMU connects over a unix socket, no kernel module) whose
// exports read content-addressed chunks through a size-bounded local cache
// with LRU eviction, fetching missing chunks from the repository and
// verifying each one's SHA-256.
package lazy

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"sync"
)

// Export is a read-only disk image the server offers under a name.
type Export interface {
	Size() int64
	// ReadAt fills p from offset off (never past Size).
	ReadAt(ctx context.Context, p []byte, off int64) error
}

// Protocol constants (the NBD protocol, fixed newstyle negotiation).
const (
	nbdMagic          = 0x4e42444d41474943 // "NBDMAGIC"
	nbdOptMagic       = 0x49484156454f5054 // "IHAVEOPT"
	nbdRepMagic       = 0x3e889045565a9
	nbdRequestMagic   = 0x25609513
	nbdSimpleMagic    = 0x67446698
	flagFixedNewstyle = 1 << 0
	flagNoZeroes      = 1 << 1

	optExportName = 1
	optAbort      = 2
	optList       = 3
	optInfo       = 6
	optGo         = 7

	repAck         = 1
	repServer      = 2
	repInfo        = 3
	repErrUnsup    = 0x80000001
	repErrInvalid  = 0x80000003
	repErrUnknown  = 0x80000006
	infoExport     = 0
	infoBlockSize  = 3
	transHasFlags  = 1 << 0
	transReadOnly  = 1 << 1
	transSendFlush = 1 << 2
	transCanMulti  = 1 << 8

	cmdRead  = 0
	cmdWrite = 1
	cmdDisc  = 2
	cmdFlush = 3
	cmdTrim  = 4

	errPerm  = 1
	errIO    = 5
	errInval = 22

	maxRequest = 32 << 20
)

// Server is an NBD server over a unix socket.
type Server struct {
	mu      sync.Mutex
	exports map[string]Export
	ln      net.Listener
	log     *slog.Logger
	wg      sync.WaitGroup
	conns   map[net.Conn]struct{}
	closed  bool
}

// Listen starts a server on the unix socket path.
func Listen(path string, log *slog.Logger) (*Server, error) {
	if log == nil {
		log = slog.Default()
	}
	ln, err := net.Listen("unix", path)
	if err != nil {
		return nil, err
	}
	s := &Server{exports: map[string]Export{}, ln: ln, log: log, conns: map[net.Conn]struct{}{}}
	s.wg.Add(1)
	go s.accept()
	return s, nil
}

// Add offers an export under name (replacing one of the same name).
func (s *Server) Add(name string, e Export) {
	s.mu.Lock()
	s.exports[name] = e
	s.mu.Unlock()
}

// Remove stops offering name to new connections.
func (s *Server) Remove(name string) {
	s.mu.Lock()
	delete(s.exports, name)
	s.mu.Unlock()
}

// Close stops the server and its connections.
func (s *Server) Close() error {
	s.mu.Lock()
	s.closed = true
	for c := range s.conns {
		c.Close()
	}
	s.mu.Unlock()
	err := s.ln.Close()
	s.wg.Wait()
	return err
}

func (s *Server) accept() {
	defer s.wg.Done()
	for {
		c, err := s.ln.Accept()
		if err != nil {
			return
		}
		s.mu.Lock()
		if s.closed {
			s.mu.Unlock()
			c.Close()
			return
		}
		s.conns[c] = struct{}{}
		s.mu.Unlock()
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			if err := s.serve(c); err != nil && !errors.Is(err, io.EOF) && !errors.Is(err, net.ErrClosed) {
				s.log.Warn("nbd connection ended", "err", err)
			}
			s.mu.Lock()
			delete(s.conns, c)
			s.mu.Unlock()
			c.Close()
		}()
	}
}

type conn struct {
	r *bufio.Reader
	w *bufio.Writer
}

func (c *conn) u16() (uint16, error) {
	var b [2]byte
	_, err := io.ReadFull(c.r, b[:])
	return binary.BigEndian.Uint16(b[:]), err
}

func (c *conn) u32() (uint32, error) {
	var b [4]byte
	_, err := io.ReadFull(c.r, b[:])
	return binary.BigEndian.Uint32(b[:]), err
}

func (c *conn) u64() (uint64, error) {
	var b [8]byte
	_, err := io.ReadFull(c.r, b[:])
	return binary.BigEndian.Uint64(b[:]), err
}

func (c *conn) put(vals ...any) {
	for _, v := range vals {
		_ = binary.Write(c.w, binary.BigEndian, v)
	}
}

func (c *conn) reply(opt, typ uint32, data []byte) error {
	c.put(uint64(nbdRepMagic), opt, typ, uint32(len(data)))
	c.w.Write(data)
	return c.w.Flush()
}

func (s *Server) serve(nc net.Conn) error {
	c := &conn{r: bufio.NewReaderSize(nc, 64<<10), w: bufio.NewWriterSize(nc, 64<<10)}
	c.put(uint64(nbdMagic), uint64(nbdOptMagic), uint16(flagFixedNewstyle|flagNoZeroes))
	if err := c.w.Flush(); err != nil {
		return err
	}
	clientFlags, err := c.u32()
	if err != nil {
		return err
	}
	if clientFlags&flagFixedNewstyle == 0 {
		return errors.New("client does not speak fixed newstyle")
	}
	noZeroes := clientFlags&flagNoZeroes != 0
	for {
		magic, err := c.u64()
		if err != nil {
			return err
		}
		if magic != nbdOptMagic {
			return fmt.Errorf("bad option magic %#x", magic)
		}
		opt, err := c.u32()
		if err != nil {
			return err
		}
		n, err := c.u32()
		if err != nil {
			return err
		}
		if n > 64<<10 {
			return fmt.Errorf("option %d too long (%d)", opt, n)
		}
		data := make([]byte, n)
		if _, err := io.ReadFull(c.r, data); err != nil {
			return err
		}
		switch opt {
		case optExportName:
			e := s.export(string(data))
			if e == nil {
				return fmt.Errorf("unknown export %q", data)
			}
			c.put(uint64(e.Size()), uint16(transHasFlags|transReadOnly|transSendFlush|transCanMulti))
			if !noZeroes {
				c.w.Write(make([]byte, 124))
			}
			if err := c.w.Flush(); err != nil {
				return err
			}
			return s.transmit(c, e)
		case optAbort:
			_ = c.reply(opt, repAck, nil)
			return nil
		case optList:
			s.mu.Lock()
			var names []string
			for name := range s.exports {
				names = append(names, name)
			}
			s.mu.Unlock()
			for _, name := range names {
				b := binary.BigEndian.AppendUint32(nil, uint32(len(name)))
				if err := c.reply(opt, repServer, append(b, name...)); err != nil {
					return err
				}
			}
			if err := c.reply(opt, repAck, nil); err != nil {
				return err
			}
		case optInfo, optGo:
			if len(data) < 6 {
				if err := c.reply(opt, repErrInvalid, nil); err != nil {
					return err
				}
				continue
			}
			nameLen := binary.BigEndian.Uint32(data)
			if uint64(nameLen)+6 > uint64(len(data)) {
				if err := c.reply(opt, repErrInvalid, nil); err != nil {
					return err
				}
				continue
			}
			e := s.export(string(data[4 : 4+nameLen]))
			if e == nil {
				if err := c.reply(opt, repErrUnknown, []byte("no such export")); err != nil {
					return err
				}
				continue
			}
			info := binary.BigEndian.AppendUint16(nil, infoExport)
			info = binary.BigEndian.AppendUint64(info, uint64(e.Size()))
			info = binary.BigEndian.AppendUint16(info, transHasFlags|transReadOnly|transSendFlush|transCanMulti)
			if err := c.reply(opt, repInfo, info); err != nil {
				return err
			}
			bs := binary.BigEndian.AppendUint16(nil, infoBlockSize)
			bs = binary.BigEndian.AppendUint32(bs, 1)
			bs = binary.BigEndian.AppendUint32(bs, 4096)
			bs = binary.BigEndian.AppendUint32(bs, maxRequest)
			if err := c.reply(opt, repInfo, bs); err != nil {
				return err
			}
			if err := c.reply(opt, repAck, nil); err != nil {
				return err
			}
			if opt == optGo {
				return s.transmit(c, e)
			}
		default:
			// Structured replies, metadata contexts, TLS...: not offered.
			if err := c.reply(opt, repErrUnsup, nil); err != nil {
				return err
			}
		}
	}
}

func (s *Server) export(name string) Export {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.exports[name]
}

// transmit serves requests one at a time, in order.
func (s *Server) transmit(c *conn, e Export) error {
	ctx := context.Background()
	buf := make([]byte, 0, 1<<20)
	for {
		magic, err := c.u32()
		if err != nil {
			return err
		}
		if magic != nbdRequestMagic {
			return fmt.Errorf("bad request magic %#x", magic)
		}
		if _, err := c.u16(); err != nil { // command flags
			return err
		}
		typ, err := c.u16()
		if err != nil {
			return err
		}
		handle, err := c.u64()
		if err != nil {
			return err
		}
		off, err := c.u64()
		if err != nil {
			return err
		}
		n, err := c.u32()
		if err != nil {
			return err
		}
		simple := func(errno uint32) {
			c.put(uint32(nbdSimpleMagic), errno, handle)
		}
		switch typ {
		case cmdRead:
			if n > maxRequest || off+uint64(n) > uint64(e.Size()) {
				simple(errInval)
				break
			}
			if cap(buf) < int(n) {
				buf = make([]byte, n)
			}
			p := buf[:n]
			if err := e.ReadAt(ctx, p, int64(off)); err != nil {
				s.log.Error("nbd read failed", "offset", off, "length", n, "err", err)
				simple(errIO)
				break
			}
			simple(0)
			c.w.Write(p)
		case cmdWrite:
			// Read-only: swallow the payload, refuse.
			if _, err := io.CopyN(io.Discard, c.r, int64(n)); err != nil {
				return err
			}
			simple(errPerm)
		case cmdTrim:
			simple(errPerm)
		case cmdFlush:
			simple(0)
		case cmdDisc:
			return c.w.Flush()
		default:
			simple(errInval)
		}
		if err := c.w.Flush(); err != nil {
			return err
		}
	}
}
