package storetest_test

import (
	"context"
	"maps"
	"net/http"
	"os"
	"os/exec"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/store"
	"github.com/idemhq/idem/store/storetest"
)

// mutants are copies of memstore that each break one rule the conformance
// suite claims to check, named by the mutation that breaks it. The suite
// must fail every one of them: one it passes is a rule that a real store
// could break unnoticed.
var mutants = []struct {
	name   string
	breaks string // the rule the mutant breaks
}{
	// Atomicity.
	{"racyAcquire", "an acquire reads the record, then writes it: two acquires of one key both win"},
	{"racyFinish", "a Finish reads the record, then writes it: two settlements under one borrowed token both land"},
	// Acquire transitions.
	{"replayExpired", "an expired record is answered as it is, not created anew"},
	{"createdKept", "a re-run after a release keeps the released record's Created"},
	{"unknownNotUpdated", "an acquire that makes an expired lease UNKNOWN leaves Updated as it was"},
	{"fenceReset", "a re-run after a release restarts the fence at 1"},
	{"fenceKeptAfterExpiry", "a record created over an expired one continues its fence"},
	{"takeoverSameFence", "a takeover keeps the fence"},
	{"takeoverAnyFingerprint", "a takeover is granted to another payload"},
	{"takeoverUnsafe", "a lease that is not takeover-safe is taken over"},
	{"takeoverKeepsSafe", "a takeover by a lease that is not takeover-safe leaves the record takeover-safe"},
	{"takeoverNotUpdated", "a takeover leaves Updated as it was"},
	{"unknownReacquired", "an UNKNOWN record is replaced by a new lease"},
	{"expiredStaysInProgress", "an expired lease that is not takeover-safe stays IN_PROGRESS"},
	{"failedKeepsCheckpoints", "a re-run after a release keeps the released run's checkpoints"},
	{"leaseOffByOne", "a lease still holds at the very millisecond it ends"},
	// Renew and Checkpoint.
	{"renewExpired", "a lease is renewed after it ran out"},
	{"renewAnyState", "a settled record's lease is renewed"},
	{"renewNoop", "a renewal is acknowledged but not stored"},
	{"checkpointKeepsSafe", "a checkpoint leaves the record takeover-safe"},
	{"checkpointExpired", "a checkpoint lands after the lease ran out"},
	{"checkpointAnyState", "a checkpoint lands on a settled record"},
	// Finish.
	{"finishNotUpdated", "a Finish leaves Updated as it was"},
	{"repeatIgnoresOmitted", "a repeat compares status and body, not headers or BodyOmitted"},
	{"repeatIgnoresHeaderValues", "a repeat compares status, body and the number of headers, not their values"},
	{"repeatIgnoresValueOrder", "a repeat compares the values of each header, not their order"},
	{"repeatIgnoresHeaderNames", "a repeat compares the values of the headers, not their names"},
	{"finishIgnoresToken", "a Finish settles the record under any token"},
	{"noRepeat", "the owner's repeat of its Finish is refused"},
	{"alwaysRepeat", "a borrowed token's second settlement is taken as a repeat"},
	{"repeatAnyToken", "a repeat is accepted under another token"},
	{"repeatAnyState", "a repeat is accepted in another state or with another response"},
	{"repeatCreates", "a repeat creates a missing record"},
	{"finishNoExpiry", "a settled record never expires"},
	{"finishDropsHeader", "a Finish drops the response's headers"},
	{"finishOnlyInProgress", "the owner's late outcome is refused on an UNKNOWN record"},
	{"finishDropsCheckpoints", "a Finish drops the record's checkpoints"},
	// Reads and pruning.
	{"getExpired", "Get returns an expired record"},
	{"scanSkipsUnknown", "a scan leaves UNKNOWN records out"},
	{"pruneUnknown", "Prune deletes UNKNOWN records"},
	{"pruneEarly", "Prune deletes records a minute before they expire"},
}

