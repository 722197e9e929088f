package idemclient_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/httpidem"
	"github.com/idemhq/idem/idemclient"
	"github.com/idemhq/idem/store/memstore"
)

// recorder is a server that answers from a script and remembers what it got.
type recorder struct {
	mu     sync.Mutex
	keys   []string
	bodies []string
	answer func(n int, w http.ResponseWriter)
}

func (s *recorder) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	b, _ := io.ReadAll(r.Body)
	s.mu.Lock()
	s.keys = append(s.keys, r.Header.Get("Idempotency-Key"))
	s.bodies = append(s.bodies, string(b))
	n := len(s.keys)
	s.mu.Unlock()
	s.answer(n, w)
}

func (s *recorder) seen() ([]string, []string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.keys...), append([]string(nil), s.bodies...)
}

func client(cfg idemclient.Config) *http.Client {
	if cfg.BaseDelay == 0 {
		cfg.BaseDelay = time.Millisecond
	}
	return &http.Client{Transport: idemclient.New(cfg)}
}

var uuid4 = regexp.MustCompile(`^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$`)

func TestSameKeyOnEveryRetry(t *testing.T) {
	srv := &recorder{answer: func(n int, w http.ResponseWriter) {
		if n < 3 {
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		w.WriteHeader(http.StatusCreated)
	}}
	ts := httptest.NewServer(srv)
	defer ts.Close()
	req, _ := http.NewRequest("POST", ts.URL, strings.NewReader(`{"amount":100}`))
	resp, err := client(idemclient.Config{}).Do(req)
	if err != nil || resp.StatusCode != 201 {
		t.Fatalf("%v %v", resp, err)
	}
	resp.Body.Close()
	keys, bodies := srv.seen()
	if len(keys) != 3 || keys[0] != keys[1] || keys[1] != keys[2] || !uuid4.MatchString(keys[0]) {
		t.Fatalf("keys sent: %q; want one UUIDv4, three times", keys)
	}
	for _, b := range bodies {
		if b != `{"amount":100}` {
			t.Fatalf("bodies: %q; want the whole body on every attempt", bodies)
		}
	}
	if req.Header.Get("Idempotency-Key") != "" {
		t.Fatal("the caller's request was modified")
	}
}

// onceReader is a body without GetBody: it can be read once.
type onceReader struct{ io.Reader }

func TestBodyWithoutGetBodyIsBuffered(t *testing.T) {
	srv := &recorder{answer: func(n int, w http.ResponseWriter) {
		if n == 1 {
			w.WriteHeader(502)
			return
		}
		w.WriteHeader(200)
	}}
	ts := httptest.NewServer(srv)
	defer ts.Close()
	req, _ := http.NewRequest("PATCH", ts.URL, onceReader{strings.NewReader("patch body")})
	req.Header.Set("Idempotency-Key", "mine")
	resp, err := client(idemclient.Config{}).Do(req)
	if err != nil || resp.StatusCode != 200 {
		t.Fatal(resp, err)
	}
	keys, bodies := srv.seen()
	if len(keys) != 2 || keys[0] != "mine" || keys[1] != "mine" || bodies[1] != "patch body" {
		t.Fatalf("keys %q bodies %q; want the caller's key and the body twice", keys, bodies)
	}

	big, _ := http.NewRequest("POST", ts.URL, onceReader{strings.NewReader(strings.Repeat("x", 100))})
	if _, err := client(idemclient.Config{MaxBody: 10}).Do(big); !errors.Is(err, idemclient.ErrBodyTooLarge) {
		t.Fatalf("a body over MaxBody: %v", err)
	}
}

func TestWhatIsNotRetried(t *testing.T) {
	for _, c := range []struct {
		name   string
		method string
		status int
		body   string
	}{
		{"GET without key", "GET", 503, ""},
		{"400", "POST", 400, `{"type":"x#key-invalid"}`},
		{"422", "POST", 422, `{"type":"x#payload-mismatch"}`},
		{"409 uncertain", "POST", 409, `{"type":"https://github.com/idemhq/idem/blob/main/docs/problems.md#operation-uncertain"}`},
		{"500", "POST", 500, ""},
	} {
		srv := &recorder{answer: func(n int, w http.ResponseWriter) {
			w.Header().Set("Content-Type", "application/problem+json")
			w.WriteHeader(c.status)
			io.WriteString(w, c.body)
		}}
		ts := httptest.NewServer(srv)
		req, _ := http.NewRequest(c.method, ts.URL, nil)
		resp, err := client(idemclient.Config{}).Do(req)
		if err != nil || resp.StatusCode != c.status {
			t.Fatalf("%s: %v %v", c.name, resp, err)
		}
		got, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		keys, _ := srv.seen()
		if len(keys) != 1 || string(got) != c.body {
			t.Errorf("%s: %d attempts, body %q; want one attempt and the body intact", c.name, len(keys), got)
		}
		if c.method == "GET" && keys[0] != "" {
			t.Errorf("a GET got a key")
		}
		ts.Close()
	}
}

func TestInProgressHonoursRetryAfter(t *testing.T) {
	srv := &recorder{answer: func(n int, w http.ResponseWriter) {
		if n == 1 {
			w.Header().Set("Retry-After", "1")
			(&httpidem.Problem{Type: httpidem.ProblemInProgress, Title: "in progress", Status: 409}).Write(w)
			return
		}
		w.WriteHeader(201)
	}}
	ts := httptest.NewServer(srv)
	defer ts.Close()
	var waited time.Duration
	start := time.Now()
	resp, err := client(idemclient.Config{OnRetry: func(_ int, _ *http.Response, _ error, wait time.Duration) { waited = wait }}).Post(ts.URL, "text/plain", nil)
	if err != nil || resp.StatusCode != 201 {
		t.Fatal(resp, err)
	}
	if waited < time.Second || time.Since(start) < time.Second {
		t.Fatalf("waited %v (%v in all); want the server's Retry-After of 1s", waited, time.Since(start))
	}
}

func TestLimits(t *testing.T) {
	always := func(status int, retryAfter string) *httptest.Server {
		return httptest.NewServer(&recorder{answer: func(n int, w http.ResponseWriter) {
			if retryAfter != "" {
				w.Header().Set("Retry-After", retryAfter)
			}
			w.WriteHeader(status)
			fmt.Fprintf(w, "attempt %d", n)
		}})
	}
	// gaveUp checks that a request given up on an answer that asked for a
	// retry ends with an *idemclient.Error saying so.
	gaveUp := func(what string, resp *http.Response, err error, attempts, status int) *idemclient.Error {
		t.Helper()
		var e *idemclient.Error
		if err == nil {
			resp.Body.Close()
		}
		if !errors.As(err, &e) || e.Attempts != attempts || e.Status != status || e.Key == "" {
			t.Fatalf("%s: %v %v; want an *idemclient.Error after %d attempts, the last answered %d", what, resp, err, attempts, status)
		}
		return e
	}
	ts := always(503, "")
	resp, err := client(idemclient.Config{MaxAttempts: 4}).Post(ts.URL, "", nil)
	gaveUp("after MaxAttempts", resp, err, 4, 503)
	ts.Close()

	ts = always(429, "60")
	defer ts.Close()
	start := time.Now()
	resp, err = client(idemclient.Config{MaxElapsed: time.Second}).Post(ts.URL, "", nil)
	if e := gaveUp("a Retry-After past MaxElapsed", resp, err, 1, 429); e.RetryAfter != time.Minute || time.Since(start) > 5*time.Second {
		t.Fatalf("a Retry-After past MaxElapsed: RetryAfter %v after %v; want the server's minute, at once", e.RetryAfter, time.Since(start))
	}

	// Many attempts with a long base delay: the exponential stays capped
	// (BaseDelay·2ⁿ overflowed, and the backoff panicked at attempt 31).
	ts3 := always(503, "")
	defer ts3.Close()
	resp, err = client(idemclient.Config{BaseDelay: 10 * time.Second, MaxDelay: time.Millisecond, MaxAttempts: 40, MaxElapsed: time.Minute}).Post(ts3.URL, "", nil)
	gaveUp("after 40 attempts", resp, err, 40, 503)

	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	ts2 := always(503, "5")
	defer ts2.Close()
	req, _ := http.NewRequestWithContext(ctx, "POST", ts2.URL, nil)
	start = time.Now()
	if _, err := client(idemclient.Config{}).Do(req); !errors.Is(err, context.DeadlineExceeded) || time.Since(start) > 3*time.Second {
		t.Fatalf("ctx deadline during a wait: %v after %v", err, time.Since(start))
	}
}

// dropAfterRun is a server that runs the idempotent handler fully (the
// outcome is stored) and then, the first time, drops the connection instead
// of answering: the client sees a network error after the effect happened.
type dropAfterRun struct {
	next    http.Handler
	dropped atomic.Bool
}

func (d *dropAfterRun) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if d.dropped.CompareAndSwap(false, true) {
		d.next.ServeHTTP(httptest.NewRecorder(), r)
		conn, _, _ := http.NewResponseController(w).Hijack()
		conn.Close()
		return
	}
	d.next.ServeHTTP(w, r)
}

