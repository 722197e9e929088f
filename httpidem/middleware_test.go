package httpidem_test

import (
	"compress/gzip"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"math"
	"net/http"
	"net/http/httptest"
	"net/http/httptrace"
	"net/http/httputil"
	"net/textproto"
	"net/url"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/httpidem"
	"github.com/idemhq/idem/internal/wait"
	"github.com/idemhq/idem/store"
	"github.com/idemhq/idem/store/memstore"
	"github.com/idemhq/idem/store/sqlitestore"
)

// storeMakers are the stores every contract row runs on.
var storeMakers = map[string]func(t *testing.T) idem.Store{
	"memstore": func(t *testing.T) idem.Store { return memstore.New() },
	"sqlite": func(t *testing.T) idem.Store {
		s, err := sqlitestore.Open(context.Background(), sqlitestore.Config{Path: filepath.Join(t.TempDir(), "idem.db")})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { s.Close() })
		return s
	},
}

// forEachStore runs fn as a parallel subtest on each store.
func forEachStore(t *testing.T, fn func(t *testing.T, store idem.Store)) {
	for name, mk := range storeMakers {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			fn(t, mk(t))
		})
	}
}

// app is a handler that counts how often it really ran.
type app struct {
	runs    atomic.Int64
	handler http.HandlerFunc
}

func (a *app) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	a.runs.Add(1)
	a.handler(w, r)
}

func charge(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	w.Header().Set("Content-Type", "application/json")
	w.Header().Add("X-Trace", "one")
	w.Header().Add("X-Trace", "two")
	w.Header().Set("Set-Cookie", "session=secret")
	w.WriteHeader(http.StatusCreated)
	fmt.Fprintf(w, `{"charge":%q,"seq":%d}`, body, time.Now().UnixNano())
}

func newEngine(t *testing.T, store idem.Store) *idem.Engine {
	t.Helper()
	e, err := idem.New(idem.Config{Store: store})
	if err != nil {
		t.Fatal(err)
	}
	return e
}

func serve(t *testing.T, cfg httpidem.Config, h http.Handler) *httptest.Server {
	t.Helper()
	mw, err := httpidem.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(mw.Wrap(h))
	t.Cleanup(srv.Close)
	srv.Client().Timeout = time.Minute // a regression fails with a message, never hangs
	return srv
}

type reply struct {
	status  int
	header  http.Header
	body    string
	problem httpidem.Problem
}

func send(t *testing.T, srv *httptest.Server, method, path, key, body string, headers ...string) reply {
	t.Helper()
	req, err := http.NewRequest(method, srv.URL+path, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	for i := 0; i+1 < len(headers); i += 2 {
		req.Header.Add(headers[i], headers[i+1])
	}
	resp, err := srv.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	rep := reply{status: resp.StatusCode, header: resp.Header, body: string(b)}
	if resp.Header.Get("Content-Type") == "application/problem+json" {
		if err := json.Unmarshal(b, &rep.problem); err != nil {
			t.Fatalf("problem body %q: %v", b, err)
		}
		if rep.problem.Status != resp.StatusCode || rep.problem.Title == "" {
			t.Fatalf("problem %+v does not match status %d", rep.problem, resp.StatusCode)
		}
	}
	return rep
}

func wantProblem(t *testing.T, r reply, status int, typ string) {
	t.Helper()
	if r.status != status || r.problem.Type != typ {
		t.Fatalf("got %d %q (%s), want %d %q", r.status, r.problem.Type, r.body, status, typ)
	}
}

func TestReplaySameOutcome(t *testing.T) {
	forEachStore(t, func(t *testing.T, store idem.Store) {
		a := &app{handler: charge}
		srv := serve(t, httpidem.Config{Engine: newEngine(t, store)}, a)
		first := send(t, srv, "POST", "/v1/charges", "key-1", `{"amount":100}`)
		second := send(t, srv, "POST", "/v1/charges", "key-1", `{"amount":100}`)
		if a.runs.Load() != 1 {
			t.Fatalf("handler ran %d times, want once", a.runs.Load())
		}
		if first.status != 201 || second.status != 201 || first.body != second.body {
			t.Fatalf("first %d %q, replay %d %q", first.status, first.body, second.status, second.body)
		}
		if second.header.Get("Idempotent-Replayed") != "true" || first.header.Get("Idempotent-Replayed") != "" {
			t.Fatalf("Idempotent-Replayed: first %q, replay %q", first.header.Get("Idempotent-Replayed"), second.header.Get("Idempotent-Replayed"))
		}
		if got := second.header.Values("X-Trace"); !reflect.DeepEqual(got, []string{"one", "two"}) {
			t.Fatalf("replayed X-Trace = %v", got)
		}
		if second.header.Get("Content-Type") != "application/json" || second.header.Get("Set-Cookie") != "" {
			t.Fatalf("replayed headers %v: want the content type and no cookie", second.header)
		}
		exp, err := http.ParseTime(first.header.Get(httpidem.HeaderExpires))
		if err != nil || exp.Before(time.Now().Add(idem.DefaultRetention-time.Minute)) || second.header.Get(httpidem.HeaderExpires) != first.header.Get(httpidem.HeaderExpires) {
			t.Fatalf("Idempotency-Expires %q / %q: want the retention, the same on replay", first.header.Get(httpidem.HeaderExpires), second.header.Get(httpidem.HeaderExpires))
		}
	})
}

func TestServerErrorIsStoredAndReplayed(t *testing.T) {
	forEachStore(t, func(t *testing.T, store idem.Store) {
		a := &app{handler: func(w http.ResponseWriter, r *http.Request) { http.Error(w, "acquirer exploded", 500) }}
		srv := serve(t, httpidem.Config{Engine: newEngine(t, store)}, a)
		for range 3 {
			if r := send(t, srv, "POST", "/v1/charges", "k", "x"); r.status != 500 || !strings.Contains(r.body, "exploded") {
				t.Fatalf("got %d %q", r.status, r.body)
			}
		}
		if a.runs.Load() != 1 {
			t.Fatalf("a stored 500 ran %d times", a.runs.Load())
		}
	})
}

func TestPayloadMismatch(t *testing.T) {
	forEachStore(t, func(t *testing.T, store idem.Store) {
		a := &app{handler: charge}
		srv := serve(t, httpidem.Config{Engine: newEngine(t, store)}, a)
		send(t, srv, "POST", "/v1/charges?currency=eur", "k", `{"amount":100}`)
		r := send(t, srv, "POST", "/v1/charges?currency=eur", "k", `{"amount":999}`)
		wantProblem(t, r, 422, httpidem.ProblemPayloadMismatch)
		if !reflect.DeepEqual(r.problem.Differs, []string{"body"}) || strings.Contains(r.body, "999") {
			t.Fatalf("mismatch problem %s: want it to name the body and not its value", r.body)
		}
		r = send(t, srv, "POST", "/v1/charges?currency=usd", "k", `{"amount":100}`)
		wantProblem(t, r, 422, httpidem.ProblemPayloadMismatch)
		if !reflect.DeepEqual(r.problem.Differs, []string{"query"}) {
			t.Fatalf("differs = %v, want [query]", r.problem.Differs)
		}
		r = send(t, srv, "PATCH", "/v1/charges?currency=eur", "k", `{"amount":100}`)
		if !reflect.DeepEqual(r.problem.Differs, []string{"method"}) {
			t.Fatalf("differs = %v, want [method]", r.problem.Differs)
		}
		if a.runs.Load() != 1 {
			t.Fatalf("handler ran %d times", a.runs.Load())
		}
	})
}

// gate is a handler that blocks until released, telling when it started.
type gate struct {
	started chan struct{}
	release chan struct{}
}

func newGate() *gate { return &gate{started: make(chan struct{}, 10), release: make(chan struct{})} }

func (g *gate) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	g.started <- struct{}{}
	select { // released by the test; bounded, so that a failed test never hangs in cleanup
	case <-g.release:
	case <-time.After(time.Minute):
	}
	w.WriteHeader(201)
	io.WriteString(w, "done")
}

// TestConcurrentDuplicateConflicts: with waiting off, a duplicate of a
// running request gets 409 in-progress at once, asked to retry.
func TestConcurrentDuplicateConflicts(t *testing.T) {
	forEachStore(t, func(t *testing.T, store idem.Store) {
		g := newGate()
		a := &app{handler: g.ServeHTTP}
		srv := serve(t, httpidem.Config{Engine: newEngine(t, store), Wait: -1}, a)
		first := make(chan reply)
		go func() { first <- send(t, srv, "POST", "/pay", "k", "x") }()
		wait.Recv(t, g.started, 10*time.Second, "the handler to start")
		r := send(t, srv, "POST", "/pay", "k", "x")
		wantProblem(t, r, 409, httpidem.ProblemInProgress)
		if r.header.Get("Retry-After") != "1" || r.header.Get(httpidem.HeaderShouldRetry) != "true" {
			t.Fatalf("409 in progress with Retry-After %q, Stripe-Should-Retry %q; want 1 and true",
				r.header.Get("Retry-After"), r.header.Get(httpidem.HeaderShouldRetry))
		}
		close(g.release)
		if got := wait.Recv(t, first, 10*time.Second, "the first request's answer"); got.status != 201 {
			t.Fatalf("first = %d", got.status)
		}
		if r := send(t, srv, "POST", "/pay", "k", "x"); r.status != 201 || r.body != "done" {
			t.Fatalf("after the first finished: %d %q", r.status, r.body)
		}
		if a.runs.Load() != 1 {
			t.Fatalf("ran %d times", a.runs.Load())
		}
	})
}

// acquireSignal reports each Acquire after it returns.
type acquireSignal struct {
	idem.Store
	acquired chan idem.Record
}

func (s *acquireSignal) Acquire(ctx context.Context, p store.AcquireParams) (idem.Record, error) {
	r, err := s.Store.Acquire(ctx, p)
	s.acquired <- r
	return r, err
}

func TestWaitModeReplaysFirstOutcome(t *testing.T) {
	forEachStore(t, func(t *testing.T, store idem.Store) {
		sig := &acquireSignal{Store: store, acquired: make(chan idem.Record, 10)}
		eng, err := idem.New(idem.Config{Store: sig, Poll: time.Hour}) // woken, not polled
		if err != nil {
			t.Fatal(err)
		}
		g := newGate()
		a := &app{handler: g.ServeHTTP}
		srv := serve(t, httpidem.Config{Engine: eng, Wait: time.Minute}, a)
		first := make(chan reply)
		go func() { first <- send(t, srv, "POST", "/pay", "k", "x") }()
		wait.Recv(t, g.started, 10*time.Second, "the handler to start")
		wait.Recv(t, sig.acquired, 10*time.Second, "the first's acquire")
		second := make(chan reply)
		go func() { second <- send(t, srv, "POST", "/pay", "k", "x") }()
		wait.Until(t, 10*time.Second, "the second to wait for the first", func() bool { return eng.Waiting("", "k") == 1 })
		close(g.release)
		f := wait.Recv(t, first, 10*time.Second, "the first's answer")
		s := wait.Recv(t, second, 10*time.Second, "the waiting duplicate's answer")
		if f.status != 201 || s.status != 201 || s.body != "done" || s.header.Get("Idempotent-Replayed") != "true" {
			t.Fatalf("first %d, waiting duplicate %d %q replayed=%q", f.status, s.status, s.body, s.header.Get("Idempotent-Replayed"))
		}
		if a.runs.Load() != 1 {
			t.Fatalf("ran %d times", a.runs.Load())
		}
	})
}