// TestSuiteRejectsMutants runs the whole conformance suite ([storetest.Run])
// on each of the mutants, each in a child process, and fails when the suite
// passes one. The control: the suite passes the unbroken copy ("none"). A
// mutant counts as rejected only when a case of the suite fails it, not when
// it panics or races. In the child process ($IDEM_STORETEST_MUTANT set) it
// is the suite run on that mutant.
func TestSuiteRejectsMutants(t *testing.T) {
	if m := os.Getenv(mutantEnv); m != "" {
		storetest.Run(t, func(t *testing.T) idem.Store { return newMutant(m) })
		return
	}
	t.Run("none", func(t *testing.T) {
		t.Parallel()
		if out, failed := runSuiteOn(t, "none"); failed != nil {
			t.Fatalf("the suite fails the unbroken store (cases %v):\n%s", failed, out)
		}
	})
	for _, m := range mutants {
		t.Run(m.name, func(t *testing.T) {
			t.Parallel()
			out, failed := runSuiteOn(t, m.name)
			if len(failed) == 0 {
				t.Fatalf("the conformance suite passed a store in which %s (mutant %q):\n%s", m.breaks, m.name, lastLines(out, 10))
			}
			t.Logf("rejected by %s", strings.Join(failed, ", "))
		})
	}
}

// mutantEnv names the mutant that the child process of
// [TestSuiteRejectsMutants] runs the suite on.
const mutantEnv = "IDEM_STORETEST_MUTANT"

var failedCase = regexp.MustCompile(`(?m)^\s*--- FAIL: TestSuiteRejectsMutants/([^/\s]+)`)

// runSuiteOn runs the suite on mutant m in a child process and returns its
// output and the cases of the suite that failed (nil when it passed). It
// fails t when the child did anything but pass or fail cases: a panic, a
// data race, a timeout.
func runSuiteOn(t *testing.T, m string) (string, []string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^TestSuiteRejectsMutants$", "-test.count=1", "-test.timeout=4m")
	cmd.Env = append(os.Environ(), mutantEnv+"="+m)
	b, err := cmd.CombinedOutput()
	out := string(b)
	if err == nil {
		return out, nil
	}
	if strings.Contains(out, "panic:") || strings.Contains(out, "DATA RACE") || ctx.Err() != nil {
		t.Fatalf("the suite on mutant %q did not run to its end: %v\n%s", m, err, lastLines(out, 40))
	}
	var failed []string
	for _, f := range failedCase.FindAllStringSubmatch(out, -1) {
		if !slices.Contains(failed, f[1]) {
			failed = append(failed, f[1])
		}
	}
	if len(failed) == 0 {
		t.Fatalf("the suite on mutant %q failed, but no case of it did: %v\n%s", m, err, lastLines(out, 40))
	}
	return out, failed
}

func lastLines(s string, n int) string {
	l := strings.Split(strings.TrimSpace(s), "\n")
	return strings.Join(l[max(0, len(l)-n):], "\n")
}

// mutant is memstore with one rule broken, the one its mutation names
// ("none": none).
type mutant struct {
	mu       sync.Mutex
	recs     map[string]*store.Record
	mutation string
	owner    string // of its cursors
}

var mutantsMade atomic.Int64

func newMutant(m string) *mutant {
	return &mutant{recs: map[string]*store.Record{}, mutation: m, owner: "mutant:" + strconv.FormatInt(mutantsMade.Add(1), 10)}
}

func recID(scope, key string) string { return scope + "\x00" + key }

func cloneRecord(r *store.Record) *store.Record {
	c := *r
	c.Response = r.Response.Clone()
	c.Checkpoints = slices.Clone(r.Checkpoints)
	return &c
}

// expiredLease reports whether ex is a live IN_PROGRESS record whose lease
// ran out at now.
func expiredLease(ex *store.Record, now time.Time) bool {
	return ex != nil && ex.Live(now) && ex.State == store.StateInProgress && !now.Before(ex.LeaseExpires)
}

