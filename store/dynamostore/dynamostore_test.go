package dynamostore

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/dynamodb"
	"github.com/aws/aws-sdk-go-v2/service/dynamodb/types"
	"github.com/aws/smithy-go"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/store"
	"github.com/idemhq/idem/store/storetest"
)

// t0 is a time that is not a whole second, so that the ttl attribute's
// rounding shows.
var t0 = time.Date(2030, 1, 2, 3, 4, 5, 6e6, time.UTC)

const (
	tokA = "0123456789abcdef0123456789abcdef"
	tokB = "fedcba9876543210fedcba9876543210"
)

func acquire(t *testing.T, s *Store, scope, key, tok string, now time.Time, takeover bool) idem.Record {
	t.Helper()
	r, err := s.Acquire(ctx, store.AcquireParams{Scope: scope, Key: key, Fingerprint: fp("a"), Token: tok,
		Now: now, LeaseExpires: now.Add(30 * time.Second), TakeoverSafe: takeover})
	if err != nil {
		t.Fatalf("Acquire(%q, %q): %v", scope, key, err)
	}
	return r
}

func finish(t *testing.T, s *Store, key, tok string, now time.Time, state idem.State, resp *idem.Response) {
	t.Helper()
	p := idem.FinishParams{Scope: "s", Key: key, Token: tok, Now: now, State: state, Response: resp}
	if state.Terminal() {
		p.Expires = now.Add(time.Hour)
	}
	if err := s.Finish(ctx, p); err != nil {
		t.Fatalf("Finish(%q, %v): %v", key, state, err)
	}
}

func okResponse(body string) *idem.Response {
	return &idem.Response{Status: 201, Header: http.Header{"Content-Type": {"application/json"}}, Body: []byte(body)}
}

// returnsItemOnConditionFailure reports whether the server sends the item
// back with a failed condition when asked to (ReturnValuesOnConditionCheckFailure).
func returnsItemOnConditionFailure(t *testing.T, s *Store) bool {
	t.Helper()
	item := map[string]types.AttributeValue{attrPK: avS("probe")}
	if _, err := s.client.PutItem(ctx, &dynamodb.PutItemInput{TableName: &s.table, Item: item}); err != nil {
		t.Fatal(err)
	}
	_, err := s.client.PutItem(ctx, &dynamodb.PutItemInput{TableName: &s.table, Item: item,
		ConditionExpression:                 aws.String("attribute_not_exists(pk)"),
		ReturnValuesOnConditionCheckFailure: types.ReturnValuesOnConditionCheckFailureAllOld})
	ccf, ok := isConditionFailed(err)
	if !ok {
		t.Fatalf("conditional put of an existing item: %v, want a failed condition", err)
	}
	return ccf.Item != nil
}

// TestRoundTrips counts the requests each operation sends.
func TestRoundTrips(t *testing.T) {
	t.Parallel()
	s, c := countingStore(t, 4)
	extra := int64(1) // a consistent GetItem where the server does not send the item back
	if returnsItemOnConditionFailure(t, s) {
		extra = 0
		t.Log("the server sends the item back with a failed condition: a replay is one round trip")
	} else {
		t.Log("the server does not send the item back with a failed condition (ReturnValuesOnConditionCheckFailure): a replay is two round trips")
	}
	count := func(what string, want int64, op func() error) {
		t.Helper()
		before := c.n.Load()
		if err := op(); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		if got := c.n.Load() - before; got != want {
			t.Errorf("%s: %d round trips, want %d", what, got, want)
		}
	}
	acq := func(key, tok string, now time.Time, want func(idem.Record) bool) func() error {
		return func() error {
			r, err := s.Acquire(ctx, store.AcquireParams{Scope: "s", Key: key, Fingerprint: fp("a"), Token: tok,
				Now: now, LeaseExpires: now.Add(30 * time.Second), TakeoverSafe: true})
			if err == nil && !want(r) {
				err = fmt.Errorf("unexpected record %+v", r)
			}
			return err
		}
	}
	owned := func(tok string) func(idem.Record) bool {
		return func(r idem.Record) bool { return r.Token == tok && r.State == idem.StateInProgress }
	}
	inState := func(st idem.State) func(idem.Record) bool { return func(r idem.Record) bool { return r.State == st } }
	now := t0

	count("acquire of a new key", 1, acq("k", tokA, now, owned(tokA)))
	count("acquire of a running key (in flight)", 1+extra, acq("k", tokB, now, owned(tokA)))
	count("renew", 1, func() error {
		return s.Renew(ctx, store.RenewParams{Scope: "s", Key: "k", Token: tokA, Now: now, LeaseExpires: now.Add(time.Minute)})
	})
	count("checkpoint", 1, func() error {
		return s.Checkpoint(ctx, store.CheckpointParams{Scope: "s", Key: "k", Token: tokA, Now: now, Name: "authorize", Data: []byte("x")})
	})
	count("complete", 1, func() error {
		return s.Finish(ctx, idem.FinishParams{Scope: "s", Key: "k", Token: tokA, Now: now, State: idem.StateCompleted,
			Response: okResponse("done"), Expires: now.Add(time.Hour)})
	})
	count("replay (acquire of a completed key)", 1+extra, acq("k", tokB, now, inState(idem.StateCompleted)))
	count("get", 1, func() error {
		_, err := s.Get(ctx, store.GetParams{Scope: "s", Key: "k", Now: now})
		return err
	})
	count("scan of an empty index (4 shards)", 4, func() error {
		_, err := s.Scan(ctx, store.ScanParams{Now: now})
		return err
	})
	count("prune", 0, func() error {
		_, err := s.Prune(ctx, store.PruneParams{Now: now})
		return err
	})
	count("list page", 1, func() error {
		res, err := s.List(ctx, store.ListParams{Now: now})
		if err == nil && (len(res.Records) != 1 || res.Cursor != "") {
			err = fmt.Errorf("listed %+v, want the one record and no cursor", res)
		}
		return err
	})

	// Release, then re-run: the re-creation is a conditional put of the item read.
	count("acquire", 1, acq("f", tokA, now, owned(tokA)))
	count("release", 1, func() error {
		return s.Finish(ctx, idem.FinishParams{Scope: "s", Key: "f", Token: tokA, Now: now, State: idem.StateFailed, Expires: now.Add(time.Hour)})
	})
	count("acquire of a released key (re-run)", 2+extra, acq("f", tokB, now, owned(tokB)))

	// Takeover of an expired takeover-safe lease.
	count("acquire", 1, acq("t", tokA, now, owned(tokA)))
	count("acquire of an expired takeover-safe lease (takeover)", 2+extra, acq("t", tokB, now.Add(time.Minute), owned(tokB)))

	// Marking UNKNOWN while the lease runs is one round trip; after it ran
	// out, the first condition fails and the other is tried.
	count("acquire", 1, acq("u", tokA, now, owned(tokA)))
	count("mark unknown while the lease runs", 1, func() error {
		return s.Finish(ctx, idem.FinishParams{Scope: "s", Key: "u", Token: tokA, Now: now, State: idem.StateUnknown})
	})
	count("acquire", 1, acq("v", tokA, now, owned(tokA)))
	count("mark unknown after the lease ran out", 2+extra, func() error {
		return s.Finish(ctx, idem.FinishParams{Scope: "s", Key: "v", Token: tokA, Now: now.Add(time.Minute), State: idem.StateUnknown})
	})
	count("scan of three stale records (4 shards)", 4, func() error {
		res, err := s.Scan(ctx, store.ScanParams{Now: now.Add(time.Minute)})
		got := map[string]bool{}
		for _, r := range res.Records {
			got[r.Key] = true
		}
		// f's re-run lease has run out, u and v are unknown; t was taken over.
		if err == nil && (len(got) != 3 || !got["f"] || !got["u"] || !got["v"]) {
			err = fmt.Errorf("scanned %v, want f, u and v", got)
		}
		return err
	})
}

