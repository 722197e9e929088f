package proxy_test

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/httpidem"
	"github.com/idemhq/idem/internal/proxy"
	"github.com/idemhq/idem/internal/testkit"
	"github.com/idemhq/idem/internal/wait"
	"github.com/idemhq/idem/store"
	"github.com/idemhq/idem/store/memstore"
	"github.com/idemhq/idem/store/sqlitestore"
)

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

func sqliteEngine(t *testing.T) *idem.Engine {
	t.Helper()
	s, err := sqlitestore.Open(context.Background(), sqlitestore.Config{Path: filepath.Join(t.TempDir(), "idem.db")})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	e, err := idem.New(idem.Config{Store: s})
	if err != nil {
		t.Fatal(err)
	}
	return e
}

// counter is an upstream that counts executions per idempotency key.
type counter struct {
	mu   sync.Mutex
	runs map[string]int
	fn   func(w http.ResponseWriter, r *http.Request, n int)
}

func (c *counter) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	c.mu.Lock()
	if c.runs == nil {
		c.runs = map[string]int{}
	}
	c.runs[r.Header.Get("Idempotency-Key")]++
	n := c.runs[r.Header.Get("Idempotency-Key")]
	c.mu.Unlock()
	c.fn(w, r, n)
}

func (c *counter) count(key string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.runs[key]
}

func start(t *testing.T, cfg proxy.Config, eng *idem.Engine, up http.Handler) *httptest.Server {
	t.Helper()
	upstream := httptest.NewServer(up)
	t.Cleanup(upstream.Close)
	if cfg.Upstream == "" {
		cfg.Upstream = upstream.URL
	}
	h, err := proxy.Handler(cfg, eng, quiet, proxy.Hooks{})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	srv.Client().Transport.(*http.Transport).MaxIdleConnsPerHost = 256
	srv.Client().Timeout = time.Minute // a regression fails with a message, never hangs
	return srv
}

type reply struct {
	status int
	body   string
	typ    string
	header http.Header
}

func post(t *testing.T, srv *httptest.Server, path, key, body string, headers ...string) reply {
	t.Helper()
	req, _ := http.NewRequest("POST", srv.URL+path, strings.NewReader(body))
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	for i := 0; i+1 < len(headers); i += 2 {
		req.Header.Set(headers[i], headers[i+1])
	}
	resp, err := srv.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	r := reply{status: resp.StatusCode, body: string(b), header: resp.Header}
	if resp.Header.Get("Content-Type") == "application/problem+json" {
		var p httpidem.Problem
		json.Unmarshal(b, &p)
		r.typ = p.Type
	}
	return r
}

func TestConcurrentDuplicatesExecuteOnce(t *testing.T) {
	for name, eng := range map[string]*idem.Engine{"memstore": mustEngine(t, memstore.New()), "sqlite": sqliteEngine(t)} {
		t.Run(name, func(t *testing.T) {
			up := &counter{fn: func(w http.ResponseWriter, r *http.Request, n int) {
				time.Sleep(5 * time.Millisecond) // a real upstream takes a while: let duplicates overlap
				w.WriteHeader(201)
				fmt.Fprintf(w, `{"execution":%d}`, n)
			}}
			srv := start(t, proxy.Config{}, eng, up)
			var wg sync.WaitGroup
			replies := make([]reply, 200)
			gate := make(chan struct{})
			for i := range replies {
				wg.Add(1)
				go func() {
					defer wg.Done()
					<-gate
					replies[i] = post(t, srv, "/v1/charges", "same-key", `{"amount":100}`)
				}()
			}
			close(gate)
			wait.Done(t, 2*time.Minute, "the concurrent goroutines to finish", wg.Wait)
			outcomes, conflicts := 0, 0
			for _, r := range replies {
				switch {
				case r.status == 201 && r.body == `{"execution":1}`:
					outcomes++
				case r.status == 409 && r.typ == httpidem.ProblemInProgress:
					conflicts++
				default:
					t.Fatalf("reply %d %q", r.status, r.body)
				}
			}
			if up.count("same-key") != 1 {
				t.Fatalf("upstream executed %d times", up.count("same-key"))
			}
			t.Logf("200 duplicates: 1 execution, %d got the outcome, %d got 409", outcomes, conflicts)
		})
	}
}

func mustEngine(t *testing.T, s idem.Store) *idem.Engine {
	t.Helper()
	e, err := idem.New(idem.Config{Store: s})
	if err != nil {
		t.Fatal(err)
	}
	return e
}

func TestUpstreamRefusedReleasesKey(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	closed := "http://" + ln.Addr().String()
	ln.Close() // nothing listens there now: connections are refused
	eng := mustEngine(t, memstore.New())
	srv := start(t, proxy.Config{Upstream: closed}, eng, http.NotFoundHandler())
	for fence := int64(1); fence <= 2; fence++ {
		if r := post(t, srv, "/pay", "k", "x"); r.status != 502 || !strings.Contains(r.body, "the request was not sent") {
			t.Fatalf("refused upstream: %d %q; want 502 saying the request was not sent", r.status, r.body)
		}
		rec, err := eng.Get(context.Background(), "", "k")
		if err != nil || rec.State != idem.StateFailed || rec.Fence != fence {
			t.Fatalf("after attempt %d: %+v, %v; want released (failed) with fence %d", fence, rec, err, fence)
		}
	}
}

