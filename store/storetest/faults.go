package storetest

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/faultnet"
	"github.com/idemhq/idem/internal/testkit"
	"github.com/idemhq/idem/internal/wait"
	"github.com/idemhq/idem/store"
)

// faultStoreTimeout is the engine's store timeout in the fault cases: short,
// so that an outage is noticed quickly.
const faultStoreTimeout = 700 * time.Millisecond

// RunFaults runs the cases that inject real network faults between the engine
// and a networked store, through a TCP proxy: replies lost after the store
// acted, connections cut, the store unreachable. target is the store
// server's address (host:port); newStore must return an empty store of its
// own that reaches the server through addr instead of target, with a
// connection pool of one where the driver has a pool, and release it with
// t.Cleanup.
//
// The promises checked: an answer lost on the way back never turns into an
// error when the store did act; a write that cannot be made while the store
// is away waits in the engine's journal, is replayed from there meanwhile,
// and lands when the store returns, across a restart too; an acquire that
// cannot be made fails closed and leaves no key blocked.
func RunFaults(t *testing.T, target string, newStore func(t *testing.T, addr string) idem.Store) {
	cases := []struct {
		name string
		fn   func(t *testing.T, f *faultHarness)
	}{
		{"AcquireReplyLost", testAcquireReplyLost},
		{"FinishReplyLost", testFinishReplyLost},
		{"ConnectionsCut", testConnectionsCut},
		{"OutageFailsAcquireClosed", testOutageFailsAcquireClosed},
		{"OutageFailsEveryCall", testOutageFailsEveryCall},
		{"OutageJournalsOutcome", testOutageJournalsOutcome},
		{"JournalSurvivesRestart", testJournalSurvivesRestart},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			proxy, err := faultnet.Listen(target)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { proxy.Close() })
			f := &faultHarness{proxy: proxy, store: newStore(t, proxy.Addr()), dir: t.TempDir()}
			f.eng = f.engine(t)
			c.fn(t, f)
		})
	}
}

// testWriter writes log lines to the test's log.
type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimSuffix(string(p), "\n"))
	return len(p), nil
}

type faultHarness struct {
	proxy *faultnet.Proxy
	store idem.Store
	eng   *idem.Engine
	dir   string // the engines' journal
}

// engine returns an engine on the harness's store and journal, closed with
// the test.
func (f *faultHarness) engine(t *testing.T) *idem.Engine {
	t.Helper()
	e, err := idem.New(idem.Config{Store: f.store, StoreTimeout: faultStoreTimeout, JournalDir: f.dir,
		Logger: slog.New(slog.NewTextHandler(testWriter{t}, nil))})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		e.Close(ctx)
	})
	return e
}

func (f *faultHarness) begin(t *testing.T, e *idem.Engine, key string, want idem.Decision) idem.Outcome {
	t.Helper()
	out, err := e.Begin(ctx, idem.BeginParams{Scope: "s", Key: key, Fingerprint: testkit.Fingerprint("a")})
	if err != nil {
		t.Fatalf("Begin(%q): %v", key, err)
	}
	if out.Decision != want {
		t.Fatalf("Begin(%q) = %v, want %v (record %+v)", key, out.Decision, want, out.Record)
	}
	return out
}

// warmUp runs a whole request, so that the driver has its connection and
// its prepared statements: the fault that follows hits the operation itself.
func (f *faultHarness) warmUp(t *testing.T) {
	t.Helper()
	l := f.begin(t, f.eng, "warm-up", idem.Execute).Lease
	if err := f.eng.Complete(ctx, l, okResponse("warm")); err != nil {
		t.Fatal(err)
	}
	f.begin(t, f.eng, "warm-up", idem.Replay)
}

func (f *faultHarness) dropped(t *testing.T, want int64) {
	t.Helper()
	if got := f.proxy.Stats().RepliesDropped; got != want {
		t.Fatalf("replies dropped: %d, want %d (the fault did not fire)", got, want)
	}
}

// testAcquireReplyLost: the store created the record, and its answer was
// lost. Asking again with the same token is answered the same way, so the
// caller holds the lease and runs the work once.
func testAcquireReplyLost(t *testing.T, f *faultHarness) {
	f.warmUp(t)
	f.proxy.DropNextReply()
	out := f.begin(t, f.eng, "k", idem.Execute)
	f.dropped(t, 1)
	resp := okResponse("once")
	if err := f.eng.Complete(ctx, out.Lease, resp); err != nil {
		t.Fatal(err)
	}
	sameResponse(t, f.begin(t, f.eng, "k", idem.Replay).Record.Response, resp)
}

