package storeopen

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"modernc.org/sqlite"
	sqlite3 "modernc.org/sqlite/lib"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/store"
)

// reopenEvery is how often a store whose server could not be reached yet is
// tried again, at most.
const reopenEvery = time.Second

// Bounds on an attempt to open a store whose server may not answer (one that
// accepts connections and never answers: a hung server, a pooler whose
// server is down; PostgreSQL's driver has no connect timeout of its own).
// The first attempt holds the start of the listeners, so it is short: past
// it the store opens in the background. A later attempt runs in the
// background while calls fail fast, so it may take longer (a migration
// that steps aside for traffic).
const (
	firstOpenTimeout = 5 * time.Second
	reopenTimeout    = 30 * time.Second
)

// OpenEventually is [Open] for a long-running server: a store whose server
// cannot be reached yet, or does not answer within firstOpenTimeout, does
// not fail it. Every call on such a store fails at once with
// [idem.ErrUnavailable] (so requests fail closed and /readyz says not
// ready) until the store opens, which a call after a pause starts again in
// the background (one attempt at a time, each bounded by reopenTimeout). A
// DSN that is wrong fails at once, as with Open: one that does not parse,
// and one the server or the file system refuses for good (see
// [misconfigured]), though its store calls it unavailable. (Redis's and
// DynamoDB's clients open without a word to the server: Open reads a
// record to learn it, see probe.)
func OpenEventually(ctx context.Context, dsn string) (*Opened, error) {
	first, cancel := context.WithTimeout(ctx, firstOpenTimeout)
	opened, err := Open(first, dsn)
	if err != nil && errors.Is(first.Err(), context.DeadlineExceeded) && ctx.Err() == nil && !errors.Is(err, idem.ErrUnavailable) {
		err = fmt.Errorf("%w: the store did not answer within %v: %w", idem.ErrUnavailable, firstOpenTimeout, err)
	}
	cancel()
	if err != nil && (!errors.Is(err, idem.ErrUnavailable) || misconfigured(Kind(dsn), err)) {
		return nil, err
	}
	if err != nil {
		scheme, _, _ := strings.Cut(dsn, ":")
		e := &eventual{dsn: dsn, last: time.Now(), lastErr: err, maxBody: maxBodyOf(scheme)}
		opened = &Opened{Store: e, Kind: kindOf(scheme), Close: e.close, NewNotifier: e.newNotifier}
	}
	if start := opened.NewNotifier; start != nil {
		// Started once it can be: cross-instance wake-ups are a speed-up
		// that waiters do without (they poll) while the server is away.
		opened.NewNotifier = func(ctx context.Context) (idem.Notifier, error) {
			n, err := startEventually(ctx, start)
			if c, ok := n.(interface{ Close() error }); ok && err == nil {
				closeStore := opened.Close
				opened.Close = func() error { c.Close(); return closeStore() }
			}
			return n, err
		}
	}
	return opened, nil
}

// misconfigured reports whether err, from opening a store of kind, means
// that the DSN is wrong rather than that the server is not up yet: waiting
// would answer 503 for ever (or, with fail_open, run every request
// unprotected). For every store: the server refused the credentials or
// the permissions ([idem.ErrDenied]). For PostgreSQL also: the database
// does not exist (3D000), the schema is not valid (3F000), a run-time
// parameter of the DSN is unknown to the server (42704: a mistyped option,
// which pgx sends to the server as one) or has a value it refuses (22023),
// or a pooler refuses it (PgBouncer's 08P01 "unsupported startup
// parameter"; its other 08P01s, a full pool or a server it cannot reach,
// may pass). For SQLite,
// which has no server to wait for: anything but a lock held by another
// process or a deadline.
func misconfigured(kind string, err error) bool {
	if errors.Is(err, idem.ErrDenied) {
		return true
	}
	switch kind {
	case "postgres":
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) {
			switch pgErr.Code {
			case "3D000", "3F000", "42704", "22023":
				return true
			case "08P01":
				return strings.HasPrefix(pgErr.Message, "unsupported startup parameter")
			}
			return false
		}
	case "sqlite":
		if errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) {
			return false
		}
		var se *sqlite.Error
		if errors.As(err, &se) {
			switch se.Code() & 0xff {
			case sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED:
				return false
			}
		}
		return true
	}
	return false
}

// eventual is a store that opens once its server answers. Its calls never
// wait for an attempt to open it: they fail as unavailable while it is not
// open, and the attempts run in the background.
type eventual struct {
	dsn     string
	maxBody int

	mu      sync.Mutex
	opened  *Opened
	opening bool      // an attempt runs in the background
	closed  bool      // Close was called: no more attempts, and a late one is closed
	last    time.Time // when the last attempt began
	lastErr error     // why it failed, wrapping idem.ErrUnavailable
}

var (
	_ idem.Store               = (*eventual)(nil)
	_ store.BodyLimiter        = (*eventual)(nil)
	_ store.DurabilityReporter = (*eventual)(nil)
)

// store returns the open store or, while it is not open, the last attempt's
// error at once, starting a new attempt in the background when none runs
// and the pause since the last one is over.
func (e *eventual) store() (*Opened, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.opened != nil {
		return e.opened, nil
	}
	if !e.opening && !e.closed && time.Since(e.last) >= reopenEvery {
		e.opening, e.last = true, time.Now()
		go e.open()
	}
	return nil, fmt.Errorf("%w (%w)", e.lastErr, store.ErrNotSent)
}

