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
//     names an execution the upstream performed, with those very bytes);
//
// and, as figures: operations, requests, faults injected, UNKNOWN records
// left once the reconciler has run, and the time to recover from the outage.
//
// Run it with go test ./internal/chaos (see chaos_test.go for its flags).
package chaos

import (
	"bytes"
	"context"
	"encoding/json"
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
	// CutStore terminates the store's connections; CutEvery is how often.
	CutStore func()
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
	Kills               int
	ClientRepliesLost   int64
	ClientRequestsCut   int64
	UpstreamRepliesLost int64
	UpstreamRequestsCut int64
	StoreCuts           int
	Outages             int
	Recovery            time.Duration // from the end of the outage to the first request served
	UnknownLeft         int           // records still stale once the reconciler had its time
	DoubleExecutions    int
	LostOutcomes        int
	AckedUnexecuted     int
	DivergentOutcomes   int // duplicates of one key that saw different outcomes
	Unpromised          int // outcomes a client got before they were kept for its retry
	Reconstructed       int // outcomes a client saw that the reconciler, not their owner, stored
	NoFinalAnswer       int
	Unexpected          int // answers the contract never gives to these clients
	Violations          []string
}

// OK reports whether every invariant held.
func (r *Report) OK() bool {
	return r.DoubleExecutions == 0 && r.LostOutcomes == 0 && r.AckedUnexecuted == 0 && r.DivergentOutcomes == 0 && r.Unpromised == 0 && r.Reconstructed == 0 &&
		r.Unexpected == 0 && r.NoFinalAnswer == 0 && r.UnknownLeft == 0
}

func (r *Report) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "store %s: %d operations (%d requests, %d executions) in %v\n", r.Store, r.Ops, r.Requests, r.Executions, r.Elapsed.Round(time.Millisecond))
	fmt.Fprintf(&b, "faults: %d proxy SIGKILLs, %d client replies lost, %d client requests cut, %d upstream replies lost, %d upstream requests cut, %d store connection cuts, %d store outages\n",
		r.Kills, r.ClientRepliesLost, r.ClientRequestsCut, r.UpstreamRepliesLost, r.UpstreamRequestsCut, r.StoreCuts, r.Outages)
	fmt.Fprintf(&b, "double executions %d, lost outcomes %d, acknowledged without execution %d, answered before kept %d, divergent duplicates %d, no final answer %d, unexpected answers %d, UNKNOWN left %d",
		r.DoubleExecutions, r.LostOutcomes, r.AckedUnexecuted, r.Unpromised, r.DivergentOutcomes, r.NoFinalAnswer, r.Unexpected, r.UnknownLeft)
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
	cfg      Config
	up       *upstream
	upFault  *faultnet.Proxy
	upSrv    *http.Server
	proxies  []*proxyProc
	recon    *proc
	client   *http.Client
	requests atomic.Int64
	mu       sync.Mutex
	seen     map[string][]seen
	ops      map[string]op
	report   Report
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
	if err := r.settle(ctx); err != nil {
		return nil, err
	}
	r.verify()
	return &r.report, nil
}

