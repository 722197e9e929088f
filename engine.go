package idem

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idemhq/idem/store"
)

// Defaults for [Config] and [BeginParams].
const (
	// DefaultLease is how long a lease lasts before it must be renewed.
	DefaultLease = 30 * time.Second
	// DefaultRetention is how long a settled outcome is kept and replayed.
	DefaultRetention = 24 * time.Hour
)

// Clock tells the time and keeps timers. The engine reads it for every
// store call and waits on it wherever a wait is counted against a lease
// (renewals in [Engine.Hold], polling in [Engine.Await]), so a test can move
// time by hand and drive those waits without sleeping. Waits against the
// network (a store call's timeout, the pause between retries) are real time.
type Clock interface {
	Now() time.Time
	// After returns a channel that receives the time once d has passed on
	// this clock.
	After(d time.Duration) <-chan time.Time
}

type systemClock struct{}

func (systemClock) Now() time.Time                         { return time.Now() }
func (systemClock) After(d time.Duration) <-chan time.Time { return time.After(d) }

// Config configures an [Engine]. The zero value of every field but Store is a
// sensible default. The fields that are data carry the names `idem proxy`
// gives them in its YAML file, flags and IDEM_* variables.
type Config struct {
	// Store keeps the records. Required.
	Store Store `yaml:"-"`
	// Clock tells the time. Defaults to the wall clock. All instances sharing
	// a store should have clocks within a small fraction of Lease.
	Clock Clock `yaml:"-"`
	// Lease is how long a lease lasts unless renewed. Defaults to
	// [DefaultLease].
	Lease time.Duration `yaml:"lease"`
	// Retention is how long a settled outcome is replayed. Defaults to
	// [DefaultRetention].
	Retention time.Duration `yaml:"retention"`
	// Notifier wakes waiters in other processes when a record is settled
	// (see [Engine.Await]). Defaults to none: waiters in other processes
	// poll.
	Notifier Notifier `yaml:"-"`
	// Poll is how often [Engine.Await] looks again when nothing wakes it.
	// Defaults to [DefaultPoll].
	Poll time.Duration `yaml:"poll"`
	// StoreTimeout bounds each store call the engine makes for a request,
	// retries included: past it the store counts as unreachable. Defaults
	// to [DefaultStoreTimeout].
	StoreTimeout time.Duration `yaml:"store_timeout"`
	// JournalDir is a directory where outcomes that the store could not take
	// (it was unreachable when the work finished) wait, each in a file
	// synced to disk, until the engine stores them; an engine opened on the
	// directory after a crash stores what it finds there. Several engines,
	// in several processes, may share one directory, on one store or on
	// several: a write (an outcome, a Release, a MarkUnknown) whose store
	// holds no record of it is left in the directory (for the engine of its
	// store) until its retention ends, counted from the write (for a
	// MarkUnknown, the retention its lease would give an outcome).
	// Defaults to "": such
	// outcomes wait in memory, and a crash of the process loses them (the
	// record is then left to the reconciler).
	JournalDir string `yaml:"journal_dir"`
	// Logger receives a line when an outcome has to wait in the journal and
	// when it lands or cannot. Defaults to slog.Default().
	Logger *slog.Logger `yaml:"-"`
	// CacheSize is how many bytes of completed outcomes the engine keeps in
	// memory, so that replays are answered without the store (a completed
	// outcome never changes until it expires). Defaults to
	// [DefaultCacheSize]; negative: none.
	CacheSize int64 `yaml:"cache_size"`
	// PruneInterval is how often the engine deletes, in the background,
	// the settled records whose retention has run out ([Engine.Prune]):
	// the first time about one interval after New, then every interval
	// (less up to a quarter, at random, so that instances sharing a store
	// take turns), until [Engine.Close]. The SQL stores keep expired
	// records until they are pruned; stores whose server expires records
	// itself (Redis, Memcached, DynamoDB) have nothing to prune, and the
	// call costs nothing. Defaults to [DefaultPruneInterval]; negative:
	// never (prune with [Engine.Prune] or `idem keys purge` on a schedule
	// of your own).
	PruneInterval time.Duration `yaml:"prune_interval"`
}

// DefaultPruneInterval is how often an engine prunes expired records by
// default (see [Config.PruneInterval]).
const DefaultPruneInterval = 10 * time.Minute

// DefaultStoreTimeout is how long the engine gives a store call, retries
// included, before it counts the store as unreachable.
const DefaultStoreTimeout = 5 * time.Second

