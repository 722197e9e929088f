// Package storetest is the conformance suite every [idem.Store] passes
// unchanged. A store's own tests call [Run] with a function that makes a fresh,
// isolated store:
//
//	func TestConformance(t *testing.T) {
//		storetest.Run(t, func(t *testing.T) idem.Store { return memstore.New() })
//	}
//
// A store that several processes can share also calls [RunInstances], with
// two instances on one backend; a networked one [RunFaults]; a notifier
// [RunNotifier].
//
// Time is moved by hand: every store call carries the engine's clock reading,
// so no case sleeps. Times the suite uses are whole milliseconds, so a store
// must keep at least millisecond precision.
package storetest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"reflect"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/testkit"
	"github.com/idemhq/idem/internal/wait"
	"github.com/idemhq/idem/store"
)

// Racers is how many goroutines race for one key in the concurrency cases of
// [RunInstances] and in those of [Run] that race Begins through the engine.
// (The cases of Run that race raw store calls use fewer, so that a slow
// backend answers them quickly: those calls all reach the store, where an
// engine sends one acquire of a key at a time.)
const Racers = 200

// Run runs every case of the suite as a parallel subtest. newStore is called
// once per subtest and must return an empty store of its own (own schema, key
// prefix or file), releasing it with t.Cleanup.
func Run(t *testing.T, newStore func(t *testing.T) idem.Store) {
	cases := []struct {
		name string
		fn   func(t *testing.T, h *harness)
	}{
		{"AcquireCreatesRecord", testAcquireCreatesRecord},
		{"ConcurrentAcquireOneWinner", testConcurrentAcquireOneWinner},
		{"ConcurrentTakeoverOneWinner", testConcurrentTakeoverOneWinner},
		{"ConcurrentExpiryNeverExecutes", testConcurrentExpiryNeverExecutes},
		{"ConcurrentDistinctKeys", testConcurrentDistinctKeys},
		{"ConcurrentStoreAcquiresOneWinner", testConcurrentStoreAcquiresOneWinner},
		{"ConcurrentSettlementsOneLands", testConcurrentSettlementsOneLands},
		{"StaleTokenLosesEveryWrite", testStaleTokenLosesEveryWrite},
		{"RepeatedAcquireKeepsLease", testRepeatedAcquireKeepsLease},
		{"UpdatedSaysWhenItChanged", testUpdatedSaysWhenItChanged},
		{"FinishRepeatSucceeds", testFinishRepeatSucceeds},
		{"RenewExtendsLease", testRenewExtendsLease},
		{"LeaseHoldsToItsLastMillisecond", testLeaseHoldsToItsLastMillisecond},
		{"ExpiredLeaseBecomesUnknown", testExpiredLeaseBecomesUnknown},
		{"ExpiredLeaseStillSettles", testExpiredLeaseStillSettles},
		{"TakeoverWhenDeclared", testTakeoverWhenDeclared},
		{"ReplayIsByteIdentical", testReplayIsByteIdentical},
		{"CheckpointsLeaveRoomForTheOutcome", testCheckpointsLeaveRoomForTheOutcome},
		{"ReleaseFreesKey", testReleaseFreesKey},
		{"MarkUnknown", testMarkUnknown},
		{"RetentionExpiresOutcome", testRetentionExpiresOutcome},
		{"PruneKeepsLiveAndUnsettled", testPruneKeepsLiveAndUnsettled},
		{"PruneSparesKeysRunAgain", testPruneSparesKeysRunAgain},
		{"ScanFindsStaleRecords", testScanFindsStaleRecords},
		{"ScopesIsolateKeys", testScopesIsolateKeys},
		{"KeysStoredAsSent", testKeysStoredAsSent},
		{"InvalidInput", testInvalidInput},
		{"MissingRecord", testMissingRecord},
		{"CanceledContext", testCanceledContext},
		{"CheckpointsRecorded", testCheckpointsRecorded},
		{"CheckpointEndsTakeover", testCheckpointEndsTakeover},
		{"CheckpointNeedsRunningLease", testCheckpointNeedsRunningLease},
		{"DurabilityReported", testDurabilityReported},
		{"ScanCursorsAreOwn", testScanCursorsAreOwn},
		{"ScanWhileSettling", testScanWhileSettling},
		{"ListFiltersRecords", testListFiltersRecords},
		{"ListCursorsAreOwn", testListCursorsAreOwn},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			store := newStore(t)
			clock := NewClock(epoch)
			eng, err := idem.New(idem.Config{Store: store, Clock: clock, Lease: lease, Retention: retention})
			if err != nil {
				t.Fatal(err)
			}
			c.fn(t, &harness{store: store, clock: clock, eng: eng, newStore: newStore})
		})
	}
}

const (
	lease     = 30 * time.Second
	retention = time.Hour
)

// epoch is the time every case starts at: whole milliseconds.
var epoch = time.Date(2030, 1, 2, 3, 4, 5, 6e6, time.UTC)

// Clock is a clock moved by hand, safe for concurrent use. Its timers
// ([Clock.After]) fire when [Clock.Advance] moves it past their time, so a
// test drives the engine's lease renewals and waits without sleeping.
type Clock struct {
	mu      sync.Mutex
	now     time.Time
	timers  []clockTimer
	set     int           // timers set so far
	changed chan struct{} // closed and replaced whenever a timer is set
}

type clockTimer struct {
	at time.Time
	ch chan time.Time
}

// NewClock returns a clock that reads start until moved.
func NewClock(start time.Time) *Clock { return &Clock{now: start, changed: make(chan struct{})} }

// Now implements [idem.Clock].
func (c *Clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

// After implements [idem.Clock]: the channel receives once the clock has
// been advanced by d or more.
func (c *Clock) After(d time.Duration) <-chan time.Time {
	ch := make(chan time.Time, 1)
	c.mu.Lock()
	defer c.mu.Unlock()
	c.set++
	close(c.changed)
	c.changed = make(chan struct{})
	if d <= 0 {
		ch <- c.now
		return ch
	}
	c.timers = append(c.timers, clockTimer{at: c.now.Add(d), ch: ch})
	return ch
}

// Advance moves the clock forward by d and fires the timers that are due.
func (c *Clock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
	kept := c.timers[:0]
	for _, t := range c.timers {
		if t.at.After(c.now) {
			kept = append(kept, t)
			continue
		}
		t.ch <- c.now
	}
	c.timers = kept
}

// Timers reports how many timers have been set on the clock so far.
func (c *Clock) Timers() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.set
}

// AwaitTimers waits until n timers in all have been set on the clock, and
// reports false when that has not happened within d (real time). A test
// calls it before Advance to know that the code under test is waiting.
func (c *Clock) AwaitTimers(n int, d time.Duration) bool {
	deadline := time.NewTimer(d)
	defer deadline.Stop()
	for {
		c.mu.Lock()
		set, changed := c.set, c.changed
		c.mu.Unlock()
		if set >= n {
			return true
		}
		select {
		case <-changed:
		case <-deadline.C:
			return false
		}
	}
}

type harness struct {
	store    idem.Store
	clock    *Clock
	eng      *idem.Engine
	newStore func(t *testing.T) idem.Store
}

var ctx = context.Background()

func (h *harness) begin(t *testing.T, scope, key string, f idem.Fingerprint) idem.Outcome {
	t.Helper()
	out, err := h.eng.Begin(ctx, idem.BeginParams{Scope: scope, Key: key, Fingerprint: f})
	if err != nil {
		t.Fatalf("Begin(%q, %q): %v", scope, key, err)
	}
	return out
}

func (h *harness) mustExecute(t *testing.T, scope, key string, f idem.Fingerprint) idem.Lease {
	t.Helper()
	out := h.begin(t, scope, key, f)
	if out.Decision != idem.Execute {
		t.Fatalf("Begin(%q, %q) = %v, want execute (record %+v)", scope, key, out.Decision, out.Record)
	}
	return out.Lease
}

func (h *harness) expect(t *testing.T, scope, key string, f idem.Fingerprint, want idem.Decision) idem.Outcome {
	t.Helper()
	out := h.begin(t, scope, key, f)
	if out.Decision != want {
		t.Fatalf("Begin(%q, %q) = %v, want %v (record %+v)", scope, key, out.Decision, want, out.Record)
	}
	return out
}

func (h *harness) get(t *testing.T, scope, key string) idem.Record {
	t.Helper()
	r, err := h.store.Get(ctx, store.GetParams{Scope: scope, Key: key, Now: h.clock.Now()})
	if err != nil {
		t.Fatalf("Get(%q, %q): %v", scope, key, err)
	}
	return r
}

func (h *harness) complete(t *testing.T, l idem.Lease, resp *idem.Response) {
	t.Helper()
	if err := h.eng.Complete(ctx, l, resp); err != nil {
		t.Fatalf("Complete(%q): %v", l.Key, err)
	}
}

// finishParams returns the store params with which the owner of l settles
// it as state (with resp, for COMPLETED) at the clock's time, kept for the
// suite's retention when terminal, and marked a Repeat as the engine marks
// its owners' writes. A writer that borrows the token (a reconciler) clears
// Repeat.
func (h *harness) finishParams(l idem.Lease, state idem.State, resp *idem.Response) idem.FinishParams {
	p := idem.FinishParams{Scope: l.Scope, Key: l.Key, Token: l.Token, Now: h.clock.Now(), State: state, Response: resp, Repeat: true}
	if state.Terminal() {
		p.Expires = p.Now.Add(retention)
	}
	return p
}

// pruneAll prunes the store at the clock's time until a call deletes
// nothing.
func (h *harness) pruneAll(t *testing.T) {
	t.Helper()
	for range 100 {
		n, err := h.store.Prune(ctx, store.PruneParams{Now: h.clock.Now()})
		if err != nil {
			t.Fatalf("Prune: %v", err)
		}
		if n == 0 {
			return
		}
	}
	t.Fatal("Prune still deletes records after 100 calls")
}

func wantErr(t *testing.T, what string, err, target error) {
	t.Helper()
	if !errors.Is(err, target) {
		t.Fatalf("%s: err = %v, want %v", what, err, target)
	}
}

func okResponse(body string) *idem.Response {
	return &idem.Response{Status: 201, Header: http.Header{"Content-Type": {"application/json"}}, Body: []byte(body)}
}

// kept is resp as a store keeps it after the engine completed a record with
// it: without the [idem.HeaderExpires] that the engine set on resp for the
// first answer (and sets on replays from the record's expiry).
func kept(resp *idem.Response) *idem.Response {
	c := *resp
	c.Header = resp.Header.Clone()
	c.Header.Del(idem.HeaderExpires)
	if len(c.Header) == 0 {
		c.Header = nil
	}
	return &c
}

func sameResponse(t *testing.T, got, want *idem.Response) {
	t.Helper()
	if got == nil || want == nil {
		if got != want {
			t.Fatalf("response = %+v, want %+v", got, want)
		}
		return
	}
	if got.Status != want.Status || got.BodyOmitted != want.BodyOmitted {
		t.Fatalf("status = %d (body omitted %v), want %d (%v)", got.Status, got.BodyOmitted, want.Status, want.BodyOmitted)
	}
	if len(got.Header) != 0 || len(want.Header) != 0 {
		if !reflect.DeepEqual(got.Header, want.Header) {
			t.Fatalf("header = %v, want %v", got.Header, want.Header)
		}
	}
	if !bytes.Equal(got.Body, want.Body) {
		t.Fatalf("body differs: got %d bytes, want %d bytes", len(got.Body), len(want.Body))
	}
}