func TestUpstreamSilentAfterRequestIsUncertain(t *testing.T) {
	eng := mustEngine(t, memstore.New())
	up := &counter{fn: func(w http.ResponseWriter, r *http.Request, n int) {
		io.ReadAll(r.Body)
		conn, _, err := http.NewResponseController(w).Hijack() // took the request, then the line dies
		if err == nil {
			conn.Close()
		}
	}}
	srv := start(t, proxy.Config{}, eng, up)
	if r := post(t, srv, "/pay", "k", "x"); r.status != 502 || !strings.Contains(r.body, "its outcome is unknown") {
		t.Fatalf("first: %d %q; want 502 saying its outcome is unknown", r.status, r.body)
	}
	if r := post(t, srv, "/pay", "k", "x"); r.status != 409 || r.typ != httpidem.ProblemUncertain {
		t.Fatalf("retry: %d %q, want 409 operation-uncertain", r.status, r.typ)
	}
	if up.count("k") != 1 {
		t.Fatalf("upstream ran %d times, want once", up.count("k"))
	}
}

// TestUncoveredRequestSentAndUnansweredIsFinal: a keyed POST that
// idempotency did not cover (a bypassed route; run by fail-open while the
// store was unreachable, as idem proxy runs it, with an Observe hook)
// reached the upstream, whose answer was lost. It was answered 502
// upstream-failed, Stripe-Should-Retry: true, and no error member, which
// Stripe's SDKs retry: the retry ran it again, as nothing recorded the key.
// It is answered as final, and says why.
func TestUncoveredRequestSentAndUnansweredIsFinal(t *testing.T) {
	up := &counter{fn: func(w http.ResponseWriter, r *http.Request, n int) {
		io.ReadAll(r.Body)
		conn, _, err := http.NewResponseController(w).Hijack() // took the request, then the line dies
		if err == nil {
			conn.Close()
		}
	}}
	upstream := httptest.NewServer(up)
	defer upstream.Close()
	bypass := proxy.DefaultConfig()
	bypass.Routes = []proxy.Route{{Match: "/bypass/", Bypass: true}}
	failOpen := proxy.DefaultConfig()
	failOpen.Defaults.FailOpen = true
	for _, c := range []struct {
		name, path string
		cfg        proxy.Config
		store      idem.Store
	}{
		{"bypassed route", "/bypass/pay", bypass, memstore.New()},
		{"fail-open", "/pay", failOpen, downStore{memstore.New()}},
	} {
		c.cfg.Upstream = upstream.URL
		h, err := proxy.Handler(c.cfg, mustEngine(t, c.store), quiet, proxy.Hooks{Observe: func(*http.Request, string) {}})
		if err != nil {
			t.Fatal(err)
		}
		srv := httptest.NewServer(h)
		r := post(t, srv, c.path, "k", "x")
		srv.Close()
		if r.status != 502 || r.typ != httpidem.ProblemUpstreamUncertain || r.header.Get(httpidem.HeaderShouldRetry) != "false" ||
			!strings.Contains(r.body, `"code":"upstream_outcome_unknown"`) || r.header.Get(httpidem.HeaderIgnored) == "" {
			t.Errorf("%s, taken by the upstream and unanswered: %d %s, %s %q, %s %q, %s; want 502 upstream-uncertain, final, the key said ignored",
				c.name, r.status, r.typ, httpidem.HeaderShouldRetry, r.header.Get(httpidem.HeaderShouldRetry),
				httpidem.HeaderIgnored, r.header.Get(httpidem.HeaderIgnored), r.body)
		}
	}
}

func TestUpstreamTimeoutIsUncertain(t *testing.T) {
	eng := mustEngine(t, memstore.New())
	release := make(chan struct{})
	defer close(release)
	up := &counter{fn: func(w http.ResponseWriter, r *http.Request, n int) { <-release }}
	srv := start(t, proxy.Config{UpstreamTimeout: 50 * time.Millisecond}, eng, up)
	if r := post(t, srv, "/pay", "k", "x"); r.status != 504 {
		t.Fatalf("first: %d, want 504", r.status)
	}
	if r := post(t, srv, "/pay", "k", "x"); r.typ != httpidem.ProblemUncertain || up.count("k") != 1 {
		t.Fatalf("retry: %d %q, upstream runs %d", r.status, r.typ, up.count("k"))
	}
}

func TestUpstreamBusyReleases(t *testing.T) {
	eng := mustEngine(t, memstore.New())
	up := &counter{fn: func(w http.ResponseWriter, r *http.Request, n int) {
		if n == 1 {
			w.Header().Set("Retry-After", "1")
			w.WriteHeader(429)
			return
		}
		w.WriteHeader(201)
		fmt.Fprintf(w, "run %d", n)
	}}
	srv := start(t, proxy.Config{}, eng, up)
	if r := post(t, srv, "/pay", "k", "x"); r.status != 429 {
		t.Fatalf("first: %d", r.status)
	}
	for range 2 {
		if r := post(t, srv, "/pay", "k", "x"); r.status != 201 || r.body != "run 2" {
			t.Fatalf("after a 429: %d %q", r.status, r.body)
		}
	}
	if up.count("k") != 2 {
		t.Fatalf("upstream ran %d times, want 2", up.count("k"))
	}
}

