package cli_test

import (
	"bufio"
	"context"
	"database/sql"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/wait"
	"github.com/idemhq/idem/store/memstore"
	"github.com/idemhq/idem/store/sqlitestore"
)

// silentServer accepts TCP connections and never answers: a PostgreSQL
// server that hangs, a pooler whose server is down, a trace collector that
// is stuck. Accepted receives a value for each connection it takes.
type silentServer struct {
	net.Listener
	accepted chan struct{}
}

func silentListener(t *testing.T, addr string) *silentServer {
	t.Helper()
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	s := &silentServer{Listener: ln, accepted: make(chan struct{}, 64)}
	var mu sync.Mutex
	var conns []net.Conn
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
			select {
			case s.accepted <- struct{}{}:
			default:
			}
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		defer mu.Unlock()
		for _, c := range conns {
			c.Close()
		}
	})
	return s
}

// getBounded is get with a client that gives up after timeout.
func getBounded(url string, timeout time.Duration) (int, string) {
	c := &http.Client{Timeout: timeout}
	resp, err := c.Get(url)
	if err != nil {
		return 0, err.Error()
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// postBounded is post with a client that gives up after timeout.
func postBounded(url, key string, timeout time.Duration) (int, error) {
	req, _ := http.NewRequest("POST", url, strings.NewReader(`{"amount":100}`))
	req.Header.Set("Idempotency-Key", key)
	resp, err := (&http.Client{Timeout: timeout}).Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	io.Copy(io.Discard, resp.Body)
	return resp.StatusCode, nil
}

// heldUpstream is an upstream whose requests wait until release is closed
// (at the end of the test at the latest), saying on started that they began.
func heldUpstream(t *testing.T) (url string, started <-chan struct{}, release func()) {
	t.Helper()
	begun, done := make(chan struct{}, 8), make(chan struct{})
	var once sync.Once
	release = func() { once.Do(func() { close(done) }) }
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		begun <- struct{}{}
		<-done
		w.WriteHeader(201)
	}))
	t.Cleanup(up.Close)
	t.Cleanup(release) // runs first: the held requests end before the server closes
	return up.URL, begun, release
}

// exited waits, within d, for p to end, and returns how Wait saw it.
func exited(t *testing.T, p *proxyProc, d time.Duration) error {
	t.Helper()
	select { // stderr ends when the process does; Wait only after reading it all
	case <-p.logsDone:
	case <-time.After(d):
		t.Fatalf("idem proxy has not exited within %v; logs %q", d, p.logs.lines)
	}
	return p.cmd.Wait()
}