func TestMissingKey(t *testing.T) {
	forEachStore(t, func(t *testing.T, store idem.Store) {
		a := &app{handler: charge}
		required := serve(t, httpidem.Config{Engine: newEngine(t, store), RequireKey: true}, a)
		wantProblem(t, send(t, required, "POST", "/pay", "", "x"), 400, httpidem.ProblemKeyMissing)
		if a.runs.Load() != 0 {
			t.Fatal("handler ran without a key")
		}
		if r := send(t, required, "GET", "/pay", "", ""); r.status != 201 {
			t.Fatalf("GET is not covered: got %d", r.status)
		}
		optional := serve(t, httpidem.Config{Engine: newEngine(t, store)}, a)
		send(t, optional, "POST", "/pay", "", "x")
		send(t, optional, "POST", "/pay", "", "x")
		if a.runs.Load() != 3 {
			t.Fatalf("without a key every request runs: ran %d, want 3", a.runs.Load())
		}
	})
}

func TestMalformedKey(t *testing.T) {
	forEachStore(t, func(t *testing.T, store idem.Store) {
		a := &app{handler: charge}
		srv := serve(t, httpidem.Config{Engine: newEngine(t, store)}, a)
		uuidOnly := serve(t, httpidem.Config{Engine: newEngine(t, store), KeyFormat: httpidem.KeyUUID}, a)
		for name, key := range map[string]string{
			"empty quoted":     `""`,
			"over 255 bytes":   strings.Repeat("k", 256),
			"unclosed quote":   `"abc`,
			"bad escape":       `"a\b"`,
			"space in bare":    "a b",
			"trailing garbage": `"abc"x`,
		} {
			if r := send(t, srv, "POST", "/pay", key, "x"); r.status != 400 || r.problem.Type != httpidem.ProblemKeyInvalid {
				t.Fatalf("%s key: got %d %q, want 400 key-invalid", name, r.status, r.problem.Type)
			}
		}
		wantProblem(t, send(t, srv, "POST", "/pay", "", "x", "Idempotency-Key", "a", "Idempotency-Key", "b"), 400, httpidem.ProblemKeyInvalid)
		wantProblem(t, send(t, uuidOnly, "POST", "/pay", "not-a-uuid", "x"), 400, httpidem.ProblemKeyInvalid)
		if a.runs.Load() != 0 {
			t.Fatalf("handler ran %d times on malformed keys", a.runs.Load())
		}
		if r := send(t, uuidOnly, "POST", "/pay", "018F6F2E-7B1A-7C3D-9E4F-0A1B2C3D4E5F", "x"); r.status != 201 {
			t.Fatalf("uuid key refused: %d", r.status)
		}
		// The quoted and the bare form name the same key.
		send(t, srv, "POST", "/pay", `"abc-1"`, "x")
		if r := send(t, srv, "POST", "/pay", `abc-1`, "x"); r.header.Get("Idempotent-Replayed") != "true" {
			t.Fatalf(`bare abc-1 after "abc-1" was not a replay: %d`, r.status)
		}
	})
}

func TestPanicMakesOutcomeUncertain(t *testing.T) {
	forEachStore(t, func(t *testing.T, store idem.Store) {
		var calls atomic.Int64
		h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if calls.Add(1) == 1 {
				panic("acquirer connection dropped mid-charge")
			}
			w.WriteHeader(201)
		})
		eng := newEngine(t, store)
		mw, _ := httpidem.New(httpidem.Config{Engine: eng})
		req := func() *httptest.ResponseRecorder {
			rec := httptest.NewRecorder()
			r := httptest.NewRequest("POST", "/pay", strings.NewReader("x"))
			r.Header.Set("Idempotency-Key", "k")
			func() {
				defer func() {
					if p := recover(); p != nil && p != "acquirer connection dropped mid-charge" {
						t.Fatalf("panic changed on the way: %v", p)
					}
				}()
				mw.Wrap(h).ServeHTTP(rec, r)
			}()
			return rec
		}
		req()
		rec := req()
		if rec.Code != 409 || !strings.Contains(rec.Body.String(), "operation-uncertain") || calls.Load() != 1 {
			t.Fatalf("retry after a panic: %d %s, handler calls %d", rec.Code, rec.Body, calls.Load())
		}
		if r, _ := eng.Get(context.Background(), "", "k"); r.State != idem.StateUnknown {
			t.Fatalf("state = %v, want unknown", r.State)
		}
	})
}

// TestPanicAfterAnswerBegunIsNeverReleased: on a TakeoverSafe route a panic
// releases the key only when the handler had begun no answer. Once it has
// (a status written, a body buffered, flushed or hijacked away, as
// httputil.ReverseProxy aborts with http.ErrAbortHandler when its
// upstream's body breaks off after the upstream answered), or has said its
// outcome is unknown, it may have acted: the retry gets 409
// operation-uncertain and the handler runs once. (Every panic released the
// key on such a route, and the retry ran again.)
func TestPanicAfterAnswerBegunIsNeverReleased(t *testing.T) {
	for _, tc := range []struct {
		name     string
		cut      func(w http.ResponseWriter, r *http.Request)
		released bool // the retry runs again
	}{
		{"nothing answered", func(w http.ResponseWriter, r *http.Request) {}, true},
		{"an informational answer only", func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Link", "</style.css>; rel=preload")
			w.WriteHeader(http.StatusEarlyHints)
		}, true},
		{"status and part of the body", func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Length", "100")
			w.WriteHeader(http.StatusCreated)
			io.WriteString(w, `{"transfer":`)
		}, false},
		{"a body, its status implied", func(w http.ResponseWriter, r *http.Request) {
			io.WriteString(w, `{"transfer":`)
		}, false},
		{"flushed", func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Length", "100")
			w.WriteHeader(http.StatusCreated)
			io.WriteString(w, `{"transfer":`)
			http.NewResponseController(w).Flush()
		}, false},
		{"hijacked", func(w http.ResponseWriter, r *http.Request) {
			conn, buf, err := http.NewResponseController(w).Hijack()
			if err != nil {
				t.Errorf("hijack: %v", err)
				return
			}
			defer conn.Close() // as the panic unwinds: net/http leaves a hijacked connection open
			buf.WriteString("HTTP/1.1 201 Created\r\nContent-Length: 100\r\n\r\n{\"transfer\":")
			buf.Flush()
			panic(http.ErrAbortHandler)
		}, false},
		{"outcome said unknown", func(w http.ResponseWriter, r *http.Request) {
			httpidem.OutcomeUnknown(r)
		}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			eng := newEngine(t, memstore.New())
			mw, err := httpidem.New(httpidem.Config{Engine: eng, TakeoverSafe: true})
			if err != nil {
				t.Fatal(err)
			}
			a := &app{}
			a.handler = func(w http.ResponseWriter, r *http.Request) {
				io.ReadAll(r.Body)
				if a.runs.Load() > 1 {
					w.WriteHeader(http.StatusCreated)
					io.WriteString(w, `{"transfer":"second"}`)
					return
				}
				tc.cut(w, r)
				panic(http.ErrAbortHandler) // the connection breaks off
			}
			ended := make(chan struct{}, 2)
			h := mw.Wrap(a)
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				defer func() { ended <- struct{}{} }() // once the middleware has settled, as the panic goes on to net/http
				h.ServeHTTP(w, r)
			}))
			t.Cleanup(srv.Close)
			srv.Client().Timeout = time.Minute
			req, _ := http.NewRequest("POST", srv.URL+"/transfers", strings.NewReader(`{"amount":100}`))
			req.Header.Set("Idempotency-Key", "k")
			if resp, err := srv.Client().Do(req); err == nil {
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
			wait.Recv(t, ended, 10*time.Second, "the first request's handler to end")
			r := send(t, srv, "POST", "/transfers", "k", `{"amount":100}`)
			if tc.released {
				if r.status != http.StatusCreated || a.runs.Load() != 2 {
					t.Fatalf("retry: %d %q, handler ran %d times; want the retry run: nothing was answered", r.status, r.body, a.runs.Load())
				}
				return
			}
			if a.runs.Load() != 1 {
				t.Fatalf("the handler ran %d times (the retry got %d %q); want once: it had begun its answer", a.runs.Load(), r.status, r.body)
			}
			wantProblem(t, r, http.StatusConflict, httpidem.ProblemUncertain)
			if rec, err := eng.Get(context.Background(), "", "k"); err != nil || rec.State != idem.StateUnknown {
				t.Fatalf("record %v, %v; want unknown", rec.State, err)
			}
		})
	}
}

// downStore is a store that cannot be reached.
type downStore struct{ idem.Store }

func (downStore) Acquire(context.Context, store.AcquireParams) (idem.Record, error) {
	return idem.Record{}, fmt.Errorf("dial tcp: connection refused: %w", idem.ErrUnavailable)
}

