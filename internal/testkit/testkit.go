// Package testkit holds the helpers this module's tests share: records made
// and settled on a store directly, notifier waits, goroutine counts, and the
// benchmarks' measuring and their response. (Store authors need only
// store/storetest.)
package testkit

import (
	"context"
	"net/http"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/wait"
	"github.com/idemhq/idem/store"
)

var ctx = context.Background()

// Counted counts the calls of a request's path (Acquire, Renew, Finish,
// Get) made to the store it wraps: the tests of the cache and of coalesced
// waiters, and the load harness, count store calls with it.
type Counted struct {
	idem.Store
	calls atomic.Int64
}

// Calls is the number of calls made so far.
func (c *Counted) Calls() int64 { return c.calls.Load() }

// Unwrap returns the counted store.
func (c *Counted) Unwrap() idem.Store { return c.Store }

func (c *Counted) Acquire(ctx context.Context, p store.AcquireParams) (idem.Record, error) {
	c.calls.Add(1)
	return c.Store.Acquire(ctx, p)
}

func (c *Counted) Renew(ctx context.Context, p store.RenewParams) error {
	c.calls.Add(1)
	return c.Store.Renew(ctx, p)
}

func (c *Counted) Finish(ctx context.Context, p store.FinishParams) error {
	c.calls.Add(1)
	return c.Store.Finish(ctx, p)
}

func (c *Counted) Get(ctx context.Context, p store.GetParams) (idem.Record, error) {
	c.calls.Add(1)
	return c.Store.Get(ctx, p)
}

// notifyWait bounds every wait for a notification.
const notifyWait = 10 * time.Second

// Fingerprint is the fingerprint of a POST /v1/charges with body, for
// tests that call a store directly.
func Fingerprint(body string) idem.Fingerprint {
	return idem.NewFingerprint(idem.Payload{Method: "POST", Path: "/v1/charges", Body: []byte(body)})
}

// Acquire acquires scope and key on s at now with a new token, failing the
// test unless the lease is granted, and returns the record.
func Acquire(t *testing.T, s idem.Store, scope, key string, now time.Time, lease time.Duration) idem.Record {
	t.Helper()
	tok, err := store.NewToken()
	if err != nil {
		t.Fatal(err)
	}
	r, err := s.Acquire(ctx, store.AcquireParams{Scope: scope, Key: key, Fingerprint: Fingerprint("a"),
		Token: tok, Now: now, LeaseExpires: now.Add(lease)})
	if err != nil {
		t.Fatalf("Acquire(%q, %q): %v", scope, key, err)
	}
	if r.Token != tok {
		t.Fatalf("Acquire(%q, %q) did not grant the lease: %+v", scope, key, r)
	}
	return r
}

// Finish settles r on s as state at now (a COMPLETED record with a small
// response; a terminal one kept for retention), failing the test on error.
func Finish(t *testing.T, s idem.Store, r idem.Record, now time.Time, state idem.State, retention time.Duration) {
	t.Helper()
	p := idem.FinishParams{Scope: r.Scope, Key: r.Key, Token: r.Token, Now: now, State: state}
	if state == idem.StateCompleted {
		p.Response = &idem.Response{Status: 201, Body: []byte("ok")}
	}
	if state.Terminal() {
		p.Expires = now.Add(retention)
	}
	if err := s.Finish(ctx, p); err != nil {
		t.Fatalf("Finish(%q) as %s: %v", r.Key, state, err)
	}
}

// MustNotify notifies scope and key through n, failing the test on error.
func MustNotify(t *testing.T, n idem.Notifier, scope, key string) {
	t.Helper()
	if err := n.Notify(ctx, scope, key); err != nil {
		t.Fatalf("Notify(%q, %q): %v", scope, key, err)
	}
}

// Woken waits for a value on ch, and fails the test if none comes within
// ten seconds: a signal wait, not a sleep.
func Woken(t *testing.T, ch <-chan struct{}, what string) {
	t.Helper()
	select {
	case <-ch:
	case <-time.After(notifyWait):
		t.Fatalf("%s was not woken within %v", what, notifyWait)
	}
}