// race runs fn on Racers goroutines released together, and returns their
// outcomes.
func race(t *testing.T, fn func() (idem.Outcome, error)) []idem.Outcome {
	t.Helper()
	outs, errs, _ := raceEach(t, Racers, func(int) (idem.Outcome, error) { return fn() })
	for _, err := range errs {
		if err != nil {
			t.Fatalf("racer: %v", err)
		}
	}
	return outs
}

// raceEach runs fn(i) for each i below n, on goroutines started together,
// and returns their results and errors by i, and the most calls of fn that
// were under way at once. The goroutines wait for the start by yielding, not
// parked on a channel, so that one is running on each thread when it comes
// (released from a channel, they are all queued on the releasing thread).
func raceEach[T any](t *testing.T, n int, fn func(i int) (T, error)) ([]T, []error, int) {
	t.Helper()
	outs := make([]T, n)
	errs := make([]error, n)
	var started atomic.Bool
	var under, most atomic.Int32
	var ready, wg sync.WaitGroup
	for i := range n {
		ready.Add(1)
		wg.Add(1)
		go func() {
			defer wg.Done()
			ready.Done()
			for !started.Load() {
				runtime.Gosched()
			}
			now := under.Add(1)
			for m := most.Load(); now > m && !most.CompareAndSwap(m, now); m = most.Load() {
			}
			outs[i], errs[i] = fn(i)
			under.Add(-1)
		}()
	}
	ready.Wait() // every goroutine is waiting for the start
	started.Store(true)
	wait.Done(t, 2*time.Minute, "the concurrent goroutines to finish", wg.Wait)
	return outs, errs, int(most.Load())
}

func count(outs []idem.Outcome) map[idem.Decision]int {
	m := map[idem.Decision]int{}
	for _, o := range outs {
		m[o.Decision]++
	}
	return m
}

func testAcquireCreatesRecord(t *testing.T, h *harness) {
	now := h.clock.Now()
	l := h.mustExecute(t, "s", "k1", testkit.Fingerprint("a"))
	if len(l.Token) != 32 {
		t.Errorf("token %q is not 128 bits in hex", l.Token)
	}
	if l.Fence != 1 || !l.Expires.Equal(now.Add(lease)) {
		t.Errorf("lease = %+v, want fence 1 expiring at %v", l, now.Add(lease))
	}
	r := h.get(t, "s", "k1")
	if r.Scope != "s" || r.Key != "k1" || r.State != idem.StateInProgress || r.Fingerprint != testkit.Fingerprint("a") ||
		r.Token != l.Token || r.Fence != 1 || !r.LeaseExpires.Equal(l.Expires) || r.TakeoverSafe ||
		r.Response != nil || !r.Created.Equal(now) || !r.Updated.Equal(now) || !r.Expires.IsZero() {
		t.Errorf("stored record = %+v", r)
	}
}

// testConcurrentAcquireOneWinner: Racers Begins of one key through one
// engine; one executes, every other is told the work is in flight, and,
// once it completed, replayed or told of a mismatch. One engine sends one
// acquire of a key to the store at a time (it answers the Begins that come
// meanwhile with that acquire's answer), so this and the other engine races
// check the decisions the engine makes on the store's records, not the
// store's atomicity: ConcurrentStoreAcquiresOneWinner sends the store many
// acquires at once.
func testConcurrentAcquireOneWinner(t *testing.T, h *harness) {
	outs := race(t, func() (idem.Outcome, error) {
		return h.eng.Begin(ctx, idem.BeginParams{Scope: "s", Key: "hot", Fingerprint: testkit.Fingerprint("a")})
	})
	c := count(outs)
	if c[idem.Execute] != 1 || c[idem.InFlight] != Racers-1 {
		t.Fatalf("decisions = %v, want 1 execute and %d in flight", c, Racers-1)
	}
	var winner idem.Lease
	for _, o := range outs {
		if o.Decision == idem.Execute {
			winner = o.Lease
		} else if o.RetryAfter < time.Second {
			t.Fatalf("in-flight RetryAfter = %v, want at least 1s", o.RetryAfter)
		}
	}
	resp := okResponse(`{"id":"ch_1"}`)
	h.complete(t, winner, resp)

	for _, o := range race(t, func() (idem.Outcome, error) {
		return h.eng.Begin(ctx, idem.BeginParams{Scope: "s", Key: "hot", Fingerprint: testkit.Fingerprint("a")})
	}) {
		if o.Decision != idem.Replay {
			t.Fatalf("after completion: decision %v, want replay", o.Decision)
		}
		sameResponse(t, o.Record.Response, resp)
	}
	for _, o := range race(t, func() (idem.Outcome, error) {
		return h.eng.Begin(ctx, idem.BeginParams{Scope: "s", Key: "hot", Fingerprint: testkit.Fingerprint("b")})
	}) {
		if o.Decision != idem.Mismatch || !reflect.DeepEqual(o.Diff, []string{"body"}) {
			t.Fatalf("other payload: decision %v diff %v, want mismatch in body", o.Decision, o.Diff)
		}
	}
}

// testConcurrentTakeoverOneWinner: Racers Begins through one engine of a
// key whose takeover-safe lease ran out; one takes it over, with the next
// fence and a new token, and every other is told it is in flight. (See
// testConcurrentAcquireOneWinner on what an engine race shows.)
func testConcurrentTakeoverOneWinner(t *testing.T, h *harness) {
	first, err := h.eng.Begin(ctx, idem.BeginParams{Scope: "s", Key: "tx", Fingerprint: testkit.Fingerprint("a"), TakeoverSafe: true})
	if err != nil || first.Decision != idem.Execute {
		t.Fatalf("first Begin = %v, %v", first.Decision, err)
	}
	h.clock.Advance(lease + time.Millisecond)
	outs := race(t, func() (idem.Outcome, error) {
		return h.eng.Begin(ctx, idem.BeginParams{Scope: "s", Key: "tx", Fingerprint: testkit.Fingerprint("a"), TakeoverSafe: true})
	})
	c := count(outs)
	if c[idem.Execute] != 1 || c[idem.InFlight] != Racers-1 {
		t.Fatalf("decisions after expiry = %v, want exactly one takeover", c)
	}
	for _, o := range outs {
		if o.Decision == idem.Execute && (o.Lease.Fence != 2 || o.Lease.Token == first.Lease.Token) {
			t.Fatalf("takeover lease = %+v, want fence 2 and a new token", o.Lease)
		}
	}
}

// testConcurrentExpiryNeverExecutes: Racers Begins through one engine of a
// key whose lease ran out, not takeover-safe; none executes, every one is
// told the outcome is uncertain. (See testConcurrentAcquireOneWinner on what
// an engine race shows.)
func testConcurrentExpiryNeverExecutes(t *testing.T, h *harness) {
	h.mustExecute(t, "s", "crash", testkit.Fingerprint("a"))
	h.clock.Advance(lease)
	c := count(race(t, func() (idem.Outcome, error) {
		return h.eng.Begin(ctx, idem.BeginParams{Scope: "s", Key: "crash", Fingerprint: testkit.Fingerprint("a")})
	}))
	if c[idem.Uncertain] != Racers {
		t.Fatalf("decisions after an expired lease = %v, want all %d uncertain", c, Racers)
	}
}

func testConcurrentDistinctKeys(t *testing.T, h *harness) {
	var wg sync.WaitGroup
	errs := make(chan error, Racers)
	for i := range Racers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			key := fmt.Sprintf("key-%d", i)
			body := fmt.Sprintf(`{"n":%d}`, i)
			out, err := h.eng.Begin(ctx, idem.BeginParams{Key: key, Fingerprint: testkit.Fingerprint(body)})
			if err != nil || out.Decision != idem.Execute {
				errs <- fmt.Errorf("%s: Begin = %v, %v", key, out.Decision, err)
				return
			}
			if err := h.eng.Complete(ctx, out.Lease, okResponse(body)); err != nil {
				errs <- fmt.Errorf("%s: Complete: %v", key, err)
				return
			}
			again, err := h.eng.Begin(ctx, idem.BeginParams{Key: key, Fingerprint: testkit.Fingerprint(body)})
			if err != nil || again.Decision != idem.Replay || string(again.Record.Response.Body) != body {
				errs <- fmt.Errorf("%s: replay = %v, %v", key, again.Decision, err)
			}
		}()
	}
	wait.Done(t, 2*time.Minute, "the concurrent goroutines to finish", wg.Wait)
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

func testStaleTokenLosesEveryWrite(t *testing.T, h *harness) {
	l := h.mustExecute(t, "s", "k", testkit.Fingerprint("a"))
	forged := l
	forged.Token = strings.Repeat("0", 32)
	_, err := h.eng.Renew(ctx, forged)
	wantErr(t, "Renew with a forged token", err, idem.ErrLeaseLost)
	wantErr(t, "Complete with a forged token", h.eng.Complete(ctx, forged, okResponse("x")), idem.ErrLeaseLost)
	wantErr(t, "Release with a forged token", h.eng.Release(ctx, forged), idem.ErrLeaseLost)
	wantErr(t, "MarkUnknown with a forged token", h.eng.MarkUnknown(ctx, forged), idem.ErrLeaseLost)
	if r := h.get(t, "s", "k"); r.State != idem.StateInProgress || r.Token != l.Token {
		t.Fatalf("forged writes changed the record: %+v", r)
	}

	resp := okResponse("done")
	h.complete(t, l, resp)
	_, err = h.eng.Renew(ctx, l)
	wantErr(t, "Renew after Complete", err, idem.ErrLeaseLost)
	wantErr(t, "second Complete", h.eng.Complete(ctx, l, okResponse("other")), idem.ErrLeaseLost)
	wantErr(t, "Release after Complete", h.eng.Release(ctx, l), idem.ErrLeaseLost)
	wantErr(t, "MarkUnknown after Complete", h.eng.MarkUnknown(ctx, l), idem.ErrLeaseLost)
	r := h.get(t, "s", "k")
	if r.State != idem.StateCompleted {
		t.Fatalf("state = %v, want completed", r.State)
	}
	sameResponse(t, r.Response, kept(resp))
}