func TestNoDoubleEffectWhenTheAnswerIsLost(t *testing.T) {
	eng, _ := idem.New(idem.Config{Store: memstore.New()})
	mw, _ := httpidem.New(httpidem.Config{Engine: eng, RequireKey: true})
	var charges atomic.Int64
	handler := mw.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := charges.Add(1)
		w.WriteHeader(201)
		fmt.Fprintf(w, "charge %d", n)
	}))
	ts := httptest.NewServer(&dropAfterRun{next: handler})
	defer ts.Close()
	resp, err := client(idemclient.Config{}).Post(ts.URL, "application/json", strings.NewReader(`{"amount":100}`))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 201 || string(b) != "charge 1" || resp.Header.Get("Idempotent-Replayed") != "true" || charges.Load() != 1 {
		t.Fatalf("got %d %q replayed=%q after %d charges; want the first charge, replayed, charged once",
			resp.StatusCode, b, resp.Header.Get("Idempotent-Replayed"), charges.Load())
	}
}

func TestUUIDs(t *testing.T) {
	seen := map[string]bool{}
	prev := ""
	uuid7 := regexp.MustCompile(`^[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$`)
	for range 1000 {
		v4, err := idemclient.NewUUIDv4()
		if err != nil || !uuid4.MatchString(v4) || seen[v4] {
			t.Fatalf("v4 %q %v", v4, err)
		}
		seen[v4] = true
		v7, err := idemclient.NewUUIDv7()
		if err != nil || !uuid7.MatchString(v7) || v7[:13] < prev {
			t.Fatalf("v7 %q after %q: want the format and time order", v7, prev)
		}
		prev = v7[:13]
	}
}

