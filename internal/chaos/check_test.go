package chaos

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/faultnet"
	"github.com/idemhq/idem/internal/wait"
	"github.com/idemhq/idem/store"
	"github.com/idemhq/idem/store/memstore"
)

// The checker's own tests: each feeds it a history with one violation that
// an earlier checker missed, and requires it to be counted.

func newTestRunner(ops int) *runner {
	return &runner{cfg: Config{Ops: ops}, up: newUpstream(0, 0), seen: map[string][]seen{}, ops: map[string]op{},
		client: &http.Client{Timeout: 10 * time.Second}}
}

// execute runs o at the upstream, as a proxy would forward it, and returns
// what a client of that proxy would have been given.
func execute(t *testing.T, up *upstream, o op) seen {
	t.Helper()
	req := httptest.NewRequest(o.method, o.path, strings.NewReader(string(o.body)))
	req.Header.Set("Idempotency-Key", o.key)
	rec := httptest.NewRecorder()
	up.ServeHTTP(rec, req)
	return seen{status: rec.Code, body: rec.Body.Bytes(), contentType: rec.Header().Get("Content-Type")}
}

// A record the store lost is a lost outcome even though a running proxy
// still replays it from its cache of completed records: the checker reads
// the store itself.
func TestLostRecordIsCountedThoughACacheReplaysIt(t *testing.T) {
	ctx := context.Background()
	lossy := &losing{Store: memstore.New(), lost: "op-lost"}
	eng, err := idem.New(idem.Config{Store: lossy, CacheSize: -1})
	if err != nil {
		t.Fatal(err)
	}
	r := newTestRunner(2)
	for _, key := range []string{"op-kept", "op-lost"} {
		o := op{key: key, method: "POST", path: "/v1/charges", body: []byte(`{"amount":100}`)}
		r.ops[key] = o
		saw := execute(t, r.up, o)
		// The owner stores the outcome and gives it to the client.
		out, err := eng.Begin(ctx, idem.BeginParams{Scope: scope, Key: key,
			Fingerprint: idem.NewFingerprint(idem.Payload{Method: o.method, Path: o.path, Body: o.body})})
		if err != nil || out.Decision != idem.Execute {
			t.Fatalf("begin %s: %v, %v", key, out.Decision, err)
		}
		resp := &idem.Response{Status: saw.status, Header: http.Header{"Content-Type": {saw.contentType}}, Body: saw.body}
		if err := eng.Complete(ctx, out.Lease, resp); err != nil {
			t.Fatal(err)
		}
		saw.expiry = resp.Header.Get(idem.HeaderExpires)
		r.seen[key] = []seen{saw}
	}
	// The store loses one record; a proxy's cache still has both.
	lossy.lose.Store(true)
	cached := func(o op) (seen, error) { return r.seen[o.key][0], nil }
	r.checkOutcomes(func(o op) (idem.Record, error) { return storedRecord(ctx, eng, o.key) }, cached)
	if r.report.LostOutcomes != 1 || len(r.report.Violations) != 1 || !strings.Contains(r.report.Violations[0], "op-lost") {
		t.Fatalf("want one lost outcome, op-lost's, counted though the replay gave it back; got %d: %q", r.report.LostOutcomes, r.report.Violations)
	}
	if r.report.AckedUnexecuted != 0 || r.report.Reconstructed != 0 {
		t.Fatalf("want no other violation; got %s", &r.report)
	}
}

// losing is a store that loses one record once told to, as a store server
// that crashed and lost acknowledged writes does.
type losing struct {
	idem.Store
	lost string
	lose atomic.Bool
}

func (s *losing) Get(ctx context.Context, p store.GetParams) (idem.Record, error) {
	if s.lose.Load() && p.Key == s.lost {
		return idem.Record{}, idem.ErrNotFound
	}
	return s.Store.Get(ctx, p)
}

// keepAndSee stores saw as key's outcome, as its owner would, and records
// it as what the client was given (with the engine's Idempotency-Expires).
func keepAndSee(t *testing.T, eng *idem.Engine, r *runner, o op, saw seen) {
	t.Helper()
	ctx := context.Background()
	out, err := eng.Begin(ctx, idem.BeginParams{Scope: scope, Key: o.key,
		Fingerprint: idem.NewFingerprint(idem.Payload{Method: o.method, Path: o.path, Body: o.body})})
	if err != nil || out.Decision != idem.Execute {
		t.Fatalf("begin %s: %v, %v", o.key, out.Decision, err)
	}
	resp := &idem.Response{Status: saw.status, Header: http.Header{"Content-Type": {saw.contentType}}, Body: saw.body}
	if err := eng.Complete(ctx, out.Lease, resp); err != nil {
		t.Fatal(err)
	}
	saw.expiry = resp.Header.Get(idem.HeaderExpires)
	r.seen[o.key] = append(r.seen[o.key], saw)
}