// TestUnsizedResponseIsReplayed: a response the upstream sends without a
// Content-Length (chunked: a Go handler's body over 2 KiB, most Node and
// Java servers) is kept and replayed like any other; only a stream
// (text/event-stream) goes through as it comes and is not kept. (The
// reverse proxy flushed every unsized response as it came, which made it a
// stream: not kept, and its retry got 409 response-not-replayable.)
func TestUnsizedResponseIsReplayed(t *testing.T) {
	big := strings.Repeat("x", 3000)
	up := &counter{fn: func(w http.ResponseWriter, r *http.Request, n int) {
		if r.URL.Path == "/events" {
			w.Header().Set("Content-Type", "text/event-stream")
		}
		w.WriteHeader(201)
		io.WriteString(w, big) // over net/http's 2 KiB buffer: sent chunked
	}}
	srv := start(t, proxy.Config{}, mustEngine(t, memstore.New()), up)
	first := post(t, srv, "/pay", "k", "x")
	if first.status != 201 || first.body != big {
		t.Fatalf("first: %d, %d bytes", first.status, len(first.body))
	}
	if again := post(t, srv, "/pay", "k", "x"); again.status != 201 || again.body != big || again.header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("retry: %d %q, %d bytes; want the replay", again.status, again.typ, len(again.body))
	}
	if r := post(t, srv, "/events", "e", "x"); r.status != 201 || r.body != big {
		t.Fatalf("a stream: %d, %d bytes", r.status, len(r.body))
	}
	if r := post(t, srv, "/events", "e", "x"); r.status != 409 || r.typ != httpidem.ProblemNotReplayable {
		t.Fatalf("a stream's retry: %d %q; want 409 response-not-replayable", r.status, r.typ)
	}
	if up.count("k") != 1 || up.count("e") != 1 {
		t.Fatalf("upstream ran %d and %d times, want once each", up.count("k"), up.count("e"))
	}
}

// TestUpstreamStalledMidBodyIsUncertain: an upstream that sends its
// headers and part of its body, then nothing, is given up after
// upstream_timeout without a byte, as one that sends no headers is: the
// outcome is unknown. (It held the key in progress for as long as the
// upstream kept the connection open.)
func TestUpstreamStalledMidBodyIsUncertain(t *testing.T) {
	release := make(chan struct{})
	defer close(release)
	up := &counter{fn: func(w http.ResponseWriter, r *http.Request, n int) {
		w.Header().Set("Content-Length", "100")
		w.WriteHeader(201)
		io.WriteString(w, `{"id":`)
		http.NewResponseController(w).Flush()
		<-release
	}}
	srv := start(t, proxy.Config{UpstreamTimeout: 200 * time.Millisecond}, mustEngine(t, memstore.New()), up)
	first := make(chan struct{})
	go func() {
		defer close(first)
		req, _ := http.NewRequest("POST", srv.URL+"/pay", strings.NewReader("x"))
		req.Header.Set("Idempotency-Key", "k")
		if resp, err := srv.Client().Do(req); err == nil {
			io.Copy(io.Discard, resp.Body) // cut short: the proxy cannot finish it
			resp.Body.Close()
		}
	}()
	wait.Recv(t, first, 10*time.Second, "the first request to end once the upstream stalled")
	if r := post(t, srv, "/pay", "k", "x"); r.status != 409 || r.typ != httpidem.ProblemUncertain {
		t.Fatalf("retry: %d %q, want 409 operation-uncertain", r.status, r.typ)
	}
	if up.count("k") != 1 {
		t.Fatalf("upstream ran %d times, want once", up.count("k"))
	}
}

// TestClientGoneMidResponseKeepsTheOutcome: a client that goes away while
// a response too large to keep is passed through to it leaves the outcome
// known: the upstream answered 201, which is stored (without its body), so
// the retry is told so (409 response-not-replayable, original status 201).
// (The aborted copy was taken for a failure of the upstream, and the record
// was left UNKNOWN: 409 operation-uncertain, for an operator to settle.)
func TestClientGoneMidResponseKeepsTheOutcome(t *testing.T) {
	eng := mustEngine(t, memstore.New())
	stop := make(chan struct{})
	defer close(stop)
	chunk := []byte(strings.Repeat("x", 64<<10))
	up := &counter{fn: func(w http.ResponseWriter, r *http.Request, n int) {
		w.WriteHeader(201)
		for range 1024 { // 64 MiB at most: the proxy stops reading long before
			if _, err := w.Write(chunk); err != nil {
				return
			}
			select {
			case <-stop:
				return
			default:
			}
		}
	}}
	srv := start(t, proxy.Config{Defaults: proxy.Route{Config: httpidem.Config{MaxResponseBody: 1024}}}, eng, up)
	req, _ := http.NewRequest("POST", srv.URL+"/pay", strings.NewReader("x"))
	req.Header.Set("Idempotency-Key", "k")
	client := &http.Client{Transport: &http.Transport{}, Timeout: 10 * time.Second}
	resp, err := client.Do(req)
	if err != nil || resp.StatusCode != 201 {
		t.Fatalf("first: %v, %v", resp, err)
	}
	io.ReadFull(resp.Body, make([]byte, 4096))
	resp.Body.Close() // gone, mid-response
	client.CloseIdleConnections()
	wait.Until(t, 10*time.Second, "the record to be settled", func() bool {
		rec, err := eng.Get(context.Background(), "", "k")
		return err == nil && rec.State != idem.StateInProgress
	})
	if rec, _ := eng.Get(context.Background(), "", "k"); rec.State != idem.StateCompleted || rec.Response == nil ||
		!rec.Response.BodyOmitted || rec.Response.Status != 201 {
		t.Fatalf("record after the client went away: %v %+v; want completed, 201, body not kept", rec.State, rec.Response)
	}
	if r := post(t, srv, "/pay", "k", "x"); r.status != 409 || r.typ != httpidem.ProblemNotReplayable {
		t.Fatalf("retry: %d %q, want 409 response-not-replayable", r.status, r.typ)
	}
	if up.count("k") != 1 {
		t.Fatalf("upstream ran %d times, want once", up.count("k"))
	}
}