// TestIgnoredKeyIsNotRetried: an answer that says the server did not honour
// the key (Idempotent-Ignored) is returned as it is: the request ran
// without idempotency, and a retry would run it again.
func TestIgnoredKeyIsNotRetried(t *testing.T) {
	eng, _ := idem.New(idem.Config{Store: memstore.New()})
	mw, _ := httpidem.New(httpidem.Config{Engine: eng, Methods: []string{"POST"}})
	var runs atomic.Int64
	ts := httptest.NewServer(mw.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if runs.Add(1) == 1 {
			w.WriteHeader(http.StatusGatewayTimeout) // the work was done, its answer lost downstream
			return
		}
		w.WriteHeader(http.StatusOK)
	})))
	defer ts.Close()
	req, _ := http.NewRequest("PATCH", ts.URL, strings.NewReader(`{"x":1}`))
	resp, err := client(idemclient.Config{}).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if runs.Load() != 1 || resp.StatusCode != http.StatusGatewayTimeout || resp.Header.Get(httpidem.HeaderIgnored) == "" {
		t.Fatalf("the handler ran %d times, answer %d; want one run and its 504, whose key was ignored", runs.Load(), resp.StatusCode)
	}
}

// TestCallersXIdempotencyKey: a caller's own X-Idempotency-Key is its key:
// every attempt carries it, and no second key is added beside it (which a
// server reads as two keys, a 400).
func TestCallersXIdempotencyKey(t *testing.T) {
	eng, _ := idem.New(idem.Config{Store: memstore.New()})
	mw, _ := httpidem.New(httpidem.Config{Engine: eng, RequireKey: true})
	var runs atomic.Int64
	ts := httptest.NewServer(&dropAfterRun{next: mw.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		w.WriteHeader(http.StatusCreated)
	}))})
	defer ts.Close()
	req, _ := http.NewRequest("POST", ts.URL, strings.NewReader(`{"x":1}`))
	req.Header.Set("X-Idempotency-Key", "order-42")
	resp, err := client(idemclient.Config{}).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusCreated || runs.Load() != 1 || resp.Header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("answer %d after %d runs (replayed %q); want the first run's 201, replayed", resp.StatusCode, runs.Load(), resp.Header.Get("Idempotent-Replayed"))
	}
	if got := resp.Request.Header.Values("Idempotency-Key"); len(got) != 0 {
		t.Fatalf("a second key was added beside the caller's X-Idempotency-Key: %q", got)
	}
}

