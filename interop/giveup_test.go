package interop

import (
	"context"
	"errors"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stripe/stripe-go/v82"

	"github.com/idemhq/idem/internal/wait"
)

// arrivals counts, by Idempotency-Key, the requests that reach idem proxy:
// the attempts an SDK made, counted on the server's side.
type arrivals struct {
	mu sync.Mutex
	n  map[string]int
}

func (a *arrivals) of(key string) int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.n[key]
}

// front is a reverse proxy to w's idem proxy that counts what reaches it.
func front(t *testing.T, w *world) (string, *arrivals) {
	t.Helper()
	target, err := url.Parse("http://" + w.toProxy.Addr())
	if err != nil {
		t.Fatal(err)
	}
	rp := httputil.NewSingleHostReverseProxy(target)
	a := &arrivals{n: map[string]int{}}
	srv := httptest.NewServer(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		a.mu.Lock()
		a.n[r.Header.Get("Idempotency-Key")]++
		a.mu.Unlock()
		rp.ServeHTTP(rw, r)
	}))
	t.Cleanup(srv.Close)
	return srv.URL, a
}

// unreachable is the address of a store nobody listens on.
func unreachable(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	return addr
}

// The answers worth retrying that outlast an SDK's retries: a store that
// cannot be reached (503 store-unavailable), and a duplicate of a request
// still running, with --wait negative (409 in-progress at once). Each is
// answered with Stripe-Should-Retry: true.
var outlasting = []struct {
	name   string
	flags  func(t *testing.T) []string
	held   bool // a first request with the key is held running at the API
	status int
	code   string
}{
	{"the store is down: 503 store-unavailable",
		func(t *testing.T) []string { return []string{"--store", "postgres://idem@" + unreachable(t) + "/idem"} },
		false, 503, "idempotency_store_unavailable"},
	{"a duplicate of a running request, no wait: 409 in-progress",
		func(*testing.T) []string { return []string{"--wait", "-1s"} },
		true, 409, "idempotency_key_in_use"},
}

// ran is how many times the API should have run the key: once if a first
// request was held running, else never.
func ran(held bool) int {
	if held {
		return 1
	}
	return 0
}

// TestStripeGoGivesUpWithAnError: stripe-go, unchanged, retries an answer
// worth retrying (its "error" member, a string, is not a Stripe error it can
// decode, and it retries every error not from Stripe), and when its retries
// run out returns an error, never an object.
func TestStripeGoGivesUpWithAnError(t *testing.T) {
	for _, c := range outlasting {
		t.Run(c.name, func(t *testing.T) {
			w := newWorld(t, c.flags(t)...)
			url, at := front(t, w)
			client := goClient(url, &counting{next: &http.Transport{}, attempts: map[string]int{}})
			const key = "go-outlasted"
			var first chan *stripe.PaymentIntent
			if c.held {
				first = make(chan *stripe.PaymentIntent, 1)
				go func() {
					pi, err := client.V1PaymentIntents.Create(context.Background(), intent(778, key))
					if err != nil {
						t.Errorf("the first request: %v", err)
					}
					first <- pi
				}()
				wait.Recv(t, w.api.arrived, 30*time.Second, "the first request to reach the API")
			}
			before := at.of(key)
			pi, err := client.V1PaymentIntents.Create(context.Background(), intent(778, key))
			t.Logf("stripe-go: %v", err)
			if err == nil {
				t.Fatalf("stripe-go returned %+v; want an error once its retries ran out", pi)
			}
			if se := (*stripe.Error)(nil); errors.As(err, &se) {
				t.Errorf("stripe-go made a *stripe.Error %+v, which it does not retry", se)
			}
			if !strings.Contains(err.Error(), c.code) {
				t.Errorf("stripe-go's error %q does not say %s", err, c.code)
			}
			if n := at.of(key) - before; n != 3 {
				t.Errorf("%d attempts reached idem; want 3 (1 and stripe-go's 2 retries)", n)
			}
			if c.held {
				w.api.release()
				if pi := wait.Recv(t, first, 30*time.Second, "the first request"); pi == nil || pi.ID == "" {
					t.Fatalf("the first request got %+v", pi)
				}
			}
			if n := w.api.executions("", key); n != ran(c.held) {
				t.Errorf("the API ran %d times; want %d", n, ran(c.held))
			}
		})
	}
}

// TestStripeNodeGivesUpWithAnError: stripe-node, unchanged, retries an
// answer worth retrying (it reads Stripe-Should-Retry) and when its retries
// run out raises an error. It raises only on an answer with an "error"
// member; without one, it resolved the call with the problem, as if it were
// the payment intent (no id, a status of 503 or 409).
func TestStripeNodeGivesUpWithAnError(t *testing.T) {
	for _, c := range outlasting {
		t.Run(c.name, func(t *testing.T) {
			w := newWorld(t, c.flags(t)...)
			url, at := front(t, w)
			node := startNode(t, url)
			const key = "node-outlasted"
			var holder *nodeClient
			if c.held {
				holder = startNode(t, url)
				holder.send(778, key)
				wait.Recv(t, w.api.arrived, 30*time.Second, "the first request to reach the API")
			}
			before := at.of(key)
			got := node.create(t, 778, key)
			t.Logf("stripe-node: %+v", got)
			if got.ID != "" || got.Error == "" {
				t.Fatalf("stripe-node resolved the call with %+v; want an error raised once its retries ran out", got)
			}
			if got.Error != "StripeOAuthError" || got.Type != c.code || got.Status != c.status || got.Message == "" || got.Attempts != 3 {
				t.Errorf("stripe-node raised %+v; want a StripeOAuthError whose raw type is %s, %d, with a message, after 3 attempts", got, c.code, c.status)
			}
			if n := at.of(key) - before; n != 3 {
				t.Errorf("%d attempts reached idem; want 3 (1 and stripe-node's 2 retries)", n)
			}
			if c.held {
				w.api.release()
				if first := holder.answer(t); first.ID == "" {
					t.Fatalf("the first request got %+v", first)
				}
			}
			if n := w.api.executions("", key); n != ran(c.held) {
				t.Errorf("the API ran %d times; want %d", n, ran(c.held))
			}
		})
	}
}