func TestRoutesAndScopes(t *testing.T) {
	defaults := proxy.DefaultConfig().Defaults
	defaults.ScopeHeaders = []string{"X-Api-Key"}
	charges := defaults
	charges.Match, charges.RequireKey, charges.KeyFormat = "POST /v1/charges", true, httpidem.KeyUUID
	cfg := proxy.Config{Defaults: defaults, Routes: []proxy.Route{charges, {Match: "/v1/webhooks/", Bypass: true}}}
	up := &counter{fn: func(w http.ResponseWriter, r *http.Request, n int) {
		fmt.Fprintf(w, "%s run %d", r.Header.Get("X-Api-Key"), n)
	}}
	srv := start(t, cfg, mustEngine(t, memstore.New()), up)
	if r := post(t, srv, "/v1/charges", "", "x"); r.status != 400 || r.typ != httpidem.ProblemKeyMissing {
		t.Fatalf("charges without key: %d %q", r.status, r.typ)
	}
	if r := post(t, srv, "/v1/charges", "not-a-uuid", "x"); r.status != 400 || r.typ != httpidem.ProblemKeyInvalid {
		t.Fatalf("charges with a non-uuid key: %d %q", r.status, r.typ)
	}
	if r := post(t, srv, "/v1/orders", "", "x"); r.status != 200 {
		t.Fatalf("default route without key: %d", r.status)
	}
	key := "2f1e0d9c-8b7a-4c6d-9e5f-4a3b2c1d0e9f"
	a1 := post(t, srv, "/v1/charges", key, "x", "X-Api-Key", "tenant-a")
	b1 := post(t, srv, "/v1/charges", key, "x", "X-Api-Key", "tenant-b")
	a2 := post(t, srv, "/v1/charges", key, "x", "X-Api-Key", "tenant-a")
	// The upstream counts by key alone: tenant b's request is its second run of it.
	if a1.body != "tenant-a run 1" || b1.body != "tenant-b run 2" || a2.body != a1.body || a2.header.Get("Idempotent-Replayed") != "true" || up.count(key) != 2 {
		t.Fatalf("scopes: a %q, b %q, a again %q", a1.body, b1.body, a2.body)
	}
	post(t, srv, "/v1/webhooks/stripe", "w", "x")
	if r := post(t, srv, "/v1/webhooks/stripe", "w", "x"); r.body != " run 2" {
		t.Fatalf("bypassed route was deduplicated: %q", r.body)
	}
}

// TestRoutesDoNotRedirectWhatTheUpstreamServes: the proxy put its routes
// in a net/http ServeMux, which answers some requests itself with a
// redirect instead of passing them on. With the README's own route
// "match: /v1/webhooks/ (bypass)", a POST /v1/webhooks (no slash), which
// the API serves without the sidecar, never reached it: the proxy answered
// 307. Without any route, a path with "//" was answered 307 too. Each is
// passed on now, with its path as sent.
func TestRoutesDoNotRedirectWhatTheUpstreamServes(t *testing.T) {
	var mu sync.Mutex
	var seen []string
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		seen = append(seen, r.Method+" "+r.URL.EscapedPath())
		mu.Unlock()
		fmt.Fprint(w, "upstream")
	}))
	defer up.Close()
	eng := mustEngine(t, memstore.New())
	for _, c := range []struct {
		routes []proxy.Route
		path   string
	}{
		{[]proxy.Route{{Match: "/v1/webhooks/", Bypass: true}}, "/v1/webhooks"},
		{nil, "/v1/files//report.pdf"},
		{nil, "/v1/files/./a/../report.pdf"},
		{nil, "/v1/files/a%2Fb.pdf"},
		{[]proxy.Route{{Match: "/v1/files/", Bypass: true}}, "/v1/files/a%2Fb.pdf"},
	} {
		cfg := proxy.DefaultConfig()
		cfg.Upstream = up.URL
		cfg.Routes = c.routes
		h, err := proxy.Handler(cfg, eng, quiet, proxy.Hooks{})
		if err != nil {
			t.Fatal(err)
		}
		mu.Lock()
		seen = nil
		mu.Unlock()
		req := httptest.NewRequest("POST", c.path, strings.NewReader(`{}`))
		req.Header.Set("Idempotency-Key", "k-"+c.path)
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		mu.Lock()
		got := seen
		mu.Unlock()
		if rec.Code != 200 || rec.Body.String() != "upstream" || len(got) != 1 || got[0] != "POST "+c.path {
			t.Errorf("routes %v: POST %s answered %d %s (Location %q), upstream saw %q; want it passed to the upstream as sent",
				c.routes, c.path, rec.Code, strings.TrimSpace(rec.Body.String()), rec.Header().Get("Location"), got)
		}
	}
}

