package idem_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/store/memstore"
)

// sharedNotifier stands in for PostgreSQL LISTEN/NOTIFY between engines:
// both engines hold the same one. It keeps the Notifier contract: per-record
// subscribers, a Notify that never blocks, a cancel that unsubscribes.
type sharedNotifier struct {
	mu   sync.Mutex
	subs map[string]map[chan struct{}]bool
}

func (n *sharedNotifier) Subscribe(scope, key string) (<-chan struct{}, func()) {
	ch := make(chan struct{}, 1)
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.subs == nil {
		n.subs = map[string]map[chan struct{}]bool{}
	}
	id := scope + "\x00" + key
	if n.subs[id] == nil {
		n.subs[id] = map[chan struct{}]bool{}
	}
	n.subs[id][ch] = true
	return ch, func() {
		n.mu.Lock()
		defer n.mu.Unlock()
		delete(n.subs[id], ch)
	}
}

func (n *sharedNotifier) Notify(ctx context.Context, scope, key string) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	for ch := range n.subs[scope+"\x00"+key] {
		select {
		case ch <- struct{}{}:
		default:
		}
	}
	return nil
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
		if out := <-w; out.Decision != idem.Replay || string(out.Record.Response.Body) != "done" {
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
	if out := <-w; out.Decision != idem.Execute || out.Lease.Fence != 2 {
		t.Fatalf("waiter after release got %v fence %d, want to execute with fence 2", out.Decision, out.Lease.Fence)
	}
}

func TestAwaitGivesUp(t *testing.T) {
	e, _ := awaitSetup(t, idem.Config{Store: memstore.New()})
	start := time.Now()
	out := <-await(e, 50*time.Millisecond)
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
	if out := <-w; out.Decision != idem.Replay {
		t.Fatalf("waiter on the other instance got %v, want the replay", out.Decision)
	}
}