// testFinishReplyLost: the store settled the record, and its answer was
// lost. The engine sends the same write again, which succeeds: the outcome
// is stored, and nothing waits in the journal.
func testFinishReplyLost(t *testing.T, f *faultHarness) {
	f.warmUp(t)
	l := f.begin(t, f.eng, "k", idem.Execute).Lease
	f.proxy.DropNextReply()
	resp := okResponse("done")
	if err := f.eng.Complete(ctx, l, resp); err != nil {
		t.Fatalf("Complete whose answer was lost: %v", err)
	}
	f.dropped(t, 1)
	if n := f.eng.Pending(); n != 0 {
		t.Fatalf("%d outcome(s) in the journal; the store was reachable", n)
	}
	sameResponse(t, f.begin(t, f.eng, "k", idem.Replay).Record.Response, resp)
}

// testConnectionsCut: every connection to the store is cut (a restarted
// server, a killed backend) between the acquire and the completion; the
// engine reconnects and stores the outcome.
func testConnectionsCut(t *testing.T, f *faultHarness) {
	f.warmUp(t)
	l := f.begin(t, f.eng, "k", idem.Execute).Lease
	f.proxy.CutAll()
	resp := okResponse("done")
	if err := f.eng.Complete(ctx, l, resp); err != nil {
		t.Fatalf("Complete after the connections were cut: %v", err)
	}
	if n := f.eng.Pending(); n != 0 {
		t.Fatalf("%d outcome(s) in the journal; the store was reachable", n)
	}
	f.proxy.CutAll()
	sameResponse(t, f.begin(t, f.eng, "k", idem.Replay).Record.Response, resp)
}

// testOutageFailsAcquireClosed: while the store is unreachable, Begin fails
// with ErrUnavailable within the store timeout (nothing runs), and once the
// store is back the key is free: the failed attempt left nothing blocked.
func testOutageFailsAcquireClosed(t *testing.T, f *faultHarness) {
	f.warmUp(t)
	end := f.proxy.Outage()
	began := time.Now()
	_, err := f.eng.Begin(ctx, idem.BeginParams{Scope: "s", Key: "k", Fingerprint: testkit.Fingerprint("a")})
	if !errors.Is(err, idem.ErrUnavailable) {
		t.Fatalf("Begin during an outage: %v, want ErrUnavailable", err)
	}
	if took := time.Since(began); took > faultStoreTimeout+3*time.Second {
		t.Fatalf("Begin took %v to fail; the store timeout is %v", took, faultStoreTimeout)
	}
	end()
	out := f.begin(t, f.eng, "k", idem.Execute)
	if err := f.eng.Complete(ctx, out.Lease, okResponse("ran")); err != nil {
		t.Fatal(err)
	}
	wait.Until(t, 10*time.Second, "the journal to empty", func() bool { return f.eng.Pending() == 0 })
}

// testOutageJournalsOutcome: the work finished while the store was away.
// Complete keeps the outcome in the journal and says so by succeeding; the
// engine replays it from there (and refuses another payload); when the store
// returns the outcome lands, and any engine replays it.
func testOutageJournalsOutcome(t *testing.T, f *faultHarness) {
	f.warmUp(t)
	l := f.begin(t, f.eng, "k", idem.Execute).Lease
	end := f.proxy.Outage()
	resp := okResponse(`{"id":"ch_1"}`)
	if err := f.eng.Complete(ctx, l, resp); err != nil {
		t.Fatalf("Complete during an outage: %v", err)
	}
	if n := f.eng.Pending(); n != 1 {
		t.Fatalf("%d outcome(s) in the journal, want 1", n)
	}
	sameResponse(t, f.begin(t, f.eng, "k", idem.Replay).Record.Response, resp)
	out, err := f.eng.Begin(ctx, idem.BeginParams{Scope: "s", Key: "k", Fingerprint: testkit.Fingerprint("b")})
	if err != nil || out.Decision != idem.Mismatch {
		t.Fatalf("another payload during the outage: %v, %v; want mismatch", out.Decision, err)
	}
	end()
	wait.Until(t, 10*time.Second, "the journaled outcome to land", func() bool { return f.eng.Pending() == 0 })
	other, err := idem.New(idem.Config{Store: f.store})
	if err != nil {
		t.Fatal(err)
	}
	sameResponse(t, f.begin(t, other, "k", idem.Replay).Record.Response, resp)
}