// TestNoPathEscapesItsRoute: a request is never taken out of its route's
// protection by how its path is spelled. With /v1/charges/ covered and
// everything else bypassed, a path that is /v1/charges/… once cleaned
// (// in it, /v1/charges without its slash, an encoded letter) is covered:
// a retry is replayed, not run again. A path that reads as different
// routes by how it is cleaned or decoded (dot segments that climb out of
// one route into another, which an API that does not clean paths reads
// within the first; an encoded / or .) is refused with 400, never passed
// on under the route that does not protect it.
func TestNoPathEscapesItsRoute(t *testing.T) {
	charges := proxy.DefaultConfig().Defaults
	charges.Match = "/v1/charges/"
	cfg := proxy.Config{Defaults: proxy.Route{Bypass: true}, Routes: []proxy.Route{charges, {Match: "/v1/webhooks/", Bypass: true}}}
	up := &counter{fn: func(w http.ResponseWriter, r *http.Request, n int) {
		fmt.Fprintf(w, "%s run %d", r.URL.EscapedPath(), n)
	}}
	srv := start(t, cfg, mustEngine(t, memstore.New()), up)
	send := func(path, key string) reply {
		t.Helper()
		// Sent as written: a client's URL parser would clean some of these.
		conn, err := net.Dial("tcp", strings.TrimPrefix(srv.URL, "http://"))
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		fmt.Fprintf(conn, "POST %s HTTP/1.1\r\nHost: x\r\nIdempotency-Key: %s\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}", path, key)
		conn.SetReadDeadline(time.Now().Add(time.Minute))
		resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return reply{status: resp.StatusCode, body: string(b), header: resp.Header}
	}
	for i, path := range []string{"/v1/charges/ch_1", "//v1/charges/ch_1", "/v1//charges/ch_1", "/v1/charges", "/v1/%63harges/ch_1"} {
		key := fmt.Sprint("covered-", i)
		first, again := send(path, key), send(path, key)
		if first.status != 200 || first.body != path+" run 1" || again.body != first.body || again.header.Get("Idempotent-Replayed") != "true" {
			t.Errorf("POST %s twice: %d %q, then %d %q; want it covered: run once (with its path as sent), then replayed",
				path, first.status, first.body, again.status, again.body)
		}
	}
	for i, path := range []string{
		"/v1/charges/../webhooks/x",     // cleaned: a webhook; as written: within /v1/charges/
		"/v1/webhooks/../charges/ch_1",  // the other way round
		"/v1/charges/%2E%2E/webhooks/x", // an encoded dot segment
		"/v1%2Fcharges/ch_1",            // one segment to the mux, /v1/charges/ decoded
		"/v1/charges%2F..%2Fwebhooks/x", // decoded, then read as written
		"/v1/./charges/ch_1",            // covered cleaned, but not as written
	} {
		key := fmt.Sprint("ambiguous-", i)
		if r := send(path, key); r.status != 400 || up.count(key) != 0 {
			t.Errorf("POST %s: %d %q, upstream ran it %d times; want 400, not passed on", path, r.status, r.body, up.count(key))
		}
	}
	// A bypassed route is still bypassed, however spelled.
	for i, path := range []string{"/v1/webhooks/x", "//v1/webhooks/x", "/v1/webhooks"} {
		key := fmt.Sprint("bypassed-", i)
		send(path, key)
		if r := send(path, key); r.status != 200 || up.count(key) != 2 {
			t.Errorf("POST %s twice: %d %q, run %d times; want it bypassed: run twice", path, r.status, r.body, up.count(key))
		}
	}
}

func TestBadRoutesAreRefused(t *testing.T) {
	eng := mustEngine(t, memstore.New())
	for name, cfg := range map[string]proxy.Config{
		"no upstream":      {},
		"ftp upstream":     {Upstream: "ftp://x"},
		"bad pattern":      {Upstream: "http://x", Routes: []proxy.Route{{Match: "POST"}}},
		"empty pattern":    {Upstream: "http://x", Routes: []proxy.Route{{}}},
		"duplicate routes": {Upstream: "http://x", Routes: []proxy.Route{{Match: "/a"}, {Match: "/a"}}},
		"negative lease":   {Upstream: "http://x", Defaults: proxy.Route{Config: httpidem.Config{Lease: -1}}},
	} {
		if _, err := proxy.Handler(cfg, eng, quiet, proxy.Hooks{}); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
}

// downStore is a store that cannot be reached.
type downStore struct{ idem.Store }

func (downStore) Get(context.Context, store.GetParams) (idem.Record, error) {
	return idem.Record{}, idem.ErrUnavailable
}

func (downStore) Acquire(context.Context, store.AcquireParams) (idem.Record, error) {
	return idem.Record{}, idem.ErrUnavailable
}

func TestAdmin(t *testing.T) {
	for name, c := range map[string]struct {
		store idem.Store
		ready int
	}{"up": {memstore.New(), 200}, "down": {downStore{memstore.New()}, 503}} {
		srv := httptest.NewServer(proxy.Admin(proxy.NewHealth(mustEngine(t, c.store), c.store, "memory", quiet), nil, nil))
		defer srv.Close()
		for path, want := range map[string]int{"/healthz": 200, "/readyz": c.ready} {
			resp, err := http.Get(srv.URL + path)
			if err != nil {
				t.Fatal(err)
			}
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != want {
				t.Errorf("store %s: %s = %d, want %d", name, path, resp.StatusCode, want)
			}
			if path == "/readyz" && c.ready == 200 && !strings.Contains(string(body), "durability: NOT crash-safe (memory:") {
				t.Errorf("store %s: /readyz does not say what a crash costs:\n%s", name, body)
			}
		}
	}
}

// TestGracefulShutdown: a request in flight when shutdown begins finishes,
// and its outcome is stored for the retry.
func TestGracefulShutdown(t *testing.T) {
	eng := sqliteEngine(t)
	started, release := make(chan struct{}), make(chan struct{})
	upstream := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		close(started)
		select {
		case <-release:
		case <-time.After(time.Minute):
		}
		w.WriteHeader(201)
		io.WriteString(w, "charged")
	}))
	defer upstream.Close()
	ctx, cancel := context.WithCancel(context.Background())
	addr := make(chan string, 1)
	done := make(chan error, 1)
	go func() {
		done <- proxy.Serve(ctx, nil, proxy.Config{Listen: "127.0.0.1:0", Upstream: upstream.URL}, eng, nil, quiet, proxy.Hooks{},
			func(a, _ string) { addr <- a })
	}()
	url := "http://" + wait.Recv(t, addr, 10*time.Second, "the proxy to listen") + "/pay"
	got := make(chan string, 1)
	go func() {
		req, _ := http.NewRequest("POST", url, strings.NewReader("x"))
		req.Header.Set("Idempotency-Key", "k")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			got <- err.Error()
			return
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		got <- string(b)
	}()
	wait.Recv(t, started, 10*time.Second, "the upstream to take the request")
	cancel() // SIGTERM
	close(release)
	if body := wait.Recv(t, got, 10*time.Second, "the in-flight request's answer"); body != "charged" {
		t.Fatalf("in-flight request during shutdown got %q", body)
	}
	if err := wait.Recv(t, done, 40*time.Second, "Serve to return after shutdown"); err != nil {
		t.Fatalf("Serve: %v", err)
	}
	rec, err := eng.Get(context.Background(), "", "k") // no Authorization header: the empty scope
	if err != nil || rec.State != idem.StateCompleted {
		t.Fatalf("record after shutdown: %+v, %v", rec, err)
	}
}