func TestStoreDownFailsClosed(t *testing.T) {
	a := &app{handler: charge}
	eng, err := idem.New(idem.Config{Store: downStore{memstore.New()}, StoreTimeout: 200 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	closed := serve(t, httpidem.Config{Engine: eng}, a)
	r := send(t, closed, "POST", "/pay", "k", "x")
	wantProblem(t, r, 503, httpidem.ProblemStoreUnavailable)
	if a.runs.Load() != 0 || r.header.Get("Retry-After") == "" {
		t.Fatalf("fail closed: handler ran %d times, Retry-After %q", a.runs.Load(), r.header.Get("Retry-After"))
	}
	open := serve(t, httpidem.Config{Engine: eng, FailOpen: true}, a)
	r = send(t, open, "POST", "/pay", "k", "x")
	if r.status != 201 || a.runs.Load() != 1 {
		t.Fatalf("fail open: %d, ran %d", r.status, a.runs.Load())
	}
	// The key was not honoured, and the answer says so: a client that
	// retried it (its answer lost) would run it again under a new record.
	if r.header.Get(httpidem.HeaderIgnored) == "" {
		t.Fatalf("fail open ran the request without idempotency and did not say so (no %s)", httpidem.HeaderIgnored)
	}
}

// TestFailOpenOnlyWhenUnreachable: FailOpen runs the handler unprotected
// when the store cannot be reached, never when it answered with an error:
// here a completed record whose stored response it cannot read (written by
// another version, or damaged). That key has run; running it again is the
// double execution idem exists to prevent, so the answer is a 503.
func TestFailOpenOnlyWhenUnreachable(t *testing.T) {
	a := &app{handler: charge}
	s, err := sqlitestore.Open(context.Background(), sqlitestore.Config{Path: filepath.Join(t.TempDir(), "idem.db")})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	srv := serve(t, httpidem.Config{Engine: newEngine(t, s), FailOpen: true}, a)
	if r := send(t, srv, "POST", "/pay", "k", "x"); r.status != 201 {
		t.Fatalf("first request: %d", r.status)
	}
	if _, err := s.DB().Exec(`UPDATE idem_records SET response = x'00ff'`); err != nil {
		t.Fatal(err)
	}
	again := serve(t, httpidem.Config{Engine: newEngine(t, s), FailOpen: true}, a) // a new process: nothing cached
	r := send(t, again, "POST", "/pay", "k", "x")
	wantProblem(t, r, 503, httpidem.ProblemStoreUnavailable)
	if a.runs.Load() != 1 {
		t.Fatalf("the handler ran %d times; want once", a.runs.Load())
	}
}

// TestStreamedReleaseMakesNoPromise: a response streamed (flushed) before
// the handler ends is sent with Idempotency-Expires only when its status
// keeps the record: a streamed 503 or 429 releases the key, and its
// retry runs, so it promises nothing.
func TestStreamedReleaseMakesNoPromise(t *testing.T) {
	forEachStore(t, func(t *testing.T, store idem.Store) {
		a := &app{handler: func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path == "/busy" {
				w.WriteHeader(503)
			}
			io.WriteString(w, "event: 1\n")
			http.NewResponseController(w).Flush()
		}}
		srv := serve(t, httpidem.Config{Engine: newEngine(t, store)}, a)
		if r := send(t, srv, "POST", "/busy", "k1", "x"); r.status != 503 || r.header.Get(idem.HeaderExpires) != "" {
			t.Fatalf("streamed 503: %d with %s %q; want no promise", r.status, idem.HeaderExpires, r.header.Get(idem.HeaderExpires))
		}
		if r := send(t, srv, "POST", "/busy", "k1", "x"); r.status != 503 || a.runs.Load() != 2 {
			t.Fatalf("its retry: %d, ran %d times; want it run again", r.status, a.runs.Load())
		}
		if r := send(t, srv, "POST", "/ok", "k2", "x"); r.status != 200 || r.header.Get(idem.HeaderExpires) == "" {
			t.Fatalf("streamed 200: %d with %s %q; want the promise", r.status, idem.HeaderExpires, r.header.Get(idem.HeaderExpires))
		}
	})
}

// TestXIdempotencyKey: a key sent as X-Idempotency-Key, the name some
// clients still use, is honoured as Idempotency-Key; both headers naming
// two keys is a malformed request; on a method that is not covered it is
// answered Idempotent-Ignored like the other. (It was ignored without a
// word: the request ran twice.)
func TestXIdempotencyKey(t *testing.T) {
	a := &app{handler: charge}
	srv := serve(t, httpidem.Config{Engine: newEngine(t, memstore.New())}, a)
	first := send(t, srv, "POST", "/pay", "", "x", httpidem.HeaderXKey, "order-1")
	again := send(t, srv, "POST", "/pay", "", "x", httpidem.HeaderXKey, "order-1")
	if first.status != 201 || again.body != first.body || again.header.Get(httpidem.HeaderReplayed) != "true" || a.runs.Load() != 1 {
		t.Fatalf("X-Idempotency-Key twice: %d, %d replayed %q, ran %d times; want one run and its replay",
			first.status, again.status, again.header.Get(httpidem.HeaderReplayed), a.runs.Load())
	}
	if r := send(t, srv, "POST", "/pay", "order-1", "x", httpidem.HeaderXKey, "order-1"); r.header.Get(httpidem.HeaderReplayed) != "true" {
		t.Fatalf("both headers, one key: %d, want the replay", r.status)
	}
	wantProblem(t, send(t, srv, "POST", "/pay", "order-1", "x", httpidem.HeaderXKey, "order-2"), 400, httpidem.ProblemKeyInvalid)
	if r := send(t, srv, "GET", "/pay", "", "", httpidem.HeaderXKey, "order-3"); r.header.Get(httpidem.HeaderIgnored) == "" {
		t.Fatalf("GET with X-Idempotency-Key: no %s header", httpidem.HeaderIgnored)
	}
	if a.runs.Load() != 2 {
		t.Fatalf("ran %d times, want the POST once and the GET", a.runs.Load())
	}
}

// TestGzipBodyFingerprintsWhatItCarries: a body sent gzip-encoded is
// fingerprinted as what it decodes to, so that a retry compressed again (a
// new timestamp in the gzip header) is the same payload, replayed, and a
// changed one inside is a 422; canonical JSON and field exclusions apply
// to it. (It was fingerprinted as compressed: the retry got a 422.)
func TestGzipBodyFingerprintsWhatItCarries(t *testing.T) {
	zipped := func(body string, mtime time.Time) string {
		var b strings.Builder
		zw := gzip.NewWriter(&b)
		zw.ModTime = mtime
		io.WriteString(zw, body)
		zw.Close()
		return b.String()
	}
	a := &app{handler: charge}
	srv := serve(t, httpidem.Config{Engine: newEngine(t, memstore.New()), ExcludeFields: []string{"sent_at"}}, a)
	t0 := time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
	first := send(t, srv, "POST", "/pay", "k", zipped(`{"amount":100,"sent_at":1}`, t0), "Content-Encoding", "gzip")
	again := send(t, srv, "POST", "/pay", "k", zipped(`{"sent_at":2, "amount":100}`, t0.Add(time.Second)), "Content-Encoding", "gzip")
	if first.status != 201 || again.header.Get(httpidem.HeaderReplayed) != "true" || a.runs.Load() != 1 {
		t.Fatalf("the same payload compressed again: %d then %d (replayed %q), ran %d times; want the replay",
			first.status, again.status, again.header.Get(httpidem.HeaderReplayed), a.runs.Load())
	}
	wantProblem(t, send(t, srv, "POST", "/pay", "k", zipped(`{"amount":500}`, t0), "Content-Encoding", "gzip"), 422, httpidem.ProblemPayloadMismatch)
}

func TestNothingHappenedReleasesKey(t *testing.T) {
	forEachStore(t, func(t *testing.T, store idem.Store) {
		for _, c := range []struct {
			name    string
			handler http.HandlerFunc
		}{
			{"429", func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(429) }},
			{"503", func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(503) }},
			{"declared", func(w http.ResponseWriter, r *http.Request) {
				httpidem.NothingHappened(r)
				w.WriteHeader(402)
			}},
		} {
			a := &app{handler: c.handler}
			srv := serve(t, httpidem.Config{Engine: newEngine(t, store)}, a)
			send(t, srv, "POST", "/pay", "k-"+c.name, "x")
			r := send(t, srv, "POST", "/pay", "k-"+c.name, "x")
			if a.runs.Load() != 2 || r.header.Get("Idempotent-Replayed") != "" {
				t.Fatalf("%s: ran %d times (replayed %q), want the retry to run", c.name, a.runs.Load(), r.header.Get("Idempotent-Replayed"))
			}
		}
	})
}

func TestOutcomeUnknownDeclared(t *testing.T) {
	forEachStore(t, func(t *testing.T, store idem.Store) {
		a := &app{handler: func(w http.ResponseWriter, r *http.Request) {
			httpidem.OutcomeUnknown(r)
			w.WriteHeader(504)
		}}
		srv := serve(t, httpidem.Config{Engine: newEngine(t, store)}, a)
		if r := send(t, srv, "POST", "/pay", "k", "x"); r.status != 504 {
			t.Fatalf("first = %d", r.status)
		}
		wantProblem(t, send(t, srv, "POST", "/pay", "k", "x"), 409, httpidem.ProblemUncertain)
		if a.runs.Load() != 1 {
			t.Fatalf("ran %d times", a.runs.Load())
		}
	})
}

func TestScopesIsolateCallers(t *testing.T) {
	forEachStore(t, func(t *testing.T, store idem.Store) {
		a := &app{handler: func(w http.ResponseWriter, r *http.Request) {
			io.WriteString(w, "for "+r.Header.Get("Authorization"))
		}}
		srv := serve(t, httpidem.Config{Engine: newEngine(t, store), Scope: httpidem.HashScope("Authorization")}, a)
		alice := send(t, srv, "POST", "/pay", "shared", "x", "Authorization", "Bearer alice")
		bob := send(t, srv, "POST", "/pay", "shared", "x", "Authorization", "Bearer bob")
		again := send(t, srv, "POST", "/pay", "shared", "x", "Authorization", "Bearer bob")
		if alice.body != "for Bearer alice" || bob.body != "for Bearer bob" || again.body != bob.body || a.runs.Load() != 2 {
			t.Fatalf("alice %q, bob %q, bob again %q, runs %d", alice.body, bob.body, again.body, a.runs.Load())
		}
	})
}

func TestUnreplayableResponse(t *testing.T) {
	forEachStore(t, func(t *testing.T, store idem.Store) {
		big := strings.Repeat("x", 2048)
		a := &app{handler: func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path == "/stream" {
				io.WriteString(w, "event: 1\n")
				http.NewResponseController(w).Flush()
				io.WriteString(w, "event: 2\n")
				return
			}
			w.WriteHeader(201)
			io.WriteString(w, big)
		}}
		eng := newEngine(t, store)
		srv := serve(t, httpidem.Config{Engine: eng, MaxResponseBody: 1024}, a)
		first := send(t, srv, "POST", "/big", "k1", "x")
		if first.status != 201 || first.body != big {
			t.Fatalf("large response not delivered whole the first time: %d, %d bytes", first.status, len(first.body))
		}
		// Its record was made all the same: the first answer says until when
		// a retry is told so, and the record lasts at least that long.
		said, err := http.ParseTime(first.header.Get(idem.HeaderExpires))
		rec, gerr := eng.Get(context.Background(), "", "k1")
		if err != nil || gerr != nil || rec.Expires.Before(said) || rec.Expires.Sub(said) > time.Minute {
			t.Fatalf("first answer's %s = %q (%v); the record expires at %v (%v)", idem.HeaderExpires, first.header.Get(idem.HeaderExpires), err, rec.Expires, gerr)
		}
		r := send(t, srv, "POST", "/big", "k1", "x")
		wantProblem(t, r, 409, httpidem.ProblemNotReplayable)
		if r.problem.OriginalStatus != 201 {
			t.Fatalf("original status = %d", r.problem.OriginalStatus)
		}
		if r := send(t, srv, "POST", "/stream", "k2", "x"); r.body != "event: 1\nevent: 2\n" {
			t.Fatalf("stream delivered %q", r.body)
		}
		wantProblem(t, send(t, srv, "POST", "/stream", "k2", "x"), 409, httpidem.ProblemNotReplayable)
		if a.runs.Load() != 2 {
			t.Fatalf("ran %d times", a.runs.Load())
		}
	})
}

func TestRequestTooLarge(t *testing.T) {
	a := &app{handler: charge}
	srv := serve(t, httpidem.Config{Engine: newEngine(t, memstore.New()), MaxRequestBody: 10}, a)
	wantProblem(t, send(t, srv, "POST", "/pay", "k", strings.Repeat("x", 11)), 413, httpidem.ProblemRequestTooLarge)
	if r := send(t, srv, "POST", "/pay", "k", strings.Repeat("x", 10)); r.status != 201 || a.runs.Load() != 1 {
		t.Fatalf("body at the limit: %d", r.status)
	}
}

