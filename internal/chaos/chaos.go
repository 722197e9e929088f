// Package chaos is idem's chaos suite: several `idem proxy` processes on one
// store, clients that retry with the same key, and faults injected for real
// — proxies SIGKILLed and restarted, replies lost between client and proxy
// and between proxy and upstream, requests cut before they arrive,
// concurrent duplicates, bodyless and bodied requests, store connections
// terminated, and a store outage — while an upstream records every side
// effect it performs. The invariants are then checked from the recorded
// history:
//
//   - no operation executed twice (the upstream saw each key at most once);
//   - every outcome a client saw is replayed byte-identical on retry (no
//     lost outcome), and duplicates saw one outcome;
//   - nothing acknowledged without an execution (every answer a client saw
//     names an execution the upstream performed, with those very bytes and
//     that status, of the very request the client sent: its method, path
//     and body);
//
// and, as figures: operations, requests, faults injected, UNKNOWN records
// left once the reconciler has run, and the time to recover from the outage.
//
// The history is checked once nothing can change it: the journals empty and
// no stale record left, every proxy stopped and the upstream idle (a request
// sent before a proxy stopped may still be running there). Each outcome a
// client saw is then read from the store itself, and replayed through one
// more proxy started with no cache of completed records, since a running
// proxy would replay from its cache a record the store lost.
//
// Run it with go test ./internal/chaos (see chaos_test.go for its flags).
package chaos

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	mrand "math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/httpidem"
	"github.com/idemhq/idem/internal/faultnet"
	"github.com/idemhq/idem/internal/storeopen"
)

// Config is one chaos run.
type Config struct {
	// Bin is the idem binary. Required.
	Bin string
	// Store is the DSN the proxies and the reconciler use. Required.
	Store string
	// Dir holds the journals and the processes' logs. Required.
	Dir string
	// Ops is the number of operations (distinct keys).
	Ops int
	// Clients is how many operations run at once.
	Clients int
	// Proxies is how many `idem proxy` processes share the store.
	Proxies int
	// Duplicates is the share of operations sent twice at once.
	Duplicates float64
	// Bodyless is the share of operations sent without a body (a capture).
	Bodyless float64
	// ClientFaults are injected between the clients and each proxy.
	ClientFaults faultnet.Faults
	// UpstreamFaults are injected between the proxies and the upstream.
	UpstreamFaults faultnet.Faults
	// KillEvery is how often a proxy is SIGKILLed (and restarted); zero
	// for never.
	KillEvery time.Duration
	// CutStore terminates the store's connections and returns how many it
	// terminated; CutEvery is how often.
	CutStore func() int
	CutEvery time.Duration
	// Outage makes the store unreachable until the function it returns is
	// called; OutageFor is how long (zero: no outage). It starts once a
	// third of the operations are done.
	Outage    func() (end func())
	OutageFor time.Duration
	// OpTimeout is how long a client keeps retrying one operation.
	OpTimeout time.Duration
	// Logf reports progress.
	Logf func(format string, args ...any)
}

// Report is what a run found.
type Report struct {
	Store               string
	Ops                 int
	Requests            int64
	Executions          int64
	Elapsed             time.Duration
	Kills               int // SIGKILLs that killed a running proxy
	ClientRepliesLost   int64
	ClientRequestsCut   int64
	UpstreamRepliesLost int64
	UpstreamRequestsCut int64
	StoreCuts           int // store cuts that terminated at least one connection
	Outages             int
	Recovery            time.Duration // from the end of the outage to the first request served; zero if none was
	Reconciled          int           // operations the reconciler asked the upstream about: their record went UNKNOWN (or stale)
	UnknownLeft         int           // records still stale once the reconciler had its time
	JournaledLeft       int           // outcomes still in a journal once the proxies had their time
	DoubleExecutions    int
	Miscounted          int // 1 when the upstream's executions are not one per operation and recovery probe
	LostOutcomes        int
	AckedUnexecuted     int
	DivergentOutcomes   int // duplicates of one key that saw different outcomes
	Unpromised          int // outcomes a client got before they were kept for its retry
	Reconstructed       int // outcomes a client saw that the reconciler, not their owner, stored
	NoFinalAnswer       int
	Unexpected          int // answers the contract never gives to these clients
	Violations          []string
}

