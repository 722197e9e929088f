package storetest

import (
	"net/http"
	"strconv"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/store"
)

// BenchResponse returns the outcome every store's benchmarks store, raw ones
// included: a small JSON charge, so that their figures compare.
func BenchResponse() *idem.Response {
	return &idem.Response{Status: 201, Header: http.Header{"Content-Type": {"application/json"}},
		Body: []byte(`{"id":"ch_3MmlLrLkdIwHu7ix0snN0B15","object":"charge","amount":1099,"currency":"usd","status":"succeeded"}`)}
}

// BenchAcquireComplete times what a request that runs costs a store: an
// Acquire of a new key, then a Finish as COMPLETED with BenchResponse(). When
// roundTrips is not nil it reads the store's count of round trips so far, and
// the benchmark reports roundtrips/op. It also reports ops/s.
func BenchAcquireComplete(b *testing.B, s idem.Store, roundTrips func() int64) {
	f := Fingerprint("bench")
	Measure(b, roundTrips, func(i int) {
		now, key, tok := time.Now(), "key-"+strconv.Itoa(i), token(b)
		r, err := s.Acquire(ctx, store.AcquireParams{Scope: "s", Key: key, Fingerprint: f, Token: tok,
			Now: now, LeaseExpires: now.Add(idem.DefaultLease)})
		if err != nil || r.Token != tok {
			b.Fatalf("Acquire = %+v, %v", r, err)
		}
		if err := s.Finish(ctx, idem.FinishParams{Scope: "s", Key: key, Token: tok, Now: now,
			State: idem.StateCompleted, Response: BenchResponse(), Expires: now.Add(idem.DefaultRetention)}); err != nil {
			b.Fatal(err)
		}
	})
}

// BenchReplay times what a retry that replays costs a store: an Acquire of a
// completed key. roundTrips is as for [BenchAcquireComplete].
func BenchReplay(b *testing.B, s idem.Store, roundTrips func() int64) {
	now := time.Now()
	p := store.AcquireParams{Scope: "s", Key: "key", Fingerprint: Fingerprint("bench"), Token: token(b), Now: now, LeaseExpires: now.Add(idem.DefaultLease)}
	if _, err := s.Acquire(ctx, p); err != nil {
		b.Fatal(err)
	}
	if err := s.Finish(ctx, idem.FinishParams{Scope: "s", Key: "key", Token: p.Token, Now: now,
		State: idem.StateCompleted, Response: BenchResponse(), Expires: now.Add(idem.DefaultRetention)}); err != nil {
		b.Fatal(err)
	}
	Measure(b, roundTrips, func(int) {
		p.Token, p.Now = token(b), time.Now()
		p.LeaseExpires = p.Now.Add(idem.DefaultLease)
		r, err := s.Acquire(ctx, p)
		if err != nil || r.State != idem.StateCompleted || r.Response == nil {
			b.Fatalf("Acquire = %+v, %v; want the completed record", r, err)
		}
	})
}

// Measure runs op under b.Loop, with the number of the iteration, and
// reports ops/s and, when roundTrips is not nil, round trips per op (as
// roundTrips counts them). Stores' benchmarks of their bare driver
// operations use it, so that they report as the idem ones do.
func Measure(b *testing.B, roundTrips func() int64, op func(i int)) {
	var start int64
	if roundTrips != nil {
		start = roundTrips()
	}
	ops := 0
	for b.Loop() {
		op(ops)
		ops++
	}
	if roundTrips != nil {
		b.ReportMetric(float64(roundTrips()-start)/float64(ops), "roundtrips/op")
	}
	b.ReportMetric(float64(ops)/b.Elapsed().Seconds(), "ops/s")
}

func token(b *testing.B) string {
	t, err := store.NewToken()
	if err != nil {
		b.Fatal(err)
	}
	return t
}