// TestItemLayout checks the attributes of items in each state: unsettled
// items are in the index and have no ttl, settled ones have a ttl (the
// expiry's epoch second, rounded up) and are not in the index.
func TestItemLayout(t *testing.T) {
	t.Parallel()
	s := newTestStore(t, nil, 0)
	n := func(item map[string]types.AttributeValue, name string) (int64, bool) {
		v, ok := item[name].(*types.AttributeValueMemberN)
		if !ok {
			return 0, false
		}
		x, err := strconv.ParseInt(v.Value, 10, 64)
		if err != nil {
			t.Fatalf("%s = %q", name, v.Value)
		}
		return x, true
	}
	unsettled := func(key string, score time.Time) {
		t.Helper()
		item := rawItem(t, s, "s", key)
		if pk := item[attrPK].(*types.AttributeValueMemberS).Value; pk != "1:s:"+key {
			t.Errorf("%s: pk = %q", key, pk)
		}
		if sh, ok := item[attrShard].(*types.AttributeValueMemberS); !ok || sh.Value != s.shardOf("1:s:"+key) {
			t.Errorf("%s: gsi_shard = %v, want %s", key, item[attrShard], s.shardOf("1:s:"+key))
		}
		if got, ok := n(item, attrStaleAt); !ok || got != score.UnixMilli() {
			t.Errorf("%s: gsi_lease = %d (%v), want %d", key, got, ok, score.UnixMilli())
		}
		for _, a := range []string{attrTTL, attrExpires, attrResp, attrBody} {
			if _, ok := item[a]; ok {
				t.Errorf("%s: unsettled item has %s", key, a)
			}
		}
	}
	settled := func(key string, exp time.Time) map[string]types.AttributeValue {
		t.Helper()
		item := rawItem(t, s, "s", key)
		if got, ok := n(item, attrTTL); !ok || got != exp.Unix()+1 { // exp is not a whole second: rounded up
			t.Errorf("%s: ttl = %d (%v), want %d", key, got, ok, exp.Unix()+1)
		}
		if got, ok := n(item, attrExpires); !ok || got != exp.UnixMilli() {
			t.Errorf("%s: expires = %d, want %d", key, got, exp.UnixMilli())
		}
		for _, a := range []string{attrShard, attrStaleAt} {
			if _, ok := item[a]; ok {
				t.Errorf("%s: settled item has %s", key, a)
			}
		}
		return item
	}

	acquire(t, s, "s", "run", tokA, t0, false)
	unsettled("run", t0.Add(30*time.Second))
	if err := s.Renew(ctx, store.RenewParams{Scope: "s", Key: "run", Token: tokA, Now: t0.Add(time.Second), LeaseExpires: t0.Add(time.Minute)}); err != nil {
		t.Fatal(err)
	}
	unsettled("run", t0.Add(time.Minute))

	acquire(t, s, "s", "done", tokA, t0, false)
	resp := okResponse(`{"id":"ch_1"}`)
	finish(t, s, "done", tokA, t0, idem.StateCompleted, resp)
	item := settled("done", t0.Add(time.Hour))
	meta, _, _ := encodeResponse(resp)
	if b, ok := item[attrResp].(*types.AttributeValueMemberB); !ok || string(b.Value) != string(meta) {
		t.Errorf("resp = %v, want the response without its body", item[attrResp])
	}
	if b, ok := item[attrBody].(*types.AttributeValueMemberB); !ok || string(b.Value) != `{"id":"ch_1"}` {
		t.Errorf("body = %v, want the raw body", item[attrBody])
	}

	acquire(t, s, "s", "failed", tokA, t0, false)
	finish(t, s, "failed", tokA, t0, idem.StateFailed, nil)
	if item := settled("failed", t0.Add(time.Hour)); item[attrResp] != nil {
		t.Errorf("a failed item has a response")
	}

	// UNKNOWN items stay in the index, scored at the earlier of the lease's
	// end and when they were marked.
	acquire(t, s, "s", "marked", tokA, t0, false)
	finish(t, s, "marked", tokA, t0.Add(time.Second), idem.StateUnknown, nil)
	unsettled("marked", t0.Add(time.Second))
	finish(t, s, "marked", tokA, t0.Add(2*time.Second), idem.StateUnknown, nil) // again, later: the score stays
	unsettled("marked", t0.Add(time.Second))
	acquire(t, s, "s", "late", tokA, t0, false)
	finish(t, s, "late", tokA, t0.Add(time.Minute), idem.StateUnknown, nil)
	unsettled("late", t0.Add(30*time.Second))
	acquire(t, s, "s", "expired", tokA, t0, false)
	if r := acquire(t, s, "s", "expired", tokB, t0.Add(time.Minute), false); r.State != idem.StateUnknown {
		t.Fatalf("acquire after the lease ran out: %v, want unknown", r.State)
	}
	unsettled("expired", t0.Add(30*time.Second))
	// The late owner settles it: out of the index, with a ttl.
	finish(t, s, "expired", tokA, t0.Add(time.Minute), idem.StateCompleted, resp)
	settled("expired", t0.Add(time.Minute+time.Hour))

	// Checkpoints: one binary line each, and their size.
	acquire(t, s, "s", "cp", tokA, t0, true)
	for i, name := range []string{"authorize", "capture"} {
		if err := s.Checkpoint(ctx, store.CheckpointParams{Scope: "s", Key: "cp", Token: tokA, Now: t0.Add(time.Duration(i) * time.Millisecond), Name: name}); err != nil {
			t.Fatal(err)
		}
	}
	item = rawItem(t, s, "s", "cp")
	list, ok := item[attrCps].(*types.AttributeValueMemberL)
	if !ok || len(list.Value) != 2 {
		t.Fatalf("cps = %v, want a list of two", item[attrCps])
	}
	want := 0
	for i, name := range []string{"authorize", "capture"} {
		line := store.AppendCheckpoint(nil, idem.Checkpoint{Name: name, At: t0.Add(time.Duration(i) * time.Millisecond)})
		if b, ok := list.Value[i].(*types.AttributeValueMemberB); !ok || string(b.Value) != string(line) {
			t.Errorf("checkpoint %d = %v, want %q", i, list.Value[i], line)
		}
		want += len(line) + 1
	}
	if got, _ := n(item, attrCpsBytes); got != int64(want) {
		t.Errorf("cps_bytes = %d, want %d", got, want)
	}
	if v, ok := item[attrTakeover].(*types.AttributeValueMemberBOOL); !ok || v.Value {
		t.Errorf("ts = %v after a checkpoint, want false", item[attrTakeover])
	}
}