func (s *mutant) Acquire(ctx context.Context, p store.AcquireParams) (store.Record, error) {
	if err := store.Ready(ctx, "mutant", "acquire", p); err != nil {
		return store.Record{}, err
	}
	k := recID(p.Scope, p.Key)
	if s.mutation == "racyAcquire" {
		s.mu.Lock()
		var ex *store.Record
		if r := s.recs[k]; r != nil {
			ex = cloneRecord(r)
		}
		s.mu.Unlock()
		time.Sleep(time.Millisecond) // what a round trip between the read and the write takes
		next, write := p.Apply(ex)
		s.mu.Lock()
		if write {
			s.recs[k] = cloneRecord(&next)
		}
		s.mu.Unlock()
		return next, nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	ex := s.recs[k]
	var next store.Record
	var write bool
	switch {
	case s.mutation == "replayExpired" && ex != nil && !ex.Live(p.Now):
		next, write = *ex, false
	case s.mutation == "createdKept" && ex != nil && ex.Live(p.Now) && ex.State == store.StateFailed:
		next, write = p.Apply(ex)
		next.Created = ex.Created
	case s.mutation == "unknownNotUpdated" && expiredLease(ex, p.Now) && !ex.TakeoverSafe:
		next, write = p.Apply(ex)
		next.Updated = ex.Updated
	case s.mutation == "fenceReset" && ex != nil && ex.Live(p.Now) && ex.State == store.StateFailed:
		next, write = p.Apply(ex)
		next.Fence = 1
	case s.mutation == "fenceKeptAfterExpiry" && ex != nil && !ex.Live(p.Now):
		next, write = p.Apply(ex)
		next.Fence = ex.Fence + 1
	case s.mutation == "takeoverSameFence" && expiredLease(ex, p.Now) && ex.TakeoverSafe:
		next, write = p.Apply(ex)
		next.Fence = ex.Fence
	case s.mutation == "takeoverAnyFingerprint" && expiredLease(ex, p.Now) && ex.TakeoverSafe:
		e := *ex
		e.Fingerprint = p.Fingerprint
		next, write = p.Apply(&e)
	case s.mutation == "takeoverUnsafe" && expiredLease(ex, p.Now) && !ex.TakeoverSafe && ex.Fingerprint == p.Fingerprint:
		e := *ex
		e.TakeoverSafe = true
		next, write = p.Apply(&e)
	case s.mutation == "unknownReacquired" && ex != nil && ex.State == store.StateUnknown:
		next, write = p.Apply(nil)
	case s.mutation == "expiredStaysInProgress" && expiredLease(ex, p.Now) && !ex.TakeoverSafe:
		next, write = *ex, false
	case s.mutation == "failedKeepsCheckpoints" && ex != nil && ex.Live(p.Now) && ex.State == store.StateFailed:
		next, write = p.Apply(ex)
		next.Checkpoints = ex.Checkpoints
	case s.mutation == "takeoverKeepsSafe" && expiredLease(ex, p.Now) && ex.TakeoverSafe:
		next, write = p.Apply(ex)
		next.TakeoverSafe = true
	case s.mutation == "takeoverNotUpdated" && expiredLease(ex, p.Now) && ex.TakeoverSafe:
		next, write = p.Apply(ex)
		next.Updated = ex.Updated
	case s.mutation == "leaseOffByOne" && ex != nil && ex.State == store.StateInProgress && p.Now.Equal(ex.LeaseExpires):
		next, write = *ex, false
	default:
		next, write = p.Apply(ex)
	}
	if write {
		s.recs[k] = cloneRecord(&next)
	}
	return *cloneRecord(&next), nil
}

// update applies apply to a copy of the record under scope and key (nil
// when there is none) and stores the copy when apply succeeds.
func (s *mutant) update(scope, key string, apply func(*store.Record) error) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	r := s.recs[recID(scope, key)]
	if r == nil {
		return apply(nil)
	}
	next := *cloneRecord(r)
	if err := apply(&next); err != nil {
		return err
	}
	*r = next
	return nil
}

func (s *mutant) Renew(ctx context.Context, p store.RenewParams) error {
	if err := store.Ready(ctx, "mutant", "renew", p); err != nil {
		return err
	}
	switch s.mutation {
	case "renewExpired":
		return s.update(p.Scope, p.Key, func(r *store.Record) error {
			if r != nil && r.Token == p.Token && r.State == store.StateInProgress {
				r.LeaseExpires, r.Updated = p.LeaseExpires, p.Now
				return nil
			}
			return store.ErrLeaseLost
		})
	case "renewAnyState":
		return s.update(p.Scope, p.Key, func(r *store.Record) error {
			if r != nil && r.Token == p.Token && p.Now.Before(r.LeaseExpires) {
				r.LeaseExpires, r.Updated = p.LeaseExpires, p.Now
				return nil
			}
			return store.ErrLeaseLost
		})
	case "renewNoop":
		return s.update(p.Scope, p.Key, func(r *store.Record) error {
			if r == nil {
				return p.Apply(nil)
			}
			e := *r
			return p.Apply(&e)
		})
	}
	return s.update(p.Scope, p.Key, p.Apply)
}

