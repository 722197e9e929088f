package memcachedstore

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/bradfitz/gomemcache/memcache"
	"github.com/idemhq/idem/internal/testkit"
)

func TestMain(m *testing.M) { testkit.Main(m) }

// testAddr returns IDEM_TEST_MEMCACHED_ADDR, or skips.
func testAddr(tb testing.TB) string {
	tb.Helper()
	return testkit.Server(tb, "IDEM_TEST_MEMCACHED_ADDR")
}

var shared struct {
	once   sync.Once
	client *memcache.Client
}

// testClient returns a client shared by the tests, or skips. The suite races
// 200 goroutines on one key, several cases at once, on a 2-CPU machine under
// the race detector: the client keeps enough idle connections for that and
// waits longer than its 500 ms default.
func testClient(tb testing.TB) *memcache.Client {
	tb.Helper()
	addr := testAddr(tb)
	shared.once.Do(func() {
		shared.client = memcache.New(addr)
		shared.client.MaxIdleConns = 256
		shared.client.Timeout = 10 * time.Second
	})
	return shared.client
}

// counter counts round trips: a connection's writes that follow a read (or
// open it) are one request, however many Write calls it takes, and its
// answer is read before the next one is sent.
type counter struct{ n atomic.Int64 }

type countingConn struct {
	net.Conn
	n       *atomic.Int64
	writing bool // the conn is used by one goroutine at a time
}

func (c *countingConn) Write(b []byte) (int, error) {
	if !c.writing {
		c.writing = true
		c.n.Add(1)
	}
	return c.Conn.Write(b)
}

func (c *countingConn) Read(b []byte) (int, error) {
	c.writing = false
	return c.Conn.Read(b)
}

// countingClient returns a client of its own whose connections count the
// round trips they make.
func countingClient(tb testing.TB) (*memcache.Client, *counter) {
	tb.Helper()
	addr := testAddr(tb)
	cnt := &counter{}
	c := memcache.New(addr)
	c.Timeout = 10 * time.Second
	c.MaxIdleConns = 8
	c.DialContext = func(ctx context.Context, network, address string) (net.Conn, error) {
		var d net.Dialer
		nc, err := d.DialContext(ctx, network, address)
		if err != nil {
			return nil, err
		}
		return &countingConn{Conn: nc, n: &cnt.n}, nil
	}
	tb.Cleanup(func() { c.Close() })
	return c, cnt
}

// randomPrefix returns a prefix no other test uses.
func randomPrefix(tb testing.TB) string {
	var b [8]byte
	if _, err := rand.Read(b[:]); err != nil {
		tb.Fatal(err)
	}
	return "idemtest-" + hex.EncodeToString(b[:])
}

// newTestStore returns a store of cfg under a fresh prefix, whose List dumps
// the test server unless cfg names Servers. When the test ends, it deletes
// the indexes and the records they name; settled records expire by
// themselves.
func newTestStore(tb testing.TB, client *memcache.Client, cfg Config) *Store {
	tb.Helper()
	cfg.Client = client
	if cfg.Servers == nil {
		cfg.Servers = []string{testAddr(tb)}
	}
	if cfg.Prefix == "" {
		cfg.Prefix = randomPrefix(tb)
	}
	s, err := New(cfg)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() {
		for _, key := range s.indexKeys {
			it, err := client.Get(key)
			if err != nil {
				continue
			}
			if set, err := parseIndex(it.Value); err == nil {
				for _, h := range set.hashes() {
					_ = client.Delete(s.recordKey(h))
				}
			}
			_ = client.Delete(key)
		}
	})
	return s
}

// metaTTL asks the server, with the meta command "mg <key> t", for the
// seconds an item has left: -1 when it never expires, -2 when it is not
// there. gomemcache cannot read an item's expiration.
func metaTTL(t *testing.T, key string) int {
	t.Helper()
	nc, err := net.DialTimeout("tcp", testAddr(t), 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	_ = nc.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := fmt.Fprintf(nc, "mg %s t\r\n", key); err != nil {
		t.Fatal(err)
	}
	line, err := bufio.NewReader(nc).ReadString('\n')
	if err != nil {
		t.Fatal(err)
	}
	line = strings.TrimSuffix(line, "\r\n")
	if line == "EN" {
		return -2
	}
	ttl, ok := strings.CutPrefix(line, "HD t")
	if !ok {
		t.Fatalf("mg %s t: %q", key, line)
	}
	n, err := strconv.Atoi(ttl)
	if err != nil {
		t.Fatalf("mg %s t: %q", key, line)
	}
	return n
}

// indexOf returns the folded index of a shard as the server holds it (nil
// when there is none).
func indexOf(t *testing.T, s *Store, shard int) indexSet {
	t.Helper()
	it, err := s.client.Get(s.indexKeys[shard])
	if err == memcache.ErrCacheMiss {
		return nil
	}
	if err != nil {
		t.Fatal(err)
	}
	set, err := parseIndex(it.Value)
	if err != nil {
		t.Fatal(err)
	}
	return set
}

// indexed reports whether the folded index holds an entry of scope and key.
func indexed(t *testing.T, s *Store, scope, key string) bool {
	t.Helper()
	h := recordHash(scope, key)
	for e := range indexOf(t, s, s.shard(h)) {
		if e.h == h {
			return true
		}
	}
	return false
}

var t0 = time.Date(2030, 1, 2, 3, 4, 5, 6e6, time.UTC)

// closedPort returns a local TCP address nothing listens on.
func closedPort(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	return addr
}