func checkAgainst(ctx context.Context, r *runner, eng *idem.Engine) {
	r.checkOutcomes(func(o op) (idem.Record, error) { return storedRecord(ctx, eng, o.key) },
		func(o op) (seen, error) { // a faithful replay of what the store holds
			rec, err := storedRecord(ctx, eng, o.key)
			if err != nil {
				return seen{}, err
			}
			return seen{status: rec.Response.Status, body: rec.Response.Body, contentType: rec.Response.Header.Get("Content-Type"),
				expiry: rec.Response.Header.Get(idem.HeaderExpires), replayed: true}, nil
		})
}

// The client's charge was acknowledged by an execution of another request:
// the proxy forwarded it without its body (a charge with no amount ran),
// and its answer was stored and given to the client. The operation the
// client asked for never ran: acknowledged without execution.
func TestAckedByAnotherRequestsExecution(t *testing.T) {
	ctx := context.Background()
	eng, err := idem.New(idem.Config{Store: memstore.New(), CacheSize: -1})
	if err != nil {
		t.Fatal(err)
	}
	r := newTestRunner(1)
	o := op{key: "op-0000001-deadbeef", method: "POST", path: "/v1/charges", body: []byte(`{"amount":100,"currency":"eur","customer":"cus_1"}`)}
	r.ops[o.key] = o
	forwarded := o
	forwarded.body = nil // what reached the upstream: the body lost on the way
	saw := execute(t, r.up, forwarded)
	keepAndSee(t, eng, r, o, saw)
	r.report.Executions = r.up.total()
	r.checkExecutions()
	checkAgainst(ctx, r, eng)
	if r.report.OK() {
		t.Fatalf("the only execution of %s ran another request (no body; the client sent %s), yet the checker finds nothing: %s", o.key, o.body, &r.report)
	}
}

// A declined charge (402 at the upstream) told to the client, stored and
// replayed as a success (201): no execution answered 201.
func TestAckedWithAnotherStatus(t *testing.T) {
	ctx := context.Background()
	eng, err := idem.New(idem.Config{Store: memstore.New(), CacheSize: -1})
	if err != nil {
		t.Fatal(err)
	}
	r := newTestRunner(1)
	o := op{key: "op-0000007-deadbeef7", method: "POST", path: "/v1/charges/ch_7/capture"}
	r.ops[o.key] = o
	saw := execute(t, r.up, o)
	if saw.status != http.StatusPaymentRequired {
		t.Fatalf("want the upstream to decline %s, got %d", o.key, saw.status)
	}
	saw.status = http.StatusCreated // what the client was told, and what was stored
	keepAndSee(t, eng, r, o, saw)
	r.report.Executions = r.up.total()
	r.checkExecutions()
	checkAgainst(ctx, r, eng)
	if r.report.OK() {
		t.Fatalf("the upstream declined %s (402) but the client was told 201, yet the checker finds nothing: %s", o.key, &r.report)
	}
}

// What the upstream answered, given to the client as it was (a bodied
// charge, a bodyless capture it declined, and an outcome the reconciler
// learnt from /resolve), is answered by an execution: the checker finds
// nothing.
func TestFaithfulOutcomesPassTheExecutionCheck(t *testing.T) {
	ctx := context.Background()
	eng, err := idem.New(idem.Config{Store: memstore.New(), CacheSize: -1})
	if err != nil {
		t.Fatal(err)
	}
	r := newTestRunner(3)
	charge := op{key: "op-0000001-deadbeef", method: "POST", path: "/v1/charges", body: []byte(`{"amount":100,"currency":"eur","customer":"cus_1"}`)}
	declined := op{key: "op-0000007-deadbeef7", method: "POST", path: "/v1/charges/ch_7/capture"}
	resolved := op{key: "op-0000002-deadbeef", method: "POST", path: "/v1/charges/ch_2/capture"}
	for _, o := range []op{charge, declined, resolved} {
		r.ops[o.key] = o
		saw := execute(t, r.up, o)
		if o.key == resolved.key { // the reply was lost: the reconciler asks the upstream
			saw = resolve(t, r.up, o.key)
		}
		keepAndSee(t, eng, r, o, saw)
	}
	if got := r.seen[declined.key][0].status; got != http.StatusPaymentRequired {
		t.Fatalf("want the upstream to decline %s, got %d", declined.key, got)
	}
	r.report.Executions = r.up.total()
	r.checkExecutions()
	checkAgainst(ctx, r, eng)
	if !r.report.OK() {
		t.Fatalf("want no violation for outcomes given as the upstream answered them; got %s", &r.report)
	}
}

