package testkit

import (
	"errors"
	"net"
	"os/exec"
	"strconv"
	"testing"
	"time"

	"github.com/idemhq/idem/internal/wait"
)

// FreePort returns a TCP port on loopback that nothing listens on (now).
func FreePort(tb testing.TB) string {
	tb.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	defer ln.Close()
	return strconv.Itoa(ln.Addr().(*net.TCPAddr).Port)
}

// ClusterPort returns a TCP port on loopback for a Redis Cluster node: free
// (now), at most 55535, with its cluster bus port (10000 higher) free too.
// (A node on a higher port does not start.)
func ClusterPort() (string, error) {
	for range 100 {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return "", err
		}
		port := ln.Addr().(*net.TCPAddr).Port
		ln.Close()
		if port <= 55535 {
			if bus, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(port+10000)); err == nil {
				bus.Close()
				return strconv.Itoa(port), nil
			}
		}
	}
	return "", errors.New("testkit: no free port under 55535 with a free bus port")
}

// StartRedis runs a Redis server of the test's own on port of loopback,
// without persistence, for a test that changes the server's settings or
// stops it, with the extra arguments args (settings CONFIG SET cannot
// change, such as cluster-enabled); it is killed when the test ends. The
// test is skipped, as every Redis test is, without IDEM_TEST_REDIS_URL.
func StartRedis(tb testing.TB, port string, args ...string) *exec.Cmd {
	tb.Helper()
	Server(tb, "IDEM_TEST_REDIS_URL")
	cmd := exec.Command("redis-server", append([]string{"--port", port, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
		"--dir", tb.TempDir()}, args...)...)
	if err := cmd.Start(); err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	wait.Until(tb, 10*time.Second, "redis-server to listen", func() bool {
		c, err := net.Dial("tcp", "127.0.0.1:"+port)
		if err == nil {
			c.Close()
		}
		return err == nil
	})
	return cmd
}
