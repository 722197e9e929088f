package interop

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stripe/stripe-go/v82"

	"github.com/idemhq/idem/internal/faultnet"
	"github.com/idemhq/idem/internal/testbin"
	"github.com/idemhq/idem/internal/wait"
)

var idemBin string

func TestMain(m *testing.M) { testbin.Main(m, &idemBin) }

// fakeStripe is a Stripe-shaped API: it creates payment intents and deletes
// customers, numbering every execution, and remembers each key's runs.
type fakeStripe struct {
	mu      sync.Mutex
	next    int
	runs    map[string][]string // by Stripe-Account + Idempotency-Key: the ids it made
	slow    time.Duration       // how long a payment intent of amount 777 takes
	held    chan struct{}       // a payment intent of amount 778 waits until it is closed
	arrived chan string         // the keys of slow and held requests as they arrive
}

func (f *fakeStripe) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	key := r.Header.Get("Stripe-Account") + "/" + r.Header.Get("Idempotency-Key")
	if err := r.ParseForm(); err != nil {
		http.Error(w, err.Error(), 400)
		return
	}
	switch r.PostForm.Get("amount") {
	case "777":
		f.arrived <- key
		time.Sleep(f.slow)
	case "778":
		f.arrived <- key
		<-f.held
	}
	f.mu.Lock()
	f.next++
	var obj map[string]any
	switch {
	case r.Method == "POST" && r.URL.Path == "/v1/payment_intents":
		amount, _ := strconv.ParseInt(r.PostForm.Get("amount"), 10, 64)
		obj = map[string]any{"id": fmt.Sprintf("pi_%d", f.next), "object": "payment_intent", "amount": amount,
			"currency": r.PostForm.Get("currency"), "status": "requires_payment_method"}
	case r.Method == "DELETE" && strings.HasPrefix(r.URL.Path, "/v1/customers/"):
		obj = map[string]any{"id": strings.TrimPrefix(r.URL.Path, "/v1/customers/"), "object": "customer", "deleted": true,
			"description": fmt.Sprintf("deletion %d", f.next)}
	default:
		f.mu.Unlock()
		http.NotFound(w, r)
		return
	}
	f.runs[key] = append(f.runs[key], fmt.Sprint(obj["id"], " #", f.next))
	f.mu.Unlock()
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Request-Id", fmt.Sprintf("req_%d", f.next))
	json.NewEncoder(w).Encode(obj)
}

func (f *fakeStripe) executions(account, key string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.runs[account+"/"+key])
}

// counting counts the attempts an SDK makes, by idempotency key, and
// remembers the keys it generated.
type counting struct {
	next     http.RoundTripper
	mu       sync.Mutex
	attempts map[string]int
	last     string
}

func (c *counting) RoundTrip(r *http.Request) (*http.Response, error) {
	c.mu.Lock()
	key := r.Header.Get("Idempotency-Key")
	c.attempts[key]++
	c.last = key
	c.mu.Unlock()
	return c.next.RoundTrip(r)
}

func (c *counting) of(key string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.attempts[key]
}

func (c *counting) lastKey() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.last
}

var listening = regexp.MustCompile(`msg="idem proxy listening" addr=(\S+)`)

// world is stripe-go talking to a fake Stripe through `idem proxy` in its
// default configuration plus the scope headers of a platform (and the flags
// newWorld is given), with a fault proxy on each side.
type world struct {
	api               *fakeStripe
	toProxy, toUpstrm *faultnet.Proxy
	count             *counting
	client            *stripe.Client
}