func (s *mutant) Checkpoint(ctx context.Context, p store.CheckpointParams) error {
	if err := store.Ready(ctx, "mutant", "checkpoint", p); err != nil {
		return err
	}
	p.Data = slices.Clone(p.Data)
	switch s.mutation {
	case "checkpointKeepsSafe":
		return s.update(p.Scope, p.Key, func(r *store.Record) error {
			var safe bool
			if r != nil {
				safe = r.TakeoverSafe
			}
			err := p.Apply(r)
			if err == nil {
				r.TakeoverSafe = safe
			}
			return err
		})
	case "checkpointExpired":
		return s.update(p.Scope, p.Key, func(r *store.Record) error {
			if r != nil && r.Token == p.Token && r.State == store.StateInProgress {
				r.Checkpoints = append(r.Checkpoints, p.Checkpoint())
				r.TakeoverSafe, r.Updated = false, p.Now
				return nil
			}
			return store.ErrLeaseLost
		})
	case "checkpointAnyState":
		return s.update(p.Scope, p.Key, func(r *store.Record) error {
			if r != nil && r.Token == p.Token && p.Now.Before(r.LeaseExpires) {
				r.Checkpoints = append(r.Checkpoints, p.Checkpoint())
				r.TakeoverSafe, r.Updated = false, p.Now
				return nil
			}
			return store.ErrLeaseLost
		})
	}
	return s.update(p.Scope, p.Key, p.Apply)
}

// repeatIf answers a Finish as a repeat when same says the stored record r
// and p are the same outcome under p's token, and applies p otherwise.
func repeatIf(p store.FinishParams, same func(r *store.Record) bool) func(r *store.Record) error {
	return func(r *store.Record) error {
		if p.Repeat && r != nil && p.State.Terminal() && r.State == p.State && same(r) {
			return nil
		}
		return p.Apply(r)
	}
}

func (s *mutant) Finish(ctx context.Context, p store.FinishParams) error {
	if err := store.Ready(ctx, "mutant", "finish", p); err != nil {
		return err
	}
	p.Response = p.Response.Clone()
	k := recID(p.Scope, p.Key)
	switch s.mutation {
	case "racyFinish":
		s.mu.Lock()
		var ex *store.Record
		if r := s.recs[k]; r != nil {
			ex = cloneRecord(r)
		}
		s.mu.Unlock()
		time.Sleep(time.Millisecond) // what a round trip between the read and the write takes
		if err := p.Apply(ex); err != nil || ex == nil {
			return err
		}
		s.mu.Lock()
		s.recs[k] = ex
		s.mu.Unlock()
		return nil
	case "repeatIgnoresOmitted":
		return s.update(p.Scope, p.Key, repeatIf(p, func(r *store.Record) bool {
			return r.Token == p.Token && r.Response != nil && p.Response != nil &&
				r.Response.Status == p.Response.Status && string(r.Response.Body) == string(p.Response.Body)
		}))
	case "repeatIgnoresHeaderValues":
		return s.update(p.Scope, p.Key, repeatIf(p, func(r *store.Record) bool {
			return r.Token == p.Token && r.Response != nil && p.Response != nil &&
				r.Response.Status == p.Response.Status && string(r.Response.Body) == string(p.Response.Body) &&
				r.Response.BodyOmitted == p.Response.BodyOmitted && len(r.Response.Header) == len(p.Response.Header)
		}))
	case "repeatIgnoresValueOrder":
		return s.update(p.Scope, p.Key, repeatIf(p, func(r *store.Record) bool {
			a, b := r.Response.Clone(), p.Response.Clone()
			if a == nil || b == nil {
				return a == b
			}
			for _, h := range []http.Header{a.Header, b.Header} {
				for _, v := range h {
					slices.Sort(v)
				}
			}
			return r.Token == p.Token && a.Equal(b)
		}))
	case "repeatIgnoresHeaderNames":
		return s.update(p.Scope, p.Key, repeatIf(p, func(r *store.Record) bool {
			a, b := r.Response.Clone(), p.Response.Clone()
			if a == nil || b == nil {
				return a == b
			}
			values := func(h http.Header) []string {
				var all []string
				for _, v := range h {
					all = append(all, v...)
				}
				slices.Sort(all)
				return all
			}
			va, vb := values(a.Header), values(b.Header)
			a.Header, b.Header = nil, nil
			return r.Token == p.Token && a.Equal(b) && slices.Equal(va, vb)
		}))
	case "repeatAnyToken":
		return s.update(p.Scope, p.Key, repeatIf(p, func(r *store.Record) bool { return r.Response.Equal(p.Response) }))
	case "repeatAnyState":
		return s.update(p.Scope, p.Key, func(r *store.Record) error {
			if p.Repeat && r != nil && r.Token == p.Token && r.State.Terminal() {
				return nil
			}
			return p.Apply(r)
		})
	case "finishIgnoresToken":
		return s.update(p.Scope, p.Key, func(r *store.Record) error {
			if r != nil {
				p.Token = r.Token
			}
			return p.Apply(r)
		})
	case "noRepeat":
		p.Repeat = false
	case "alwaysRepeat":
		p.Repeat = true
	case "repeatCreates":
		s.mu.Lock()
		if s.recs[k] == nil && p.Repeat {
			s.recs[k] = &store.Record{Scope: p.Scope, Key: p.Key, Token: p.Token, State: p.State, Response: p.Response,
				Expires: p.Expires, Created: p.Now, Updated: p.Now, Fence: 1}
			s.mu.Unlock()
			return nil
		}
		s.mu.Unlock()
	case "finishNoExpiry", "finishDropsCheckpoints", "finishNotUpdated":
		return s.update(p.Scope, p.Key, func(r *store.Record) error {
			var before store.Record
			if r != nil {
				before = *r
			}
			if err := p.Apply(r); err != nil {
				return err
			}
			switch s.mutation {
			case "finishNoExpiry":
				r.Expires = time.Time{}
			case "finishDropsCheckpoints":
				r.Checkpoints = nil
			case "finishNotUpdated":
				r.Updated = before.Updated
			}
			return nil
		})
	case "finishDropsHeader":
		if p.Response != nil {
			p.Response.Header = nil
		}
	case "finishOnlyInProgress":
		return s.update(p.Scope, p.Key, func(r *store.Record) error {
			if r != nil && r.State == store.StateUnknown {
				return store.ErrLeaseLost
			}
			return p.Apply(r)
		})
	}
	return s.update(p.Scope, p.Key, p.Apply)
}