// syncBuffer is a log destination safe for the server's goroutines, read
// as JSON lines.
type syncBuffer struct{ testkit.SyncBuffer }

func (s *syncBuffer) lines() []map[string]any {
	var out []map[string]any
	for _, l := range strings.Split(strings.TrimSpace(s.String()), "\n") {
		var m map[string]any
		if json.Unmarshal([]byte(l), &m) == nil {
			out = append(out, m)
		}
	}
	return out
}

// TestLogsNameTheRequest: with access_log, every request gets a line saying
// what idem did with it and its key hash; a failed upstream's warning names
// the method, path and key hash, so an operator can find the record.
func TestLogsNameTheRequest(t *testing.T) {
	var logs syncBuffer
	log := slog.New(slog.NewJSONHandler(&logs, nil))
	eng := sqliteEngine(t)
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/broken" {
			panic(http.ErrAbortHandler) // the connection drops after the request arrived
		}
		w.WriteHeader(201)
	}))
	t.Cleanup(up.Close)
	h, err := proxy.Handler(proxy.Config{Upstream: up.URL, AccessLog: true, Defaults: proxy.DefaultConfig().Defaults}, eng, log, proxy.Hooks{})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	post := func(path, key string) {
		req, _ := http.NewRequest("POST", srv.URL+path, strings.NewReader("x"))
		req.Header.Set("Idempotency-Key", key)
		req.Header.Set("Authorization", "Bearer sk_a")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
	}
	post("/pay", "k1")
	post("/pay", "k1")
	post("/broken", "k2")
	scope := httpidem.HashScope("Authorization")(&http.Request{Header: http.Header{"Authorization": {"Bearer sk_a"}}})
	k1, k2 := idem.KeyHash(scope, "k1"), idem.KeyHash(scope, "k2")

	var access []map[string]any
	var warned map[string]any
	for _, l := range logs.lines() {
		switch l["msg"] {
		case "request":
			access = append(access, l)
		case "upstream took the request but gave no response: outcome unknown until reconciled":
			warned = l
		}
	}
	want := []struct {
		path, idem, keyHash string
		status              float64
	}{{"/pay", "executed", k1, 201}, {"/pay", "replayed", k1, 201}, {"/broken", "executed", k2, 502}}
	if len(access) != len(want) {
		t.Fatalf("access log: %v; want %d lines", access, len(want))
	}
	for i, w := range want {
		a := access[i]
		if a["method"] != "POST" || a["path"] != w.path || a["idem"] != w.idem || a["key_hash"] != w.keyHash || a["status"] != w.status {
			t.Errorf("access line %d = %v; want %+v", i, a, w)
		}
	}
	if warned == nil || warned["method"] != "POST" || warned["path"] != "/broken" || warned["key_hash"] != k2 {
		t.Fatalf("the upstream warning = %v; want it to name POST /broken and key hash %s", warned, k2)
	}
}

func TestLoopbackByDefault(t *testing.T) {
	for in, want := range map[string]string{
		":9090": "127.0.0.1:9090", "0.0.0.0:9090": "0.0.0.0:9090", "[::1]:9090": "[::1]:9090",
		"10.0.0.5:9090": "10.0.0.5:9090", "localhost:9090": "localhost:9090",
	} {
		if got := proxy.LoopbackByDefault(in); got != want {
			t.Errorf("LoopbackByDefault(%q) = %q, want %q", in, got, want)
		}
	}
}