// TestOuterBodyLimitIsTooLarge: a body cut off by an http.MaxBytesReader
// around the middleware is too large, finally (a 413 that says not to
// retry), not unreadable (a 400 that says to retry the same body).
func TestOuterBodyLimitIsTooLarge(t *testing.T) {
	a := &app{handler: charge}
	mw, err := httpidem.New(httpidem.Config{Engine: newEngine(t, memstore.New())})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(http.MaxBytesHandler(mw.Wrap(a), 100))
	t.Cleanup(srv.Close)
	srv.Client().Timeout = time.Minute
	r := send(t, srv, "POST", "/pay", "k", strings.Repeat("x", 1000))
	wantProblem(t, r, 413, httpidem.ProblemRequestTooLarge)
	if r.header.Get("Stripe-Should-Retry") != "false" || a.runs.Load() != 0 {
		t.Errorf("Stripe-Should-Retry %q, %d runs", r.header.Get("Stripe-Should-Retry"), a.runs.Load())
	}
}

func TestCanonicalJSONAndFieldSelection(t *testing.T) {
	a := &app{handler: charge}
	eng := newEngine(t, memstore.New())
	canon := serve(t, httpidem.Config{Engine: eng, CanonicalJSON: true}, a)
	send(t, canon, "POST", "/pay", "k1", `{"amount":100,"currency":"eur"}`)
	if r := send(t, canon, "POST", "/pay", "k1", "{ \"currency\": \"eur\",\n  \"amount\": 1e2 }"); r.header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("reordered JSON was not the same payload: %d %s", r.status, r.body)
	}
	wantProblem(t, send(t, canon, "POST", "/pay", "k1", `{"amount":101,"currency":"eur"}`), 422, httpidem.ProblemPayloadMismatch)

	excl := serve(t, httpidem.Config{Engine: eng, ExcludeFields: []string{"client_ts", "meta.trace"}}, a)
	send(t, excl, "POST", "/pay", "k2", `{"amount":100,"client_ts":1,"meta":{"trace":"a","order":7}}`)
	if r := send(t, excl, "POST", "/pay", "k2", `{"amount":100,"client_ts":2,"meta":{"trace":"b","order":7}}`); r.header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("excluded fields counted: %d %s", r.status, r.body)
	}
	wantProblem(t, send(t, excl, "POST", "/pay", "k2", `{"amount":100,"client_ts":2,"meta":{"trace":"b","order":8}}`), 422, httpidem.ProblemPayloadMismatch)

	incl := serve(t, httpidem.Config{Engine: eng, IncludeFields: []string{"amount"}}, a)
	send(t, incl, "POST", "/pay", "k3", `{"amount":100,"note":"a"}`)
	if r := send(t, incl, "POST", "/pay", "k3", `{"note":"b","amount":100}`); r.header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("only included fields should count: %d", r.status)
	}
	if a.runs.Load() != 3 {
		t.Fatalf("ran %d times, want 3", a.runs.Load())
	}
}

func TestHeaderAllowlist(t *testing.T) {
	a := &app{handler: charge}
	srv := serve(t, httpidem.Config{Engine: newEngine(t, memstore.New()), StoreHeaders: []string{"content-type"}}, a)
	send(t, srv, "POST", "/pay", "k", "x")
	r := send(t, srv, "POST", "/pay", "k", "x")
	if r.header.Get("Content-Type") != "application/json" || r.header.Get("X-Trace") != "" {
		t.Fatalf("allowlist replay headers = %v", r.header)
	}
}

// TestClientDisconnectDoesNotCancel: the client gives up mid-request; the
// handler carries on with a live context, and the retry gets the replay.
func TestClientDisconnectDoesNotCancel(t *testing.T) {
	forEachStore(t, func(t *testing.T, store idem.Store) {
		g := newGate()
		ctxErr := make(chan error, 1)
		a := &app{handler: func(w http.ResponseWriter, r *http.Request) {
			g.started <- struct{}{}
			select {
			case <-g.release:
			case <-time.After(time.Minute):
			}
			ctxErr <- r.Context().Err()
			w.WriteHeader(201)
			io.WriteString(w, "charged")
		}}
		srv := serve(t, httpidem.Config{Engine: newEngine(t, store), Wait: time.Minute}, a)
		ctx, cancel := context.WithCancel(context.Background())
		req, _ := http.NewRequestWithContext(ctx, "POST", srv.URL+"/pay", strings.NewReader("x"))
		req.Header.Set("Idempotency-Key", "k")
		gone := make(chan error)
		go func() {
			_, err := srv.Client().Do(req)
			gone <- err
		}()
		wait.Recv(t, g.started, 10*time.Second, "the handler to start")
		cancel()
		if err := wait.Recv(t, gone, 10*time.Second, "the client to give up"); err == nil {
			t.Fatal("the client's request did not fail")
		}
		close(g.release)
		if err := wait.Recv(t, ctxErr, 10*time.Second, "the handler to finish"); err != nil {
			t.Fatalf("handler context ended with the client: %v", err)
		}
		if r := send(t, srv, "POST", "/pay", "k", "x"); r.status != 201 || r.body != "charged" || a.runs.Load() != 1 {
			t.Fatalf("retry: %d %q, runs %d", r.status, r.body, a.runs.Load())
		}
	})
}

// renewBlocker fails every renewal: the store is unreachable for the owner.
type renewBlocker struct{ idem.Store }

func (renewBlocker) Renew(context.Context, store.RenewParams) error {
	return fmt.Errorf("timeout: %w", idem.ErrUnavailable)
}

// TestLostLeaseNeverOverwritesNewerOwner: the first owner cannot renew, its
// lease runs out, a retry takes over (takeover-safe route) and completes;
// the first owner's late outcome is refused, and replays show the newer one.
func TestLostLeaseNeverOverwritesNewerOwner(t *testing.T) {
	forEachStore(t, func(t *testing.T, store idem.Store) {
		eng, err := idem.New(idem.Config{Store: renewBlocker{store}, Lease: 300 * time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		firstCancelled := make(chan struct{})
		secondDone := make(chan struct{})
		var calls atomic.Int64
		h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if calls.Add(1) == 1 {
				select {
				case <-r.Context().Done(): // the lease is lost: the middleware cancels us
				case <-time.After(time.Minute):
					t.Error("the first owner's context was never cancelled")
					return
				}
				if !strings.Contains(context.Cause(r.Context()).Error(), "lease lost") {
					t.Errorf("cause = %v", context.Cause(r.Context()))
				}
				close(firstCancelled)
				select {
				case <-secondDone:
				case <-time.After(time.Minute):
				}
				io.WriteString(w, "stale first owner")
				return
			}
			io.WriteString(w, "second owner")
		})
		srv := serve(t, httpidem.Config{Engine: eng, TakeoverSafe: true}, h)
		first := make(chan reply)
		go func() { first <- send(t, srv, "POST", "/pay", "k", "x") }()
		wait.Recv(t, firstCancelled, 10*time.Second, "the first owner's context to be cancelled")
		if r := send(t, srv, "POST", "/pay", "k", "x"); r.body != "second owner" {
			t.Fatalf("takeover got %d %q", r.status, r.body)
		}
		close(secondDone)
		wait.Recv(t, first, 10*time.Second, "the stale first owner's answer")
		for range 3 {
			if r := send(t, srv, "POST", "/pay", "k", "x"); r.body != "second owner" || r.header.Get("Idempotent-Replayed") != "true" {
				t.Fatalf("replay after the stale owner finished: %q", r.body)
			}
		}
	})
}

func TestManyConcurrentDuplicatesRunOnce(t *testing.T) {
	forEachStore(t, func(t *testing.T, store idem.Store) {
		a := &app{handler: charge}
		srv := serve(t, httpidem.Config{Engine: newEngine(t, store)}, a)
		srv.Client().Transport.(*http.Transport).MaxIdleConnsPerHost = 200
		var wg sync.WaitGroup
		start := make(chan struct{})
		replies := make([]reply, 200)
		for i := range replies {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				replies[i] = send(t, srv, "POST", "/pay", "hot", "x")
			}()
		}
		close(start)
		wait.Done(t, 60*time.Second, "200 concurrent duplicates to be answered", wg.Wait)
		var body string
		for _, r := range replies {
			switch {
			case r.status == 201 && (body == "" || r.body == body):
				body = r.body
			case r.status == 409 && r.problem.Type == httpidem.ProblemInProgress:
			default:
				t.Fatalf("unexpected reply %d %q", r.status, r.body)
			}
		}
		if a.runs.Load() != 1 {
			t.Fatalf("200 duplicates ran the handler %d times", a.runs.Load())
		}
	})
}

func TestNewValidates(t *testing.T) {
	if _, err := httpidem.New(httpidem.Config{}); err == nil {
		t.Fatal("New without an engine succeeded")
	}
	if _, err := httpidem.New(httpidem.Config{Engine: newEngine(t, memstore.New()), MaxRequestBody: -1}); err == nil {
		t.Fatal("New with a negative body limit succeeded")
	}
}

// TestHijackedResponseIsNotReplayable: a handler that takes over the
// connection delivers its answer once; a retry is told it cannot be replayed.
func TestHijackedResponseIsNotReplayable(t *testing.T) {
	a := &app{handler: func(w http.ResponseWriter, r *http.Request) {
		conn, buf, err := http.NewResponseController(w).Hijack()
		if err != nil {
			t.Errorf("hijack: %v", err)
			return
		}
		defer conn.Close()
		buf.WriteString("HTTP/1.1 200 OK\r\nContent-Length: 3\r\nConnection: close\r\n\r\nraw")
		buf.Flush()
	}}
	eng := newEngine(t, memstore.New())
	srv := serve(t, httpidem.Config{Engine: eng}, a)
	if r := send(t, srv, "POST", "/socket", "k", "x"); r.status != 200 || r.body != "raw" {
		t.Fatalf("hijacked answer: %d %q", r.status, r.body)
	}
	// The client had its answer before the middleware stored the outcome
	// (the handler wrote to the connection itself): wait for that.
	wait.Until(t, 5*time.Second, "the hijacked request's outcome to be stored", func() bool {
		r, err := eng.Get(context.Background(), "", "k")
		return err == nil && r.State == idem.StateCompleted
	})
	wantProblem(t, send(t, srv, "POST", "/socket", "k", "x"), 409, httpidem.ProblemNotReplayable)
	if a.runs.Load() != 1 {
		t.Fatalf("ran %d times", a.runs.Load())
	}
}

func TestObserve(t *testing.T) {
	var mu sync.Mutex
	var seen []string
	a := &app{handler: charge}
	srv := serve(t, httpidem.Config{Engine: newEngine(t, memstore.New()), RequireKey: true, Observe: func(r *http.Request, what string) {
		mu.Lock()
		seen = append(seen, what)
		mu.Unlock()
	}}, a)
	send(t, srv, "POST", "/pay", "k", "x")
	send(t, srv, "POST", "/pay", "k", "x")
	send(t, srv, "POST", "/pay", "k", "y")
	send(t, srv, "POST", "/pay", "", "x")
	send(t, srv, "POST", "/pay", `"bad`, "x")
	send(t, srv, "GET", "/pay", "", "")
	want := []string{httpidem.ObservedExecuted, httpidem.ObservedReplayed, httpidem.ObservedMismatch, httpidem.ObservedKeyMissing, httpidem.ObservedKeyInvalid}
	mu.Lock()
	defer mu.Unlock()
	if !reflect.DeepEqual(seen, want) {
		t.Fatalf("observed %v, want %v (GET is not covered)", seen, want)
	}
}

