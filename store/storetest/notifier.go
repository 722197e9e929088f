package storetest

import (
	"context"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/testkit"
	"github.com/idemhq/idem/store"
)

// notifyWait bounds every wait for a notification: a signal wait that fails
// the test when it runs out, not a sleep.
const notifyWait = 10 * time.Second

// RunNotifier runs the conformance cases for an [idem.Notifier] as parallel
// subtests. newInstances is called once per subtest and returns a fresh
// store and a function that makes a notifier on one shared channel each time
// it is called, as separate processes would have; it cleans up with
// t.Cleanup.
func RunNotifier(t *testing.T, newInstances func(t *testing.T) (idem.Store, func() idem.Notifier)) {
	cases := []struct {
		name string
		fn   func(t *testing.T, store idem.Store, newNotifier func() idem.Notifier)
	}{
		{"WakesOtherInstance", testNotifierWakesOtherInstance},
		{"KeepsRecordsApart", testNotifierKeepsRecordsApart},
		{"Cancel", testNotifierCancel},
		{"WakesAwaitOnOtherEngine", testNotifierWakesAwaitOnOtherEngine},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			store, newNotifier := newInstances(t)
			c.fn(t, store, newNotifier)
		})
	}
}

// testNotifierWakesOtherInstance: a notification sent by one instance right
// after another's notifier was made wakes the other's subscriber (and the
// sender's own).
func testNotifierWakesOtherInstance(t *testing.T, _ idem.Store, newNotifier func() idem.Notifier) {
	a, b := newNotifier(), newNotifier()
	onB, cancelB := b.Subscribe("s", "k")
	defer cancelB()
	onA, cancelA := a.Subscribe("s", "k")
	defer cancelA()
	testkit.MustNotify(t, a, "s", "k")
	testkit.Woken(t, onB, "the other instance's subscriber")
	testkit.Woken(t, onA, "the sending instance's own subscriber")
}

// testNotifierKeepsRecordsApart: a notification for another key, or for the
// same key in another scope, does not wake a subscriber. Notifications sent
// one after another arrive in that order, so once the marker's has arrived
// the wrong ones have been handled.
func testNotifierKeepsRecordsApart(t *testing.T, _ idem.Store, newNotifier func() idem.Notifier) {
	a, b := newNotifier(), newNotifier()
	right, c1 := b.Subscribe("s", "k")
	defer c1()
	otherKey, c2 := b.Subscribe("s", "k2")
	defer c2()
	otherScope, c3 := b.Subscribe("s2", "k")
	defer c3()
	marker, c4 := b.Subscribe("s", "marker")
	defer c4()

	testkit.MustNotify(t, a, "s", "k2")
	testkit.MustNotify(t, a, "s2", "k")
	testkit.MustNotify(t, a, "s", "marker")
	testkit.Woken(t, marker, "the marker's subscriber")
	if !testkit.Pending(otherKey) || !testkit.Pending(otherScope) {
		t.Fatal("the notifications sent before the marker's were not delivered before it")
	}
	if testkit.Pending(right) {
		t.Fatal("a notification for another key or scope woke the subscriber")
	}
	testkit.MustNotify(t, a, "s", "k")
	testkit.Woken(t, right, "the subscriber")
	if testkit.Pending(right) || testkit.Pending(otherKey) || testkit.Pending(otherScope) || testkit.Pending(marker) {
		t.Fatal("a subscriber was woken twice, or by another record's notification")
	}
}

// testNotifierCancel: a cancelled subscription is no longer woken, and the
// others on the same record still are.
func testNotifierCancel(t *testing.T, _ idem.Store, newNotifier func() idem.Notifier) {
	n := newNotifier()
	gone, cancelGone := n.Subscribe("s", "k")
	kept, cancelKept := n.Subscribe("s", "k")
	defer cancelKept()
	cancelGone()
	cancelGone() // twice is harmless
	testkit.MustNotify(t, n, "s", "k")
	testkit.Woken(t, kept, "the remaining subscriber")
	if testkit.Pending(gone) {
		t.Fatal("a cancelled subscription was woken")
	}
}

// acquireSignal reports each Acquire once it has returned.
type acquireSignal struct {
	idem.Store
	acquired chan idem.Record
}

func (s *acquireSignal) Acquire(ctx context.Context, p store.AcquireParams) (idem.Record, error) {
	r, err := s.Store.Acquire(ctx, p)
	s.acquired <- r
	return r, err
}

// testNotifierWakesAwaitOnOtherEngine: two engines on one store, each with
// its own notifier and an hour between polls, so only a notification can
// wake a waiter in time: the second engine's Await returns the replay as
// soon as the first engine completes.
func testNotifierWakesAwaitOnOtherEngine(t *testing.T, store idem.Store, newNotifier func() idem.Notifier) {
	first, err := idem.New(idem.Config{Store: store, Notifier: newNotifier(), Poll: time.Hour, Lease: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	sig := &acquireSignal{Store: store, acquired: make(chan idem.Record, 10)}
	second, err := idem.New(idem.Config{Store: sig, Notifier: newNotifier(), Poll: time.Hour, Lease: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	req := idem.BeginParams{Scope: "s", Key: "k", Fingerprint: testkit.Fingerprint("a")}
	out, err := first.Begin(ctx, req)
	if err != nil || out.Decision != idem.Execute {
		t.Fatalf("first Begin = %v, %v; want execute", out.Decision, err)
	}
	type result struct {
		out idem.Outcome
		err error
	}
	waited := make(chan result, 1)
	go func() {
		out, err := second.Await(ctx, req, time.Minute)
		waited <- result{out, err}
	}()
	select {
	case r := <-sig.acquired: // the waiter saw the record in flight and now waits
		if r.State != idem.StateInProgress {
			t.Fatalf("the waiter found the record %s", r.State)
		}
	case <-time.After(notifyWait):
		t.Fatal("the waiter never looked the record up")
	}
	if err := first.Complete(ctx, out.Lease, &idem.Response{Status: 201, Body: []byte("done")}); err != nil {
		t.Fatal(err)
	}
	select {
	case r := <-waited:
		if r.err != nil || r.out.Decision != idem.Replay || string(r.out.Record.Response.Body) != "done" {
			t.Fatalf("the waiter on the other engine got %v, %v; want the replay", r.out.Decision, r.err)
		}
	case <-time.After(notifyWait):
		t.Fatal("the waiter on the other engine was not woken by the completion")
	}
}
