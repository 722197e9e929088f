package idem_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/wait"
	"github.com/idemhq/idem/store"
	"github.com/idemhq/idem/store/memstore"
	"github.com/idemhq/idem/store/storetest"
)

var ctx = context.Background()

var payload = idem.NewFingerprint(idem.Payload{Method: "POST", Path: "/charges", Body: []byte(`{"amount":100}`)})

func TestNewValidates(t *testing.T) {
	if _, err := idem.New(idem.Config{}); !errors.Is(err, idem.ErrInvalid) {
		t.Errorf("New without a store: %v", err)
	}
	if _, err := idem.New(idem.Config{Store: memstore.New(), Lease: -time.Second}); !errors.Is(err, idem.ErrInvalid) {
		t.Errorf("New with a negative lease: %v", err)
	}
}

func TestBeginUsesDefaultsAndOverrides(t *testing.T) {
	e, err := idem.New(idem.Config{Store: memstore.New()})
	if err != nil {
		t.Fatal(err)
	}
	before := time.Now()
	out, err := e.Begin(ctx, idem.BeginParams{Key: "k", Fingerprint: payload})
	if err != nil || out.Decision != idem.Execute {
		t.Fatal(out.Decision, err)
	}
	if l := out.Lease; l.Duration != idem.DefaultLease || l.Retention != idem.DefaultRetention ||
		l.Expires.Before(before.Add(idem.DefaultLease)) || l.Expires.After(time.Now().Add(idem.DefaultLease)) {
		t.Fatalf("lease = %+v, want the defaults", l)
	}
	out, err = e.Begin(ctx, idem.BeginParams{Key: "k2", Fingerprint: payload, Lease: time.Minute, Retention: 72 * time.Hour})
	if err != nil || out.Lease.Duration != time.Minute || out.Lease.Retention != 72*time.Hour {
		t.Fatalf("overrides not applied: %+v, %v", out.Lease, err)
	}
}

func TestDecisionString(t *testing.T) {
	for d, want := range map[idem.Decision]string{idem.Execute: "execute", idem.Replay: "replay", idem.Mismatch: "mismatch",
		idem.InFlight: "in_flight", idem.Uncertain: "uncertain", idem.Decision(42): "Decision(42)"} {
		if d.String() != want {
			t.Errorf("%d.String() = %q, want %q", int(d), d.String(), want)
		}
	}
}

func TestNewToken(t *testing.T) {
	seen := map[string]bool{}
	for range 1000 {
		tok, err := store.NewToken()
		if err != nil {
			t.Fatal(err)
		}
		if len(tok) != 32 || strings.Trim(tok, "0123456789abcdef") != "" || seen[tok] {
			t.Fatalf("token %q: want 32 unique hex digits", tok)
		}
		seen[tok] = true
	}
}

// signalStore reports each renewal and can be told to fail them.
type signalStore struct {
	idem.Store
	renewed chan struct{}
	mu      sync.Mutex
	fail    error
}

func (s *signalStore) Renew(ctx context.Context, p store.RenewParams) error {
	s.mu.Lock()
	fail := s.fail
	s.mu.Unlock()
	if fail != nil {
		return fail
	}
	err := s.Store.Renew(ctx, p)
	if err == nil {
		s.renewed <- struct{}{}
	}
	return err
}

func (s *signalStore) failRenewals(err error) {
	s.mu.Lock()
	s.fail = err
	s.mu.Unlock()
}

// started returns an engine made of cfg, and the outcome of a first Begin
// of key k, which runs it.
func started(t *testing.T, cfg idem.Config) (*idem.Engine, idem.Outcome) {
	t.Helper()
	e, err := idem.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	out, err := e.Begin(ctx, idem.BeginParams{Key: "k", Fingerprint: payload})
	if err != nil || out.Decision != idem.Execute {
		t.Fatal(out.Decision, err)
	}
	return e, out
}

func holdSetup(t *testing.T, lease time.Duration) (*idem.Engine, *signalStore, idem.Lease, *storetest.Clock) {
	t.Helper()
	s := &signalStore{Store: memstore.New(), renewed: make(chan struct{}, 100)}
	clock := storetest.NewClock(time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC))
	e, out := started(t, idem.Config{Store: s, Lease: lease, Clock: clock})
	return e, s, out.Lease, clock
}