// testRepeatedAcquireKeepsLease: an Acquire whose answer was lost is sent
// again with the same params, token included (the engine retries an acquire
// that got no answer, and its journal releases the token if it never learns
// the answer). The repeat must be answered as the acquire that landed was:
// the record under that token, in progress, with the same fence and lease,
// so that the caller holds the lease and runs the work once, instead of
// finding its own record held by "somebody else" and answering 409 for a
// request nobody runs. Whatever the first acquire found: no record, a
// released one, an expired one, or a lease to take over.
func testRepeatedAcquireKeepsLease(t *testing.T, h *harness) {
	fp := testkit.Fingerprint("a")
	for _, c := range []struct {
		before       string
		takeoverSafe bool
		fence        int64
		prepare      func(key string)
	}{
		{"no record", false, 1, func(string) {}},
		{"a released record", false, 2, func(key string) {
			if err := h.eng.Release(ctx, h.mustExecute(t, "s", key, fp)); err != nil {
				t.Fatal(err)
			}
		}},
		{"an expired record", false, 1, func(key string) {
			h.complete(t, h.mustExecute(t, "s", key, fp), okResponse("x"))
			h.clock.Advance(retention)
		}},
		{"a lease to take over", true, 2, func(key string) {
			if out, err := h.eng.Begin(ctx, idem.BeginParams{Scope: "s", Key: key, Fingerprint: fp, TakeoverSafe: true}); err != nil || out.Decision != idem.Execute {
				t.Fatalf("Begin(%q) = %v, %v; want execute", key, out.Decision, err)
			}
			h.clock.Advance(lease)
		}},
	} {
		key := "after " + c.before
		c.prepare(key)
		tok, err := store.NewToken()
		if err != nil {
			t.Fatal(err)
		}
		now := h.clock.Now()
		p := store.AcquireParams{Scope: "s", Key: key, Fingerprint: fp, Token: tok, Now: now, LeaseExpires: now.Add(lease), TakeoverSafe: c.takeoverSafe}
		first, err := h.store.Acquire(ctx, p)
		if err != nil || first.Token != tok || first.State != idem.StateInProgress || first.Fence != c.fence {
			t.Fatalf("%s: Acquire = %+v, %v; want the lease, fence %d", key, first, err, c.fence)
		}
		h.clock.Advance(time.Second) // the retry comes later; its params are the same
		again, err := h.store.Acquire(ctx, p)
		if err != nil || again.Token != tok || again.State != idem.StateInProgress || again.Fence != first.Fence || !again.LeaseExpires.Equal(first.LeaseExpires) {
			t.Fatalf("%s: the same Acquire again = %+v, %v; want the lease it granted, %+v", key, again, err, first)
		}
	}
}

// testUpdatedSaysWhenItChanged: a record's Updated is the time of the call
// that last changed it: a renewal, a takeover, an acquire that made an
// expired lease UNKNOWN, its owner's MarkUnknown, a completion, a release,
// a reconciler's settlement; and a re-run after a release is a new record,
// created and updated then. The reconciler's grace for an UNKNOWN record
// starts at Updated (reconcile.Abandoned): a store that left it at the
// record's creation would have a record that a retry made UNKNOWN a moment
// ago settled at once, while its owner may still store the outcome.
func testUpdatedSaysWhenItChanged(t *testing.T, h *harness) {
	fp := testkit.Fingerprint("a")
	updated := func(key, after string) {
		t.Helper()
		if r := h.get(t, "s", key); !r.Updated.Equal(h.clock.Now()) {
			t.Errorf("after %s: updated %v; want %v, the time of that call", after, r.Updated, h.clock.Now())
		}
	}
	renewed := h.mustExecute(t, "s", "renewed", fp)
	h.mustExecute(t, "s", "made unknown", fp)
	marked := h.mustExecute(t, "s", "marked unknown", fp)
	completed := h.mustExecute(t, "s", "completed", fp)
	released := h.mustExecute(t, "s", "released", fp)
	reconciled := h.mustExecute(t, "s", "reconciled", fp)
	if out, err := h.eng.Begin(ctx, idem.BeginParams{Scope: "s", Key: "taken over", Fingerprint: fp, TakeoverSafe: true}); err != nil || out.Decision != idem.Execute {
		t.Fatalf("Begin = %v, %v; want execute", out.Decision, err)
	}

	h.clock.Advance(time.Second)
	if _, err := h.eng.Renew(ctx, renewed); err != nil {
		t.Fatal(err)
	}
	updated("renewed", "a renewal")
	if err := h.eng.MarkUnknown(ctx, marked); err != nil {
		t.Fatal(err)
	}
	updated("marked unknown", "its owner's MarkUnknown")
	h.complete(t, completed, okResponse("x"))
	updated("completed", "a completion")
	if err := h.eng.Release(ctx, released); err != nil {
		t.Fatal(err)
	}
	updated("released", "a release")

	h.clock.Advance(lease)
	h.expect(t, "s", "made unknown", fp, idem.Uncertain)
	if r := h.get(t, "s", "made unknown"); r.State != idem.StateUnknown {
		t.Fatalf("record after its lease ran out = %+v; want unknown", r)
	}
	updated("made unknown", "an acquire that made the expired lease unknown")
	if out, err := h.eng.Begin(ctx, idem.BeginParams{Scope: "s", Key: "taken over", Fingerprint: fp, TakeoverSafe: true}); err != nil || out.Decision != idem.Execute {
		t.Fatalf("Begin after the takeover-safe lease ran out = %v, %v; want a takeover", out.Decision, err)
	}
	updated("taken over", "a takeover")

	h.clock.Advance(time.Second)
	settle := h.finishParams(reconciled, idem.StateFailed, nil)
	settle.Repeat = false // a reconciler borrows the token
	wantErr(t, "a reconciler's release", h.store.Finish(ctx, settle), nil)
	updated("reconciled", "a reconciler's release")
	settle = h.finishParams(marked, idem.StateCompleted, okResponse("late"))
	settle.Repeat = false
	wantErr(t, "a reconciler's settlement of an unknown record", h.store.Finish(ctx, settle), nil)
	updated("marked unknown", "a reconciler's settlement of the unknown record")
	h.mustExecute(t, "s", "released", fp)
	if r := h.get(t, "s", "released"); !r.Created.Equal(h.clock.Now()) {
		t.Errorf("a re-run after a release: created %v; want %v, a new record", r.Created, h.clock.Now())
	}
	updated("released", "a re-run after a release")
}

// otherHeaders are changes to a response's header that make it another
// response: change reports false where it finds nothing to change.
var otherHeaders = []struct {
	what   string
	change func(http.Header) bool
}{
	{"another header", func(h http.Header) bool { h.Set("X-Other", "1"); return true }},
	{"another value of a header", func(h http.Header) bool {
		for _, name := range slices.Sorted(maps.Keys(h)) {
			if len(h[name]) > 0 {
				h[name] = append([]string{h[name][0] + "; other"}, h[name][1:]...)
				return true
			}
		}
		return false
	}},
	{"a header under another name", func(h http.Header) bool {
		for _, name := range slices.Sorted(maps.Keys(h)) {
			values := h[name]
			delete(h, name)
			h["X-Other"] = values
			return true
		}
		return false
	}},
	{"the values of a header in another order", func(h http.Header) bool {
		for _, name := range slices.Sorted(maps.Keys(h)) {
			if len(h[name]) > 1 {
				slices.Reverse(h[name])
				return true
			}
		}
		return false
	}},
	{"a header with one value fewer", func(h http.Header) bool {
		for _, name := range slices.Sorted(maps.Keys(h)) {
			if len(h[name]) > 1 {
				h[name] = h[name][:len(h[name])-1]
				return true
			}
		}
		return false
	}},
}

// testFinishRepeatSucceeds: an owner whose Finish got no answer (the reply
// was lost, the connection died after the commit, the driver timed out)
// sends the very same Finish again, marked Repeat. The repeat must succeed,
// whether or not the first one landed, rather than report the lease lost;
// any other outcome under the same token (another status, body, header,
// value of a header, or order of a header's values) is still refused, so the
// repeat can never overwrite anything. Unmarked, it is refused: two writers
// borrowing one token (reconcilers) must not both succeed.
func testFinishRepeatSucceeds(t *testing.T, h *harness) {
	finish := h.finishParams
	bodies := map[string]*idem.Response{"small": okResponse(`{"id":"ch_1"}`), "no header": {Status: 204},
		// HTTP allows any byte in a header value (a Latin-1 file name):
		// one that is no UTF-8 is kept as it is, and its repeat lands.
		"latin-1 header": {Status: 200, Header: http.Header{"Content-Disposition": {"attachment; filename=\"caf\xe9.pdf\""}}, Body: []byte("%PDF")},
		"multi-value header": {Status: 200, Header: http.Header{"Content-Type": {"application/json"},
			"Link": {`</orders?page=1>; rel="prev"`, `</orders?page=3>; rel="next"`}}, Body: []byte(`{"page":2}`)}}
	if limit := store.MaxBody(h.store); limit < 8<<20 {
		bodies["over the store's limit"] = &idem.Response{Status: 201, Body: bytes.Repeat([]byte("x"), limit+1)}
	}
	for name, resp := range bodies {
		t.Run(name, func(t *testing.T) {
			l := h.mustExecute(t, "s", "completed "+name, testkit.Fingerprint("a"))
			p := finish(l, idem.StateCompleted, resp)
			wantErr(t, "Finish", h.store.Finish(ctx, p), nil)
			h.clock.Advance(time.Second)
			wantErr(t, "the same Finish again", h.store.Finish(ctx, p), nil)
			strict := p
			strict.Repeat = false
			wantErr(t, "the same Finish again, not marked a repeat", h.store.Finish(ctx, strict), idem.ErrLeaseLost)
			other := *resp
			other.Status++
			wantErr(t, "another status under the same token", h.store.Finish(ctx, finish(l, idem.StateCompleted, &other)), idem.ErrLeaseLost)
			if len(resp.Body) <= store.MaxBody(h.store) { // a body the store kept
				other = *resp
				other.Body = []byte("another body")
				wantErr(t, "another body under the same token", h.store.Finish(ctx, finish(l, idem.StateCompleted, &other)), idem.ErrLeaseLost)
			}
			for _, c := range otherHeaders {
				other = *resp
				other.Header = resp.Header.Clone()
				if other.Header == nil {
					other.Header = http.Header{}
				}
				if c.change(other.Header) {
					wantErr(t, c.what+" under the same token", h.store.Finish(ctx, finish(l, idem.StateCompleted, &other)), idem.ErrLeaseLost)
				}
			}
			wantErr(t, "a release under the same token", h.store.Finish(ctx, finish(l, idem.StateFailed, nil)), idem.ErrLeaseLost)
			wantErr(t, "unknown under the same token", h.store.Finish(ctx, finish(l, idem.StateUnknown, nil)), idem.ErrLeaseLost)
			r := h.get(t, "s", "completed "+name)
			if r.State != idem.StateCompleted || r.Token != l.Token {
				t.Fatalf("record after the repeats = %+v", r)
			}
			want := resp
			if len(resp.Body) > store.MaxBody(h.store) {
				want = &idem.Response{Status: resp.Status, Header: resp.Header, BodyOmitted: true}
			}
			sameResponse(t, r.Response, want)
		})
	}

	l := h.mustExecute(t, "s", "released", testkit.Fingerprint("a"))
	p := finish(l, idem.StateFailed, nil)
	wantErr(t, "Release", h.store.Finish(ctx, p), nil)
	wantErr(t, "the same release again", h.store.Finish(ctx, p), nil)
	wantErr(t, "a completion after the release", h.store.Finish(ctx, finish(l, idem.StateCompleted, okResponse("x"))), idem.ErrLeaseLost)
	if r := h.get(t, "s", "released"); r.State != idem.StateFailed {
		t.Fatalf("released record after the repeat = %+v", r)
	}
	// Once the key runs again under a new lease, the old token's repeat is
	// refused: it would release the newer owner's work.
	h.mustExecute(t, "s", "released", testkit.Fingerprint("a"))
	wantErr(t, "the old release once a new owner runs", h.store.Finish(ctx, p), idem.ErrLeaseLost)

	l = h.mustExecute(t, "s", "unknown", testkit.Fingerprint("a"))
	p = finish(l, idem.StateUnknown, nil)
	wantErr(t, "MarkUnknown", h.store.Finish(ctx, p), nil)
	wantErr(t, "the same MarkUnknown again", h.store.Finish(ctx, p), nil)
	done := finish(l, idem.StateCompleted, okResponse("late"))
	wantErr(t, "the owner's late outcome", h.store.Finish(ctx, done), nil)
	wantErr(t, "the late outcome again", h.store.Finish(ctx, done), nil)
	wantErr(t, "MarkUnknown after the late outcome", h.store.Finish(ctx, p), idem.ErrLeaseLost)
}

