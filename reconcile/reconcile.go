// Package reconcile settles records whose outcome nobody knows: UNKNOWN
// records, and IN_PROGRESS records whose owner stopped renewing its lease (it
// crashed, or lost its store). For each, a [Resolver] asks the world what
// really happened — typically the downstream service, by the downstream
// idempotency key the owner recorded in a checkpoint — and the reconciler
// stores the answer: COMPLETED with the response a retry will replay, or
// FAILED, which lets the retry run.
//
// Several reconcilers may run at once, on any number of instances: every
// settlement is a compare-and-set on the record's lease token, so each
// record is settled once, and an owner that comes back late cannot overwrite
// the reconciler's answer (nor the reconciler the owner's).
//
// The work is a synchronous [Reconciler.RunOnce]; [Reconciler.Start] runs it
// every [Config.Interval] until [Reconciler.Stop]. Each resolver call has
// [Config.ResolveTimeout] to answer.
package reconcile

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/httpidem"
)

// Defaults for [Config].
const (
	// DefaultGrace is how long an unsettled record is left to its owner
	// once it went quiet (its lease ended, or it became unknown) before the
	// reconciler steps in; an operator's Resolve always waits this long
	// (see [AbandonedAt]).
	DefaultGrace = time.Minute
	// DefaultInterval is how often Start runs a pass.
	DefaultInterval = 30 * time.Second
	// DefaultPageSize is how many records a pass reads at a time.
	DefaultPageSize = 100
	// DefaultResolveTimeout is how long a resolver has to answer for one
	// record (and its Commit to run).
	DefaultResolveTimeout = 30 * time.Second
)

// outageAfter is how many store calls in a row, in a pass, must fail as
// unavailable before the reconciler takes the store for unreachable (a
// failed scan does at once). Fewer are one record's trouble: that record is
// counted as an error and left for the next pass, and the others go on.
const outageAfter = 3

// Outcome is what a resolver found.
type Outcome int

// The outcomes a [Resolver] reports.
const (
	// StillUnknown: the world cannot tell yet; look again on a later pass.
	StillUnknown Outcome = iota
	// Completed: the effect happened; Resolution.Response is what retries
	// will replay.
	Completed
	// Failed: the effect did not happen; the key is released and the next
	// retry runs.
	Failed
)

func (o Outcome) String() string {
	switch o {
	case Completed:
		return "completed"
	case Failed:
		return "failed"
	}
	return "unknown"
}

// Resolution is a resolver's answer for one record.
type Resolution struct {
	Outcome Outcome
	// Response is the outcome to replay when Outcome is Completed.
	Response *idem.Response
	// Commit, when set, settles the record itself instead of the
	// reconciler: it must run the store's transactional finish (pgstore's
	// or sqlitestore's FinishTx) with the params it gets, together with the
	// business writes the outcome implies (the ledger debit for a charge the
	// acquirer confirms), and commit. [idem.ErrLeaseLost] from it means the
	// record was settled by someone else first.
	Commit func(ctx context.Context, p idem.FinishParams) error
}

// Resolver finds out what happened to a record's side effect. The record
// carries its checkpoints and its downstream keys ([idem.Record.DownstreamKey]).
// Resolve must return once its context ends: the reconciler bounds each call
// by [Config.ResolveTimeout].
type Resolver interface {
	Resolve(ctx context.Context, rec idem.Record) (Resolution, error)
}

// ResolverFunc adapts a function to [Resolver].
type ResolverFunc func(ctx context.Context, rec idem.Record) (Resolution, error)

// Resolve calls f.
func (f ResolverFunc) Resolve(ctx context.Context, rec idem.Record) (Resolution, error) {
	return f(ctx, rec)
}