// Engine decides, for each request, whether to run it, replay it or refuse
// it, and writes its outcome. It is safe for concurrent use; several engines
// in several processes may share one store.
//
// An engine whose store was unreachable when work finished keeps that
// outcome in its journal (see [Config.JournalDir]) and stores it in the
// background; [Engine.Close] stops that.
type Engine struct {
	store        Store
	clock        Clock
	lease        time.Duration
	retention    time.Duration
	poll         time.Duration
	storeTimeout time.Duration
	notifier     Notifier
	local        localNotifier
	owners       owners  // leases this engine's callers hold
	flights      flights // acquires on their way to the store
	waits        waits   // Await's callers, by record and payload
	cache        *cache  // completed records
	journal      *journal
	log          *slog.Logger
	down         atomic.Bool // the store has not answered for a whole store timeout
	stopPruning  context.CancelFunc
	pruned       chan struct{} // closed when the pruner has stopped
}

// New returns an engine for cfg. With a JournalDir, it reads the outcomes a
// previous engine left there and starts storing them.
func New(cfg Config) (*Engine, error) {
	if cfg.Store == nil {
		return nil, invalid("config has no store")
	}
	e := &Engine{store: cfg.Store, clock: cfg.Clock, lease: cfg.Lease, retention: cfg.Retention,
		poll: cfg.Poll, storeTimeout: cfg.StoreTimeout, notifier: cfg.Notifier, log: cfg.Logger}
	switch {
	case cfg.CacheSize == 0:
		e.cache = newCache(DefaultCacheSize)
	case cfg.CacheSize > 0:
		e.cache = newCache(cfg.CacheSize)
	}
	if e.clock == nil {
		e.clock = systemClock{}
	}
	if e.lease == 0 {
		e.lease = DefaultLease
	}
	if e.retention == 0 {
		e.retention = DefaultRetention
	}
	if e.poll == 0 {
		e.poll = DefaultPoll
	}
	if e.storeTimeout == 0 {
		e.storeTimeout = DefaultStoreTimeout
	}
	if e.log == nil {
		e.log = slog.Default()
	}
	for _, d := range []struct {
		name  string
		value time.Duration
	}{{"lease", e.lease}, {"retention", e.retention}, {"poll", e.poll}, {"store_timeout", e.storeTimeout}} { // named as Config's YAML names them
		if d.value < 0 {
			return nil, invalid("%s %v is negative: want a positive duration, or 0 for the default", d.name, d.value)
		}
	}
	j, err := openJournal(e, cfg.JournalDir)
	if err != nil {
		return nil, err
	}
	e.journal = j
	ctx, stop := context.WithCancel(context.Background())
	e.stopPruning, e.pruned = stop, make(chan struct{})
	if cfg.PruneInterval < 0 {
		close(e.pruned)
	} else {
		go e.prune(ctx, cmp.Or(cfg.PruneInterval, DefaultPruneInterval))
	}
	return e, nil
}

// prune runs [Engine.Prune] every interval (less up to a quarter, at
// random) until ctx ends, logging what it deleted and what failed.
func (e *Engine) prune(ctx context.Context, interval time.Duration) {
	defer close(e.pruned)
	for {
		t := time.NewTimer(interval - rand.N(interval/4+1))
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
		n, err := e.Prune(ctx, PruneOptions{})
		switch {
		case ctx.Err() != nil:
			return
		case err != nil:
			e.log.Warn("idempotency store: pruning expired records failed; the next try is in one prune interval", "deleted", n, "err", err)
		case n > 0:
			e.log.Info("idempotency store: pruned expired records", "deleted", n)
		}
	}
}

// Close waits, until ctx ends, for the requests this engine's callers run
// (the leases they hold and have not settled, until those run out) to
// settle, then stores what the journal holds, waiting until it is empty or
// ctx ends, and stops the engine's background work. Outcomes still waiting
// stay in the JournalDir for the next engine opened on it (without a
// JournalDir they are lost); the error says how many, and how many requests
// were still running (their records stay in progress until their leases
// run out, then UNKNOWN, for a reconciler). After Close, an outcome that the
// store does not take is kept only in the JournalDir: without one, Complete
// returns ErrUnavailable.
func (e *Engine) Close(ctx context.Context) error {
	e.stopPruning()
	select {
	case <-e.pruned:
	case <-ctx.Done():
	}
	running := e.owners.running(e.clock.Now())
	if running > 0 {
		tick := time.NewTicker(closePoll)
		defer tick.Stop()
		for running > 0 && ctx.Err() == nil {
			select {
			case <-ctx.Done():
			case <-tick.C:
				running = e.owners.running(e.clock.Now())
			}
		}
	}
	err := e.journal.close(ctx)
	if running > 0 {
		err = errors.Join(fmt.Errorf("idem: %d request(s) still running when the engine closed: their records stay in progress until their leases run out, then UNKNOWN", running), err)
	}
	return err
}

// closePoll is how often Close looks whether the requests it waits for have
// settled.
const closePoll = 10 * time.Millisecond