func testRenewExtendsLease(t *testing.T, h *harness) {
	t0 := h.clock.Now()
	l := h.mustExecute(t, "s", "k", testkit.Fingerprint("a"))
	h.clock.Advance(20 * time.Second)
	l, err := h.eng.Renew(ctx, l)
	if err != nil {
		t.Fatalf("Renew: %v", err)
	}
	if want := t0.Add(20*time.Second + lease); !l.Expires.Equal(want) {
		t.Fatalf("renewed lease expires %v, want %v", l.Expires, want)
	}
	if r := h.get(t, "s", "k"); !r.LeaseExpires.Equal(l.Expires) {
		t.Fatalf("stored lease expires %v, want %v", r.LeaseExpires, l.Expires)
	}
	h.clock.Advance(20 * time.Second) // past the first lease, inside the renewed one
	out := h.expect(t, "s", "k", testkit.Fingerprint("a"), idem.InFlight)
	if out.RetryAfter != 10*time.Second {
		t.Fatalf("RetryAfter = %v, want 10s", out.RetryAfter)
	}
	h.clock.Advance(10 * time.Second) // exactly at expiry: too late to renew
	_, err = h.eng.Renew(ctx, l)
	wantErr(t, "Renew at expiry", err, idem.ErrLeaseLost)
}

// testLeaseHoldsToItsLastMillisecond: a lease is its owner's until the very
// millisecond it ends. One millisecond before, another caller is told the
// work is in flight, a scan leaves the record out, and the owner's
// checkpoint and renewal land (at that millisecond the lease has ended: see
// RenewExtendsLease, CheckpointNeedsRunningLease and
// ExpiredLeaseBecomesUnknown). The engine relies on the store keeping the
// lease it asked for to the millisecond: a store that ended it early (a
// server TTL rounded down to the second, say) would make running work
// uncertain, hand it to the reconciler and cancel its handler.
func testLeaseHoldsToItsLastMillisecond(t *testing.T, h *harness) {
	l := h.mustExecute(t, "s", "k", testkit.Fingerprint("a"))
	h.clock.Advance(lease - time.Millisecond)
	h.expect(t, "s", "k", testkit.Fingerprint("a"), idem.InFlight)
	res, err := h.eng.Scan(ctx, 0, "")
	if err != nil || len(res.Records) != 0 {
		t.Fatalf("Scan a millisecond before the lease ends = %+v, %v; want no record", res.Records, err)
	}
	if err := h.eng.Checkpoint(ctx, l, "authorize", nil); err != nil {
		t.Fatalf("Checkpoint a millisecond before the lease ends: %v", err)
	}
	if _, err := h.eng.Renew(ctx, l); err != nil {
		t.Fatalf("Renew a millisecond before the lease ends: %v", err)
	}
	if r := h.get(t, "s", "k"); r.State != idem.StateInProgress || r.Token != l.Token || len(r.Checkpoints) != 1 ||
		!r.LeaseExpires.Equal(h.clock.Now().Add(lease)) {
		t.Fatalf("record = %+v; want in progress under the lease, with the checkpoint and the renewed lease", r)
	}
}

func testExpiredLeaseBecomesUnknown(t *testing.T, h *harness) {
	l := h.mustExecute(t, "s", "k", testkit.Fingerprint("a"))
	other := h.mustExecute(t, "s", "other", testkit.Fingerprint("a"))
	h.clock.Advance(lease)
	h.expect(t, "s", "k", testkit.Fingerprint("a"), idem.Uncertain)
	if r := h.get(t, "s", "k"); r.State != idem.StateUnknown || r.Token != l.Token {
		t.Fatalf("record after expiry = %+v, want unknown under the old token", r)
	}
	out := h.expect(t, "s", "other", testkit.Fingerprint("b"), idem.Mismatch)
	if r := h.get(t, "s", "other"); r.State != idem.StateUnknown || out.Record.State != idem.StateUnknown {
		t.Fatalf("expired record seen with another payload is %v, want unknown", r.State)
	}
	_, err := h.eng.Renew(ctx, l)
	wantErr(t, "Renew of an unknown record", err, idem.ErrLeaseLost)

	// A record an acquire made unknown never expires: the reconciler finds
	// it, under the token it borrows, however late it looks.
	for _, later := range []time.Duration{0, 72 * time.Hour} {
		h.clock.Advance(later)
		res, err := h.eng.Scan(ctx, 0, "")
		if err != nil {
			t.Fatalf("Scan %v later: %v", later, err)
		}
		got := map[string]string{}
		for _, r := range res.Records {
			got[r.Key] = string(r.State) + " under " + r.Token
		}
		want := map[string]string{"k": string(idem.StateUnknown) + " under " + l.Token, "other": string(idem.StateUnknown) + " under " + other.Token}
		if !reflect.DeepEqual(got, want) {
			t.Fatalf("Scan %v later found %v; want %v", later, got, want)
		}
	}

	// The owner's late outcome settles the unknown record.
	resp := okResponse("late but true")
	h.complete(t, l, resp)
	sameResponse(t, h.expect(t, "s", "k", testkit.Fingerprint("a"), idem.Replay).Record.Response, resp)
}

// testExpiredLeaseStillSettles: a record whose lease ran out and that no
// acquire has looked at since is still in progress in the store, and its
// token still settles it: the owner's late outcome (a handler that outlived
// its lease, an outcome replayed from the engine's journal after an outage
// or a restart) lands, as does its MarkUnknown, and so does the release of
// a reconciler that borrowed the token from a scan. The engine relies on
// this as on the late outcome that settles an UNKNOWN record: refusing it
// would lose an outcome a client may have seen, or leave a resolved record
// in every scan. Of two reconcilers borrowing the token only the first
// succeeds, and the owner's outcome that comes after theirs is refused.
func testExpiredLeaseStillSettles(t *testing.T, h *harness) {
	fp := testkit.Fingerprint("a")
	done := h.mustExecute(t, "s", "done", fp)
	unknown := h.mustExecute(t, "s", "unknown", fp)
	released := h.mustExecute(t, "s", "released", fp)
	h.clock.Advance(lease + 5*time.Second)

	resp := okResponse("late")
	wantErr(t, "the owner's late outcome", h.store.Finish(ctx, h.finishParams(done, idem.StateCompleted, resp)), nil)
	h.expect(t, "s", "done", fp, idem.Replay)
	sameResponse(t, h.get(t, "s", "done").Response, resp)

	wantErr(t, "the owner's late MarkUnknown", h.store.Finish(ctx, h.finishParams(unknown, idem.StateUnknown, nil)), nil)
	res, err := h.eng.Scan(ctx, 0, "")
	if err != nil || len(res.Records) != 2 {
		t.Fatalf("Scan = %+v, %v; want the records unknown and released, still stale", res.Records, err)
	}

	release := h.finishParams(released, idem.StateFailed, nil)
	release.Repeat = false // a reconciler borrows the token
	wantErr(t, "a reconciler's release", h.store.Finish(ctx, release), nil)
	wantErr(t, "a second reconciler's release", h.store.Finish(ctx, release), idem.ErrLeaseLost)
	wantErr(t, "the owner's outcome after the reconciler's release",
		h.store.Finish(ctx, h.finishParams(released, idem.StateCompleted, okResponse("late"))), idem.ErrLeaseLost)
	if r := h.get(t, "s", "released"); r.State != idem.StateFailed {
		t.Fatalf("released record = %+v; want failed", r)
	}
	res, err = h.eng.Scan(ctx, 0, "")
	if err != nil || len(res.Records) != 1 || res.Records[0].Key != "unknown" || res.Records[0].State != idem.StateUnknown {
		t.Fatalf("Scan = %+v, %v; want only the record marked unknown", res.Records, err)
	}
	if l := h.mustExecute(t, "s", "released", fp); l.Fence != 2 {
		t.Fatalf("a retry of the released key: fence %d; want 2", l.Fence)
	}
}

func testTakeoverWhenDeclared(t *testing.T, h *harness) {
	begin := func(f idem.Fingerprint) idem.Outcome {
		t.Helper()
		out, err := h.eng.Begin(ctx, idem.BeginParams{Scope: "s", Key: "k", Fingerprint: f, TakeoverSafe: true})
		if err != nil {
			t.Fatal(err)
		}
		return out
	}
	old := begin(testkit.Fingerprint("a"))
	if old.Decision != idem.Execute {
		t.Fatalf("first Begin = %v", old.Decision)
	}
	if d := begin(testkit.Fingerprint("a")).Decision; d != idem.InFlight {
		t.Fatalf("Begin while the lease runs = %v, want in flight", d)
	}
	h.clock.Advance(lease)
	if out := begin(testkit.Fingerprint("b")); out.Decision != idem.Mismatch || out.Record.State != idem.StateInProgress {
		t.Fatalf("other payload after expiry = %v in %v, want mismatch on an in-progress record", out.Decision, out.Record.State)
	}
	now := begin(testkit.Fingerprint("a"))
	if now.Decision != idem.Execute || now.Lease.Fence != 2 || now.Lease.Token == old.Lease.Token {
		t.Fatalf("takeover = %v %+v, want execute with fence 2 and a new token", now.Decision, now.Lease)
	}
	_, err := h.eng.Renew(ctx, old.Lease)
	wantErr(t, "old owner's Renew", err, idem.ErrLeaseLost)
	wantErr(t, "old owner's Complete", h.eng.Complete(ctx, old.Lease, okResponse("stale")), idem.ErrLeaseLost)
	wantErr(t, "old owner's Release", h.eng.Release(ctx, old.Lease), idem.ErrLeaseLost)
	wantErr(t, "old owner's MarkUnknown", h.eng.MarkUnknown(ctx, old.Lease), idem.ErrLeaseLost)
	wantErr(t, "old owner's Checkpoint", h.eng.Checkpoint(ctx, old.Lease, "authorize", nil), idem.ErrLeaseLost)
	if r := h.get(t, "s", "k"); r.State != idem.StateInProgress || r.Token != now.Lease.Token || r.Fence != 2 || len(r.Checkpoints) != 0 || !r.TakeoverSafe {
		t.Fatalf("record after the old owner's writes = %+v; want the new owner's, untouched", r)
	}
	resp := okResponse("fresh")
	h.complete(t, now.Lease, resp)
	out := begin(testkit.Fingerprint("a"))
	if out.Decision != idem.Replay || out.Record.Fence != 2 {
		t.Fatalf("after takeover completed: %v fence %d", out.Decision, out.Record.Fence)
	}
	sameResponse(t, out.Record.Response, resp)
	// Not even the new owner's very outcome is a repeat under the old token.
	settled := h.get(t, "s", "k")
	repeat := h.finishParams(old.Lease, idem.StateCompleted, settled.Response)
	repeat.Expires = settled.Expires
	wantErr(t, "old owner's repeat of the new owner's outcome", h.store.Finish(ctx, repeat), idem.ErrLeaseLost)

	// The record is as takeover-safe as the lease that holds it: a takeover
	// by a lease that is not leaves a record whose expiry is uncertain.
	once := func(safe bool) idem.Outcome {
		t.Helper()
		out, err := h.eng.Begin(ctx, idem.BeginParams{Scope: "s", Key: "safe once", Fingerprint: testkit.Fingerprint("a"), TakeoverSafe: safe})
		if err != nil {
			t.Fatal(err)
		}
		return out
	}
	if d := once(true).Decision; d != idem.Execute {
		t.Fatalf("first Begin = %v", d)
	}
	h.clock.Advance(lease)
	if out := once(false); out.Decision != idem.Execute || out.Lease.Fence != 2 {
		t.Fatalf("takeover by a lease that is not takeover-safe = %v %+v, want execute with fence 2", out.Decision, out.Lease)
	}
	if r := h.get(t, "s", "safe once"); r.TakeoverSafe {
		t.Fatalf("record after a takeover by a lease that is not takeover-safe = %+v; want it not takeover-safe", r)
	}
	h.clock.Advance(lease)
	if d := once(true).Decision; d != idem.Uncertain {
		t.Fatalf("once that lease ran out: %v, want uncertain", d)
	}
}