// Config configures a [Reconciler].
type Config struct {
	// Engine reads and settles the records. Required.
	Engine *idem.Engine
	// Resolver answers for each record. Required.
	Resolver Resolver
	// Grace leaves a record alone this long past its lease's end (UNKNOWN:
	// past the moment it became unknown), so that a slow owner whose renewals failed can
	// still finish (its context is cancelled when its lease runs out), and a
	// downstream call that timed out on the owner's side but may still land
	// has landed before the resolver asks. Make it longer than the
	// downstream calls' timeouts. The reconciler also waits this long after
	// the last time it could not reach the store: owners that kept their
	// outcomes in their journals while the store was away then have a whole
	// grace to store them themselves, before the resolver is asked. Defaults
	// to [DefaultGrace]; negative means none.
	Grace time.Duration
	// Interval is the time between passes under Start. Defaults to
	// [DefaultInterval].
	Interval time.Duration
	// PageSize is how many records a pass reads at a time. Defaults to
	// [DefaultPageSize].
	PageSize int
	// ResolveTimeout bounds the resolver's call for one record, and the
	// Commit of its resolution, each: past it, the call's context is
	// cancelled, the record is counted as an error and logged, and it is
	// left for the next pass (a hung lookup does not hold up the pass).
	// Defaults to [DefaultResolveTimeout].
	ResolveTimeout time.Duration
	// Logger receives a line per settled record and per error. Defaults to
	// slog.Default().
	Logger *slog.Logger
	// OnPass, when set, gets the report of every pass Start runs. For
	// metrics.
	OnPass func(Report)
}

// Reconciler settles stale records. It is safe for concurrent use.
type Reconciler struct {
	cfg  Config
	log  *slog.Logger
	mu   sync.Mutex
	loop *loop // the loop Start runs; nil when none runs

	unreachable atomic.Pointer[time.Time] // the last time the store could not be reached
}

// loop is one run of Start's background passes.
type loop struct {
	ctx  context.Context // the passes' context: Start's
	stop chan struct{}   // closed by Stop: no record after the one under way
	done chan struct{}   // closed when the loop has ended
}

// New checks cfg and returns a reconciler.
func New(cfg Config) (*Reconciler, error) {
	if cfg.Engine == nil || cfg.Resolver == nil {
		return nil, fmt.Errorf("%w: reconcile: config needs an engine and a resolver", idem.ErrInvalid)
	}
	if cfg.Interval < 0 || cfg.PageSize < 0 || cfg.ResolveTimeout < 0 {
		return nil, fmt.Errorf("%w: reconcile: negative interval, page size or resolve timeout", idem.ErrInvalid)
	}
	switch {
	case cfg.Grace == 0:
		cfg.Grace = DefaultGrace
	case cfg.Grace < 0:
		cfg.Grace = 0
	}
	if cfg.Interval == 0 {
		cfg.Interval = DefaultInterval
	}
	if cfg.PageSize == 0 {
		cfg.PageSize = DefaultPageSize
	}
	if cfg.ResolveTimeout == 0 {
		cfg.ResolveTimeout = DefaultResolveTimeout
	}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	return &Reconciler{cfg: cfg, log: log}, nil
}

// Report counts what a pass did.
type Report struct {
	// Stale is how many stale records the pass saw.
	Stale int
	// Waiting were records still inside their grace period (or back
	// inside it: a retry marked an abandoned record unknown since the scan).
	Waiting int
	// Completed and Failed were settled by this pass.
	Completed, Failed int
	// Unknown are records the resolver could not answer for yet.
	Unknown int
	// Lost were settled, renewed or taken over by someone else (the owner,
	// another reconciler, a retry), or are gone, since the scan saw them.
	Lost int
	// Errors are records the pass could not handle (a store call or the
	// resolver failed, or the resolver did not answer within
	// [Config.ResolveTimeout]); see the log. They are left for the next
	// pass.
	Errors int
}

// pass is the state of one RunOnce.
type pass struct {
	rep         Report
	unavailable int // store calls in a row that failed as unavailable
}

// RunOnce makes one pass over the stale records and returns what it did. It
// returns an error only when the store cannot be scanned, or ctx ends (the
// pass stops there); a record that fails is counted and logged, and the
// pass goes on.
//
// A failed scan means the store is unreachable (as does a run of failed
// calls): every record then waits a grace from now, as owners may have
// outcomes in their journals to store first. One record whose read or
// settlement fails is that record's error, left for the next pass.
func (r *Reconciler) RunOnce(ctx context.Context) (Report, error) { return r.runOnce(ctx, nil) }