// tick waits until Hold has set its n-th renewal timer, then moves the clock
// by d.
func tick(t *testing.T, clock *storetest.Clock, n int, d time.Duration) {
	t.Helper()
	if !clock.AwaitTimers(n, 5*time.Second) {
		t.Fatalf("Hold never set its renewal timer number %d", n)
	}
	clock.Advance(d)
}

// TestHoldOutlivesLease: work that runs for several lease lengths keeps its
// lease, so a duplicate meanwhile is in flight, not uncertain, and the owner
// can still store its outcome. The clock is moved by hand, so the test does
// not depend on how fast the machine is.
func TestHoldOutlivesLease(t *testing.T) {
	e, s, l, clock := holdSetup(t, 300*time.Millisecond)
	held, stop := e.Hold(ctx, l)
	for i := range 9 { // renewals every 100ms: three whole lease lengths
		tick(t, clock, i+1, 100*time.Millisecond)
		wait.Recv(t, s.renewed, 5*time.Second, fmt.Sprintf("renewal %d", i+1))
		if out, err := e.Begin(ctx, idem.BeginParams{Key: "k", Fingerprint: payload}); err != nil || out.Decision != idem.InFlight {
			t.Fatalf("duplicate while held: %v, %v; want in flight", out.Decision, err)
		}
	}
	if held.Err() != nil {
		t.Fatalf("held context ended: %v", context.Cause(held))
	}
	last := stop()
	if !last.Expires.After(l.Expires.Add(500 * time.Millisecond)) {
		t.Fatalf("stop returned lease expiring %v, not 9 renewals after the first %v", last.Expires, l.Expires)
	}
	if held.Err() == nil {
		t.Fatal("held context still live after stop")
	}
	if err := e.Complete(ctx, last, &idem.Response{Status: 200}); err != nil {
		t.Fatalf("Complete after a long hold: %v", err)
	}
}

// TestHoldCancelsWhenLeaseLost: once a renewal is refused, the work's
// context is cancelled with ErrLeaseLost as its cause.
func TestHoldCancelsWhenLeaseLost(t *testing.T) {
	e, _, l, clock := holdSetup(t, 60*time.Millisecond)
	held, stop := e.Hold(ctx, l)
	defer stop()
	if err := e.MarkUnknown(ctx, l); err != nil { // someone settles the record
		t.Fatal(err)
	}
	tick(t, clock, 1, 20*time.Millisecond)
	wait.Recv(t, held.Done(), 5*time.Second, "the held context to end once the lease was lost")
	if cause := context.Cause(held); !errors.Is(cause, idem.ErrLeaseLost) {
		t.Fatalf("cause = %v, want ErrLeaseLost", cause)
	}
}

// TestHoldCancelsWhenStoreStaysDown: transient renewal errors are retried,
// but once the lease has run out without a renewal the work is cancelled —
// and not before.
func TestHoldCancelsWhenStoreStaysDown(t *testing.T) {
	e, s, l, clock := holdSetup(t, 60*time.Millisecond)
	s.failRenewals(idem.ErrUnavailable)
	held, stop := e.Hold(ctx, l)
	defer stop()
	for n := 1; n <= 2; n++ { // 20ms, 40ms: the lease still runs
		tick(t, clock, n, 20*time.Millisecond)
		if !clock.AwaitTimers(n+1, 5*time.Second) {
			t.Fatalf("Hold stopped renewing after failure %d, before the lease ran out: %v", n, context.Cause(held))
		}
		if held.Err() != nil {
			t.Fatalf("cancelled at %v, before the lease ran out at %v", clock.Now(), l.Expires)
		}
	}
	tick(t, clock, 3, 20*time.Millisecond) // 60ms: the lease has run out
	wait.Recv(t, held.Done(), 5*time.Second, "the held context to end once the lease ran out")
	if cause := context.Cause(held); !errors.Is(cause, idem.ErrLeaseLost) {
		t.Fatalf("cause = %v, want ErrLeaseLost", cause)
	}
}

// slowFailingStore fails every renewal after the time it takes (the clock
// moved by took): a store that answers late, then not at all.
type slowFailingStore struct {
	idem.Store
	clock *storetest.Clock
	took  time.Duration
}

func (s *slowFailingStore) Renew(ctx context.Context, p store.RenewParams) error {
	s.clock.Advance(s.took)
	return fmt.Errorf("renewal timed out: %w", idem.ErrUnavailable)
}

