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

// OpenEventually is [Open] for a long-running server: a store whose server
// cannot be reached yet does not fail it. Every call on such a store fails
// with [idem.ErrUnavailable] (so requests fail closed and /readyz says not
// ready) until the store opens, which the next call after a pause tries
// again. A DSN that is wrong fails at once, as with Open: one that does not
// parse, and one the server or the file system refuses for good (see
// [misconfigured]), though its store calls it unavailable.
func OpenEventually(ctx context.Context, dsn string) (*Opened, error) {
	opened, err := Open(ctx, dsn)
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
// does not exist (3D000), or the schema is not valid (3F000). For SQLite,
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
			return pgErr.Code == "3D000" || pgErr.Code == "3F000"
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

// eventual is a store that opens once its server answers.
type eventual struct {
	dsn     string
	maxBody int

	mu      sync.Mutex
	opened  *Opened
	last    time.Time
	lastErr error
}

var (
	_ idem.Store               = (*eventual)(nil)
	_ store.BodyLimiter        = (*eventual)(nil)
	_ store.DurabilityReporter = (*eventual)(nil)
)

// store returns the open store, opening it when the pause since the last
// try is over.
func (e *eventual) store(ctx context.Context) (idem.Store, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.opened != nil {
		return e.opened.Store, nil
	}
	if time.Since(e.last) < reopenEvery {
		return nil, e.lastErr
	}
	e.last = time.Now()
	opened, err := Open(ctx, e.dsn)
	if err != nil {
		if !errors.Is(err, idem.ErrUnavailable) {
			err = fmt.Errorf("%w: %w", idem.ErrUnavailable, err)
		}
		e.lastErr = err
		return nil, err
	}
	e.opened = opened
	return opened.Store, nil
}

func (e *eventual) close() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.opened != nil {
		return e.opened.Close()
	}
	return nil
}

// newNotifier starts the open store's notifier, once the store is open.
func (e *eventual) newNotifier(ctx context.Context) (idem.Notifier, error) {
	if _, err := e.store(ctx); err != nil {
		return nil, err
	}
	if e.opened.NewNotifier == nil {
		return nil, fmt.Errorf("%w: this store has no notifier", idem.ErrInvalid)
	}
	return e.opened.NewNotifier(ctx)
}

// MaxBody implements [store.BodyLimiter]: the limit of the store's kind.
func (e *eventual) MaxBody() int { return e.maxBody }

func (e *eventual) Acquire(ctx context.Context, p store.AcquireParams) (idem.Record, error) {
	s, err := e.store(ctx)
	if err != nil {
		return idem.Record{}, err
	}
	return s.Acquire(ctx, p)
}

func (e *eventual) Renew(ctx context.Context, p store.RenewParams) error {
	s, err := e.store(ctx)
	if err != nil {
		return err
	}
	return s.Renew(ctx, p)
}

func (e *eventual) Checkpoint(ctx context.Context, p store.CheckpointParams) error {
	s, err := e.store(ctx)
	if err != nil {
		return err
	}
	return s.Checkpoint(ctx, p)
}

func (e *eventual) Finish(ctx context.Context, p idem.FinishParams) error {
	s, err := e.store(ctx)
	if err != nil {
		return err
	}
	return s.Finish(ctx, p)
}

func (e *eventual) Get(ctx context.Context, p store.GetParams) (idem.Record, error) {
	s, err := e.store(ctx)
	if err != nil {
		return idem.Record{}, err
	}
	return s.Get(ctx, p)
}

func (e *eventual) Scan(ctx context.Context, p store.ScanParams) (idem.ScanResult, error) {
	s, err := e.store(ctx)
	if err != nil {
		return idem.ScanResult{}, err
	}
	return s.Scan(ctx, p)
}

func (e *eventual) List(ctx context.Context, p store.ListParams) (idem.ScanResult, error) {
	s, err := e.store(ctx)
	if err != nil {
		return idem.ScanResult{}, err
	}
	return s.List(ctx, p)
}

func (e *eventual) Prune(ctx context.Context, p store.PruneParams) (int, error) {
	s, err := e.store(ctx)
	if err != nil {
		return 0, err
	}
	return s.Prune(ctx, p)
}

// Durability implements [store.DurabilityReporter] once the store is open.
func (e *eventual) Durability(ctx context.Context) (store.Durability, error) {
	s, err := e.store(ctx)
	if err != nil {
		return store.Durability{}, err
	}
	r, ok := s.(store.DurabilityReporter)
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