// Pending reports how many outcomes wait in the journal for the store. (It
// leaves out the releases of lost acquires that the store has answered but
// that are sent again, in case the acquire lands late, until its lease ends.)
func (e *Engine) Pending() int { return e.journal.len() }

// retryPause is the real-time pause before retry n (0-based) of a store call
// whose answer was lost: short, since most such faults are one dropped
// connection, and growing.
func retryPause(n int) time.Duration {
	if n >= 3 { // 10 ms << 6 is past the cap; further shifts overflow
		return 500 * time.Millisecond
	}
	return min(10*time.Millisecond<<(2*n), 500*time.Millisecond)
}

// answered notes that the store answered: it is not down, and when it was,
// the journal sends what waits at once instead of after its pause.
func (e *Engine) answered() {
	if e.down.Swap(false) {
		e.journal.poke()
	}
}

// retry runs op until it succeeds, fails with something other than
// [ErrUnavailable], or the store timeout has run out; op gets each attempt's
// context. It returns op's last error. Once the store has failed a whole
// store timeout, it counts as down, and calls make one attempt each (failing
// fast, closed) until one succeeds.
func (e *Engine) retry(ctx context.Context, op func(ctx context.Context) error) error {
	down := e.down.Load()
	deadline := time.Now().Add(e.storeTimeout)
	// Detached from the caller's cancellation: a client that goes away must
	// not leave a store write half-known.
	detached := context.WithoutCancel(ctx)
	var refusal error // an attempt the store answered with a refusal
	for n := 0; ; n++ {
		actx, cancel := context.WithDeadline(detached, deadline)
		err := unanswered(actx, op(actx))
		cancel()
		if err == nil || !errors.Is(err, ErrUnavailable) {
			e.answered()
			return err
		}
		if errors.Is(err, ErrRefused) || errors.Is(err, ErrDenied) {
			refusal = err
		}
		pause := retryPause(n)
		// A call that never left the process (store.ErrNotSent: the store
		// has not opened) has no answer to lose: not sent again.
		if down || time.Until(deadline) < pause || errors.Is(err, store.ErrNotSent) {
			e.down.Store(true)
			if refusal != nil && refusal != err {
				// The store was reached and refused (a lock held, writes
				// refused), then did not answer in time: still a refusal,
				// which is never a reason to fail open.
				return fmt.Errorf("%w (an attempt before: %w)", err, refusal)
			}
			return err
		}
		time.Sleep(pause)
	}
}

// unanswered returns err, made to wrap [ErrUnavailable] when ctx, the
// context of the store call that returned it, has run out: the store did
// not answer in time, whatever error it gave (a store may return the
// context's own error, or one of its own caused by it), so the call's
// outcome is not known, and it is retried or kept, never taken as refused.
// An answer the store did give (the lease lost, no record, invalid
// params) stays what it is.
func unanswered(ctx context.Context, err error) error {
	if err == nil || ctx.Err() == nil || errors.Is(err, ErrUnavailable) ||
		errors.Is(err, ErrLeaseLost) || errors.Is(err, ErrNotFound) || errors.Is(err, ErrInvalid) {
		return err
	}
	return fmt.Errorf("%w: %w", ErrUnavailable, err)
}

// Now returns the engine's clock reading, for what acts in the engine's
// time (a reconciler's grace periods).
func (e *Engine) Now() time.Time { return e.clock.Now() }

// Decision is what to do with a request.
type Decision int

// The decisions [Engine.Begin] makes.
const (
	// Execute: the caller holds the lease; run the work, then Complete,
	// Release or MarkUnknown.
	Execute Decision = iota + 1
	// Replay: the work ran before; send the stored Response again.
	Replay
	// Mismatch: the key was used with a different payload; refuse (422).
	Mismatch
	// InFlight: another owner is running the work now; come back later (409).
	InFlight
	// Uncertain: the outcome of an earlier run is unknown; nothing may run
	// until it is resolved (409, operation uncertain).
	Uncertain
)

var decisionNames = [...]string{"", "execute", "replay", "mismatch", "in_flight", "uncertain"}

func (d Decision) String() string {
	if d > 0 && int(d) < len(decisionNames) {
		return decisionNames[d]
	}
	return fmt.Sprintf("Decision(%d)", int(d))
}

// BeginParams describes a request about to run.
type BeginParams struct {
	// Scope isolates callers; see [store.ValidateScope].
	Scope string
	// Key is the client's idempotency key; see [ValidateKey].
	Key string
	// Fingerprint identifies the payload; see [NewFingerprint].
	Fingerprint Fingerprint
	// Lease overrides [Config.Lease] for this request when non-zero.
	Lease time.Duration
	// Retention overrides [Config.Retention] for this request when non-zero.
	Retention time.Duration
	// TakeoverSafe declares that all of this work's effects commit together
	// with the record (transactional completion), so that when its lease
	// expires a retry may take over instead of the record becoming UNKNOWN.
	TakeoverSafe bool
}

