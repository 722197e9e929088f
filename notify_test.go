package idem_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/testkit"
	"github.com/idemhq/idem/internal/wait"
	"github.com/idemhq/idem/store"
	"github.com/idemhq/idem/store/memstore"
	"github.com/idemhq/idem/store/storetest"
)

// sharedNotifier stands in for PostgreSQL LISTEN/NOTIFY between engines:
// both engines hold the same one.
type sharedNotifier struct{ waiters store.Waiters }

func (n *sharedNotifier) Subscribe(scope, key string) (<-chan struct{}, func()) {
	return n.waiters.Add(idem.KeyHash(scope, key))
}

func (n *sharedNotifier) Notify(ctx context.Context, scope, key string) error {
	n.waiters.Wake(idem.KeyHash(scope, key))
	return nil
}

func TestWaiters(t *testing.T) {
	var w store.Waiters
	a, cancelA := w.Add(idem.KeyHash("s", "a"))
	b, _ := w.Add(idem.KeyHash("s", "b"))
	w.Wake(idem.KeyHash("s", "a"))
	w.Wake(idem.KeyHash("s", "a")) // a second wake-up never blocks
	if len(a) != 1 || len(b) != 0 {
		t.Fatalf("after waking a: a holds %d, b holds %d", len(a), len(b))
	}
	wait.Recv(t, a, time.Second, "the wake-up already in a")
	cancelA()
	w.WakeAll()
	if len(a) != 0 || len(b) != 1 {
		t.Fatalf("after WakeAll: cancelled a holds %d, b holds %d", len(a), len(b))
	}
	if idem.KeyHash("a", "bc") == idem.KeyHash("ab", "c") || len(idem.KeyHash("s", "k")) != 32 {
		t.Fatal("KeyHash must keep scope and key apart and be 128 bits in hex")
	}
}

func awaitSetup(t *testing.T, cfg idem.Config) (*idem.Engine, idem.Lease) {
	t.Helper()
	cfg.Poll = time.Hour // only a notification can wake a waiter in time
	e, err := idem.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	out, err := e.Begin(ctx, idem.BeginParams{Key: "k", Fingerprint: payload})
	if err != nil || out.Decision != idem.Execute {
		t.Fatal(out.Decision, err)
	}
	return e, out.Lease
}

func await(e *idem.Engine, within time.Duration) <-chan idem.Outcome {
	ch := make(chan idem.Outcome, 1)
	go func() {
		out, err := e.Await(ctx, idem.BeginParams{Key: "k", Fingerprint: payload}, within)
		if err != nil {
			out.Decision = 0
		}
		ch <- out
	}()
	return ch
}

func TestAwaitWakesOnComplete(t *testing.T) {
	e, l := awaitSetup(t, idem.Config{Store: memstore.New()})
	waiters := []<-chan idem.Outcome{await(e, time.Minute), await(e, time.Minute), await(e, time.Minute)}
	if err := e.Complete(ctx, l, &idem.Response{Status: 201, Body: []byte("done")}); err != nil {
		t.Fatal(err)
	}
	for _, w := range waiters {
		if out := wait.Recv(t, w, 10*time.Second, "the waiter"); out.Decision != idem.Replay || string(out.Record.Response.Body) != "done" {
			t.Fatalf("waiter got %v, want the replay", out.Decision)
		}
	}
}

func TestAwaitRunsAfterRelease(t *testing.T) {
	e, l := awaitSetup(t, idem.Config{Store: memstore.New()})
	w := await(e, time.Minute)
	if err := e.Release(ctx, l); err != nil {
		t.Fatal(err)
	}
	if out := wait.Recv(t, w, 10*time.Second, "the waiter"); out.Decision != idem.Execute || out.Lease.Fence != 2 {
		t.Fatalf("waiter after release got %v fence %d, want to execute with fence 2", out.Decision, out.Lease.Fence)
	}
}

func TestAwaitGivesUp(t *testing.T) {
	e, _ := awaitSetup(t, idem.Config{Store: memstore.New()})
	start := time.Now()
	out := wait.Recv(t, await(e, 50*time.Millisecond), 10*time.Second, "the waiter to give up")
	if out.Decision != idem.InFlight || time.Since(start) < 50*time.Millisecond {
		t.Fatalf("got %v after %v, want in flight after the 50ms wait", out.Decision, time.Since(start))
	}
}