func testReplayIsByteIdentical(t *testing.T, h *harness) {
	every := make([]byte, 256)
	for i := range every {
		every[i] = byte(i)
	}
	large := bytes.Repeat([]byte("0123456789abcdef"), 64*1024) // 1 MiB
	cases := []*idem.Response{
		{Status: 500, Header: http.Header{
			"Content-Type":   {"application/octet-stream"},
			"X-Multi":        {"one", "two", ""},
			"X-Quoted":       {`"a", b; c=d`},
			"Content-Length": {"256"},
		}, Body: every},
		{Status: 204},
		{Status: 200, Header: http.Header{"Content-Type": {"text/plain; charset=utf-8"}}, Body: large},
		{Status: 202, Body: []byte("héllo wörld \u2603")},
		{Status: 200, Header: http.Header{"Content-Type": {"text/event-stream"}}, BodyOmitted: true},
		{Status: 200, Header: http.Header{"Content-Disposition": {"attachment; filename=\"caf\xe9.pdf\"", "\xff\xfe"}}, Body: []byte("%PDF")},
	}
	// A store with a body limit keeps bodies up to it byte for byte, and
	// an outcome with a larger body with the body omitted, never an error.
	limit := store.MaxBody(h.store)
	if limit < len(large) {
		cases = append(cases, &idem.Response{Status: 201, Header: http.Header{"X-At-Limit": {"yes"}}, Body: bytes.Repeat([]byte("L"), limit)})
	}
	for i, resp := range cases {
		key := fmt.Sprintf("replay-%d", i)
		l := h.mustExecute(t, "s", key, testkit.Fingerprint(key))
		h.complete(t, l, resp)
		want := resp
		if len(resp.Body) > limit {
			want = &idem.Response{Status: resp.Status, Header: resp.Header, BodyOmitted: true}
		}
		r := h.get(t, "s", key)
		sameResponse(t, r.Response, kept(want))
		out := h.expect(t, "s", key, testkit.Fingerprint(key), idem.Replay)
		sameResponse(t, out.Record.Response, want)
		if !out.Record.Expires.Equal(h.clock.Now().Add(retention)) {
			t.Fatalf("expires = %v, want now + retention", out.Record.Expires)
		}
	}
}

// testCheckpointsLeaveRoomForTheOutcome: a lease that recorded as many
// checkpoints as the store takes still completes with a body under the
// store's limit; a store without room for the body keeps the outcome with
// the body omitted (never an error: the outcome would be lost), and the
// owner's repeat of that write lands. A store may refuse a checkpoint
// ([idem.ErrInvalid]) once it has too many: that is before the step it
// guards, so nothing is lost.
func testCheckpointsLeaveRoomForTheOutcome(t *testing.T, h *harness) {
	l := h.mustExecute(t, "s", "k", testkit.Fingerprint("a"))
	data := bytes.Repeat([]byte("x"), store.MaxCheckpointData)
	for i := range 20 {
		err := h.eng.Checkpoint(ctx, l, fmt.Sprintf("call-%d", i), data)
		if errors.Is(err, idem.ErrInvalid) && i > 0 {
			break // the store's cap on checkpoints
		}
		if err != nil {
			t.Fatalf("checkpoint %d: %v", i, err)
		}
	}
	now := h.clock.Now()
	resp := &idem.Response{Status: 201, Header: http.Header{"Content-Type": {"application/json"}},
		Body: bytes.Repeat([]byte("b"), min(store.MaxBody(h.store)-1, 1<<20))}
	p := idem.FinishParams{Scope: "s", Key: "k", Token: l.Token, Now: now, State: idem.StateCompleted, Response: resp, Expires: now.Add(retention)}
	if err := h.store.Finish(ctx, p); err != nil {
		t.Fatalf("Finish after the checkpoints, with a body under the store's limit: %v", err)
	}
	omitted := &idem.Response{Status: resp.Status, Header: resp.Header, BodyOmitted: true}
	if r := h.get(t, "s", "k"); r.State != idem.StateCompleted || !(r.Response.Equal(resp) || r.Response.Equal(omitted)) {
		t.Fatalf("record %s, body %d B, omitted %v; want completed, the body whole or omitted", r.State, len(r.Response.Body), r.Response.BodyOmitted)
	}
	p.Repeat = true
	if err := h.store.Finish(ctx, p); err != nil {
		t.Fatalf("the owner's repeat of that write: %v; want it to land", err)
	}
}

func testReleaseFreesKey(t *testing.T, h *harness) {
	l := h.mustExecute(t, "s", "k", testkit.Fingerprint("a"))
	if err := h.eng.Release(ctx, l); err != nil {
		t.Fatalf("Release: %v", err)
	}
	if r := h.get(t, "s", "k"); r.State != idem.StateFailed || r.Response != nil || r.Expires.IsZero() {
		t.Fatalf("released record = %+v, want failed with an expiry", r)
	}
	again := h.mustExecute(t, "s", "k", testkit.Fingerprint("a"))
	if again.Fence != 2 || again.Token == l.Token {
		t.Fatalf("re-run lease = %+v, want fence 2 and a new token", again)
	}
	wantErr(t, "released owner's Complete", h.eng.Complete(ctx, l, okResponse("x")), idem.ErrLeaseLost)
	if err := h.eng.Release(ctx, again); err != nil {
		t.Fatal(err)
	}
	// A released key binds no payload: nothing happened under it.
	third := h.mustExecute(t, "s", "k", testkit.Fingerprint("other"))
	if third.Fence != 3 {
		t.Fatalf("third lease fence = %d, want 3", third.Fence)
	}
	if r := h.get(t, "s", "k"); r.Fingerprint != testkit.Fingerprint("other") || !r.Expires.IsZero() {
		t.Fatalf("re-acquired record = %+v", r)
	}
}

func testMarkUnknown(t *testing.T, h *harness) {
	l := h.mustExecute(t, "s", "k", testkit.Fingerprint("a"))
	if err := h.eng.MarkUnknown(ctx, l); err != nil {
		t.Fatalf("MarkUnknown: %v", err)
	}
	h.expect(t, "s", "k", testkit.Fingerprint("a"), idem.Uncertain)
	h.clock.Advance(48 * time.Hour) // unsettled records never expire
	h.expect(t, "s", "k", testkit.Fingerprint("a"), idem.Uncertain)
	res, err := h.eng.Scan(ctx, 0, "")
	if err != nil || len(res.Records) != 1 || res.Records[0].Key != "k" || res.Records[0].State != idem.StateUnknown {
		t.Fatalf("Scan = %+v, %v; want the unknown record", res, err)
	}
	if err := h.eng.Release(ctx, l); err != nil {
		t.Fatalf("owner's late Release of its unknown record: %v", err)
	}
	h.mustExecute(t, "s", "k", testkit.Fingerprint("a"))
}

func testRetentionExpiresOutcome(t *testing.T, h *harness) {
	l := h.mustExecute(t, "s", "done", testkit.Fingerprint("a"))
	h.complete(t, l, okResponse("x"))
	f := h.mustExecute(t, "s", "failed", testkit.Fingerprint("a"))
	if err := h.eng.Release(ctx, f); err != nil {
		t.Fatal(err)
	}
	h.clock.Advance(retention - time.Millisecond)
	if n, err := h.store.Prune(ctx, store.PruneParams{Now: h.clock.Now()}); err != nil || n != 0 {
		t.Fatalf("Prune a millisecond before the outcomes expire = %d, %v; want nothing deleted", n, err)
	}
	h.expect(t, "s", "done", testkit.Fingerprint("a"), idem.Replay)
	h.get(t, "s", "failed")
	h.clock.Advance(time.Millisecond)
	for _, key := range []string{"done", "failed"} {
		_, err := h.eng.Get(ctx, "s", key)
		wantErr(t, "Get of an expired record", err, idem.ErrNotFound)
		if l := h.mustExecute(t, "s", key, testkit.Fingerprint("b")); l.Fence != 1 {
			t.Fatalf("expired key %q: new lease fence = %d, want 1", key, l.Fence)
		}
	}
	// Per-request retention overrides the engine's.
	out, err := h.eng.Begin(ctx, idem.BeginParams{Scope: "s", Key: "short", Fingerprint: testkit.Fingerprint("a"), Retention: time.Minute})
	if err != nil || out.Decision != idem.Execute {
		t.Fatalf("Begin with retention: %v, %v", out.Decision, err)
	}
	h.complete(t, out.Lease, okResponse("x"))
	if r := h.get(t, "s", "short"); !r.Expires.Equal(h.clock.Now().Add(time.Minute)) {
		t.Fatalf("expires = %v, want a minute from now", r.Expires)
	}
}

func testPruneKeepsLiveAndUnsettled(t *testing.T, h *harness) {
	for i := range 5 {
		l := h.mustExecute(t, "s", fmt.Sprintf("old-%d", i), testkit.Fingerprint("a"))
		if i < 3 {
			h.complete(t, l, okResponse("x"))
		} else if err := h.eng.Release(ctx, l); err != nil {
			t.Fatal(err)
		}
	}
	h.mustExecute(t, "s", "running", testkit.Fingerprint("a"))
	u := h.mustExecute(t, "s", "unknown", testkit.Fingerprint("a"))
	if err := h.eng.MarkUnknown(ctx, u); err != nil {
		t.Fatal(err)
	}
	h.clock.Advance(retention)
	live := h.mustExecute(t, "s", "live", testkit.Fingerprint("a"))
	h.complete(t, live, okResponse("x"))

	total := 0
	for {
		n, err := h.store.Prune(ctx, store.PruneParams{Now: h.clock.Now(), Limit: 2})
		if err != nil {
			t.Fatalf("Prune: %v", err)
		}
		if n < 0 || n > 2 {
			t.Fatalf("Prune with limit 2 deleted %d", n)
		}
		total += n
		if n < 2 {
			break
		}
	}
	if total > 5 {
		t.Fatalf("Prune deleted %d records, only 5 had expired", total)
	}
	for i := range 5 {
		_, err := h.eng.Get(ctx, "s", fmt.Sprintf("old-%d", i))
		wantErr(t, "Get after prune", err, idem.ErrNotFound)
	}
	if r := h.get(t, "s", "running"); r.State != idem.StateInProgress {
		t.Fatalf("prune touched the running record: %+v", r)
	}
	if r := h.get(t, "s", "unknown"); r.State != idem.StateUnknown {
		t.Fatalf("prune touched the unknown record: %+v", r)
	}
	h.expect(t, "s", "live", testkit.Fingerprint("a"), idem.Replay)
	if n, err := h.eng.Prune(ctx, idem.PruneOptions{}); err != nil || n != 0 {
		t.Fatalf("second Prune = %d, %v; want nothing left to delete", n, err)
	}
}