// TestKeyKeptWhenGivingUp: when the transport gives up after sending the
// request (attempts or time run out, or the context ends in a backoff),
// its error carries the key, the only way its caller can ask again without
// running the request twice.
func TestKeyKeptWhenGivingUp(t *testing.T) {
	srv := &recorder{answer: func(n int, w http.ResponseWriter) {
		conn, _, _ := http.NewResponseController(w).Hijack()
		conn.Close() // every answer lost
	}}
	ts := httptest.NewServer(srv)
	defer ts.Close()
	resp, err := client(idemclient.Config{MaxAttempts: 3}).Post(ts.URL, "application/json", strings.NewReader(`{}`))
	if err == nil {
		resp.Body.Close()
		t.Fatal("no error after every answer was lost")
	}
	keys, _ := srv.seen()
	var gaveUp *idemclient.Error
	if !errors.As(err, &gaveUp) || len(keys) != 3 || gaveUp.Key != keys[0] || gaveUp.Attempts != 3 {
		t.Fatalf("error %v after %d attempts; want an *idemclient.Error carrying the key sent and 3 attempts", err, len(keys))
	}
	if strings.Contains(err.Error(), keys[0]) {
		t.Fatalf("the error's message shows the key: %v", err)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	wait := httptest.NewServer(&recorder{answer: func(n int, w http.ResponseWriter) {
		w.Header().Set("Retry-After", "5")
		w.WriteHeader(http.StatusServiceUnavailable)
	}})
	defer wait.Close()
	req, _ := http.NewRequestWithContext(ctx, "POST", wait.URL, nil)
	_, err = client(idemclient.Config{}).Do(req)
	if !errors.As(err, &gaveUp) || gaveUp.Key == "" || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("the context ended in a backoff: %v; want an *idemclient.Error with the key, wrapping the deadline", err)
	}
}

// TestStalledBodiesAreNotWaitedFor: the body of an answer to retry (or a
// 409 read for its problem type) that stalls does not hold the request
// past MaxElapsed.
func TestStalledBodiesAreNotWaitedFor(t *testing.T) {
	for _, c := range []struct {
		name  string
		write func(w http.ResponseWriter)
	}{
		{"503", func(w http.ResponseWriter) { w.WriteHeader(http.StatusServiceUnavailable) }},
		{"409", func(w http.ResponseWriter) {
			w.Header().Set("Content-Type", "application/problem+json")
			w.WriteHeader(http.StatusConflict)
		}},
	} {
		release := make(chan struct{})
		ts := httptest.NewServer(&recorder{answer: func(n int, w http.ResponseWriter) {
			c.write(w)
			io.WriteString(w, `{"type":"`)
			w.(http.Flusher).Flush()
			<-release // the rest of the body never comes
		}})
		done := make(chan error, 1)
		go func() {
			resp, err := client(idemclient.Config{MaxElapsed: 500 * time.Millisecond, MaxAttempts: 2}).Post(ts.URL, "", nil)
			if err == nil {
				resp.Body.Close()
			}
			done <- err
		}()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			t.Errorf("%s: still waiting for a stalled body 10 s into a request with MaxElapsed 500ms", c.name)
		}
		close(release)
		ts.Close()
	}
}