// TestExpiredItemHidden: DynamoDB deletes expired items late, so until it
// does, reads treat them as absent and Acquire writes over them.
func TestExpiredItemHidden(t *testing.T) {
	t.Parallel()
	s := newTestStore(t, nil, 0)
	acquire(t, s, "s", "done", tokA, t0, false)
	finish(t, s, "done", tokA, t0, idem.StateCompleted, okResponse("old"))
	if err := s.Checkpoint(ctx, store.CheckpointParams{Scope: "s", Key: "done", Token: tokA, Now: t0, Name: "late"}); !errors.Is(err, idem.ErrLeaseLost) {
		t.Fatalf("checkpoint of a completed record: %v", err)
	}
	later := t0.Add(time.Hour) // exactly at expiry
	if _, err := s.Get(ctx, store.GetParams{Scope: "s", Key: "done", Now: later}); !errors.Is(err, idem.ErrNotFound) {
		t.Fatalf("Get of an expired record: %v, want ErrNotFound", err)
	}
	if item := rawItem(t, s, "s", "done"); item == nil {
		t.Fatal("the expired item is gone; the test needs it still there")
	}
	if res, err := s.Scan(ctx, store.ScanParams{Now: later}); err != nil || len(res.Records) != 0 {
		t.Fatalf("Scan = %+v, %v", res, err)
	}
	if res, err := s.List(ctx, store.ListParams{Now: later}); err != nil || len(res.Records) != 0 {
		t.Fatalf("List = %+v, %v", res, err)
	}
	r := acquire(t, s, "s", "done", tokB, later, false)
	if r.Token != tokB || r.Fence != 1 || r.State != idem.StateInProgress || r.Response != nil || !r.Created.Equal(later) {
		t.Fatalf("acquire over the expired item = %+v, want a fresh record", r)
	}
	item := rawItem(t, s, "s", "done")
	for _, a := range []string{attrTTL, attrExpires, attrResp, attrBody} {
		if _, ok := item[a]; ok {
			t.Errorf("the re-created item kept %s", a)
		}
	}
	got, err := s.Get(ctx, store.GetParams{Scope: "s", Key: "done", Now: later})
	if err != nil || got.Token != tokB || got.Fence != 1 {
		t.Fatalf("Get = %+v, %v", got, err)
	}
}

// hangingServer returns a server that never answers, until the test ends.
func hangingServer(t *testing.T) *httptest.Server {
	done := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body) // so that the server notices the client leaving
		select {
		case <-r.Context().Done():
		case <-done:
		}
	}))
	t.Cleanup(func() {
		close(done)
		srv.Close()
	})
	return srv
}

// TestUnavailable: a server that cannot be reached, does not answer in
// time, fails or throttles gives errors wrapping idem.ErrUnavailable.
func TestUnavailable(t *testing.T) {
	t.Parallel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	closed := "http://" + ln.Addr().String()
	ln.Close()

	hang := hangingServer(t)
	answer := func(status int, typ string) string { return answering(t, status, typ) }
	now := t0
	ops := map[string]func(context.Context, *Store) error{
		"acquire": func(ctx context.Context, s *Store) error {
			_, err := s.Acquire(ctx, store.AcquireParams{Key: "k", Fingerprint: fp("a"), Token: tokA, Now: now, LeaseExpires: now.Add(time.Second)})
			return err
		},
		"renew": func(ctx context.Context, s *Store) error {
			return s.Renew(ctx, store.RenewParams{Key: "k", Token: tokA, Now: now, LeaseExpires: now.Add(time.Second)})
		},
		"checkpoint": func(ctx context.Context, s *Store) error {
			return s.Checkpoint(ctx, store.CheckpointParams{Key: "k", Token: tokA, Now: now, Name: "x"})
		},
		"finish": func(ctx context.Context, s *Store) error {
			return s.Finish(ctx, idem.FinishParams{Key: "k", Token: tokA, Now: now, State: idem.StateCompleted, Response: okResponse("x"), Expires: now.Add(time.Hour)})
		},
		"mark unknown": func(ctx context.Context, s *Store) error {
			return s.Finish(ctx, idem.FinishParams{Key: "k", Token: tokA, Now: now, State: idem.StateUnknown})
		},
		"get": func(ctx context.Context, s *Store) error {
			_, err := s.Get(ctx, store.GetParams{Key: "k", Now: now})
			return err
		},
		"scan": func(ctx context.Context, s *Store) error {
			_, err := s.Scan(ctx, store.ScanParams{Now: now})
			return err
		},
		"list": func(ctx context.Context, s *Store) error {
			_, err := s.List(ctx, store.ListParams{Now: now})
			return err
		},
	}
	for name, url := range map[string]string{
		"closed port":                 closed,
		"no answer in time":           hang.URL,
		"500":                         answer(500, "InternalServerError"),
		"503":                         answer(503, "ServiceUnavailable"),
		"throttled":                   answer(400, "ThrottlingException"),
		"over provisioned throughput": answer(400, "ProvisionedThroughputExceededException"),
		"request limit":               answer(400, "RequestLimitExceeded"),
	} {
		client, c := newClient(url, func(o *dynamodb.Options) { o.Retryer = aws.NopRetryer{} })
		s, err := New(Config{Client: client, Table: "idem_unreachable", Shards: 2})
		if err != nil {
			t.Fatal(err)
		}
		for op, f := range ops {
			ctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
			err := f(ctx, s)
			cancel()
			if !errors.Is(err, idem.ErrUnavailable) {
				t.Errorf("%s, %s: err = %v, want ErrUnavailable", name, op, err)
			}
			if name == "no answer in time" && !errors.Is(err, context.DeadlineExceeded) {
				t.Errorf("%s, %s: err = %v, want it to wrap context.DeadlineExceeded", name, op, err)
			}
		}
		if c.n.Load() == 0 {
			t.Errorf("%s: no request sent", name)
		}
	}
}