// OK reports whether every invariant held: every count of a violation is
// zero, and nothing else was reported as one.
func (r *Report) OK() bool {
	return r.DoubleExecutions == 0 && r.Miscounted == 0 && r.LostOutcomes == 0 && r.AckedUnexecuted == 0 && r.DivergentOutcomes == 0 && r.Unpromised == 0 && r.Reconstructed == 0 &&
		r.Unexpected == 0 && r.NoFinalAnswer == 0 && r.UnknownLeft == 0 && r.JournaledLeft == 0 && len(r.Violations) == 0
}

func (r *Report) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "store %s: %d operations (%d requests, %d executions) in %v\n", r.Store, r.Ops, r.Requests, r.Executions, r.Elapsed.Round(time.Millisecond))
	fmt.Fprintf(&b, "faults: %d proxy SIGKILLs, %d client replies lost, %d client requests cut, %d upstream replies lost, %d upstream requests cut, %d store connection cuts, %d store outages; %d operations went to the reconciler\n",
		r.Kills, r.ClientRepliesLost, r.ClientRequestsCut, r.UpstreamRepliesLost, r.UpstreamRequestsCut, r.StoreCuts, r.Outages, r.Reconciled)
	fmt.Fprintf(&b, "double executions %d, executions miscounted %d, lost outcomes %d, acknowledged without execution %d, answered before kept %d, divergent duplicates %d, no final answer %d, unexpected answers %d, UNKNOWN left %d, journaled left %d",
		r.DoubleExecutions, r.Miscounted, r.LostOutcomes, r.AckedUnexecuted, r.Unpromised, r.DivergentOutcomes, r.NoFinalAnswer, r.Unexpected, r.UnknownLeft, r.JournaledLeft)
	fmt.Fprintf(&b, ", stored by the reconciler instead of their owner %d", r.Reconstructed)
	if r.Outages > 0 {
		fmt.Fprintf(&b, ", recovery after the outage %v", r.Recovery.Round(time.Millisecond))
	}
	for _, v := range r.Violations {
		b.WriteString("\n  " + v)
	}
	return b.String()
}

// op is one operation: a key and the request that carries it.
type op struct {
	key, method, path string
	body              []byte
}

// seen is an outcome a client was given.
type seen struct {
	status              int
	body                []byte
	contentType, expiry string // Content-Type and Idempotency-Expires
	replayed            bool
}

type runner struct {
	cfg        Config
	up         *upstream
	upFault    *faultnet.Proxy
	upSrv      *http.Server  // the upstream, for the proxies
	upServed   chan struct{} // closed when upSrv's Serve has returned
	resolveSrv *http.Server  // the upstream, for the reconciler
	proxies    []*proxyProc
	replayer   *proxyProc // the proxy with no cache that replays at the end
	recon      *proc
	client     *http.Client
	requests   atomic.Int64
	mu         sync.Mutex
	seen       map[string][]seen
	ops        map[string]op
	report     Report
}

// Run runs the suite and returns its report; an error means the run itself
// could not be made (a process would not start), not a broken invariant.
func Run(ctx context.Context, cfg Config) (*Report, error) {
	if cfg.Logf == nil {
		cfg.Logf = func(string, ...any) {}
	}
	r := &runner{cfg: cfg, seen: map[string][]seen{}, ops: map[string]op{}, up: newUpstream(0.05, 200*time.Millisecond)}
	r.report.Store, _, _ = strings.Cut(cfg.Store, ":")
	r.report.Ops = cfg.Ops
	defer r.stop()
	if err := r.start(); err != nil {
		return nil, err
	}
	began := time.Now()
	r.runOps(ctx)
	r.report.Elapsed = time.Since(began)
	opened, err := storeopen.Open(ctx, cfg.Store)
	if err != nil {
		return nil, err
	}
	defer opened.Close()
	// The checker's engine reads what the proxies left: it prunes nothing
	// (a record it is to check must not go under it), and it is closed
	// before its store.
	eng, err := idem.New(idem.Config{Store: opened.Store, CacheSize: -1, PruneInterval: -1})
	if err != nil {
		return nil, err
	}
	defer eng.Close(ctx)
	if err := r.settle(ctx, eng); err != nil {
		return nil, err
	}
	if err := r.drain(); err != nil {
		return nil, err
	}
	if err := r.verify(ctx, eng); err != nil {
		return nil, err
	}
	return &r.report, nil
}

