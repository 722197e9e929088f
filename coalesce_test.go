package idem_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/testkit"
	"github.com/idemhq/idem/internal/wait"
	"github.com/idemhq/idem/store"
	"github.com/idemhq/idem/store/memstore"
	"github.com/idemhq/idem/store/storetest"
)

// awaitAll starts n duplicates of charge waiting on eng, and returns once
// they all wait; outcomes waits for their answers.
func awaitAll(t *testing.T, eng *idem.Engine, n int) (outcomes func() []idem.Outcome) {
	t.Helper()
	outs := make([]idem.Outcome, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			outs[i], _ = eng.Await(context.Background(), charge, 30*time.Second)
		}()
	}
	wait.Until(t, 10*time.Second, "the duplicates to wait", func() bool { return eng.Waiting(charge.Scope, charge.Key) == n })
	return func() []idem.Outcome {
		wait.Done(t, 10*time.Second, "the duplicates to get the outcome", wg.Wait)
		return outs
	}
}

var charge = idem.BeginParams{Scope: "tenant", Key: "order-1", Fingerprint: testkit.Fingerprint(`{"amount":100}`)}

// TestReplaysComeFromTheCache: once a replay has read a completed outcome
// from the store, the next replays and a reused key's mismatch are answered
// without it, until the retention runs out.
func TestReplaysComeFromTheCache(t *testing.T) {
	clock := storetest.NewClock(time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC))
	s := &testkit.Counted{Store: memstore.New()}
	eng, err := idem.New(idem.Config{Store: s, Clock: clock, Retention: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	out, err := eng.Begin(ctx, charge)
	if err != nil || out.Decision != idem.Execute {
		t.Fatal(out.Decision, err)
	}
	if err := eng.Complete(ctx, out.Lease, &idem.Response{Status: 201, Body: []byte(`{"id":"ch_1"}`)}); err != nil {
		t.Fatal(err)
	}
	before := s.Calls() + 1 // the first replay reads the store
	for range 100 {
		out, err := eng.Begin(ctx, charge)
		if err != nil || out.Decision != idem.Replay || string(out.Record.Response.Body) != `{"id":"ch_1"}` || out.Record.Response.Header.Get(idem.HeaderExpires) == "" {
			t.Fatalf("replay: %v %+v %v", out.Decision, out.Record.Response, err)
		}
	}
	other := charge
	other.Fingerprint = testkit.Fingerprint(`{"amount":500}`)
	if out, err := eng.Begin(ctx, other); err != nil || out.Decision != idem.Mismatch || len(out.Diff) == 0 {
		t.Fatalf("another payload: %v %v %v", out.Decision, out.Diff, err)
	}
	if n := s.Calls() - before; n != 0 {
		t.Fatalf("100 replays and a mismatch made %d more store calls than the first replay; want none", n)
	}
	clock.Advance(time.Hour)
	if out, err := eng.Begin(ctx, charge); err != nil || out.Decision != idem.Execute {
		t.Fatalf("after the retention: %v %v; want a new run", out.Decision, err)
	}
}

// TestDuplicatesShareOneWait: 1,000 duplicates of a request running in this
// process wait for it without the store, and all get its outcome; the whole
// costs the first request's own store calls.
func TestDuplicatesShareOneWait(t *testing.T) {
	s := &testkit.Counted{Store: memstore.New()}
	eng, err := idem.New(idem.Config{Store: s})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	first, err := eng.Begin(ctx, charge)
	if err != nil || first.Decision != idem.Execute {
		t.Fatal(first.Decision, err)
	}
	const n = 1000
	outcomes := awaitAll(t, eng, n)
	if err := eng.Complete(ctx, first.Lease, &idem.Response{Status: 201, Body: []byte(`{"id":"ch_1"}`)}); err != nil {
		t.Fatal(err)
	}
	for i, out := range outcomes() {
		if out.Decision != idem.Replay || string(out.Record.Response.Body) != `{"id":"ch_1"}` {
			t.Fatalf("duplicate %d: %v", i, out.Decision)
		}
	}
	if calls := s.Calls(); calls > 10 {
		t.Fatalf("one request and 1,000 duplicates made %d store calls; want at most 10", calls)
	}
}

// TestDuplicatesOfARemoteRequestShareOnePoll: duplicates in this process of
// a request another process runs poll the store once between them, not
// once each.
func TestDuplicatesOfARemoteRequestShareOnePoll(t *testing.T) {
	shared := memstore.New()
	other, _ := idem.New(idem.Config{Store: shared})
	s := &testkit.Counted{Store: shared}
	eng, err := idem.New(idem.Config{Store: s, Poll: 20 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	first, err := other.Begin(ctx, charge)
	if err != nil || first.Decision != idem.Execute {
		t.Fatal(first.Decision, err)
	}
	const n = 200
	outcomes := awaitAll(t, eng, n)
	waited := s.Calls()
	polls := time.Now()
	if err := other.Complete(ctx, first.Lease, &idem.Response{Status: 201, Body: []byte(`{"id":"ch_1"}`)}); err != nil {
		t.Fatal(err)
	}
	for i, out := range outcomes() {
		if out.Decision != idem.Replay {
			t.Fatalf("duplicate %d: %v", i, out.Decision)
		}
	}
	// Every poll interval, one store call for all of them, give or take.
	budget := int64(2*time.Since(polls)/(20*time.Millisecond)) + 5
	t.Logf("%d duplicates: %d store calls to start waiting, %d more", n, waited, s.Calls()-waited)
	if waited > n/4 || s.Calls()-waited > budget {
		t.Fatalf("%d duplicates made %d store calls to start waiting and %d more; want one poll at a time between them",
			n, waited, s.Calls()-waited)
	}
}

// gated is a store whose first Acquire waits for the test.
type gated struct {
	*testkit.Counted
	entered, release chan struct{}
	once             sync.Once
}

func (g *gated) Acquire(ctx context.Context, p store.AcquireParams) (idem.Record, error) {
	first := false
	g.once.Do(func() { first = true })
	if first {
		close(g.entered)
		<-g.release
	}
	return g.Counted.Acquire(ctx, p)
}

// TestConcurrentRequestsShareOneAcquire: requests for a key that arrive
// while its acquire is on its way to the store take that acquire's answer:
// one runs, and the others are told it runs, for one store call.
func TestConcurrentRequestsShareOneAcquire(t *testing.T) {
	g := &gated{Counted: &testkit.Counted{Store: memstore.New()}, entered: make(chan struct{}), release: make(chan struct{})}
	eng, err := idem.New(idem.Config{Store: g})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	const n = 100
	outs := make([]idem.Outcome, n)
	var started, done sync.WaitGroup
	for i := range n {
		started.Add(1)
		done.Add(1)
		go func() {
			defer done.Done()
			started.Done()
			outs[i], _ = eng.Begin(ctx, charge)
		}()
	}
	wait.Recv(t, g.entered, 10*time.Second, "the first acquire")
	wait.Done(t, 10*time.Second, "every request to start", started.Wait)
	// Every other request waits for the first one's acquire (a request that
	// has started need not have got that far yet on a loaded machine).
	wait.Until(t, 10*time.Second, "the other requests to share the first acquire", func() bool {
		return testkit.Selecting("idem.(*Engine).Begin", "coalesce_test.go") == n-1
	})
	close(g.release)
	wait.Done(t, 10*time.Second, "every request's answer", done.Wait)
	decisions := map[idem.Decision]int{}
	for _, out := range outs {
		decisions[out.Decision]++
	}
	if decisions[idem.Execute] != 1 || decisions[idem.InFlight] != n-1 {
		t.Fatalf("decisions %v; want one execute and %d in flight", decisions, n-1)
	}
	if calls := g.Calls(); calls > 10 {
		t.Fatalf("%d concurrent requests made %d acquires; want them to share the first", n, calls)
	}
}

// payloadGate is a store whose acquires of one payload wait for the test.
type payloadGate struct {
	*testkit.Counted
	fingerprint      idem.Fingerprint
	entered, release chan struct{}
}

func (g *payloadGate) Acquire(ctx context.Context, p store.AcquireParams) (idem.Record, error) {
	if p.Fingerprint == g.fingerprint {
		g.entered <- struct{}{}
		<-g.release
	}
	return g.Counted.Acquire(ctx, p)
}

// TestAWaiterGivingUpLeavesTheOthersWaiting: when the duplicate that polls
// the store for the others gives up (its client went away) in the middle of
// a poll, here while it shares another request's acquire, that is its own
// answer: the others keep waiting, and get the outcome. (An error shared
// with them was their answer too: a false 503, or with FailOpen a second
// run while the first still ran.)
func TestAWaiterGivingUpLeavesTheOthersWaiting(t *testing.T) {
	shared := memstore.New()
	other, _ := idem.New(idem.Config{Store: shared}) // another instance runs the work
	reused := charge
	reused.Fingerprint = testkit.Fingerprint(`{"amount":500}`)
	g := &payloadGate{Counted: &testkit.Counted{Store: shared}, fingerprint: reused.Fingerprint,
		entered: make(chan struct{}), release: make(chan struct{})}
	eng, err := idem.New(idem.Config{Store: g, Poll: 10 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	first, err := other.Begin(ctx, charge)
	if err != nil || first.Decision != idem.Execute {
		t.Fatal(first.Decision, err)
	}
	pollerCtx, leave := context.WithCancel(ctx)
	defer leave()
	pollerDone := make(chan error, 1)
	go func() { _, err := eng.Await(pollerCtx, charge, 30*time.Second); pollerDone <- err }()
	// Its first lookup, then its first poll: it is the one that polls.
	wait.Until(t, 10*time.Second, "the first duplicate to poll", func() bool { return g.Calls() >= 2 })
	type answer struct {
		out idem.Outcome
		err error
	}
	staying := make(chan answer, 1)
	go func() { out, err := eng.Await(ctx, charge, 30*time.Second); staying <- answer{out, err} }()
	wait.Until(t, 10*time.Second, "the second duplicate to wait", func() bool { return eng.Waiting(charge.Scope, charge.Key) == 2 })

	// A request with the key and another payload: its acquire is on its
	// way, and the poller's next poll shares it.
	reusedDone := make(chan struct{})
	go func() { defer close(reusedDone); eng.Begin(ctx, reused) }()
	wait.Recv(t, g.entered, 10*time.Second, "the other payload's acquire")
	wait.Until(t, 10*time.Second, "the poller to share that acquire", func() bool {
		return testkit.Selecting("idem.(*Engine).Begin", "idem.(*Engine).awaitStep") == 1
	})
	leave()
	if err := wait.Recv(t, pollerDone, 10*time.Second, "the poller to give up"); !errors.Is(err, context.Canceled) {
		t.Fatalf("the poller that gave up: %v, want context.Canceled", err)
	}
	close(g.release)
	wait.Recv(t, reusedDone, 10*time.Second, "the other payload's answer")
	if err := other.Complete(ctx, first.Lease, &idem.Response{Status: 201, Body: []byte(`{"id":"ch_1"}`)}); err != nil {
		t.Fatal(err)
	}
	got := wait.Recv(t, staying, 10*time.Second, "the duplicate that stayed")
	if got.err != nil || got.out.Decision != idem.Replay {
		t.Fatalf("the duplicate that stayed: %v, %v; want the replay of the outcome", got.out.Decision, got.err)
	}
}