// TestHoldEndsWhenTheLeaseRunsOut: renewals that fail slowly (each takes
// 45 of the lease's 300 ms) do not let the work run on past its lease: the
// try after a failure is set no later than the lease's end, where the work
// is cancelled. (It was set a third of the lease after the failure: here
// at 390 ms, 90 ms during which another owner could take the key.)
func TestHoldEndsWhenTheLeaseRunsOut(t *testing.T) {
	clock := storetest.NewClock(time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC))
	s := &slowFailingStore{Store: memstore.New(), clock: clock, took: 45 * time.Millisecond}
	e, out := started(t, idem.Config{Store: s, Lease: 300 * time.Millisecond, Clock: clock})
	held, stop := e.Hold(ctx, out.Lease)
	defer stop()
	tick(t, clock, 1, 100*time.Millisecond) // tries at 100 ms, fails at 145
	tick(t, clock, 2, 100*time.Millisecond) // tries at 245 ms, fails at 290
	if !clock.AwaitTimers(3, 5*time.Second) {
		t.Fatalf("Hold set no timer after its second failure: %v", context.Cause(held))
	}
	if held.Err() != nil {
		t.Fatalf("cancelled at %v, before the lease ran out at %v", clock.Now(), out.Lease.Expires)
	}
	clock.Advance(out.Lease.Expires.Sub(clock.Now())) // the lease's end
	wait.Recv(t, held.Done(), 5*time.Second, "the held context to end when the lease ran out")
	if cause := context.Cause(held); !errors.Is(cause, idem.ErrLeaseLost) {
		t.Fatalf("cause = %v, want ErrLeaseLost", cause)
	}
}

// hangingStore's renewals wait until their context ends.
type hangingStore struct{ idem.Store }

func (hangingStore) Renew(ctx context.Context, _ store.RenewParams) error {
	<-ctx.Done()
	return fmt.Errorf("renewal: %w: %w", idem.ErrUnavailable, ctx.Err())
}

// TestHoldEndsWhileARenewalHangs: on the wall clock, a renewal that hangs
// (a store that does not answer, with a store timeout longer than the
// lease) is cut at the lease's end, and the work with it.
func TestHoldEndsWhileARenewalHangs(t *testing.T) {
	e, out := started(t, idem.Config{Store: hangingStore{memstore.New()}, Lease: 300 * time.Millisecond, StoreTimeout: time.Minute})
	held, stop := e.Hold(ctx, out.Lease)
	defer stop()
	wait.Recv(t, held.Done(), 10*time.Second, "the held context to end when the lease ran out, not when the store timeout did")
	if cause := context.Cause(held); !errors.Is(cause, idem.ErrLeaseLost) {
		t.Fatalf("cause = %v, want ErrLeaseLost", cause)
	}
	if now := time.Now(); now.Before(out.Lease.Expires) {
		t.Fatalf("cancelled at %v, before the lease ran out at %v", now, out.Lease.Expires)
	}
}

// TestHoldOnTheSystemClock: on the wall clock (where renewals are runtime
// timers, not goroutines waiting on the clock) the lease is renewed every
// third of its length until stop, which returns it as last renewed.
func TestHoldOnTheSystemClock(t *testing.T) {
	s := &signalStore{Store: memstore.New(), renewed: make(chan struct{}, 100)}
	// Renewals every 300ms: a stall of the machine shorter than 600ms
	// cannot let the lease run out between two of them.
	e, out := started(t, idem.Config{Store: s, Lease: 900 * time.Millisecond})
	held, stop := e.Hold(ctx, out.Lease)
	for i := range 2 {
		wait.Recv(t, s.renewed, 5*time.Second, fmt.Sprintf("renewal %d", i+1))
	}
	last := stop()
	if !last.Expires.After(out.Lease.Expires) {
		t.Fatalf("stop returned a lease expiring %v, not later than the first %v", last.Expires, out.Lease.Expires)
	}
	if held.Err() == nil {
		t.Fatal("held context still live after stop")
	}
	if err := e.Complete(ctx, last, &idem.Response{Status: 200}); err != nil {
		t.Fatalf("Complete after the hold: %v", err)
	}
}

func TestHoldStopsWithParent(t *testing.T) {
	e, _, l, _ := holdSetup(t, time.Minute)
	parent, cancel := context.WithCancel(ctx)
	held, stop := e.Hold(parent, l)
	cancel()
	wait.Recv(t, held.Done(), 5*time.Second, "the held context to end with its parent")
	if got := stop(); got.Token != l.Token {
		t.Fatalf("stop returned %+v", got)
	}
}