// Pending reports, without waiting, whether ch holds a wake-up.
func Pending(ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}

// stacks returns the stacks of every goroutine, as runtime.Stack writes
// them.
func stacks() string {
	for buf := make([]byte, 1<<16); ; buf = make([]byte, 2*len(buf)) {
		if n := runtime.Stack(buf, true); n < len(buf) {
			return string(buf[:n])
		}
	}
}

// Goroutines counts the goroutines that the calling goroutine started in
// function fn (as runtime.Stack names it) and that are still running.
func Goroutines(fn string) int {
	buf := make([]byte, 64)
	self := strings.Fields(string(buf[:runtime.Stack(buf, false)]))[1] // goroutine <id> [running]:
	return strings.Count(stacks(), "\ncreated by "+fn+" in goroutine "+self+"\n")
}

// Selecting counts the goroutines blocked in a select with every one of
// frames (function names or file names) on their stacks: how a test knows
// that callers wait where it means them to, when nothing signals it.
func Selecting(frames ...string) int {
	n := 0
	for _, g := range strings.Split(stacks(), "\n\n") {
		header, _, _ := strings.Cut(g, "\n")
		if strings.Contains(header, "[select") && !slices.ContainsFunc(frames, func(f string) bool { return !strings.Contains(g, f) }) {
			n++
		}
	}
	return n
}

// AwaitGoroutines waits until exactly want goroutines that the calling
// goroutine started in function fn (as runtime.Stack names it) are still
// running, failing the test after ten seconds: how a store's test shows
// that Close ended what a constructor started (one that has just ended may
// still be returning).
func AwaitGoroutines(t *testing.T, fn string, want int) {
	t.Helper()
	for deadline := time.Now().Add(notifyWait); Goroutines(fn) != want; {
		if time.Now().After(deadline) {
			t.Fatalf("%d goroutines started in %s still run, want %d", Goroutines(fn), fn, want)
		}
		time.Sleep(time.Millisecond)
	}
}

// BenchResponse returns the outcome every store's benchmarks store, raw ones
// included: a small JSON charge, so that their figures compare.
func BenchResponse() *idem.Response {
	return &idem.Response{Status: 201, Header: http.Header{"Content-Type": {"application/json"}},
		Body: []byte(`{"id":"ch_3MmlLrLkdIwHu7ix0snN0B15","object":"charge","amount":1099,"currency":"usd","status":"succeeded"}`)}
}

// Measure runs op under b.Loop, with the number of the iteration, and
// reports ops/s and, when roundTrips is not nil, round trips per op (as
// roundTrips counts them). Stores' benchmarks of their bare driver
// operations use it, so that they report as the idem ones do.
func Measure(b *testing.B, roundTrips func() int64, op func(i int)) {
	var start int64
	if roundTrips != nil {
		start = roundTrips()
	}
	ops := 0
	for b.Loop() {
		op(ops)
		ops++
	}
	if roundTrips != nil {
		b.ReportMetric(float64(roundTrips()-start)/float64(ops), "roundtrips/op")
	}
	b.ReportMetric(float64(ops)/b.Elapsed().Seconds(), "ops/s")
}

// Queue starts calls that queue behind a batch that is still running, one
// at a time, each once the one before it is queued (by Waiting, the count of
// queued calls), so that they queue in the order they were added; each
// call's result goes to Results (set it) under its name.
type Queue struct {
	T       testing.TB
	Waiting func() int
	Results map[string]chan error
}

// Add starts call under name and returns once it is queued (or fails the
// test after 10 s).
func (q *Queue) Add(name string, call func() error) {
	q.T.Helper()
	ch := make(chan error, 1)
	q.Results[name] = ch
	want := q.Waiting() + 1
	go func() { ch <- call() }()
	wait.Until(q.T, 10*time.Second, name+" to queue", func() bool { return q.Waiting() == want })
}

// SyncBuffer is a log's output that goroutines write while a test reads it
// (a server's, an SDK's).
type SyncBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

// Write appends p.
func (s *SyncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

// String returns what was written so far.
func (s *SyncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}