// TestStoppingProxyIsUnreadyWhileItDrains: at a graceful stop, /readyz goes
// 503 at once, so that a load balancer stops sending requests, and the
// admin listener stays up until the proxied one has drained; the request in
// flight finishes, and the proxy says every outcome is stored. Sequence: a
// request held by the upstream; SIGTERM; once the proxy says it is shutting
// down, /readyz answers 503 "stopping"; the proxied listener stops
// accepting, and /readyz still answers 503; the upstream answers; the
// client gets 201; exit 0, "every outcome is stored", the record completed.
// (/readyz used to answer 200 while the proxied listener was already
// closed.)
func TestStoppingProxyIsUnreadyWhileItDrains(t *testing.T) {
	upstream, started, release := heldUpstream(t)
	dbPath := filepath.Join(t.TempDir(), "s.db")
	p := runProxy(t, "--upstream", upstream, "--store", "sqlite:"+dbPath, "--admin-listen", "127.0.0.1:0", "--shutdown-timeout", "20s")
	answer := make(chan int, 1)
	go func() { code, _ := postBounded(p.url+"/pay", "drained", 30*time.Second); answer <- code }()
	wait.Recv(t, started, 10*time.Second, "the upstream to take the request")
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	wait.Until(t, 10*time.Second, "the proxy to say it is shutting down", func() bool { return p.logs.has("shutting down") })
	if status, body := getBounded(p.admin+"/readyz", 5*time.Second); status != 503 || !strings.Contains(body, "stopping") {
		t.Fatalf("/readyz once shutting down: %d %q; want 503, stopping", status, body)
	}
	host := strings.TrimPrefix(p.url, "http://")
	wait.Until(t, 10*time.Second, "the proxied listener to stop accepting", func() bool {
		c, err := net.DialTimeout("tcp", host, time.Second)
		if err == nil {
			c.Close()
		}
		return err != nil
	})
	if status, body := getBounded(p.admin+"/readyz", 5*time.Second); status != 503 {
		t.Fatalf("/readyz while the proxied listener drains: %d %q; want 503 from a listener still up", status, body)
	}
	release()
	if code := wait.Recv(t, answer, 20*time.Second, "the in-flight request's answer"); code != 201 {
		t.Fatalf("the request in flight at SIGTERM got %d; want it to finish (201)", code)
	}
	if err := exited(t, p, 20*time.Second); err != nil {
		t.Fatalf("exit after a drain that finished: %v (logs %q)", err, p.logs.lines)
	}
	if !p.logs.has("stopped: every outcome is stored") {
		t.Fatalf("no word that every outcome is stored: %q", p.logs.lines)
	}
	if rec := recordIn(t, dbPath, "drained"); rec.State != idem.StateCompleted {
		t.Fatalf("record after the stop: %s; want completed", rec.State)
	}
}

// recordIn reads key's record (empty scope) from the SQLite file at path.
func recordIn(t *testing.T, path, key string) idem.Record {
	t.Helper()
	s, err := sqlitestore.Open(context.Background(), sqlitestore.Config{Path: path})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	eng, err := idem.New(idem.Config{Store: s})
	if err != nil {
		t.Fatal(err)
	}
	defer eng.Close(context.Background())
	rec, err := eng.Get(context.Background(), "", key)
	if err != nil {
		t.Fatalf("record %s: %v", key, err)
	}
	return rec
}

// TestStopCutShortDoesNotClaimEveryOutcomeIsStored: a request still running
// when shutdown_timeout runs out is cut by the exit, its record left in
// progress (then UNKNOWN, for the reconciler); the proxy says so, exits 1,
// and never logs that every outcome is stored. Sequence: shutdown_timeout
// 1s; a request held by the upstream; SIGTERM; the process exits within a
// few seconds; its log says it stopped with work left, not that every
// outcome is stored; the record is in progress. (The engine used to be
// closed at once after the drain gave up, and the proxy logged "every
// outcome is stored".)
func TestStopCutShortDoesNotClaimEveryOutcomeIsStored(t *testing.T) {
	upstream, started, _ := heldUpstream(t)
	dbPath := filepath.Join(t.TempDir(), "s.db")
	p := runProxy(t, "--upstream", upstream, "--store", "sqlite:"+dbPath, "--shutdown-timeout", "1s")
	go postBounded(p.url+"/pay", "cut", 30*time.Second)
	wait.Recv(t, started, 10*time.Second, "the upstream to take the request")
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	var exit *exec.ExitError
	if err := exited(t, p, 15*time.Second); !errors.As(err, &exit) || exit.ExitCode() != 1 {
		t.Errorf("exit after a stop cut short: %v; want status 1", err)
	}
	if p.logs.has("every outcome is stored") || !p.logs.has("stopped with work left") {
		t.Fatalf("a request was cut by the stop, yet the log says: %q", p.logs.lines)
	}
	if rec := recordIn(t, dbPath, "cut"); rec.State != idem.StateInProgress {
		t.Fatalf("record of the cut request: %s; want in progress (UNKNOWN once its lease runs out)", rec.State)
	}
}