// runOnce is RunOnce, which also ends, before its next record, once stop
// is closed.
func (r *Reconciler) runOnce(ctx context.Context, stop <-chan struct{}) (Report, error) {
	var p pass
	cursor := ""
	for {
		page, err := r.cfg.Engine.Scan(ctx, r.cfg.PageSize, cursor)
		if err != nil {
			r.noteUnreachable(err)
			return p.rep, fmt.Errorf("reconcile: scanning: %w", err)
		}
		p.unavailable = 0
		for _, rec := range page.Records {
			if err := ctx.Err(); err != nil {
				return p.rep, fmt.Errorf("reconcile: pass cut short: %w", err)
			}
			select {
			case <-stop:
				return p.rep, errStopped
			default:
			}
			p.rep.Stale++
			r.settle(ctx, rec, &p)
		}
		if cursor = page.Cursor; cursor == "" {
			return p.rep, nil
		}
	}
}

func (r *Reconciler) settle(ctx context.Context, rec idem.Record, p *pass) {
	eng, rep := r.cfg.Engine, &p.rep
	log := r.log.With("key_hash", idem.KeyHash(rec.Scope, rec.Key), "state", rec.State, "fence", rec.Fence)
	if eng.Now().Before(r.quietUntil(rec)) {
		rep.Waiting++
		return
	}
	// A scan may answer from an index that lags behind the records (a
	// DynamoDB secondary index does): the record itself says whether its
	// owner has renewed it, or someone settled it, since.
	fresh, err := eng.Get(ctx, rec.Scope, rec.Key)
	r.storeCalled(p, err)
	switch {
	case errors.Is(err, idem.ErrNotFound):
		rep.Lost++
		return
	case err != nil:
		r.failed(ctx, p, log, "reconcile: reading the record; it is left for the next pass", "err", err)
		return
	case fresh.Token != rec.Token || !fresh.Stale(eng.Now()):
		rep.Lost++ // renewed, settled or taken over since the scan
		return
	case eng.Now().Before(r.quietUntil(fresh)):
		rep.Waiting++ // unsettled, back inside a grace: a retry marked it unknown since the scan
		return
	}
	rec = fresh
	var res Resolution
	if rec.State == idem.StateInProgress && rec.TakeoverSafe {
		// All of its effects commit with the record, which never committed:
		// nothing happened.
		res = Resolution{Outcome: Failed}
	} else {
		rctx, cancel := context.WithTimeout(ctx, r.cfg.ResolveTimeout)
		res, err = r.cfg.Resolver.Resolve(rctx, rec)
		late := errors.Is(rctx.Err(), context.DeadlineExceeded) && ctx.Err() == nil
		cancel()
		switch {
		case err != nil && late:
			r.failed(ctx, p, log, "reconcile: the resolver did not answer in time; the record is left for the next pass",
				"timeout", r.cfg.ResolveTimeout, "err", err)
			return
		case err != nil:
			r.failed(ctx, p, log, "reconcile: resolver failed; the record is left for the next pass", "err", err)
			return
		}
		if commit := res.Commit; commit != nil {
			res.Commit = func(ctx context.Context, fp idem.FinishParams) error {
				ctx, cancel := context.WithTimeout(ctx, r.cfg.ResolveTimeout)
				defer cancel()
				return commit(ctx, fp)
			}
		}
	}
	err = apply(ctx, eng, rec, res)
	if !errors.Is(err, errStillUnknown) {
		r.storeCalled(p, err)
	}
	switch {
	case errors.Is(err, errStillUnknown):
		rep.Unknown++
	case errors.Is(err, idem.ErrLeaseLost):
		rep.Lost++
	case err != nil:
		r.failed(ctx, p, log, "reconcile: settling; the record is left for the next pass", "outcome", res.Outcome, "err", err)
	case res.Outcome == Completed:
		rep.Completed++
		log.Info("reconcile: settled", "outcome", res.Outcome)
	default:
		rep.Failed++
		log.Info("reconcile: settled", "outcome", res.Outcome)
	}
}