// start brings up the upstream, the proxies and the reconciler.
func (r *runner) start() error {
	if err := r.serveUpstream(); err != nil {
		return err
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	r.resolveSrv = &http.Server{Handler: r.up}
	go r.resolveSrv.Serve(ln)
	r.upFault.SetFaults(r.cfg.UpstreamFaults)
	for i := range r.cfg.Proxies {
		p, err := newProxyProc(r.cfg, strconv.Itoa(i), "http://"+r.upFault.Addr())
		if err != nil {
			return err
		}
		r.proxies = append(r.proxies, p)
		if err := p.start(); err != nil {
			return err
		}
	}
	r.recon = &proc{name: "reconcile", bin: r.cfg.Bin, log: filepath.Join(r.cfg.Dir, "reconcile.log"),
		args: []string{"reconcile", "--store", r.cfg.Store, "--resolver-url", "http://" + ln.Addr().String() + "/resolve",
			"--grace", "3s", "--interval", "300ms"}}
	if err := r.recon.start(); err != nil {
		return err
	}
	r.client = &http.Client{Timeout: 20 * time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: 2 * r.cfg.Clients}}
	return nil
}

// serveUpstream serves the upstream to the proxies, behind a fault proxy,
// its connections tracked (upstream.track).
func (r *runner) serveUpstream() error {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	r.upSrv = &http.Server{Handler: r.up, ConnState: r.up.track}
	r.upServed = make(chan struct{})
	go func() {
		defer close(r.upServed)
		r.upSrv.Serve(ln)
	}()
	r.upFault, err = faultnet.Listen(ln.Addr().String())
	return err
}

func (r *runner) stop() {
	for _, p := range append(r.proxies, r.replayer) {
		if p != nil {
			p.terminate()
			p.fault.Close()
		}
	}
	if r.recon != nil {
		r.recon.terminate()
	}
	if r.upFault != nil {
		r.upFault.Close()
	}
	if r.upSrv != nil {
		r.upSrv.Close()
	}
	if r.resolveSrv != nil {
		r.resolveSrv.Close()
	}
}

// runOps runs the operations on cfg.Clients workers while the fault loops
// run, and stops the faults once the last operation has its answer.
func (r *runner) runOps(ctx context.Context) {
	ops := make(chan int)
	var done atomic.Int64
	var workers sync.WaitGroup
	for w := range r.cfg.Clients {
		workers.Add(1)
		go func() {
			defer workers.Done()
			rng := mrand.New(mrand.NewPCG(uint64(w), uint64(time.Now().UnixNano())))
			for i := range ops {
				o := r.makeOp(i, rng)
				if rng.Float64() < r.cfg.Duplicates {
					var dup sync.WaitGroup
					dup.Add(1)
					go func() {
						defer dup.Done()
						r.do(ctx, o, mrand.New(mrand.NewPCG(uint64(i), 99)))
					}()
					r.do(ctx, o, rng)
					dup.Wait()
				} else {
					r.do(ctx, o, rng)
				}
				if n := done.Add(1); n%max(int64(r.cfg.Ops/10), 1) == 0 {
					r.cfg.Logf("%d/%d operations done, %d requests", n, r.cfg.Ops, r.requests.Load())
				}
			}
		}()
	}
	faultsDone := make(chan struct{})
	var faults sync.WaitGroup
	r.faultLoops(&faults, faultsDone, &done)
	for i := range r.cfg.Ops {
		ops <- i
	}
	close(ops)
	workers.Wait()
	close(faultsDone)
	faults.Wait()
}

func (r *runner) makeOp(i int, rng *mrand.Rand) op {
	key := fmt.Sprintf("op-%07d-%08x", i, rng.Uint32())
	if i%10 == 7 {
		key += "7" // declined at the upstream
	}
	o := op{key: key, method: "POST", path: fmt.Sprintf("/v1/charges/ch_%d/capture", i)}
	if rng.Float64() >= r.cfg.Bodyless {
		body := fmt.Sprintf(`{"amount":%d,"currency":"eur","customer":"cus_%d"}`, 100+rng.IntN(9900), rng.IntN(50))
		o = op{key: key, method: "POST", path: "/v1/charges", body: []byte(body)}
	}
	r.mu.Lock()
	r.ops[key] = o
	r.mu.Unlock()
	return o
}