// TestHugeRetryAfter: a Retry-After too long for a time.Duration is too
// long to wait, not a short wait (it overflowed to 0.29 s); one whose
// wait, added to the time already spent, overflowed is too long as well
// (a date in year 9999: the client waited until the context ended, for
// good without a deadline).
func TestHugeRetryAfter(t *testing.T) {
	for _, after := range []string{"18446744074", "Fri, 31 Dec 9999 23:59:59 GMT"} {
		srv := &recorder{answer: func(n int, w http.ResponseWriter) {
			w.Header().Set("Retry-After", after)
			w.WriteHeader(http.StatusServiceUnavailable)
		}}
		ts := httptest.NewServer(srv)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		req, _ := http.NewRequestWithContext(ctx, "POST", ts.URL, nil)
		_, err := client(idemclient.Config{MaxElapsed: 5 * time.Second}).Do(req)
		var gaveUp *idemclient.Error
		if keys, _ := srv.seen(); !errors.As(err, &gaveUp) || gaveUp.Status != 503 || len(keys) != 1 || ctx.Err() != nil {
			t.Errorf("Retry-After %q: %v after %d attempts; want the 503 given up on at once (its Retry-After is past MaxElapsed)", after, err, len(keys))
		}
		cancel()
		ts.Close()
	}
}

// TestGivingUpOnAnAnswerIsAnError: the first attempt ran and its answer
// was lost; the retries met a store outage (503, not run) until attempts
// ran out. The 503 came back with no error, and so without the key: a
// caller that sent the request again later, under a new key, ran it a
// second time. Giving up on an answer that asked for a retry is an
// *idemclient.Error that carries the key.
func TestGivingUpOnAnAnswerIsAnError(t *testing.T) {
	srv := &recorder{answer: func(n int, w http.ResponseWriter) {
		if n == 1 { // it ran; the answer is lost
			conn, _, _ := http.NewResponseController(w).Hijack()
			conn.Close()
			return
		}
		(&httpidem.Problem{Type: httpidem.ProblemStoreUnavailable, Title: "Idempotency store unavailable", Status: 503,
			Detail: "the request was not run; retry it with the same key", RetryAfter: time.Millisecond}).Write(w)
	}}
	ts := httptest.NewServer(srv)
	defer ts.Close()
	resp, err := client(idemclient.Config{MaxAttempts: 3}).Post(ts.URL, "application/json", strings.NewReader(`{"amount":100}`))
	if err == nil {
		resp.Body.Close()
	}
	keys, _ := srv.seen()
	var gaveUp *idemclient.Error
	if !errors.As(err, &gaveUp) || len(keys) != 3 || gaveUp.Key != keys[0] || gaveUp.Attempts != 3 || gaveUp.Status != 503 {
		t.Fatalf("%v, %v after %d attempts; want an *idemclient.Error carrying the key sent, 3 attempts, the last answered 503", resp, err, len(keys))
	}
}

// TestGivingUpMidBackoffKeepsTheAnswer: the caller's context ends while
// the client waits to retry an answer that asked for a retry (503,
// Retry-After: 2): the error says what that answer was, its status and
// Retry-After, as giving up at once does. (Both were 0, "no answer".)
func TestGivingUpMidBackoffKeepsTheAnswer(t *testing.T) {
	ts := httptest.NewServer(&recorder{answer: func(n int, w http.ResponseWriter) {
		w.Header().Set("Retry-After", "2")
		w.WriteHeader(http.StatusServiceUnavailable)
	}})
	defer ts.Close()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	c := client(idemclient.Config{OnRetry: func(int, *http.Response, error, time.Duration) { cancel() }}) // ends during the wait
	req, _ := http.NewRequestWithContext(ctx, "POST", ts.URL, strings.NewReader("x"))
	resp, err := c.Do(req)
	if err == nil {
		resp.Body.Close()
	}
	var gaveUp *idemclient.Error
	if !errors.As(err, &gaveUp) || gaveUp.Status != 503 || gaveUp.RetryAfter != 2*time.Second || !errors.Is(err, context.Canceled) {
		t.Fatalf("%+v; want an *idemclient.Error with the answer's 503 and Retry-After 2s, and the context's error", err)
	}
}

