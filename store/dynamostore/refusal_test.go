package dynamostore

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/dynamodb"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/httpidem"
	"github.com/idemhq/idem/store"
	"github.com/idemhq/idem/store/memstore"
)

// writeFault is an HTTP endpoint in front of the test server that answers
// some PutItem requests itself, as DynamoDB does when it throttles or fails
// them, and passes every other request on.
type writeFault struct {
	// fault is the answer: the status and the error type of DynamoDB's
	// body, or a status of 0 for a connection cut before any answer.
	status int
	code   string
	// first makes the fault answer every PutItem; otherwise it answers
	// only those that replace a record read (their condition names the
	// record's token), and lets a put of a new item through.
	first bool
	// on turns the fault on; faulted counts the requests it answered.
	on      atomic.Bool
	faulted atomic.Int64
}

// listen starts the fault in front of the test server, on, and returns its
// URL.
func (f *writeFault) listen(t *testing.T) string {
	t.Helper()
	target, err := url.Parse(endpoint(t))
	if err != nil {
		t.Fatal(err)
	}
	pass := httputil.NewSingleHostReverseProxy(target)
	f.on.Store(true)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, err := io.ReadAll(r.Body)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		r.Body = io.NopCloser(bytes.NewReader(body))
		put := strings.HasSuffix(r.Header.Get("X-Amz-Target"), ".PutItem")
		if !f.on.Load() || !put || !f.first && bytes.Contains(body, []byte("attribute_not_exists")) {
			pass.ServeHTTP(w, r)
			return
		}
		f.faulted.Add(1)
		if f.status == 0 {
			conn, _, err := http.NewResponseController(w).Hijack()
			if err == nil {
				conn.Close()
			}
			return
		}
		w.Header().Set("Content-Type", "application/x-amz-json-1.0")
		w.WriteHeader(f.status)
		fmt.Fprintf(w, `{"__type":"com.amazonaws.dynamodb.v20120810#%s","message":"test fault"}`, f.code)
	}))
	t.Cleanup(srv.Close)
	return srv.URL
}

// writeFaults are the answers DynamoDB gives a write it does not make for
// a reason of the moment: throttling, a transaction holding the item, a
// failure of its own; and a connection cut before the answer.
var writeFaults = []struct {
	name   string
	status int
	code   string
}{
	{"ProvisionedThroughputExceededException", 400, "ProvisionedThroughputExceededException"},
	{"ThrottlingException", 400, "ThrottlingException"},
	{"RequestLimitExceeded", 400, "RequestLimitExceeded"},
	{"TransactionConflictException", 400, "TransactionConflictException"},
	{"InternalServerError", 500, "InternalServerError"},
	{"connection cut", 0, ""},
}

// TestWriteAfterReadRefused: a retry of a request whose owner crashed (in
// progress, its lease run out) finds the record, and its write that marks
// it UNKNOWN is throttled (or conflicts with a transaction, or fails):
// DynamoDB was reached and holds the record, which may say the request
// ran, so the error is ErrRefused as well as ErrUnavailable, never a reason
// to fail open. (It was plain ErrUnavailable, and the middleware with
// fail_open ran the request again.) The same fault on the put of a new key,
// before any record was seen, stays plain ErrUnavailable.
func TestWriteAfterReadRefused(t *testing.T) {
	t.Parallel()
	for _, wf := range writeFaults {
		t.Run(wf.name, func(t *testing.T) {
			t.Parallel()
			now := time.Now()
			seed := newTestStore(t, nil, 0)
			if _, err := seed.Acquire(ctx, store.AcquireParams{Key: "abandoned", Fingerprint: fp("a"), Token: tokA,
				Now: now.Add(-2 * time.Minute), LeaseExpires: now.Add(-time.Minute)}); err != nil {
				t.Fatal(err)
			}
			f := &writeFault{status: wf.status, code: wf.code}
			client, _ := newClient(f.listen(t), func(o *dynamodb.Options) { o.Retryer = aws.NopRetryer{} })
			s, err := New(Config{Client: client, Table: seed.table})
			if err != nil {
				t.Fatal(err)
			}
			_, err = s.Acquire(ctx, store.AcquireParams{Key: "abandoned", Fingerprint: fp("a"), Token: tokB,
				Now: now, LeaseExpires: now.Add(time.Minute)})
			if !errors.Is(err, idem.ErrUnavailable) || !errors.Is(err, idem.ErrRefused) {
				t.Errorf("acquire of an abandoned record whose write is answered %s: %v; want ErrUnavailable and ErrRefused", wf.name, err)
			}
			if f.faulted.Load() == 0 {
				t.Errorf("no write faulted")
			}
			if r := rawGet(t, seed, "abandoned", now); r.State != idem.StateInProgress || r.Token != tokA {
				t.Errorf("the record after a faulted write: %v, %s; want it as it was", r.State, r.Token)
			}

			first := &writeFault{status: wf.status, code: wf.code, first: true}
			client, _ = newClient(first.listen(t), func(o *dynamodb.Options) { o.Retryer = aws.NopRetryer{} })
			if s, err = New(Config{Client: client, Table: seed.table}); err != nil {
				t.Fatal(err)
			}
			_, err = s.Acquire(ctx, store.AcquireParams{Key: "new", Fingerprint: fp("a"), Token: tokB,
				Now: now, LeaseExpires: now.Add(time.Minute)})
			if !errors.Is(err, idem.ErrUnavailable) || errors.Is(err, idem.ErrRefused) {
				t.Errorf("acquire of a new key whose put is answered %s: %v; want ErrUnavailable, not ErrRefused (no record seen)", wf.name, err)
			}
		})
	}
}

