package pgstore

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemhq/idem/store"
)

var _ store.Notifier = (*Notifier)(nil)

// DefaultNotifyChannel is the channel a [Notifier] listens and notifies on
// when [NotifierConfig.Channel] is empty.
const DefaultNotifyChannel = "idem_settled"

// The listener's timings.
const (
	// reconnectMin and reconnectMax bound the pause before each attempt to
	// connect the listener again; it doubles after each failed attempt.
	reconnectMin = 100 * time.Millisecond
	reconnectMax = 5 * time.Second
	// listenIdle is how long the listener waits for a notification before it
	// checks that its connection still answers, so that a connection the
	// network dropped silently is replaced within about a minute.
	listenIdle = 30 * time.Second
	// listenTimeout bounds that check, and each attempt to reconnect.
	listenTimeout = 10 * time.Second
	// closeTimeout bounds the goodbye sent when the connection is closed.
	closeTimeout = time.Second
)

// notifySQL sends one notification, outside any transaction: one round trip.
const notifySQL = `SELECT pg_notify($1, $2)`

// NotifierConfig configures a [Notifier]. The zero value of every field but
// Pool is a sensible default.
type NotifierConfig struct {
	// Pool is the connection pool the notifier sends notifications through
	// and takes its listening connection from. Required. The notifier does
	// not close it.
	Pool *pgxpool.Pool
	// Channel is the PostgreSQL notification channel. Every notifier that
	// should wake the others' waiters must use the same one; deployments
	// sharing a database may use different ones so as not to wake each
	// other's waiters for nothing. Any name up to 63 bytes is accepted.
	// Defaults to [DefaultNotifyChannel].
	Channel string
}

// Notifier is an [store.Notifier] on PostgreSQL LISTEN/NOTIFY: give one to
// each [store.Engine] (in [store.Config.Notifier]), and a record settled by one
// engine wakes the callers waiting for it in [store.Engine.Await] in every
// other process, instead of at their next poll.
//
// It holds one connection of its own, taken from the pool and then no longer
// counted by it, that LISTENs on the channel; that connection must reach
// PostgreSQL directly or through a pooler in session mode (LISTEN does not
// work through transaction pooling). When it breaks, the notifier connects
// again, with a pause growing from 100 ms to 5 s, until [Notifier.Close];
// meanwhile notifications are lost and waiters only poll, and once it is
// back every subscriber is woken once, to look again. Notifications carry a
// hash of the scope and key, never the key itself, since every session
// listening on the channel can read them.
//
// A Notifier is safe for concurrent use. Close it when done.
type Notifier struct {
	pool      *pgxpool.Pool
	channel   string
	listenSQL string
	subs      store.Waiters

	stop context.CancelFunc // stops the listener
	done chan struct{}      // closed when the listener has stopped
}

// NewNotifier returns a notifier on cfg. It returns once its connection
// listens on the channel, so that any notification sent after it returns is
// delivered to its subscribers. An invalid config gives an error wrapping
// [store.ErrInvalid]; an unreachable server one wrapping
// [store.ErrUnavailable].
func NewNotifier(ctx context.Context, cfg NotifierConfig) (*Notifier, error) {
	if cfg.Pool == nil {
		return nil, fmt.Errorf("pgstore: %w: notifier config has no pool", store.ErrInvalid)
	}
	channel := cfg.Channel
	if channel == "" {
		channel = DefaultNotifyChannel
	}
	if len(channel) > maxIdentifierLen || strings.IndexByte(channel, 0) >= 0 {
		return nil, fmt.Errorf("pgstore: %w: notify channel name must be 1 to %d bytes without NUL", store.ErrInvalid, maxIdentifierLen)
	}
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("pgstore: listen: %w", err)
	}
	n := &Notifier{
		pool:      cfg.Pool,
		channel:   channel,
		listenSQL: "LISTEN " + pgx.Identifier{channel}.Sanitize(),
		done:      make(chan struct{}),
	}
	conn, err := n.connect(ctx)
	if err != nil {
		return nil, err
	}
	running, stop := context.WithCancel(context.Background())
	n.stop = stop
	go n.run(running, conn)
	return n, nil
}