// Outcome is the engine's answer to [Engine.Begin].
type Outcome struct {
	Decision Decision
	// Lease is the caller's lease when Decision is Execute.
	Lease Lease
	// Record is the stored record as the store returned it.
	Record Record
	// Diff names the payload parts that differed when Decision is Mismatch.
	Diff []string
	// RetryAfter is how long until the running lease ends when Decision is
	// InFlight; at least one second.
	RetryAfter time.Duration
}

// Begin looks the key up and decides; when the decision is Execute, the caller
// holds a new lease. It is one store round trip.
//
// The store call is detached from ctx's cancellation: a client that goes
// away while it runs cannot leave the acquire half-known. When the store's
// answer is lost (ErrUnavailable), Begin asks again with the same lease
// token, which a store answers the same way whether or not the first one
// landed, until the store timeout runs out. When it still cannot tell, it
// returns ErrUnavailable and has the journal release the record if the
// acquire landed after all (nothing ran under it), so the key is never left
// blocked by work that did not run. When ctx ends while another request
// for the key is on its way to the store, Begin returns ctx's error with an
// InFlight outcome.
func (e *Engine) Begin(ctx context.Context, p BeginParams) (Outcome, error) {
	lease, retention := p.Lease, p.Retention
	if lease == 0 {
		lease = e.lease
	}
	if retention == 0 {
		retention = e.retention
	}
	if lease < 0 || retention < 0 {
		return Outcome{}, invalid("lease and retention must be positive")
	}
	if err := ctx.Err(); err != nil {
		return Outcome{}, err // gone before anything started
	}
	if out, ok := e.known(p, false); ok {
		return out, nil
	}
	// A request for a key whose acquire is on its way to the store takes
	// that acquire's answer: it happened at the same moment.
	f, leader := e.flights.join(p.Scope, p.Key)
	if !leader {
		select {
		case <-f.done:
		case <-ctx.Done():
			// Another request for the key is on its way to the store: as far
			// as this caller knows, it runs.
			return Outcome{Decision: InFlight, RetryAfter: time.Second}, ctx.Err()
		}
		if f.err != nil {
			return Outcome{}, f.err
		}
		return decide(f.rec, p.Fingerprint, e.clock.Now()), nil
	}
	landed := false
	defer func() {
		if !landed { // the store panicked: the callers that joined must not wait for ever
			e.flights.land(f, Record{}, fmt.Errorf("%w: the store's acquire panicked", ErrUnavailable))
		}
	}()
	out, err := e.acquire(ctx, p, lease, retention)
	e.flights.land(f, out.Record, err)
	landed = true
	return out, err
}

// acquire asks the store for the record, with a new token, and decides.
func (e *Engine) acquire(ctx context.Context, p BeginParams, lease, retention time.Duration) (Outcome, error) {
	token, err := store.NewToken()
	if err != nil {
		return Outcome{}, err
	}
	now := e.clock.Now()
	ap := store.AcquireParams{
		Scope:        p.Scope,
		Key:          p.Key,
		Fingerprint:  p.Fingerprint,
		Token:        token,
		Now:          now,
		LeaseExpires: now.Add(lease),
		TakeoverSafe: p.TakeoverSafe,
	}
	var rec Record
	sent := false
	err = e.retry(ctx, func(ctx context.Context) (err error) {
		rec, err = e.store.Acquire(ctx, ap)
		sent = sent || !errors.Is(err, store.ErrNotSent)
		return err
	})
	if errors.Is(err, ErrUnavailable) && sent {
		// The acquire may have landed: release the record if it did.
		e.journal.put(FinishParams{Scope: p.Scope, Key: p.Key, Token: token, Now: now, State: StateFailed,
			Expires: now.Add(retention), Repeat: true}, p.Fingerprint, ap.LeaseExpires, time.Time{})
	}
	if err != nil {
		return Outcome{}, err
	}
	rec = withExpires(rec)
	if rec.Token == token && rec.State == StateInProgress {
		e.owners.add(rec)
		return Outcome{Decision: Execute, Record: rec, Lease: Lease{Scope: p.Scope, Key: p.Key, Token: token, Fence: rec.Fence,
			Fingerprint: rec.Fingerprint, Expires: rec.LeaseExpires, Duration: lease, Retention: retention}}, nil
	}
	e.cache.put(rec)
	return decide(rec, p.Fingerprint, now), nil
}