// TestStoreBodyLimitCapsWhatIsKept: behind a store that keeps at most 10
// bytes of body, a larger answer is delivered once and not replayed.
func TestStoreBodyLimitCapsWhatIsKept(t *testing.T) {
	a := &app{handler: func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "twenty bytes of body") }}
	srv := serve(t, httpidem.Config{Engine: newEngine(t, memstore.NewLimited(10))}, a)
	if r := send(t, srv, "POST", "/pay", "k", "x"); r.body != "twenty bytes of body" {
		t.Fatalf("first answer %q", r.body)
	}
	wantProblem(t, send(t, srv, "POST", "/pay", "k", "x"), 409, httpidem.ProblemNotReplayable)
}

// TestProblemsSpeakStripe: every problem says whether to retry
// (Stripe-Should-Retry) and carries an "error" member. A final one's is a
// Stripe-style object, so that Stripe's SDKs raise a typed error instead of
// retrying. One worth retrying has its code alone, a string (with the
// message in "error_description", as an OAuth error): stripe-go cannot
// decode it into its error and retries it, and stripe-node, which went by
// Stripe-Should-Retry and raises only on an answer with an "error" member,
// raises it when its retries run out (it resolved the call with the problem
// as if it were the object asked for). Either form decodes back into a
// Problem.
func TestProblemsSpeakStripe(t *testing.T) {
	final := map[string]string{
		httpidem.ProblemKeyMissing:        "invalid_request_error",
		httpidem.ProblemKeyInvalid:        "invalid_request_error",
		httpidem.ProblemRequestTooLarge:   "invalid_request_error",
		httpidem.ProblemPayloadMismatch:   "idempotency_error",
		httpidem.ProblemUncertain:         "idempotency_error",
		httpidem.ProblemNotReplayable:     "idempotency_error",
		httpidem.ProblemIdempotencyFailed: "api_error",
		httpidem.ProblemUpstreamUncertain: "api_error",
	}
	retry := []string{httpidem.ProblemInProgress, httpidem.ProblemStoreUnavailable, httpidem.ProblemUpstreamFailed, httpidem.ProblemRequestUnreadable, httpidem.ProblemNotRun}
	snake := regexp.MustCompile(`^[a-z]+(_[a-z]+)+$`)
	codes := map[string]string{} // code: the type it names
	for _, typ := range append(retry, slices.Collect(maps.Keys(final))...) {
		w := httptest.NewRecorder()
		(&httpidem.Problem{Type: typ, Title: "t", Status: 409, Detail: "d"}).Write(w)
		var body struct {
			Type             string
			Error            json.RawMessage
			ErrorDescription string `json:"error_description"`
		}
		if err := json.Unmarshal(w.Body.Bytes(), &body); err != nil || body.Type != typ {
			t.Fatalf("%s: body %q, %v", typ, w.Body, err)
		}
		want, isFinal := final[typ]
		if got := w.Header().Get(httpidem.HeaderShouldRetry); got != strconv.FormatBool(!isFinal) {
			t.Errorf("%s: Stripe-Should-Retry %q", typ, got)
		}
		var code string
		if isFinal {
			var e struct {
				Type, Code, Message string
				DocURL              string `json:"doc_url"`
			}
			if err := json.Unmarshal(body.Error, &e); err != nil || e.Type != want || e.Code == "" || e.Message != "t: d" || e.DocURL != typ {
				t.Errorf("%s: error member %s (%v), want an object of type %s with a code, the message and the doc URL", typ, body.Error, err, want)
			}
			if body.ErrorDescription != "" {
				t.Errorf("%s: a final problem has an error_description %q", typ, body.ErrorDescription)
			}
			code = e.Code
		} else {
			if err := json.Unmarshal(body.Error, &code); err != nil {
				t.Errorf("%s: error member %s; a problem worth retrying must have a string (stripe-node raises it, stripe-go retries it): %v", typ, body.Error, err)
			}
			if body.ErrorDescription != "t: d" {
				t.Errorf("%s: error_description %q, want the message", typ, body.ErrorDescription)
			}
		}
		if !snake.MatchString(code) || codes[code] != "" {
			t.Errorf("%s: code %q; want snake_case, one per type (%q has it)", typ, code, codes[code])
		}
		codes[code] = typ
		var p httpidem.Problem
		if err := json.Unmarshal(w.Body.Bytes(), &p); err != nil || p.Type != typ || p.Error == nil || p.Error.Code != code {
			t.Errorf("%s: decoded back into a Problem: %+v, %v", typ, p, err)
		}
	}
	// A handler's own type says nothing of a retry: its 400 was marked
	// worth retrying, and idemclient retried it until it gave up.
	w := httptest.NewRecorder()
	(&httpidem.Problem{Type: "https://api.example.com/problems#invalid-charge", Title: "Invalid charge", Status: 400}).Write(w)
	if got, ok := w.Header()[httpidem.HeaderShouldRetry]; ok {
		t.Errorf("a handler's own problem type: Stripe-Should-Retry %q; want none", got)
	}
}

// TestIgnoredKeyIsSaid: a key on a request whose method is not covered is
// not honoured, and the answer says so.
func TestIgnoredKeyIsSaid(t *testing.T) {
	a := &app{handler: charge}
	srv := serve(t, httpidem.Config{Engine: newEngine(t, memstore.New()), Methods: []string{"POST"}}, a)
	r := send(t, srv, "DELETE", "/pay", "k", "")
	if r.status != 201 || !strings.Contains(r.header.Get(httpidem.HeaderIgnored), "DELETE is not covered") {
		t.Fatalf("a keyed DELETE on a POST-only route: %d, %s %q", r.status, httpidem.HeaderIgnored, r.header.Get(httpidem.HeaderIgnored))
	}
	if r := send(t, srv, "DELETE", "/pay", "", ""); r.header.Get(httpidem.HeaderIgnored) != "" {
		t.Fatal("a request without a key was told its key was ignored")
	}
}

// TestUnsafeMethodsCoveredByDefault: POST, PUT, PATCH and DELETE carry keys
// (Stripe's SDKs send one on each); all four are covered by default.
func TestUnsafeMethodsCoveredByDefault(t *testing.T) {
	a := &app{handler: charge}
	srv := serve(t, httpidem.Config{Engine: newEngine(t, memstore.New())}, a)
	for _, m := range []string{"POST", "PUT", "PATCH", "DELETE"} {
		first := send(t, srv, m, "/pay", "k-"+m, "")
		again := send(t, srv, m, "/pay", "k-"+m, "")
		if again.body != first.body || again.header.Get("Idempotent-Replayed") != "true" {
			t.Errorf("%s: the retry got %q (replayed %q), want the replay of %q", m, again.body, again.header.Get("Idempotent-Replayed"), first.body)
		}
	}
	if a.runs.Load() != 4 {
		t.Fatalf("ran %d times, want 4", a.runs.Load())
	}
}

// TestIgnoredSurvivesInformationalResponses: Idempotent-Ignored reaches the
// final answer when the handler sends a 1xx first. A reverse proxy in
// front of an upstream that answers 103 Early Hints (or 100 Continue)
// clears the headers after passing the 1xx on, which took the header away:
// the key was ignored silently, and a client retrying a lost answer ran
// the request twice.
func TestIgnoredSurvivesInformationalResponses(t *testing.T) {
	upstream := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Link", "</style.css>; rel=preload")
		w.WriteHeader(http.StatusEarlyHints)
		w.Header().Del("Link")
		w.WriteHeader(http.StatusCreated)
	}))
	t.Cleanup(upstream.Close)
	target, _ := url.Parse(upstream.URL)
	forward := httputil.NewSingleHostReverseProxy(target)
	down, err := idem.New(idem.Config{Store: downStore{memstore.New()}, StoreTimeout: 200 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	for name, srv := range map[string]*httptest.Server{
		"a method not covered": serve(t, httpidem.Config{Engine: newEngine(t, memstore.New()), Methods: []string{"POST"}}, forward),
		"fail_open":            serve(t, httpidem.Config{Engine: down, FailOpen: true}, forward),
	} {
		method := "POST"
		if name == "a method not covered" {
			method = "PUT"
		}
		r := send(t, srv, method, "/pay", "k", "x")
		if r.status != http.StatusCreated || r.header.Get(httpidem.HeaderIgnored) == "" {
			t.Errorf("%s: %d, %s %q; want the upstream's 201 saying the key was ignored", name, r.status, httpidem.HeaderIgnored, r.header.Get(httpidem.HeaderIgnored))
		}
	}
}

// TestIgnoredKeepsTheWritersInterfaces: the writer of an answer whose key
// is not honoured is still an http.Hijacker (a WebSocket upgrader checks
// for one): wrapping it to set Idempotent-Ignored hid it, and the upgrade
// failed.
func TestIgnoredKeepsTheWritersInterfaces(t *testing.T) {
	srv := serve(t, httpidem.Config{Engine: newEngine(t, memstore.New())}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if _, ok := w.(http.Hijacker); !ok {
			http.Error(w, "no Hijacker", http.StatusInternalServerError)
			return
		}
		if _, ok := w.(io.ReaderFrom); !ok {
			http.Error(w, "no ReaderFrom", http.StatusInternalServerError)
			return
		}
		w.WriteHeader(http.StatusNoContent)
	}))
	if r := send(t, srv, "GET", "/ws", "k", ""); r.status != http.StatusNoContent || r.header.Get(httpidem.HeaderIgnored) == "" {
		t.Fatalf("%d %s; want 204 from a handler that found the writer's interfaces, saying the key was ignored", r.status, r.body)
	}
}

// cancelOnAcquire cancels the request's context (the cancel func withCancel
// sends it) once the store has acquired the record: the request's deadline
// passes while its acquire is under way.
type cancelOnAcquire struct {
	idem.Store
	cancel chan context.CancelFunc
}

func (s *cancelOnAcquire) Acquire(ctx context.Context, p store.AcquireParams) (idem.Record, error) {
	r, err := s.Store.Acquire(ctx, p)
	select {
	case cancel := <-s.cancel:
		cancel()
	default:
	}
	return r, err
}

// withCancel is an outer middleware that ends a request's context as a
// per-request deadline would: at once when it carries "X-Test-Cancel: now",
// and when the test calls the cancel func sent to cancels when it carries
// "X-Test-Cancel: later".
func withCancel(h http.Handler, cancels chan<- context.CancelFunc) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx, cancel := context.WithCancel(r.Context())
		defer cancel()
		switch r.Header.Get("X-Test-Cancel") {
		case "now":
			cancel()
		case "later":
			cancels <- cancel
		}
		h.ServeHTTP(w, r.WithContext(ctx))
	})
}