// TestSecondSignalEndsTheProxyAtOnce: an operator who sends a second
// SIGTERM or SIGINT (Ctrl-C twice) during a graceful stop ends the process
// at once. Sequence: a request held by the upstream, shutdown_timeout 60s;
// SIGTERM; once the proxy says it is shutting down, SIGINT; the process
// ends within a few seconds, killed by SIGINT. (The second signal used to
// be swallowed: the process waited for the drain.)
func TestSecondSignalEndsTheProxyAtOnce(t *testing.T) {
	err := stopTwice(t, false, syscall.SIGTERM)
	var exit *exec.ExitError
	if !errors.As(err, &exit) {
		t.Fatalf("exit after a second signal: %v; want killed by SIGINT", err)
	}
	if ws, ok := exit.Sys().(syscall.WaitStatus); !ok || !ws.Signaled() || ws.Signal() != syscall.SIGINT {
		t.Fatalf("exit after a second signal: %v; want killed by SIGINT", err)
	}
}

// TestSecondSignalEndsTheProxyStartedWithSIGINTIgnored: a background job
// of a script starts with SIGINT ignored; the first SIGINT still begins a
// graceful stop and a second one still ends the proxy at once. (Restoring
// the signal's disposition after the first restored "ignored": the second
// was ignored, and the proxy waited for its request in flight.)
func TestSecondSignalEndsTheProxyStartedWithSIGINTIgnored(t *testing.T) {
	err := stopTwice(t, true, syscall.SIGINT)
	var exit *exec.ExitError
	if !errors.As(err, &exit) || exit.ExitCode() != 130 {
		t.Fatalf("exit after a second SIGINT: %v; want status 130", err)
	}
}

// stopTwice starts a proxy (with SIGINT ignored, as a background job of a
// script, when ignoreSIGINT), holds a request in flight, sends first, and
// once the proxy says it is shutting down, SIGINT; it returns how the
// process ended, within 5 s.
func stopTwice(t *testing.T, ignoreSIGINT bool, first os.Signal) error {
	t.Helper()
	upstream, started, _ := heldUpstream(t)
	var launcher []string
	if ignoreSIGINT { // as a script's background job: the shell ignores SIGINT, and exec keeps it so
		launcher = []string{"sh", "-c", `trap "" INT; exec "$0" "$@"`}
	}
	p := runProxyVia(t, launcher, "--upstream", upstream, "--store", "memory:", "--shutdown-timeout", "60s")
	go postBounded(p.url+"/pay", "held", 90*time.Second)
	wait.Recv(t, started, 10*time.Second, "the upstream to take the request")
	if err := p.cmd.Process.Signal(first); err != nil {
		t.Fatal(err)
	}
	wait.Until(t, 10*time.Second, "the proxy to say it is shutting down", func() bool { return p.logs.has("shutting down") })
	if err := p.cmd.Process.Signal(syscall.SIGINT); err != nil {
		t.Fatal(err)
	}
	return exited(t, p, 5*time.Second)
}

// TestProxyListensWhilePostgresHangs: the proxy starts whether or not its
// store answers, also when the store's server accepts connections and
// never answers (a hung server, a pooler whose server is down). Sequence: a
// PostgreSQL DSN naming a listener that never answers; the proxy says it is
// listening (within runProxy's 30 s; the first attempt to open is bounded
// at a few seconds); /readyz says not ready; a keyed request gets 503
// quickly. (The first attempt to open was bounded by nothing: the proxy
// did not listen for minutes.)
func TestProxyListensWhilePostgresHangs(t *testing.T) {
	ln := silentListener(t, "127.0.0.1:0")
	upstream := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(201) }))
	defer upstream.Close()
	p := runProxy(t, "--upstream", upstream.URL, "--store", "postgres://u@"+ln.Addr().String()+"/db?sslmode=disable",
		"--store-timeout", "500ms", "--admin-listen", "127.0.0.1:0")
	if status, body := getBounded(p.admin+"/readyz", 10*time.Second); status != 503 || !strings.Contains(body, "not ready") {
		t.Fatalf("/readyz with a store that does not answer: %d %q; want 503", status, body)
	}
	began := time.Now()
	if code, err := postBounded(p.url+"/pay", "k", 10*time.Second); err != nil || code != 503 {
		t.Fatalf("a keyed request with a store that does not answer: %d %v; want 503", code, err)
	}
	if took := time.Since(began); took > 3*time.Second {
		t.Fatalf("the 503 took %v", took)
	}
}