// TestFinalConflictIsReadable: a 409 read for its problem type is handed
// to the caller whole: one that came after MaxElapsed was closed unread
// (its body failed), one larger than 64 KiB was cut there without an
// error.
func TestFinalConflictIsReadable(t *testing.T) {
	uncertain := `{"type":"https://idem.dev/problems#operation-uncertain","title":"Outcome unknown","status":409}`
	for _, c := range []struct {
		name string
		body string
		late time.Duration
	}{
		{"late", uncertain, 150 * time.Millisecond},
		{"large", uncertain + strings.Repeat(" ", 100<<10), 0},
	} {
		ts := httptest.NewServer(&recorder{answer: func(n int, w http.ResponseWriter) {
			<-time.After(c.late) // an answer that comes after MaxElapsed
			w.Header().Set("Content-Type", "application/problem+json")
			w.WriteHeader(http.StatusConflict)
			w.(http.Flusher).Flush()
			io.WriteString(w, c.body)
		}})
		resp, err := client(idemclient.Config{MaxElapsed: 100 * time.Millisecond}).Post(ts.URL, "", nil)
		if err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		b, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 409 || err != nil || string(b) != c.body {
			t.Errorf("%s: %d, %d bytes of %d, %v; want the 409 whole", c.name, resp.StatusCode, len(b), len(c.body), err)
		}
		ts.Close()
	}
}

// closeCounter is a request body that counts its closes.
type closeCounter struct {
	io.Reader
	closed atomic.Int64
}

func (c *closeCounter) Close() error { c.closed.Add(1); return nil }

// TestRequestBodyClosed: the RoundTripper contract says the request's body
// is closed, even when a GetBody supplies every attempt's.
func TestRequestBodyClosed(t *testing.T) {
	ts := httptest.NewServer(&recorder{answer: func(n int, w http.ResponseWriter) { w.WriteHeader(http.StatusCreated) }})
	defer ts.Close()
	body := &closeCounter{Reader: strings.NewReader("x")}
	req, _ := http.NewRequest("POST", ts.URL, body)
	req.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(strings.NewReader("x")), nil }
	resp, err := idemclient.New(idemclient.Config{}).RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if body.closed.Load() == 0 {
		t.Fatal("the request's body was never closed")
	}
}

// TestTransportTimeoutsAreRetried: http.Transport's ResponseHeaderTimeout, a
// dial's timeout and a deadline a Base gives each attempt are all
// context.DeadlineExceeded, while the caller's context is live: the first
// attempt's answer is late, or nothing was sent, and a retry with the key
// is what the client is for.
func TestTransportTimeoutsAreRetried(t *testing.T) {
	// slow holds the first attempt until the client gives up on it.
	slow := func(n *atomic.Int64) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			io.Copy(io.Discard, r.Body) // then the server watches the connection, and r's context ends with it
			if n.Add(1) == 1 {
				select {
				case <-r.Context().Done():
				case <-time.After(time.Minute):
				}
				return
			}
			w.WriteHeader(http.StatusCreated)
		})
	}
	t.Run("response header timeout", func(t *testing.T) {
		var n atomic.Int64
		ts := httptest.NewServer(slow(&n))
		defer ts.Close()
		base := &http.Transport{ResponseHeaderTimeout: time.Second}
		resp, err := client(idemclient.Config{Base: base}).Post(ts.URL, "application/json", strings.NewReader(`{}`))
		if err != nil {
			t.Fatalf("after %d attempt(s), the caller's context live: %v", n.Load(), err)
		}
		resp.Body.Close()
	})
	t.Run("a deadline per attempt", func(t *testing.T) {
		var n atomic.Int64
		ts := httptest.NewServer(slow(&n))
		defer ts.Close()
		resp, err := client(idemclient.Config{Base: deadlinePerAttempt{time.Second}}).Post(ts.URL, "application/json", strings.NewReader(`{}`))
		if err != nil {
			t.Fatalf("after %d attempt(s), the caller's context live: %v", n.Load(), err)
		}
		resp.Body.Close()
	})
	t.Run("dial timeout", func(t *testing.T) {
		ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusCreated) }))
		defer ts.Close()
		var dials atomic.Int64
		base := &http.Transport{DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			d := &net.Dialer{}
			if dials.Add(1) == 1 {
				d.Timeout = time.Nanosecond // the first SYN is lost
			}
			return d.DialContext(ctx, network, addr)
		}}
		resp, err := client(idemclient.Config{Base: base}).Post(ts.URL, "application/json", strings.NewReader(`{}`))
		if err != nil {
			t.Fatalf("after %d dial(s): %v", dials.Load(), err)
		}
		resp.Body.Close()
	})
}