// resolve asks the upstream what became of key, as the reconciler does, and
// returns the outcome it would store.
func resolve(t *testing.T, up *upstream, key string) seen {
	t.Helper()
	rec := httptest.NewRecorder()
	up.ServeHTTP(rec, httptest.NewRequest("POST", "/resolve", strings.NewReader(`{"key":"`+key+`"}`)))
	var got struct {
		Outcome string              `json:"outcome"`
		Status  int                 `json:"status"`
		Header  map[string][]string `json:"header"`
		Body    string              `json:"body"`
	}
	if err := json.Unmarshal(rec.Body.Bytes(), &got); err != nil || got.Outcome != "completed" {
		t.Fatalf("resolve %s: %s (%v)", key, rec.Body, err)
	}
	return seen{status: got.Status, body: []byte(got.Body), contentType: http.Header(got.Header).Get("Content-Type")}
}

// An execution still running at the upstream when the proxies stop is
// counted: quiesce waits until the upstream has finished it.
func TestLateExecutionIsCounted(t *testing.T) {
	r := newTestRunner(1)
	arrived, release := make(chan struct{}), make(chan struct{})
	var n atomic.Int32
	r.up.hold = func() {
		if n.Add(1) == 2 { // the second execution is late
			close(arrived)
			<-release
		}
	}
	if err := r.serveUpstream(); err != nil {
		t.Fatal(err)
	}
	defer r.stop()
	o := op{key: "op-late", method: "POST", path: "/v1/charges", body: []byte(`{"amount":100}`)}
	r.ops[o.key] = o
	if got, err := r.send(context.Background(), "http://"+r.upFault.Addr(), o); err != nil || got.status != http.StatusCreated {
		t.Fatalf("first execution: %d, %v", got.status, err)
	}
	// A proxy sent it again just before it stopped.
	sent := make(chan struct{})
	go func() {
		defer close(sent)
		r.send(context.Background(), "http://"+r.upFault.Addr(), o)
	}()
	wait.Recv(t, arrived, 10*time.Second, "the second execution to reach the upstream")
	if got := r.up.total(); got != 1 {
		t.Fatalf("want the late execution not recorded yet (a count taken now misses it); got %d executions", got)
	}
	quiesced := make(chan error, 1)
	go func() { quiesced <- r.quiesce() }()
	select {
	case err := <-quiesced:
		t.Fatalf("quiesce returned (%v) while an execution was still running at the upstream", err)
	case <-time.After(200 * time.Millisecond): // it is waiting, as it must
	}
	close(release)
	if err := wait.Recv(t, quiesced, idleBound+5*time.Second, "quiesce once the late execution ended"); err != nil {
		t.Fatal(err)
	}
	wait.Recv(t, sent, 10*time.Second, "the client of the late execution")
	r.checkExecutions()
	if r.report.Executions != 2 || r.report.DoubleExecutions != 1 || r.report.Miscounted != 1 {
		t.Fatalf("want 2 executions of one operation, counted as a double execution and a miscount; got %s", &r.report)
	}
}

// The suite's clients see every reply the fault proxy drops between them
// and a proxy, and retry it themselves (through a proxy picked at random,
// after a pause, counted in Requests). Here a reply is dropped on a
// kept-alive connection of the suite's own client.
func TestClientSeesTheReplyLost(t *testing.T) {
	var got atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		got.Add(1)
		io.Copy(io.Discard, req.Body)
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		w.Write([]byte(`{}`))
	}))
	defer srv.Close()
	f, err := faultnet.Listen(srv.Listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	r := newTestRunner(1)
	r.client = &http.Client{Timeout: 20 * time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: 48}} // as start makes it
	o := op{key: "op-0000001-deadbeef", method: "POST", path: "/v1/charges", body: []byte(`{"amount":100}`)}
	if _, err := r.send(context.Background(), "http://"+f.Addr(), o); err != nil { // the connection is now kept alive
		t.Fatal(err)
	}
	f.DropNextReply()
	res, err := r.send(context.Background(), "http://"+f.Addr(), o)
	if err == nil {
		t.Fatalf("the reply was dropped (%+v), yet the suite's client got %d and no error: net/http sent the request again by itself (the server got it %d times in all, the suite counted %d requests)",
			f.Stats(), res.status, got.Load(), r.requests.Load())
	}
}