// newWorld starts a world; flags are added to the proxy's (a --store among
// them replaces its SQLite file).
func newWorld(t *testing.T, flags ...string) *world {
	t.Helper()
	api := &fakeStripe{runs: map[string][]string{}, slow: 2500 * time.Millisecond, held: make(chan struct{}), arrived: make(chan string, 16)}
	upstream := httptest.NewServer(api)
	t.Cleanup(upstream.Close)
	t.Cleanup(api.release) // before the upstream closes, which waits for its handlers
	toUpstream, err := faultnet.Listen(strings.TrimPrefix(upstream.URL, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { toUpstream.Close() })
	dir := t.TempDir()
	args := []string{"proxy", "--listen", "127.0.0.1:0", "--upstream", "http://" + toUpstream.Addr(),
		"--journal-dir", filepath.Join(dir, "journal"), "--scope-header", "Authorization", "--scope-header", "Stripe-Account"}
	if !slices.Contains(flags, "--store") {
		args = append(args, "--store", "sqlite:"+filepath.Join(dir, "idem.db"))
	}
	cmd := exec.Command(idemBin, append(args, flags...)...)
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	addr := make(chan string, 1)
	go func() {
		lines := bufio.NewScanner(stderr)
		for lines.Scan() {
			if m := listening.FindStringSubmatch(lines.Text()); m != nil {
				addr <- m[1]
			}
		}
	}()
	toProxy, err := faultnet.Listen(wait.Recv(t, addr, 30*time.Second, "idem proxy to listen"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { toProxy.Close() })
	count := &counting{next: &http.Transport{}, attempts: map[string]int{}}
	client := goClient("http://"+toProxy.Addr(), count)
	return &world{api: api, toProxy: toProxy, toUpstrm: toUpstream, count: count, client: client}
}

// release lets the held payment intents (amount 778) finish.
func (f *fakeStripe) release() {
	select {
	case <-f.held:
	default:
		close(f.held)
	}
}

// goClient is stripe-go, unchanged but for its URL and its quiet logger,
// counting its attempts with count.
func goClient(url string, count *counting) *stripe.Client {
	backend := stripe.GetBackendWithConfig(stripe.APIBackend, &stripe.BackendConfig{
		URL:        stripe.String(url),
		HTTPClient: &http.Client{Transport: count, Timeout: 30 * time.Second},
		// MaxNetworkRetries is the SDK's default, 2.
		LeveledLogger: &stripe.LeveledLogger{Level: stripe.LevelNull},
	})
	return stripe.NewClient("sk_test_platform", stripe.WithBackends(&stripe.Backends{API: backend}))
}

func intent(amount int64, key string) *stripe.PaymentIntentCreateParams {
	p := &stripe.PaymentIntentCreateParams{Amount: stripe.Int64(amount), Currency: stripe.String("eur")}
	if key != "" {
		p.IdempotencyKey = stripe.String(key)
	}
	return p
}

func stripeError(t *testing.T, err error) *stripe.Error {
	t.Helper()
	var se *stripe.Error
	if !errors.As(err, &se) {
		t.Fatalf("got %T %v; want a typed *stripe.Error", err, err)
	}
	return se
}

// TestStripeGo runs stripe-go v82, unchanged, through idem proxy: every
// scenario is one execution at the API, the same object on retry, and a
// typed error without pointless retries where idem refuses.
func TestStripeGo(t *testing.T) {
	ctx := context.Background()

	t.Run("the proxy's reply is lost: the SDK's retry gets the same object", func(t *testing.T) {
		w := newWorld(t)
		w.toProxy.DropNextReply()
		pi, err := w.client.V1PaymentIntents.Create(ctx, intent(1000, ""))
		if err != nil {
			t.Fatal(err)
		}
		key := w.count.lastKey()
		if n := w.api.executions("", key); n != 1 || w.count.of(key) != 2 {
			t.Fatalf("%d executions over %d attempts; want 1 over 2", n, w.count.of(key))
		}
		again, err := w.client.V1PaymentIntents.Create(ctx, intent(1000, key))
		if err != nil || again.ID != pi.ID {
			t.Fatalf("a later retry with the SDK's key: %v, %v; want %s", again, err, pi.ID)
		}
	})

	t.Run("the API's reply is lost: outcome unknown, a typed error, never a second charge", func(t *testing.T) {
		w := newWorld(t)
		w.toUpstrm.DropNextReply()
		_, err := w.client.V1PaymentIntents.Create(ctx, intent(1000, "lost-upstream"))
		se := stripeError(t, err)
		if se.Type != stripe.ErrorTypeIdempotency || se.Code != "idempotency_outcome_unknown" || se.HTTPStatusCode != 409 {
			t.Fatalf("error %+v; want idempotency_error idempotency_outcome_unknown (409)", se)
		}
		if n, a := w.api.executions("", "lost-upstream"), w.count.of("lost-upstream"); n != 1 || a != 2 {
			t.Fatalf("%d executions over %d attempts; want 1 over 2 (a 502 retried, then a final 409)", n, a)
		}
	})

	t.Run("concurrent duplicates under one key: one execution, one object", func(t *testing.T) {
		w := newWorld(t)
		ids := make(chan string, 10)
		var wg sync.WaitGroup
		for range 10 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				pi, err := w.client.V1PaymentIntents.Create(ctx, intent(2000, "double-click"))
				if err != nil {
					t.Error(err)
					return
				}
				ids <- pi.ID
			}()
		}
		wait.Done(t, time.Minute, "the duplicates", wg.Wait)
		close(ids)
		seen := map[string]bool{}
		for id := range ids {
			seen[id] = true
		}
		if len(seen) != 1 || w.api.executions("", "double-click") != 1 {
			t.Fatalf("objects %v, executions %d; want one of each", seen, w.api.executions("", "double-click"))
		}
	})

	t.Run("a changed payload under a reused key: a typed idempotency error, not retried", func(t *testing.T) {
		w := newWorld(t)
		if _, err := w.client.V1PaymentIntents.Create(ctx, intent(3000, "reused")); err != nil {
			t.Fatal(err)
		}
		_, err := w.client.V1PaymentIntents.Create(ctx, intent(3001, "reused"))
		se := stripeError(t, err)
		if se.Type != stripe.ErrorTypeIdempotency || se.Code != "idempotency_key_reused" || se.HTTPStatusCode != 422 {
			t.Fatalf("error %+v; want idempotency_error idempotency_key_reused (422)", se)
		}
		if _, ok := se.Err.(*stripe.IdempotencyError); !ok {
			t.Fatalf("the SDK made a %T, want *stripe.IdempotencyError", se.Err)
		}
		if a := w.count.of("reused"); a != 2 {
			t.Fatalf("%d attempts for two calls; the refusal was retried", a)
		}
	})

	t.Run("a DELETE whose reply is lost runs once", func(t *testing.T) {
		w := newWorld(t)
		w.toProxy.DropNextReply()
		c, err := w.client.V1Customers.Delete(ctx, "cus_1", nil)
		if err != nil || !c.Deleted {
			t.Fatalf("delete: %+v, %v", c, err)
		}
		key := w.count.lastKey()
		if n := w.api.executions("", key); n != 1 || w.count.of(key) != 2 {
			t.Fatalf("%d executions over %d attempts; want 1 over 2", n, w.count.of(key))
		}
	})

	t.Run("two connected accounts, one key: two payments", func(t *testing.T) {
		w := newWorld(t)
		a, b := intent(4000, "same-key"), intent(4000, "same-key")
		a.SetStripeAccount("acct_a")
		b.SetStripeAccount("acct_b")
		pa, err := w.client.V1PaymentIntents.Create(ctx, a)
		if err != nil {
			t.Fatal(err)
		}
		pb, err := w.client.V1PaymentIntents.Create(ctx, b)
		if err != nil {
			t.Fatal(err)
		}
		if pa.ID == pb.ID || w.api.executions("acct_a", "same-key") != 1 || w.api.executions("acct_b", "same-key") != 1 {
			t.Fatalf("account a got %s, account b %s: one account's payment was replayed to the other", pa.ID, pb.ID)
		}
	})

	t.Run("duplicates of a slow request wait for it and succeed", func(t *testing.T) {
		w := newWorld(t)
		first := make(chan string, 1)
		go func() {
			pi, err := w.client.V1PaymentIntents.Create(ctx, intent(777, "slow"))
			if err != nil {
				t.Error(err)
			}
			first <- pi.ID
		}()
		wait.Recv(t, w.api.arrived, 30*time.Second, "the slow request to reach the API")
		var dupes atomic.Int64
		var wg sync.WaitGroup
		for range 3 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				pi, err := w.client.V1PaymentIntents.Create(ctx, intent(777, "slow"))
				if err != nil {
					t.Errorf("a duplicate of a slow request: %v", err)
					return
				}
				if pi.ID != "" {
					dupes.Add(1)
				}
			}()
		}
		wait.Done(t, time.Minute, "the duplicates", wg.Wait)
		if id := wait.Recv(t, first, time.Minute, "the slow request"); id == "" || dupes.Load() != 3 || w.api.executions("", "slow") != 1 {
			t.Fatalf("first %q, %d duplicates succeeded, %d executions", id, dupes.Load(), w.api.executions("", "slow"))
		}
	})

	t.Run("a malformed key: a typed invalid request error, not retried", func(t *testing.T) {
		w := newWorld(t)
		_, err := w.client.V1PaymentIntents.Create(ctx, intent(5000, "clé"))
		se := stripeError(t, err)
		if se.Type != stripe.ErrorTypeInvalidRequest || se.Code != "idempotency_key_invalid" || w.count.of("clé") != 1 {
			t.Fatalf("error %+v after %d attempts; want invalid_request_error idempotency_key_invalid after 1", se, w.count.of("clé"))
		}
	})
}