// testPruneSparesKeysRunAgain: Prune goes by the record a key holds now,
// not by one it replaced. A key whose outcome expired and that runs again, a
// released key that runs again, and a released key that ran again and
// completed later are all kept until their current record expires, however
// long ago the replaced one did. Stores that index records by expiry (a
// sorted set, an index item, a TTL attribute) must move or drop the replaced
// record's entry: pruning by it would delete running work, whose retry would
// then run it a second time, or an outcome a retry should replay.
func testPruneSparesKeysRunAgain(t *testing.T, h *harness) {
	fp := testkit.Fingerprint("a")
	h.complete(t, h.mustExecute(t, "s", "expired, running again", fp), okResponse("x"))
	if err := h.eng.Release(ctx, h.mustExecute(t, "s", "released, running again", fp)); err != nil {
		t.Fatal(err)
	}
	h.mustExecute(t, "s", "released, running again", fp)
	if err := h.eng.Release(ctx, h.mustExecute(t, "s", "released, completed later", fp)); err != nil {
		t.Fatal(err)
	}
	h.clock.Advance(retention / 2)
	h.complete(t, h.mustExecute(t, "s", "released, completed later", fp), okResponse("x"))
	h.clock.Advance(retention / 2) // the first records have expired
	h.mustExecute(t, "s", "expired, running again", testkit.Fingerprint("b"))

	h.pruneAll(t)
	for key, want := range map[string]idem.State{
		"expired, running again":    idem.StateInProgress,
		"released, running again":   idem.StateInProgress,
		"released, completed later": idem.StateCompleted,
	} {
		if r := h.get(t, "s", key); r.State != want {
			t.Fatalf("%s: after Prune the record is %+v; want %s", key, r, want)
		}
	}
	h.clock.Advance(2 * retention) // unsettled records never expire
	h.pruneAll(t)
	for _, key := range []string{"expired, running again", "released, running again"} {
		if r := h.get(t, "s", key); r.State != idem.StateInProgress {
			t.Fatalf("%s: after a later Prune the record is %+v; want in progress", key, r)
		}
	}
}

// testScanFindsStaleRecords: a scan returns every stale record once, over
// pages of at most its limit, and no other record, also when many running
// records come before the stale ones in the store's order.
func testScanFindsStaleRecords(t *testing.T, h *harness) {
	want := map[string]bool{}
	for i := range 15 { // leases that will run out
		key := fmt.Sprintf("expired-%02d", i)
		h.mustExecute(t, fmt.Sprintf("scope-%d", i%3), key, testkit.Fingerprint("a"))
		want[key] = true
	}
	for i := range 10 { // declared unknown
		key := fmt.Sprintf("unknown-%02d", i)
		if err := h.eng.MarkUnknown(ctx, h.mustExecute(t, "s", key, testkit.Fingerprint("a"))); err != nil {
			t.Fatal(err)
		}
		want[key] = true
	}
	h.clock.Advance(lease)
	for i := range 5 { // still running, settled, released: not stale
		h.mustExecute(t, "s", fmt.Sprintf("running-%d", i), testkit.Fingerprint("a"))
		h.complete(t, h.mustExecute(t, "s", fmt.Sprintf("done-%d", i), testkit.Fingerprint("a")), okResponse("x"))
		if err := h.eng.Release(ctx, h.mustExecute(t, "s", fmt.Sprintf("failed-%d", i), testkit.Fingerprint("a"))); err != nil {
			t.Fatal(err)
		}
	}
	for i := range 20 { // running, in a scope before every stale record's
		h.mustExecute(t, "a", fmt.Sprintf("running-%02d", i), testkit.Fingerprint("a"))
	}

	for _, limit := range []int{7, 2} {
		seen := map[string]bool{}
		cursor := ""
		for pages := 1; ; pages++ {
			if pages > 100 {
				t.Fatalf("limit %d: the scan has not ended after %d pages", limit, pages-1)
			}
			res, err := h.eng.Scan(ctx, limit, cursor)
			if err != nil {
				t.Fatalf("Scan: %v", err)
			}
			if len(res.Records) > limit {
				t.Fatalf("page %d has %d records with limit %d", pages, len(res.Records), limit)
			}
			for _, r := range res.Records {
				if seen[r.Key] {
					t.Fatalf("limit %d: Scan returned %q twice", limit, r.Key)
				}
				seen[r.Key] = true
				if !r.Stale(h.clock.Now()) {
					t.Fatalf("limit %d: Scan returned a record that is not stale: %+v", limit, r)
				}
			}
			if cursor = res.Cursor; cursor == "" {
				break
			}
		}
		if !reflect.DeepEqual(seen, want) {
			t.Fatalf("limit %d: Scan found %d records %v, want the %d stale ones", limit, len(seen), seen, len(want))
		}
	}
	res, err := h.eng.Scan(ctx, 0, "")
	if err != nil || len(res.Records) != len(want) {
		t.Fatalf("Scan with the default limit: %d records, %v; want %d", len(res.Records), err, len(want))
	}
}

func testScopesIsolateKeys(t *testing.T, h *harness) {
	a := h.mustExecute(t, "tenant-a", "shared-key", testkit.Fingerprint("a"))
	b := h.mustExecute(t, "tenant-b", "shared-key", testkit.Fingerprint("b"))
	none := h.mustExecute(t, "", "shared-key", testkit.Fingerprint("c"))
	respA, respB := okResponse("for a"), okResponse("for b")
	h.complete(t, a, respA)
	h.expect(t, "tenant-b", "shared-key", testkit.Fingerprint("b"), idem.InFlight)
	h.complete(t, b, respB)
	sameResponse(t, h.expect(t, "tenant-a", "shared-key", testkit.Fingerprint("a"), idem.Replay).Record.Response, respA)
	sameResponse(t, h.expect(t, "tenant-b", "shared-key", testkit.Fingerprint("b"), idem.Replay).Record.Response, respB)
	h.expect(t, "", "shared-key", testkit.Fingerprint("c"), idem.InFlight)
	if err := h.eng.Release(ctx, none); err != nil {
		t.Fatal(err)
	}
	// Scope and key are not concatenated: ("a:b", "c") is not ("a", "b:c").
	h.mustExecute(t, "a:b", "c", testkit.Fingerprint("a"))
	h.mustExecute(t, "a", "b:c", testkit.Fingerprint("a"))
}

func testKeysStoredAsSent(t *testing.T, h *harness) {
	var printable strings.Builder
	for c := byte(0x20); c <= 0x7e; c++ {
		printable.WriteByte(c)
	}
	keys := []string{
		strings.Repeat("k", idem.MaxKeyLen),
		printable.String(),
		"018f6f2e-7b1a-7c3d-9e4f-0a1b2c3d4e5f",
		`{tag}:*?[]"'\%_`,
		" leading and trailing ",
	}
	scope := strings.Repeat("s", idem.MaxScopeLen)
	for _, key := range keys {
		l := h.mustExecute(t, scope, key, testkit.Fingerprint("a"))
		h.complete(t, l, okResponse(key))
		r := h.get(t, scope, key)
		if r.Key != key || r.Scope != scope || string(r.Response.Body) != key {
			t.Fatalf("key %q stored as %q in scope %q", key, r.Key, r.Scope)
		}
	}
	if _, err := h.eng.Get(ctx, scope, strings.ToUpper(keys[2])); !errors.Is(err, idem.ErrNotFound) {
		t.Fatalf("keys must be case-sensitive: Get of the upper-cased key = %v", err)
	}
}

func testInvalidInput(t *testing.T, h *harness) {
	now := h.clock.Now()
	tok := strings.Repeat("a", 32)
	for name, p := range map[string]idem.BeginParams{
		"empty key":          {Key: "", Fingerprint: testkit.Fingerprint("a")},
		"key over 255 bytes": {Key: strings.Repeat("k", idem.MaxKeyLen+1), Fingerprint: testkit.Fingerprint("a")},
		"key with newline":   {Key: "a\nb", Fingerprint: testkit.Fingerprint("a")},
		"key not ASCII":      {Key: "clé", Fingerprint: testkit.Fingerprint("a")},
		"scope over 255":     {Scope: strings.Repeat("s", idem.MaxScopeLen+1), Key: "k", Fingerprint: testkit.Fingerprint("a")},
		"scope with NUL":     {Scope: "a\x00b", Key: "k", Fingerprint: testkit.Fingerprint("a")},
		"no fingerprint":     {Key: "k"},
		"negative lease":     {Key: "k", Fingerprint: testkit.Fingerprint("a"), Lease: -time.Second},
	} {
		_, err := h.eng.Begin(ctx, p)
		wantErr(t, "Begin with "+name, err, idem.ErrInvalid)
	}
	errs := map[string]error{}
	_, errs["Acquire without token"] = h.store.Acquire(ctx, store.AcquireParams{Key: "k", Fingerprint: testkit.Fingerprint("a"), Now: now, LeaseExpires: now.Add(lease)})
	_, errs["Acquire with a lease already over"] = h.store.Acquire(ctx, store.AcquireParams{Key: "k", Fingerprint: testkit.Fingerprint("a"), Token: tok, Now: now, LeaseExpires: now})
	_, errs["Acquire without a time"] = h.store.Acquire(ctx, store.AcquireParams{Key: "k", Fingerprint: testkit.Fingerprint("a"), Token: tok, LeaseExpires: now.Add(lease)})
	errs["Renew without token"] = h.store.Renew(ctx, store.RenewParams{Key: "k", Now: now, LeaseExpires: now.Add(lease)})
	errs["Finish completed without response"] = h.store.Finish(ctx, idem.FinishParams{Key: "k", Token: tok, Now: now, State: idem.StateCompleted, Expires: now.Add(time.Hour)})
	errs["Finish with status 42"] = h.store.Finish(ctx, idem.FinishParams{Key: "k", Token: tok, Now: now, State: idem.StateCompleted, Response: &idem.Response{Status: 42}, Expires: now.Add(time.Hour)})
	errs["Finish with an interim status, 102"] = h.store.Finish(ctx, idem.FinishParams{Key: "k", Token: tok, Now: now, State: idem.StateCompleted, Response: &idem.Response{Status: 102}, Expires: now.Add(time.Hour)})
	errs["Finish with an omitted body and a body"] = h.store.Finish(ctx, idem.FinishParams{Key: "k", Token: tok, Now: now, State: idem.StateCompleted, Response: &idem.Response{Status: 200, Body: []byte("x"), BodyOmitted: true}, Expires: now.Add(time.Hour)})
	errs["Finish as in progress"] = h.store.Finish(ctx, idem.FinishParams{Key: "k", Token: tok, Now: now, State: idem.StateInProgress})
	errs["Finish failed with a response"] = h.store.Finish(ctx, idem.FinishParams{Key: "k", Token: tok, Now: now, State: idem.StateFailed, Response: okResponse("x"), Expires: now.Add(time.Hour)})
	errs["Finish completed without expiry"] = h.store.Finish(ctx, idem.FinishParams{Key: "k", Token: tok, Now: now, State: idem.StateCompleted, Response: okResponse("x")})
	errs["Finish unknown with expiry"] = h.store.Finish(ctx, idem.FinishParams{Key: "k", Token: tok, Now: now, State: idem.StateUnknown, Expires: now.Add(time.Hour)})
	_, errs["Get with empty key"] = h.store.Get(ctx, store.GetParams{Now: now})
	_, errs["Scan with negative limit"] = h.store.Scan(ctx, store.ScanParams{Now: now, Limit: -1})
	_, errs["Prune without a time"] = h.store.Prune(ctx, store.PruneParams{})
	for name, err := range errs {
		wantErr(t, name, err, idem.ErrInvalid)
	}
	if err := h.eng.Complete(ctx, h.mustExecute(t, "", "k", testkit.Fingerprint("a")), nil); !errors.Is(err, idem.ErrInvalid) {
		t.Fatalf("Complete with a nil response: %v, want ErrInvalid", err)
	}
	if _, err := h.eng.Get(ctx, "", "k"); err != nil {
		t.Fatalf("the record survives invalid writes: %v", err)
	}
}

