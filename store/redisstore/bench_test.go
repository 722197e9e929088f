package redisstore

import (
	"context"
	"strconv"
	"testing"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/testkit"
	"github.com/idemhq/idem/store/storetest"
)

// The benchmarks run one operation at a time on one connection, so ns/op is
// the latency of an operation, round trips included. Each reports its round
// trips per operation as counted by a client hook.

// BenchmarkAcquireComplete: Acquire of a fresh key, then Finish as
// COMPLETED — what a request that runs costs.
func BenchmarkAcquireComplete(b *testing.B) {
	client, hook := countingClient(b)
	s := newTestStore(b, client, 0)
	warmUp(b, s)
	storetest.BenchAcquireComplete(b, s, hook.n.Load)
}

// BenchmarkReplay: Acquire of a completed key — what a retry that replays
// costs.
func BenchmarkReplay(b *testing.B) {
	client, hook := countingClient(b)
	s := newTestStore(b, client, 0)
	warmUp(b, s)
	storetest.BenchReplay(b, s, hook.n.Load)
}

// BenchmarkRawSetNXSet: the bare driver commands of a hand-made check, SET
// NX PX to claim a key and SET XX to store the outcome.
func BenchmarkRawSetNXSet(b *testing.B) {
	client, hook := countingClient(b)
	s := newTestStore(b, client, 0)
	warmUp(b, s)
	ctx := context.Background()
	value, err := testkit.BenchResponse().MarshalBinary()
	if err != nil {
		b.Fatal(err)
	}
	base := s.tags[0] + ":raw:"
	testkit.Measure(b, hook.n.Load, func(i int) {
		key := base + strconv.Itoa(i)
		if ok, err := client.SetNX(ctx, key, "in_progress", idem.DefaultLease).Result(); err != nil || !ok {
			b.Fatalf("SET NX = %v, %v", ok, err)
		}
		if ok, err := client.SetXX(ctx, key, value, idem.DefaultRetention).Result(); err != nil || !ok {
			b.Fatalf("SET XX = %v, %v", ok, err)
		}
	})
}

// BenchmarkRawGet: a bare GET of a stored outcome.
func BenchmarkRawGet(b *testing.B) {
	client, hook := countingClient(b)
	s := newTestStore(b, client, 0)
	warmUp(b, s)
	ctx := context.Background()
	value, err := testkit.BenchResponse().MarshalBinary()
	if err != nil {
		b.Fatal(err)
	}
	key := s.tags[0] + ":raw"
	if err := client.Set(ctx, key, value, idem.DefaultRetention).Err(); err != nil {
		b.Fatal(err)
	}
	testkit.Measure(b, hook.n.Load, func(int) {
		if v, err := client.Get(ctx, key).Bytes(); err != nil || len(v) != len(value) {
			b.Fatalf("GET = %d bytes, %v", len(v), err)
		}
	})
}

// BenchmarkAcquireCompleteParallel: BenchmarkAcquireComplete from many
// goroutines at once, whose scripts share pipelines.
func BenchmarkAcquireCompleteParallel(b *testing.B) {
	client, _ := countingClient(b)
	s := newTestStore(b, client, 0)
	warmUp(b, s)
	storetest.BenchAcquireCompleteParallel(b, s)
}