// answering returns the URL of a server that answers every request with
// status and an error of type typ, as DynamoDB does.
func answering(t *testing.T, status int, typ string) string {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/x-amz-json-1.0")
		w.WriteHeader(status)
		fmt.Fprintf(w, `{"__type":"com.amazonaws.dynamodb.v20120810#%s","message":"test"}`, typ)
	}))
	t.Cleanup(srv.Close)
	return srv.URL
}

// stsDown is a credentials source whose refresh fails as STS's does when
// it throttles, cannot reach the identity provider, or finds the web
// identity token expired (AssumeRoleWithWebIdentity under EKS IRSA, say).
type stsDown struct{ code string }

func (p stsDown) Retrieve(context.Context) (aws.Credentials, error) {
	return aws.Credentials{}, &smithy.OperationError{ServiceID: "STS", OperationName: "AssumeRoleWithWebIdentity",
		Err: &smithy.GenericAPIError{Code: p.code, Message: "test", Fault: smithy.FaultClient}}
}

// TestOutageCodesUnavailable: every answer that is not a verdict on the
// request itself wraps idem.ErrUnavailable, so that the engine keeps an
// outcome it could not store for later rather than drop it: a credential
// source that fails before the request is signed (whatever its code), and
// DynamoDB codes of throttling, timeouts and denied or expired credentials
// beyond the few TestUnavailable names. A verdict (a malformed request)
// stays final.
func TestOutageCodesUnavailable(t *testing.T) {
	t.Parallel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() }) // accepts nothing: no request may reach it
	complete := idem.FinishParams{Key: "k", Token: tokA, Now: t0, State: idem.StateCompleted, Response: okResponse("x"),
		Expires: t0.Add(time.Hour), Repeat: true}
	for _, code := range []string{"Throttling", "IDPCommunicationError", "ExpiredTokenException", "InvalidIdentityToken"} {
		client, c := newClient("http://"+ln.Addr().String(), func(o *dynamodb.Options) {
			o.Credentials = aws.NewCredentialsCache(stsDown{code})
			o.Retryer = aws.NopRetryer{}
		})
		s, err := New(Config{Client: client, Table: "idem_unreachable"})
		if err != nil {
			t.Fatal(err)
		}
		err = s.Finish(ctx, complete)
		if !errors.Is(err, idem.ErrUnavailable) || errors.Is(err, idem.ErrDenied) {
			t.Errorf("credentials failing with %s: Finish: %v, want ErrUnavailable (DynamoDB never reached: not ErrDenied)", code, err)
		}
		if n := c.n.Load(); n != 0 {
			t.Errorf("credentials failing with %s: %d requests sent", code, n)
		}
	}
	for code, want := range map[string]bool{
		"Throttling":                  true,
		"TooManyRequestsException":    true,
		"RequestTimeout":              true,
		"RequestTimeoutException":     true,
		"LimitExceededException":      true,
		"SlowDown":                    true,
		"ExpiredTokenException":       true,
		"UnrecognizedClientException": true,
		"AccessDeniedException":       true,
		"ValidationException":         false,
		"SerializationException":      false,
	} {
		client, c := newClient(answering(t, 400, code), func(o *dynamodb.Options) { o.Retryer = aws.NopRetryer{} })
		s, err := New(Config{Client: client, Table: "idem_unreachable"})
		if err != nil {
			t.Fatal(err)
		}
		err = s.Finish(ctx, complete)
		if errors.Is(err, idem.ErrUnavailable) != want || err == nil {
			t.Errorf("%s: Finish: %v, want ErrUnavailable %v", code, err, want)
		}
		// DynamoDB refusing the credentials was reached: no reason to fail open.
		if isDenied := code == "ExpiredTokenException" || code == "UnrecognizedClientException" || code == "AccessDeniedException"; errors.Is(err, idem.ErrDenied) != isDenied {
			t.Errorf("%s: Finish: %v, want ErrDenied %v", code, err, isDenied)
		}
		if c.n.Load() == 0 {
			t.Errorf("%s: no request sent", code)
		}
	}
}

// TestCanceledContext: a context cancelled before the call sends nothing
// and gives an error that is context.Canceled (and not ErrUnavailable).
func TestCanceledContext(t *testing.T) {
	t.Parallel()
	s, c := countingStore(t, 0)
	canceled, cancel := context.WithCancel(ctx)
	cancel()
	before := c.n.Load()
	errs := map[string]error{}
	_, errs["acquire"] = s.Acquire(canceled, store.AcquireParams{Key: "k", Fingerprint: fp("a"), Token: tokA, Now: t0, LeaseExpires: t0.Add(time.Second)})
	errs["renew"] = s.Renew(canceled, store.RenewParams{Key: "k", Token: tokA, Now: t0, LeaseExpires: t0.Add(time.Second)})
	errs["checkpoint"] = s.Checkpoint(canceled, store.CheckpointParams{Key: "k", Token: tokA, Now: t0, Name: "x"})
	errs["finish"] = s.Finish(canceled, idem.FinishParams{Key: "k", Token: tokA, Now: t0, State: idem.StateFailed, Expires: t0.Add(time.Hour)})
	_, errs["get"] = s.Get(canceled, store.GetParams{Key: "k", Now: t0})
	_, errs["scan"] = s.Scan(canceled, store.ScanParams{Now: t0})
	_, errs["list"] = s.List(canceled, store.ListParams{Now: t0})
	for op, err := range errs {
		if !errors.Is(err, context.Canceled) || errors.Is(err, idem.ErrUnavailable) {
			t.Errorf("%s: err = %v, want context.Canceled", op, err)
		}
	}
	if n := c.n.Load() - before; n != 0 {
		t.Errorf("%d requests sent with a cancelled context", n)
	}
	// Cancelled while in flight: the SDK's error still says so.
	hang := hangingServer(t)
	client, _ := newClient(hang.URL)
	hs, err := New(Config{Client: client})
	if err != nil {
		t.Fatal(err)
	}
	inFlight, cancel := context.WithCancel(ctx)
	time.AfterFunc(50*time.Millisecond, cancel)
	if _, err := hs.Get(inFlight, store.GetParams{Key: "k", Now: t0}); !errors.Is(err, context.Canceled) || errors.Is(err, idem.ErrUnavailable) {
		t.Errorf("get cancelled in flight: err = %v, want context.Canceled", err)
	}
}