// testJournalSurvivesRestart: the process that kept the outcome in its
// journal stops before the store returns; the next engine opened on the
// journal lands it.
func testJournalSurvivesRestart(t *testing.T, f *faultHarness) {
	f.warmUp(t)
	l := f.begin(t, f.eng, "k", idem.Execute).Lease
	end := f.proxy.Outage()
	resp := okResponse(`{"id":"ch_2"}`)
	if err := f.eng.Complete(ctx, l, resp); err != nil {
		t.Fatalf("Complete during an outage: %v", err)
	}
	stopped, cancel := context.WithCancel(ctx)
	cancel()
	if err := f.eng.Close(stopped); err == nil {
		t.Fatal("Close with an outcome still waiting said nothing")
	}
	end()
	next := f.engine(t)
	wait.Until(t, 10*time.Second, "the next engine to land the journaled outcome", func() bool { return next.Pending() == 0 })
	r, err := next.Get(ctx, "s", "k")
	if err != nil || r.State != idem.StateCompleted {
		t.Fatalf("record after the restart: %+v, %v", r, err)
	}
	sameResponse(t, r.Response, resp)
}

// testOutageFailsEveryCall: while the server cannot be reached, every
// operation of the store fails with ErrUnavailable, and with no other
// sentinel (the outcome is not known, so nothing else may be claimed); a
// context cancelled by the caller stays a cancellation, not unavailability.
func testOutageFailsEveryCall(t *testing.T, f *faultHarness) {
	f.warmUp(t)
	end := f.proxy.Outage()
	defer end()
	now := time.Now()
	tok := strings.Repeat("a", 32)
	call := func(name string, fn func(ctx context.Context) error) {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		err := fn(ctx)
		if name == "Prune" && err == nil {
			return // a store whose server expires records itself has nothing to ask it
		}
		if !errors.Is(err, idem.ErrUnavailable) {
			t.Errorf("%s during an outage: %v, want ErrUnavailable", name, err)
		}
		for _, other := range []error{idem.ErrNotFound, idem.ErrLeaseLost, idem.ErrInvalid} {
			if errors.Is(err, other) {
				t.Errorf("%s during an outage: %v also claims %v", name, err, other)
			}
		}
	}
	call("Acquire", func(ctx context.Context) error {
		_, err := f.store.Acquire(ctx, store.AcquireParams{Scope: "s", Key: "k", Fingerprint: testkit.Fingerprint("a"), Token: tok, Now: now, LeaseExpires: now.Add(time.Minute)})
		return err
	})
	call("Renew", func(ctx context.Context) error {
		return f.store.Renew(ctx, store.RenewParams{Scope: "s", Key: "k", Token: tok, Now: now, LeaseExpires: now.Add(time.Minute)})
	})
	call("Checkpoint", func(ctx context.Context) error {
		return f.store.Checkpoint(ctx, store.CheckpointParams{Scope: "s", Key: "k", Token: tok, Now: now, Name: "step"})
	})
	call("Finish", func(ctx context.Context) error {
		return f.store.Finish(ctx, idem.FinishParams{Scope: "s", Key: "k", Token: tok, Now: now, State: idem.StateFailed, Expires: now.Add(time.Hour)})
	})
	call("Get", func(ctx context.Context) error {
		_, err := f.store.Get(ctx, store.GetParams{Scope: "s", Key: "k", Now: now})
		return err
	})
	call("Scan", func(ctx context.Context) error {
		_, err := f.store.Scan(ctx, store.ScanParams{Now: now})
		return err
	})
	call("Prune", func(ctx context.Context) error {
		_, err := f.store.Prune(ctx, store.PruneParams{Now: now})
		return err
	})
	canceled, cancel := context.WithCancel(context.Background())
	cancel()
	_, err := f.store.Get(canceled, store.GetParams{Scope: "s", Key: "k", Now: now})
	if !errors.Is(err, context.Canceled) || errors.Is(err, idem.ErrUnavailable) {
		t.Errorf("Get with a cancelled context: %v, want context.Canceled and not ErrUnavailable", err)
	}
}