// TestDuplicateWhoseWaitEndsWithItsContextIsToldToRetry: a duplicate waits
// for the first, which still runs; an outer middleware's per-request
// deadline ends the duplicate's context during the wait. The client, still
// connected, gets 409 in-progress with Retry-After and Stripe-Should-Retry:
// true, and its retry after the first finished gets the replay. (The
// middleware returned without writing: net/http answered 200 OK with an
// empty body for work that did not run.)
func TestDuplicateWhoseWaitEndsWithItsContextIsToldToRetry(t *testing.T) {
	g := newGate()
	a := &app{handler: g.ServeHTTP}
	eng := newEngine(t, memstore.New())
	mw, err := httpidem.New(httpidem.Config{Engine: eng, Wait: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	cancels := make(chan context.CancelFunc, 1)
	srv := httptest.NewServer(withCancel(mw.Wrap(a), cancels))
	t.Cleanup(srv.Close)
	srv.Client().Timeout = time.Minute
	release := sync.OnceFunc(func() { close(g.release) })
	var sending sync.WaitGroup
	t.Cleanup(func() { release(); sending.Wait() }) // before srv.Close, however the test ends
	first, second := make(chan reply, 1), make(chan reply, 1)
	sending.Go(func() { first <- send(t, srv, "POST", "/pay", "k", "x") })
	wait.Recv(t, g.started, 10*time.Second, "the handler to start")
	sending.Go(func() { second <- send(t, srv, "POST", "/pay", "k", "x", "X-Test-Cancel", "later") })
	cancel := wait.Recv(t, cancels, 10*time.Second, "the duplicate to arrive")
	wait.Until(t, 10*time.Second, "the duplicate to wait for the first", func() bool { return eng.Waiting("", "k") == 1 })
	cancel()
	r := wait.Recv(t, second, 10*time.Second, "the duplicate's answer")
	wantProblem(t, r, http.StatusConflict, httpidem.ProblemInProgress)
	if r.header.Get("Retry-After") == "" || r.header.Get(httpidem.HeaderShouldRetry) != "true" {
		t.Fatalf("Retry-After %q, %s %q; want a retry asked for", r.header.Get("Retry-After"), httpidem.HeaderShouldRetry, r.header.Get(httpidem.HeaderShouldRetry))
	}
	release()
	if f := wait.Recv(t, first, 10*time.Second, "the first's answer"); f.status != 201 {
		t.Fatalf("first = %d", f.status)
	}
	if r := send(t, srv, "POST", "/pay", "k", "x"); r.status != 201 || r.header.Get("Idempotent-Replayed") != "true" || a.runs.Load() != 1 {
		t.Fatalf("retry: %d replayed=%q, runs %d", r.status, r.header.Get("Idempotent-Replayed"), a.runs.Load())
	}
}

// TestRequestWhoseContextEndedBeforeItRanIsToldToRetry: a request's context
// ends (an outer middleware's per-request deadline) before the handler runs:
// once before the key is looked up, once while the store acquires it. The
// client, still connected, gets 503 not-run with Retry-After and
// Stripe-Should-Retry: true, nothing ran, and its retry with the same key
// runs. (The middleware returned without writing: net/http answered 200 OK
// with an empty body.)
func TestRequestWhoseContextEndedBeforeItRanIsToldToRetry(t *testing.T) {
	a := &app{handler: charge}
	st := &cancelOnAcquire{Store: memstore.New(), cancel: make(chan context.CancelFunc, 1)}
	mw, err := httpidem.New(httpidem.Config{Engine: newEngine(t, st)})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(withCancel(mw.Wrap(a), st.cancel))
	t.Cleanup(srv.Close)
	srv.Client().Timeout = time.Minute
	for _, when := range []string{"now", "later"} { // before the lookup; during the acquire
		key := "k-" + when
		r := send(t, srv, "POST", "/pay", key, "x", "X-Test-Cancel", when)
		wantProblem(t, r, http.StatusServiceUnavailable, httpidem.ProblemNotRun)
		if r.header.Get("Retry-After") == "" || r.header.Get(httpidem.HeaderShouldRetry) != "true" || a.runs.Load() != 0 {
			t.Fatalf("%s: Retry-After %q, %s %q, runs %d; want a retry asked for, nothing run", when,
				r.header.Get("Retry-After"), httpidem.HeaderShouldRetry, r.header.Get(httpidem.HeaderShouldRetry), a.runs.Load())
		}
		if r := send(t, srv, "POST", "/pay", key, "x"); r.status != 201 || a.runs.Load() != 1 {
			t.Fatalf("%s: retry %d, runs %d; want it run", when, r.status, a.runs.Load())
		}
		a.runs.Store(0)
	}
}

// TestEscapedSlashIsAnotherPath: /charges/a%2Fb/refund and
// /charges/a/b/refund are two routes for Go 1.22's ServeMux ({id} is "a/b"
// in the first); the same key sent to the second after the first gets 422,
// not the first's replay. (Both were fingerprinted by the decoded path.)
func TestEscapedSlashIsAnotherPath(t *testing.T) {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /charges/{id}/refund", func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, "refunded charge "+r.PathValue("id"))
	})
	mux.HandleFunc("POST /charges/{acct}/{id}/refund", func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, "refunded charge "+r.PathValue("id")+" of account "+r.PathValue("acct"))
	})
	srv := serve(t, httpidem.Config{Engine: newEngine(t, memstore.New())}, mux)
	if r := send(t, srv, "POST", "/charges/a%2Fb/refund", "k", "x"); r.body != "refunded charge a/b" {
		t.Fatalf("first: %d %q", r.status, r.body)
	}
	r := send(t, srv, "POST", "/charges/a/b/refund", "k", "x")
	wantProblem(t, r, http.StatusUnprocessableEntity, httpidem.ProblemPayloadMismatch)
	if !reflect.DeepEqual(r.problem.Differs, []string{"path"}) {
		t.Fatalf("differs = %v, want [path]", r.problem.Differs)
	}
	// A literal "%2F" in a segment (sent as %252F) is a third route.
	wantProblem(t, send(t, srv, "POST", "/charges/a%252Fb/refund", "k", "x"), http.StatusUnprocessableEntity, httpidem.ProblemPayloadMismatch)
	if r := send(t, srv, "POST", "/charges/a%2fb/refund", "k2", "x"); r.body != "refunded charge a/b" {
		t.Fatalf("lower-case escape: %d %q", r.status, r.body)
	}
	if r := send(t, srv, "POST", "/charges/a%2fb/refund", "k2", "x"); r.header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("retry of an escaped-slash path: %d %q, want the replay", r.status, r.body)
	}
}

// TestCaseFoldedMembersInAnotherOrderAreAnotherPayload: with CanonicalJSON,
// {"amount":100,"AMOUNT":5000} is charged 5000 by a Go handler (encoding/json
// binds both names to the field, the last wins); the same key then sent with
// {"AMOUNT":5000,"amount":100}, which the handler reads as 100, gets 422,
// not the replay of the charge of 5000, and so does a body that repeats a
// member; a retry with the first's bytes gets the replay. Such a body is
// hashed as sent. (Sorting the members made the two one canonical text.)
func TestCaseFoldedMembersInAnotherOrderAreAnotherPayload(t *testing.T) {
	a := &app{handler: chargeAmount}
	srv := serve(t, httpidem.Config{Engine: newEngine(t, memstore.New()), CanonicalJSON: true}, a)
	first := `{"amount":100,"AMOUNT":5000}`
	if r := send(t, srv, "POST", "/pay", "k", first); r.body != "charged 5000 " {
		t.Fatalf("first: %d %q", r.status, r.body)
	}
	for _, other := range []string{`{"AMOUNT":5000,"amount":100}`, `{"amount":100,"AMOUNT":5000,"amount":100}`} {
		wantProblem(t, send(t, srv, "POST", "/pay", "k", other), http.StatusUnprocessableEntity, httpidem.ProblemPayloadMismatch)
	}
	if r := send(t, srv, "POST", "/pay", "k", first); r.header.Get("Idempotent-Replayed") != "true" || r.body != "charged 5000 " {
		t.Fatalf("a retry with the same bytes: %d %q, want the replay", r.status, r.body)
	}
	if a.runs.Load() != 1 {
		t.Fatalf("ran %d times", a.runs.Load())
	}
}

// TestRepeatedMembersAreAnotherPayload: with CanonicalJSON, or with
// IncludeFields [card.number], {"card":{"number":"4242"},"card":{}} is
// charged to card 4242 by a Go handler (encoding/json decodes both members
// into the field, the second leaving the number of the first); the same key
// then sent with {"card":{"number":"1111"},"card":{}}, which the handler
// charges to card 1111, gets 422, not the replay of the charge to 4242; a
// retry with the first's bytes gets the replay. (A decoded map kept only
// the last "card", {}: both bodies had one fingerprint.)
func TestRepeatedMembersAreAnotherPayload(t *testing.T) {
	for name, cfg := range map[string]httpidem.Config{
		"canonical JSON": {CanonicalJSON: true},
		"fields":         {IncludeFields: []string{"amount", "card.number"}},
	} {
		t.Run(name, func(t *testing.T) {
			a := &app{handler: chargeAmount}
			cfg.Engine = newEngine(t, memstore.New())
			srv := serve(t, cfg, a)
			first := `{"card":{"number":"4242"},"card":{}}`
			if r := send(t, srv, "POST", "/pay", "k", first); r.body != "charged 0 4242" {
				t.Fatalf("first: %d %q", r.status, r.body)
			}
			wantProblem(t, send(t, srv, "POST", "/pay", "k", `{"card":{"number":"1111"},"card":{}}`), http.StatusUnprocessableEntity, httpidem.ProblemPayloadMismatch)
			if r := send(t, srv, "POST", "/pay", "k", first); r.header.Get("Idempotent-Replayed") != "true" || r.body != "charged 0 4242" {
				t.Fatalf("a retry with the same bytes: %d %q, want the replay", r.status, r.body)
			}
			if a.runs.Load() != 1 {
				t.Fatalf("ran %d times", a.runs.Load())
			}
		})
	}
}

// chargeAmount charges what encoding/json reads from the body.
func chargeAmount(w http.ResponseWriter, r *http.Request) {
	var in struct {
		Amount   int    `json:"amount"`
		Currency string `json:"currency"`
		Card     struct {
			Number string `json:"number"`
		} `json:"card"`
	}
	if err := json.NewDecoder(r.Body).Decode(&in); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	fmt.Fprintf(w, "charged %d %s%s", in.Amount, in.Currency, in.Card.Number)
}

// TestIncludeFieldsMatchNamesAsEncodingJSONDoes: IncludeFields [amount,
// currency, card.number] and a client that writes PascalCase, which
// encoding/json binds to those fields: the same key sent with another
// amount, currency or card number gets 422, not the replay of the first
// charge. (The names were matched exactly: both bodies fingerprinted as
// {}.)
func TestIncludeFieldsMatchNamesAsEncodingJSONDoes(t *testing.T) {
	a := &app{handler: chargeAmount}
	srv := serve(t, httpidem.Config{Engine: newEngine(t, memstore.New()), IncludeFields: []string{"amount", "currency", "card.number"}}, a)
	first := `{"Amount":100,"Currency":"usd","Card":{"Number":"4242"},"Note":"a"}`
	if r := send(t, srv, "POST", "/pay", "k", first); r.body != "charged 100 usd4242" {
		t.Fatalf("first: %d %q", r.status, r.body)
	}
	for _, other := range []string{
		`{"Amount":5000,"Currency":"usd","Card":{"Number":"4242"}}`,
		`{"Amount":100,"currency":"eur","Card":{"Number":"4242"}}`,
		`{"Amount":100,"Currency":"usd","CARD":{"NUMBER":"1111"}}`,
		`{"Amount":100,"amount":5000,"Currency":"usd","Card":{"Number":"4242"}}`,
	} {
		wantProblem(t, send(t, srv, "POST", "/pay", "k", other), http.StatusUnprocessableEntity, httpidem.ProblemPayloadMismatch)
	}
	if r := send(t, srv, "POST", "/pay", "k", `{"Currency":"usd","Note":"b","Card":{"Number":"4242","Exp":"1"},"Amount":100}`); r.header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("only the included fields count: %d %q, want the replay", r.status, r.body)
	}
	if a.runs.Load() != 1 {
		t.Fatalf("ran %d times", a.runs.Load())
	}
}

