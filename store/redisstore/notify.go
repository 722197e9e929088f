package redisstore

import (
	"context"
	"fmt"
	"sync"

	"github.com/idemhq/idem/store"
	"github.com/redis/go-redis/v9"
)

var _ store.Notifier = (*Notifier)(nil)

// DefaultNotifyChannel is the pub/sub channel a [Notifier] subscribes and
// publishes to when [NotifierConfig.Channel] is empty.
const DefaultNotifyChannel = "idem:settled"

// NotifierConfig configures a [Notifier]. The zero value of every field but
// Client is a sensible default.
type NotifierConfig struct {
	// Client talks to Redis: a *redis.Client, a *redis.ClusterClient, or any
	// other redis.UniversalClient. Required. The notifier does not close it.
	Client redis.UniversalClient
	// Channel is the pub/sub channel. Every notifier that should wake the
	// others' waiters must use the same one; deployments sharing a Redis may
	// use different ones so as not to wake each other's waiters for nothing.
	// Defaults to [DefaultNotifyChannel].
	Channel string
}

// Notifier is an [store.Notifier] on Redis pub/sub: give one to each
// [store.Engine] (in [store.Config.Notifier]), and a record settled by one
// engine wakes the callers waiting for it in [store.Engine.Await] in every
// other process, instead of at their next poll.
//
// It holds one subscription (SUBSCRIBE, on a connection of its own) to the
// channel. go-redis checks that connection and subscribes again when it
// breaks; meanwhile messages are lost and waiters only poll, and once it is
// back every subscriber is woken once, to look again. On Redis Cluster the
// classic PUBLISH it sends reaches the subscribers on every node. Messages
// carry a hash of the scope and key, never the key itself, since every
// client subscribed to the channel can read them.
//
// A Notifier is safe for concurrent use. Close it when done.
type Notifier struct {
	client  redis.UniversalClient
	channel string
	pubsub  *redis.PubSub
	subs    store.Waiters

	done     chan struct{} // closed when the goroutine reading pubsub has ended
	close    sync.Once
	closeErr error
}

// NewNotifier returns a notifier on cfg. It returns once Redis has confirmed
// the subscription, so that any notification sent after it returns is
// delivered to its subscribers; ctx bounds that wait. An invalid config
// gives an error wrapping [store.ErrInvalid]; an unreachable server one
// wrapping [store.ErrUnavailable].
func NewNotifier(ctx context.Context, cfg NotifierConfig) (*Notifier, error) {
	if cfg.Client == nil {
		return nil, fmt.Errorf("redisstore: %w: notifier config has no client", store.ErrInvalid)
	}
	channel := cfg.Channel
	if channel == "" {
		channel = DefaultNotifyChannel
	}
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("redisstore: subscribe: %w", err)
	}
	pubsub := cfg.Client.Subscribe(ctx, channel)
	msg, err := pubsub.Receive(ctx)
	if err == nil {
		if s, ok := msg.(*redis.Subscription); !ok || s.Kind != "subscribe" || s.Channel != channel {
			err = fmt.Errorf("unexpected reply %v to SUBSCRIBE", msg)
		}
	}
	if err != nil {
		pubsub.Close()
		return nil, translateServer("subscribe", err)
	}
	n := &Notifier{client: cfg.Client, channel: channel, pubsub: pubsub, done: make(chan struct{})}
	go n.run(pubsub.ChannelWithSubscriptions())
	return n, nil
}

// Subscribe implements [store.Notifier]. It never blocks and does no I/O; the
// channel has room for one value, so wake-ups that come before the last was
// received are merged. It works after Close too, but then nothing wakes the
// channel.
func (n *Notifier) Subscribe(scope, key string) (<-chan struct{}, func()) {
	return n.subs.Add(store.KeyHash(scope, key))
}

// Notify implements [store.Notifier] with one PUBLISH on the client, so it
// works after Close too. An unreachable server gives an error wrapping
// [store.ErrUnavailable].
func (n *Notifier) Notify(ctx context.Context, scope, key string) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("redisstore: notify: %w", err)
	}
	if err := n.client.Publish(ctx, n.channel, store.KeyHash(scope, key)).Err(); err != nil {
		return translateServer("notify", err)
	}
	return nil
}

// Close ends the subscription, closes its connection and returns once the
// goroutine that read it has ended. It may be called more than once, also
// concurrently; later calls return what the first returned.
func (n *Notifier) Close() error {
	n.close.Do(func() {
		if err := n.pubsub.Close(); err != nil {
			n.closeErr = fmt.Errorf("redisstore: closing the notifier: %w", err)
		}
		<-n.done
	})
	return n.closeErr
}

// run wakes the subscribers of each message until the PubSub is closed.
func (n *Notifier) run(msgs <-chan any) {
	defer close(n.done)
	for msg := range msgs {
		switch m := msg.(type) {
		case *redis.Message:
			if m.Channel == n.channel {
				n.subs.Wake(m.Payload)
			}
		case *redis.Subscription:
			// go-redis subscribed again on a new connection: messages
			// published while it had none are lost, so every waiter looks
			// again now that new ones will arrive.
			if m.Kind == "subscribe" {
				n.subs.WakeAll()
			}
		}
	}
}