// failed counts a record the pass could not handle and logs why, unless the
// pass itself was cut short (its context ended).
func (r *Reconciler) failed(ctx context.Context, p *pass, log *slog.Logger, msg string, args ...any) {
	p.rep.Errors++
	if ctx.Err() == nil {
		log.Error(msg, args...)
	}
}

// storeCalled notes how a store call for one record went: a run of
// [outageAfter] calls that failed as unavailable means the store is away;
// any answer ends the run.
func (r *Reconciler) storeCalled(p *pass, err error) {
	if !errors.Is(err, idem.ErrUnavailable) {
		p.unavailable = 0
		return
	}
	if p.unavailable++; p.unavailable >= outageAfter {
		r.noteUnreachable(err)
	}
}

// errStillUnknown: the resolution was StillUnknown; the record says so now.
var errStillUnknown = errors.New("reconcile: the outcome is still unknown")

// apply stores a resolution of rec under its borrowed lease.
func apply(ctx context.Context, eng *idem.Engine, rec idem.Record, res Resolution) error {
	s := idem.Settlement{Commit: res.Commit}
	switch res.Outcome {
	case Completed:
		if res.Response == nil {
			return fmt.Errorf("%w: reconcile: a completed resolution needs a response", idem.ErrInvalid)
		}
		// Its headers are stored as a handler's are (a resolver in another
		// language may spell names in lower case, or pass a Set-Cookie on).
		response := *res.Response
		response.Header = httpidem.StoredHeader(response.Header)
		s.State, s.Response = idem.StateCompleted, &response
	case Failed:
		s.State = idem.StateFailed
	default:
		if rec.State != idem.StateInProgress {
			return errStillUnknown
		}
		// Say so on the record: retries get operation-uncertain.
		if err := eng.Settle(ctx, rec.Lease(), idem.Settlement{State: idem.StateUnknown}); err != nil && !errors.Is(err, idem.ErrLeaseLost) {
			return err
		}
		return errStillUnknown
	}
	return eng.Settle(ctx, rec.Lease(), s)
}

// Errors of [Resolve].
var (
	// ErrSettled: the record is already settled (completed or failed).
	ErrSettled = errors.New("reconcile: the record is already settled")
	// ErrLeaseRunning: the record's owner still holds its lease, or it went
	// quiet (its lease ended, or it became unknown) less than [DefaultGrace]
	// ago: its owner may still store the true outcome.
	ErrLeaseRunning = errors.New("reconcile: the record's owner may still store its outcome")
)

// quietUntil is when the reconciler may step in for rec: its grace after
// rec went quiet, or after the store was last unreachable when that is
// later (owners may have outcomes in their journals to store first).
func (r *Reconciler) quietUntil(rec idem.Record) time.Time {
	quiet := quietSince(rec)
	if t := r.unreachable.Load(); t != nil && t.After(quiet) {
		quiet = *t
	}
	return quiet.Add(r.cfg.Grace)
}

// quietSince is when an unsettled record was last heard of: the end of its
// lease (IN_PROGRESS), or when it became unknown (UNKNOWN). Its owner, whose
// renewals may have failed while its work went on, may store the true
// outcome for a while after, and a downstream call it made just before may
// still land.
func quietSince(rec idem.Record) time.Time {
	if rec.State == idem.StateUnknown {
		return rec.Updated
	}
	return rec.LeaseExpires
}

// AbandonedAt is when an unsettled record may be settled by hand:
// [DefaultGrace] after its lease ended (IN_PROGRESS) or after it became
// unknown (UNKNOWN), as the reconciler's own passes wait. Within the grace
// its owner may still store the true outcome.
func AbandonedAt(rec idem.Record) time.Time { return quietSince(rec).Add(DefaultGrace) }

// Abandoned reports whether an unsettled record may be settled by hand at
// now (see [AbandonedAt]).
func Abandoned(rec idem.Record, now time.Time) bool {
	return !rec.State.Terminal() && !now.Before(AbandonedAt(rec))
}