// TestStoreThatComesBackHungDoesNotHoldRequests: while the store is not
// open, store calls fail fast as unavailable and the attempts to open it
// run in the background, so that no caller waits behind another's attempt.
// Sequence: the proxy starts with its PostgreSQL refused (store_timeout
// 500ms, read-only console); the server comes back hung (accepts, never
// answers); /readyz is polled until an attempt to open reaches it; then a
// console view (its count lists records) and a keyed request: the console
// answers, and the request gets 503 within a few seconds. (An attempt to
// open ran under the store's lock, the console's with no deadline: every
// request then hung behind it.)
func TestStoreThatComesBackHungDoesNotHoldRequests(t *testing.T) {
	probe, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := probe.Addr().String()
	probe.Close() // nothing listens there: refused at start
	upstream := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(201) }))
	defer upstream.Close()
	p := runProxy(t, "--upstream", upstream.URL, "--store", "postgres://u@"+addr+"/db?sslmode=disable",
		"--store-timeout", "500ms", "--admin-listen", "127.0.0.1:0", "--console-read-only")
	if status, _ := getBounded(p.admin+"/readyz", 10*time.Second); status != 503 {
		t.Fatalf("/readyz with the store refused: %d; want 503", status)
	}
	hung := silentListener(t, addr) // the server is back, and hangs
	wait.Until(t, 15*time.Second, "an attempt to open the store to reach the hung server", func() bool {
		select {
		case <-hung.accepted:
			return true
		default:
		}
		getBounded(p.admin+"/readyz", 5*time.Second)
		return false
	})
	// Past the pause between two attempts to open (storeopen's reopenEvery,
	// 1s; no event marks its end), a console view: its count lists the
	// records. Either it answers without waiting on the store, or its own
	// attempt to open the store reaches the hung server; then a keyed
	// request.
	time.Sleep(1100 * time.Millisecond)
	console := make(chan int, 1)
	go func() { status, _ := getBounded(p.admin+"/console/", 30*time.Second); console <- status }()
	consoleStatus := 0
	select {
	case consoleStatus = <-console:
	case <-hung.accepted:
	case <-time.After(10 * time.Second):
		t.Fatal("the console view neither answered nor reached the store within 10s")
	}
	began := time.Now()
	if code, err := postBounded(p.url+"/pay", "k1", 20*time.Second); err != nil || code != 503 {
		t.Errorf("a keyed request while the store hangs: %d %v after %v; want a quick 503", code, err, time.Since(began))
	} else if took := time.Since(began); took > 3*time.Second {
		t.Errorf("the keyed request's 503 took %v (store_timeout 500ms)", took)
	}
	if consoleStatus == 0 {
		consoleStatus = wait.Recv(t, console, 20*time.Second, "the console's answer")
	}
	if consoleStatus != 200 {
		t.Errorf("the console while the store hangs: %d; want its page (with the count's error)", consoleStatus)
	}
}

