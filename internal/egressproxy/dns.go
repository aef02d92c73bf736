package egressproxy

import (
	"context"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"net/netip"
	"time"

	"golang.org/x/net/dns/dnsmessage"
)

// The guest's resolver: each query whose name the policy lets the guest
// reach is passed, as it came, to the node's resolvers (the first that
// answers wins); any other query is answered REFUSED without leaving the
// node, so a sandbox without internet access cannot talk to the world
// through DNS either.

// servePackets answers the UDP socket.
func (s *Sandbox) servePackets() {
	defer s.wg.Done()
	buf := make([]byte, 65535)
	for {
		n, from, err := s.cfg.DNSPacket.ReadFrom(buf)
		if err != nil {
			if s.ctx.Err() == nil && !errors.Is(err, net.ErrClosed) {
				s.cfg.Log.Warn("guest resolver read", "err", err)
			}
			return
		}
		q := append([]byte(nil), buf[:n]...)
		select {
		case s.queries <- struct{}{}:
		default:
			continue // too many in flight: the guest's resolver retries
		}
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			defer func() { <-s.queries }()
			if answer := s.answer(q, "udp"); answer != nil {
				_, _ = s.cfg.DNSPacket.WriteTo(answer, from)
			}
		}()
	}
}

// serveDNSStream answers one TCP connection (length-prefixed messages).
func (s *Sandbox) serveDNSStream(c net.Conn) {
	for {
		_ = c.SetReadDeadline(time.Now().Add(30 * time.Second))
		var size [2]byte
		if _, err := io.ReadFull(c, size[:]); err != nil {
			return
		}
		q := make([]byte, binary.BigEndian.Uint16(size[:]))
		if _, err := io.ReadFull(c, q); err != nil {
			return
		}
		answer := s.answer(q, "tcp")
		if answer == nil {
			return
		}
		out := binary.BigEndian.AppendUint16(nil, uint16(len(answer)))
		if _, err := c.Write(append(out, answer...)); err != nil {
			return
		}
	}
}

// answer returns the reply to a query (nil: none, for input that is not a
// query at all).
func (s *Sandbox) answer(q []byte, network string) []byte {
	var p dnsmessage.Parser
	h, err := p.Start(q)
	if err != nil || h.Response {
		return nil
	}
	question, err := p.Question()
	if err != nil {
		return refusal(h, nil)
	}
	pol := s.policy.Load()
	if !pol.AnyName && !pol.AllowsName(question.Name.String()) {
		return refusal(h, &question)
	}
	for _, r := range s.cfg.Resolvers {
		if a, err := forward(s.ctx, network, r, q); err == nil {
			return a
		}
	}
	return failure(h, &question, dnsmessage.RCodeServerFailure)
}

func refusal(h dnsmessage.Header, q *dnsmessage.Question) []byte {
	return failure(h, q, dnsmessage.RCodeRefused)
}

func failure(h dnsmessage.Header, q *dnsmessage.Question, code dnsmessage.RCode) []byte {
	b := dnsmessage.NewBuilder(nil, dnsmessage.Header{ID: h.ID, Response: true, OpCode: h.OpCode,
		RecursionDesired: h.RecursionDesired, RecursionAvailable: true, RCode: code})
	if q != nil {
		_ = b.StartQuestions()
		_ = b.Question(*q)
	}
	out, err := b.Finish()
	if err != nil {
		return nil
	}
	return out
}

// forward asks one resolver.
func forward(ctx context.Context, network string, r netip.AddrPort, q []byte) ([]byte, error) {
	ctx, cancel := context.WithTimeout(ctx, resolverTimeout)
	defer cancel()
	var d net.Dialer
	c, err := d.DialContext(ctx, network, r.String())
	if err != nil {
		return nil, err
	}
	defer c.Close()
	deadline, _ := ctx.Deadline()
	_ = c.SetDeadline(deadline)
	if network == "udp" {
		if _, err := c.Write(q); err != nil {
			return nil, err
		}
		buf := make([]byte, 65535)
		for {
			n, err := c.Read(buf)
			if err != nil {
				return nil, err
			}
			if n >= 12 && buf[0] == q[0] && buf[1] == q[1] {
				return buf[:n], nil
			}
		}
	}
	if _, err := c.Write(append(binary.BigEndian.AppendUint16(nil, uint16(len(q))), q...)); err != nil {
		return nil, err
	}
	var size [2]byte
	if _, err := io.ReadFull(c, size[:]); err != nil {
		return nil, err
	}
	a := make([]byte, binary.BigEndian.Uint16(size[:]))
	if _, err := io.ReadFull(c, a); err != nil {
		return nil, err
	}
	return a, nil
}