// flakyStore fails every Acquire and Finish with ErrUnavailable while down,
// and counts the acquires attempted.
type flakyStore struct {
	idem.Store
	down     atomic.Bool
	attempts atomic.Int64
}

func (s *flakyStore) Finish(ctx context.Context, p idem.FinishParams) error {
	if s.down.Load() {
		return idem.ErrUnavailable
	}
	return s.Store.Finish(ctx, p)
}

func (s *flakyStore) Acquire(ctx context.Context, p store.AcquireParams) (idem.Record, error) {
	s.attempts.Add(1)
	if s.down.Load() {
		return idem.Record{}, idem.ErrUnavailable
	}
	return s.Store.Acquire(ctx, p)
}

// TestStoreKnownDownFailsFast: a store call whose answer is lost is tried
// again until the store timeout runs out; once a whole timeout has passed
// without an answer the store counts as down, and each call tries once, so
// requests fail closed at once, until the store answers again.
func TestStoreKnownDownFailsFast(t *testing.T) {
	s := &flakyStore{Store: memstore.New()}
	// Retries at 10, 50 and 210 ms, then at 710: a machine that stalls for
	// most of the timeout cannot make a retried call look like one attempt.
	e, err := idem.New(idem.Config{Store: s, StoreTimeout: 500 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	begin := func(key string) error {
		_, err := e.Begin(ctx, idem.BeginParams{Key: key, Fingerprint: payload})
		return err
	}
	s.down.Store(true)
	if err := begin("a"); !errors.Is(err, idem.ErrUnavailable) || s.attempts.Load() < 2 {
		t.Fatalf("first call with the store down: %v after %d attempts; want ErrUnavailable after retries", err, s.attempts.Load())
	}
	s.attempts.Store(0)
	if err := begin("b"); !errors.Is(err, idem.ErrUnavailable) || s.attempts.Load() != 1 {
		t.Fatalf("a call once the store is known down: %v after %d attempts; want one attempt", err, s.attempts.Load())
	}
	s.down.Store(false)
	if err := begin("c"); err != nil {
		t.Fatalf("once the store answers: %v", err)
	}
	// The releases of the acquires whose answers were lost land first (a
	// landing that fails while the store is down again would count it down).
	wait.Until(t, 10*time.Second, "the journal to land its releases", func() bool { return e.Pending() == 0 })
	s.down.Store(true)
	s.attempts.Store(0)
	if err := begin("d"); !errors.Is(err, idem.ErrUnavailable) || s.attempts.Load() < 2 {
		t.Fatalf("after the store had answered again: %d attempts; want retries again", s.attempts.Load())
	}
}

// TestJournalReplaysUntilTheRetention: an outcome that waits in the
// journal for the store is replayed by this engine, but not once its
// retention has run out: a request with that key then is a new one (here it
// fails closed, the store being down still), not the old one answered again.
func TestJournalReplaysUntilTheRetention(t *testing.T) {
	s := &flakyStore{Store: memstore.New()}
	e, err := idem.New(idem.Config{Store: s, StoreTimeout: 100 * time.Millisecond, Retention: 300 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	p := idem.BeginParams{Key: "k", Fingerprint: payload}
	out, err := e.Begin(ctx, p)
	if err != nil || out.Decision != idem.Execute {
		t.Fatal(out.Decision, err)
	}
	s.down.Store(true)
	if err := e.Complete(ctx, out.Lease, &idem.Response{Status: 201}); err != nil {
		t.Fatalf("Complete with the store down: %v, want it kept in the journal", err)
	}
	replay, err := e.Begin(ctx, p)
	if err != nil || replay.Decision != idem.Replay {
		t.Fatalf("Begin with the outcome in the journal: %v, %v; want a replay", replay.Decision, err)
	}
	wait.Until(t, 5*time.Second, "the retention to run out", func() bool { return time.Now().After(replay.Record.Expires) })
	if out, err := e.Begin(ctx, p); !errors.Is(err, idem.ErrUnavailable) {
		t.Fatalf("Begin after the retention: %v, %v; want ErrUnavailable (a new request, the store down)", out.Decision, err)
	}
}

// TestCompleteStampsExpiry: a completed outcome carries Idempotency-Expires,
// the time its record stops being replayed, on the caller's response (for
// the first answer) and on every replay: from this engine, from another
// that reads the store, and from Get. The store does not keep the header:
// it is the record's expiry, which the store keeps anyway (51 bytes less
// per record: WAL on PostgreSQL, memory on Redis).
func TestCompleteStampsExpiry(t *testing.T) {
	st := memstore.New()
	e, err := idem.New(idem.Config{Store: st, Retention: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	out, err := e.Begin(ctx, idem.BeginParams{Key: "k", Fingerprint: payload})
	if err != nil {
		t.Fatal(err)
	}
	resp := &idem.Response{Status: 201, Header: http.Header{"Content-Type": {"application/json"}}}
	if err := e.Complete(ctx, out.Lease, resp); err != nil {
		t.Fatal(err)
	}
	kept, err := st.Get(ctx, store.GetParams{Key: "k", Now: time.Now()})
	if err != nil {
		t.Fatal(err)
	}
	want := kept.Expires.UTC().Format(http.TimeFormat)
	if got := resp.Header.Get(idem.HeaderExpires); got != want {
		t.Fatalf("the caller's response says %q, the record expires %q", got, want)
	}
	if got := kept.Response.Header; len(got) != 1 || got.Get("Content-Type") != "application/json" {
		t.Fatalf("the store keeps the headers %v, want the handler's alone", got)
	}
	other, err := idem.New(idem.Config{Store: st, Retention: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	for name, e := range map[string]*idem.Engine{"this engine": e, "another engine": other} {
		for i := range 2 { // the store's record, then the cached one
			out, err := e.Begin(ctx, idem.BeginParams{Key: "k", Fingerprint: payload})
			if err != nil || out.Decision != idem.Replay {
				t.Fatalf("%s: %v, %v; want a replay", name, out.Decision, err)
			}
			if got := out.Record.Response.Header.Get(idem.HeaderExpires); got != want {
				t.Fatalf("%s, replay %d: %q, want %q", name, i+1, got, want)
			}
		}
		rec, err := e.Get(ctx, "", "k")
		if err != nil {
			t.Fatal(err)
		}
		if got := rec.Response.Header.Get(idem.HeaderExpires); got != want || rec.Response.Header.Get("Content-Type") != "application/json" {
			t.Fatalf("%s: Get's response has %v, want %s %q", name, rec.Response.Header, idem.HeaderExpires, want)
		}
	}
	if got := kept.Response.Header.Get(idem.HeaderExpires); got != "" {
		t.Fatalf("a replay wrote %q into the record the store returned", got)
	}
}

// TestSettleOnce: two reconcilers borrowing one record's lease settle it
// with the same outcome; one succeeds, the other is told the lease is lost.
func TestSettleOnce(t *testing.T) {
	e, err := idem.New(idem.Config{Store: memstore.New()})
	if err != nil {
		t.Fatal(err)
	}
	out, err := e.Begin(ctx, idem.BeginParams{Key: "k", Fingerprint: payload})
	if err != nil {
		t.Fatal(err)
	}
	rec := out.Record
	s := idem.Settlement{State: idem.StateFailed}
	if err := e.Settle(ctx, rec.Lease(), s); err != nil {
		t.Fatal(err)
	}
	if err := e.Settle(ctx, rec.Lease(), s); !errors.Is(err, idem.ErrLeaseLost) {
		t.Fatalf("the second settlement: %v, want ErrLeaseLost", err)
	}
}

// TestCompleteAdoptsTheSameOutcome: a reconciler settled the record while
// its owner was still finishing, and found what the owner did (the same
// status and body): the owner's Complete then counts as stored, with the
// record's Idempotency-Expires, so its first answer and the replays agree.
// Another outcome stands against it: ErrLeaseLost.
func TestCompleteAdoptsTheSameOutcome(t *testing.T) {
	e, err := idem.New(idem.Config{Store: memstore.New()})
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name       string
		reconciled string
		want       error
	}{{"same", "charged", nil}, {"other", "declined", idem.ErrLeaseLost}} {
		out, err := e.Begin(ctx, idem.BeginParams{Key: tc.name, Fingerprint: payload})
		if err != nil {
			t.Fatal(err)
		}
		if err := e.Settle(ctx, out.Record.Lease(), idem.Settlement{State: idem.StateCompleted,
			Response: &idem.Response{Status: 201, Body: []byte(tc.reconciled)}}); err != nil {
			t.Fatal(err)
		}
		resp := &idem.Response{Status: 201, Header: http.Header{"Content-Type": {"text/plain"}}, Body: []byte("charged")}
		if err := e.Complete(ctx, out.Lease, resp); !errors.Is(err, tc.want) {
			t.Fatalf("%s: Complete = %v, want %v", tc.name, err, tc.want)
		}
		if tc.want == nil {
			rec, _ := e.Get(ctx, "", tc.name)
			if got, want := resp.Header.Get(idem.HeaderExpires), rec.Response.Header.Get(idem.HeaderExpires); got != want || got == "" {
				t.Fatalf("the owner's answer says %q, the stored outcome %q", got, want)
			}
		}
	}
}

// panicking panics in its first Acquire: a bug in a store or its driver,
// which net/http recovers in the handler that called Begin.
type panicking struct {
	idem.Store
	once sync.Once
}

func (s *panicking) Acquire(ctx context.Context, p store.AcquireParams) (idem.Record, error) {
	s.once.Do(func() { panic("a bug in the store") })
	return s.Store.Acquire(ctx, p)
}

// TestStorePanicFreesTheKey: a store whose acquire panics once left the
// key's acquire "in flight" in the engine for ever: every later request
// for the key in this process waited on it until its own context ended,
// and one without a deadline hung.
func TestStorePanicFreesTheKey(t *testing.T) {
	eng, err := idem.New(idem.Config{Store: &panicking{Store: memstore.New()}})
	if err != nil {
		t.Fatal(err)
	}
	func() {
		defer func() {
			if recover() == nil {
				t.Error("the store's panic did not reach the caller")
			}
		}()
		eng.Begin(ctx, charge)
	}()
	bounded, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if out, err := eng.Begin(bounded, charge); err != nil || out.Decision != idem.Execute {
		t.Fatalf("the next request for the key: %v, %v; want Execute", out.Decision, err)
	}
}

// TestCloseWaitsForRunningRequests: Close closed the journal at once, with
// requests still running: a proxy stopping gracefully said "every outcome
// is stored" and exited while a request ran (its record left in progress,
// then UNKNOWN). Close waits for the leases held to settle; when its
// context ends first, its error says how many requests still ran.
func TestCloseWaitsForRunningRequests(t *testing.T) {
	eng, err := idem.New(idem.Config{Store: memstore.New()})
	if err != nil {
		t.Fatal(err)
	}
	out, err := eng.Begin(ctx, charge)
	if err != nil || out.Decision != idem.Execute {
		t.Fatal(out.Decision, err)
	}
	closed := make(chan error, 1)
	go func() { closed <- eng.Close(ctx) }()
	select {
	case err := <-closed:
		t.Fatalf("Close returned (%v) while a request ran", err)
	case <-time.After(100 * time.Millisecond): // it may only be slow to return early: this can miss a defect, not invent one
	}
	if err := eng.Complete(ctx, out.Lease, &idem.Response{Status: 201, Body: []byte(`{"id":"ch_1"}`)}); err != nil {
		t.Fatal(err)
	}
	if err := wait.Recv(t, closed, 10*time.Second, "Close, once the request settled"); err != nil {
		t.Fatalf("Close after the running request settled: %v", err)
	}

	other, err := idem.New(idem.Config{Store: memstore.New()})
	if err != nil {
		t.Fatal(err)
	}
	if out, err = other.Begin(ctx, charge); err != nil || out.Decision != idem.Execute {
		t.Fatal(out.Decision, err)
	}
	short, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
	defer cancel()
	if err := other.Close(short); err == nil || !strings.Contains(err.Error(), "1 request(s) still running") {
		t.Fatalf("Close whose context ended with a request running: %v; want it to say so", err)
	}
}

// TestOutcomeAfterCloseIsNotDroppedSilently: a request that finished after
// its engine closed, the store unreachable and no JournalDir, had its
// outcome put in a journal nobody would send again, and Complete said nil:
// the client was answered, the outcome lost. Complete now says the store
// did not take it.
func TestOutcomeAfterCloseIsNotDroppedSilently(t *testing.T) {
	s := &flakyStore{Store: memstore.New()}
	eng, err := idem.New(idem.Config{Store: s, StoreTimeout: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	out, err := eng.Begin(ctx, charge)
	if err != nil || out.Decision != idem.Execute {
		t.Fatal(out.Decision, err)
	}
	short, cancel := context.WithTimeout(ctx, 10*time.Millisecond)
	defer cancel()
	eng.Close(short) // the request still runs: Close gives up waiting
	s.down.Store(true)
	if err := eng.Complete(ctx, out.Lease, &idem.Response{Status: 201}); !errors.Is(err, idem.ErrUnavailable) {
		t.Fatalf("Complete after Close, the store down, no journal directory: %v; want ErrUnavailable", err)
	}
}

// stallingCheckpoints is a store whose checkpoints are never answered (a
// dead connection, a row lock) while every other call is.
type stallingCheckpoints struct{ idem.Store }

func (s stallingCheckpoints) Checkpoint(ctx context.Context, p store.CheckpointParams) error {
	<-ctx.Done()
	return ctx.Err()
}

// TestCheckpointIsBoundedByTheStoreTimeout: a checkpoint the store does
// not answer is unavailable after the store timeout, like every other call
// the engine makes for a request. (It waited on the handler's context,
// which Hold cancels only when the lease is lost, and renewals kept it: the
// request hung for good.)
func TestCheckpointIsBoundedByTheStoreTimeout(t *testing.T) {
	eng, err := idem.New(idem.Config{Store: stallingCheckpoints{memstore.New()}, StoreTimeout: 100 * time.Millisecond, Lease: 3 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	out, err := eng.Begin(ctx, idem.BeginParams{Scope: "s", Key: "k", Fingerprint: payload})
	if err != nil || out.Decision != idem.Execute {
		t.Fatal(out.Decision, err)
	}
	held, stop := eng.Hold(context.WithoutCancel(ctx), out.Lease) // as httpidem gives the handler
	defer stop()
	done := make(chan error, 1)
	go func() { done <- eng.Checkpoint(held, out.Lease, "authorize", []byte("x")) }()
	if err := wait.Recv(t, done, 10*time.Second, "the checkpoint's end (store timeout 100ms)"); !errors.Is(err, idem.ErrUnavailable) {
		t.Fatalf("Checkpoint = %v, want ErrUnavailable", err)
	}
}

// stallingListings is a store whose listings and prunes are never answered
// (a partition with no reset: the driver waits for the OS's TCP timeout).
type stallingListings struct{ idem.Store }

func (stallingListings) List(ctx context.Context, p store.ListParams) (store.ScanResult, error) {
	<-ctx.Done()
	return store.ScanResult{}, ctx.Err()
}

func (stallingListings) Prune(ctx context.Context, p store.PruneParams) (int, error) {
	<-ctx.Done()
	return 0, ctx.Err()
}

// TestListAndPruneAreBoundedByTheStoreTimeout: an operator's listing (the
// console's records page, idem keys ls) and a prune are unavailable after
// the store timeout when the store does not answer, as Get and Scan are.
// (They waited on the caller's context: the console's page hung for as
// long as the store did, and every reload left another request waiting.)
func TestListAndPruneAreBoundedByTheStoreTimeout(t *testing.T) {
	eng, err := idem.New(idem.Config{Store: stallingListings{memstore.New()}, StoreTimeout: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 2)
	go func() {
		_, err := eng.List(ctx, idem.ListParams{})
		done <- err
	}()
	go func() {
		_, err := eng.Prune(ctx, idem.PruneOptions{})
		done <- err
	}()
	for range 2 {
		if err := wait.Recv(t, done, 10*time.Second, "the listing's and the prune's end (store timeout 100ms)"); !errors.Is(err, idem.ErrUnavailable) {
			t.Fatalf("got %v, want ErrUnavailable", err)
		}
	}
}

// notOpen is a store that has not opened yet: every call is refused before
// it leaves the process (as storeopen's while the server is unreachable).
type notOpen struct{ idem.Store }

func (notOpen) Acquire(context.Context, store.AcquireParams) (store.Record, error) {
	return store.Record{}, fmt.Errorf("%w: connection refused (%w)", idem.ErrUnavailable, store.ErrNotSent)
}

// TestUnsentCallIsNotRetried: a call the store says it never sent is not
// sent again until the store timeout: nothing was sent whose answer could
// be lost, so the caller is told unavailable at once. (The first request
// after a start with the store away waited the whole store timeout, 5 s by
// default, before its 503.)
func TestUnsentCallIsNotRetried(t *testing.T) {
	eng, err := idem.New(idem.Config{Store: notOpen{memstore.New()}, StoreTimeout: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		_, err := eng.Begin(ctx, idem.BeginParams{Scope: "s", Key: "k", Fingerprint: payload})
		done <- err
	}()
	if err := wait.Recv(t, done, 10*time.Second, "Begin's answer (store timeout 1m)"); !errors.Is(err, idem.ErrUnavailable) {
		t.Fatalf("Begin = %v, want ErrUnavailable", err)
	}
}

// pruneWatch tells of each Prune call; block makes them wait for their
// context (a store that does not answer).
type pruneWatch struct {
	idem.Store
	calls chan context.Context
	block bool
}

func (s pruneWatch) Prune(ctx context.Context, p store.PruneParams) (int, error) {
	select {
	case s.calls <- ctx:
	default:
	}
	if s.block {
		<-ctx.Done()
		return 0, ctx.Err()
	}
	return s.Store.Prune(ctx, p)
}

// TestPrunesInTheBackground: an engine deletes settled records whose
// retention has run out every PruneInterval, without a caller asking (the
// SQL stores kept them for ever: a proxy's table grew until an operator
// ran idem keys purge), and Close stops it, a prune under way included.
func TestPrunesInTheBackground(t *testing.T) {
	clock := storetest.NewClock(time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC))
	mem := memstore.New()
	watch := pruneWatch{Store: mem, calls: make(chan context.Context, 1)}
	e, out := started(t, idem.Config{Store: watch, Clock: clock, Retention: time.Hour, PruneInterval: 20 * time.Millisecond})
	if err := e.Complete(ctx, out.Lease, &idem.Response{Status: 201}); err != nil {
		t.Fatal(err)
	}
	get := func() error {
		_, err := mem.Get(ctx, store.GetParams{Key: "k", Now: clock.Now()})
		return err
	}
	if err := get(); err != nil {
		t.Fatalf("the completed record: %v", err)
	}
	wait.Recv(t, watch.calls, 10*time.Second, "a prune while the record is replayed")
	if err := get(); err != nil {
		t.Fatalf("pruned while replayed: %v", err)
	}
	clock.Advance(2 * time.Hour)
	wait.Until(t, 10*time.Second, "the expired record pruned (every 20ms)", func() bool {
		_, err := mem.Get(ctx, store.GetParams{Key: "k", Now: clock.Now().Add(-2 * time.Hour)})
		return errors.Is(err, idem.ErrNotFound)
	})
	if err := e.Close(ctx); err != nil {
		t.Fatal(err)
	}

	blocked := pruneWatch{Store: mem, calls: make(chan context.Context, 1), block: true}
	e, err := idem.New(idem.Config{Store: blocked, PruneInterval: 20 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	pruning := wait.Recv(t, blocked.calls, 10*time.Second, "a prune")
	closeCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := e.Close(closeCtx); err != nil {
		t.Fatal(err)
	}
	if pruning.Err() == nil || closeCtx.Err() != nil {
		t.Fatalf("Close returned (its context: %v) with the prune under way still running", closeCtx.Err())
	}
}

// refusedThenSilent refuses the first acquire (a lock not had in time)
// and leaves the others unanswered until their deadline.
type refusedThenSilent struct {
	idem.Store
	calls atomic.Int64
}

func (s *refusedThenSilent) Acquire(ctx context.Context, p store.AcquireParams) (store.Record, error) {
	if s.calls.Add(1) == 1 {
		return store.Record{}, store.Refused(errors.New("lock not available (SQLSTATE 55P03)"))
	}
	<-ctx.Done()
	return store.Record{}, ctx.Err()
}

// TestRefusalOutlivesALaterTimeout: a store that refused a call (it was
// reached: a row locked, writes refused) and then did not answer the
// retry in time still refused it: the error says so, and fail-open, which
// reads it, never runs the request. (The last attempt's timeout alone was
// returned, and fail-open ran it.)
func TestRefusalOutlivesALaterTimeout(t *testing.T) {
	s := &refusedThenSilent{Store: memstore.New()}
	e, err := idem.New(idem.Config{Store: s, StoreTimeout: 300 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	_, err = e.Begin(ctx, idem.BeginParams{Key: "k", Fingerprint: payload})
	if !errors.Is(err, idem.ErrUnavailable) || !errors.Is(err, idem.ErrRefused) || s.calls.Load() < 2 {
		t.Fatalf("Begin after %d attempts: %v; want ErrUnavailable and ErrRefused", s.calls.Load(), err)
	}
}