// TestDeclaredTrailerIsReplayedAsTrailer: a handler declares a trailer
// (Trailer: X-Checksum) and sets it after the body. The first client and
// the replay both get it as a trailer, not as a header. (Trailer was never
// stored: the replay sent X-Checksum as a header, and no trailer.)
func TestDeclaredTrailerIsReplayedAsTrailer(t *testing.T) {
	a := &app{handler: func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Trailer", "X-Checksum")
		w.WriteHeader(http.StatusCreated)
		io.WriteString(w, "body")
		w.Header().Set("X-Checksum", "abc")
	}}
	srv := serve(t, httpidem.Config{Engine: newEngine(t, memstore.New())}, a)
	for _, which := range []string{"first", "replay"} {
		req, _ := http.NewRequest("POST", srv.URL+"/pay", strings.NewReader("x"))
		req.Header.Set("Idempotency-Key", "k")
		resp, err := srv.Client().Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 201 || string(body) != "body" || resp.Trailer.Get("X-Checksum") != "abc" || resp.Header.Get("X-Checksum") != "" {
			t.Fatalf("%s: %d %q, trailer %v, header X-Checksum %q; want the trailer, not a header", which, resp.StatusCode, body, resp.Trailer, resp.Header.Get("X-Checksum"))
		}
	}
	if a.runs.Load() != 1 {
		t.Fatalf("ran %d times", a.runs.Load())
	}
}

// TestStreamedTrailersReachTheClient: a streaming handler keeps its header
// map (net/http gives one map for the whole response), flushes, and sets
// its trailers in that map once the body is written, one declared and one
// under http.TrailerPrefix. The client gets both, as without the
// middleware. (After a flush the handler's map was a dead copy: they were
// lost.)
func TestStreamedTrailersReachTheClient(t *testing.T) {
	handler := func(w http.ResponseWriter, r *http.Request) {
		h := w.Header()
		h.Set("Trailer", "X-Checksum")
		w.WriteHeader(http.StatusOK)
		io.WriteString(w, "part1")
		http.NewResponseController(w).Flush()
		io.WriteString(w, "part2")
		h.Set("X-Checksum", "abc123")
		h.Set(http.TrailerPrefix+"X-Rows", "2")
	}
	mw, err := httpidem.New(httpidem.Config{Engine: newEngine(t, memstore.New())})
	if err != nil {
		t.Fatal(err)
	}
	for _, which := range []struct {
		name string
		h    http.Handler
	}{{"without the middleware", http.HandlerFunc(handler)}, {"with it", mw.Wrap(http.HandlerFunc(handler))}} {
		srv := httptest.NewServer(which.h)
		srv.Client().Timeout = time.Minute
		req, _ := http.NewRequest("POST", srv.URL, strings.NewReader("x"))
		req.Header.Set("Idempotency-Key", "k")
		resp, err := srv.Client().Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		srv.Close()
		if string(body) != "part1part2" || resp.Trailer.Get("X-Checksum") != "abc123" || resp.Trailer.Get("X-Rows") != "2" {
			t.Errorf("%s: %q, trailers %v", which.name, body, resp.Trailer)
		}
	}
}

// TestEarlyHintsCarryTheHandlersHeaders: a handler sets a Link header and
// sends 103 Early Hints, then its answer. The 103 carries the Link, as
// net/http sends a 1xx with the header map as it is then. (It went out with
// the writer's headers, without the Link the handler had put in the
// capture's.)
func TestEarlyHintsCarryTheHandlersHeaders(t *testing.T) {
	a := &app{handler: func(w http.ResponseWriter, r *http.Request) {
		w.Header().Add("Link", "</style.css>; rel=preload; as=style")
		w.WriteHeader(http.StatusEarlyHints)
		w.Header().Del("Link")
		w.WriteHeader(http.StatusCreated)
	}}
	srv := serve(t, httpidem.Config{Engine: newEngine(t, memstore.New())}, a)
	var hints []http.Header
	req, _ := http.NewRequest("POST", srv.URL+"/pay", strings.NewReader("x"))
	req.Header.Set("Idempotency-Key", "k")
	req = req.WithContext(httptrace.WithClientTrace(req.Context(), &httptrace.ClientTrace{Got1xxResponse: func(code int, h textproto.MIMEHeader) error {
		hints = append(hints, http.Header(h).Clone())
		return nil
	}}))
	resp, err := srv.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if len(hints) != 1 || hints[0].Get("Link") != "</style.css>; rel=preload; as=style" {
		t.Fatalf("1xx answers %v; want one carrying the handler's Link", hints)
	}
	if resp.StatusCode != 201 || resp.Header.Get("Link") != "" {
		t.Fatalf("final answer %d with Link %q; want 201 without the Link the handler removed", resp.StatusCode, resp.Header.Get("Link"))
	}
}

// heldAcquire holds every Acquire until gate closes, and says when the
// first one has reached it.
type heldAcquire struct {
	idem.Store
	reached chan struct{}
	once    sync.Once
	gate    chan struct{}
}

func (s *heldAcquire) Acquire(ctx context.Context, p store.AcquireParams) (idem.Record, error) {
	s.once.Do(func() { close(s.reached) })
	<-s.gate
	return s.Store.Acquire(ctx, p)
}

// TestDuplicateJoiningAnAcquireIsToldItRuns: a duplicate that arrived
// while the first request's acquire was on its way to the store, and whose
// own deadline then passed, was told 503 not-run ("no request with its key
// was running") while the first went on to run. It is told 409 in-progress.
func TestDuplicateJoiningAnAcquireIsToldItRuns(t *testing.T) {
	st := &heldAcquire{Store: memstore.New(), reached: make(chan struct{}), gate: make(chan struct{})}
	eng, err := idem.New(idem.Config{Store: st, StoreTimeout: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	var runs atomic.Int64
	mw, err := httpidem.New(httpidem.Config{Engine: eng})
	if err != nil {
		t.Fatal(err)
	}
	h := mw.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		w.WriteHeader(http.StatusCreated)
	}))
	request := func(ctx context.Context) *http.Request {
		r := httptest.NewRequest("POST", "/pay", strings.NewReader(`{"amount":100}`)).WithContext(ctx)
		r.Header.Set("Idempotency-Key", "k")
		return r
	}
	first := make(chan int, 1)
	go func() {
		w := httptest.NewRecorder()
		h.ServeHTTP(w, request(context.Background()))
		first <- w.Code
	}()
	wait.Recv(t, st.reached, 10*time.Second, "the first request's acquire to reach the store")
	deadline, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	w := httptest.NewRecorder()
	h.ServeHTTP(w, request(deadline))
	close(st.gate)
	if code := wait.Recv(t, first, 10*time.Second, "the first request"); code != http.StatusCreated || runs.Load() != 1 {
		t.Fatalf("first request: %d, %d runs; want 201, one run", code, runs.Load())
	}
	if w.Code != http.StatusConflict || !strings.Contains(w.Body.String(), "in-progress") {
		t.Fatalf("duplicate whose deadline passed while the first's acquire was on its way: %d %s; want 409 in-progress", w.Code, w.Body)
	}
}

// TestLargestBodyLimitMeansNone: MaxRequestBody at the largest int64, a
// way to say "no limit", wrapped round when the middleware read one byte
// past it: every body was read as empty, so another payload under the same
// key was replayed the first one's outcome instead of 422.
func TestLargestBodyLimitMeansNone(t *testing.T) {
	a := &app{handler: charge}
	srv := serve(t, httpidem.Config{Engine: newEngine(t, memstore.New()), MaxRequestBody: math.MaxInt64}, a)
	if r := send(t, srv, "POST", "/pay", "k", `{"amount":1000}`); r.status != 201 || !strings.Contains(r.body, `amount`) {
		t.Fatalf("first: %d %s; want 201 and the body seen by the handler", r.status, r.body)
	}
	wantProblem(t, send(t, srv, "POST", "/pay", "k", `{"amount":999999}`), 422, httpidem.ProblemPayloadMismatch)
}

// TestTimeoutHandlerInsideWrapWithExplicitRelease: http.TimeoutHandler
// inside the middleware writes its 503 when its timer fires while the
// handler it wraps goes on (the card is charged). By default a 503 releases
// the key (DESIGN: it means "nothing happened"), so the retry would run the
// charge again; with ExplicitRelease only NothingHappened releases it, and
// the retry gets the stored 503 instead of a second run.
func TestTimeoutHandlerInsideWrapWithExplicitRelease(t *testing.T) {
	eng := newEngine(t, memstore.New())
	var runs atomic.Int64
	release, done := make(chan struct{}), make(chan struct{}, 2)
	inner := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		defer func() { done <- struct{}{} }()
		runs.Add(1)
		select { // the acquirer is slow: the TimeoutHandler's timer fires first
		case <-release:
		case <-time.After(time.Minute):
		}
		io.WriteString(w, `{"charged":true}`)
	})
	srv := serve(t, httpidem.Config{Engine: eng, ExplicitRelease: true, Wait: -1}, http.TimeoutHandler(inner, 20*time.Millisecond, "timed out"))
	first := send(t, srv, "POST", "/charges", "k", `{"amount":100}`)
	retry := send(t, srv, "POST", "/charges", "k", `{"amount":100}`)
	close(release)
	wait.Recv(t, done, 10*time.Second, "the charge to finish")
	if first.status != 503 || retry.status != 503 || retry.header.Get(httpidem.HeaderReplayed) != "true" || runs.Load() != 1 {
		t.Fatalf("first %d, retry %d (replayed %q), %d charges; want the 503 stored and replayed, one charge",
			first.status, retry.status, retry.header.Get(httpidem.HeaderReplayed), runs.Load())
	}
	// NothingHappened still releases the key.
	a := &app{handler: func(w http.ResponseWriter, r *http.Request) {
		httpidem.NothingHappened(r)
		w.WriteHeader(503)
	}}
	srv = serve(t, httpidem.Config{Engine: eng, ExplicitRelease: true}, a)
	send(t, srv, "POST", "/refused", "k2", "x")
	send(t, srv, "POST", "/refused", "k2", "x")
	if a.runs.Load() != 2 {
		t.Fatalf("a declared NothingHappened ran %d times; want the retry to run", a.runs.Load())
	}
}