// deadlinePerAttempt is a Base that gives each attempt a deadline of its own.
type deadlinePerAttempt struct{ d time.Duration }

func (p deadlinePerAttempt) RoundTrip(r *http.Request) (*http.Response, error) {
	ctx, cancel := context.WithTimeout(r.Context(), p.d)
	defer cancel()
	resp, err := http.DefaultTransport.RoundTrip(r.WithContext(ctx))
	if err != nil {
		return nil, err
	}
	b, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	resp.Body = io.NopCloser(bytes.NewReader(b))
	return resp, err
}

// TestReplaysAreFinal: a replay of the key's stored outcome never changes,
// whatever its status or Stripe-Should-Retry say (idem stores a 504 or a
// handler's own retry advice): the caller gets it, body and all, after one
// attempt, not an error after every attempt got the same replay.
func TestReplaysAreFinal(t *testing.T) {
	for _, c := range []struct {
		name   string
		status int
		header string
	}{{"a stored 504", http.StatusGatewayTimeout, ""}, {"a stored retry advice", http.StatusConflict, "true"}} {
		t.Run(c.name, func(t *testing.T) {
			eng, err := idem.New(idem.Config{Store: memstore.New()})
			if err != nil {
				t.Fatal(err)
			}
			mw, err := httpidem.New(httpidem.Config{Engine: eng, RequireKey: true})
			if err != nil {
				t.Fatal(err)
			}
			var runs, attempts atomic.Int64
			h := mw.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				runs.Add(1)
				if c.header != "" {
					w.Header().Set("Stripe-Should-Retry", c.header)
				}
				w.WriteHeader(c.status)
				io.WriteString(w, `{"charge":"ch_1"}`)
			}))
			ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { attempts.Add(1); h.ServeHTTP(w, r) }))
			defer ts.Close()
			resp, err := client(idemclient.Config{}).Post(ts.URL, "application/json", strings.NewReader(`{"amount":100}`))
			if err != nil {
				t.Fatalf("%d run(s), %d attempts: %v; want the stored outcome", runs.Load(), attempts.Load(), err)
			}
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != c.status || string(b) != `{"charge":"ch_1"}` || runs.Load() != 1 || attempts.Load() != 2 {
				t.Fatalf("%d %s after %d run(s) and %d attempts; want the stored %d after 1 run and 2 attempts (the first, its replay)",
					resp.StatusCode, b, runs.Load(), attempts.Load(), c.status)
			}
		})
	}
}

// TestBufferingHonoursTheContext: a body without GetBody is read whole
// before the first attempt; a stream whose producer stalls must not keep
// RoundTrip from returning when the request's context ends.
func TestBufferingHonoursTheContext(t *testing.T) {
	ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.Copy(io.Discard, r.Body) }))
	defer ts.Close()
	for _, ended := range []bool{true, false} {
		pr, pw := io.Pipe()
		defer pw.Close()
		go pw.Write([]byte(`{"amount":`)) // and then nothing more
		ctx, cancel := context.WithCancel(context.Background())
		if ended {
			cancel() // before RoundTrip
		} else {
			defer cancel()
			time.AfterFunc(50*time.Millisecond, cancel) // while the body is read
		}
		req, _ := http.NewRequestWithContext(ctx, "POST", ts.URL, pr)
		done := make(chan error, 1)
		go func() {
			resp, err := client(idemclient.Config{}).Do(req)
			if err == nil {
				resp.Body.Close()
			}
			done <- err
		}()
		select {
		case err := <-done:
			if !errors.Is(err, context.Canceled) {
				t.Fatalf("context ended before RoundTrip %v: %v; want context.Canceled", ended, err)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("context ended before RoundTrip %v: still in RoundTrip 10 s after the request's context ended", ended)
		}
	}
}