// TestMissingTable: a store on a table that does not exist says so.
func TestMissingTable(t *testing.T) {
	t.Parallel()
	s, err := New(Config{Client: sharedClient(t), Table: "idem_test_no_such_table"})
	if err != nil {
		t.Fatal(err)
	}
	_, err = s.Get(ctx, store.GetParams{Key: "k", Now: t0})
	if !errors.Is(err, ErrTableNotFound) || errors.Is(err, idem.ErrUnavailable) || !strings.Contains(err.Error(), "idem_test_no_such_table") {
		t.Fatalf("Get: err = %v, want ErrTableNotFound naming the table", err)
	}
	t.Log(err)
	_, err = s.Acquire(ctx, store.AcquireParams{Key: "k", Fingerprint: fp("a"), Token: tokA, Now: t0, LeaseExpires: t0.Add(time.Second)})
	if !errors.Is(err, ErrTableNotFound) {
		t.Fatalf("Acquire: err = %v, want ErrTableNotFound", err)
	}
	if _, err := s.Scan(ctx, store.ScanParams{Now: t0}); !errors.Is(err, ErrTableNotFound) {
		t.Fatalf("Scan: err = %v, want ErrTableNotFound", err)
	}
	if _, err := s.List(ctx, store.ListParams{Now: t0}); !errors.Is(err, ErrTableNotFound) {
		t.Fatalf("List: err = %v, want ErrTableNotFound", err)
	}
}

// TestCreateTableTwice: CreateTable on an existing table is fine.
func TestCreateTableTwice(t *testing.T) {
	t.Parallel()
	client := sharedClient(t)
	table := newTable(t)
	if err := CreateTable(ctx, client, table); err != nil {
		t.Fatalf("second CreateTable: %v", err)
	}
	out, err := client.DescribeTable(ctx, &dynamodb.DescribeTableInput{TableName: &table})
	if err != nil {
		t.Fatal(err)
	}
	if out.Table.TableStatus != types.TableStatusActive || len(out.Table.GlobalSecondaryIndexes) != 1 ||
		aws.ToString(out.Table.GlobalSecondaryIndexes[0].IndexName) != staleIndex {
		t.Fatalf("table = %+v", out.Table)
	}
	for name, err := range map[string]error{
		"no client":  CreateTable(ctx, nil, table),
		"bad name":   CreateTable(ctx, client, "a b"),
		"short name": CreateTable(ctx, client, "ab"),
	} {
		if !errors.Is(err, idem.ErrInvalid) {
			t.Errorf("CreateTable with %s: %v, want ErrInvalid", name, err)
		}
	}
}