// do sends one operation until it gets a final answer, through a proxy
// picked at random each time (a load balancer), and records the answer.
func (r *runner) do(ctx context.Context, o op, rng *mrand.Rand) {
	deadline := time.Now().Add(r.cfg.OpTimeout)
	for time.Now().Before(deadline) && ctx.Err() == nil {
		p := r.proxies[rng.IntN(len(r.proxies))]
		got, err := r.send(ctx, "http://"+p.fault.Addr(), o)
		status, body := got.status, got.body
		pause := time.Duration(20+rng.IntN(80)) * time.Millisecond
		switch {
		case err != nil: // the reply was lost, the proxy died, the connection was cut
		case status == http.StatusCreated || status == http.StatusPaymentRequired:
			if got.expiry == "" && !got.replayed {
				r.violation(&r.report.Unpromised, "key %s: the client got %d %s without Idempotency-Expires: not kept for its retry", o.key, status, body)
			}
			r.mu.Lock()
			r.seen[o.key] = append(r.seen[o.key], got)
			r.mu.Unlock()
			return
		case status == http.StatusConflict && bytes.Contains(body, []byte("operation-uncertain")):
			pause = time.Duration(200+rng.IntN(300)) * time.Millisecond // the reconciler settles it
		case status == http.StatusConflict && bytes.Contains(body, []byte("#in-progress")):
		case status == http.StatusBadGateway || status == http.StatusGatewayTimeout || status == http.StatusServiceUnavailable:
		default:
			r.violation(&r.report.Unexpected, "key %s: unexpected answer %d %s", o.key, status, body)
			return
		}
		time.Sleep(pause)
	}
	r.violation(&r.report.NoFinalAnswer, "key %s: no final answer within %v", o.key, r.cfg.OpTimeout)
}

// authorization is the clients' Authorization header.
const authorization = "Bearer sk_chaos"

// probePrefix begins the keys of the requests that measure the recovery
// from the outage.
const probePrefix = "probe-"

func (r *runner) send(ctx context.Context, base string, o op) (seen, error) {
	r.requests.Add(1)
	var body io.Reader
	if o.body != nil {
		body = bytes.NewReader(o.body)
	}
	req, err := http.NewRequestWithContext(ctx, o.method, base+o.path, body)
	if err != nil {
		return seen{}, err
	}
	// The key goes under a lower-case name: the same field on the wire
	// (field names are case-insensitive), but net/http's transport, whose
	// check is case-sensitive, then does not take the POST for replayable
	// and never sends it again by itself when a kept-alive connection
	// breaks. Every resend is the suite's own (do, through a proxy picked at
	// random), and counted in Requests.
	req.Header["idempotency-key"] = []string{o.key}
	req.Header.Set("Authorization", authorization)
	if o.body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := r.client.Do(req)
	if err != nil {
		return seen{}, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return seen{status: resp.StatusCode, body: b, contentType: resp.Header.Get("Content-Type"),
		expiry: resp.Header.Get("Idempotency-Expires"), replayed: resp.Header.Get("Idempotent-Replayed") == "true"}, err
}

// violation counts a broken invariant in counter (when not nil) and keeps
// its description (the first 20); any description fails the run.
func (r *runner) violation(counter *int, format string, args ...any) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if counter != nil {
		*counter++
	}
	if len(r.report.Violations) < 20 {
		r.report.Violations = append(r.report.Violations, fmt.Sprintf(format, args...))
	}
}