// rawGet reads the record of key, live or not.
func rawGet(t *testing.T, s *Store, key string, now time.Time) idem.Record {
	t.Helper()
	r, err := s.Get(ctx, store.GetParams{Key: key, Now: now})
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// TestThrottledWriteIsNoReasonToFailOpen is TestWriteAfterReadRefused
// through the middleware: with fail_open, the retry of a request whose
// owner crashed is answered 503 while DynamoDB throttles the write that
// marks its record UNKNOWN, and is not run (it ran again: a second
// charge); once the throttling stops, the record is marked UNKNOWN (409),
// and the request still does not run. The client retries as the SDK does
// by default.
func TestThrottledWriteIsNoReasonToFailOpen(t *testing.T) {
	t.Parallel()
	var runs atomic.Int64
	charge := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		w.WriteHeader(http.StatusCreated)
	})
	post := func(st idem.Store, key string) int {
		eng, err := idem.New(idem.Config{Store: st, StoreTimeout: 500 * time.Millisecond, CacheSize: -1})
		if err != nil {
			t.Fatal(err)
		}
		mw, err := httpidem.New(httpidem.Config{Engine: eng, FailOpen: true})
		if err != nil {
			t.Fatal(err)
		}
		w := httptest.NewRecorder()
		r := httptest.NewRequest("POST", "/charges", strings.NewReader(`{"amount":1}`))
		r.Header.Set("Idempotency-Key", key)
		mw.Wrap(charge).ServeHTTP(w, r)
		return w.Code
	}
	// The record a crashed owner leaves: in progress, its lease run out,
	// with the request's fingerprint (as a store of the test's own takes it).
	probe := memstore.New()
	post(probe, "charge-1")
	rec, err := probe.Get(ctx, store.GetParams{Key: "charge-1", Now: time.Now()})
	if err != nil {
		t.Fatal(err)
	}
	seed := newTestStore(t, nil, 0)
	now := time.Now()
	if _, err := seed.Acquire(ctx, store.AcquireParams{Scope: rec.Scope, Key: rec.Key, Fingerprint: rec.Fingerprint, Token: "crashed",
		Now: now.Add(-2 * time.Minute), LeaseExpires: now.Add(-time.Minute)}); err != nil {
		t.Fatal(err)
	}
	f := &writeFault{status: 400, code: "ProvisionedThroughputExceededException"}
	client, _ := newClient(f.listen(t))
	s, err := New(Config{Client: client, Table: seed.table})
	if err != nil {
		t.Fatal(err)
	}
	runs.Store(0)
	if status := post(s, "charge-1"); status != http.StatusServiceUnavailable || runs.Load() != 0 {
		t.Fatalf("a retry while DynamoDB throttles its write: %d after %d runs; want 503, no run", status, runs.Load())
	}
	if f.faulted.Load() == 0 {
		t.Fatal("no write throttled")
	}
	f.on.Store(false)
	if status := post(s, "charge-1"); status != http.StatusConflict || runs.Load() != 0 {
		t.Fatalf("the retry once DynamoDB takes writes: %d after %d runs; want 409 (unknown), no run", status, runs.Load())
	}
}
