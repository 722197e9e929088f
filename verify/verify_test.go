package verify_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/httpidem"
	"github.com/idemhq/idem/store/memstore"
	"github.com/idemhq/idem/verify"
)

// charge is an endpoint whose every execution answers differently.
func charge(n *atomic.Int64) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		time.Sleep(20 * time.Millisecond) // real work takes a while: duplicates overlap
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"execution":%d,"for":%q}`, n.Add(1), body)
	}
}

func run(t *testing.T, h http.Handler) verify.Report {
	t.Helper()
	srv := httptest.NewServer(h)
	defer srv.Close()
	rep, err := verify.Run(context.Background(), verify.Config{
		URL: srv.URL + "/v1/charges", Body: `{"amount":100}`, RequireKey: true,
		Credentials: []string{"Bearer alice", "Bearer bob"},
	})
	if err != nil {
		t.Fatal(err)
	}
	return rep
}

func results(rep verify.Report) map[string]verify.Check {
	m := map[string]verify.Check{}
	for _, c := range rep.Checks {
		m[c.Name] = c
	}
	return m
}

func TestPassesAgainstTheMiddleware(t *testing.T) {
	eng, _ := idem.New(idem.Config{Store: memstore.New()})
	mw, _ := httpidem.New(httpidem.Config{Engine: eng, RequireKey: true, Scope: httpidem.HashScope("Authorization")})
	var n atomic.Int64
	rep := run(t, mw.Wrap(charge(&n)))
	for _, c := range rep.Checks {
		if c.Result != verify.Pass {
			t.Errorf("%s: %s: %s", c.Name, c.Result, c.Detail)
		}
	}
	if len(rep.Checks) != 7 || !rep.Passed() {
		t.Fatalf("report: %+v", rep)
	}
}

// TestPassesBehindAProxyThatStampsEveryResponse: the middleware behind a
// layer that adds a header of its own to every response (a request id, as
// a load balancer or a CDN does) passes: the replay is the same answer,
// and a header that differs per response is named, not failed. (It was
// failed: "the replay changed headers: X-Request-Id".)
func TestPassesBehindAProxyThatStampsEveryResponse(t *testing.T) {
	eng, _ := idem.New(idem.Config{Store: memstore.New()})
	mw, _ := httpidem.New(httpidem.Config{Engine: eng, RequireKey: true, Scope: httpidem.HashScope("Authorization")})
	var n, ids atomic.Int64
	inner := mw.Wrap(charge(&n))
	stamped := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("X-Request-Id", fmt.Sprint(ids.Add(1)))
		inner.ServeHTTP(w, r)
	})
	got := results(run(t, stamped))
	if c := got["replay"]; c.Result != verify.Pass || !strings.Contains(c.Detail, "X-Request-Id") {
		t.Fatalf("replay: %+v; want a pass that names the header that differs", c)
	}
}

// noIdempotency runs every request.
func TestCatchesNoIdempotency(t *testing.T) {
	var n atomic.Int64
	got := results(run(t, charge(&n)))
	if c := got["replay"]; c.Result != verify.Fail || !strings.Contains(c.Detail, "ran again") {
		t.Fatalf("replay: %+v", c)
	}
	for _, name := range []string{"payload-mismatch", "missing-key", "malformed-keys", "concurrent-duplicates"} {
		if got[name].Result != verify.Fail {
			t.Errorf("%s: %+v", name, got[name])
		}
	}
}

// keyed is a hand-made idempotency layer with two optional flaws.
type keyed struct {
	ignorePayload bool // replays whatever the payload
	noLock        bool // looks up, runs, then stores: duplicates race
	mu            sync.Mutex
	done          map[string][2]string // key → body, answer
	next          http.Handler
	// Without the lock, a run waits (up to a second) for the next lookup
	// of its key, so that duplicates sent at once overlap however the
	// machine schedules them: the race is there to be found.
	looked map[string]chan struct{}
}

func (k *keyed) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	key, err := httpidem.ParseKey(r.Header.Values("Idempotency-Key"), httpidem.KeyAny)
	if err != nil {
		(&httpidem.Problem{Type: httpidem.ProblemKeyInvalid, Title: "bad key", Status: 400}).Write(w)
		return
	}
	body, _ := io.ReadAll(r.Body)
	key = r.Header.Get("Authorization") + "\x00" + key
	k.mu.Lock()
	if k.looked == nil {
		k.looked = map[string]chan struct{}{}
	}
	if earlier, ok := k.looked[key]; ok {
		close(earlier) // a run may wait for this lookup
	}
	k.looked[key] = make(chan struct{})
	lookup := k.looked[key]
	prior, ok := k.done[key]
	if ok {
		k.mu.Unlock()
		if !k.ignorePayload && prior[0] != string(body) {
			(&httpidem.Problem{Type: httpidem.ProblemPayloadMismatch, Title: "mismatch", Status: 422}).Write(w)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Idempotent-Replayed", "true")
		w.WriteHeader(http.StatusCreated)
		io.WriteString(w, prior[1])
		return
	}
	if k.noLock {
		k.mu.Unlock()
		select {
		case <-lookup: // a duplicate looked, and found nothing either
		case <-time.After(time.Second):
		}
	}
	rec := httptest.NewRecorder()
	r.Body = io.NopCloser(strings.NewReader(string(body)))
	k.next.ServeHTTP(rec, r)
	if k.noLock {
		k.mu.Lock()
	}
	k.done[key] = [2]string{string(body), rec.Body.String()}
	k.mu.Unlock()
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(rec.Code)
	w.Write(rec.Body.Bytes())
}

func TestCatchesIgnoredPayload(t *testing.T) {
	var n atomic.Int64
	got := results(run(t, &keyed{ignorePayload: true, done: map[string][2]string{}, next: charge(&n)}))
	if c := got["payload-mismatch"]; c.Result != verify.Fail || !strings.Contains(c.Detail, "want 422") {
		t.Fatalf("payload-mismatch: %+v", c)
	}
	if got["replay"].Result != verify.Pass || got["concurrent-duplicates"].Result != verify.Pass {
		t.Fatalf("the rest should pass: %+v", got)
	}
}

func TestCatchesMissingLock(t *testing.T) {
	var n atomic.Int64
	got := results(run(t, &keyed{noLock: true, done: map[string][2]string{}, next: charge(&n)}))
	if c := got["concurrent-duplicates"]; c.Result != verify.Fail || !strings.Contains(c.Detail, "ran more than once") {
		t.Fatalf("concurrent-duplicates: %+v", c)
	}
	if got["replay"].Result != verify.Pass || got["payload-mismatch"].Result != verify.Pass {
		t.Fatalf("the rest should pass: %+v", got)
	}
}

func TestCatchesGlobalKeys(t *testing.T) {
	eng, _ := idem.New(idem.Config{Store: memstore.New()})
	mw, _ := httpidem.New(httpidem.Config{Engine: eng, RequireKey: true}) // no Scope
	var n atomic.Int64
	got := results(run(t, mw.Wrap(charge(&n))))
	if c := got["scopes"]; c.Result != verify.Fail || !strings.Contains(c.Detail, "not scoped") {
		t.Fatalf("scopes: %+v", c)
	}
}

func TestRunNeedsAURL(t *testing.T) {
	if _, err := verify.Run(context.Background(), verify.Config{}); err == nil {
		t.Fatal("no error without a URL")
	}
}

// TestPassesAgainstAStrictEndpoint: an endpoint that refuses JSON members it
// does not know (as idem demo does) passes with the default changed body.
func TestPassesAgainstAStrictEndpoint(t *testing.T) {
	eng, _ := idem.New(idem.Config{Store: memstore.New()})
	mw, _ := httpidem.New(httpidem.Config{Engine: eng, RequireKey: true, Scope: httpidem.HashScope("Authorization")})
	var n atomic.Int64
	strict := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var req struct{ Amount int64 }
		dec := json.NewDecoder(r.Body)
		dec.DisallowUnknownFields()
		if err := dec.Decode(&req); err != nil {
			httpidem.NothingHappened(r)
			(&httpidem.Problem{Type: "about:blank", Title: "Invalid", Status: 400, Detail: err.Error()}).Write(w)
			return
		}
		charge(&n)(w, r)
	})
	for _, c := range run(t, mw.Wrap(strict)).Checks {
		if c.Result != verify.Pass {
			t.Errorf("%s: %s: %s", c.Name, c.Result, c.Detail)
		}
	}
}

// TestStopsAtAnEndpointThatCannotBeReached: no answer at all ends the run
// with ErrUnreachable after one check, not the same error in every check.
func TestStopsAtAnEndpointThatCannotBeReached(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	url := "http://" + ln.Addr().String() + "/v1/charges"
	ln.Close() // connections are refused from now on
	rep, err := verify.Run(context.Background(), verify.Config{URL: url})
	if !errors.Is(err, verify.ErrUnreachable) || len(rep.Checks) != 1 || strings.Contains(rep.Checks[0].Detail, "give a body") {
		t.Fatalf("Run against a closed port = %+v, %v; want one failed check and ErrUnreachable", rep, err)
	}
}

// TestStopsAtARefusal: a first request the endpoint refuses (a body it does
// not accept) ends the run with ErrRefused: the other checks would only
// see the same refusal.
func TestStopsAtARefusal(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		(&httpidem.Problem{Type: "about:blank", Title: "Invalid", Status: 400}).Write(w)
	}))
	defer srv.Close()
	rep, err := verify.Run(context.Background(), verify.Config{URL: srv.URL})
	if !errors.Is(err, verify.ErrRefused) || len(rep.Checks) != 1 || rep.Checks[0].Result != verify.Fail {
		t.Fatalf("Run against an endpoint that refuses = %+v, %v; want one failed check and ErrRefused", rep, err)
	}
}