// TestTimeoutHandlerOutsideWrapRunsOnce: where the package doc puts
// http.TimeoutHandler, outside Wrap, its 503 reaches the client while the
// handler goes on detached; the outcome is stored and the retry replays it.
func TestTimeoutHandlerOutsideWrapRunsOnce(t *testing.T) {
	eng := newEngine(t, memstore.New())
	g := newGate()
	a := &app{handler: g.ServeHTTP}
	mw, err := httpidem.New(httpidem.Config{Engine: eng})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(http.TimeoutHandler(mw.Wrap(a), time.Second, "timed out"))
	t.Cleanup(srv.Close)
	first := make(chan reply, 1)
	go func() { first <- send(t, srv, "POST", "/pay", "k", "x") }()
	wait.Recv(t, g.started, 10*time.Second, "the handler to start")
	if r := wait.Recv(t, first, 10*time.Second, "the TimeoutHandler's answer"); r.status != 503 {
		t.Fatalf("first = %d, want the TimeoutHandler's 503", r.status)
	}
	close(g.release)
	wait.Until(t, 10*time.Second, "the outcome to be stored", func() bool {
		rec, err := eng.Get(context.Background(), "", "k")
		return err == nil && rec.State == idem.StateCompleted
	})
	if r := send(t, srv, "POST", "/pay", "k", "x"); r.status != 201 || r.header.Get(httpidem.HeaderReplayed) != "true" || a.runs.Load() != 1 {
		t.Fatalf("retry %d (replayed %q), ran %d times; want the replay of the one run", r.status, r.header.Get(httpidem.HeaderReplayed), a.runs.Load())
	}
}

// TestTrailerPrefixedSecretsAreNeverStored: a cookie or credential sent as
// a trailer under http.TrailerPrefix is judged by its name, as a header is:
// never stored nor replayed. Another trailer so sent is replayed, and an
// allowlist names it as it names a header.
func TestTrailerPrefixedSecretsAreNeverStored(t *testing.T) {
	for _, allow := range [][]string{nil, {"X-Rows"}} {
		eng := newEngine(t, memstore.New())
		srv := serve(t, httpidem.Config{Engine: eng, StoreHeaders: allow}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			io.WriteString(w, "ok")
			w.Header().Set(http.TrailerPrefix+"Set-Cookie", "session=secret")
			w.Header().Set(http.TrailerPrefix+"authorization", "Bearer sk_live_secret")
			w.Header().Set(http.TrailerPrefix+"X-Rows", "2")
		}))
		for _, which := range []string{"first", "replay"} {
			req, _ := http.NewRequest("POST", srv.URL+"/c", strings.NewReader("{}"))
			req.Header.Set("Idempotency-Key", "k")
			resp, err := srv.Client().Do(req)
			if err != nil {
				t.Fatal(err)
			}
			io.ReadAll(resp.Body)
			resp.Body.Close()
			if got := resp.Trailer.Get("X-Rows"); got != "2" {
				t.Errorf("allow %v, %s: trailer X-Rows %q, want 2", allow, which, got)
			}
			secrets := resp.Trailer.Get("Set-Cookie") + resp.Trailer.Get("Authorization")
			if replayed := resp.Header.Get(httpidem.HeaderReplayed) == "true"; replayed != (which == "replay") || (replayed && secrets != "") {
				t.Errorf("allow %v, %s: replayed %v, trailers %v; a replay carries no cookie or credential", allow, which, replayed, resp.Trailer)
			}
		}
		rec, err := eng.Get(context.Background(), "", "k")
		if err != nil {
			t.Fatal(err)
		}
		for name, v := range rec.Response.Header {
			if strings.Contains(strings.Join(v, ","), "secret") {
				t.Errorf("allow %v: stored header %q = %q: a cookie or credential kept in the record", allow, name, v)
			}
		}
	}
}

// switchStore's Acquire can be made unreachable mid-test.
type switchStore struct {
	idem.Store
	down atomic.Bool
}

func (s *switchStore) Acquire(ctx context.Context, p store.AcquireParams) (idem.Record, error) {
	if s.down.Load() {
		return idem.Record{}, fmt.Errorf("dial tcp: connection refused: %w", idem.ErrUnavailable)
	}
	return s.Store.Acquire(ctx, p)
}

// TestFailOpenNeverRunsADuplicateOfALocalRun: with FailOpen, a duplicate
// that reaches the process running its key while the store cannot be
// reached is not run unprotected: it gets 409 in-progress while the first
// runs (with or without the store's lease), or the first's outcome when it
// finished while the duplicate waited.
func TestFailOpenNeverRunsADuplicateOfALocalRun(t *testing.T) {
	for _, c := range []struct {
		name     string
		wait     time.Duration
		downFrom string // "start": the first itself fails open
	}{{"no wait", -1, ""}, {"no wait, first failed open", -1, "start"}, {"wait", time.Minute, ""}} {
		t.Run(c.name, func(t *testing.T) {
			st := &switchStore{Store: memstore.New()}
			st.down.Store(c.downFrom == "start")
			eng, err := idem.New(idem.Config{Store: st, StoreTimeout: 200 * time.Millisecond, Poll: time.Hour})
			if err != nil {
				t.Fatal(err)
			}
			g := newGate()
			a := &app{handler: g.ServeHTTP}
			srv := serve(t, httpidem.Config{Engine: eng, FailOpen: true, Wait: c.wait}, a)
			first, second := make(chan reply, 1), make(chan reply, 1)
			go func() { first <- send(t, srv, "POST", "/c", "k", "{}") }()
			wait.Recv(t, g.started, 10*time.Second, "the first to run")
			st.down.Store(true)
			go func() { second <- send(t, srv, "POST", "/c", "k", "{}") }()
			var dup reply
			if c.wait > 0 {
				wait.Until(t, 10*time.Second, "the duplicate to wait for the first", func() bool { return eng.Waiting("", "k") == 1 })
				close(g.release)
				dup = wait.Recv(t, second, 10*time.Second, "the duplicate's answer")
				if dup.status != 201 || dup.body != "done" || dup.header.Get(httpidem.HeaderReplayed) != "true" {
					t.Errorf("duplicate that waited: %d %q (replayed %q, ignored %q); want the first's replay",
						dup.status, dup.body, dup.header.Get(httpidem.HeaderReplayed), dup.header.Get(httpidem.HeaderIgnored))
				}
			} else {
				select {
				case dup = <-second:
				case <-g.started: // the duplicate runs too
					close(g.release)
					t.Fatalf("the duplicate ran (fail-open) while the first ran here")
				case <-time.After(10 * time.Second):
					t.Fatalf("waited 10s for the duplicate's answer")
				}
				close(g.release)
				if dup.status != 409 || dup.problem.Type != httpidem.ProblemInProgress {
					t.Errorf("duplicate: %d %q (ignored %q); want 409 in-progress", dup.status, dup.problem.Type, dup.header.Get(httpidem.HeaderIgnored))
				}
			}
			if r := wait.Recv(t, first, 10*time.Second, "the first's answer"); r.status != 201 {
				t.Errorf("first = %d", r.status)
			}
			if a.runs.Load() != 1 {
				t.Fatalf("ran %d times; want once", a.runs.Load())
			}
		})
	}
}

// TestInvalidStatusPanicsAsNetHTTP: WriteHeader with a status net/http
// refuses panics, as net/http's does, so the handler stops there and the
// record is marked unknown at once (it stayed IN_PROGRESS until its lease
// ran out, its handler running on past the call).
func TestInvalidStatusPanicsAsNetHTTP(t *testing.T) {
	for _, code := range []int{1000, 42} {
		eng := newEngine(t, memstore.New())
		var after atomic.Bool
		mw, _ := httpidem.New(httpidem.Config{Engine: eng})
		h := mw.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.WriteHeader(code)
			after.Store(true)
		}))
		var p any
		func() {
			defer func() { p = recover() }()
			r := httptest.NewRequest("POST", "/c", strings.NewReader("{}"))
			r.Header.Set("Idempotency-Key", "k")
			h.ServeHTTP(httptest.NewRecorder(), r)
		}()
		if want := fmt.Sprintf("invalid WriteHeader code %d", code); p != want || after.Load() {
			t.Fatalf("WriteHeader(%d): panic %v, went on %v; want the panic %q", code, p, after.Load(), want)
		}
		if rec, err := eng.Get(context.Background(), "", "k"); err != nil || rec.State != idem.StateUnknown {
			t.Fatalf("WriteHeader(%d): record %v, %v; want unknown", code, rec.State, err)
		}
	}
}

// TestSuperfluousWriteHeaderIsIgnored: once the status is written, a
// second WriteHeader is superfluous whatever its code, as net/http ignores
// it (a status variable left 0 on some path): the first answer stands and
// is stored. (For a while the code was checked first: the handler
// panicked after its 201, the client got no answer and the record UNKNOWN.)
func TestSuperfluousWriteHeaderIsIgnored(t *testing.T) {
	eng := newEngine(t, memstore.New())
	mw, _ := httpidem.New(httpidem.Config{Engine: eng})
	h := mw.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusCreated)
		io.WriteString(w, `{"id":"ch_1"}`)
		var status int
		w.WriteHeader(status)
	}))
	for _, want := range []string{"", "true"} {
		w := httptest.NewRecorder()
		r := httptest.NewRequest("POST", "/c", strings.NewReader("{}"))
		r.Header.Set("Idempotency-Key", "k")
		h.ServeHTTP(w, r)
		if w.Code != http.StatusCreated || w.Body.String() != `{"id":"ch_1"}` || w.Header().Get("Idempotent-Replayed") != want {
			t.Fatalf("answer %d %q (replayed %q); want the 201 (replayed %q)", w.Code, w.Body.String(), w.Header().Get("Idempotent-Replayed"), want)
		}
	}
}

// refusingStore refuses to complete a record, as a store refuses params it
// finds malformed.
type refusingStore struct{ idem.Store }

func (s refusingStore) Finish(ctx context.Context, p store.FinishParams) error {
	if p.State == idem.StateCompleted {
		return fmt.Errorf("%w: a response the store cannot keep", idem.ErrInvalid)
	}
	return s.Store.Finish(ctx, p)
}

// TestRefusedOutcomeIsUnknown: an outcome the store refuses as malformed
// leaves the record unknown, not in progress until its lease runs out: the
// handler ran.
func TestRefusedOutcomeIsUnknown(t *testing.T) {
	eng := newEngine(t, refusingStore{memstore.New()})
	a := &app{handler: charge}
	srv := serve(t, httpidem.Config{Engine: eng}, a)
	if r := send(t, srv, "POST", "/pay", "k", "x"); r.status != 201 {
		t.Fatalf("first = %d", r.status)
	}
	if rec, err := eng.Get(context.Background(), "", "k"); err != nil || rec.State != idem.StateUnknown {
		t.Fatalf("record %v, %v; want unknown", rec.State, err)
	}
	wantProblem(t, send(t, srv, "POST", "/pay", "k", "x"), 409, httpidem.ProblemUncertain)
}

// TestObserveMisconfiguredScope: a covered request whose scope the engine
// refuses (500 "Idempotency misconfigured") is observed too.
func TestObserveMisconfiguredScope(t *testing.T) {
	var mu sync.Mutex
	var seen []string
	srv := serve(t, httpidem.Config{Engine: newEngine(t, memstore.New()),
		Scope: func(r *http.Request) string { return r.Header.Get("Authorization") }, // a JWT: over 255 bytes
		Observe: func(r *http.Request, what string) {
			mu.Lock()
			defer mu.Unlock()
			seen = append(seen, what)
		}}, &app{handler: charge})
	r := send(t, srv, "POST", "/c", "k", "{}", "Authorization", "Bearer "+strings.Repeat("x", 300))
	wantProblem(t, r, 500, httpidem.ProblemIdempotencyFailed)
	mu.Lock()
	defer mu.Unlock()
	if !reflect.DeepEqual(seen, []string{httpidem.ObservedMisconfigured}) {
		t.Fatalf("observed %q, want [%s]", seen, httpidem.ObservedMisconfigured)
	}
}