// known decides from what this engine knows without asking the store: an
// outcome waiting in its journal or kept in its cache and, when waiting,
// work that one of its callers runs (Begin asks the store then, which may
// know that somebody else settled the record meanwhile).
func (e *Engine) known(p BeginParams, waiting bool) (Outcome, bool) {
	now := e.clock.Now()
	if out, ok := e.journal.replay(p.Scope, p.Key, p.Fingerprint, now); ok {
		return out, true
	}
	if rec, ok := e.cache.get(p.Scope, p.Key, now); ok {
		return decide(rec, p.Fingerprint, now), true
	}
	if !waiting {
		return Outcome{}, false
	}
	if rec, ok := e.owners.get(p.Scope, p.Key, now); ok {
		return decide(rec, p.Fingerprint, now), true
	}
	return Outcome{}, false
}

// decide is the decision for a request with fingerprint f on a record that
// somebody else owns or settled.
func decide(rec Record, f Fingerprint, now time.Time) Outcome {
	out := Outcome{Record: rec}
	switch {
	case rec.Fingerprint != f:
		out.Decision = Mismatch
		out.Diff = f.Diff(rec.Fingerprint)
	case rec.State == StateCompleted:
		out.Decision = Replay
	case rec.State == StateUnknown:
		out.Decision = Uncertain
	default:
		out.Decision = InFlight
		out.RetryAfter = max(rec.LeaseExpires.Sub(now).Round(time.Second), time.Second)
	}
	return out
}

// Renew extends l by its Duration from now and returns the renewed lease.
// [ErrLeaseLost] means the lease had already run out or was taken over: stop
// the work if you still can, and do not expect to store its outcome over a
// newer owner.
func (e *Engine) Renew(ctx context.Context, l Lease) (Lease, error) {
	now := e.clock.Now()
	expires := now.Add(l.Duration)
	ctx, cancel := context.WithTimeout(ctx, e.storeTimeout)
	defer cancel()
	if err := e.store.Renew(ctx, store.RenewParams{Scope: l.Scope, Key: l.Key, Token: l.Token, Now: now, LeaseExpires: expires}); err != nil {
		if errors.Is(err, ErrLeaseLost) {
			e.owners.done(l)
			e.local.Notify(ctx, l.Scope, l.Key) // the waiters on this owner look again
		}
		return l, err
	}
	l.Expires = expires
	e.owners.renewed(l)
	return l, nil
}

// Complete stores resp as the outcome; every later Begin with the same key
// and payload replays it until the retention runs out.
//
// An outcome is never dropped for want of a store: Complete (like Release
// and MarkUnknown) is detached from ctx's cancellation, and when the
// store's answer is lost it sends the same write again (a repeat of a
// settling write succeeds, so this is safe). When the store stays
// unreachable for the store timeout, the outcome goes to the journal (see
// [Config.JournalDir]), which stores it as soon as the store answers, and
// Complete returns nil: the outcome is kept, and a Begin in this engine
// replays it meanwhile. An error means it was not kept: [ErrLeaseLost] (a
// newer owner's outcome stands) or [ErrInvalid].
func (e *Engine) Complete(ctx context.Context, l Lease, resp *Response) error {
	return e.finish(ctx, l, StateCompleted, resp)
}

// Release records that nothing happened (the work was refused before any
// side effect, e.g. rate limited): the record becomes FAILED and the next
// retry runs.
func (e *Engine) Release(ctx context.Context, l Lease) error {
	return e.finish(ctx, l, StateFailed, nil)
}

// MarkUnknown records that the work may have had a side effect whose outcome
// is not known (e.g. it panicked during an external call). Retries get
// Uncertain until the owner's late Complete or Release, or the reconciler,
// settles it.
func (e *Engine) MarkUnknown(ctx context.Context, l Lease) error {
	return e.finish(ctx, l, StateUnknown, nil)
}

// HeaderExpires is the response header that says until when an outcome is
// replayed (an HTTP-date): the retention policy the IETF draft asks servers
// to publish. The engine sets it on the response of every outcome it
// completes, for the first answer, and on the response of every completed
// record it reads, for the replays: the same value, the record's expiry.
// (Stores do not keep the header: they keep the expiry.)
const HeaderExpires = "Idempotency-Expires"

// expiresHeader is [HeaderExpires]'s value for an outcome that expires at t.
func expiresHeader(t time.Time) string { return t.UTC().Format(http.TimeFormat) }

// finishParams returns the store params that settle l as state at the
// engine's current time, with the lease's retention. A completed outcome's
// header gets [HeaderExpires]: resp's own header, so that the caller can send
// it with the first answer; the response stored is a copy without it.
func (e *Engine) finishParams(l Lease, state State, resp *Response) FinishParams {
	now := e.clock.Now()
	p := FinishParams{Scope: l.Scope, Key: l.Key, Token: l.Token, Now: now, State: state, Response: resp}
	if state.Terminal() {
		p.Expires = e.expires(l, now)
	}
	if state == StateCompleted && resp != nil {
		stored := *resp
		stored.Header = resp.Header.Clone()
		stored.Header.Del(HeaderExpires)
		p.Response = &stored
		if resp.Header == nil {
			resp.Header = http.Header{}
		}
		resp.Header.Set(HeaderExpires, expiresHeader(p.Expires))
	}
	return p
}