// TestItemSizeLimits: whatever a record holds within the limits fits in
// DynamoDB's 400 KB item; past them, the store says so before writing.
func TestItemSizeLimits(t *testing.T) {
	t.Parallel()
	s, c := countingStore(t, 0)
	scope, key := strings.Repeat("s", idem.MaxScopeLen), strings.Repeat("k", idem.MaxKeyLen)
	fprint, tok := idem.Fingerprint(strings.Repeat("f", store.MaxFingerprintLen)), strings.Repeat("t", store.MaxTokenLen)
	now := t0
	r, err := s.Acquire(ctx, store.AcquireParams{Scope: scope, Key: key, Fingerprint: fprint, Token: tok, Now: now, LeaseExpires: now.Add(time.Minute)})
	if err != nil || r.Token != tok {
		t.Fatalf("Acquire = %+v, %v", r, err)
	}

	// Checkpoints of the largest kind until there is no room left.
	data := []byte(strings.Repeat("\x00", store.MaxCheckpointData)) // escaped in JSON: the longest line
	var stored int
	for i := 0; ; i++ {
		p := store.CheckpointParams{Scope: scope, Key: key, Token: tok, Now: now.Add(time.Duration(i) * time.Millisecond),
			Name: strings.Repeat("n", store.MaxCheckpointName), Data: data}
		err := s.Checkpoint(ctx, p)
		if errors.Is(err, idem.ErrInvalid) {
			t.Logf("checkpoint %d: %v", i, err)
			break
		}
		if err != nil {
			t.Fatalf("checkpoint %d: %v", i, err)
		}
		stored++
		if i > 100 {
			t.Fatal("checkpoints never ran out of room")
		}
	}
	if got, err := s.Get(ctx, store.GetParams{Scope: scope, Key: key, Now: now}); err != nil || len(got.Checkpoints) != stored {
		t.Fatalf("Get: %d checkpoints, %v; want %d", len(got.Checkpoints), err, stored)
	}

	// Headers over the whole item's limit: ErrInvalid from the store, not
	// the server's error, and nothing sent.
	for _, size := range []int{450 << 10} {
		big := &idem.Response{Status: 200, Header: http.Header{"X-Big": {strings.Repeat("h", size)}}, Body: []byte("x")}
		before := c.n.Load()
		err = s.Finish(ctx, idem.FinishParams{Scope: scope, Key: key, Token: tok, Now: now, State: idem.StateCompleted, Response: big, Expires: now.Add(time.Hour)})
		var api apiError
		if !errors.Is(err, idem.ErrInvalid) || errors.As(err, &api) {
			t.Fatalf("Finish with %d bytes of headers: %v, want the store's ErrInvalid", size, err)
		}
		if n := c.n.Load() - before; n != 0 {
			t.Fatalf("Finish with %d bytes of headers sent %d requests", size, n)
		}
		t.Log(err)
	}
	if got, err := s.Get(ctx, store.GetParams{Scope: scope, Key: key, Now: now}); err != nil || got.State != idem.StateInProgress {
		t.Fatalf("after the refused Finish: %+v, %v; want the record still running", got.State, err)
	}

	// Headers just within the limit and a body at the limit: the item is
	// as large as the store makes one, and DynamoDB's limit holds.
	resp := &idem.Response{Status: 200, Header: http.Header{"X-Big": {""}}, Body: []byte(strings.Repeat("b", MaxBodyBytes))}
	meta, _, _ := encodeResponse(resp)
	resp.Header["X-Big"][0] = strings.Repeat("h", MaxHeaderBytes-len(meta))
	if meta, _, _ = encodeResponse(resp); len(meta) != MaxHeaderBytes {
		t.Fatalf("meta is %d bytes, want %d", len(meta), MaxHeaderBytes)
	}
	if err := s.Finish(ctx, idem.FinishParams{Scope: scope, Key: key, Token: tok, Now: now, State: idem.StateCompleted, Response: resp, Expires: now.Add(time.Hour)}); err != nil {
		t.Fatalf("Finish of the largest item: %v", err)
	}
	item := rawItem(t, s, scope, key)
	size := itemSize(item)
	t.Logf("largest item: %d bytes of %d (%d checkpoints)", size, itemSizeLimit, stored)
	if size > itemSizeLimit {
		t.Fatalf("the largest item is %d bytes, over DynamoDB's %d", size, itemSizeLimit)
	}
	fixed := size - MaxBodyBytes - MaxHeaderBytes
	if l, ok := item[attrCps].(*types.AttributeValueMemberL); ok {
		fixed -= valueSize(l) + len(attrCps)
	}
	if fixed > fixedBytes {
		t.Fatalf("the fixed attributes take %d bytes, over the %d budgeted", fixed, fixedBytes)
	}
	got, err := s.Get(ctx, store.GetParams{Scope: scope, Key: key, Now: now})
	if err != nil || got.Response == nil || len(got.Response.Body) != MaxBodyBytes || got.Response.BodyOmitted {
		t.Fatalf("Get of the largest item: %v", err)
	}

	// A body over the limit: stored as omitted, with no body attribute.
	acquire(t, s, "s", "huge", tokA, now, false)
	finish(t, s, "huge", tokA, now, idem.StateCompleted, &idem.Response{Status: 200, Body: make([]byte, MaxBodyBytes+1)})
	if item := rawItem(t, s, "s", "huge"); item[attrBody] != nil {
		t.Fatal("a body over the limit was stored")
	}
	if got, err := s.Get(ctx, store.GetParams{Scope: "s", Key: "huge", Now: now}); err != nil || !got.Response.BodyOmitted || got.Response.Body != nil {
		t.Fatalf("Get = %+v, %v; want the body omitted", got.Response, err)
	}
}

// TestLargeHeadersKeepOutcome: a response whose status and headers take
// more than MaxHeaderBytes is still stored, the item budgeted as a whole:
// with its body when status, headers and body fit in MaxHeaderBytes +
// MaxBodyBytes together, with the body omitted when they do not (and a
// repeat of that Finish lands); DynamoDB's limit holds on a record with
// checkpoints at their limit.
func TestLargeHeadersKeepOutcome(t *testing.T) {
	t.Parallel()
	s := newTestStore(t, nil, 0)
	now := t0
	withHeaders := func(n int, body []byte) *idem.Response {
		resp := &idem.Response{Status: 200, Header: http.Header{"X-Big": {""}}, Body: body}
		meta, _, _ := encodeResponse(resp)
		resp.Header["X-Big"][0] = strings.Repeat("h", n-len(meta))
		if meta, _, _ = encodeResponse(resp); len(meta) != n {
			t.Fatalf("meta is %d bytes, want %d", len(meta), n)
		}
		return resp
	}
	complete := func(key string, resp *idem.Response, repeat bool) error {
		return s.Finish(ctx, idem.FinishParams{Scope: "s", Key: key, Token: tokA, Now: now, State: idem.StateCompleted,
			Response: resp, Expires: now.Add(time.Hour), Repeat: repeat})
	}

	// Checkpoints at their limit, then headers of 100 KiB and a body that
	// fills the response's budget to the byte: all kept, within 400 KB.
	acquire(t, s, "s", "full", tokA, now, false)
	for i := 0; ; i++ {
		err := s.Checkpoint(ctx, store.CheckpointParams{Scope: "s", Key: "full", Token: tokA, Now: now.Add(time.Duration(i) * time.Millisecond),
			Name: strings.Repeat("n", store.MaxCheckpointName), Data: []byte(strings.Repeat("\x00", store.MaxCheckpointData))})
		if errors.Is(err, idem.ErrInvalid) {
			break
		}
		if err != nil || i > 100 {
			t.Fatalf("checkpoint %d: %v", i, err)
		}
	}
	resp := withHeaders(100<<10, nil)
	resp.Body = []byte(strings.Repeat("b", MaxBodyBytes+MaxHeaderBytes-(100<<10)))
	if err := complete("full", resp, false); err != nil {
		t.Fatalf("Finish with 100 KiB of headers and a body that fits beside them: %v", err)
	}
	if size := itemSize(rawItem(t, s, "s", "full")); size > itemSizeLimit {
		t.Fatalf("the item is %d bytes, over DynamoDB's %d", size, itemSizeLimit)
	}
	if got, err := s.Get(ctx, store.GetParams{Scope: "s", Key: "full", Now: now}); err != nil || !got.Response.Equal(resp) {
		t.Fatalf("Get = %v; want the response whole", err)
	}

	// Headers over MaxHeaderBytes, a small body: kept whole.
	acquire(t, s, "s", "small", tokA, now, false)
	small := withHeaders(MaxHeaderBytes+1, []byte("x"))
	if err := complete("small", small, false); err != nil {
		t.Fatalf("Finish with %d bytes of headers: %v", MaxHeaderBytes+1, err)
	}
	if got, err := s.Get(ctx, store.GetParams{Scope: "s", Key: "small", Now: now}); err != nil || !got.Response.Equal(small) {
		t.Fatalf("Get = %v; want the response whole", err)
	}

	// Headers over MaxHeaderBytes and a body of MaxBodyBytes: stored with
	// the body omitted; the same Finish repeated lands, another does not.
	acquire(t, s, "s", "omit", tokA, now, false)
	big := withHeaders(MaxHeaderBytes+1, []byte(strings.Repeat("b", MaxBodyBytes)))
	if err := complete("omit", big, false); err != nil {
		t.Fatalf("Finish with %d bytes of headers and a body of %d: %v", MaxHeaderBytes+1, MaxBodyBytes, err)
	}
	got, err := s.Get(ctx, store.GetParams{Scope: "s", Key: "omit", Now: now})
	if err != nil || got.State != idem.StateCompleted || !got.Response.BodyOmitted || got.Response.Body != nil ||
		!slices.Equal(got.Response.Header["X-Big"], big.Header["X-Big"]) {
		t.Fatalf("Get = %v; want the response with its headers and the body omitted", err)
	}
	if err := complete("omit", big, true); err != nil {
		t.Fatalf("the Finish repeated: %v, want it to land", err)
	}
	if err := complete("omit", big, false); !errors.Is(err, idem.ErrLeaseLost) {
		t.Fatalf("the Finish sent again, not as a repeat: %v, want ErrLeaseLost", err)
	}
}