func testMissingRecord(t *testing.T, h *harness) {
	_, err := h.eng.Get(ctx, "s", "absent")
	wantErr(t, "Get of a missing record", err, idem.ErrNotFound)
	ghost := idem.Lease{Scope: "s", Key: "absent", Token: strings.Repeat("f", 32), Duration: lease, Retention: retention}
	_, err = h.eng.Renew(ctx, ghost)
	wantErr(t, "Renew of a missing record", err, idem.ErrLeaseLost)
	wantErr(t, "Complete of a missing record", h.eng.Complete(ctx, ghost, okResponse("x")), idem.ErrLeaseLost)
	// No settlement creates a record, a repeat or not: a record no acquire
	// made would replay, block or reach the reconciler for nothing.
	for _, state := range []idem.State{idem.StateCompleted, idem.StateFailed, idem.StateUnknown} {
		var resp *idem.Response
		if state == idem.StateCompleted {
			resp = okResponse("ghost")
		}
		for _, repeat := range []bool{false, true} {
			p := h.finishParams(ghost, state, resp)
			p.Repeat = repeat
			what := fmt.Sprintf("Finish of a missing record as %s (repeat %v)", state, repeat)
			wantErr(t, what, h.store.Finish(ctx, p), idem.ErrLeaseLost)
			_, err := h.eng.Get(ctx, "s", "absent")
			wantErr(t, "Get after a "+what, err, idem.ErrNotFound)
		}
	}
	res, err := h.eng.Scan(ctx, 0, "")
	if err != nil || len(res.Records) != 0 || res.Cursor != "" {
		t.Fatalf("Scan of an empty store = %+v, %v", res, err)
	}
	if l := h.mustExecute(t, "s", "absent", testkit.Fingerprint("a")); l.Fence != 1 {
		t.Fatalf("the first lease of the key after those writes: fence %d; want 1", l.Fence)
	}
}

func testCanceledContext(t *testing.T, h *harness) {
	canceled, cancel := context.WithCancel(ctx)
	cancel()
	_, err := h.eng.Begin(canceled, idem.BeginParams{Key: "k", Fingerprint: testkit.Fingerprint("a")})
	wantErr(t, "Begin with a canceled context", err, context.Canceled)
	_, err = h.eng.Get(ctx, "", "k")
	wantErr(t, "Get after a canceled Begin", err, idem.ErrNotFound)
}

func testCheckpointsRecorded(t *testing.T, h *harness) {
	out, err := h.eng.Begin(ctx, idem.BeginParams{Scope: "s", Key: "k", Fingerprint: testkit.Fingerprint("a"), TakeoverSafe: true})
	if err != nil || out.Decision != idem.Execute {
		t.Fatal(out.Decision, err)
	}
	l := out.Lease
	t0 := h.clock.Now()
	binary := []byte{0, 1, 2, 0xff, '\n', '"', '\\'}
	if err := h.eng.Checkpoint(ctx, l, "authorize", []byte(l.DownstreamKey("authorize"))); err != nil {
		t.Fatalf("Checkpoint: %v", err)
	}
	h.clock.Advance(time.Second)
	if err := h.eng.Checkpoint(ctx, l, "capture", binary); err != nil {
		t.Fatalf("second Checkpoint: %v", err)
	}
	want := []idem.Checkpoint{
		{Name: "authorize", Data: []byte(l.DownstreamKey("authorize")), At: t0},
		{Name: "capture", Data: binary, At: t0.Add(time.Second)},
	}
	sameCheckpoints := func(what string, got []idem.Checkpoint) {
		t.Helper()
		if len(got) != len(want) {
			t.Fatalf("%s: %d checkpoints, want %d", what, len(got), len(want))
		}
		for i := range want {
			if got[i].Name != want[i].Name || !bytes.Equal(got[i].Data, want[i].Data) || !got[i].At.Equal(want[i].At) {
				t.Fatalf("%s: checkpoint %d = %+v, want %+v", what, i, got[i], want[i])
			}
		}
	}
	r := h.get(t, "s", "k")
	sameCheckpoints("stored", r.Checkpoints)
	if r.TakeoverSafe || !r.Updated.Equal(t0.Add(time.Second)) {
		t.Fatalf("after a checkpoint: takeover safe %v, updated %v", r.TakeoverSafe, r.Updated)
	}
	if r.DownstreamKey("authorize") != l.DownstreamKey("authorize") {
		t.Fatal("the record and its lease derive different downstream keys")
	}
	h.complete(t, l, okResponse("charged"))
	sameCheckpoints("after completion", h.get(t, "s", "k").Checkpoints)
	sameCheckpoints("on the replayed record", h.expect(t, "s", "k", testkit.Fingerprint("a"), idem.Replay).Record.Checkpoints)
	h.clock.Advance(retention) // expired: the key starts over, with no checkpoints
	if out := h.begin(t, "s", "k", testkit.Fingerprint("a")); out.Decision != idem.Execute || len(out.Record.Checkpoints) != 0 || len(h.get(t, "s", "k").Checkpoints) != 0 {
		t.Fatalf("re-created over an expired record: %v with %d checkpoints", out.Decision, len(out.Record.Checkpoints))
	}

	// Unsettled records reach the reconciler with their checkpoints.
	u := h.mustExecute(t, "s", "u", testkit.Fingerprint("a"))
	if err := h.eng.Checkpoint(ctx, u, "authorize", []byte("x")); err != nil {
		t.Fatal(err)
	}
	h.clock.Advance(lease)
	res, err := h.eng.Scan(ctx, 0, "")
	if err != nil {
		t.Fatal(err)
	}
	var scanned *idem.Record
	for i := range res.Records {
		if res.Records[i].Key == "u" {
			scanned = &res.Records[i]
		}
	}
	if scanned == nil || len(scanned.Checkpoints) != 1 || scanned.Checkpoints[0].Name != "authorize" {
		t.Fatalf("Scan = %+v; want the record u with its checkpoint", res.Records)
	}

	// A re-run after a release starts with no checkpoints.
	f := h.mustExecute(t, "s", "f", testkit.Fingerprint("a"))
	if err := h.eng.Checkpoint(ctx, f, "authorize", nil); err != nil {
		t.Fatal(err)
	}
	if err := h.eng.Release(ctx, f); err != nil {
		t.Fatal(err)
	}
	h.mustExecute(t, "s", "f", testkit.Fingerprint("a"))
	if cps := h.get(t, "s", "f").Checkpoints; len(cps) != 0 {
		t.Fatalf("re-run record kept %d checkpoints", len(cps))
	}
}

func testCheckpointEndsTakeover(t *testing.T, h *harness) {
	begin := func() idem.Outcome {
		t.Helper()
		out, err := h.eng.Begin(ctx, idem.BeginParams{Scope: "s", Key: "k", Fingerprint: testkit.Fingerprint("a"), TakeoverSafe: true})
		if err != nil {
			t.Fatal(err)
		}
		return out
	}
	l := begin().Lease
	if err := h.eng.Checkpoint(ctx, l, "authorize", nil); err != nil {
		t.Fatal(err)
	}
	h.clock.Advance(lease)
	// The work left the database: its expiry is uncertain, not a takeover.
	if out := begin(); out.Decision != idem.Uncertain {
		t.Fatalf("after a checkpoint and an expired lease: %v, want uncertain", out.Decision)
	}
	if r := h.get(t, "s", "k"); r.State != idem.StateUnknown || r.Token != l.Token {
		t.Fatalf("record = %+v", r)
	}
}

// testCheckpointNeedsRunningLease: a checkpoint lands only under the token
// of an IN_PROGRESS record whose lease has not run out, and only when its
// name and data are within the limits.
func testCheckpointNeedsRunningLease(t *testing.T, h *harness) {
	l := h.mustExecute(t, "s", "k", testkit.Fingerprint("a"))
	forged := l
	forged.Token = strings.Repeat("0", 32)
	wantErr(t, "Checkpoint with a forged token", h.eng.Checkpoint(ctx, forged, "x", nil), idem.ErrLeaseLost)
	ghost := l
	ghost.Key = "absent"
	wantErr(t, "Checkpoint of a missing record", h.eng.Checkpoint(ctx, ghost, "x", nil), idem.ErrLeaseLost)
	for name, c := range map[string]struct {
		name string
		data []byte
	}{
		"empty name":    {"", nil},
		"long name":     {strings.Repeat("n", store.MaxCheckpointName+1), nil},
		"name with tab": {"a\tb", nil},
		"too much data": {"x", make([]byte, store.MaxCheckpointData+1)},
	} {
		wantErr(t, "Checkpoint with "+name, h.eng.Checkpoint(ctx, l, c.name, c.data), idem.ErrInvalid)
	}
	if err := h.eng.Checkpoint(ctx, l, strings.Repeat("n", store.MaxCheckpointName), make([]byte, store.MaxCheckpointData)); err != nil {
		t.Fatalf("Checkpoint at the limits: %v", err)
	}
	// A settled record takes no checkpoint, though its lease has time left.
	for _, c := range []struct {
		settled string
		settle  func(idem.Lease) error
	}{
		{"completed", func(l idem.Lease) error { return h.eng.Complete(ctx, l, okResponse("x")) }},
		{"released", func(l idem.Lease) error { return h.eng.Release(ctx, l) }},
		{"marked unknown", func(l idem.Lease) error { return h.eng.MarkUnknown(ctx, l) }},
	} {
		settled := h.mustExecute(t, "s", c.settled, testkit.Fingerprint("a"))
		if err := c.settle(settled); err != nil {
			t.Fatal(err)
		}
		wantErr(t, "Checkpoint of a record "+c.settled+" while its lease runs", h.eng.Checkpoint(ctx, settled, "x", nil), idem.ErrLeaseLost)
		if r := h.get(t, "s", c.settled); len(r.Checkpoints) != 0 {
			t.Fatalf("a record %s took %d checkpoints", c.settled, len(r.Checkpoints))
		}
	}
	h.clock.Advance(lease) // exactly at expiry: too late
	wantErr(t, "Checkpoint at expiry", h.eng.Checkpoint(ctx, l, "x", nil), idem.ErrLeaseLost)
	h.expect(t, "s", "k", testkit.Fingerprint("a"), idem.Uncertain)
	wantErr(t, "Checkpoint of an unknown record", h.eng.Checkpoint(ctx, l, "x", nil), idem.ErrLeaseLost)
	h.complete(t, l, okResponse("late"))
	wantErr(t, "Checkpoint after completion", h.eng.Checkpoint(ctx, l, "x", nil), idem.ErrLeaseLost)
	if n := len(h.get(t, "s", "k").Checkpoints); n != 1 {
		t.Fatalf("%d checkpoints stored, want only the valid one", n)
	}
}

