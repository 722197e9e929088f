package memcachedstore

import (
	"context"
	"errors"
	"net"
	"net/http"
	"net/http/httptest"
	"os/exec"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/bradfitz/gomemcache/memcache"
	"github.com/idemhq/idem"
	"github.com/idemhq/idem/httpidem"
	"github.com/idemhq/idem/internal/testkit"
	"github.com/idemhq/idem/internal/wait"
	"github.com/idemhq/idem/store"
	"github.com/idemhq/idem/store/memstore"
)

// startFullMemcached runs a memcached of the test's own on a free port of
// loopback, with -M (a write it has no room for is answered with an error,
// nothing is evicted) and 2 MiB of memory, and returns its address. It is
// killed when the test ends. The test is skipped, as every memcached test
// is, without IDEM_TEST_MEMCACHED_ADDR.
func startFullMemcached(t *testing.T) string {
	t.Helper()
	testAddr(t)
	port := testkit.FreePort(t)
	cmd := exec.Command("memcached", "-l", "127.0.0.1", "-p", port, "-u", "root", "-M", "-m", "2")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	addr := "127.0.0.1:" + port
	wait.Until(t, 5*time.Second, "memcached to listen", func() bool {
		c, err := net.Dial("tcp", addr)
		if err == nil {
			c.Close()
		}
		return err == nil
	})
	return addr
}

// fill sets items of n bytes until memcached answers that it is out of
// memory (which it does under -M instead of evicting), and returns their
// keys.
func fill(t *testing.T, c *memcache.Client, n int) []string {
	t.Helper()
	v := make([]byte, n)
	var keys []string
	for i := 0; ; i++ {
		key := "filler-" + strconv.Itoa(n) + "-" + strconv.Itoa(i)
		err := c.Set(&memcache.Item{Key: key, Value: v})
		if err != nil {
			if strings.Contains(err.Error(), "out of memory") {
				return keys
			}
			t.Fatalf("filling: %v", err)
		}
		keys = append(keys, key)
		if i > 1e6 {
			t.Fatal("memcached never ran out of memory")
		}
	}
}

// TestOutOfMemoryIsRefused: a memcached run with -M, as the package
// documentation advises, answers a write it has no room for with
// "SERVER_ERROR out of memory storing object". A retry of a request whose
// owner crashed (in progress, its lease run out) reads the record, and the
// compare-and-swap that marks it UNKNOWN is refused so: memcached was
// reached and holds the record, which is ErrRefused (it was plain
// ErrUnavailable, a reason to fail open).
func TestOutOfMemoryIsRefused(t *testing.T) {
	ctx := context.Background()
	addr := startFullMemcached(t)
	client := memcache.New(addr)
	client.Timeout = 5 * time.Second
	s := newTestStore(t, client, Config{Servers: []string{addr}})
	now := time.Now()
	r, err := s.Acquire(ctx, store.AcquireParams{Key: "abandoned", Fingerprint: "fp", Token: "crashed",
		Now: now.Add(-2 * time.Minute), LeaseExpires: now.Add(-time.Minute)})
	if err != nil {
		t.Fatal(err)
	}
	it, err := client.Get(s.recordKey(recordHash(r.Scope, r.Key)))
	if err != nil {
		t.Fatal(err)
	}
	fill(t, client, len(it.Value))
	_, err = s.Acquire(ctx, store.AcquireParams{Key: "abandoned", Fingerprint: "fp", Token: "retry",
		Now: now, LeaseExpires: now.Add(time.Minute)})
	if !errors.Is(err, store.ErrUnavailable) || !errors.Is(err, store.ErrRefused) {
		t.Fatalf("acquire of an abandoned record on a memcached out of memory: %v; want ErrUnavailable and ErrRefused", err)
	}
}

// TestOutOfMemoryIsNoReasonToFailOpen is TestOutOfMemoryIsRefused through
// the middleware: with fail_open, the retry of a request whose owner
// crashed is answered 503 while memcached is out of memory, and is not run
// (it ran again: a second charge); once memcached has room, the record is
// marked UNKNOWN (409), and the request still does not run.
func TestOutOfMemoryIsNoReasonToFailOpen(t *testing.T) {
	ctx := context.Background()
	addr := startFullMemcached(t)
	client := memcache.New(addr)
	client.Timeout = 5 * time.Second
	s := newTestStore(t, client, Config{Servers: []string{addr}})
	var runs atomic.Int64
	charge := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		w.WriteHeader(http.StatusCreated)
	})
	post := func(st idem.Store, key string) int {
		eng, err := idem.New(idem.Config{Store: st, StoreTimeout: 500 * time.Millisecond, CacheSize: -1})
		if err != nil {
			t.Fatal(err)
		}
		mw, err := httpidem.New(httpidem.Config{Engine: eng, FailOpen: true})
		if err != nil {
			t.Fatal(err)
		}
		w := httptest.NewRecorder()
		r := httptest.NewRequest("POST", "/charges", strings.NewReader(`{"amount":1}`))
		r.Header.Set("Idempotency-Key", key)
		mw.Wrap(charge).ServeHTTP(w, r)
		return w.Code
	}
	// The record a crashed owner leaves: in progress, its lease run out,
	// with the request's fingerprint (as a store of the test's own takes it).
	probe := memstore.New()
	post(probe, "charge-1")
	rec, err := probe.Get(ctx, store.GetParams{Key: "charge-1", Now: time.Now()})
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	if _, err := s.Acquire(ctx, store.AcquireParams{Scope: rec.Scope, Key: rec.Key, Fingerprint: rec.Fingerprint, Token: "crashed",
		Now: now.Add(-2 * time.Minute), LeaseExpires: now.Add(-time.Minute)}); err != nil {
		t.Fatal(err)
	}
	it, err := client.Get(s.recordKey(recordHash(rec.Scope, rec.Key)))
	if err != nil {
		t.Fatal(err)
	}
	fillers := fill(t, client, len(it.Value))
	runs.Store(0)
	if status := post(s, "charge-1"); status != http.StatusServiceUnavailable || runs.Load() != 0 {
		t.Fatalf("a retry while memcached is out of memory: %d after %d runs; want 503, no run", status, runs.Load())
	}
	for _, key := range fillers[:min(16, len(fillers))] { // room for the record again
		if err := client.Delete(key); err != nil {
			t.Fatal(err)
		}
	}
	if status := post(s, "charge-1"); status != http.StatusConflict || runs.Load() != 0 {
		t.Fatalf("the retry once memcached has room: %d after %d runs; want 409 (unknown), no run", status, runs.Load())
	}
}