// nodeClient is stripe-node, unchanged, run by interop/node/client.mjs.
type nodeClient struct {
	in    io.WriteCloser
	lines chan string // what it answers, a line per command
}

type nodeResult struct {
	ID       string `json:"id"`
	Error    string `json:"error"` // the SDK's error class
	Type     string `json:"type"`  // the API's error type
	Code     string `json:"code"`
	Message  string `json:"message"`
	Status   int    `json:"status"`
	Attempts int    `json:"attempts"`
}

func startNode(t *testing.T, api string) *nodeClient {
	t.Helper()
	if _, err := os.Stat(filepath.Join("node", "node_modules", "stripe")); err != nil {
		t.Skip("run npm ci in interop/node to test stripe-node (CI does)")
	}
	cmd := exec.Command("node", filepath.Join("node", "client.mjs"), api)
	in, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { in.Close(); cmd.Process.Kill(); cmd.Wait() })
	n := &nodeClient{in: in, lines: make(chan string, 16)}
	go func() {
		scan := bufio.NewScanner(out)
		for scan.Scan() {
			n.lines <- scan.Text()
		}
	}()
	return n
}

// create asks stripe-node for a payment intent under key.
func (n *nodeClient) create(t *testing.T, amount int, key string) nodeResult {
	t.Helper()
	n.send(amount, key)
	return n.answer(t)
}