// TestRetriedWritesLand: the SDK retries a request whose answer was lost;
// when the first attempt had landed, the retry finds its own write and
// succeeds, rather than reporting a lost lease or writing twice.
func TestRetriedWritesLand(t *testing.T) {
	t.Parallel()
	s := newTestStore(t, nil, 0)
	acquire(t, s, "s", "k", tokA, t0, false)
	cp := store.CheckpointParams{Scope: "s", Key: "k", Token: tokA, Now: t0, Name: "authorize", Data: []byte("x")}
	for range 2 {
		if err := s.Checkpoint(ctx, cp); err != nil {
			t.Fatalf("Checkpoint: %v", err)
		}
	}
	if r, _ := s.Get(ctx, store.GetParams{Scope: "s", Key: "k", Now: t0}); len(r.Checkpoints) != 1 {
		t.Fatalf("%d checkpoints after the same one twice, want 1", len(r.Checkpoints))
	}
	cp.Now = t0.Add(time.Millisecond) // the same step again, later: a new checkpoint
	if err := s.Checkpoint(ctx, cp); err != nil {
		t.Fatal(err)
	}
	if r, _ := s.Get(ctx, store.GetParams{Scope: "s", Key: "k", Now: t0}); len(r.Checkpoints) != 2 {
		t.Fatalf("%d checkpoints, want 2", len(r.Checkpoints))
	}
	p := idem.FinishParams{Scope: "s", Key: "k", Token: tokA, Now: t0, State: idem.StateCompleted, Response: okResponse("done"), Expires: t0.Add(time.Hour), Repeat: true}
	for range 2 {
		if err := s.Finish(ctx, p); err != nil {
			t.Fatalf("Finish: %v", err)
		}
	}
	other := p
	other.Response = okResponse("other")
	if err := s.Finish(ctx, other); !errors.Is(err, idem.ErrLeaseLost) {
		t.Fatalf("Finish with another response: %v, want ErrLeaseLost", err)
	}
	other = p
	other.Repeat = false
	if err := s.Finish(ctx, other); !errors.Is(err, idem.ErrLeaseLost) {
		t.Fatalf("the same Finish not marked a repeat: %v, want ErrLeaseLost", err)
	}
}

func TestNewValidatesConfig(t *testing.T) {
	client := dynamodb.New(dynamodb.Options{Region: "us-east-1"}) // never contacted
	for name, cfg := range map[string]Config{
		"no client":       {},
		"short table":     {Client: client, Table: "ab"},
		"table with /":    {Client: client, Table: "a/b/c"},
		"negative shards": {Client: client, Shards: -1},
		"too many shards": {Client: client, Shards: MaxShards + 1},
	} {
		if _, err := New(cfg); !errors.Is(err, idem.ErrInvalid) {
			t.Errorf("New with %s: err = %v, want ErrInvalid", name, err)
		}
	}
	s, err := New(Config{Client: client})
	if err != nil {
		t.Fatal(err)
	}
	if s.table != DefaultTable || s.shards != DefaultShards || s.MaxBody() != MaxBodyBytes {
		t.Fatalf("defaults: table %q, %d shards, max body %d", s.table, s.shards, s.MaxBody())
	}
}

func TestPartitionKey(t *testing.T) {
	seen := map[string][2]string{}
	for _, sk := range [][2]string{{"", "k"}, {"a:b", "c"}, {"a", "b:c"}, {"1:a", "b"}, {"", "1:a:b"}, {"s", ""}, {"::", "::"}} {
		pk := pkOf(sk[0], sk[1])
		if prev, ok := seen[pk]; ok {
			t.Fatalf("%q and %q share the partition key %q", prev, sk, pk)
		}
		seen[pk] = sk
		scope, key, err := parsePK(pk)
		if err != nil || scope != sk[0] || key != sk[1] {
			t.Fatalf("parsePK(%q) = %q, %q, %v; want %q", pk, scope, key, err, sk)
		}
	}
	for _, bad := range []string{"", "x", "3:ab", "-1::k", "2:abc", "1:a"} {
		if _, _, err := parsePK(bad); err == nil {
			t.Errorf("parsePK(%q) accepted it", bad)
		}
	}
}