func TestAwaitWokenByOtherInstance(t *testing.T) {
	store := memstore.New()
	n := &sharedNotifier{}
	first, l := awaitSetup(t, idem.Config{Store: store, Notifier: n})
	second, err := idem.New(idem.Config{Store: store, Notifier: n, Poll: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	w := await(second, time.Minute)
	if err := first.Complete(ctx, l, &idem.Response{Status: 200}); err != nil {
		t.Fatal(err)
	}
	if out := wait.Recv(t, w, 10*time.Second, "the waiter on the other instance"); out.Decision != idem.Replay {
		t.Fatalf("waiter on the other instance got %v, want the replay", out.Decision)
	}
}

// announcing is a sharedNotifier that says when it has announced.
type announcing struct {
	sharedNotifier
	announced chan struct{}
}

func (n *announcing) Notify(ctx context.Context, scope, key string) error {
	n.sharedNotifier.Notify(ctx, scope, key)
	select {
	case n.announced <- struct{}{}:
	default:
	}
	return nil
}

// completeDuringLookup is a store whose second Acquire answers with what it
// read before another instance completed the record and announced it: the
// completion lands while the lookup's answer is on its way back.
type completeDuringLookup struct {
	idem.Store
	calls    int
	complete func()
}

func (s *completeDuringLookup) Acquire(ctx context.Context, p store.AcquireParams) (store.Record, error) {
	r, err := s.Store.Acquire(ctx, p)
	if s.calls++; s.calls == 2 {
		s.complete()
	}
	return r, err
}

// TestAwaitHearsACompletionDuringItsLookup: a waiter must be woken by a
// completion announced while its lookup was on the way, even with an hour
// between polls. (It waited for the next poll when it subscribed only after
// that lookup.)
func TestAwaitHearsACompletionDuringItsLookup(t *testing.T) {
	shared := memstore.New()
	announced := make(chan struct{}, 1)
	n := &announcing{announced: announced}
	first, l := awaitSetup(t, idem.Config{Store: shared, Notifier: n})
	racy := &completeDuringLookup{Store: shared, complete: func() {
		if err := first.Complete(ctx, l, &idem.Response{Status: 200}); err != nil {
			t.Error(err)
		}
		select { // on the waiter's goroutine: t.Error, not t.Fatal
		case <-announced:
		case <-time.After(10 * time.Second):
			t.Error("waited 10s for the completion to be announced; it was not")
		}
	}}
	second, err := idem.New(idem.Config{Store: racy, Notifier: n, Poll: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	if out := wait.Recv(t, await(second, time.Minute), 10*time.Second, "the waiter to be woken"); out.Decision != idem.Replay {
		t.Fatalf("waiter got %v, want the replay", out.Decision)
	}
}

// TestLocalWaitersWakeWhenTheOwnerLosesItsLease: duplicates wait in engine
// x for a request x runs; another engine settles the record under x's lease
// (an operator's resolve --force, the console) and x's owner then learns
// that its lease is lost. The waiters wake at once to the replay the store
// holds. (They waited on x's owner, which never notified them when its
// write was refused, and slept out their whole wait.)
func TestLocalWaitersWakeWhenTheOwnerLosesItsLease(t *testing.T) {
	shared := memstore.New()
	n := &sharedNotifier{}
	x, err := idem.New(idem.Config{Store: shared, Notifier: n, Poll: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	y, err := idem.New(idem.Config{Store: shared, Notifier: n})
	if err != nil {
		t.Fatal(err)
	}
	first, err := x.Begin(ctx, charge)
	if err != nil || first.Decision != idem.Execute {
		t.Fatal(first.Decision, err)
	}
	const waiters = 5
	outs := make(chan idem.Outcome, waiters)
	for range waiters {
		go func() {
			out, _ := x.Await(ctx, charge, time.Hour)
			outs <- out
		}()
	}
	wait.Until(t, 10*time.Second, "the duplicates to wait", func() bool { return x.Waiting(charge.Scope, charge.Key) == waiters })
	rec, err := y.Get(ctx, charge.Scope, charge.Key)
	if err != nil {
		t.Fatal(err)
	}
	if err := y.Settle(ctx, rec.Lease(), idem.Settlement{State: idem.StateCompleted, Response: &idem.Response{Status: 201, Body: []byte(`{"id":"ch_1"}`)}}); err != nil {
		t.Fatal(err)
	}
	if err := x.Complete(ctx, first.Lease, &idem.Response{Status: 500}); !errors.Is(err, idem.ErrLeaseLost) {
		t.Fatalf("the owner's Complete over the settlement: %v, want ErrLeaseLost", err)
	}
	for i := range waiters {
		if out := wait.Recv(t, outs, 10*time.Second, fmt.Sprintf("waiter %d's answer (each waits up to an hour)", i)); out.Decision != idem.Replay {
			t.Errorf("waiter %d: %v, want the replay the store holds", i, out.Decision)
		}
	}
}

// TestWaitersOnALocalOwnerWhoseLeaseRanOut: a request runs in engine x and
// its lease runs out unsettled (its handler is stuck in a call that ignores
// its context, and no renewal extends it). Duplicates wait in x. Engine y,
// sharing the store, the Notifier and the clock, finds the lease over (the
// record becomes UNKNOWN) and settles it COMPLETED. Await looks again when
// the running lease ends: the duplicates learn the record's state (UNKNOWN,
// or the replay) once the clock passes the lease's end, an hour before the
// end of their wait. (They slept their whole wait, since nobody in x asked
// the store while x's map said that x's own caller ran the work; then one
// answered InFlight though the store held the outcome.)
func TestWaitersOnALocalOwnerWhoseLeaseRanOut(t *testing.T) {
	clock := storetest.NewClock(time.Now())
	shared, n := memstore.New(), &sharedNotifier{}
	x, err := idem.New(idem.Config{Store: shared, Notifier: n, Clock: clock, Poll: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	y, err := idem.New(idem.Config{Store: shared, Notifier: n, Clock: clock, Poll: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	owner := charge
	owner.Lease = time.Minute
	first, err := x.Begin(ctx, owner)
	if err != nil || first.Decision != idem.Execute {
		t.Fatal(first.Decision, err)
	}
	const waiters, within = 3, time.Hour
	outs := make(chan idem.Outcome, waiters)
	for range waiters {
		go func() {
			out, _ := x.Await(ctx, charge, within)
			outs <- out
		}()
	}
	wait.Until(t, 10*time.Second, "the duplicates to wait", func() bool { return x.Waiting(charge.Scope, charge.Key) == waiters })
	if !clock.AwaitTimers(waiters, 10*time.Second) {
		t.Fatal("the duplicates did not start their pauses")
	}
	clock.Advance(owner.Lease + time.Millisecond) // the owner's lease has run out
	o, err := y.Begin(ctx, charge)
	if err != nil || o.Decision != idem.Uncertain {
		t.Fatalf("y after the lease: %v %v, want Uncertain", o.Decision, err)
	}
	rec, err := y.Get(ctx, charge.Scope, charge.Key)
	if err != nil {
		t.Fatal(err)
	}
	if err := y.Settle(ctx, rec.Lease(), idem.Settlement{State: idem.StateCompleted, Response: &idem.Response{Status: 201, Body: []byte("ch_1")}}); err != nil {
		t.Fatal(err)
	}
	for i := range waiters {
		// Real time: the engines' clock stands a minute past the start, an
		// hour short of the end of the duplicates' wait.
		out := wait.Recv(t, outs, 10*time.Second, fmt.Sprintf("waiter %d's answer after the owner's lease ran out", i))
		if out.Decision != idem.Replay && out.Decision != idem.Uncertain {
			t.Errorf("waiter %d: %v; want UNKNOWN or the replay the store holds", i, out.Decision)
		}
	}
}

// TestLocalWaitersHearASettlementThroughTheNotifier: a request runs in
// engine x, its lease running, its handler stuck; 1,000 duplicates wait in
// x. Another engine settles the record under x's lease (an operator's
// resolve --force) and announces it through the Notifier. The duplicates
// get the replay at once, and between them ask the store only a few times.
// (Nobody in x listened to the Notifier while x's own caller held the
// lease: they slept until the lease's end, or the end of their wait.)
func TestLocalWaitersHearASettlementThroughTheNotifier(t *testing.T) {
	shared, n := memstore.New(), &sharedNotifier{}
	s := &testkit.Counted{Store: shared}
	x, err := idem.New(idem.Config{Store: s, Notifier: n, Poll: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	y, err := idem.New(idem.Config{Store: shared, Notifier: n})
	if err != nil {
		t.Fatal(err)
	}
	owner := charge
	owner.Lease = time.Hour
	first, err := x.Begin(ctx, owner)
	if err != nil || first.Decision != idem.Execute {
		t.Fatal(first.Decision, err)
	}
	const waiters = 1000
	outs := make(chan idem.Outcome, waiters)
	for range waiters {
		go func() {
			out, _ := x.Await(ctx, charge, time.Hour)
			outs <- out
		}()
	}
	wait.Until(t, 10*time.Second, "the duplicates to wait, one of them listening to the Notifier", func() bool {
		return x.Waiting(charge.Scope, charge.Key) == waiters && n.waiters.Len(idem.KeyHash(charge.Scope, charge.Key)) == 1
	})
	rec, err := y.Get(ctx, charge.Scope, charge.Key)
	if err != nil {
		t.Fatal(err)
	}
	if err := y.Settle(ctx, rec.Lease(), idem.Settlement{State: idem.StateCompleted, Response: &idem.Response{Status: 201, Body: []byte(`{"id":"ch_1"}`)}}); err != nil {
		t.Fatal(err)
	}
	for i := range waiters {
		if out := wait.Recv(t, outs, 10*time.Second, fmt.Sprintf("waiter %d's answer (each waits up to an hour)", i)); out.Decision != idem.Replay {
			t.Fatalf("waiter %d: %v, want the replay the store holds", i, out.Decision)
		}
	}
	if calls := s.Calls(); calls > 10 {
		t.Fatalf("one request and 1,000 duplicates made %d store calls; want at most 10", calls)
	}
}

// TestLocalWaitersWithANotifierOutlastTheStoreAway: duplicates wait in x,
// which has a Notifier, for a request x runs, while the store is away. The
// one that listens to the Notifier asks the store once, and is not
// answered: that is no news while the owner here runs, and they all wait
// for it. Its outcome, kept in the journal, is their replay.
func TestLocalWaitersWithANotifierOutlastTheStoreAway(t *testing.T) {
	s := &flakyStore{Store: memstore.New()}
	n := &sharedNotifier{}
	x, err := idem.New(idem.Config{Store: s, Notifier: n, StoreTimeout: 100 * time.Millisecond, Poll: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	first, err := x.Begin(ctx, charge)
	if err != nil || first.Decision != idem.Execute {
		t.Fatal(first.Decision, err)
	}
	s.down.Store(true)
	const waiters = 5
	outs := make(chan idem.Outcome, waiters)
	for range waiters {
		go func() {
			out, _ := x.Await(ctx, charge, time.Minute)
			outs <- out
		}()
	}
	wait.Until(t, 10*time.Second, "the duplicates to wait, one of them listening, its lookup refused", func() bool {
		return x.Waiting(charge.Scope, charge.Key) == waiters && n.waiters.Len(idem.KeyHash(charge.Scope, charge.Key)) == 1 && s.attempts.Load() > 1
	})
	if err := x.Complete(ctx, first.Lease, &idem.Response{Status: 201, Body: []byte(`{"id":"ch_1"}`)}); err != nil {
		t.Fatalf("Complete with the store away: %v, want it kept", err)
	}
	for i := range waiters {
		if out := wait.Recv(t, outs, 10*time.Second, fmt.Sprintf("waiter %d's answer", i)); out.Decision != idem.Replay || string(out.Record.Response.Body) != `{"id":"ch_1"}` {
			t.Fatalf("waiter %d: %v, want the replay of the kept outcome", i, out.Decision)
		}
	}
}
