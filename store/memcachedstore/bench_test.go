package memcachedstore

import (
	"strconv"
	"testing"
	"time"

	"github.com/bradfitz/gomemcache/memcache"
	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/testkit"
	"github.com/idemhq/idem/store/storetest"
)

// The benchmarks run one operation at a time on one connection, so ns/op is
// the latency of an operation, round trips included. Each reports its round
// trips per operation as its connections counted them.

// warmUp creates the index of every shard, so that the first acquire of a
// shard does not pay for creating it, and opens the client's connection.
func warmUp(b *testing.B, s *Store) {
	b.Helper()
	for _, key := range s.indexKeys {
		if err := s.client.Add(&memcache.Item{Key: key, Value: nil}); err != nil && err != memcache.ErrNotStored {
			b.Fatal(err)
		}
	}
}

// BenchmarkAcquireComplete: Acquire of a fresh key, then Finish as
// COMPLETED — what a request that runs costs.
func BenchmarkAcquireComplete(b *testing.B) {
	client, cnt := countingClient(b)
	s := newTestStore(b, client, Config{})
	warmUp(b, s)
	storetest.BenchAcquireComplete(b, s, cnt.n.Load)
}

// BenchmarkReplay: Acquire of a completed key — what a retry that replays
// costs.
func BenchmarkReplay(b *testing.B) {
	client, cnt := countingClient(b)
	s := newTestStore(b, client, Config{})
	warmUp(b, s)
	storetest.BenchReplay(b, s, cnt.n.Load)
}

// BenchmarkRawAddSet: the bare client calls of a hand-made check, add to
// claim a key and set to store the outcome.
func BenchmarkRawAddSet(b *testing.B) {
	client, cnt := countingClient(b)
	s := newTestStore(b, client, Config{})
	value, err := testkit.BenchResponse().MarshalBinary()
	if err != nil {
		b.Fatal(err)
	}
	base := s.prefix + ":raw:"
	written := 0
	b.Cleanup(func() {
		for j := range written {
			_ = client.Delete(base + strconv.Itoa(j))
		}
	})
	exp := int32(idem.DefaultRetention / time.Second)
	testkit.Measure(b, cnt.n.Load, func(i int) {
		key := base + strconv.Itoa(i)
		written = i + 1
		if err := client.Add(&memcache.Item{Key: key, Value: []byte("in_progress")}); err != nil {
			b.Fatalf("add: %v", err)
		}
		if err := client.Set(&memcache.Item{Key: key, Value: value, Expiration: exp}); err != nil {
			b.Fatalf("set: %v", err)
		}
	})
}

// BenchmarkRawGet: a bare get of a stored outcome.
func BenchmarkRawGet(b *testing.B) {
	client, cnt := countingClient(b)
	s := newTestStore(b, client, Config{})
	value, err := testkit.BenchResponse().MarshalBinary()
	if err != nil {
		b.Fatal(err)
	}
	key := s.prefix + ":raw"
	if err := client.Set(&memcache.Item{Key: key, Value: value, Expiration: 3600}); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = client.Delete(key) })
	testkit.Measure(b, cnt.n.Load, func(int) {
		it, err := client.Get(key)
		if err != nil || len(it.Value) != len(value) {
			b.Fatalf("get: %v", err)
		}
	})
}