// open makes one attempt to open the store, out of every caller's way.
func (e *eventual) open() {
	ctx, cancel := context.WithTimeout(context.Background(), reopenTimeout)
	opened, err := Open(ctx, e.dsn)
	cancel()
	e.mu.Lock()
	defer e.mu.Unlock()
	e.opening = false
	switch {
	case err != nil:
		if !errors.Is(err, idem.ErrUnavailable) {
			err = fmt.Errorf("%w: %w", idem.ErrUnavailable, err)
		}
		e.lastErr = err
	case e.closed:
		opened.Close()
	default:
		e.opened = opened
	}
}

func (e *eventual) close() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.closed = true
	if e.opened != nil {
		return e.opened.Close()
	}
	return nil
}

// newNotifier starts the open store's notifier, once the store is open.
func (e *eventual) newNotifier(ctx context.Context) (idem.Notifier, error) {
	opened, err := e.store()
	if err != nil {
		return nil, err
	}
	if opened.NewNotifier == nil {
		return nil, fmt.Errorf("%w: this store has no notifier", idem.ErrInvalid)
	}
	return opened.NewNotifier(ctx)
}

// MaxBody implements [store.BodyLimiter]: the limit of the store's kind.
func (e *eventual) MaxBody() int { return e.maxBody }

func (e *eventual) Acquire(ctx context.Context, p store.AcquireParams) (idem.Record, error) {
	o, err := e.store()
	if err != nil {
		return idem.Record{}, err
	}
	return o.Store.Acquire(ctx, p)
}

func (e *eventual) Renew(ctx context.Context, p store.RenewParams) error {
	o, err := e.store()
	if err != nil {
		return err
	}
	return o.Store.Renew(ctx, p)
}

func (e *eventual) Checkpoint(ctx context.Context, p store.CheckpointParams) error {
	o, err := e.store()
	if err != nil {
		return err
	}
	return o.Store.Checkpoint(ctx, p)
}

func (e *eventual) Finish(ctx context.Context, p idem.FinishParams) error {
	o, err := e.store()
	if err != nil {
		return err
	}
	return o.Store.Finish(ctx, p)
}

func (e *eventual) Get(ctx context.Context, p store.GetParams) (idem.Record, error) {
	o, err := e.store()
	if err != nil {
		return idem.Record{}, err
	}
	return o.Store.Get(ctx, p)
}

func (e *eventual) Scan(ctx context.Context, p store.ScanParams) (idem.ScanResult, error) {
	o, err := e.store()
	if err != nil {
		return idem.ScanResult{}, err
	}
	return o.Store.Scan(ctx, p)
}

func (e *eventual) List(ctx context.Context, p store.ListParams) (idem.ScanResult, error) {
	o, err := e.store()
	if err != nil {
		return idem.ScanResult{}, err
	}
	return o.Store.List(ctx, p)
}

func (e *eventual) Prune(ctx context.Context, p store.PruneParams) (int, error) {
	o, err := e.store()
	if err != nil {
		return 0, err
	}
	return o.Store.Prune(ctx, p)
}

// Durability implements [store.DurabilityReporter] once the store is open.
func (e *eventual) Durability(ctx context.Context) (store.Durability, error) {
	o, err := e.store()
	if err != nil {
		return store.Durability{}, err
	}
	r, ok := o.Store.(store.DurabilityReporter)
	if !ok {
		return store.Durability{Detail: "unknown"}, nil
	}
	return r.Durability(ctx)
}

// maxBodyOf is the body limit of a store kind that may open eventually.
func maxBodyOf(scheme string) int {
	if scheme == "dynamodb" {
		return dynamoMaxBody
	}
	return math.MaxInt
}

// notifierRetry is the pause between attempts to start a notifier whose
// server could not be reached.
const notifierRetry = 2 * time.Second

// eventualNotifier is a notifier that starts once its server answers; until
// then nobody is woken across instances and waiters poll.
type eventualNotifier struct {
	mu   sync.Mutex
	real idem.Notifier
	stop chan struct{}
	done chan struct{}
}

// startEventually starts a notifier with start now, or, when the server
// cannot be reached, in the background as soon as it can be.
func startEventually(ctx context.Context, start func(context.Context) (idem.Notifier, error)) (idem.Notifier, error) {
	n, err := start(ctx)
	if err == nil || !errors.Is(err, idem.ErrUnavailable) {
		return n, err
	}
	e := &eventualNotifier{stop: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(e.done)
		for {
			select {
			case <-e.stop:
				return
			case <-time.After(notifierRetry):
			}
			attempt, cancel := context.WithTimeout(context.WithoutCancel(ctx), notifierRetry)
			n, err := start(attempt)
			cancel()
			if err == nil {
				e.mu.Lock()
				e.real = n
				e.mu.Unlock()
				return
			}
		}
	}()
	return e, nil
}

func (e *eventualNotifier) current() idem.Notifier {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.real
}

// Subscribe implements [idem.Notifier]; before the notifier has started, the
// channel never receives (the waiter polls).
func (e *eventualNotifier) Subscribe(scope, key string) (<-chan struct{}, func()) {
	if n := e.current(); n != nil {
		return n.Subscribe(scope, key)
	}
	return nil, func() {}
}

// Notify implements [idem.Notifier].
func (e *eventualNotifier) Notify(ctx context.Context, scope, key string) error {
	if n := e.current(); n != nil {
		return n.Notify(ctx, scope, key)
	}
	return fmt.Errorf("%w: the notifier has not reached its server yet", idem.ErrUnavailable)
}

// Close stops trying and closes the notifier once started.
func (e *eventualNotifier) Close() error {
	select {
	case <-e.stop:
	default:
		close(e.stop)
	}
	<-e.done
	if c, ok := e.current().(interface{ Close() error }); ok {
		return c.Close()
	}
	return nil
}