// faultLoops starts the kills, the store cuts and the outage, which stop
// when done closes.
func (r *runner) faultLoops(wg *sync.WaitGroup, done <-chan struct{}, opsDone *atomic.Int64) {
	for _, p := range r.proxies {
		p.fault.SetFaults(r.cfg.ClientFaults)
	}
	every := func(d time.Duration, fn func(rng *mrand.Rand)) {
		if d <= 0 {
			return
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := mrand.New(mrand.NewPCG(uint64(d), uint64(time.Now().UnixNano())))
			for {
				select {
				case <-done:
					return
				case <-time.After(d/2 + time.Duration(rng.Int64N(int64(d)))):
				}
				fn(rng)
			}
		}()
	}
	every(r.cfg.KillEvery, func(rng *mrand.Rand) {
		p := r.proxies[rng.IntN(len(r.proxies))]
		if p.kill() {
			r.report.Kills++
		}
		if err := p.start(); err != nil {
			r.cfg.Logf("restarting %s: %v", p.name, err)
		}
	})
	if r.cfg.CutStore != nil {
		every(r.cfg.CutEvery, func(*mrand.Rand) {
			if r.cfg.CutStore() > 0 {
				r.report.StoreCuts++
			}
		})
	}
	if r.cfg.Outage != nil && r.cfg.OutageFor > 0 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for opsDone.Load() < int64(r.cfg.Ops/3) {
				select {
				case <-done:
					return
				case <-time.After(10 * time.Millisecond):
				}
			}
			r.cfg.Logf("store outage for %v", r.cfg.OutageFor)
			end := r.cfg.Outage()
			time.Sleep(r.cfg.OutageFor)
			end()
			r.report.Outages++
			ended := time.Now()
			for i := 0; time.Since(ended) < recoveryBound; i++ {
				got, err := r.send(context.Background(), "http://"+r.proxies[i%len(r.proxies)].listen,
					op{key: fmt.Sprintf("%s%d-%d", probePrefix, ended.UnixNano(), i), method: "POST", path: "/v1/probe", body: []byte("{}")})
				if err == nil && got.status == http.StatusCreated {
					r.report.Recovery = time.Since(ended)
					r.cfg.Logf("served again %v after the outage", r.report.Recovery.Round(time.Millisecond))
					return
				}
				time.Sleep(10 * time.Millisecond)
			}
			r.cfg.Logf("no request served within %v of the outage's end", recoveryBound)
		}()
	}
}

// The bounds of the end of a run.
const (
	// settleBound is how long the journals and the reconciler have to settle
	// what the faults left once they stop.
	settleBound = 60 * time.Second
	// idleBound is how long the upstream has to finish the requests the
	// proxies sent before they stopped.
	idleBound = 30 * time.Second
	// recoveryBound is how long after the outage a request must be served.
	recoveryBound = time.Minute
)

// settle turns the faults off, restarts every proxy that is down, and waits
// until the journals are empty and the reconciler has settled what it can.
func (r *runner) settle(ctx context.Context, eng *idem.Engine) error {
	r.upFault.SetFaults(faultnet.Faults{})
	for _, p := range r.proxies {
		p.fault.SetFaults(faultnet.Faults{})
		if !p.running() {
			if err := p.start(); err != nil {
				return err
			}
		}
	}
	journaled := func() int {
		n := 0
		for _, p := range r.proxies {
			entries, _ := filepath.Glob(filepath.Join(p.journal, "*.json"))
			n += len(entries)
		}
		return n
	}
	if err := r.awaitSettled(ctx, settleBound, journaled, func(ctx context.Context) (int, error) { return stale(ctx, eng) }); err != nil {
		return err
	}
	var cs, cr int64
	for _, p := range r.proxies {
		s := p.fault.Stats()
		cs += s.RepliesDropped
		cr += s.RequestsDropped
	}
	us := r.upFault.Stats()
	r.report.ClientRepliesLost, r.report.ClientRequestsCut = cs, cr
	r.report.UpstreamRepliesLost, r.report.UpstreamRequestsCut = us.RepliesDropped, us.RequestsDropped
	return nil
}