func TestCursor(t *testing.T) {
	client := dynamodb.New(dynamodb.Options{Region: "us-east-1"}) // never contacted
	s, err := New(Config{Client: client, Shards: 4})
	if err != nil {
		t.Fatal(err)
	}
	for _, pos := range []position{
		{shard: 3},
		{shard: 1, last: map[string]types.AttributeValue{attrShard: avS("1"), attrStaleAt: avN(1893553445006), attrPK: avS("3:a:b:c:d")}},
	} {
		c, err := s.encodeCursor(pos)
		if err != nil {
			t.Fatal(err)
		}
		got, err := s.decodeCursor(c)
		if err != nil || got.shard != pos.shard || len(got.last) != len(pos.last) {
			t.Fatalf("decodeCursor(encodeCursor(%+v)) = %+v, %v", pos, got, err)
		}
		for k, v := range pos.last {
			if fmt.Sprint(got.last[k]) != fmt.Sprint(v) {
				t.Fatalf("cursor key %s = %v, want %v", k, got.last[k], v)
			}
		}
	}
	enc := func(s string) string { return base64.RawURLEncoding.EncodeToString([]byte(s)) }
	for _, bad := range []string{"%%%", enc("2:1"), enc("1:4"), enc("1:x"), enc("1:1:x:1:a:b"), enc("1:1:5:nope"), enc("1:1:5")} {
		if _, err := s.Scan(ctx, store.ScanParams{Now: t0, Cursor: bad}); !errors.Is(err, idem.ErrInvalid) {
			t.Errorf("Scan with cursor %q: err = %v, want ErrInvalid", bad, err)
		}
	}

	// List cursors hold a partition key; neither kind is taken for the other.
	listCursor := store.EncodeCursor(s.owner(), pkOf("a:b", "c"))
	if start, err := s.decodeListCursor(listCursor); err != nil || len(start) != 1 || start[attrPK].(*types.AttributeValueMemberS).Value != "3:a:b:c" {
		t.Fatalf("decodeListCursor = %v, %v", start, err)
	}
	if _, err := s.Scan(ctx, store.ScanParams{Now: t0, Cursor: listCursor}); !errors.Is(err, idem.ErrInvalid) {
		t.Errorf("Scan with a list cursor: err = %v, want ErrInvalid", err)
	}
	scanCursor, err := s.encodeCursor(position{shard: 1})
	if err != nil {
		t.Fatal(err)
	}
	for _, bad := range []string{scanCursor, store.EncodeCursor(s.owner(), "a", "b"), store.EncodeCursor(s.owner(), "")} {
		if _, err := s.List(ctx, store.ListParams{Now: t0, Cursor: bad}); !errors.Is(err, idem.ErrInvalid) {
			t.Errorf("List with cursor %q: err = %v, want ErrInvalid", bad, err)
		}
	}
}

// TestFaults runs the suite's network-fault cases, through a TCP proxy
// between the store and the server.
func TestFaults(t *testing.T) {
	u, err := url.Parse(endpoint(t))
	if err != nil {
		t.Fatal(err)
	}
	storetest.RunFaults(t, u.Host, func(t *testing.T, addr string) idem.Store {
		client, _ := newClient("http://" + addr)
		return newTestStore(t, client, 0)
	})
}

// TestListReadsAPageAtATime: DynamoDB's Limit counts the items a Scan reads,
// not those that match, so a listing that matches little takes a request
// per Limit items, each page holding what matched: at most Limit, maybe
// none. An item that is not a record is skipped, and a page may end on it.
func TestListReadsAPageAtATime(t *testing.T) {
	t.Parallel()
	s, c := countingStore(t, 0)
	const n = 10 // items: 9 records and another application's item
	for i := range n - 1 {
		acquire(t, s, "s", "k"+strconv.Itoa(i), tokA, t0, false)
	}
	finish(t, s, "k7", tokA, t0, idem.StateCompleted, okResponse("7"))
	foreign := map[string]types.AttributeValue{attrPK: avS("not a record"), "data": avS("x")}
	if _, err := s.client.PutItem(ctx, &dynamodb.PutItemInput{TableName: &s.table, Item: foreign}); err != nil {
		t.Fatal(err)
	}
	for _, want := range []struct {
		p    store.ListParams
		keys int
	}{
		{store.ListParams{Now: t0, Limit: 3, States: []idem.State{idem.StateCompleted}}, 1},
		{store.ListParams{Now: t0, Limit: 3}, n - 1},
		{store.ListParams{Now: t0, Limit: 1}, n - 1}, // one page ends on the foreign item
	} {
		p := want.p
		seen := map[string]bool{}
		pages := 0
		for {
			if pages++; pages > n+1 {
				t.Fatalf("states %v: the listing does not end", p.States)
			}
			before := c.n.Load()
			res, err := s.List(ctx, p)
			if err != nil {
				t.Fatal(err)
			}
			if got := c.n.Load() - before; got != 1 {
				t.Fatalf("a page took %d requests, want 1", got)
			}
			if len(res.Records) > p.Limit {
				t.Fatalf("a page of %d records with limit %d", len(res.Records), p.Limit)
			}
			for _, r := range res.Records {
				seen[r.Key] = true
			}
			if p.Cursor = res.Cursor; p.Cursor == "" {
				break
			}
		}
		if least := (n + p.Limit - 1) / p.Limit; pages < least {
			t.Errorf("states %v: %d pages over %d items, want at least %d: a page reads at most Limit items", p.States, pages, n, least)
		}
		if len(seen) != want.keys {
			t.Errorf("states %v: listed %v, want %d keys", p.States, seen, want.keys)
		}
	}
}

// TestListMillisecondBounds: times are stored as whole milliseconds, and the
// filter sent to DynamoDB must let through every record that Match keeps at
// bounds between two milliseconds.
func TestListMillisecondBounds(t *testing.T) {
	t.Parallel()
	s := newTestStore(t, nil, 0)
	created := t0.Add(400 * time.Microsecond) // stored as t0
	acquire(t, s, "s", "k", tokA, created, false)
	finish(t, s, "k", tokA, created, idem.StateCompleted, okResponse("k"))
	expires := t0.Add(time.Hour) // stored, truncated, by finish
	half := 500 * time.Microsecond
	for _, c := range []struct {
		name string
		p    store.ListParams
		want bool
	}{
		{"created before, half a millisecond after", store.ListParams{Now: t0, CreatedBefore: t0.Add(half)}, true},
		{"created before, at it", store.ListParams{Now: t0, CreatedBefore: t0}, false},
		{"created from, half a millisecond before", store.ListParams{Now: t0, CreatedFrom: t0.Add(-half)}, true},
		{"created from, half a millisecond after", store.ListParams{Now: t0, CreatedFrom: t0.Add(half)}, false},
		{"half a millisecond before expiry", store.ListParams{Now: expires.Add(-half)}, true},
		{"at expiry", store.ListParams{Now: expires}, false},
		{"scope and key prefixes", store.ListParams{Now: t0, ScopePrefix: "s", KeyPrefix: "k"}, true},
		{"a key prefix that is the scope", store.ListParams{Now: t0, KeyPrefix: "s"}, false},
	} {
		res, err := s.List(ctx, c.p)
		if err != nil || res.Cursor != "" {
			t.Fatalf("%s: List = %+v, %v", c.name, res, err)
		}
		if got := len(res.Records) == 1; got != c.want {
			t.Errorf("%s: listed %v, want %v", c.name, got, c.want)
		}
	}
}