// send asks stripe-node for a payment intent under key, without waiting for
// its answer.
func (n *nodeClient) send(amount int, key string) {
	fmt.Fprintf(n.in, `{"amount":%d,"key":%q}`+"\n", amount, key)
}

// answer is what stripe-node says to the oldest command not yet answered.
func (n *nodeClient) answer(t *testing.T) nodeResult {
	t.Helper()
	got := wait.Recv(t, n.lines, 30*time.Second, "stripe-node's answer")
	var r nodeResult
	if err := json.Unmarshal([]byte(got), &r); err != nil {
		t.Fatalf("stripe-node said %q: %v", got, err)
	}
	return r
}

// TestStripeNode runs stripe-node through idem proxy: a lost reply is retried
// into the same object, once executed; a changed payload under a reused key
// is a typed error, not retried. (stripe-node picks its error class by
// status: it makes idem's 422 a StripeAPIError whose type is
// idempotency_error; Stripe itself answers 400, which it makes a
// StripeIdempotencyError.)
func TestStripeNode(t *testing.T) {
	w := newWorld(t)
	node := startNode(t, "http://"+w.toProxy.Addr())

	w.toProxy.DropNextReply()
	first := node.create(t, 1000, "node-lost-reply")
	if first.ID == "" || first.Attempts != 2 || w.api.executions("", "node-lost-reply") != 1 {
		t.Fatalf("a lost reply: %+v, %d executions; want an object after 2 attempts, 1 execution", first, w.api.executions("", "node-lost-reply"))
	}
	if again := node.create(t, 1000, "node-lost-reply"); again.ID != first.ID {
		t.Fatalf("a later retry got %+v, want %s", again, first.ID)
	}
	reused := node.create(t, 1001, "node-lost-reply")
	if reused.Error != "StripeAPIError" || reused.Type != "idempotency_error" || reused.Code != "idempotency_key_reused" || reused.Status != 422 || reused.Attempts != 4 {
		t.Fatalf("a changed payload under a reused key: %+v; want a StripeAPIError of type idempotency_error, code idempotency_key_reused, 422, not retried", reused)
	}
}
