// Package memstore is an [idem.Store] in memory, for tests and for a single
// process that can afford to forget every record when it exits.
//
// Every operation takes one mutex and costs no I/O. Records are copied in and
// out, so a caller that changes a response after storing it changes nothing
// in the store.
package memstore

import (
	"context"
	"maps"
	"math"
	"slices"
	"sync"

	"github.com/idemhq/idem"
)

var _ idem.Store = (*Store)(nil)

// Store keeps records in a map. The zero value is not usable; call [New].
type Store struct {
	mu      sync.Mutex
	records map[string]*idem.Record
	maxBody int
}

var _ idem.BodyLimiter = (*Store)(nil)

// New returns an empty store.
func New() *Store {
	return &Store{records: make(map[string]*idem.Record), maxBody: math.MaxInt}
}

// NewLimited returns an empty store that keeps response bodies of at most
// maxBody bytes, as stores with an item size limit do (see
// [idem.BodyLimiter]); for tests of that behaviour.
func NewLimited(maxBody int) *Store {
	s := New()
	s.maxBody = maxBody
	return s
}

// MaxBody implements [idem.BodyLimiter].
func (s *Store) MaxBody() int { return s.maxBody }

// id joins scope and key; neither may hold a NUL byte, so it is unambiguous.
func id(scope, key string) string { return scope + "\x00" + key }

// Acquire implements [idem.Store].
func (s *Store) Acquire(ctx context.Context, p idem.AcquireParams) (idem.Record, error) {
	if err := p.Validate(); err != nil {
		return idem.Record{}, err
	}
	if err := ctx.Err(); err != nil {
		return idem.Record{}, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	k := id(p.Scope, p.Key)
	next, write := p.Apply(s.records[k])
	if write {
		s.records[k] = clone(&next)
	}
	return *clone(&next), nil
}

// Renew implements [idem.Store].
func (s *Store) Renew(ctx context.Context, p idem.RenewParams) error {
	if err := p.Validate(); err != nil {
		return err
	}
	return s.update(ctx, p.Scope, p.Key, p.Apply)
}

// Checkpoint implements [idem.Store].
func (s *Store) Checkpoint(ctx context.Context, p idem.CheckpointParams) error {
	if err := p.Validate(); err != nil {
		return err
	}
	p.Data = slices.Clone(p.Data)
	return s.update(ctx, p.Scope, p.Key, p.Apply)
}

// Finish implements [idem.Store].
func (s *Store) Finish(ctx context.Context, p idem.FinishParams) error {
	if err := p.Validate(); err != nil {
		return err
	}
	p.Response = cloneResponse(p.Response)
	if p.Response != nil && len(p.Response.Body) > s.maxBody {
		p.Response.Body, p.Response.BodyOmitted = nil, true
	}
	return s.update(ctx, p.Scope, p.Key, p.Apply)
}

func (s *Store) update(ctx context.Context, scope, key string, apply func(*idem.Record) error) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	r := s.records[id(scope, key)]
	if r == nil {
		return apply(nil)
	}
	next := *clone(r)
	if err := apply(&next); err != nil {
		return err
	}
	*r = next
	return nil
}

// Get implements [idem.Store].
func (s *Store) Get(ctx context.Context, p idem.GetParams) (idem.Record, error) {
	if err := p.Validate(); err != nil {
		return idem.Record{}, err
	}
	if err := ctx.Err(); err != nil {
		return idem.Record{}, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	r := s.records[id(p.Scope, p.Key)]
	if r == nil || !r.Live(p.Now) {
		return idem.Record{}, idem.ErrNotFound
	}
	return *clone(r), nil
}

// Scan implements [idem.Store]. Pages are in scope and key order; the cursor
// is the last scope and key returned.
func (s *Store) Scan(ctx context.Context, p idem.ScanParams) (idem.ScanResult, error) {
	if err := p.Validate(); err != nil {
		return idem.ScanResult{}, err
	}
	if err := ctx.Err(); err != nil {
		return idem.ScanResult{}, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	ids := slices.Sorted(maps.Keys(s.records))
	var res idem.ScanResult
	for _, k := range ids {
		if k <= p.Cursor {
			continue
		}
		if r := s.records[k]; r.Live(p.Now) && r.Stale(p.Now) {
			if len(res.Records) == p.PageSize() {
				res.Cursor = id(res.Records[len(res.Records)-1].Scope, res.Records[len(res.Records)-1].Key)
				return res, nil
			}
			res.Records = append(res.Records, *clone(r))
		}
	}
	return res, nil
}

// Prune implements [idem.Store].
func (s *Store) Prune(ctx context.Context, p idem.PruneParams) (int, error) {
	if err := p.Validate(); err != nil {
		return 0, err
	}
	if err := ctx.Err(); err != nil {
		return 0, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for k, r := range s.records {
		if n == p.BatchSize() {
			break
		}
		if r.State.Terminal() && !r.Live(p.Now) {
			delete(s.records, k)
			n++
		}
	}
	return n, nil
}

func clone(r *idem.Record) *idem.Record {
	c := *r
	c.Response = cloneResponse(r.Response)
	c.Checkpoints = slices.Clone(r.Checkpoints)
	for i := range c.Checkpoints {
		c.Checkpoints[i].Data = slices.Clone(c.Checkpoints[i].Data)
	}
	return &c
}

func cloneResponse(r *idem.Response) *idem.Response {
	if r == nil {
		return nil
	}
	c := *r
	c.Header, c.Body = r.Header.Clone(), slices.Clone(r.Body)
	return &c
}

var _ idem.DurabilityReporter = (*Store)(nil)

// Durability implements [idem.DurabilityReporter]: records live in this
// process's memory and die with it.
func (s *Store) Durability(context.Context) (idem.Durability, error) {
	return idem.Durability{Detail: "memory: records live in this process and are lost when it exits"}, nil
}