// awaitSettled waits, up to bound, until no journal holds an outcome and
// the store lists no stale record. What is left then is counted as a
// violation (JournaledLeft, UnknownLeft); a store that cannot list its
// stale records at the end is an error, since nothing can be said then.
func (r *runner) awaitSettled(ctx context.Context, bound time.Duration, journaled func() int, stale func(context.Context) (int, error)) error {
	deadline := time.Now().Add(bound)
	for {
		pending := journaled()
		n, err := stale(ctx)
		if err == nil && pending == 0 && n == 0 {
			return nil
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if time.Now().After(deadline) {
			if err != nil {
				return fmt.Errorf("settling: the store's stale records could not be listed %v after the run: %w", bound, err)
			}
			r.report.UnknownLeft, r.report.JournaledLeft = n, pending
			r.violation(nil, "%d stale records and %d journaled outcomes left %v after the run", n, pending, bound)
			return nil
		}
		time.Sleep(200 * time.Millisecond) // nothing signals that the store settled: look again
	}
}

// stale counts the store's stale records, every page of them.
func stale(ctx context.Context, eng *idem.Engine) (int, error) {
	n, cursor := 0, ""
	for {
		res, err := eng.Scan(ctx, 0, cursor)
		if err != nil {
			return 0, err
		}
		n += len(res.Records)
		if cursor = res.Cursor; cursor == "" {
			return n, nil
		}
	}
}

// drain stops every proxy at once, then the way to the upstream, and counts
// the executions once the upstream has finished what it was running.
func (r *runner) drain() error {
	var wg sync.WaitGroup
	for _, p := range r.proxies {
		wg.Add(1)
		go func() {
			defer wg.Done()
			p.terminate()
		}()
	}
	wg.Wait()
	return r.quiesce()
}

// quiesce closes the way to the upstream — the fault proxy (whose Close
// waits for the bytes on their way), then the server and its listener — and
// waits until no connection is open to the upstream, so that no request is
// still running there, then counts the executions. A request a proxy sent
// before it stopped is recorded only once it has run, which may be well
// after the proxy is gone.
func (r *runner) quiesce() error {
	r.upFault.Close()
	r.upSrv.Close()
	select {
	case <-r.upServed: // every connection it accepted is counted as open
	case <-time.After(idleBound):
		return fmt.Errorf("the upstream's server did not stop within %v", idleBound)
	}
	if !r.up.waitIdle(idleBound) {
		return fmt.Errorf("the upstream still had a connection open %v after every proxy stopped: its executions cannot be counted", idleBound)
	}
	r.report.Executions = r.up.total()
	return nil
}

// verify checks the invariants against the recorded history, once nothing
// can change it: the executions, then each outcome a client saw, in the
// store and through a proxy with no cache.
func (r *runner) verify(ctx context.Context, eng *idem.Engine) error {
	r.report.Requests = r.requests.Load()
	r.checkExecutions()
	// Its upstream is the one the other proxies used, closed by now: a
	// replay that would run the request again gets a 502 and is counted.
	p, err := newProxyProc(r.cfg, "replayer", "http://"+r.upFault.Addr(), "--cache-size", "-1")
	if err != nil {
		return err
	}
	r.replayer = p
	if err := p.start(); err != nil {
		return err
	}
	r.checkOutcomes(func(o op) (idem.Record, error) { return storedRecord(ctx, eng, o.key) },
		func(o op) (seen, error) { return r.send(ctx, "http://"+p.listen, o) })
	return nil
}

// checkExecutions checks the executions the upstream recorded: none twice,
// and one per operation and recovery probe in all.
func (r *runner) checkExecutions() {
	r.up.mu.Lock()
	runs := make(map[string][]execution, len(r.up.runs))
	for k, v := range r.up.runs {
		runs[k] = v
	}
	r.up.mu.Unlock()
	probes := 0
	for k, execs := range runs {
		if strings.HasPrefix(k, probePrefix) {
			probes++
		}
		if len(execs) > 1 {
			ids := make([]int64, len(execs))
			for i, e := range execs {
				ids[i] = e.ID
			}
			r.violation(&r.report.DoubleExecutions, "key %s: executed %d times (executions %v)", k, len(execs), ids)
		}
	}
	if want := int64(r.cfg.Ops + probes); r.report.Executions != want {
		r.violation(&r.report.Miscounted, "%d executions at the upstream, for %d operations and %d recovery probes executed: want %d", r.report.Executions, r.cfg.Ops, probes, want)
	}
	r.mu.Lock()
	keys := make([]string, 0, len(r.ops))
	for k := range r.ops {
		keys = append(keys, k)
	}
	r.mu.Unlock()
	for _, k := range keys {
		if r.up.askedAbout(k) {
			r.report.Reconciled++
		}
	}
}

// checkOutcomes checks every outcome a client saw: duplicates saw the same,
// an execution at the upstream answered it, stored is the record the store
// holds (it must hold the outcome, as its owner stored it), and replay its
// retry (it must get the outcome back).
func (r *runner) checkOutcomes(stored func(op) (idem.Record, error), replay func(op) (seen, error)) {
	r.mu.Lock()
	seenByKey := r.seen
	r.mu.Unlock()
	for key, outs := range seenByKey {
		first := outs[0]
		for _, o := range outs[1:] {
			if o.status != first.status || !bytes.Equal(o.body, first.body) {
				r.violation(&r.report.DivergentOutcomes, "key %s: duplicates saw %d %s and %d %s", key, first.status, first.body, o.status, o.body)
			}
		}
		var a answer
		o := r.opOf(key)
		runs := r.up.executions(key)
		if err := json.Unmarshal(first.body, &a); err != nil || !answeredBy(runs, o, a.Exec, first) {
			r.violation(&r.report.AckedUnexecuted, "key %s: the client saw %d %s for %s %s (body sha256 %s), which no execution at the upstream answered (its executions: %s)",
				key, first.status, first.body, o.method, o.path, bodySHA(o.body), describeRuns(runs))
		}
		rec, err := stored(o)
		if err != nil || rec.State != idem.StateCompleted || rec.Response == nil || rec.Response.BodyOmitted ||
			rec.Response.Status != first.status || !bytes.Equal(rec.Response.Body, first.body) || rec.Response.Header.Get("Content-Type") != first.contentType {
			r.violation(&r.report.LostOutcomes, "key %s: the client saw %d %s; the store holds %s", key, first.status, first.body, describe(rec, err))
			continue
		}
		if rec.Response.Header.Get(idem.HeaderExpires) != first.expiry {
			r.violation(&r.report.Reconstructed, "key %s: the client saw an outcome its owner did not store: the store holds it as the reconciler stored it (Idempotency-Expires %q, not %q)",
				key, rec.Response.Header.Get(idem.HeaderExpires), first.expiry)
			continue
		}
		got, err := replay(o)
		if err != nil || got.status != first.status || !bytes.Equal(got.body, first.body) || got.contentType != first.contentType {
			r.violation(&r.report.LostOutcomes, "key %s: the client saw %d %s; the retry through a proxy with no cache got %d %s (%v)", key, first.status, first.body, got.status, got.body, err)
		} else if got.expiry != first.expiry {
			r.violation(&r.report.Reconstructed, "key %s: the client saw an outcome its owner did not store: the retry got it as the reconciler stored it (Idempotency-Expires %q, not %q)", key, got.expiry, first.expiry)
		}
	}
}

// describe says what a store answered for a record, for a violation.
func describe(rec idem.Record, err error) string {
	switch {
	case err != nil:
		return "no record: " + err.Error()
	case rec.Response == nil:
		return fmt.Sprintf("a record %s with no outcome", rec.State)
	}
	return fmt.Sprintf("a record %s with %d %s (Content-Type %q, body omitted %v)", rec.State, rec.Response.Status, rec.Response.Body,
		rec.Response.Header.Get("Content-Type"), rec.Response.BodyOmitted)
}

// scope is the scope the proxies keep the suite's records under: the
// SHA-256 of the clients' Authorization, idem proxy's default scope header.
var scope = httpidem.HashScope("Authorization")(&http.Request{Header: http.Header{"Authorization": {authorization}}})

// storedRecord reads key's record from the store itself, asking again for a
// while if the store does not answer.
func storedRecord(ctx context.Context, eng *idem.Engine, key string) (idem.Record, error) {
	deadline := time.Now().Add(10 * time.Second)
	for {
		rec, err := eng.Get(ctx, scope, key)
		if !errors.Is(err, idem.ErrUnavailable) || time.Now().After(deadline) {
			return rec, err
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// opOf is the operation of key, for its replay.
func (r *runner) opOf(key string) op {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.ops[key]
}

// answeredBy reports whether the execution id, among runs, is what the
// client of o was given in saw: that execution ran o's very request (its
// method, path and body, as the upstream received them) and answered saw's
// status and bytes. An answer of an execution that ran another request (a
// body lost on the way) or answered another status acknowledges an
// operation that never ran as the client asked.
func answeredBy(runs []execution, o op, id int64, saw seen) bool {
	for _, e := range runs {
		if e.ID == id && bytes.Equal(e.Body, saw.body) && e.Status == saw.status &&
			e.Method == o.method && e.Path == o.path && e.BodySHA == bodySHA(o.body) {
			return true
		}
	}
	return false
}

// bodySHA is the hex SHA-256 of a request body, as the upstream records it
// (a bodyless request's is that of no bytes).
func bodySHA(body []byte) string {
	sum := sha256.Sum256(body)
	return hex.EncodeToString(sum[:])
}

// describeRuns lists executions for a violation.
func describeRuns(runs []execution) string {
	if len(runs) == 0 {
		return "none"
	}
	parts := make([]string, len(runs))
	for i, e := range runs {
		parts[i] = fmt.Sprintf("#%d %s %s body sha256 %s answered %d", e.ID, e.Method, e.Path, e.BodySHA, e.Status)
	}
	return strings.Join(parts, "; ")
}

// proc is a process of the idem binary, restarted on demand, its output
// appended to a log file.
type proc struct {
	name, bin, log string
	args           []string
	mu             sync.Mutex
	cmd            *exec.Cmd
	exited         chan struct{}
}

func (p *proc) start() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	f, err := os.OpenFile(p.log, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		return err
	}
	cmd := exec.Command(p.bin, p.args...)
	cmd.Stdout, cmd.Stderr = f, f
	if err := cmd.Start(); err != nil {
		f.Close()
		return err
	}
	exited := make(chan struct{})
	go func() { cmd.Wait(); f.Close(); close(exited) }()
	p.cmd, p.exited = cmd, exited
	return nil
}

func (p *proc) running() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd == nil {
		return false
	}
	select {
	case <-p.exited:
		return false
	default:
		return true
	}
}

// kill SIGKILLs the process and waits for it to be gone. It reports whether
// it killed it: false if the process was not running, or ended otherwise.
func (p *proc) kill() bool {
	p.mu.Lock()
	cmd, exited := p.cmd, p.exited
	p.mu.Unlock()
	if cmd == nil {
		return false
	}
	select {
	case <-exited:
		return false
	default:
	}
	cmd.Process.Kill()
	<-exited
	ws, ok := cmd.ProcessState.Sys().(syscall.WaitStatus)
	return ok && ws.Signaled() && ws.Signal() == syscall.SIGKILL
}

// terminate asks the process to stop (SIGTERM) and kills it if it has not
// within 10 seconds.
func (p *proc) terminate() {
	p.mu.Lock()
	cmd, exited := p.cmd, p.exited
	p.mu.Unlock()
	if cmd == nil {
		return
	}
	cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-exited:
	case <-time.After(10 * time.Second):
		cmd.Process.Kill()
		<-exited
	}
}

// proxyProc is one `idem proxy` with its fixed ports, its journal and the
// fault proxy its clients go through.
type proxyProc struct {
	*proc
	listen, admin, journal string
	fault                  *faultnet.Proxy
}

// newProxyProc prepares the proxy named id (its files are named after it)
// in front of upstream; extra are more flags.
func newProxyProc(cfg Config, id, upstream string, extra ...string) (*proxyProc, error) {
	listen, err := freeAddr()
	if err != nil {
		return nil, err
	}
	admin, err := freeAddr()
	if err != nil {
		return nil, err
	}
	fault, err := faultnet.Listen(listen)
	if err != nil {
		return nil, err
	}
	p := &proxyProc{listen: listen, admin: admin, journal: filepath.Join(cfg.Dir, "journal-"+id), fault: fault}
	p.proc = &proc{name: "proxy-" + id, bin: cfg.Bin, log: filepath.Join(cfg.Dir, "proxy-"+id+".log"),
		args: append([]string{"proxy", "--listen", listen, "--admin-listen", admin, "--upstream", upstream, "--store", cfg.Store,
			"--journal-dir", p.journal, "--lease", "2s", "--wait", "2s", "--store-timeout", "1s", "--shutdown-timeout", "5s"}, extra...)}
	return p, nil
}

// start starts the proxy and waits until it answers.
func (p *proxyProc) start() error {
	if err := p.proc.start(); err != nil {
		return err
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		resp, err := http.Get("http://" + p.admin + "/healthz")
		if err == nil {
			resp.Body.Close()
			return nil
		}
		if !p.running() {
			out, _ := os.ReadFile(p.log) // the test's directory goes with it: the log's end is in the error
			return fmt.Errorf("%s exited at start; its log ends:\n%s", p.name, out[max(0, len(out)-2000):])
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s did not answer within 30s: %w", p.name, err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func freeAddr() (string, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer ln.Close()
	return ln.Addr().String(), nil
}
