// Package faultnet is a fault-injecting TCP proxy for tests: it sits between
// a client and a server (idem and its store, idem and its upstream, a client
// and idem) and loses replies, cuts connections, refuses new ones or pauses
// traffic, on command or at random, so that tests inject real network faults
// instead of mocking them away.
//
// A "reply" is what one read from the server side returns: for the small
// request/response exchanges of a database, Redis or an HTTP API on
// loopback, one reply. Dropping it means the server did the work and the
// client never hears of it; the connection is then cut both ways, as when a
// network path dies after the server answered.
package faultnet

import (
	mrand "math/rand/v2"
	"net"
	"sync"
	"sync/atomic"
	"time"
)

// Faults are the random faults a [Proxy] injects; the zero value injects none.
type Faults struct {
	// DropReply is the probability that a reply from the server is dropped
	// and its connection cut: the server acted, the client never knows.
	DropReply float64
	// DropRequest is the probability that a chunk from the client is
	// dropped and its connection cut before the server sees it.
	DropRequest float64
	// Refuse closes every new connection at once, as a server that is down.
	Refuse bool
	// Latency delays every chunk in both directions.
	Latency time.Duration
}

// Stats counts what a [Proxy] did.
type Stats struct {
	// Connections accepted, refused, and cut by a fault or by CutAll.
	Accepted, Refused, Cut int64
	// RepliesDropped and RequestsDropped count the chunks lost on purpose.
	RepliesDropped, RequestsDropped int64
	// Held counts the chunks waiting, right now, for a pause to end.
	Held int64
	// Dialing counts the connections accepted whose dial to the target is
	// under way, right now.
	Dialing int64
}

// Proxy forwards TCP connections from its own address to a target address.
type Proxy struct {
	ln     net.Listener
	target string

	mu        sync.Mutex
	faults    Faults
	dropNext  int // replies to drop deterministically, next first
	pauseGate chan struct{}
	conns     map[*link]struct{}
	rng       *mrand.Rand
	closed    bool

	accepted, refused, cut, repliesDropped, requestsDropped, held, dialing atomic.Int64
	wg                                                                     sync.WaitGroup
}

// link is one proxied connection: client side and server side.
type link struct {
	client, server net.Conn
	once           sync.Once
}

// close closes both sides, once; it reports whether this call closed them.
func (l *link) close() bool { return l.cut(nil) }

// cut is close that, when this call closes the link, counts it in counter
// first: whoever sees the connection end sees it counted.
func (l *link) cut(counter *atomic.Int64) (closed bool) {
	l.once.Do(func() {
		if counter != nil {
			counter.Add(1)
		}
		l.client.Close()
		l.server.Close()
		closed = true
	})
	return closed
}

// Listen starts a proxy to target on a free loopback port.
func Listen(target string) (*Proxy, error) {
	return ListenOn("127.0.0.1:0", target)
}

// ListenOn starts a proxy to target on addr.
func ListenOn(addr, target string) (*Proxy, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, err
	}
	p := &Proxy{ln: ln, target: target, conns: map[*link]struct{}{},
		rng: mrand.New(mrand.NewPCG(uint64(time.Now().UnixNano()), 1))}
	p.wg.Add(1)
	go p.accept()
	return p, nil
}

// Addr is the proxy's address, host:port.
func (p *Proxy) Addr() string { return p.ln.Addr().String() }

// Target is the address the proxy forwards to.
func (p *Proxy) Target() string { return p.target }

// SetFaults replaces the random faults.
func (p *Proxy) SetFaults(f Faults) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.faults = f
}

// DropNextReply drops the next reply from the server, on whichever
// connection it comes, and cuts that connection.
func (p *Proxy) DropNextReply() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.dropNext++
}

// CutAll closes every open connection at once, as a server restart or a
// killed backend does, and returns how many it cut.
func (p *Proxy) CutAll() int {
	p.mu.Lock()
	links := make([]*link, 0, len(p.conns))
	for l := range p.conns {
		links = append(links, l)
	}
	p.mu.Unlock()
	n := 0
	for _, l := range links {
		if l.cut(&p.cut) {
			n++
		}
	}
	return n
}

// Outage makes the target unreachable: open connections are cut, and new
// ones refused until the returned function is called, those accepted before
// it whose dial to the target was still under way included.
func (p *Proxy) Outage() (end func()) {
	p.mu.Lock()
	p.faults.Refuse = true
	p.mu.Unlock()
	p.CutAll()
	return func() {
		p.mu.Lock()
		p.faults.Refuse = false
		p.mu.Unlock()
	}
}

