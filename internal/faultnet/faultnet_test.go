package faultnet_test

import (
	"bufio"
	"errors"
	"io"
	"net"
	"os"
	"syscall"
	"testing"
	"time"

	"github.com/idemhq/idem/internal/faultnet"
	"github.com/idemhq/idem/internal/wait"
)

// echoServer answers every line with the same line and counts the lines it got.
func echoServer(t *testing.T) (string, <-chan string) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	got := make(chan string, 100)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				r := bufio.NewReader(c)
				for {
					line, err := r.ReadString('\n')
					if err != nil {
						return
					}
					got <- line
					c.Write([]byte(line))
				}
			}()
		}
	}()
	return ln.Addr().String(), got
}

func proxy(t *testing.T, target string) *faultnet.Proxy {
	p, err := faultnet.Listen(target)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return p
}

func roundTrip(c net.Conn, line string) (string, error) {
	c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Write([]byte(line)); err != nil {
		return "", err
	}
	return bufio.NewReader(c).ReadString('\n')
}

func TestDropNextReplyLosesOnlyTheReply(t *testing.T) {
	target, got := echoServer(t)
	p := proxy(t, target)
	c, err := net.Dial("tcp", p.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if reply, err := roundTrip(c, "one\n"); err != nil || reply != "one\n" {
		t.Fatalf("first exchange: %q, %v", reply, err)
	}
	wait.Recv(t, got, 5*time.Second, "the server to get the first line")
	p.DropNextReply()
	if reply, err := roundTrip(c, "two\n"); !errors.Is(err, io.EOF) {
		t.Fatalf("after DropNextReply got %q, %v; want EOF", reply, err)
	}
	if line := wait.Recv(t, got, 5*time.Second, "the server to get the line whose reply was lost"); line != "two\n" {
		t.Fatalf("server got %q", line)
	}
	if s := p.Stats(); s.RepliesDropped != 1 || s.Cut != 1 {
		t.Fatalf("stats %+v", s)
	}
}

func TestOutageRefusesThenRecovers(t *testing.T) {
	target, _ := echoServer(t)
	p := proxy(t, target)
	open, err := net.Dial("tcp", p.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer open.Close()
	if _, err := roundTrip(open, "x\n"); err != nil {
		t.Fatal(err)
	}
	end := p.Outage()
	if _, err := roundTrip(open, "y\n"); err == nil {
		t.Fatal("an open connection survived the outage")
	}
	if c, err := net.Dial("tcp", p.Addr()); err == nil {
		_, err = roundTrip(c, "z\n")
		c.Close()
		if err == nil {
			t.Fatal("a new connection got through during the outage")
		}
	}
	end()
	c, err := net.Dial("tcp", p.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if reply, err := roundTrip(c, "back\n"); err != nil || reply != "back\n" {
		t.Fatalf("after the outage: %q, %v", reply, err)
	}
}

func TestPauseHoldsBytesUntilResumed(t *testing.T) {
	target, got := echoServer(t)
	p := proxy(t, target)
	c, err := net.Dial("tcp", p.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	resume := p.Pause()
	c.Write([]byte("held\n"))
	wait.Until(t, 5*time.Second, "the line to be held", func() bool { return p.Stats().Held == 1 })
	if len(got) != 0 {
		t.Fatalf("the server got %q while paused", <-got)
	}
	resume()
	if line := wait.Recv(t, got, 5*time.Second, "the held line after resume"); line != "held\n" {
		t.Fatalf("got %q", line)
	}
}

func TestCutAllReportsWhatItCut(t *testing.T) {
	target, _ := echoServer(t)
	p := proxy(t, target)
	if n := p.CutAll(); n != 0 {
		t.Fatalf("CutAll with no connection open: want 0 cut, got %d", n)
	}
	for range 2 {
		c, err := net.Dial("tcp", p.Addr())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		if _, err := roundTrip(c, "x\n"); err != nil {
			t.Fatal(err)
		}
	}
	if n := p.CutAll(); n != 2 {
		t.Fatalf("CutAll with two connections open: want 2 cut, got %d", n)
	}
	if n := p.CutAll(); n != 0 {
		t.Fatalf("CutAll again: want 0 cut (they are closed already), got %d", n)
	}
	if s := p.Stats(); s.Cut != 2 {
		t.Fatalf("want Stats().Cut 2, got %+v", s)
	}
}

// slowTarget is a listener whose accept queue holds one connection
// (backlog 0): once it is filled, a dial to it waits on SYN retransmits
// until the queue is drained, as a loaded server's does.
func slowTarget(t *testing.T) net.Listener {
	fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM, 0)
	if err != nil {
		t.Fatal(err)
	}
	if err := syscall.Bind(fd, &syscall.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Listen(fd, 0); err != nil {
		t.Fatal(err)
	}
	f := os.NewFile(uintptr(fd), "slow-target")
	ln, err := net.FileListener(f)
	f.Close()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	return ln
}

// A connection the proxy accepted just before an outage, whose dial to the
// target was still under way, must not carry traffic during the outage:
// "open connections are cut and new ones refused".
func TestOutageCutsAConnectionStillDialing(t *testing.T) {
	ln := slowTarget(t)
	// Fill the target's accept queue so that the proxy's dial waits.
	filler, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer filler.Close()
	p := proxy(t, ln.Addr().String())
	c, err := net.Dial("tcp", p.Addr()) // accepted before the outage
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	wait.Until(t, 5*time.Second, "the proxy to accept the connection and dial the target", func() bool { return p.Stats().Dialing == 1 })
	end := p.Outage()
	defer end()
	// The target drains its queue and serves (an echo) while the outage lasts.
	go func() {
		for {
			s, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer s.Close()
				line, err := bufio.NewReader(s).ReadString('\n')
				if err == nil {
					s.Write([]byte(line))
				}
			}()
		}
	}()
	if reply, err := roundTrip(c, "during the outage\n"); err == nil {
		t.Fatalf("a connection went through to the target during the outage: got %q back (stats %+v)", reply, p.Stats())
	}
}
