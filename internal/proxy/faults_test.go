package proxy_test

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/httpidem"
	"github.com/idemhq/idem/internal/faultnet"
	"github.com/idemhq/idem/internal/proxy"
	"github.com/idemhq/idem/internal/testkit"
	"github.com/idemhq/idem/internal/wait"
	"github.com/idemhq/idem/store/memstore"
	"github.com/idemhq/idem/store/pgstore"
)

func TestMain(m *testing.M) { testkit.Main(m) }

// pgThroughFaults returns a PostgreSQL store in a schema of its own whose
// connections go through a fault-injecting TCP proxy, under application
// name app, or skips without IDEM_TEST_DATABASE_URL.
func pgThroughFaults(t *testing.T, app string) (*pgstore.Store, *faultnet.Proxy) {
	t.Helper()
	url := testkit.Server(t, "IDEM_TEST_DATABASE_URL")
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	faults, err := faultnet.Listen(net.JoinHostPort(cfg.ConnConfig.Host, strconv.Itoa(int(cfg.ConnConfig.Port))))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { faults.Close() })
	host, port, _ := net.SplitHostPort(faults.Addr())
	p, _ := strconv.Atoi(port)
	cfg.ConnConfig.Host, cfg.ConnConfig.Port, cfg.ConnConfig.Fallbacks = host, uint16(p), nil
	cfg.ConnConfig.RuntimeParams["application_name"] = app
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	var b [6]byte
	rand.Read(b[:])
	schema := "idem_proxy_test_" + hex.EncodeToString(b[:])
	t.Cleanup(func() {
		c, err := pgx.Connect(context.Background(), url)
		if err == nil {
			c.Exec(context.Background(), "DROP SCHEMA IF EXISTS "+schema+" CASCADE")
			c.Close(context.Background())
		}
	})
	s, err := pgstore.New(context.Background(), pgstore.Config{Pool: pool, Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	return s, faults
}

func engineOn(t *testing.T, s idem.Store, journal string) *idem.Engine {
	t.Helper()
	e, err := idem.New(idem.Config{Store: s, JournalDir: journal, StoreTimeout: time.Second, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		e.Close(ctx)
	})
	return e
}

// TestOutcomeSurvivesStoreOutage: the upstream answers while the store is
// unreachable. The client gets its outcome, with the promise to replay it
// (Idempotency-Expires); its retry meanwhile gets the same bytes from the
// journal, not a 503; once the store is back the outcome is stored, and any
// instance replays it.
func TestOutcomeSurvivesStoreOutage(t *testing.T) {
	store, faults := pgThroughFaults(t, "idem-proxy-outage")
	eng := engineOn(t, store, t.TempDir())
	answer := make(chan struct{})
	up := &counter{fn: func(w http.ResponseWriter, r *http.Request, n int) {
		select {
		case <-answer:
		case <-time.After(time.Minute):
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(201)
		w.Write([]byte(`{"id":"ch_1","execution":` + strconv.Itoa(n) + `}`))
	}}
	srv := start(t, proxy.Config{}, eng, up)
	first := make(chan reply, 1)
	go func() { first <- post(t, srv, "/v1/charges", "k", `{"amount":100}`) }()
	wait.Until(t, 5*time.Second, "the upstream to take the request", func() bool { return up.count("k") == 1 })
	end := faults.Outage()
	close(answer)
	got := wait.Recv(t, first, 10*time.Second, "the first answer")
	if got.status != 201 || got.header.Get(httpidem.HeaderExpires) == "" {
		t.Fatalf("first answer during the outage: %d %q, Idempotency-Expires %q", got.status, got.body, got.header.Get(httpidem.HeaderExpires))
	}
	if eng.Pending() != 1 {
		t.Fatalf("%d outcome(s) in the journal, want 1", eng.Pending())
	}
	again := post(t, srv, "/v1/charges", "k", `{"amount":100}`)
	if again.status != 201 || again.body != got.body || again.header.Get(httpidem.HeaderReplayed) != "true" {
		t.Fatalf("retry during the outage: %d %q; want the replay of %q", again.status, again.body, got.body)
	}
	end()
	wait.Until(t, 10*time.Second, "the journaled outcome to reach the store", func() bool { return eng.Pending() == 0 })
	other := start(t, proxy.Config{}, engineOn(t, store, ""), up)
	if r := post(t, other, "/v1/charges", "k", `{"amount":100}`); r.status != 201 || r.body != got.body {
		t.Fatalf("another instance after the outage: %d %q; want the replay of %q", r.status, r.body, got.body)
	}
	if n := up.count("k"); n != 1 {
		t.Fatalf("the upstream ran %d times", n)
	}
}

// TestBackendTerminatedMidRequest: the store's connections are killed on
// the server (pg_terminate_backend) while the upstream works; the outcome
// is stored on a new connection, and the retry replays it.
func TestBackendTerminatedMidRequest(t *testing.T) {
	store, _ := pgThroughFaults(t, "idem-proxy-terminate")
	eng := engineOn(t, store, t.TempDir())
	admin, err := pgx.Connect(context.Background(), os.Getenv("IDEM_TEST_DATABASE_URL"))
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close(context.Background())
	var killed atomic.Int64
	up := &counter{fn: func(w http.ResponseWriter, r *http.Request, n int) {
		var k int64
		if err := admin.QueryRow(r.Context(), `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
			WHERE application_name = 'idem-proxy-terminate'`).Scan(&k); err != nil {
			t.Error(err)
		}
		killed.Add(k)
		w.WriteHeader(201)
		w.Write([]byte("charged " + strconv.Itoa(n)))
	}}
	srv := start(t, proxy.Config{}, eng, up)
	got := post(t, srv, "/v1/charges", "k", `{"amount":100}`)
	if got.status != 201 || got.header.Get(httpidem.HeaderExpires) == "" {
		t.Fatalf("answer: %d %q, Idempotency-Expires %q", got.status, got.body, got.header.Get(httpidem.HeaderExpires))
	}
	if killed.Load() == 0 {
		t.Fatal("no backend was terminated: the fault did not happen")
	}
	if r := post(t, srv, "/v1/charges", "k", `{"amount":100}`); r.status != 201 || r.body != got.body {
		t.Fatalf("retry: %d %q; want the replay of %q", r.status, r.body, got.body)
	}
	if eng.Pending() != 0 || up.count("k") != 1 {
		t.Fatalf("journal %d, upstream runs %d; want 0 and 1", eng.Pending(), up.count("k"))
	}
}

// TestClientGoneDuringAcquireLeavesNoRecord: the client disconnects while
// the acquire is on its way to the store (the network to the store is
// paused). The acquire lands all the same; the proxy sees the client gone,
// runs nothing and releases the key, so the retry runs — rather than
// finding a record for work that never ran.
func TestClientGoneDuringAcquireLeavesNoRecord(t *testing.T) {
	store, faults := pgThroughFaults(t, "idem-proxy-client-gone")
	eng := engineOn(t, store, t.TempDir())
	up := &counter{fn: func(w http.ResponseWriter, r *http.Request, n int) {
		w.WriteHeader(201)
		w.Write([]byte("ran " + strconv.Itoa(n)))
	}}
	var gone atomic.Int64
	h, err := proxy.Handler(proxy.Config{Upstream: httptest.NewServer(up).URL}, eng, quiet, proxy.Hooks{
		Observe: func(_ *http.Request, what string) {
			if what == httpidem.ObservedClientGone {
				gone.Add(1)
			}
		}})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	defer srv.Close()
	post(t, srv, "/warm", "warm-up", "x") // the pool has its connection and statements

	resume := faults.Pause()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		req, _ := http.NewRequestWithContext(ctx, "POST", srv.URL+"/v1/charges", strings.NewReader(`{"amount":100}`))
		req.Header.Set("Idempotency-Key", "k")
		resp, err := http.DefaultClient.Do(req)
		if err == nil {
			resp.Body.Close()
		}
		done <- err
	}()
	wait.Until(t, 5*time.Second, "the acquire to reach the paused network", func() bool { return faults.Stats().Held > 0 })
	cancel()
	if err := wait.Recv(t, done, 5*time.Second, "the client to give up"); !errors.Is(err, context.Canceled) {
		t.Fatalf("client: %v", err)
	}
	resume()
	wait.Until(t, 10*time.Second, "the proxy to see the client gone", func() bool { return gone.Load() == 1 })
	rec, err := eng.Get(context.Background(), "", "k")
	if err != nil || rec.State != idem.StateFailed {
		t.Fatalf("record after the client left: %+v, %v; want released (failed)", rec, err)
	}
	if r := post(t, srv, "/v1/charges", "k", `{"amount":100}`); r.status != 201 || r.body != "ran 1" {
		t.Fatalf("retry: %d %q; want it to run", r.status, r.body)
	}
}

// TestSlowClientsAreCutOff: a client that sends its body a byte at a time
// (slowloris), or keeps an idle connection open, is disconnected by the
// read and idle timeouts; nothing runs for the slow request.
func TestSlowClientsAreCutOff(t *testing.T) {
	up := &counter{fn: func(w http.ResponseWriter, r *http.Request, n int) { w.WriteHeader(201) }}
	upstream := httptest.NewServer(up)
	defer upstream.Close()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	addr := make(chan string, 1)
	cfg := proxy.Config{Listen: "127.0.0.1:0", Upstream: upstream.URL,
		Timeouts: proxy.Timeouts{ReadTimeout: 300 * time.Millisecond, IdleTimeout: 300 * time.Millisecond}}
	go proxy.Serve(ctx, nil, cfg, sqliteEngine(t), nil, quiet, proxy.Hooks{}, func(a, _ string) { addr <- a })
	proxyAddr := wait.Recv(t, addr, 5*time.Second, "the proxy to listen")

	closedWithin := func(what string, c net.Conn, within time.Duration) string {
		t.Helper()
		c.SetReadDeadline(time.Now().Add(within))
		b, err := io.ReadAll(c)
		if errors.Is(err, os.ErrDeadlineExceeded) {
			t.Fatalf("%s: the connection was still open after %v", what, within)
		}
		return string(b)
	}
	slow, err := net.Dial("tcp", proxyAddr)
	if err != nil {
		t.Fatal(err)
	}
	defer slow.Close()
	io.WriteString(slow, "POST /v1/charges HTTP/1.1\r\nHost: x\r\nIdempotency-Key: slow\r\nContent-Length: 100\r\n\r\nx")
	if answer := closedWithin("a body sent 1 byte of 100", slow, 5*time.Second); answer != "" && !strings.HasPrefix(answer, "HTTP/1.1 400") {
		t.Fatalf("the slow request got %q", answer)
	}
	if up.count("slow") != 0 {
		t.Fatal("the slow request ran")
	}

	idle, err := net.Dial("tcp", proxyAddr)
	if err != nil {
		t.Fatal(err)
	}
	defer idle.Close()
	io.WriteString(idle, "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
	resp, err := http.ReadResponse(bufio.NewReader(idle), nil)
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	closedWithin("an idle kept-alive connection", idle, 5*time.Second)
}

// TestUpstreamNotReadingIsBounded: an upstream that takes the connection
// but never reads (a frozen process: the kernel accepts for it) is given
// up after upstream_timeout while the request's body is being written, as
// while its answer is awaited. It held the key in progress, and the
// request, for as long as the socket stayed open.
func TestUpstreamNotReadingIsBounded(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close() // never accepts: the kernel does, and nothing reads
	eng := mustEngine(t, memstore.New())
	srv := start(t, proxy.Config{Upstream: "http://" + ln.Addr().String(), UpstreamTimeout: 200 * time.Millisecond,
		Defaults: proxy.Route{Config: httpidem.Config{MaxRequestBody: 64 << 20}}}, eng, nil)
	done := make(chan int, 1)
	go func() {
		req, _ := http.NewRequest("POST", srv.URL+"/pay", strings.NewReader(strings.Repeat("x", 32<<20))) // past any socket buffer
		req.Header.Set("Idempotency-Key", "k")
		resp, err := srv.Client().Do(req)
		if err != nil {
			done <- -1
			return
		}
		resp.Body.Close()
		done <- resp.StatusCode
	}()
	select {
	case status := <-done:
		rec, err := eng.Get(context.Background(), "", "k")
		if status != http.StatusGatewayTimeout || err != nil || rec.State != idem.StateUnknown {
			t.Fatalf("answer %d, record %v (%v); want 504 and the record unknown (the upstream had the request's headers)", status, rec.State, err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("no answer 20 s into a request to an upstream that does not read, with upstream_timeout 200ms")
	}
}

// TestIgnoredSurvivesContinue: a keyed request on a bypassed route is
// answered with Idempotent-Ignored even when it asks for 100 Continue,
// which the upstream sends and the reverse proxy passes on, clearing the
// headers after it (the key was then ignored silently).
func TestIgnoredSurvivesContinue(t *testing.T) {
	up := &counter{fn: func(w http.ResponseWriter, r *http.Request, n int) {
		io.ReadAll(r.Body) // a Go server sends 100 Continue here
		w.WriteHeader(http.StatusCreated)
	}}
	cfg := proxy.Config{Routes: []proxy.Route{{Match: "/bypass/", Bypass: true}},
		Defaults: proxy.Route{Config: httpidem.Config{Methods: []string{"POST"}}}}
	srv := start(t, cfg, mustEngine(t, memstore.New()), up)
	client := *srv.Client()
	client.Timeout = 10 * time.Second // a regression fails, it does not hang
	for _, c := range []struct{ method, path string }{{"POST", "/bypass/x"}, {"PUT", "/pay"}} {
		req, _ := http.NewRequest(c.method, srv.URL+c.path, strings.NewReader(strings.Repeat("x", 2000)))
		req.Header.Set("Idempotency-Key", "k-"+c.method)
		req.Header.Set("Expect", "100-continue")
		resp, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusCreated || resp.Header.Get(httpidem.HeaderIgnored) == "" {
			t.Errorf("%s %s with Expect: 100-continue: %d without %s; the key was ignored silently", c.method, c.path, resp.StatusCode, httpidem.HeaderIgnored)
		}
	}
}

// TestUpgradePassesThrough: an upgrade (a WebSocket) through the proxy is
// the upstream's 101 and then the tunnel. Every upgrade failed with 502
// (the proxy wrapped the 101's body in one that cannot be written to), and
// a keyed one was left UNKNOWN.
func TestUpgradePassesThrough(t *testing.T) {
	up := &counter{fn: func(w http.ResponseWriter, r *http.Request, n int) {
		conn, brw, err := http.NewResponseController(w).Hijack()
		if err != nil {
			return
		}
		defer conn.Close()
		brw.WriteString("HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n")
		brw.Flush()
		line, _ := brw.ReadString('\n')
		brw.WriteString("echo " + line)
		brw.Flush()
	}}
	eng := mustEngine(t, memstore.New())
	srv := start(t, proxy.Config{UpstreamTimeout: 100 * time.Millisecond}, eng, up)
	for _, method := range []string{"GET", "POST"} {
		conn, err := net.Dial("tcp", strings.TrimPrefix(srv.URL, "http://"))
		if err != nil {
			t.Fatal(err)
		}
		conn.SetDeadline(time.Now().Add(10 * time.Second))
		fmt.Fprintf(conn, "%s /ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nIdempotency-Key: ws-%s\r\nContent-Length: 0\r\n\r\n", method, method)
		br := bufio.NewReader(conn)
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatalf("%s upgrade: %v", method, err)
		}
		if resp.StatusCode != http.StatusSwitchingProtocols {
			t.Fatalf("%s upgrade: %d; want the upstream's 101", method, resp.StatusCode)
		}
		time.Sleep(300 * time.Millisecond) // the tunnel idle for three upstream_timeouts: nothing may cut it
		fmt.Fprintf(conn, "hello\n")
		if line, err := br.ReadString('\n'); err != nil || line != "echo hello\n" {
			t.Fatalf("%s upgrade: the tunnel answered %q, %v", method, line, err)
		}
		conn.Close()
	}
	if rec, err := eng.Get(context.Background(), "", "ws-POST"); err == nil && rec.State == idem.StateUnknown {
		t.Fatalf("the keyed upgrade's record is unknown, though the upstream answered")
	}
}

// TestSteadyUploadOutlastsTheTimeout: upstream_timeout bounds a stall in
// sending a request, not the whole of a steady upload: one that keeps
// going for longer passes (it was cut at upstream_timeout, 504).
func TestSteadyUploadOutlastsTheTimeout(t *testing.T) {
	up := &counter{fn: func(w http.ResponseWriter, r *http.Request, n int) {
		b, _ := io.ReadAll(r.Body)
		w.Write([]byte(strconv.Itoa(len(b))))
	}}
	srv := start(t, proxy.Config{UpstreamTimeout: 300 * time.Millisecond}, mustEngine(t, memstore.New()), up)
	pr, pw := io.Pipe()
	go func() {
		for range 10 { // a second in all, a part every 100 ms: never a stall of 300 ms
			pw.Write([]byte("0123456789"))
			time.Sleep(100 * time.Millisecond)
		}
		pw.Close()
	}()
	req, _ := http.NewRequest("POST", srv.URL+"/upload", pr) // no key: streamed through
	client := *srv.Client()
	client.Timeout = 10 * time.Second // a regression fails, it does not hang
	resp, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || string(b) != "100" {
		t.Fatalf("%d %q; want the upstream's 200 for all 100 bytes", resp.StatusCode, b)
	}
}
