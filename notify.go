package idem

import (
	"context"
	"sync"
	"time"
)

// Notifier wakes callers waiting for a record to be settled, across
// instances (PostgreSQL LISTEN/NOTIFY, Redis pub/sub). The engine always
// wakes waiters in its own process; a Notifier adds the others. Delivery may
// be lost and wake-ups may be spurious: a value on the channel only means
// "look again", and waiters also poll, so a Notifier only makes them faster.
// The caller that made a Notifier owns it and closes it; the engine does not.
//
// With a Notifier, every settled record costs one more store round trip,
// made in the background off the request's path.
type Notifier interface {
	// Subscribe returns a channel that receives a value after a later
	// Notify for scope and key, and a function that ends the subscription.
	// It must never block a Notify.
	Subscribe(scope, key string) (ch <-chan struct{}, cancel func())
	// Notify tells every subscriber of scope and key, in every process,
	// that the record was settled.
	Notify(ctx context.Context, scope, key string) error
}

// DefaultPoll is how often a waiting caller looks again when nothing wakes it.
const DefaultPoll = 250 * time.Millisecond

// localNotifier wakes waiters in this process.
type localNotifier struct {
	mu   sync.Mutex
	subs map[string]map[chan struct{}]struct{}
}

func (n *localNotifier) Subscribe(scope, key string) (<-chan struct{}, func()) {
	id := scope + "\x00" + key
	ch := make(chan struct{}, 1)
	n.mu.Lock()
	if n.subs == nil {
		n.subs = map[string]map[chan struct{}]struct{}{}
	}
	if n.subs[id] == nil {
		n.subs[id] = map[chan struct{}]struct{}{}
	}
	n.subs[id][ch] = struct{}{}
	n.mu.Unlock()
	return ch, func() {
		n.mu.Lock()
		delete(n.subs[id], ch)
		if len(n.subs[id]) == 0 {
			delete(n.subs, id)
		}
		n.mu.Unlock()
	}
}

func (n *localNotifier) Notify(_ context.Context, scope, key string) error {
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

// Await is Begin that, while another owner is running the work, waits up to
// within for it to settle and then decides again: a caller gets the replay
// (or the key, when the first owner released it) instead of a conflict. It
// wakes at once when an engine in this process, or one reached through
// [Config.Notifier], settles the record, and otherwise looks again every
// [Config.Poll] (or sooner, when the running lease ends sooner). When the
// wait runs out, the last InFlight outcome is returned.
func (e *Engine) Await(ctx context.Context, p BeginParams, within time.Duration) (Outcome, error) {
	deadline := e.clock.Now().Add(within)
	local, cancelLocal := e.local.Subscribe(p.Scope, p.Key)
	defer cancelLocal()
	var remote <-chan struct{}
	if e.notifier != nil {
		var cancelRemote func()
		remote, cancelRemote = e.notifier.Subscribe(p.Scope, p.Key)
		defer cancelRemote()
	}
	for {
		out, err := e.Begin(ctx, p)
		if err != nil || out.Decision != InFlight {
			return out, err
		}
		left := deadline.Sub(e.clock.Now())
		if left <= 0 {
			return out, nil
		}
		pause := min(left, e.poll, max(out.Record.LeaseExpires.Sub(e.clock.Now()), time.Millisecond))
		timer := time.NewTimer(pause)
		select {
		case <-ctx.Done():
			timer.Stop()
			return out, ctx.Err()
		case <-local:
		case <-remote:
		case <-timer.C:
		}
		timer.Stop()
	}
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
