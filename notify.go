package idem

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idemhq/idem/store"
)

// DefaultPoll is how often a waiting caller looks again when nothing wakes it.
const DefaultPoll = 250 * time.Millisecond

// localNotifier wakes waiters in this process.
type localNotifier struct {
	waiters store.Waiters
	// subscribed counts the subscriptions, so that settling a record
	// nobody in this process waits for (most of them) costs no lookup.
	subscribed atomic.Int64
}

func (n *localNotifier) Subscribe(scope, key string) (<-chan struct{}, func()) {
	n.subscribed.Add(1)
	ch, cancel := n.waiters.Add(KeyHash(scope, key))
	var once sync.Once
	return ch, func() {
		once.Do(func() {
			cancel()
			n.subscribed.Add(-1)
		})
	}
}

func (n *localNotifier) Notify(_ context.Context, scope, key string) error {
	if n.subscribed.Load() > 0 {
		n.waiters.Wake(KeyHash(scope, key))
	}
	return nil
}

// Await is Begin that, while another owner is running the work, waits up to
// within for it to settle and then decides again: a caller gets the replay
// (or the key, when the first owner released it) instead of a conflict. It
// wakes at once when an engine in this process, or one reached through
// [Config.Notifier], settles the record, and otherwise looks again every
// [Config.Poll] (or sooner, when the running lease ends sooner). When the
// wait runs out, the last InFlight outcome is returned; when ctx ends, its
// error with that outcome (InFlight when nothing newer is known).
//
// Callers in this process that wait for the same record and payload share
// one wait: while the work runs in another process one of them asks the
// store at a time for them all; while it runs in this one none of them
// polls (its owner wakes them when it settles or loses the record), but
// one listens to the Notifier and asks the store when a settlement is
// announced (and once when it starts listening), and they look at the
// store when the owner's lease runs out unsettled. A thousand duplicates
// cost what one does.
func (e *Engine) Await(ctx context.Context, p BeginParams, within time.Duration) (Outcome, error) {
	deadline := e.clock.Now().Add(within)
	// Most requests wait for nothing: decide once, and only a duplicate of
	// running work (here, or known to callers already waiting) waits.
	out, ok := e.known(p, true)
	if ok && out.Decision != InFlight {
		return out, nil
	}
	if !ok && !e.waits.active(p) {
		out, err := e.Begin(ctx, p)
		if err != nil || out.Decision != InFlight {
			return out, err
		}
	}
	local, cancelLocal := e.local.Subscribe(p.Scope, p.Key)
	defer cancelLocal()
	g := e.waits.join(p)
	polling := false
	defer func() {
		if e.waits.leave(g, polling) {
			e.local.Notify(ctx, p.Scope, p.Key) // somebody else polls from now on
		}
	}()
	// The poller hears of other instances' completions, subscribed before
	// the lookup that decides to wait: a completion after that lookup wakes
	// it, one before it is what the lookup finds.
	var remote <-chan struct{}
	cancelRemote := func() {}
	defer func() { cancelRemote() }()
	subscribe := func() (now bool) {
		if remote == nil && e.notifier != nil {
			remote, cancelRemote = e.notifier.Subscribe(p.Scope, p.Key)
			return true
		}
		return false
	}
	heard := false // the Notifier announced a settlement since the last step
	for {
		out, err, ok, here := e.awaitStep(ctx, p, g, &polling, subscribe, heard)
		heard = false
		if ok && (err != nil || out.Decision != InFlight) {
			return out, err
		}
		now := e.clock.Now()
		left := deadline.Sub(now)
		if left <= 0 {
			if !ok { // the poller has not answered yet
				out = Outcome{Decision: InFlight, RetryAfter: time.Second}
			}
			return out, nil
		}
		leaseEnd := max(out.Record.LeaseExpires.Sub(now), time.Millisecond)
		pause := left // a member that does not poll waits for news
		switch {
		case here:
			// A lease held in this process: its owner wakes the waiters
			// when it settles or loses the record, but a lease that runs
			// out unsettled (a stuck handler, failing renewals) is news
			// nobody announces. Every member looks again then (without
			// the store, until the lease is over: a renewal moves it).
			pause = min(left, leaseEnd)
		case polling:
			pause = min(left, e.poll, leaseEnd)
		}
		select {
		case <-ctx.Done():
			if out.Decision == 0 { // the poller had not answered: the first still runs, as far as this caller knows
				out = Outcome{Decision: InFlight, RetryAfter: time.Second}
			}
			return out, ctx.Err()
		case <-local:
		case <-remote:
			heard = true
		case <-e.clock.After(pause):
		}
	}
}

// Waiting reports how many callers of Await wait for the record under scope
// and key.
func (e *Engine) Waiting(scope, key string) int { return e.local.waiters.Len(KeyHash(scope, key)) }

// awaitStep decides once for a member of g: from what this process knows
// (an outcome in the journal or the cache, the poller's final answer, work
// running here), or else from the store if the member is, or becomes, the
// one that polls (subscribed first, so that no completion falls between its
// lookup and its subscription), or else from the poller's latest answer (ok
// is false while there is none). here reports an InFlight answer from a
// lease that a caller of this engine holds.
//
// While the work runs here, the poller does not poll: it asks the store
// only when the Notifier announced a settlement (heard), or when it has
// just subscribed (an announcement before that would be lost). Another
// instance may settle the record under the running lease (an operator, a
// reconciler), and the owner learns it only at its next write. Only a
// decided answer from the store is taken then: an error or an InFlight is
// no news while the owner here runs, and the members keep waiting for it.
func (e *Engine) awaitStep(ctx context.Context, p BeginParams, g *waitGroup, polling *bool, subscribe func() bool, heard bool) (out Outcome, err error, ok, here bool) {
	mine, runs := e.known(p, true)
	if runs && mine.Decision != InFlight {
		return mine, nil, true, false
	}
	if !*polling {
		out, err, ok := e.waits.latest(g)
		if ok && (err != nil || out.Decision != InFlight) {
			return out, err, true, false // the poller's final answer
		}
		if !e.waits.claim(g) {
			if runs {
				return mine, nil, true, true
			}
			return out, err, ok, false
		}
		*polling = true
	}
	if subscribe() {
		heard = true
	}
	if runs && !heard {
		return mine, nil, true, true
	}
	out, err = e.Begin(ctx, p)
	if err != nil && ctx.Err() != nil {
		// It gave up: its own answer, not the others'. One of them polls
		// in its place once it has left.
		return out, err, true, false
	}
	if runs && (err != nil || out.Decision == InFlight) {
		return mine, nil, true, true
	}
	if err != nil || out.Decision != Execute {
		e.waits.publish(g, out, err)
		if err != nil || out.Decision != InFlight {
			e.local.Notify(ctx, p.Scope, p.Key) // news for the others
		}
	}
	return out, err, true, false
}

// notifyTimeout bounds a cross-instance notification.
const notifyTimeout = 5 * time.Second

// notify wakes this process's waiters at once and, through the Notifier, the
// others' in the background: the outcome is already stored, so neither a
// slow Notifier nor a client that went away may hold the caller up. A failure
// to notify only delays waiters until they poll, so it is not reported.
func (e *Engine) notify(ctx context.Context, scope, key string) {
	e.local.Notify(ctx, scope, key)
	if e.notifier != nil {
		ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), notifyTimeout)
		go func() {
			defer cancel()
			e.notifier.Notify(ctx, scope, key)
		}()
	}
}