// withExpires returns rec, read from the store or the journal, with
// [HeaderExpires] in its response when it is completed: a copy of the
// response, since the one read may be shared (a store's, the journal's).
// A record that release 0.1.0 stored keeps the header, with this value.
func withExpires(rec Record) Record {
	if rec.State != StateCompleted || rec.Response == nil || rec.Expires.IsZero() {
		return rec
	}
	v := expiresHeader(rec.Expires)
	if rec.Response.Header.Get(HeaderExpires) == v {
		return rec
	}
	resp := *rec.Response
	resp.Header = resp.Header.Clone()
	if resp.Header == nil {
		resp.Header = http.Header{}
	}
	resp.Header.Set(HeaderExpires, v)
	rec.Response = &resp
	return rec
}

// Expires is when an outcome of l settled now would stop being replayed,
// as [HeaderExpires] would say. For the answer to a request that goes to
// the client before its outcome is stored (a streamed response): the record
// is settled a moment later, so it lasts at least until then.
func (e *Engine) Expires(l Lease) time.Time { return e.expires(l, e.clock.Now()) }

func (e *Engine) expires(l Lease, now time.Time) time.Time {
	if l.Retention > 0 {
		return now.Add(l.Retention)
	}
	return now.Add(e.retention)
}

func (e *Engine) finish(ctx context.Context, l Lease, state State, resp *Response) error {
	p := e.finishParams(l, state, resp)
	p.Repeat = true // the lease's owner: a repeat of its own write may succeed
	err := e.retry(ctx, func(ctx context.Context) error { return e.store.Finish(ctx, p) })
	if errors.Is(err, ErrUnavailable) {
		// In the journal before the lease counts as done: Close, which waits
		// for the leases held, then finds the outcome there.
		var keep time.Time // how long another store's engine leaves it
		if state == StateUnknown {
			keep = e.expires(l, p.Now)
		}
		err := e.journal.put(p, l.Fingerprint, time.Time{}, keep)
		e.owners.done(l)
		if err != nil {
			return err
		}
		e.notify(ctx, l.Scope, l.Key) // this engine's waiters find it in the journal
		return nil
	}
	e.owners.done(l)
	switch {
	case err == nil:
		e.notify(ctx, l.Scope, l.Key)
		return nil
	case errors.Is(err, ErrLeaseLost):
		// Somebody else settled or took the record: this process's
		// waiters, who waited on this owner, look at it again.
		e.local.Notify(ctx, l.Scope, l.Key)
		if state == StateCompleted && e.adopt(ctx, l, resp) {
			return nil
		}
	}
	return err
}

// adopt reports whether the record l names was settled by somebody else
// with the outcome resp (its status and body): a reconciler that asked the
// downstream service after this owner's lease ran out found what this owner
// did. Then that outcome is stored, and resp takes its Idempotency-Expires,
// so the first answer and the replays agree.
func (e *Engine) adopt(ctx context.Context, l Lease, resp *Response) bool {
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), e.storeTimeout)
	defer cancel()
	rec, err := e.store.Get(sctx, store.GetParams{Scope: l.Scope, Key: l.Key, Now: e.clock.Now()})
	return err == nil && adopted(rec, l, resp)
}

// adopted is adopt's rule for rec, the record l names, read from the store.
func adopted(rec Record, l Lease, resp *Response) bool {
	if !sameOutcome(rec.Response, resp) || rec.State != StateCompleted || rec.Fingerprint != l.Fingerprint {
		return false
	}
	resp.Header.Set(HeaderExpires, expiresHeader(rec.Expires))
	return true
}

// sameOutcome reports whether two responses are the same outcome: status and
// body (headers may differ: who stored it, when).
func sameOutcome(a, b *Response) bool {
	return a != nil && b != nil && a.Status == b.Status && a.BodyOmitted == b.BodyOmitted && bytes.Equal(a.Body, b.Body)
}

// Settlement is an outcome found out from outside a running request: by a
// reconciler that asked the downstream service, by an operator, or by a
// handler that stores its outcome in its own database transaction.
type Settlement struct {
	// State is StateCompleted, StateFailed (nothing happened: the next
	// retry runs) or StateUnknown (retries get Uncertain).
	State State
	// Response is what retries replay; required for StateCompleted, which
	// gets [HeaderExpires] in its header.
	Response *Response
	// Commit, when set, stores the settlement itself, in the caller's
	// database transaction, together with the writes the outcome implies
	// (the ledger debit of a charge): it must pass p to the store's
	// transactional finish (pgstore's or sqlitestore's FinishTx) and commit.
	// When it returns nil, the settlement is stored.
	Commit func(ctx context.Context, p FinishParams) error
}

