package pgstore_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/testkit"
	"github.com/idemhq/idem/store/pgstore"
	"github.com/idemhq/idem/store/storetest"
)

// signalWait bounds every wait for a notification. It is only reached when
// the test fails.
const signalWait = 10 * time.Second

// newChannel returns a notification channel no other test uses.
func newChannel(t *testing.T) string {
	t.Helper()
	var b [8]byte
	if _, err := rand.Read(b[:]); err != nil {
		t.Fatal(err)
	}
	return "idem_test_" + hex.EncodeToString(b[:])
}

// newNotifier returns a notifier on the shared pool, closed when the test
// ends.
func newNotifier(t *testing.T, channel string) *pgstore.Notifier {
	t.Helper()
	n, err := pgstore.NewNotifier(ctx, pgstore.NotifierConfig{Pool: sharedPool(t), Channel: channel})
	if err != nil {
		t.Fatalf("NewNotifier: %v", err)
	}
	t.Cleanup(func() {
		if err := n.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	return n
}

// listeners returns the backends that listen on channel (by their last
// statement, which is LISTEN until the listener's first idle check, 30 s on).
func listeners(t *testing.T, channel string) []int32 {
	t.Helper()
	rows, err := sharedPool(t).Query(ctx, "SELECT pid FROM pg_stat_activity WHERE query = $1",
		"LISTEN "+pgx.Identifier{channel}.Sanitize())
	if err != nil {
		t.Fatal(err)
	}
	pids, err := pgx.CollectRows(rows, pgx.RowTo[int32])
	if err != nil {
		t.Fatal(err)
	}
	return pids
}

// awaitListeners waits until exactly want sessions listen on channel, none of
// them the session skip, and returns them.
func awaitListeners(t *testing.T, channel string, want int, skip int32) []int32 {
	t.Helper()
	deadline := time.Now().Add(signalWait)
	for {
		pids := listeners(t, channel)
		if len(pids) == want && !slices.Contains(pids, skip) {
			return pids
		}
		if time.Now().After(deadline) {
			t.Fatalf("sessions listening on the channel: %v, want %d other than %d", pids, want, skip)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestNotifierConfig needs no server.
func TestNotifierConfig(t *testing.T) {
	t.Parallel()
	if _, err := pgstore.NewNotifier(ctx, pgstore.NotifierConfig{}); !errors.Is(err, idem.ErrInvalid) {
		t.Fatalf("NewNotifier without a pool = %v, want ErrInvalid", err)
	}
	pool := closedPortPool(t)
	for _, channel := range []string{strings.Repeat("c", 64), "a\x00b"} {
		if _, err := pgstore.NewNotifier(ctx, pgstore.NotifierConfig{Pool: pool, Channel: channel}); !errors.Is(err, idem.ErrInvalid) {
			t.Fatalf("NewNotifier with channel %q = %v, want ErrInvalid", channel, err)
		}
	}
	if _, err := pgstore.NewNotifier(ctx, pgstore.NotifierConfig{Pool: pool}); !errors.Is(err, idem.ErrUnavailable) {
		t.Fatalf("NewNotifier on an unreachable server = %v, want ErrUnavailable", err)
	}
	canceled, cancel := context.WithCancel(ctx)
	cancel()
	_, err := pgstore.NewNotifier(canceled, pgstore.NotifierConfig{Pool: pool})
	if !errors.Is(err, context.Canceled) || errors.Is(err, idem.ErrUnavailable) {
		t.Fatalf("NewNotifier with a canceled context = %v, want context.Canceled and not ErrUnavailable", err)
	}
}

// TestNotifierPayloadIsAHash: what another session sees on the channel is a
// hash of the scope and key, not the key.
func TestNotifierPayloadIsAHash(t *testing.T) {
	t.Parallel()
	channel := newChannel(t)
	n := newNotifier(t, channel)
	conn, err := pgx.Connect(ctx, databaseURL(t))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, "LISTEN "+pgx.Identifier{channel}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	testkit.MustNotify(t, n, "tenant-42", "order-7")
	wait, cancel := context.WithTimeout(ctx, signalWait)
	defer cancel()
	note, err := conn.WaitForNotification(wait)
	if err != nil {
		t.Fatalf("waiting for the notification: %v", err)
	}
	// The same value as in redisstore's test: the two must agree.
	const want = "e61c97590bef91c078be53cfecf177c9" // hex(SHA-256("tenant-42\x00order-7")[:16])
	if note.Channel != channel || note.Payload != want {
		t.Fatalf("notification on %q with payload %q, want %q on %q", note.Channel, note.Payload, want, channel)
	}
}

// TestNotifierConformance runs the notifier suite: two notifiers on one
// channel, as two processes.
func TestNotifierConformance(t *testing.T) {
	storetest.RunNotifier(t, func(t *testing.T) (idem.Store, func() idem.Notifier) {
		store, _ := newStore(t)
		channel := newChannel(t)
		return store, func() idem.Notifier { return newNotifier(t, channel) }
	})
}

// TestNotifierClose: Close ends the listener's goroutine, closes its
// connection and may be called again; afterwards Subscribe still works
// (nothing wakes it) and Notify still sends through the pool.
func TestNotifierClose(t *testing.T) {
	t.Parallel()
	const fn = "github.com/idemhq/idem/store/pgstore.NewNotifier"
	channel := newChannel(t)
	other := newNotifier(t, channel)
	n, err := pgstore.NewNotifier(ctx, pgstore.NotifierConfig{Pool: sharedPool(t), Channel: channel})
	if err != nil {
		t.Fatal(err)
	}
	if pids := listeners(t, channel); len(pids) != 2 {
		t.Fatalf("%d sessions listen on the channel, want 2", len(pids))
	}
	if g := testkit.Goroutines(fn); g != 2 {
		t.Fatalf("%d listener goroutines, want 2", g)
	}
	if err := n.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	testkit.AwaitGoroutines(t, fn, 1)
	if err := n.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	awaitListeners(t, channel, 1, 0) // the closed notifier's session has ended
	ch, cancel := n.Subscribe("s", "k")
	defer cancel()
	onOther, cancelOther := other.Subscribe("s", "k")
	defer cancelOther()
	if err := n.Notify(ctx, "s", "k"); err != nil {
		t.Fatalf("Notify after Close: %v", err)
	}
	testkit.Woken(t, onOther, "the open notifier's subscriber")
	if testkit.Pending(ch) {
		t.Fatal("the closed notifier woke a subscriber")
	}
}

// TestNotifierReconnects: when the listening session is killed, the notifier
// connects again, wakes every subscriber once (notifications may have been
// lost meanwhile) and delivers notifications again; Close also ends a
// notifier that is reconnecting.
func TestNotifierReconnects(t *testing.T) {
	t.Parallel()
	channel := newChannel(t)
	n, err := pgstore.NewNotifier(ctx, pgstore.NotifierConfig{Pool: sharedPool(t), Channel: channel})
	if err != nil {
		t.Fatal(err)
	}
	waiter, cancelWaiter := n.Subscribe("s", "waiting")
	defer cancelWaiter()
	kill := func(pid int32) {
		t.Helper()
		var ok bool
		if err := sharedPool(t).QueryRow(ctx, "SELECT pg_terminate_backend($1)", pid).Scan(&ok); err != nil || !ok {
			t.Fatalf("terminating the listener %d: %v, %v", pid, ok, err)
		}
	}

	killed := awaitListeners(t, channel, 1, 0)[0]
	kill(killed)
	testkit.Woken(t, waiter, "a subscriber, once the listener was back,")
	again := awaitListeners(t, channel, 1, killed)[0]
	ch, cancel := n.Subscribe("s", "k")
	defer cancel()
	testkit.MustNotify(t, n, "s", "k")
	testkit.Woken(t, ch, "a subscriber after the reconnection")

	kill(again)
	closed := make(chan error, 1)
	go func() { closed <- n.Close() }()
	select {
	case err := <-closed:
		if err != nil {
			t.Fatalf("Close: %v", err)
		}
	case <-time.After(signalWait):
		t.Fatal("Close did not return while the notifier was reconnecting")
	}
}

// ExampleNewNotifier gives an engine a notifier, so that a duplicate request
// waiting in Await is answered as soon as the instance running the first one
// settles it, rather than at its next poll. Every instance does the same with
// the same channel. It needs a server, so it is compiled, not run.
func ExampleNewNotifier() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("IDEM_TEST_DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	store, err := pgstore.New(ctx, pgstore.Config{Pool: pool})
	if err != nil {
		log.Fatal(err)
	}
	notifier, err := pgstore.NewNotifier(ctx, pgstore.NotifierConfig{Pool: pool}) // LISTENs on "idem_settled"
	if err != nil {
		log.Fatal(err)
	}
	defer notifier.Close()
	eng, err := idem.New(idem.Config{Store: store, Notifier: notifier})
	if err != nil {
		log.Fatal(err)
	}
	// Complete, Release, MarkUnknown and Settle (with FinishTx in a
	// transaction too) notify by themselves.

	out, err := eng.Await(ctx, idem.BeginParams{
		Key:         "order-7",
		Fingerprint: idem.NewFingerprint(idem.Payload{Method: "POST", Path: "/v1/orders", Body: []byte(`{"sku":"a1"}`)}),
	}, 10*time.Second)
	if err != nil {
		log.Fatal(err)
	}
	switch out.Decision {
	case idem.Execute:
		// ... run the work, then eng.Complete ...
	case idem.Replay:
		fmt.Println("replayed:", out.Record.Response.Status)
	default:
		fmt.Println(out.Decision) // still in flight after 10 s, a mismatch, or uncertain
	}
}