// The same for a request cut on a kept-alive connection: one send of the
// suite, two requests cut (net/http sent it again by itself on a new
// connection, which was cut too).
func TestClientSeesTheRequestCut(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		io.Copy(io.Discard, req.Body)
		w.WriteHeader(http.StatusCreated)
	}))
	defer srv.Close()
	f, err := faultnet.Listen(srv.Listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	r := newTestRunner(1)
	r.client = &http.Client{Timeout: 20 * time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: 48}}
	o := op{key: "op-0000001-deadbeef", method: "POST", path: "/v1/charges", body: []byte(`{"amount":100}`)}
	if _, err := r.send(context.Background(), "http://"+f.Addr(), o); err != nil {
		t.Fatal(err)
	}
	f.SetFaults(faultnet.Faults{DropRequest: 1})
	r.send(context.Background(), "http://"+f.Addr(), o)
	if s := f.Stats(); s.RequestsDropped != 1 {
		t.Fatalf("one send of the suite's client, %d requests cut (%+v): net/http resent the cut request by itself", s.RequestsDropped, s)
	}
}

// A store whose stale records cannot be listed is asked again within the
// bound, and the run fails with a message if it never answers.
func TestSettlingRetriesTheScanThenFails(t *testing.T) {
	r := newTestRunner(0)
	calls := 0
	flaky := func(context.Context) (int, error) {
		if calls++; calls < 3 {
			return 0, errors.New("store down")
		}
		return 0, nil
	}
	if err := r.awaitSettled(context.Background(), 10*time.Second, func() int { return 0 }, flaky); err != nil || !r.report.OK() {
		t.Fatalf("want a scan failing twice, then answering none stale, to settle; got %v, %s", err, &r.report)
	}
	down := func(context.Context) (int, error) { return 0, errors.New("store down") }
	err := r.awaitSettled(context.Background(), 300*time.Millisecond, func() int { return 0 }, down)
	if err == nil || !strings.Contains(err.Error(), "store down") {
		t.Fatalf("want an error naming the scan's failure; got %v", err)
	}
}

// Outcomes still journaled, and records still stale, once the bound is
// over fail the run.
func TestLeftoversFailTheRun(t *testing.T) {
	r := newTestRunner(0)
	err := r.awaitSettled(context.Background(), 300*time.Millisecond, func() int { return 2 },
		func(context.Context) (int, error) { return 1, nil })
	if err != nil {
		t.Fatal(err)
	}
	if r.report.JournaledLeft != 2 || r.report.UnknownLeft != 1 || r.report.OK() {
		t.Fatalf("want 2 journaled and 1 stale left, and the run not OK; got OK %v: %s", r.report.OK(), &r.report)
	}
	r = newTestRunner(0)
	r.violation(nil, "something no counter counts")
	if r.report.OK() {
		t.Fatal("want a run with a violation not OK")
	}
}

// A kill counts only when it killed a running process.
func TestKillCountsOnlyARunningProcess(t *testing.T) {
	dir := t.TempDir()
	p := &proc{name: "sleep", bin: "sleep", args: []string{"60"}, log: filepath.Join(dir, "sleep.log")}
	if p.kill() {
		t.Fatal("want no kill of a process never started")
	}
	if err := p.start(); err != nil {
		t.Fatal(err)
	}
	if !p.kill() {
		t.Fatal("want the kill of a running process counted")
	}
	if p.kill() {
		t.Fatal("want no kill of a process already dead")
	}
	p = &proc{name: "true", bin: "true", log: filepath.Join(dir, "true.log")}
	if err := p.start(); err != nil {
		t.Fatal(err)
	}
	wait.Recv[struct{}](t, p.exited, 10*time.Second, "true to exit")
	if p.kill() {
		t.Fatal("want no kill of a process that ended by itself")
	}
}