// TestExitIsBoundedWhenTheTraceCollectorHangs: flushing the traces at exit
// is bounded, so that a collector that accepts connections and never
// answers does not hold the process. Sequence: traces exported to a
// listener that never answers; one request (a span to flush);
// shutdown_timeout 1s; SIGTERM (one); the process exits within 10 s (the
// shutdown, then at most telemetry.FlushTimeout). (It took 30 s.)
func TestExitIsBoundedWhenTheTraceCollectorHangs(t *testing.T) {
	ln := silentListener(t, "127.0.0.1:0")
	t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://"+ln.Addr().String())
	upstream := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(201) }))
	defer upstream.Close()
	p := runProxy(t, "--upstream", upstream.URL, "--store", "memory:", "--shutdown-timeout", "1s")
	if code, err := postBounded(p.url+"/pay", "k", 10*time.Second); err != nil || code != 201 {
		t.Fatalf("a request: %d %v", code, err)
	}
	began := time.Now()
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	exited(t, p, 20*time.Second)
	if took := time.Since(began); took > 10*time.Second {
		t.Fatalf("exited %v after SIGTERM, with shutdown_timeout 1s: the trace flush is not bounded", took)
	}
}

// demoProc is an `idem demo` running as a real process.
type demoProc struct {
	cmd                  *exec.Cmd
	api, acquirer, admin string
	logs                 *logLines
	logsDone             chan struct{}
}

var demoAddrs = regexp.MustCompile(`^(simulated card acquirer|admin|payments API listening) on (http://\S+)`)

// runDemo runs `idem demo` on free ports and returns it once its API
// listens.
func runDemo(t *testing.T, args ...string) *demoProc {
	t.Helper()
	dir := t.TempDir()
	cmd := exec.Command(idemBin, append([]string{"demo", "--listen", "127.0.0.1:0", "--acquirer-listen", "127.0.0.1:0",
		"--admin-listen", "127.0.0.1:0", "--journal-dir", filepath.Join(dir, "journal"), "--audit-log", filepath.Join(dir, "audit.log"),
		"--store", "sqlite:" + filepath.Join(dir, "demo.db")}, args...)...)
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	d := &demoProc{cmd: cmd, logs: &logLines{}, logsDone: make(chan struct{})}
	go func() {
		defer close(d.logsDone)
		for lines := bufio.NewScanner(stderr); lines.Scan(); {
			d.logs.add(lines.Text())
		}
	}()
	up := make(chan struct{})
	go func() {
		defer io.Copy(io.Discard, stdout)
		for lines := bufio.NewScanner(stdout); lines.Scan(); {
			m := demoAddrs.FindStringSubmatch(lines.Text())
			if m == nil {
				continue
			}
			switch m[1] {
			case "simulated card acquirer":
				d.acquirer = m[2]
			case "admin":
				d.admin = m[2]
			default:
				d.api = m[2]
				close(up)
				return
			}
		}
	}()
	wait.Recv(t, up, 30*time.Second, "idem demo to say its API listens")
	return d
}