// Settle stores s as the outcome of the record l names: a lease the caller
// holds, or one borrowed from a stale record ([Record.Lease]). It is a
// compare-and-set on the lease token, made once: [ErrLeaseLost] means
// somebody else settled the record first (the owner, another reconciler) and
// theirs stands; [ErrUnavailable] that the store could not be reached, and
// whether the settlement landed is not known (look again). Unlike Complete,
// it is neither retried nor journaled, since two reconcilers borrowing one
// token must not both succeed, and a Commit's own writes must not commit
// twice. store.Waiters for the record are woken.
func (e *Engine) Settle(ctx context.Context, l Lease, s Settlement) error {
	p := e.finishParams(l, s.State, s.Response)
	var err error
	if s.Commit != nil {
		err = s.Commit(ctx, p)
	} else {
		err = e.bounded(ctx, func(ctx context.Context) error { return e.store.Finish(ctx, p) })
	}
	if err == nil || errors.Is(err, ErrLeaseLost) {
		e.owners.done(l) // the caller is done with the lease
	}
	if err != nil {
		return err
	}
	e.notify(ctx, l.Scope, l.Key)
	return nil
}

// MaxBody is the largest response body the engine's store keeps (see
// [store.BodyLimiter]); a completed outcome with a larger one is kept with its
// body omitted.
func (e *Engine) MaxBody() int { return store.MaxBody(e.store) }

// Get returns the live record under scope and key, or [ErrNotFound]. A
// store that does not answer within the store timeout is unavailable.
func (e *Engine) Get(ctx context.Context, scope, key string) (Record, error) {
	var r Record
	err := e.bounded(ctx, func(ctx context.Context) (err error) {
		r, err = e.store.Get(ctx, store.GetParams{Scope: scope, Key: key, Now: e.clock.Now()})
		return err
	})
	if err == nil || errors.Is(err, ErrNotFound) {
		e.answered()
	}
	return withExpires(r), err
}

// Scan returns a page of stale records (UNKNOWN, or IN_PROGRESS past their
// lease) for a reconciler; pass the returned cursor to get the next page. A
// store that does not answer within the store timeout is unavailable.
func (e *Engine) Scan(ctx context.Context, limit int, cursor string) (ScanResult, error) {
	var page ScanResult
	err := e.bounded(ctx, func(ctx context.Context) (err error) {
		page, err = e.store.Scan(ctx, store.ScanParams{Now: e.clock.Now(), Limit: limit, Cursor: cursor})
		return err
	})
	return page, err
}

// bounded makes a store call under the store timeout: one not answered by
// then is unavailable, whatever error came with it, unless the caller's own
// context ended first (its cancellation is its answer).
func (e *Engine) bounded(ctx context.Context, call func(context.Context) error) error {
	sctx, cancel := context.WithTimeout(ctx, e.storeTimeout)
	defer cancel()
	err := call(sctx)
	if ctx.Err() == nil {
		err = unanswered(sctx, err)
	}
	return err
}

// List returns a page of the live records that match p, in any state, for
// operators; pass the returned cursor in p.Cursor for the next page. p.Now
// is the engine's clock's now. See [ListParams] for what a page promises. A
// store that does not answer within the store timeout is unavailable.
func (e *Engine) List(ctx context.Context, p ListParams) (ScanResult, error) {
	p.Now = e.clock.Now()
	var page ScanResult
	err := e.bounded(ctx, func(ctx context.Context) (err error) {
		page, err = e.store.List(ctx, p)
		return err
	})
	for i, rec := range page.Records {
		page.Records[i] = withExpires(rec)
	}
	return page, err
}

// PruneOptions says what [Engine.Prune] deletes.
type PruneOptions struct {
	// Before: settled records that expired at or before it are deleted.
	// Defaults to now (the engine's clock); a time after now is refused,
	// since it would delete outcomes that are still being replayed.
	Before time.Time
	// Progress, when set, is told the running total after each batch.
	Progress func(deleted int)
}

// Prune deletes settled records whose retention has run out, in batches,
// and returns how many it deleted. Unsettled records (in progress, unknown)
// are never deleted. Stores whose server expires records itself (Redis,
// Memcached, DynamoDB) have nothing to delete. Each batch is one store call
// under the store timeout.
func (e *Engine) Prune(ctx context.Context, o PruneOptions) (int, error) {
	now := e.clock.Now()
	before := o.Before
	if before.IsZero() {
		before = now
	}
	if before.After(now) {
		return 0, invalid("cannot prune records expiring after now (%s): they are still replayed", now.UTC().Format(time.RFC3339))
	}
	total := 0
	for {
		var n int
		err := e.bounded(ctx, func(ctx context.Context) (err error) {
			n, err = e.store.Prune(ctx, store.PruneParams{Now: before, Limit: store.DefaultPruneLimit})
			return err
		})
		total += n
		if o.Progress != nil {
			o.Progress(total)
		}
		if err != nil || n < store.DefaultPruneLimit {
			return total, err
		}
	}
}

