// Package memstore is an [store.Store] in memory, for tests and for a single
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
	"strconv"
	"sync"
	"sync/atomic"

	"github.com/idemhq/idem/store"
)

var _ store.Store = (*Store)(nil)

// Store keeps records in a map. The zero value is not usable; call [New].
type Store struct {
	mu      sync.Mutex
	records map[string]*store.Record
	maxBody int
	owner   string // names this store in its scan cursors
}

// instances numbers the stores made, so that each has cursors of its own.
var instances atomic.Uint64

var _ store.BodyLimiter = (*Store)(nil)

// New returns an empty store.
func New() *Store {
	return &Store{records: make(map[string]*store.Record), maxBody: math.MaxInt,
		owner: "memstore:" + strconv.FormatUint(instances.Add(1), 10)}
}

// NewLimited returns an empty store that keeps response bodies of at most
// maxBody bytes, as stores with an item size limit do (see
// [store.BodyLimiter]); for tests of that behaviour.
func NewLimited(maxBody int) *Store {
	s := New()
	s.maxBody = maxBody
	return s
}

// MaxBody implements [store.BodyLimiter].
func (s *Store) MaxBody() int { return s.maxBody }

// id joins scope and key; neither may hold a NUL byte, so it is unambiguous.
func id(scope, key string) string { return scope + "\x00" + key }

// Acquire implements [store.Store].
func (s *Store) Acquire(ctx context.Context, p store.AcquireParams) (store.Record, error) {
	if err := p.Validate(); err != nil {
		return store.Record{}, err
	}
	if err := ctx.Err(); err != nil {
		return store.Record{}, err
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

// Renew implements [store.Store].
func (s *Store) Renew(ctx context.Context, p store.RenewParams) error {
	if err := p.Validate(); err != nil {
		return err
	}
	return s.update(ctx, p.Scope, p.Key, p.Apply)
}

// Checkpoint implements [store.Store].
func (s *Store) Checkpoint(ctx context.Context, p store.CheckpointParams) error {
	if err := p.Validate(); err != nil {
		return err
	}
	p.Data = slices.Clone(p.Data)
	return s.update(ctx, p.Scope, p.Key, p.Apply)
}

// Finish implements [store.Store].
func (s *Store) Finish(ctx context.Context, p store.FinishParams) error {
	if err := p.Validate(); err != nil {
		return err
	}
	p.Response = cloneResponse(p.Response)
	if p.Response != nil && len(p.Response.Body) > s.maxBody {
		p.Response = p.Response.WithoutBody()
	}
	return s.update(ctx, p.Scope, p.Key, p.Apply)
}

func (s *Store) update(ctx context.Context, scope, key string, apply func(*store.Record) error) error {
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

// Get implements [store.Store].
func (s *Store) Get(ctx context.Context, p store.GetParams) (store.Record, error) {
	if err := p.Validate(); err != nil {
		return store.Record{}, err
	}
	if err := ctx.Err(); err != nil {
		return store.Record{}, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	r := s.records[id(p.Scope, p.Key)]
	if r == nil || !r.Live(p.Now) {
		return store.Record{}, store.ErrNotFound
	}
	return *clone(r), nil
}

// Scan implements [store.Store].
func (s *Store) Scan(ctx context.Context, p store.ScanParams) (store.ScanResult, error) {
	if err := p.Validate(); err != nil {
		return store.ScanResult{}, err
	}
	return s.page(ctx, p.Cursor, p.PageSize(), func(r *store.Record) bool { return r.Live(p.Now) && r.Stale(p.Now) })
}

// List implements [store.Store]: the matching records in the order of
// their scope and key.
func (s *Store) List(ctx context.Context, p store.ListParams) (store.ScanResult, error) {
	if err := p.Validate(); err != nil {
		return store.ScanResult{}, err
	}
	return s.page(ctx, p.Cursor, p.PageSize(), func(r *store.Record) bool { return p.Match(*r) })
}

// page returns up to size records that match, after the cursor's, in the
// order of their scope and key.
func (s *Store) page(ctx context.Context, cursor string, size int, match func(*store.Record) bool) (store.ScanResult, error) {
	after := ""
	if cursor != "" {
		f, err := store.DecodeCursor(cursor, s.owner, 2)
		if err != nil {
			return store.ScanResult{}, err
		}
		after = id(f[0], f[1])
	}
	if err := ctx.Err(); err != nil {
		return store.ScanResult{}, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	var res store.ScanResult
	for _, k := range slices.Sorted(maps.Keys(s.records)) {
		if r := s.records[k]; k > after && match(r) {
			if len(res.Records) == size {
				last := res.Records[len(res.Records)-1]
				res.Cursor = store.EncodeCursor(s.owner, last.Scope, last.Key)
				return res, nil
			}
			res.Records = append(res.Records, *clone(r))
		}
	}
	return res, nil
}

// Prune implements [store.Store].
func (s *Store) Prune(ctx context.Context, p store.PruneParams) (int, error) {
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

func clone(r *store.Record) *store.Record {
	c := *r
	c.Response = cloneResponse(r.Response)
	c.Checkpoints = slices.Clone(r.Checkpoints)
	for i := range c.Checkpoints {
		c.Checkpoints[i].Data = slices.Clone(c.Checkpoints[i].Data)
	}
	return &c
}

func cloneResponse(r *store.Response) *store.Response {
	if r == nil {
		return nil
	}
	c := *r
	c.Header, c.Body = r.Header.Clone(), slices.Clone(r.Body)
	return &c
}

var _ store.DurabilityReporter = (*Store)(nil)

// Durability implements [store.DurabilityReporter]: records live in this
// process's memory and die with it.
func (s *Store) Durability(context.Context) (store.Durability, error) {
	return store.Durability{Detail: "memory: records live in this process and are lost when it exits"}, nil
}