// Resolve settles one record by hand, as an operator who found out what
// happened (idem keys resolve): res is what a resolver would have answered,
// Completed with a response or Failed. rec is the record the operator
// looked at; Resolve reads it again and judges what the store holds now,
// since an owner renewing its lease keeps its token. It refuses a settled
// record ([ErrSettled]) and, unless force, one that is not [Abandoned]
// ([ErrLeaseRunning]), since its owner may yet store the true outcome.
// [idem.ErrLeaseLost] means the record is no longer the one rec describes
// (another lease took it, or it was settled meanwhile): look again.
func Resolve(ctx context.Context, eng *idem.Engine, rec idem.Record, res Resolution, force bool) error {
	seen := rec
	rec, err := eng.Get(ctx, seen.Scope, seen.Key)
	switch {
	case errors.Is(err, idem.ErrNotFound):
		return fmt.Errorf("%w: the record is gone", idem.ErrLeaseLost)
	case err != nil:
		return err
	case rec.Token != seen.Token || rec.Fence != seen.Fence:
		return idem.ErrLeaseLost
	}
	switch {
	case rec.State.Terminal():
		return fmt.Errorf("%w (%s)", ErrSettled, rec.State)
	case !Abandoned(rec, eng.Now()) && !force:
		return fmt.Errorf("%w, until %s", ErrLeaseRunning, AbandonedAt(rec).UTC().Format(time.RFC3339))
	case res.Outcome != Completed && res.Outcome != Failed:
		return fmt.Errorf("%w: reconcile: resolve a record as completed or failed", idem.ErrInvalid)
	}
	return apply(ctx, eng, rec, res)
}

// noteUnreachable remembers when the store could not be reached.
func (r *Reconciler) noteUnreachable(err error) {
	if errors.Is(err, idem.ErrUnavailable) {
		now := r.cfg.Engine.Now()
		r.unreachable.Store(&now)
	}
}

// Start runs a pass now and then every Interval, in the background, until
// Stop or ctx ends. Starting a running reconciler does nothing; once its
// loop has ended (or is ending) with its context, Start starts a new one
// (which begins when the old one has ended).
func (r *Reconciler) Start(ctx context.Context) {
	r.mu.Lock()
	defer r.mu.Unlock()
	prev := r.loop
	if prev != nil && prev.ctx.Err() == nil {
		return
	}
	l := &loop{ctx: ctx, stop: make(chan struct{}), done: make(chan struct{})}
	r.loop = l
	go func() {
		defer close(l.done)
		defer func() {
			r.mu.Lock()
			if r.loop == l {
				r.loop = nil // a later Start runs again
			}
			r.mu.Unlock()
		}()
		if prev != nil {
			<-prev.done // one loop at a time
		}
		r.run(l.ctx, l.stop)
	}()
}

// errStopped ends a pass that Stop cut short.
var errStopped = errors.New("reconcile: stopped")

// run makes a pass now and then every Interval until ctx ends or stop is
// closed.
func (r *Reconciler) run(ctx context.Context, stop <-chan struct{}) {
	ticker := time.NewTicker(r.cfg.Interval)
	defer ticker.Stop()
	for ctx.Err() == nil {
		rep, err := r.runOnce(ctx, stop)
		if errors.Is(err, errStopped) {
			return
		}
		if err == nil && r.cfg.OnPass != nil {
			r.cfg.OnPass(rep)
		}
		if err != nil {
			if ctx.Err() == nil {
				r.log.Error("reconcile: pass failed", "err", err)
			}
		} else if rep.Completed+rep.Failed+rep.Unknown+rep.Errors > 0 {
			r.log.Info("reconcile: pass", "stale", rep.Stale, "completed", rep.Completed, "failed", rep.Failed,
				"unknown", rep.Unknown, "waiting", rep.Waiting, "lost", rep.Lost, "errors", rep.Errors)
		}
		select {
		case <-ctx.Done():
		case <-stop:
			return
		case <-ticker.C:
		}
	}
}

// Stop ends the background passes and waits for them to end: the pass
// under way settles the record it is on (its resolver's call bounded by
// [Config.ResolveTimeout]) and stops there; the records after it are left
// for a later pass.
func (r *Reconciler) Stop() {
	r.mu.Lock()
	l := r.loop
	r.loop = nil
	r.mu.Unlock()
	if l != nil {
		close(l.stop)
		<-l.done
	}
}