// TestPinRetentions: what the console settles (with the engine's
// retention, knowing no route) is kept as long as the longest route keeps
// its outcomes; each route keeps its own. (The console kept an outcome of a
// route with a 72 h retention for the engine's 24 h.)
func TestPinRetentions(t *testing.T) {
	cfg := proxy.DefaultConfig()
	cfg.Routes = []proxy.Route{
		{Match: "POST /v1/charges", Config: httpidem.Config{Retention: 72 * time.Hour}},
		{Match: "POST /v1/refunds"},
	}
	pinned := cfg.PinRetentions()
	if pinned.Engine.Retention != 72*time.Hour {
		t.Errorf("engine retention %v, want the longest route's, 72h", pinned.Engine.Retention)
	}
	if pinned.Defaults.Retention != idem.DefaultRetention || pinned.Routes[0].Retention != 72*time.Hour || pinned.Routes[1].Retention != idem.DefaultRetention {
		t.Errorf("route retentions %v, %v, %v; want each its own (24h, 72h, 24h)", pinned.Defaults.Retention, pinned.Routes[0].Retention, pinned.Routes[1].Retention)
	}
	if cfg.Routes[1].Retention != 0 {
		t.Error("PinRetentions changed the config it was called on")
	}
}

// TestForwardedHeadersReachTheAPI: behind an ingress that terminates TLS,
// the API reads the client's scheme, host and address from the headers the
// ingress sets; the sidecar passes them on, X-Forwarded-For with its own
// peer appended, as the API got them without it. (They were replaced with
// what the sidecar saw: http, its peer, its host; Forwarded was dropped.)
func TestForwardedHeadersReachTheAPI(t *testing.T) {
	up := &counter{fn: func(w http.ResponseWriter, r *http.Request, n int) {
		fmt.Fprintf(w, "proto=%s for=%s host=%s forwarded=%s",
			r.Header.Get("X-Forwarded-Proto"), r.Header.Get("X-Forwarded-For"), r.Header.Get("X-Forwarded-Host"), r.Header.Get("Forwarded"))
	}}
	srv := start(t, proxy.Config{}, mustEngine(t, memstore.New()), up)
	r := post(t, srv, "/v1/charges", "k", "{}", "X-Forwarded-Proto", "https", "X-Forwarded-For", "203.0.113.7",
		"X-Forwarded-Host", "api.example.com", "Forwarded", "for=203.0.113.7;proto=https")
	if want := `proto=https for=203.0.113.7, 127.0.0.1 host=api.example.com forwarded=for=203.0.113.7;proto=https`; r.body != want {
		t.Errorf("the API saw %q, want %q", r.body, want)
	}
	// A request that came with none gets the sidecar's view, as before.
	r = post(t, srv, "/v1/charges", "k2", "{}")
	if host := strings.TrimPrefix(srv.URL, "http://"); r.body != "proto=http for=127.0.0.1 host="+host+" forwarded=" {
		t.Errorf("the API saw %q", r.body)
	}
}

// cutMidBody is an upstream whose connection breaks mid-body: it sends its
// 201 and part of its body (a Content-Length of 100), then aborts.
func cutMidBody(w http.ResponseWriter, r *http.Request) {
	io.ReadAll(r.Body)
	w.Header().Set("Content-Length", "100")
	w.WriteHeader(201)
	io.WriteString(w, `{"id":`)
	http.NewResponseController(w).Flush()
	panic(http.ErrAbortHandler) // the connection breaks mid-body
}

