package idem

import (
	"context"
	"time"

	"github.com/idemhq/idem/store"
)

// DefaultPoll is how often a waiting caller looks again when nothing wakes it.
const DefaultPoll = 250 * time.Millisecond

// localNotifier wakes waiters in this process.
type localNotifier struct{ waiters store.Waiters }

func (n *localNotifier) Subscribe(scope, key string) (<-chan struct{}, func()) {
	return n.waiters.Add(KeyHash(scope, key))
}

func (n *localNotifier) Notify(_ context.Context, scope, key string) error {
	n.waiters.Wake(KeyHash(scope, key))
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
		select {
		case <-ctx.Done():
			return out, ctx.Err()
		case <-local:
		case <-remote:
		case <-e.clock.After(pause):
		}
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
