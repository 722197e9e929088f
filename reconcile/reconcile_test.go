package reconcile_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/testkit"
	"github.com/idemhq/idem/internal/wait"
	"github.com/idemhq/idem/reconcile"
	"github.com/idemhq/idem/store"
	"github.com/idemhq/idem/store/memstore"
	"github.com/idemhq/idem/store/storetest"
)

var ctx = context.Background()

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

type world struct {
	eng   *idem.Engine
	store idem.Store
	clock *storetest.Clock
}

func newWorld(t *testing.T) *world {
	t.Helper()
	clock := storetest.NewClock(time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC))
	store := memstore.New()
	eng, err := idem.New(idem.Config{Store: store, Clock: clock, Lease: 30 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	return &world{eng: eng, store: store, clock: clock}
}

func payload(key string) idem.Fingerprint {
	return idem.NewFingerprint(idem.Payload{Method: "POST", Path: "/charges", Body: []byte(key)})
}

// begin starts a request under key and checkpoints it, as a handler does
// before calling the acquirer; the caller then lets it die.
func (w *world) begin(t *testing.T, key string, takeoverSafe bool) idem.Lease {
	t.Helper()
	out, err := w.eng.Begin(ctx, idem.BeginParams{Key: key, Fingerprint: payload(key), TakeoverSafe: takeoverSafe})
	if err != nil || out.Decision != idem.Execute {
		t.Fatalf("Begin(%s) = %v, %v", key, out.Decision, err)
	}
	if !takeoverSafe {
		if err := w.eng.Checkpoint(ctx, out.Lease, "authorize", []byte(out.Lease.DownstreamKey("authorize"))); err != nil {
			t.Fatal(err)
		}
	}
	return out.Lease
}

func (w *world) reconciler(t *testing.T, res reconcile.Resolver) *reconcile.Reconciler {
	t.Helper()
	r, err := reconcile.New(reconcile.Config{Engine: w.eng, Resolver: res, Grace: time.Minute, PageSize: 7, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func (w *world) decide(t *testing.T, key string) idem.Outcome {
	t.Helper()
	out, err := w.eng.Begin(ctx, idem.BeginParams{Key: key, Fingerprint: payload(key)})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// acquirer answers by downstream key, as a card acquirer's lookup API does.
type acquirer map[string]reconcile.Outcome

func (a acquirer) Resolve(ctx context.Context, rec idem.Record) (reconcile.Resolution, error) {
	if len(rec.Checkpoints) == 0 || string(rec.Checkpoints[0].Data) != rec.DownstreamKey("authorize") {
		return reconcile.Resolution{}, errors.New("no authorize checkpoint")
	}
	switch a[rec.DownstreamKey("authorize")] {
	case reconcile.Completed:
		return reconcile.Resolution{Outcome: reconcile.Completed, Response: &idem.Response{Status: 201, Body: []byte("charged " + rec.Key)}}, nil
	case reconcile.Failed:
		return reconcile.Resolution{Outcome: reconcile.Failed}, nil
	}
	return reconcile.Resolution{Outcome: reconcile.StillUnknown}, nil
}

func TestRunOnceSettlesByAskingTheWorld(t *testing.T) {
	w := newWorld(t)
	charged, declined := w.begin(t, "charged", false), w.begin(t, "never-sent", false)
	w.begin(t, "silent", false)                              // the acquirer will not know this one yet
	if err := w.eng.MarkUnknown(ctx, declined); err != nil { // a panic mid-call, say
		t.Fatal(err)
	}
	w.clock.Advance(30*time.Second + time.Minute) // past every lease and the grace
	w.begin(t, "recent", false)
	w.clock.Advance(31 * time.Second) // its lease is over, its grace is not
	world := acquirer{charged.DownstreamKey("authorize"): reconcile.Completed, declined.DownstreamKey("authorize"): reconcile.Failed}

	rep, err := w.reconciler(t, world).RunOnce(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if want := (reconcile.Report{Stale: 4, Waiting: 1, Completed: 1, Failed: 1, Unknown: 1}); rep != want {
		t.Fatalf("report = %+v, want %+v", rep, want)
	}
	if out := w.decide(t, "charged"); out.Decision != idem.Replay || string(out.Record.Response.Body) != "charged charged" {
		t.Fatalf("charged: %v", out.Decision)
	}
	if out := w.decide(t, "never-sent"); out.Decision != idem.Execute {
		t.Fatalf("a charge that never happened: %v, want the retry to run", out.Decision)
	}
	if out := w.decide(t, "silent"); out.Decision != idem.Uncertain || out.Record.State != idem.StateUnknown {
		t.Fatalf("unanswerable: %v in %v, want uncertain and marked unknown", out.Decision, out.Record.State)
	}
	// The late owner cannot overwrite what the reconciler stored.
	if err := w.eng.Complete(ctx, charged, &idem.Response{Status: 500}); !errors.Is(err, idem.ErrLeaseLost) {
		t.Fatalf("late owner's Complete: %v, want ErrLeaseLost", err)
	}
}

func TestTakeoverSafeRecordsAreReleased(t *testing.T) {
	w := newWorld(t)
	w.begin(t, "tx", true)
	w.clock.Advance(2 * time.Minute)
	rep, err := w.reconciler(t, reconcile.ResolverFunc(func(context.Context, idem.Record) (reconcile.Resolution, error) {
		t.Fatal("the resolver was asked about work that commits with its record")
		return reconcile.Resolution{}, nil
	})).RunOnce(ctx)
	if err != nil || rep.Failed != 1 {
		t.Fatalf("report %+v, %v", rep, err)
	}
	if out := w.decide(t, "tx"); out.Decision != idem.Execute {
		t.Fatalf("after release: %v", out.Decision)
	}
}

func TestResolverErrorsAndCommit(t *testing.T) {
	w := newWorld(t)
	w.begin(t, "broken", false)
	w.begin(t, "committed", false)
	w.clock.Advance(2 * time.Minute)
	var committed atomic.Int64
	res := reconcile.ResolverFunc(func(ctx context.Context, rec idem.Record) (reconcile.Resolution, error) {
		if rec.Key == "broken" {
			return reconcile.Resolution{}, errors.New("acquirer lookup timed out")
		}
		return reconcile.Resolution{Outcome: reconcile.Completed, Response: &idem.Response{Status: 201},
			Commit: func(ctx context.Context, p idem.FinishParams) error {
				committed.Add(1) // the ledger write would go here, in one transaction
				return w.store.Finish(ctx, p)
			}}, nil
	})
	rep, err := w.reconciler(t, res).RunOnce(ctx)
	if err != nil || rep.Errors != 1 || rep.Completed != 1 || committed.Load() != 1 {
		t.Fatalf("report %+v, %v, commits %d", rep, err, committed.Load())
	}
	if out := w.decide(t, "broken"); out.Decision != idem.Uncertain {
		t.Fatalf("a record the resolver failed on: %v", out.Decision)
	}
}

// TestConcurrentReconcilersSettleOnce: four reconcilers on one store race
// over the same records; each record is settled exactly once.
func TestConcurrentReconcilersSettleOnce(t *testing.T) {
	w := newWorld(t)
	world := acquirer{}
	for i := range 60 {
		l := w.begin(t, fmt.Sprintf("k%02d", i), false)
		world[l.DownstreamKey("authorize")] = reconcile.Outcome(1 + i%2)
	}
	w.clock.Advance(2 * time.Minute)
	var wg sync.WaitGroup
	reports := make([]reconcile.Report, 4)
	for i := range reports {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := w.reconciler(t, world)
			rep, err := r.RunOnce(ctx)
			if err != nil {
				t.Error(err)
			}
			reports[i] = rep
		}()
	}
	wait.Done(t, 2*time.Minute, "the concurrent goroutines to finish", wg.Wait)
	var settled reconcile.Report
	for _, r := range reports {
		settled.Completed += r.Completed
		settled.Failed += r.Failed
		settled.Errors += r.Errors
	}
	if settled.Completed != 30 || settled.Failed != 30 || settled.Errors != 0 {
		t.Fatalf("settled %+v over %+v; want each of 60 records settled once", settled, reports)
	}
}

func TestStartStop(t *testing.T) {
	w := newWorld(t)
	w.begin(t, "k", false)
	w.clock.Advance(2 * time.Minute)
	asked := make(chan struct{}, 10)
	r, err := reconcile.New(reconcile.Config{Engine: w.eng, Interval: time.Hour, Logger: quiet,
		Resolver: reconcile.ResolverFunc(func(context.Context, idem.Record) (reconcile.Resolution, error) {
			asked <- struct{}{}
			return reconcile.Resolution{Outcome: reconcile.Failed}, nil
		})})
	if err != nil {
		t.Fatal(err)
	}
	r.Start(ctx)
	r.Start(ctx) // a second Start does nothing
	wait.Recv(t, asked, 10*time.Second, "the first pass, which Start runs at once")
	r.Stop()
	r.Stop()
	if out := w.decide(t, "k"); out.Decision != idem.Execute {
		t.Fatalf("after the background pass: %v", out.Decision)
	}
}

func TestHTTPResolver(t *testing.T) {
	var got map[string]any
	srv := httptest.NewServer(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		json.NewDecoder(r.Body).Decode(&got)
		switch got["key"] {
		case "done":
			fmt.Fprint(rw, `{"outcome":"completed","status":201,"header":{"Content-Type":["application/json"]},"body":"{\"id\":1}"}`)
		case "nothing":
			fmt.Fprint(rw, `{"outcome":"failed"}`)
		case "odd":
			fmt.Fprint(rw, `{"outcome":"maybe"}`)
		case "down":
			rw.WriteHeader(500)
		default:
			fmt.Fprint(rw, `{"outcome":"unknown"}`)
		}
	}))
	defer srv.Close()
	res := reconcile.HTTPResolver{URL: srv.URL}
	rec := func(key string) idem.Record {
		return idem.Record{Key: key, State: idem.StateUnknown, Checkpoints: []idem.Checkpoint{{Name: "authorize", Data: []byte("K")}}}
	}
	r, err := res.Resolve(ctx, rec("done"))
	if err != nil || r.Outcome != reconcile.Completed || r.Response.Status != 201 || string(r.Response.Body) != `{"id":1}` ||
		r.Response.Header.Get("Content-Type") != "application/json" {
		t.Fatalf("completed: %+v, %v", r, err)
	}
	if cps, _ := got["checkpoints"].([]any); len(cps) != 1 || got["state"] != "unknown" {
		t.Fatalf("the resolver was sent %v", got)
	}
	if r, err := res.Resolve(ctx, rec("nothing")); err != nil || r.Outcome != reconcile.Failed {
		t.Fatalf("failed: %+v, %v", r, err)
	}
	if r, err := res.Resolve(ctx, rec("later")); err != nil || r.Outcome != reconcile.StillUnknown {
		t.Fatalf("unknown: %+v, %v", r, err)
	}
	for _, key := range []string{"odd", "down"} {
		if _, err := res.Resolve(ctx, rec(key)); err == nil {
			t.Errorf("%s: no error", key)
		}
	}
}

func TestNewValidates(t *testing.T) {
	if _, err := reconcile.New(reconcile.Config{}); !errors.Is(err, idem.ErrInvalid) {
		t.Fatalf("New without engine: %v", err)
	}
}

// outageStore fails every call with ErrUnavailable while down.
type outageStore struct {
	idem.Store
	down atomic.Bool
}

func (s *outageStore) Scan(ctx context.Context, p store.ScanParams) (idem.ScanResult, error) {
	if s.down.Load() {
		return idem.ScanResult{}, idem.ErrUnavailable
	}
	return s.Store.Scan(ctx, p)
}

// TestOwnersGoFirstAfterAnOutage: while the store was away, owners kept
// their outcomes in their journals. Once it is back, the reconciler leaves
// them a whole grace to store those themselves — even for records whose
// lease ran out long ago — before it asks the resolver: the outcome a
// client saw is the one that stands.
func TestOwnersGoFirstAfterAnOutage(t *testing.T) {
	clock := storetest.NewClock(time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC))
	store := &outageStore{Store: memstore.New()}
	eng, err := idem.New(idem.Config{Store: store, Clock: clock, Lease: 30 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	out, err := eng.Begin(ctx, idem.BeginParams{Key: "k", Fingerprint: payload("k")})
	if err != nil {
		t.Fatal(err)
	}
	var asked atomic.Int64
	r, err := reconcile.New(reconcile.Config{Engine: eng, Grace: time.Minute, Logger: quiet,
		Resolver: reconcile.ResolverFunc(func(context.Context, idem.Record) (reconcile.Resolution, error) {
			asked.Add(1)
			return reconcile.Resolution{Outcome: reconcile.Completed, Response: &idem.Response{Status: 201, Body: []byte("from the resolver")}}, nil
		})})
	if err != nil {
		t.Fatal(err)
	}
	clock.Advance(5 * time.Minute) // the lease ran out long ago
	store.down.Store(true)
	if _, err := r.RunOnce(ctx); !errors.Is(err, idem.ErrUnavailable) {
		t.Fatalf("a pass during the outage: %v", err)
	}
	store.down.Store(false)
	clock.Advance(time.Second)
	rep, err := r.RunOnce(ctx)
	if err != nil || rep.Waiting != 1 || asked.Load() != 0 {
		t.Fatalf("the first pass after the outage: %+v, %v, resolver asked %d times; want it to wait", rep, err, asked.Load())
	}
	if err := eng.Complete(ctx, out.Lease, &idem.Response{Status: 201, Body: []byte("the owner's")}); err != nil {
		t.Fatalf("the owner's outcome after the outage: %v", err)
	}
	if got := w(eng).decide(t, "k"); string(got.Record.Response.Body) != "the owner's" {
		t.Fatalf("replay = %q, want the owner's outcome", got.Record.Response.Body)
	}

	// Without an owner to come back, the reconciler steps in a grace later.
	out, err = eng.Begin(ctx, idem.BeginParams{Key: "k2", Fingerprint: payload("k2")})
	if err != nil {
		t.Fatal(err)
	}
	clock.Advance(5 * time.Minute)
	store.down.Store(true)
	r.RunOnce(ctx)
	store.down.Store(false)
	clock.Advance(time.Minute)
	if rep, err := r.RunOnce(ctx); err != nil || rep.Completed != 1 {
		t.Fatalf("a grace after the outage: %+v, %v; want the record settled", rep, err)
	}
}

func w(eng *idem.Engine) *world { return &world{eng: eng} }

// TestResolveLeavesTheOwnerItsGrace: an operator's Resolve of a record
// whose lease has just ended is refused for the reconciler's grace, as the
// reconciler's own pass would be: an owner whose renewals failed may still
// be storing its outcome, and releasing its key would run the request
// again. (It was allowed the moment the lease ended.)
func TestResolveLeavesTheOwnerItsGrace(t *testing.T) {
	w := newWorld(t)
	w.begin(t, "k", false)
	w.clock.Advance(31 * time.Second) // the 30 s lease has ended
	rec, err := w.eng.Get(ctx, "", "k")
	if err != nil {
		t.Fatal(err)
	}
	if err := reconcile.Resolve(ctx, w.eng, rec, reconcile.Resolution{Outcome: reconcile.Failed}, false); !errors.Is(err, reconcile.ErrLeaseRunning) {
		t.Fatalf("Resolve a second after the lease: %v, want ErrLeaseRunning", err)
	}
	if reconcile.Abandoned(rec, w.eng.Now()) {
		t.Fatal("Abandoned a second after the lease, want not yet")
	}
	w.clock.Advance(reconcile.DefaultGrace)
	if !reconcile.Abandoned(rec, w.eng.Now()) {
		t.Fatal("not Abandoned past the grace")
	}
	if err := reconcile.Resolve(ctx, w.eng, rec, reconcile.Resolution{Outcome: reconcile.Failed}, false); err != nil {
		t.Fatalf("Resolve past the grace: %v", err)
	}
}

// TestResolveJudgesTheRecordAsItIsNow: the operator's copy of a record (from
// a listing that took minutes to page through) shows a lease long ended,
// but its owner has renewed it since, under the same token. Resolve judged
// the copy and settled the record under the running owner: the next retry
// ran the request a second time and the owner's outcome was refused. It
// reads the record again and refuses; a record taken by another lease
// since the copy is refused as changed.
func TestResolveJudgesTheRecordAsItIsNow(t *testing.T) {
	w := newWorld(t)
	lease := w.begin(t, "k", false)
	seen, err := w.eng.Get(ctx, "", "k")
	if err != nil {
		t.Fatal(err)
	}
	for range 12 { // two minutes of renewals
		w.clock.Advance(10 * time.Second)
		if lease, err = w.eng.Renew(ctx, lease); err != nil {
			t.Fatal(err)
		}
	}
	if err := reconcile.Resolve(ctx, w.eng, seen, reconcile.Resolution{Outcome: reconcile.Failed}, false); !errors.Is(err, reconcile.ErrLeaseRunning) {
		t.Fatalf("Resolve of a record whose owner renews: %v; want ErrLeaseRunning", err)
	}
	if err := w.eng.Complete(ctx, lease, &idem.Response{Status: 201, Body: []byte("charged k")}); err != nil {
		t.Fatalf("the owner's outcome: %v", err)
	}
	if out := w.decide(t, "k"); out.Decision != idem.Replay {
		t.Fatalf("a retry: %v; want the owner's outcome replayed", out.Decision)
	}
	if err := reconcile.Resolve(ctx, w.eng, seen, reconcile.Resolution{Outcome: reconcile.Failed}, true); !errors.Is(err, reconcile.ErrSettled) {
		t.Fatalf("Resolve, forced, of the settled record: %v; want ErrSettled", err)
	}

	// Taken over: the copy's lease ended, another took the key.
	w.begin(t, "k2", true)
	seen, _ = w.eng.Get(ctx, "", "k2")
	w.clock.Advance(31 * time.Second)
	w.begin(t, "k2", true)
	w.clock.Advance(reconcile.DefaultGrace)
	if err := reconcile.Resolve(ctx, w.eng, seen, reconcile.Resolution{Outcome: reconcile.Failed}, true); !errors.Is(err, idem.ErrLeaseLost) {
		t.Fatalf("Resolve of a record taken by another lease since: %v; want ErrLeaseLost", err)
	}
}

// TestResolveLeavesAnUnknownRecordItsGrace: a retry that comes after the
// lease ended marks the record UNKNOWN at once; an operator's Resolve of it
// is then refused for the grace, as the reconciler's pass waits and as it
// was for the same record IN_PROGRESS. (It was accepted at once: the
// owner's late outcome was refused and the next retry ran the request
// again.)
func TestResolveLeavesAnUnknownRecordItsGrace(t *testing.T) {
	w := newWorld(t)
	lease := w.begin(t, "k", false)
	w.clock.Advance(31 * time.Second) // the owner's renewals failed; its lease just ended
	if out := w.decide(t, "k"); out.Decision != idem.Uncertain {
		t.Fatalf("a retry: %v; want uncertain", out.Decision)
	}
	rec, err := w.eng.Get(ctx, "", "k")
	if err != nil || rec.State != idem.StateUnknown {
		t.Fatal(rec.State, err)
	}
	if rep, _ := w.reconciler(t, acquirer{}).RunOnce(ctx); rep.Waiting != 1 {
		t.Fatalf("the reconciler's pass: %+v; want it waiting", rep)
	}
	if reconcile.Abandoned(rec, w.eng.Now()) {
		t.Fatal("Abandoned a second after it became unknown")
	}
	if err := reconcile.Resolve(ctx, w.eng, rec, reconcile.Resolution{Outcome: reconcile.Failed}, false); !errors.Is(err, reconcile.ErrLeaseRunning) {
		t.Fatalf("Resolve a second after it became unknown: %v; want ErrLeaseRunning", err)
	}
	if err := w.eng.Complete(ctx, lease, &idem.Response{Status: 201, Body: []byte("charged k")}); err != nil {
		t.Fatalf("the owner's late outcome: %v", err)
	}
	if out := w.decide(t, "k"); out.Decision != idem.Replay {
		t.Fatalf("the next retry: %v; want the owner's outcome replayed", out.Decision)
	}
	// Past the grace, an unknown record is the operator's.
	w.begin(t, "k2", false)
	w.clock.Advance(31 * time.Second)
	w.decide(t, "k2")
	w.clock.Advance(reconcile.DefaultGrace)
	rec, _ = w.eng.Get(ctx, "", "k2")
	if !reconcile.Abandoned(rec, w.eng.Now()) {
		t.Fatal("not Abandoned past the grace")
	}
	if err := reconcile.Resolve(ctx, w.eng, rec, reconcile.Resolution{Outcome: reconcile.Failed}, false); err != nil {
		t.Fatalf("Resolve past the grace: %v", err)
	}
}

// TestResolvedHeadersAreStoredForAReplay: a resolution's headers are stored
// as a handler's are: names in canonical form (a resolver in Node sends
// "content-type": replayed raw, net/http sniffed a second Content-Type
// beside it), without credentials, cookies and hop-by-hop headers (which
// were stored and replayed).
func TestResolvedHeadersAreStoredForAReplay(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		fmt.Fprint(rw, `{"outcome":"completed","status":201,"header":{"content-type":["application/json"],"set-cookie":["session=s3cret"],"Connection":["close"],"x-charge":["ch_1"]},"body":"{}"}`)
	}))
	defer srv.Close()
	w := newWorld(t)
	w.begin(t, "k", false)
	w.clock.Advance(5 * time.Minute)
	r, err := reconcile.New(reconcile.Config{Engine: w.eng, Resolver: reconcile.HTTPResolver{URL: srv.URL}, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	if rep, err := r.RunOnce(ctx); err != nil || rep.Completed != 1 {
		t.Fatalf("%+v %v", rep, err)
	}
	rec, err := w.eng.Get(ctx, "", "k")
	if err != nil {
		t.Fatal(err)
	}
	h := rec.Response.Header
	if len(h["Content-Type"]) != 1 || len(h["X-Charge"]) != 1 || h["content-type"] != nil || h.Get("Set-Cookie") != "" || h.Get("Connection") != "" {
		t.Fatalf("stored headers %v; want Content-Type and X-Charge, canonical, and neither Set-Cookie nor Connection", h)
	}
}

// TestReconcilerLogsNoSecrets: the resolver's URL is logged without its
// password, and a record is named by its key hash, not its scope (which a
// Scope function may make of a caller's credentials).
func TestReconcilerLogsNoSecrets(t *testing.T) {
	down := httptest.NewServer(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) { rw.WriteHeader(500) }))
	defer down.Close()
	w := newWorld(t)
	if _, err := w.eng.Begin(ctx, idem.BeginParams{Scope: "sk_live_tenant", Key: "k", Fingerprint: payload("k")}); err != nil {
		t.Fatal(err)
	}
	w.clock.Advance(5 * time.Minute)
	var logs strings.Builder
	r, err := reconcile.New(reconcile.Config{Engine: w.eng, Logger: slog.New(slog.NewTextHandler(&logs, nil)),
		Resolver: reconcile.HTTPResolver{URL: strings.Replace(down.URL, "http://", "http://idem:s3cret-pw@", 1)}})
	if err != nil {
		t.Fatal(err)
	}
	if rep, _ := r.RunOnce(ctx); rep.Errors != 1 {
		t.Fatalf("%+v; want the resolver's error", rep)
	}
	for _, secret := range []string{"s3cret-pw", "sk_live_tenant"} {
		if strings.Contains(logs.String(), secret) {
			t.Errorf("the log shows %q:\n%s", secret, logs.String())
		}
	}
}

// laggingScan is a store whose Scan answers from an index that lags, as a
// DynamoDB global secondary index may: it returns the record as it was when
// snapped, however it changed since.
type laggingScan struct {
	idem.Store
	snapped []idem.Record
}

func (s *laggingScan) Scan(context.Context, store.ScanParams) (store.ScanResult, error) {
	return store.ScanResult{Records: s.snapped}, nil
}

// TestReconcilerReadsTheRecordBeforeSettling: a record whose scan view is
// stale (its owner has renewed the lease since) is left to its owner: the
// reconciler reads the record itself before it asks the resolver. (The
// stale view was settled with the owner's token while its lease was live,
// and a retry ran the request again.)
func TestReconcilerReadsTheRecordBeforeSettling(t *testing.T) {
	clock := storetest.NewClock(time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC))
	s := &laggingScan{Store: memstore.New()}
	eng, err := idem.New(idem.Config{Store: s, Clock: clock, Lease: 30 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	out, err := eng.Begin(ctx, idem.BeginParams{Key: "k", Fingerprint: payload("k")})
	if err != nil {
		t.Fatal(err)
	}
	rec, err := eng.Get(ctx, "", "k")
	if err != nil {
		t.Fatal(err)
	}
	s.snapped = []idem.Record{rec}
	lease := out.Lease
	for range 4 { // the owner renews every 25 s; the index still shows its first lease
		clock.Advance(25 * time.Second)
		if lease, err = eng.Renew(ctx, lease); err != nil {
			t.Fatal(err)
		}
	}
	var asked atomic.Int64
	r, err := reconcile.New(reconcile.Config{Engine: eng, Logger: quiet, Resolver: reconcile.ResolverFunc(func(context.Context, idem.Record) (reconcile.Resolution, error) {
		asked.Add(1)
		return reconcile.Resolution{Outcome: reconcile.Failed}, nil // the downstream has not seen the owner's call yet
	})})
	if err != nil {
		t.Fatal(err)
	}
	rep, err := r.RunOnce(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if asked.Load() != 0 || rep.Failed != 0 {
		t.Fatalf("%+v, the resolver asked %d times; want the running record left alone", rep, asked.Load())
	}
	if err := eng.Complete(ctx, lease, &idem.Response{Status: 201}); err != nil {
		t.Fatalf("the owner's outcome: %v", err)
	}
}

// hangingScan is a store whose Scan never answers (a connection black-holed).
type hangingScan struct{ idem.Store }

func (hangingScan) Scan(ctx context.Context, _ store.ScanParams) (store.ScanResult, error) {
	<-ctx.Done()
	return store.ScanResult{}, ctx.Err()
}

// TestScanIsBounded: a pass whose scan is not answered ends with the
// store's timeout, as unavailable, instead of hanging until TCP gives up.
func TestScanIsBounded(t *testing.T) {
	eng, err := idem.New(idem.Config{Store: hangingScan{memstore.New()}, StoreTimeout: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	r, err := reconcile.New(reconcile.Config{Engine: eng, Resolver: acquirer{}, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { _, err := r.RunOnce(ctx); done <- err }()
	select {
	case err := <-done:
		if !errors.Is(err, idem.ErrUnavailable) {
			t.Fatalf("a scan not answered: %v; want unavailable", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("a pass whose scan is not answered still runs after 10 s (store timeout 100ms)")
	}
}

// flakyGet fails every read of one record as unavailable (one slow call
// past the store timeout, say), on every pass.
type flakyGet struct {
	idem.Store
	bad string
}

func (f flakyGet) Get(ctx context.Context, p store.GetParams) (idem.Record, error) {
	if p.Key == f.bad {
		return idem.Record{}, fmt.Errorf("%w: timeout", idem.ErrUnavailable)
	}
	return f.Store.Get(ctx, p)
}

// TestOneUnavailableRecordDoesNotStarveTheRest: one record whose read fails
// as unavailable on every pass is that record's error; the records after it
// in key order are settled in the same pass (it used to restart the grace
// for every record, on every pass, for good).
func TestOneUnavailableRecordDoesNotStarveTheRest(t *testing.T) {
	clock := storetest.NewClock(time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC))
	eng, err := idem.New(idem.Config{Store: flakyGet{Store: memstore.New(), bad: "b"}, Clock: clock, Lease: 30 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"a", "b", "c", "d"} {
		if _, err := eng.Begin(ctx, idem.BeginParams{Key: k, Fingerprint: payload(k)}); err != nil {
			t.Fatal(err)
		}
	}
	clock.Advance(5 * time.Minute)
	settled := map[string]bool{}
	r, err := reconcile.New(reconcile.Config{Engine: eng, Grace: time.Minute, Logger: quiet,
		Resolver: reconcile.ResolverFunc(func(_ context.Context, rec idem.Record) (reconcile.Resolution, error) {
			settled[rec.Key] = true
			return reconcile.Resolution{Outcome: reconcile.Failed}, nil
		})})
	if err != nil {
		t.Fatal(err)
	}
	for pass := range 3 {
		rep, err := r.RunOnce(ctx)
		if err != nil || rep.Errors != 1 {
			t.Fatalf("pass %d: %+v, %v; want b counted as an error", pass, rep, err)
		}
		clock.Advance(reconcile.DefaultInterval)
	}
	if !settled["a"] || !settled["c"] || !settled["d"] || settled["b"] {
		t.Fatalf("settled %v after 3 passes; want a, c and d (b cannot be read)", settled)
	}
}

// runOfFailures fails every read as unavailable while down: a store that
// went away after the scan.
type runOfFailures struct {
	idem.Store
	down atomic.Bool
}

func (s *runOfFailures) Get(ctx context.Context, p store.GetParams) (idem.Record, error) {
	if s.down.Load() {
		return idem.Record{}, idem.ErrUnavailable
	}
	return s.Store.Get(ctx, p)
}

// TestARunOfFailedReadsIsAnOutage: reads of several records in a row that
// fail as unavailable mean the store went away mid-pass: the records after
// them, and every record on the next pass, wait a grace (owners go first).
func TestARunOfFailedReadsIsAnOutage(t *testing.T) {
	clock := storetest.NewClock(time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC))
	s := &runOfFailures{Store: memstore.New()}
	eng, err := idem.New(idem.Config{Store: s, Clock: clock, Lease: 30 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	for i := range 5 {
		key := fmt.Sprintf("k%d", i)
		if _, err := eng.Begin(ctx, idem.BeginParams{Key: key, Fingerprint: payload(key)}); err != nil {
			t.Fatal(err)
		}
	}
	clock.Advance(5 * time.Minute)
	r, err := reconcile.New(reconcile.Config{Engine: eng, Grace: time.Minute, Logger: quiet, Resolver: reconcile.ResolverFunc(
		func(context.Context, idem.Record) (reconcile.Resolution, error) {
			return reconcile.Resolution{Outcome: reconcile.Failed}, nil
		})})
	if err != nil {
		t.Fatal(err)
	}
	s.down.Store(true)
	if rep, err := r.RunOnce(ctx); err != nil || rep.Errors != 3 || rep.Waiting != 2 {
		t.Fatalf("the pass the store went away in: %+v, %v; want 3 errors, then the rest waiting", rep, err)
	}
	s.down.Store(false)
	clock.Advance(time.Second)
	if rep, err := r.RunOnce(ctx); err != nil || rep.Waiting != 5 {
		t.Fatalf("the pass after: %+v, %v; want every record waiting", rep, err)
	}
	clock.Advance(time.Minute)
	if rep, err := r.RunOnce(ctx); err != nil || rep.Failed != 5 {
		t.Fatalf("a grace later: %+v, %v; want every record settled", rep, err)
	}
}

// TestAHungResolverTimesOut: a resolver that does not answer (a lookup
// without a deadline of its own) is cancelled after ResolveTimeout; its
// record is an error, logged, and left for the next pass, and the pass goes
// on to the next record.
func TestAHungResolverTimesOut(t *testing.T) {
	w := newWorld(t)
	w.begin(t, "hung", false)
	w.begin(t, "next", false)
	w.clock.Advance(2 * time.Minute)
	var logged testkit.SyncBuffer
	log := slog.New(slog.NewTextHandler(&logged, nil))
	r, err := reconcile.New(reconcile.Config{Engine: w.eng, Logger: log, ResolveTimeout: 50 * time.Millisecond,
		Resolver: reconcile.ResolverFunc(func(ctx context.Context, rec idem.Record) (reconcile.Resolution, error) {
			if rec.Key == "hung" {
				<-ctx.Done()
				return reconcile.Resolution{}, ctx.Err()
			}
			return reconcile.Resolution{Outcome: reconcile.Failed}, nil
		})})
	if err != nil {
		t.Fatal(err)
	}
	var rep reconcile.Report
	wait.Done(t, 10*time.Second, "a pass whose resolver hangs on one record (timeout 50ms)", func() { rep, err = r.RunOnce(ctx) })
	if err != nil || rep.Errors != 1 || rep.Failed != 1 {
		t.Fatalf("report %+v, %v; want the hung record an error, the next one settled", rep, err)
	}
	line := logged.String()
	if !strings.Contains(line, "did not answer in time") || !strings.Contains(line, idem.KeyHash("", "hung")) {
		t.Fatalf("log %q; want the record that timed out named", line)
	}
	if out := w.decide(t, "hung"); out.Decision != idem.Uncertain {
		t.Fatalf("the record whose resolver timed out: %v; want it left unsettled", out.Decision)
	}
	if _, err := reconcile.New(reconcile.Config{Engine: w.eng, Resolver: acquirer{}, ResolveTimeout: -time.Second}); !errors.Is(err, idem.ErrInvalid) {
		t.Fatalf("a negative resolve timeout: %v", err)
	}
}

// TestStopWaitsForTheRecordUnderWayOnly: Stop lets the pass settle the
// record it is on, its resolver's call bounded by ResolveTimeout (a call
// that hangs held Stop for good), and leaves the records after it.
func TestStopWaitsForTheRecordUnderWayOnly(t *testing.T) {
	w := newWorld(t)
	w.begin(t, "a-hung", false)
	w.begin(t, "b-next", false)
	w.clock.Advance(2 * time.Minute)
	entered := make(chan struct{}, 2)
	r, err := reconcile.New(reconcile.Config{Engine: w.eng, Logger: quiet, ResolveTimeout: 2 * time.Second,
		Resolver: reconcile.ResolverFunc(func(ctx context.Context, _ idem.Record) (reconcile.Resolution, error) {
			entered <- struct{}{}
			<-ctx.Done()
			return reconcile.Resolution{}, ctx.Err()
		})})
	if err != nil {
		t.Fatal(err)
	}
	r.Start(ctx)
	wait.Recv(t, entered, 10*time.Second, "the resolver's call")
	wait.Done(t, 10*time.Second, "Stop, with the resolver's call in flight (ResolveTimeout 2s)", r.Stop)
	if n := len(entered); n != 0 {
		t.Fatalf("the resolver was asked about %d more record(s) after Stop", n)
	}
	for _, key := range []string{"a-hung", "b-next"} {
		if out := w.decide(t, key); out.Decision != idem.Uncertain {
			t.Fatalf("%s after the stopped pass: %v; want it left unsettled", key, out.Decision)
		}
	}
}

// TestStartAfterTheContextEnded: a loop that ended with its context (a
// request's, a test's) does not keep a later Start from running passes.
func TestStartAfterTheContextEnded(t *testing.T) {
	w := newWorld(t)
	w.begin(t, "k", false)
	w.clock.Advance(2 * time.Minute)
	passes := make(chan reconcile.Report, 10)
	r, err := reconcile.New(reconcile.Config{Engine: w.eng, Interval: time.Hour, Logger: quiet,
		OnPass: func(rep reconcile.Report) { passes <- rep },
		Resolver: reconcile.ResolverFunc(func(ctx context.Context, _ idem.Record) (reconcile.Resolution, error) {
			return reconcile.Resolution{Outcome: reconcile.Failed}, nil
		})})
	if err != nil {
		t.Fatal(err)
	}
	ended, cancel := context.WithCancel(ctx)
	cancel()
	r.Start(ended)
	r.Start(ctx)
	if rep := wait.Recv(t, passes, 10*time.Second, "a pass of the second Start"); rep.Failed != 1 {
		t.Fatalf("the second Start's pass: %+v; want the record settled failed", rep)
	}
	r.Stop()
	if out := w.decide(t, "k"); out.Decision != idem.Execute {
		t.Fatalf("after the second Start's pass: %v", out.Decision)
	}
}

// snapScan runs before once, right after the first scan.
type snapScan struct {
	idem.Store
	before func()
	done   bool
}

func (s *snapScan) Scan(ctx context.Context, p store.ScanParams) (store.ScanResult, error) {
	res, err := s.Store.Scan(ctx, p)
	if !s.done && s.before != nil {
		s.done = true
		s.before()
	}
	return res, err
}

// TestARecordBackInItsGraceIsWaiting: a retry turned an abandoned record
// UNKNOWN between the scan and the read (its grace starts again); the pass
// counts it as waiting, not as lost ("settled elsewhere"): it is not
// settled.
func TestARecordBackInItsGraceIsWaiting(t *testing.T) {
	w := newWorld(t)
	w.begin(t, "k", false)
	w.clock.Advance(2 * time.Minute)
	sc := &snapScan{Store: w.store}
	eng, err := idem.New(idem.Config{Store: sc, Clock: w.clock, Lease: 30 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	r, err := reconcile.New(reconcile.Config{Engine: eng, Logger: quiet, Resolver: acquirer{}})
	if err != nil {
		t.Fatal(err)
	}
	sc.before = func() {
		if out := w.decide(t, "k"); out.Decision != idem.Uncertain {
			t.Errorf("retry: %v", out.Decision)
		}
	}
	rep, err := r.RunOnce(ctx)
	if want := (reconcile.Report{Stale: 1, Waiting: 1}); err != nil || rep != want {
		t.Fatalf("report %+v, %v; want %+v", rep, err, want)
	}
}