// sendCut sends a keyed POST whose answer the upstream cuts, and returns
// once the proxy has given up on it: the proxy closes the client's
// connection only after its handler (the middleware, the access log) has
// unwound.
func sendCut(t *testing.T, url, key string) {
	t.Helper()
	req, _ := http.NewRequest("POST", url, strings.NewReader(`{"amount":100}`))
	req.Header.Set("Idempotency-Key", key)
	client := &http.Client{Transport: &http.Transport{}, Timeout: time.Minute}
	defer client.CloseIdleConnections()
	if resp, err := client.Do(req); err == nil {
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
}

// TestCutAnswerOnTakeoverSafeRouteIsNeverReleased: on a route declared
// takeover_safe, the upstream commits a transfer, sends its 201 and part of
// the body, then the connection breaks. The upstream has acted (it
// answered), so the retry must not run it again: 409 operation-uncertain
// (as when no answer came at all), never a second run. (The reverse
// proxy's abort was taken for a panic before any effect, which a
// takeover-safe route releases: the retry transferred again.)
func TestCutAnswerOnTakeoverSafeRouteIsNeverReleased(t *testing.T) {
	eng := mustEngine(t, memstore.New())
	up := &counter{fn: func(w http.ResponseWriter, r *http.Request, n int) {
		if n > 1 {
			io.ReadAll(r.Body)
			w.WriteHeader(201)
			io.WriteString(w, `{"transfer":"second"}`)
			return
		}
		cutMidBody(w, r)
	}}
	srv := start(t, proxy.Config{Defaults: proxy.Route{Config: httpidem.Config{TakeoverSafe: true}}}, eng, up)
	sendCut(t, srv.URL+"/v1/ledger/transfers", "k")
	if rec, err := eng.Get(context.Background(), "", "k"); err != nil || rec.State != idem.StateUnknown {
		t.Errorf("record after the cut answer: %v, %v; want unknown", rec.State, err)
	}
	r := post(t, srv, "/v1/ledger/transfers", "k", `{"amount":100}`)
	if up.count("k") != 1 {
		t.Fatalf("upstream ran the transfer %d times (retry got %d %q); want once: it had answered 201 before the cut", up.count("k"), r.status, r.typ)
	}
	if r.status != 409 || r.typ != httpidem.ProblemUncertain {
		t.Fatalf("retry: %d %q; want 409 operation-uncertain", r.status, r.typ)
	}
}

// TestAccessLogNamesACutAnswer: with access_log, "a line for every
// request", the request whose upstream answer was cut mid-body included
// (its record now UNKNOWN: the one an operator most needs to find), saying
// the answer was cut. (The reverse proxy's abort went through the access
// log, which logged only once the handler returned: no line.)
func TestAccessLogNamesACutAnswer(t *testing.T) {
	var logs syncBuffer
	log := slog.New(slog.NewJSONHandler(&logs, nil))
	up := httptest.NewServer(http.HandlerFunc(cutMidBody))
	t.Cleanup(up.Close)
	h, err := proxy.Handler(proxy.Config{Upstream: up.URL, AccessLog: true, Defaults: proxy.DefaultConfig().Defaults}, mustEngine(t, memstore.New()), log, proxy.Hooks{})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	sendCut(t, srv.URL+"/pay", "k")
	access := func() []map[string]any {
		var lines []map[string]any
		for _, l := range logs.lines() {
			if l["msg"] == "request" {
				lines = append(lines, l)
			}
		}
		return lines
	}
	wait.Until(t, 10*time.Second, "the cut request's access log line", func() bool { return len(access()) > 0 })
	lines := access()
	if len(lines) != 1 {
		t.Fatalf("access log lines for the one request: %d; want 1. Log:\n%s", len(lines), logs.String())
	}
	if a := lines[0]; a["path"] != "/pay" || a["idem"] != httpidem.ObservedExecuted || a["key_hash"] != idem.KeyHash("", "k") ||
		a["cut"] != true || a["status"] != float64(0) {
		t.Fatalf("access line %v; want /pay, executed, its key hash, cut, status 0 (none sent)", a)
	}
}

// TestJSONLogHasEveryLine: with log_format json, the reverse proxy's own
// line about a cut upstream answer is written through the proxy's logger,
// as JSON. (ReverseProxy.ErrorLog was not set: it went to the standard log
// package, as plain text, outside the proxy's log.)
func TestJSONLogHasEveryLine(t *testing.T) {
	var logs syncBuffer
	up := httptest.NewServer(http.HandlerFunc(cutMidBody))
	t.Cleanup(up.Close)
	cfg := proxy.Config{Upstream: up.URL, LogFormat: "json", Defaults: proxy.DefaultConfig().Defaults}
	log, err := cfg.Logger(&logs)
	if err != nil {
		t.Fatal(err)
	}
	h, err := proxy.Handler(cfg, mustEngine(t, memstore.New()), log, proxy.Hooks{})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	sendCut(t, srv.URL+"/pay", "k")
	// The reverse proxy logs the failed copy before it aborts, so before
	// the client's connection closes; the wait only bounds a regression.
	wait.Until(t, 5*time.Second, "the reverse proxy's line about the cut body, in the JSON log", func() bool {
		for _, l := range logs.lines() {
			if msg, _ := l["msg"].(string); strings.Contains(msg, "ReverseProxy read error during body copy") && l["level"] == "WARN" {
				return true
			}
		}
		return false
	})
	for _, l := range strings.Split(strings.TrimSpace(logs.String()), "\n") {
		if !json.Valid([]byte(l)) {
			t.Fatalf("a line of the JSON log is not JSON: %q", l)
		}
	}
}

// TestStreamIsPassedThroughWhateverTheCaseOfItsType: "a stream
// (text/event-stream) goes through as it comes". A media type is
// case-insensitive (RFC 9110, 8.3.1), and the reverse proxy itself takes
// Text/Event-Stream for a stream; the proxy kept it whole instead, so the
// client got no event until the stream ended.
func TestStreamIsPassedThroughWhateverTheCaseOfItsType(t *testing.T) {
	for _, ct := range []string{"Text/Event-Stream", "TEXT/EVENT-STREAM; charset=utf-8"} {
		t.Run(ct, func(t *testing.T) {
			release := make(chan struct{})
			defer close(release)
			up := &counter{fn: func(w http.ResponseWriter, r *http.Request, n int) {
				w.Header().Set("Content-Type", ct)
				w.WriteHeader(200)
				io.WriteString(w, "data: 1\n\n")
				http.NewResponseController(w).Flush()
				<-release
			}}
			srv := start(t, proxy.Config{UpstreamTimeout: 10 * time.Second}, mustEngine(t, memstore.New()), up)
			req, _ := http.NewRequest("POST", srv.URL+"/v1/subscribe", strings.NewReader("x"))
			req.Header.Set("Idempotency-Key", "k")
			got := make(chan string, 1)
			go func() {
				resp, err := srv.Client().Do(req)
				if err != nil {
					got <- err.Error()
					return
				}
				defer resp.Body.Close()
				b := make([]byte, len("data: 1\n\n"))
				_, err = io.ReadFull(resp.Body, b)
				got <- string(b) + fmt.Sprint(err)
			}()
			if g := wait.Recv(t, got, 5*time.Second, "the stream's first event, flushed by the upstream, to reach the client"); g != "data: 1\n\n<nil>" {
				t.Fatalf("first event: %q", g)
			}
		})
	}
}
