package redisstore

import (
	"context"
	"net/http"
	"strconv"
	"testing"
	"time"

	"github.com/idemhq/idem"
)

// The benchmarks run one operation at a time on one connection, so ns/op is
// the latency of an operation, round trips included. Each reports its round
// trips per operation as counted by a client hook.

var benchResponse = &idem.Response{
	Status: http.StatusCreated,
	Header: http.Header{"Content-Type": {"application/json"}},
	Body:   []byte(`{"id":"ch_3MmlLrLkdIwHu7ix0snN0B15","amount":1000,"currency":"eur","status":"succeeded"}`),
}

func reportRoundTrips(b *testing.B, hook *countingHook, before int64) {
	b.ReportMetric(float64(hook.n.Load()-before)/float64(b.N), "roundtrips/op")
}

// BenchmarkAcquireComplete: Acquire of a fresh key, then Finish as
// COMPLETED — what a request that runs costs.
func BenchmarkAcquireComplete(b *testing.B) {
	client, hook := countingClient(b)
	s := newTestStore(b, client, 0)
	warmUp(b, s)
	ctx := context.Background()
	f := fp("bench")
	tok, err := idem.NewToken()
	if err != nil {
		b.Fatal(err)
	}
	before := hook.n.Load()
	i := 0
	for b.Loop() {
		now := time.Now()
		key := "key-" + strconv.Itoa(i)
		i++
		r, err := s.Acquire(ctx, idem.AcquireParams{Scope: "s", Key: key, Fingerprint: f, Token: tok,
			Now: now, LeaseExpires: now.Add(idem.DefaultLease)})
		if err != nil || r.Token != tok {
			b.Fatalf("Acquire = %+v, %v", r, err)
		}
		if err := s.Finish(ctx, idem.FinishParams{Scope: "s", Key: key, Token: tok, Now: now,
			State: idem.StateCompleted, Response: benchResponse, Expires: now.Add(idem.DefaultRetention)}); err != nil {
			b.Fatal(err)
		}
	}
	reportRoundTrips(b, hook, before)
}

// BenchmarkReplay: Acquire of a completed key — what a retry that replays
// costs.
func BenchmarkReplay(b *testing.B) {
	client, hook := countingClient(b)
	s := newTestStore(b, client, 0)
	warmUp(b, s)
	ctx := context.Background()
	f := fp("bench")
	now := time.Now()
	tok := "0123456789abcdef0123456789abcdef"
	if _, err := s.Acquire(ctx, idem.AcquireParams{Scope: "s", Key: "key", Fingerprint: f, Token: tok,
		Now: now, LeaseExpires: now.Add(idem.DefaultLease)}); err != nil {
		b.Fatal(err)
	}
	if err := s.Finish(ctx, idem.FinishParams{Scope: "s", Key: "key", Token: tok, Now: now,
		State: idem.StateCompleted, Response: benchResponse, Expires: now.Add(idem.DefaultRetention)}); err != nil {
		b.Fatal(err)
	}
	other := "fedcba9876543210fedcba9876543210"
	before := hook.n.Load()
	for b.Loop() {
		now := time.Now()
		r, err := s.Acquire(ctx, idem.AcquireParams{Scope: "s", Key: "key", Fingerprint: f, Token: other,
			Now: now, LeaseExpires: now.Add(idem.DefaultLease)})
		if err != nil || r.State != idem.StateCompleted || r.Response == nil {
			b.Fatalf("Acquire = %+v, %v; want the completed record", r, err)
		}
	}
	reportRoundTrips(b, hook, before)
}

// BenchmarkRawSetNXSet: the bare driver commands of a hand-made check, SET
// NX PX to claim a key and SET XX to store the outcome.
func BenchmarkRawSetNXSet(b *testing.B) {
	client, hook := countingClient(b)
	s := newTestStore(b, client, 0)
	warmUp(b, s)
	ctx := context.Background()
	value, err := benchResponse.MarshalBinary()
	if err != nil {
		b.Fatal(err)
	}
	base := s.tags[0] + ":raw:"
	before := hook.n.Load()
	i := 0
	for b.Loop() {
		key := base + strconv.Itoa(i)
		i++
		if ok, err := client.SetNX(ctx, key, "in_progress", idem.DefaultLease).Result(); err != nil || !ok {
			b.Fatalf("SET NX = %v, %v", ok, err)
		}
		if ok, err := client.SetXX(ctx, key, value, idem.DefaultRetention).Result(); err != nil || !ok {
			b.Fatalf("SET XX = %v, %v", ok, err)
		}
	}
	reportRoundTrips(b, hook, before)
}

// BenchmarkRawGet: a bare GET of a stored outcome.
func BenchmarkRawGet(b *testing.B) {
	client, hook := countingClient(b)
	s := newTestStore(b, client, 0)
	warmUp(b, s)
	ctx := context.Background()
	value, err := benchResponse.MarshalBinary()
	if err != nil {
		b.Fatal(err)
	}
	key := s.tags[0] + ":raw"
	if err := client.Set(ctx, key, value, idem.DefaultRetention).Err(); err != nil {
		b.Fatal(err)
	}
	before := hook.n.Load()
	for b.Loop() {
		if v, err := client.Get(ctx, key).Bytes(); err != nil || len(v) != len(value) {
			b.Fatalf("GET = %d bytes, %v", len(v), err)
		}
	}
	reportRoundTrips(b, hook, before)
}