// Subscribe implements [store.Notifier]. It never blocks and does no I/O; the
// channel has room for one value, so wake-ups that come before the last was
// received are merged. It works after Close too, but then nothing wakes the
// channel.
func (n *Notifier) Subscribe(scope, key string) (<-chan struct{}, func()) {
	return n.subs.Add(store.KeyHash(scope, key))
}

// Notify implements [store.Notifier] with one statement on the pool
// (pg_notify), so it works after Close too. An unreachable server gives an
// error wrapping [store.ErrUnavailable].
func (n *Notifier) Notify(ctx context.Context, scope, key string) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("pgstore: notify: %w", err)
	}
	if _, err := n.pool.Exec(ctx, notifySQL, n.channel, store.KeyHash(scope, key)); err != nil {
		return translate("notify", err)
	}
	return nil
}

// Close stops listening, closes the notifier's connection and returns once
// the goroutine that listened has ended. It may be called more than once,
// also concurrently; it always returns nil.
func (n *Notifier) Close() error {
	n.stop()
	<-n.done
	return nil
}

// connect takes a connection from the pool, so that the pool's hooks and
// settings apply to it, owns it from then on, and makes it LISTEN.
func (n *Notifier) connect(ctx context.Context) (*pgx.Conn, error) {
	pooled, err := n.pool.Acquire(ctx)
	if err != nil {
		return nil, translate("listen", err)
	}
	conn := pooled.Hijack()
	if _, err := conn.Exec(ctx, n.listenSQL); err != nil {
		closeConn(conn)
		return nil, translate("listen", err)
	}
	return conn, nil
}

// run delivers notifications until ctx is cancelled, connecting again
// whenever the connection breaks.
func (n *Notifier) run(ctx context.Context, conn *pgx.Conn) {
	defer close(n.done)
	for {
		n.listen(ctx, conn)
		closeConn(conn)
		if conn = n.reconnect(ctx); conn == nil {
			return
		}
		// Notifications sent while nothing listened are lost: every waiter
		// looks again now that new ones will arrive.
		n.subs.WakeAll()
	}
}

// listen wakes the subscribers of each notification on conn until ctx is
// cancelled or conn breaks.
func (n *Notifier) listen(ctx context.Context, conn *pgx.Conn) {
	for {
		wait, cancel := context.WithTimeout(ctx, listenIdle)
		note, err := conn.WaitForNotification(wait)
		idle := wait.Err() != nil
		cancel()
		switch {
		case ctx.Err() != nil:
			return
		case err == nil:
			if note != nil && note.Channel == n.channel {
				n.subs.Wake(note.Payload)
			}
		case idle && !conn.IsClosed():
			// Nothing came for a while: make sure the connection answers.
			ping, cancel := context.WithTimeout(ctx, listenTimeout)
			err := conn.Ping(ping)
			cancel()
			if err != nil {
				return
			}
		default:
			return
		}
	}
}

// reconnect connects again after a pause that grows with each failure, and
// returns nil once ctx is cancelled.
func (n *Notifier) reconnect(ctx context.Context) *pgx.Conn {
	pause := reconnectMin
	timer := time.NewTimer(pause)
	defer timer.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-timer.C:
		}
		attempt, cancel := context.WithTimeout(ctx, listenTimeout)
		conn, err := n.connect(attempt)
		cancel()
		if err == nil {
			return conn
		}
		pause = min(pause*2, reconnectMax)
		timer.Reset(pause)
	}
}

// closeConn closes a connection the notifier owns, waiting a little for the
// server to be told.
func closeConn(conn *pgx.Conn) {
	ctx, cancel := context.WithTimeout(context.Background(), closeTimeout)
	defer cancel()
	conn.Close(ctx)
}