// testDurabilityReported: every store says what a crash of its server would
// cost, and names the same server run twice in a row.
func testDurabilityReported(t *testing.T, h *harness) {
	r, ok := h.store.(store.DurabilityReporter)
	if !ok {
		t.Fatalf("%T does not implement store.DurabilityReporter", h.store)
	}
	first, err := r.Durability(ctx)
	if err != nil {
		t.Fatalf("Durability: %v", err)
	}
	if first.Detail == "" {
		t.Fatalf("Durability %+v says nothing", first)
	}
	second, err := r.Durability(ctx)
	if err != nil || second != first {
		t.Fatalf("Durability again = %+v, %v; want %+v", second, err, first)
	}
}

// testScanCursorsAreOwn: a scan cursor continues a scan of the store that
// made it and of no other: another store of the same kind (another schema,
// prefix, table or file), or a cursor that is not one, gives ErrInvalid.
func testScanCursorsAreOwn(t *testing.T, h *harness) {
	for _, k := range []string{"a", "b"} {
		if err := h.eng.MarkUnknown(ctx, h.mustExecute(t, "s", k, testkit.Fingerprint("x"))); err != nil {
			t.Fatal(err)
		}
	}
	first, err := h.store.Scan(ctx, store.ScanParams{Now: h.clock.Now(), Limit: 1})
	if err != nil || len(first.Records) != 1 || first.Cursor == "" {
		t.Fatalf("a page of one of two stale records = %+v, %v", first, err)
	}
	next, err := h.store.Scan(ctx, store.ScanParams{Now: h.clock.Now(), Limit: 1, Cursor: first.Cursor})
	if err != nil || len(next.Records) != 1 || next.Records[0].Key == first.Records[0].Key {
		t.Fatalf("the next page = %+v, %v", next, err)
	}
	other := h.newStore(t)
	_, err = other.Scan(ctx, store.ScanParams{Now: h.clock.Now(), Limit: 1, Cursor: first.Cursor})
	wantErr(t, "another store's cursor", err, idem.ErrInvalid)
	for _, bad := range []string{"x", "!!", "AQ", store.EncodeCursor("someone else", "s", "a")} {
		_, err := h.store.Scan(ctx, store.ScanParams{Now: h.clock.Now(), Cursor: bad})
		wantErr(t, fmt.Sprintf("cursor %q", bad), err, idem.ErrInvalid)
	}
}

// testScanWhileSettling: a reconciler settles what each page returns before
// it asks for the next, the last record of the page (where the cursor
// stands) included; every record that was stale when the scan began is still
// returned exactly once.
func testScanWhileSettling(t *testing.T, h *harness) {
	const n = 50
	want := map[string]bool{}
	for i := range n {
		key := fmt.Sprintf("k%02d", i)
		l := h.mustExecute(t, "s", key, testkit.Fingerprint("x"))
		if i%2 == 0 {
			if err := h.eng.MarkUnknown(ctx, l); err != nil {
				t.Fatal(err)
			}
		}
		want[key] = true
	}
	h.clock.Advance(lease) // the others' leases run out: stale too
	now := h.clock.Now()
	seen := map[string]bool{}
	settled, cursor := 0, ""
	for pages := 0; ; pages++ {
		if pages > n {
			t.Fatal("the scan does not end")
		}
		res, err := h.store.Scan(ctx, store.ScanParams{Now: now, Limit: 7, Cursor: cursor})
		if err != nil {
			t.Fatal(err)
		}
		for i, r := range res.Records {
			if seen[r.Key] {
				t.Fatalf("%s returned twice", r.Key)
			}
			seen[r.Key] = true
			if i%3 == 0 || i == len(res.Records)-1 {
				testkit.Finish(t, h.store, r, now, idem.StateFailed, time.Hour)
				settled++
			}
		}
		if cursor = res.Cursor; cursor == "" {
			break
		}
	}
	if len(seen) != len(want) {
		t.Fatalf("the scan returned %d of the %d stale records", len(seen), len(want))
	}
	left := 0
	for cursor := ""; ; {
		res, err := h.store.Scan(ctx, store.ScanParams{Now: now, Cursor: cursor})
		if err != nil {
			t.Fatal(err)
		}
		left += len(res.Records)
		if cursor = res.Cursor; cursor == "" {
			break
		}
	}
	if left != n-settled {
		t.Fatalf("a fresh scan found %d records; want the %d left unsettled", left, n-settled)
	}
}

// testListFiltersRecords: List returns every live record that matches its
// filter, whatever its state, over pages of at most Limit, and no other.
func testListFiltersRecords(t *testing.T, h *harness) {
	fp := testkit.Fingerprint("x")
	t0 := h.clock.Now()
	h.complete(t, h.mustExecute(t, "tenant-a", "order-1", fp), okResponse("1"))
	if err := h.eng.Release(ctx, h.mustExecute(t, "tenant-a", "order-2", fp)); err != nil {
		t.Fatal(err)
	}
	h.mustExecute(t, "tenant-a", "refund-1", fp) // left in progress
	gone := testkit.Acquire(t, h.store, "tenant-a", "order-gone", t0, lease)
	testkit.Finish(t, h.store, gone, t0, idem.StateCompleted, time.Minute) // expired by the listing
	h.clock.Advance(10 * time.Minute)
	t1 := h.clock.Now()
	if err := h.eng.MarkUnknown(ctx, h.mustExecute(t, "tenant-b", "order-1", fp)); err != nil {
		t.Fatal(err)
	}
	h.complete(t, h.mustExecute(t, "tenant-b", "order-3", fp), okResponse("3"))
	h.complete(t, h.mustExecute(t, "tenant-ab", "order-4", fp), okResponse("4"))
	h.clock.Advance(time.Second)

	states := map[string]idem.State{
		"tenant-a/order-1": idem.StateCompleted, "tenant-a/order-2": idem.StateFailed, "tenant-a/refund-1": idem.StateInProgress,
		"tenant-b/order-1": idem.StateUnknown, "tenant-b/order-3": idem.StateCompleted, "tenant-ab/order-4": idem.StateCompleted,
	}
	for _, c := range []struct {
		name string
		p    idem.ListParams
		want []string
	}{
		{"everything live", idem.ListParams{}, slices.Collect(maps.Keys(states))},
		{"completed", idem.ListParams{States: []idem.State{idem.StateCompleted}}, []string{"tenant-a/order-1", "tenant-b/order-3", "tenant-ab/order-4"}},
		{"settled, scope prefix", idem.ListParams{States: []idem.State{idem.StateCompleted, idem.StateFailed}, ScopePrefix: "tenant-a"},
			[]string{"tenant-a/order-1", "tenant-a/order-2", "tenant-ab/order-4"}},
		{"key prefix", idem.ListParams{KeyPrefix: "order-"}, []string{"tenant-a/order-1", "tenant-a/order-2", "tenant-b/order-1", "tenant-b/order-3", "tenant-ab/order-4"}},
		{"created from", idem.ListParams{CreatedFrom: t1}, []string{"tenant-b/order-1", "tenant-b/order-3", "tenant-ab/order-4"}},
		{"created before", idem.ListParams{CreatedBefore: t1}, []string{"tenant-a/order-1", "tenant-a/order-2", "tenant-a/refund-1"}},
		{"unknown, key and scope", idem.ListParams{States: []idem.State{idem.StateUnknown}, ScopePrefix: "tenant-b", KeyPrefix: "order-1"}, []string{"tenant-b/order-1"}},
		{"in progress", idem.ListParams{States: []idem.State{idem.StateInProgress}}, []string{"tenant-a/refund-1"}},
		{"none", idem.ListParams{KeyPrefix: "nothing"}, nil},
	} {
		seen := map[string]bool{}
		p := c.p
		p.Limit = 2
		for pages := 0; ; pages++ {
			if pages > 20 {
				t.Fatalf("%s: the listing does not end", c.name)
			}
			res, err := h.eng.List(ctx, p)
			if err != nil {
				t.Fatalf("%s: List: %v", c.name, err)
			}
			if len(res.Records) > 2 {
				t.Fatalf("%s: a page of %d records with limit 2", c.name, len(res.Records))
			}
			for _, r := range res.Records {
				id := r.Scope + "/" + r.Key
				if want, ok := states[id]; !ok || r.State != want {
					t.Fatalf("%s: listed %s in state %s; want %s", c.name, id, r.State, want)
				}
				seen[id] = true
			}
			if p.Cursor = res.Cursor; p.Cursor == "" {
				break
			}
		}
		got := slices.Sorted(maps.Keys(seen))
		want := slices.Sorted(slices.Values(c.want))
		if !slices.Equal(got, want) {
			t.Errorf("%s: listed %v; want %v", c.name, got, want)
		}
	}
	res, err := h.eng.List(ctx, idem.ListParams{})
	if err != nil || len(res.Records) != len(states) || res.Cursor != "" {
		t.Fatalf("List with the default limit: %d records, cursor %q, %v; want all %d in one page", len(res.Records), res.Cursor, err, len(states))
	}
}

// testListCursorsAreOwn: a listing's cursor continues it, and a cursor of
// another store or a malformed one is refused, as are malformed params.
func testListCursorsAreOwn(t *testing.T, h *harness) {
	for _, k := range []string{"a", "b"} {
		h.complete(t, h.mustExecute(t, "s", k, testkit.Fingerprint("x")), okResponse(k))
	}
	var first idem.ScanResult
	for p := (idem.ListParams{Now: h.clock.Now(), Limit: 1}); len(first.Records) == 0; {
		var err error
		if first, err = h.store.List(ctx, p); err != nil || first.Cursor == "" {
			t.Fatalf("a page of one of two records = %+v, %v", first, err)
		}
		p.Cursor = first.Cursor
	}
	other := h.newStore(t)
	_, err := other.List(ctx, idem.ListParams{Now: h.clock.Now(), Limit: 1, Cursor: first.Cursor})
	wantErr(t, "another store's cursor", err, idem.ErrInvalid)
	for _, bad := range []string{"x", "!!", "AQ", store.EncodeCursor("someone else", "s", "a")} {
		_, err := h.store.List(ctx, idem.ListParams{Now: h.clock.Now(), Cursor: bad})
		wantErr(t, fmt.Sprintf("cursor %q", bad), err, idem.ErrInvalid)
	}
	now := h.clock.Now()
	for name, p := range map[string]idem.ListParams{
		"no time":         {},
		"negative limit":  {Now: now, Limit: -1},
		"unknown state":   {Now: now, States: []idem.State{"done"}},
		"empty time span": {Now: now, CreatedFrom: now, CreatedBefore: now},
	} {
		_, err := h.store.List(ctx, p)
		wantErr(t, name, err, idem.ErrInvalid)
	}
}
