package redisstore

import (
	"context"
	"errors"
	"fmt"
	"log"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/testkit"
	"github.com/idemhq/idem/store/storetest"
	"github.com/redis/go-redis/v9"
)

// signalWait bounds every wait for a notification. It is only reached when
// the test fails.
const signalWait = 10 * time.Second

// newChannel returns a pub/sub channel no other test uses.
func newChannel(t *testing.T) string { return randomPrefix(t) + ":settled" }

// newNotifier returns a notifier on client, closed when the test ends.
func newNotifier(t *testing.T, client redis.UniversalClient, channel string) *Notifier {
	t.Helper()
	n, err := NewNotifier(context.Background(), NotifierConfig{Client: client, Channel: channel})
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

// TestNotifyPayload: the payload is the hex of the first 16 bytes of
// SHA-256(scope, NUL, key), the same value as in pgstore's test.
func TestNotifyPayload(t *testing.T) {
	const want = "e61c97590bef91c078be53cfecf177c9"
	if got := idem.KeyHash("tenant-42", "order-7"); got != want {
		t.Fatalf("KeyHash = %q, want %q", got, want)
	}
	if idem.KeyHash("s", "k") == idem.KeyHash("s", "k2") || idem.KeyHash("s", "k") == idem.KeyHash("s2", "k") ||
		idem.KeyHash("a", "bc") == idem.KeyHash("ab", "c") {
		t.Fatal("two records share a payload")
	}
}

// TestNotifierConfig needs no server.
func TestNotifierConfig(t *testing.T) {
	if _, err := NewNotifier(context.Background(), NotifierConfig{}); !errors.Is(err, idem.ErrInvalid) {
		t.Fatalf("NewNotifier without a client = %v, want ErrInvalid", err)
	}
	client := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", MaxRetries: -1})
	t.Cleanup(func() { client.Close() })
	if _, err := NewNotifier(context.Background(), NotifierConfig{Client: client}); !errors.Is(err, idem.ErrUnavailable) {
		t.Fatalf("NewNotifier on an unreachable server = %v, want ErrUnavailable", err)
	}
	canceled, cancel := context.WithCancel(context.Background())
	cancel()
	_, err := NewNotifier(canceled, NotifierConfig{Client: client})
	if !errors.Is(err, context.Canceled) || errors.Is(err, idem.ErrUnavailable) {
		t.Fatalf("NewNotifier with a canceled context = %v, want context.Canceled and not ErrUnavailable", err)
	}
}

// TestNotifierPayloadIsAHash: what another client sees on the channel is a
// hash of the scope and key, not the key.
func TestNotifierPayloadIsAHash(t *testing.T) {
	t.Parallel()
	client := testClient(t)
	channel := newChannel(t)
	n := newNotifier(t, client, channel)
	ctx, cancel := context.WithTimeout(context.Background(), signalWait)
	defer cancel()
	raw := client.Subscribe(ctx, channel)
	defer raw.Close()
	if _, err := raw.Receive(ctx); err != nil {
		t.Fatal(err)
	}
	testkit.MustNotify(t, n, "tenant-42", "order-7")
	msg, err := raw.ReceiveMessage(ctx)
	if err != nil {
		t.Fatalf("waiting for the message: %v", err)
	}
	if want := idem.KeyHash("tenant-42", "order-7"); msg.Channel != channel || msg.Payload != want {
		t.Fatalf("message on %q with payload %q, want %q on %q", msg.Channel, msg.Payload, want, channel)
	}
}

// TestNotifierConformance runs the notifier suite: two notifiers on one
// channel, as two processes.
func TestNotifierConformance(t *testing.T) {
	storetest.RunNotifier(t, func(t *testing.T) (idem.Store, func() idem.Notifier) {
		client := testClient(t)
		store := newTestStore(t, client, 0)
		channel := newChannel(t)
		return store, func() idem.Notifier { return newNotifier(t, client, channel) }
	})
}

// TestNotifierClose: Close ends the notifier's goroutine, and go-redis's for
// its subscription, and may be called again; afterwards Subscribe still works
// (nothing wakes it) and Notify still publishes through the client.
func TestNotifierClose(t *testing.T) {
	t.Parallel()
	fns := []string{
		"github.com/idemhq/idem/store/redisstore.NewNotifier",     // run
		"github.com/redis/go-redis/v9.(*channel).initAllChan",     // the subscription's reader
		"github.com/redis/go-redis/v9.(*channel).initHealthCheck", // its health check
	}
	client := testClient(t)
	channel := newChannel(t)
	other := newNotifier(t, client, channel)
	n, err := NewNotifier(context.Background(), NotifierConfig{Client: client, Channel: channel})
	if err != nil {
		t.Fatal(err)
	}
	for _, fn := range fns {
		if g := testkit.Goroutines(fn); g != 2 {
			t.Fatalf("%d goroutines started in %s, want 2", g, fn)
		}
	}
	if err := n.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	for _, fn := range fns {
		testkit.AwaitGoroutines(t, fn, 1)
	}
	if err := n.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	ch, cancel := n.Subscribe("s", "k")
	defer cancel()
	onOther, cancelOther := other.Subscribe("s", "k")
	defer cancelOther()
	if err := n.Notify(context.Background(), "s", "k"); err != nil {
		t.Fatalf("Notify after Close: %v", err)
	}
	testkit.Woken(t, onOther, "the open notifier's subscriber")
	if testkit.Pending(ch) {
		t.Fatal("the closed notifier woke a subscriber")
	}
}

// pubsubClientID returns the id Redis gives the one pub/sub connection named
// name, waiting for it to appear.
func pubsubClientID(t *testing.T, name string) string {
	t.Helper()
	deadline := time.Now().Add(signalWait)
	for {
		list, err := testClient(t).ClientList(context.Background()).Result()
		if err != nil {
			t.Fatal(err)
		}
		var ids []string
		for _, line := range strings.Split(list, "\n") {
			fields := map[string]string{}
			for _, f := range strings.Fields(line) {
				if k, v, ok := strings.Cut(f, "="); ok {
					fields[k] = v
				}
			}
			if fields["name"] == name && fields["sub"] == "1" {
				ids = append(ids, fields["id"])
			}
		}
		if len(ids) == 1 {
			return ids[0]
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d pub/sub connections named %s, want 1", len(ids), name)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestNotifierResubscribes: when its connection is killed, go-redis
// subscribes again; the notifier then wakes every subscriber once (messages
// may have been lost meanwhile) and delivers notifications again.
func TestNotifierResubscribes(t *testing.T) {
	t.Parallel()
	opt := testOptions(t)
	opt.ClientName = randomPrefix(t) // to find the notifier's connection
	client := redis.NewClient(opt)
	t.Cleanup(func() { client.Close() })
	n := newNotifier(t, client, newChannel(t))
	waiter, cancelWaiter := n.Subscribe("s", "waiting")
	defer cancelWaiter()

	killed := pubsubClientID(t, opt.ClientName)
	if err := testClient(t).Do(context.Background(), "CLIENT", "KILL", "ID", killed).Err(); err != nil {
		t.Fatalf("killing the subscription's connection: %v", err)
	}
	testkit.Woken(t, waiter, "a subscriber, once the subscription was back,")
	if id := pubsubClientID(t, opt.ClientName); id == killed {
		t.Fatal("the killed connection is still subscribed")
	}
	ch, cancel := n.Subscribe("s", "k")
	defer cancel()
	testkit.MustNotify(t, n, "s", "k")
	testkit.Woken(t, ch, "a subscriber after the resubscription")
}

// TestNotifierCluster: on Redis Cluster, a notification published on any
// node wakes the subscriber of a notifier on a ClusterClient. It runs when
// IDEM_TEST_REDIS_CLUSTER_ADDRS lists the nodes (testdata/start-cluster.sh
// starts a cluster).
func TestNotifierCluster(t *testing.T) {
	cluster := testClusterClient(t)
	channel := newChannel(t)
	b := newNotifier(t, cluster, channel)
	ch, cancel := b.Subscribe("s", "k")
	defer cancel()
	testkit.MustNotify(t, newNotifier(t, cluster, channel), "s", "k")
	testkit.Woken(t, ch, "the subscriber, notified through the cluster client,")
	for _, addr := range cluster.Options().Addrs {
		node := redis.NewClient(&redis.Options{Addr: addr})
		t.Cleanup(func() { node.Close() })
		testkit.MustNotify(t, newNotifier(t, node, channel), "s", "k")
		testkit.Woken(t, ch, fmt.Sprintf("the subscriber, notified on node %s,", addr))
	}
}

// ExampleNewNotifier gives an engine a notifier, so that a duplicate request
// waiting in Await is answered as soon as the instance running the first one
// settles it, rather than at its next poll. Every instance does the same with
// the same channel. It needs a Redis server, so it is compiled, not run.
func ExampleNewNotifier() {
	ctx := context.Background()
	opt, err := redis.ParseURL(os.Getenv("IDEM_TEST_REDIS_URL")) // e.g. redis://127.0.0.1:6379/0
	if err != nil {
		log.Fatal(err)
	}
	client := redis.NewClient(opt) // or redis.NewClusterClient for Redis Cluster
	defer client.Close()
	store, err := New(Config{Client: client, Prefix: "payments"})
	if err != nil {
		log.Fatal(err)
	}
	notifier, err := NewNotifier(ctx, NotifierConfig{Client: client}) // SUBSCRIBEs to "idem:settled"
	if err != nil {
		log.Fatal(err)
	}
	defer notifier.Close()
	eng, err := idem.New(idem.Config{Store: store, Notifier: notifier})
	if err != nil {
		log.Fatal(err)
	}

	out, err := eng.Await(ctx, idem.BeginParams{
		Key:         "order-7",
		Fingerprint: idem.NewFingerprint(idem.Payload{Method: "POST", Path: "/v1/orders", Body: []byte(`{"sku":"a1"}`)}),
	}, 10*time.Second)
	if err != nil {
		log.Fatal(err)
	}
	switch out.Decision {
	case idem.Execute:
		// ... run the work, then eng.Complete, which notifies ...
	case idem.Replay:
		fmt.Println("replayed:", out.Record.Response.Status)
	default:
		fmt.Println(out.Decision) // still in flight after 10 s, a mismatch, or uncertain
	}
}