func (s *mutant) Get(ctx context.Context, p store.GetParams) (store.Record, error) {
	if err := store.Ready(ctx, "mutant", "get", p); err != nil {
		return store.Record{}, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	r := s.recs[recID(p.Scope, p.Key)]
	if r == nil || !r.Live(p.Now) && s.mutation != "getExpired" {
		return store.Record{}, store.ErrNotFound
	}
	return *cloneRecord(r), nil
}

// page returns the records that match, in key order, from the cursor on.
func (s *mutant) page(cursor string, size int, match func(*store.Record) bool) (store.ScanResult, error) {
	after := ""
	if cursor != "" {
		f, err := store.DecodeCursor(cursor, s.owner, 2)
		if err != nil {
			return store.ScanResult{}, err
		}
		after = recID(f[0], f[1])
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	var res store.ScanResult
	for _, k := range slices.Sorted(maps.Keys(s.recs)) {
		if r := s.recs[k]; k > after && match(r) {
			if len(res.Records) == size {
				last := res.Records[len(res.Records)-1]
				res.Cursor = store.EncodeCursor(s.owner, last.Scope, last.Key)
				return res, nil
			}
			res.Records = append(res.Records, *cloneRecord(r))
		}
	}
	return res, nil
}

func (s *mutant) Scan(ctx context.Context, p store.ScanParams) (store.ScanResult, error) {
	if err := store.Ready(ctx, "mutant", "scan", p); err != nil {
		return store.ScanResult{}, err
	}
	return s.page(p.Cursor, p.PageSize(), func(r *store.Record) bool {
		if s.mutation == "scanSkipsUnknown" && r.State == store.StateUnknown {
			return false
		}
		return r.Live(p.Now) && r.Stale(p.Now)
	})
}

func (s *mutant) List(ctx context.Context, p store.ListParams) (store.ScanResult, error) {
	if err := store.Ready(ctx, "mutant", "list", p); err != nil {
		return store.ScanResult{}, err
	}
	return s.page(p.Cursor, p.PageSize(), func(r *store.Record) bool { return p.Match(*r) })
}

func (s *mutant) Prune(ctx context.Context, p store.PruneParams) (int, error) {
	if err := store.Ready(ctx, "mutant", "prune", p); err != nil {
		return 0, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for k, r := range s.recs {
		if n == p.BatchSize() {
			break
		}
		expired := !r.Live(p.Now) || s.mutation == "pruneEarly" && !r.Expires.After(p.Now.Add(time.Minute))
		if r.State.Terminal() && expired || s.mutation == "pruneUnknown" && r.State == store.StateUnknown {
			delete(s.recs, k)
			n++
		}
	}
	return n, nil
}

func (s *mutant) Durability(context.Context) (store.Durability, error) {
	return store.Durability{Detail: "memory"}, nil
}