// TestStoppingDemoKeepsItsAcquirerUntilTheAPIDrains: at a graceful stop of
// `idem demo`, /readyz goes 503 at once, the payments API stops accepting
// and drains, and the simulated acquirer it calls keeps serving until it
// has: a charge in flight completes. Sequence: the acquirer answers after
// 1.5 s (its caller waits 2 s); a charge reaches it; SIGTERM; the API stops
// accepting while the acquirer still accepts and /readyz answers 503; the
// charge gets 201; exit 0, "every outcome is stored". (The servers were
// shut down one by one, the acquirer first: the API kept taking charges
// that the closed acquirer then refused, and /readyz said ready.)
func TestStoppingDemoKeepsItsAcquirerUntilTheAPIDrains(t *testing.T) {
	d := runDemo(t)
	c := &http.Client{Timeout: 10 * time.Second}
	req, _ := http.NewRequest("PUT", d.acquirer+"/faults", strings.NewReader(`{"latency":"1500ms"}`))
	if resp, err := c.Do(req); err != nil || resp.StatusCode != 200 {
		t.Fatalf("PUT /faults: %v %v", resp, err)
	}
	charge := make(chan int, 1)
	go func() {
		req, _ := http.NewRequest("POST", d.api+"/v1/charges", strings.NewReader(`{"amount":1000,"currency":"eur","customer":"cus_1"}`))
		req.Header.Set("Authorization", "Bearer sk_demo")
		req.Header.Set("Idempotency-Key", "in-flight")
		resp, err := (&http.Client{Timeout: 30 * time.Second}).Do(req)
		if err != nil {
			charge <- 0
			return
		}
		resp.Body.Close()
		charge <- resp.StatusCode
	}()
	wait.Until(t, 10*time.Second, "the charge to reach the acquirer", func() bool {
		_, body := getBounded(d.acquirer+"/stats", 5*time.Second)
		return strings.Contains(body, `"requests":1`)
	})
	if err := d.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	api := strings.TrimPrefix(d.api, "http://")
	wait.Until(t, 10*time.Second, "the payments API to stop accepting", func() bool {
		conn, err := net.DialTimeout("tcp", api, time.Second)
		if err == nil {
			conn.Close()
		}
		return err != nil
	})
	if status, body := getBounded(d.admin+"/readyz", 5*time.Second); status != 503 || !strings.Contains(body, "stopping") {
		t.Errorf("/readyz while the API drains: %d %q; want 503, stopping", status, body)
	}
	if conn, err := net.DialTimeout("tcp", strings.TrimPrefix(d.acquirer, "http://"), time.Second); err != nil {
		t.Errorf("the acquirer stopped accepting while the API that calls it drains: %v", err)
	} else {
		conn.Close()
	}
	if status := wait.Recv(t, charge, 20*time.Second, "the charge's answer"); status != 201 {
		t.Errorf("the charge in flight at SIGTERM got %d; want 201; logs %q", status, d.logs.lines)
	}
	select {
	case <-d.logsDone:
	case <-time.After(20 * time.Second):
		t.Fatalf("idem demo has not exited within 20s of a drained stop; logs %q", d.logs.lines)
	}
	if err := d.cmd.Wait(); err != nil || !d.logs.has("stopped: every outcome is stored") {
		t.Fatalf("exit: %v; logs %q", err, d.logs.lines)
	}
}

// TestWorkLeftExitsNonZero: a stop that leaves an outcome the store has
// not taken logs "stopped with work left" and exits 1, for a supervisor or
// a deploy script to see. Sequence: a request held upstream; another
// process takes SQLite's write lock; the upstream answers, the outcome
// waits in the journal; SIGTERM with shutdown_timeout 2s: the drain ends
// at once, the journal cannot land. (The exit status was 0: only a drain
// cut short made it 1.)
func TestWorkLeftExitsNonZero(t *testing.T) {
	upstream, started, release := heldUpstream(t)
	dbPath := filepath.Join(t.TempDir(), "s.db")
	p := runProxy(t, "--upstream", upstream, "--store", "sqlite:"+dbPath, "--store-timeout", "500ms", "--shutdown-timeout", "2s")
	answer := make(chan int, 1)
	go func() { code, _ := postBounded(p.url+"/pay", "left", 30*time.Second); answer <- code }()
	wait.Recv(t, started, 10*time.Second, "the upstream to take the request")
	db, err := sql.Open("sqlite", "file:"+dbPath)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	c, err := db.Conn(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.ExecContext(context.Background(), "BEGIN IMMEDIATE"); err != nil {
		t.Fatal(err)
	}
	defer c.ExecContext(context.Background(), "ROLLBACK")
	release()
	if code := wait.Recv(t, answer, 20*time.Second, "the answer"); code != http.StatusCreated {
		t.Fatalf("the client's answer, its outcome in the journal: %d; want 201", code)
	}
	wait.Until(t, 10*time.Second, "the outcome to wait in the journal", func() bool { return p.logs.has("waits in the journal") })
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	err = exited(t, p, 20*time.Second)
	var exit *exec.ExitError
	if !p.logs.has("stopped with work left") || !errors.As(err, &exit) || exit.ExitCode() != 1 {
		t.Fatalf("a stop with an outcome left in the journal: exit %v, logs %q; want status 1 and the work left said", err, p.logs.lines)
	}
}

// TestOpenStreamAtStopIsNotWorkLeft: a connection still open when the
// stop's deadline comes is closed, and that alone is no outcome at risk.
// Sequence: an unkeyed GET whose upstream streams (text/event-stream,
// passed through); SIGTERM with shutdown_timeout 2s; the stream is cut at
// the deadline; the proxy says every outcome is stored and exits 0. (It
// exited 1, saying requests stayed in progress, for a record that did not
// exist.)
func TestOpenStreamAtStopIsNotWorkLeft(t *testing.T) {
	done := make(chan struct{})
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		w.WriteHeader(http.StatusOK)
		io.WriteString(w, "data: hello\n\n")
		w.(http.Flusher).Flush()
		select {
		case <-done:
		case <-r.Context().Done():
		}
	}))
	defer up.Close()
	defer close(done)
	p := runProxy(t, "--upstream", up.URL, "--store", "memory:", "--shutdown-timeout", "2s")
	client := &http.Client{Timeout: 30 * time.Second}
	resp, err := client.Get(p.url + "/events")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if _, err := io.ReadFull(resp.Body, make([]byte, 5)); err != nil {
		t.Fatal(err)
	}
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	err = exited(t, p, 20*time.Second)
	if err != nil || !p.logs.has("stopped: every outcome is stored") {
		t.Fatalf("a stop that closed an unkeyed stream: exit %v, logs %q; want status 0, every outcome stored", err, p.logs.lines)
	}
}