// Hold keeps l alive while work runs: it renews the lease every third of its
// Duration until stop is called. The returned context is cancelled, with
// cause [ErrLeaseLost], when the lease is lost or runs out before a renewal
// succeeds (the store may be unreachable meanwhile); work should then stop,
// since its outcome can no longer be stored over a newer owner. stop ends the
// renewals, waits for the one in progress, and returns the lease as last
// renewed.
//
// ctx bounds the renewals; pass a context that a client disconnect does not
// cancel (context.WithoutCancel) when the work must finish regardless.
func (e *Engine) Hold(ctx context.Context, l Lease) (held context.Context, stop func() Lease) {
	held, cancel := context.WithCancelCause(ctx)
	h := &hold{e: e, held: held, cancel: cancel, current: l, every: max(l.Duration/3, time.Millisecond)}
	h.mu.Lock()
	h.schedule(h.every)
	h.mu.Unlock()
	return held, h.stop
}

// hold is a lease kept alive by [Engine.Hold]. No goroutine waits between
// renewals: each is a timer's callback, which sets the next.
type hold struct {
	e      *Engine
	held   context.Context
	cancel context.CancelCauseFunc
	every  time.Duration

	mu       sync.Mutex
	current  Lease
	stopped  bool
	timer    func()        // stops the next renewal's timer
	renewing chan struct{} // closed when the renewal in progress ends
}

// schedule sets the timer of the next renewal, d from now; h.mu is held.
func (h *hold) schedule(d time.Duration) { h.timer = afterFunc(h.e.clock, d, h.renew) }

// renew renews the lease, and sets the timer of the next renewal: a third
// of the lease after a success; after a failure the same, or the moment the
// lease runs out if that comes first, when the work is cancelled. The work
// never runs on past its lease: another owner may then take the key.
func (h *hold) renew() {
	h.mu.Lock()
	if h.stopped || h.held.Err() != nil {
		h.mu.Unlock()
		return
	}
	current := h.current
	if !h.e.clock.Now().Before(current.Expires) {
		h.cancel(fmt.Errorf("%w: lease ran out while renewals failed", ErrLeaseLost))
		h.mu.Unlock()
		return
	}
	done := make(chan struct{})
	h.renewing = done
	h.mu.Unlock()

	// A renewal does not outlast the lease it renews. (Deadlines are on
	// the wall clock; on another clock the timer above bounds the wait.)
	ctx, cancel := h.held, context.CancelFunc(func() {})
	if _, ok := h.e.clock.(systemClock); ok {
		ctx, cancel = context.WithDeadline(h.held, current.Expires)
	}
	renewed, err := h.e.Renew(ctx, current)
	cancel()

	h.mu.Lock()
	defer h.mu.Unlock()
	defer close(done)
	h.renewing = nil
	next := h.every
	switch {
	case err == nil:
		h.current = renewed
	case errors.Is(err, ErrLeaseLost):
		h.cancel(fmt.Errorf("%w: renewal refused: %v", ErrLeaseLost, err))
		return
	default:
		left := current.Expires.Sub(h.e.clock.Now())
		if left <= 0 {
			h.cancel(fmt.Errorf("%w: lease ran out while renewals failed: %v", ErrLeaseLost, err))
			return
		}
		next = min(next, left)
	}
	if !h.stopped {
		h.schedule(next)
	}
}

func (h *hold) stop() Lease {
	h.mu.Lock()
	h.stopped = true
	h.timer()
	renewing := h.renewing
	h.mu.Unlock()
	if renewing != nil {
		<-renewing
	}
	h.cancel(context.Canceled)
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.current
}

// afterFunc calls f in a goroutine of its own once d has passed on c, unless
// the function it returns is called first. On the system clock it is a
// runtime timer (no goroutine waits); on another clock a goroutine waits for
// c.After, whose timer is set before afterFunc returns.
func afterFunc(c Clock, d time.Duration, f func()) (stop func()) {
	if _, ok := c.(systemClock); ok {
		t := time.AfterFunc(d, f)
		return func() { t.Stop() }
	}
	fire := c.After(d)
	cancel := make(chan struct{})
	go func() {
		select {
		case <-fire:
			f()
		case <-cancel:
		}
	}()
	var once sync.Once
	return func() { once.Do(func() { close(cancel) }) }
}