// start brings up the upstream, the proxies and the reconciler.
func (r *runner) start() error {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	r.upSrv = &http.Server{Handler: r.up}
	go r.upSrv.Serve(ln)
	if r.upFault, err = faultnet.Listen(ln.Addr().String()); err != nil {
		return err
	}
	r.upFault.SetFaults(r.cfg.UpstreamFaults)
	for i := range r.cfg.Proxies {
		p, err := newProxyProc(r.cfg, i, "http://"+r.upFault.Addr())
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

func (r *runner) stop() {
	for _, p := range r.proxies {
		p.terminate()
		p.fault.Close()
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
	req.Header.Set("Idempotency-Key", o.key)
	req.Header.Set("Authorization", "Bearer sk_chaos")
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

func (r *runner) violation(counter *int, format string, args ...any) {
	r.mu.Lock()
	defer r.mu.Unlock()
	*counter++
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
		p.kill()
		r.report.Kills++
		if err := p.start(); err != nil {
			r.cfg.Logf("restarting %s: %v", p.name, err)
		}
	})
	if r.cfg.CutStore != nil {
		every(r.cfg.CutEvery, func(*mrand.Rand) {
			r.cfg.CutStore()
			r.report.StoreCuts++
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
			for i := 0; ; i++ {
				got, err := r.send(context.Background(), "http://"+r.proxies[i%len(r.proxies)].listen,
					op{key: fmt.Sprintf("probe-%d-%d", ended.UnixNano(), i), method: "POST", path: "/v1/probe", body: []byte("{}")})
				if err == nil && got.status == http.StatusCreated {
					r.report.Recovery = time.Since(ended)
					r.cfg.Logf("served again %v after the outage", r.report.Recovery.Round(time.Millisecond))
					return
				}
				time.Sleep(10 * time.Millisecond)
			}
		}()
	}
}

// settle turns the faults off, restarts every proxy that is down, and waits
// until the journals are empty and the reconciler has settled what it can.
func (r *runner) settle(ctx context.Context) error {
	r.upFault.SetFaults(faultnet.Faults{})
	for _, p := range r.proxies {
		p.fault.SetFaults(faultnet.Faults{})
		if !p.running() {
			if err := p.start(); err != nil {
				return err
			}
		}
	}
	r.report.Executions = r.up.total()
	opened, err := storeopen.Open(ctx, r.cfg.Store)
	if err != nil {
		return err
	}
	defer opened.Close()
	eng, err := idem.New(idem.Config{Store: opened.Store})
	if err != nil {
		return err
	}
	deadline := time.Now().Add(60 * time.Second)
	for {
		pending := 0
		for _, p := range r.proxies {
			entries, _ := filepath.Glob(filepath.Join(p.journal, "*.json"))
			pending += len(entries)
		}
		stale := 0
		cursor := ""
		for {
			res, err := eng.Scan(ctx, 0, cursor)
			if err != nil {
				break
			}
			stale += len(res.Records)
			if cursor = res.Cursor; cursor == "" {
				break
			}
		}
		if pending == 0 && stale == 0 {
			break
		}
		if time.Now().After(deadline) {
			var n int
			r.violation(&n, "%d stale records and %d journaled outcomes left 60s after the run", stale, pending)
			r.report.UnknownLeft = stale
			break
		}
		time.Sleep(200 * time.Millisecond)
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

// verify checks the invariants against the recorded history.
func (r *runner) verify() {
	r.report.Requests = r.requests.Load()
	r.up.mu.Lock()
	for k, runs := range r.up.runs {
		if len(runs) > 1 {
			ids := make([]int64, len(runs))
			for i, e := range runs {
				ids[i] = e.ID
			}
			r.up.mu.Unlock()
			r.violation(&r.report.DoubleExecutions, "key %s: executed %d times (executions %v)", k, len(runs), ids)
			r.up.mu.Lock()
		}
	}
	r.up.mu.Unlock()
	r.mu.Lock()
	seenByKey := r.seen
	r.mu.Unlock()
	i := 0
	for key, outs := range seenByKey {
		first := outs[0]
		for _, o := range outs[1:] {
			if o.status != first.status || !bytes.Equal(o.body, first.body) {
				r.violation(&r.report.DivergentOutcomes, "key %s: duplicates saw %d %s and %d %s", key, first.status, first.body, o.status, o.body)
			}
		}
		var a answer
		runs := r.up.executions(key)
		if err := json.Unmarshal(first.body, &a); err != nil || len(runs) == 0 || !containsExec(runs, a.Exec, first.body) {
			r.violation(&r.report.AckedUnexecuted, "key %s: the client saw %d %s, which no execution at the upstream answered", key, first.status, first.body)
		}
		// The replay, through a proxy, with no fault on the way.
		o := r.opOf(key)
		got, err := r.send(context.Background(), "http://"+r.proxies[i%len(r.proxies)].listen, o)
		i++
		if err != nil || got.status != first.status || !bytes.Equal(got.body, first.body) || got.contentType != first.contentType {
			r.violation(&r.report.LostOutcomes, "key %s: the client saw %d %s; the retry got %d %s (%v)", key, first.status, first.body, got.status, got.body, err)
		} else if got.expiry != first.expiry {
			r.violation(&r.report.Reconstructed, "key %s: the client saw an outcome its owner did not store: the retry got it as the reconciler stored it (without Idempotency-Expires %q)", key, first.expiry)
		}
	}
}

// opOf is the operation of key, for its replay.
func (r *runner) opOf(key string) op {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.ops[key]
}

func containsExec(runs []execution, id int64, body []byte) bool {
	for _, e := range runs {
		if e.ID == id && bytes.Equal(e.Body, body) {
			return true
		}
	}
	return false
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

// kill SIGKILLs the process and waits for it to be gone.
func (p *proc) kill() {
	p.mu.Lock()
	cmd, exited := p.cmd, p.exited
	p.mu.Unlock()
	if cmd == nil {
		return
	}
	cmd.Process.Kill()
	<-exited
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

func newProxyProc(cfg Config, i int, upstream string) (*proxyProc, error) {
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
	p := &proxyProc{listen: listen, admin: admin, journal: filepath.Join(cfg.Dir, "journal-"+strconv.Itoa(i)), fault: fault}
	p.proc = &proc{name: "proxy-" + strconv.Itoa(i), bin: cfg.Bin, log: filepath.Join(cfg.Dir, "proxy-"+strconv.Itoa(i)+".log"),
		args: []string{"proxy", "--listen", listen, "--admin-listen", admin, "--upstream", upstream, "--store", cfg.Store,
			"--journal-dir", p.journal, "--lease", "2s", "--wait", "2s", "--store-timeout", "1s", "--shutdown-timeout", "5s"}}
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
			return fmt.Errorf("%s exited at start; see %s", p.name, p.log)
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