// finishDown is a store that takes no outcome (its Finish finds the store
// unreachable) and names no store, so the outcome it leaves in a journal
// is anyone's.
type finishDown struct{ idem.Store }

func (finishDown) Finish(context.Context, idem.FinishParams) error { return idem.ErrUnavailable }

// TestFailedStartDoesNotWaitForTheStore: a proxy whose address is taken
// never serves; its journal holds an outcome from an earlier run, and its
// store cannot be reached. It waited the whole shutdown deadline (75 s)
// trying to store the outcome before it exited; the outcome stays on disk
// for the next start whatever it does, so it exits at once.
func TestFailedStartDoesNotWaitForTheStore(t *testing.T) {
	journal := filepath.Join(t.TempDir(), "journal")
	eng, err := idem.New(idem.Config{Store: finishDown{memstore.New()}, JournalDir: journal, StoreTimeout: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	out, err := eng.Begin(context.Background(), idem.BeginParams{Key: "k", Fingerprint: idem.NewFingerprint(idem.Payload{Method: "POST"})})
	if err != nil {
		t.Fatal(err)
	}
	if err := eng.Complete(context.Background(), out.Lease, &idem.Response{Status: 201}); err != nil {
		t.Fatal(err)
	}
	stop, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	eng.Close(stop)
	cancel()

	taken, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer taken.Close()
	closed, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	noStore := closed.Addr().String()
	closed.Close()
	cmd := exec.Command(idemBin, "proxy", "--listen", taken.Addr().String(), "--upstream", "http://127.0.0.1:9",
		"--store", "postgres://postgres@"+noStore+"/test?sslmode=disable", "--journal-dir", journal)
	began := time.Now()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	select {
	case err := <-exited:
		var exit *exec.ExitError
		if !errors.As(err, &exit) || exit.ExitCode() != 1 {
			t.Fatalf("a proxy whose address is taken: %v; want exit status 1", err)
		}
		if took := time.Since(began); took > 10*time.Second {
			t.Fatalf("it exited after %v; want at once", took)
		}
	case <-time.After(30 * time.Second):
		cmd.Process.Kill()
		t.Fatal("a proxy whose address is taken still ran 30 s after it started")
	}
	if files, _ := filepath.Glob(filepath.Join(journal, "*.json")); len(files) != 1 {
		t.Fatalf("%d entries in the journal after the failed start; want the earlier run's outcome kept", len(files))
	}
}
