package storetest

import (
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/testkit"
	"github.com/idemhq/idem/store"
)

// BenchAcquireComplete times what a request that runs costs a store: an
// Acquire of a new key, then a Finish as COMPLETED with testkit.BenchResponse(). When
// roundTrips is not nil it reads the store's count of round trips so far, and
// the benchmark reports roundtrips/op. It also reports ops/s.
func BenchAcquireComplete(b *testing.B, s idem.Store, roundTrips func() int64) {
	f := testkit.Fingerprint("bench")
	testkit.Measure(b, roundTrips, func(i int) {
		now, key, tok := time.Now(), "key-"+strconv.Itoa(i), token(b)
		r, err := s.Acquire(ctx, store.AcquireParams{Scope: "s", Key: key, Fingerprint: f, Token: tok,
			Now: now, LeaseExpires: now.Add(idem.DefaultLease)})
		if err != nil || r.Token != tok {
			b.Fatalf("Acquire = %+v, %v", r, err)
		}
		if err := s.Finish(ctx, idem.FinishParams{Scope: "s", Key: key, Token: tok, Now: now,
			State: idem.StateCompleted, Response: testkit.BenchResponse(), Expires: now.Add(idem.DefaultRetention)}); err != nil {
			b.Fatal(err)
		}
	})
}

// BenchReplay times what a retry that replays costs a store: an Acquire of a
// completed key. roundTrips is as for [BenchAcquireComplete].
func BenchReplay(b *testing.B, s idem.Store, roundTrips func() int64) {
	now := time.Now()
	p := store.AcquireParams{Scope: "s", Key: "key", Fingerprint: testkit.Fingerprint("bench"), Token: token(b), Now: now, LeaseExpires: now.Add(idem.DefaultLease)}
	if _, err := s.Acquire(ctx, p); err != nil {
		b.Fatal(err)
	}
	if err := s.Finish(ctx, idem.FinishParams{Scope: "s", Key: "key", Token: p.Token, Now: now,
		State: idem.StateCompleted, Response: testkit.BenchResponse(), Expires: now.Add(idem.DefaultRetention)}); err != nil {
		b.Fatal(err)
	}
	testkit.Measure(b, roundTrips, func(int) {
		p.Token, p.Now = token(b), time.Now()
		p.LeaseExpires = p.Now.Add(idem.DefaultLease)
		r, err := s.Acquire(ctx, p)
		if err != nil || r.State != idem.StateCompleted || r.Response == nil {
			b.Fatalf("Acquire = %+v, %v; want the completed record", r, err)
		}
	})
}

func token(b *testing.B) string {
	t, err := store.NewToken()
	if err != nil {
		b.Fatal(err)
	}
	return t
}

// BenchAcquireCompleteParallel is [BenchAcquireComplete] from 16 goroutines
// per CPU at once, as a loaded server calls a store: what the store's
// batching of concurrent writes buys shows here. It reports ops/s.
func BenchAcquireCompleteParallel(b *testing.B, s idem.Store) {
	f := testkit.Fingerprint("bench")
	var next atomic.Int64
	b.SetParallelism(16)
	start := time.Now()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			now, key, tok := time.Now(), "pkey-"+strconv.FormatInt(next.Add(1), 10), token(b)
			r, err := s.Acquire(ctx, store.AcquireParams{Scope: "s", Key: key, Fingerprint: f, Token: tok,
				Now: now, LeaseExpires: now.Add(idem.DefaultLease)})
			if err != nil || r.Token != tok {
				b.Errorf("Acquire = %+v, %v", r, err)
				return
			}
			if err := s.Finish(ctx, idem.FinishParams{Scope: "s", Key: key, Token: tok, Now: now,
				State: idem.StateCompleted, Response: testkit.BenchResponse(), Expires: now.Add(idem.DefaultRetention)}); err != nil {
				b.Error(err)
				return
			}
		}
	})
	b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "ops/s")
}