// Pause stops all traffic, both ways, on every connection, without closing
// anything (a network partition): bytes wait until the returned function is
// called. New connections are accepted but wait too.
func (p *Proxy) Pause() (resume func()) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.pauseGate == nil {
		p.pauseGate = make(chan struct{})
	}
	gate := p.pauseGate
	return func() {
		p.mu.Lock()
		defer p.mu.Unlock()
		if p.pauseGate == gate {
			close(gate)
			p.pauseGate = nil
		}
	}
}

// Stats returns the counts so far.
func (p *Proxy) Stats() Stats {
	return Stats{Accepted: p.accepted.Load(), Refused: p.refused.Load(), Cut: p.cut.Load(),
		RepliesDropped: p.repliesDropped.Load(), RequestsDropped: p.requestsDropped.Load(), Held: p.held.Load(), Dialing: p.dialing.Load()}
}

// Close stops listening and cuts every connection.
func (p *Proxy) Close() error {
	p.mu.Lock()
	p.closed = true
	p.mu.Unlock()
	err := p.ln.Close()
	p.CutAll()
	p.wg.Wait()
	return err
}

func (p *Proxy) accept() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		p.mu.Lock()
		refuse := p.faults.Refuse || p.closed
		p.mu.Unlock()
		if refuse {
			p.refuse(c)
			continue
		}
		p.wg.Add(1)
		go p.serve(c)
	}
}

// refuse closes a client's connection with a reset, as a closed port does,
// and counts it refused.
func (p *Proxy) refuse(c net.Conn) {
	p.refused.Add(1)
	if tc, ok := c.(*net.TCPConn); ok {
		tc.SetLinger(0)
	}
	c.Close()
}

func (p *Proxy) serve(client net.Conn) {
	defer p.wg.Done()
	p.dialing.Add(1)
	server, err := net.DialTimeout("tcp", p.target, 5*time.Second)
	p.dialing.Add(-1)
	if err != nil {
		p.refused.Add(1)
		client.Close()
		return
	}
	l := &link{client: client, server: server}
	// An outage (or Close) that began while the dial was under way found no
	// link to cut: the connection is refused now, as it would have been
	// had it come a moment later. Checked under mu, with the registration,
	// so that CutAll either finds the link or the link sees the outage.
	p.mu.Lock()
	if p.closed || p.faults.Refuse {
		p.mu.Unlock()
		server.Close()
		p.refuse(client)
		return
	}
	p.conns[l] = struct{}{}
	p.mu.Unlock()
	p.accepted.Add(1)
	defer func() {
		p.mu.Lock()
		delete(p.conns, l)
		p.mu.Unlock()
		l.close()
	}()
	done := make(chan struct{}, 2)
	go func() { p.pipe(l, client, server, true); done <- struct{}{} }()
	go func() { p.pipe(l, server, client, false); done <- struct{}{} }()
	<-done
	l.close()
	<-done
}

// pipe copies from src to dst, chunk by chunk, injecting faults. reply is
// true for the server-to-client direction.
func (p *Proxy) pipe(l *link, dst, src net.Conn, reply bool) {
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			drop, latency, gate := p.decide(reply)
			if gate != nil {
				p.held.Add(1)
				<-gate
				p.held.Add(-1)
			}
			if latency > 0 {
				time.Sleep(latency)
			}
			if drop {
				l.cut(&p.cut)
				return
			}
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return // either side closing ends the link
		}
	}
}

// decide says what to do with one chunk: drop it (and cut), delay it, or
// wait on a pause gate first.
func (p *Proxy) decide(reply bool) (drop bool, latency time.Duration, gate chan struct{}) {
	p.mu.Lock()
	defer p.mu.Unlock()
	gate, latency = p.pauseGate, p.faults.Latency
	if reply {
		if p.dropNext > 0 {
			p.dropNext--
			p.repliesDropped.Add(1)
			return true, latency, gate
		}
		if p.faults.DropReply > 0 && p.rng.Float64() < p.faults.DropReply {
			p.repliesDropped.Add(1)
			return true, latency, gate
		}
		return false, latency, gate
	}
	if p.faults.DropRequest > 0 && p.rng.Float64() < p.faults.DropRequest {
		p.requestsDropped.Add(1)
		return true, latency, gate
	}
	return false, latency, gate
}
