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

// keyed is a hand-made idempotency layer with three optional flaws.
type keyed struct {
	ignorePayload bool // replays whatever the payload
	noLock        bool // looks up, runs, then stores: duplicates race
	chargesFirst  bool // runs a known key's request before comparing payloads: charges, then 422
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
		if k.chargesFirst && prior[0] != string(body) {
			r.Body = io.NopCloser(strings.NewReader(string(body)))
			k.next.ServeHTTP(httptest.NewRecorder(), r)
		}
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

// TestMismatchIsNotPassedByAValidationRefusal: an endpoint that replays
// whatever the payload (keyed{ignorePayload}) behind a validator that
// answers 422 to a member it does not know (FastAPI with extra=forbid,
// Rails) is certified "payload-mismatch: pass": the default changed body
// adds "idem_verify_changed" to a body without a number, the validator
// answers 422, and verify takes that 422 for the mismatch answer. A real
// second payload under the key ({"customer":"cus_2"}) is replayed the
// first one's charge.
func TestMismatchIsNotPassedByAValidationRefusal(t *testing.T) {
	var n atomic.Int64
	idem := &keyed{ignorePayload: true, done: map[string][2]string{}, next: charge(&n)}
	strict := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		var req struct{ Customer string }
		dec := json.NewDecoder(strings.NewReader(string(body)))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&req); err != nil {
			(&httpidem.Problem{Type: "about:blank", Title: "Validation failed", Status: 422, Detail: err.Error()}).Write(w)
			return
		}
		r.Body = io.NopCloser(strings.NewReader(string(body)))
		idem.ServeHTTP(w, r)
	})
	srv := httptest.NewServer(strict)
	defer srv.Close()
	// The flaw, shown directly: another valid payload under a used key is
	// replayed the first one's answer.
	send := func(key, body string) (int, string) {
		req, _ := http.NewRequest("POST", srv.URL, strings.NewReader(body))
		req.Header.Set("Idempotency-Key", key)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	send("k1", `{"customer":"cus_1"}`)
	if st, b := send("k1", `{"customer":"cus_2"}`); st != 201 || !strings.Contains(b, "cus_1") {
		t.Fatalf("setup: the endpoint should replay cus_1's charge to cus_2: %d %s", st, b)
	}
	rep, err := verify.Run(context.Background(), verify.Config{URL: srv.URL, Body: `{"customer":"cus_1"}`})
	if err != nil {
		t.Fatal(err)
	}
	if c := results(rep)["payload-mismatch"]; c.Result != verify.Fail || !strings.Contains(c.Detail, "not judged: ") || !strings.Contains(c.Detail, "refuses the changed body on its own") {
		t.Fatalf("payload-mismatch: %+v; want no pass for an endpoint that replays another payload (its 422 was the validator's, for the changed body itself), but a failure saying it was not judged", c)
	}
	// With a changed body the validator takes, the flaw is found.
	rep, err = verify.Run(context.Background(), verify.Config{URL: srv.URL, Body: `{"customer":"cus_1"}`, ChangedBody: `{"customer":"cus_2"}`})
	if err != nil {
		t.Fatal(err)
	}
	if c := results(rep)["payload-mismatch"]; c.Result != verify.Fail || !strings.Contains(c.Detail, "want 422") {
		t.Fatalf("payload-mismatch with --changed-body: %+v; want a failure: another payload was replayed the first one's answer", c)
	}
}

// TestMismatchWatchesTheEffects: with an effects URL, the payload-mismatch
// check reads the side effects around the other payload. A layer that
// charges the other payload before it answers 422 fails it, naming what
// moved; one that answers 422 and runs nothing passes. (Every check passed
// the first, which charged 5 times for 4 keys.)
func TestMismatchWatchesTheEffects(t *testing.T) {
	for name, chargesFirst := range map[string]bool{"charges first": true, "correct": false} {
		t.Run(name, func(t *testing.T) {
			var n atomic.Int64
			mux := http.NewServeMux()
			mux.Handle("POST /v1/charges", &keyed{chargesFirst: chargesFirst, done: map[string][2]string{}, next: charge(&n)})
			mux.HandleFunc("GET /effects", func(w http.ResponseWriter, r *http.Request) {
				fmt.Fprintf(w, `{"charges":%d}`, n.Load())
			})
			srv := httptest.NewServer(mux)
			defer srv.Close()
			rep, err := verify.Run(context.Background(), verify.Config{URL: srv.URL + "/v1/charges", Body: `{"amount":100}`,
				Credentials: []string{"Bearer alice", "Bearer bob"}, EffectsURL: srv.URL + "/effects"})
			if err != nil {
				t.Fatal(err)
			}
			got := results(rep)
			c := got["payload-mismatch"]
			if chargesFirst {
				if c.Result != verify.Fail || !strings.Contains(c.Detail, "moved the side effects") || !strings.Contains(c.Detail, "/charges by 1") {
					t.Errorf("payload-mismatch: %+v; want a failure saying /charges moved by 1", c)
				}
			} else if c.Result != verify.Pass || !strings.Contains(c.Detail, "got 422") || !strings.Contains(c.Detail, "did not move") {
				t.Errorf("payload-mismatch: %+v; want a pass saying the side effects did not move", c)
			}
			for _, other := range rep.Checks {
				if other.Name != "payload-mismatch" && other.Result == verify.Fail {
					t.Errorf("%s: %+v; want no other failure", other.Name, other)
				}
			}
		})
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

// TestScopesIsNotFailedByAValidationRefusal: the idem middleware, keys
// scoped per caller, behind the same validator: the scopes check sends the
// changed body (a member the validator does not know) under the second
// credential, gets the validator's 422 and reports "keys are not scoped
// per caller", which is false (the same key under bob with a body the
// validator takes runs as bob's own request).
func TestScopesIsNotFailedByAValidationRefusal(t *testing.T) {
	eng, _ := idem.New(idem.Config{Store: memstore.New()})
	mw, _ := httpidem.New(httpidem.Config{Engine: eng, Scope: httpidem.HashScope("Authorization")})
	var n atomic.Int64
	inner := mw.Wrap(charge(&n))
	strict := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		var req struct{ Customer string }
		dec := json.NewDecoder(strings.NewReader(string(body)))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&req); err != nil {
			(&httpidem.Problem{Type: "about:blank", Title: "Validation failed", Status: 422, Detail: err.Error()}).Write(w)
			return
		}
		r.Body = io.NopCloser(strings.NewReader(string(body)))
		inner.ServeHTTP(w, r)
	})
	srv := httptest.NewServer(strict)
	defer srv.Close()
	rep, err := verify.Run(context.Background(), verify.Config{URL: srv.URL, Body: `{"customer":"cus_1"}`,
		Credentials: []string{"Bearer alice", "Bearer bob"}})
	if err != nil {
		t.Fatal(err)
	}
	if c := results(rep)["scopes"]; strings.Contains(c.Detail, "not scoped") || !strings.Contains(c.Detail, "refuses the changed body on its own") {
		t.Fatalf("scopes: %+v; the keys are scoped per caller: the 422 was the validator's, for the changed body itself, and the check should say so", c)
	}
	// With a changed body the validator takes, every check passes.
	rep, err = verify.Run(context.Background(), verify.Config{URL: srv.URL, Body: `{"customer":"cus_1"}`, ChangedBody: `{"customer":"cus_2"}`,
		Credentials: []string{"Bearer alice", "Bearer bob"}})
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range rep.Checks {
		if c.Result == verify.Fail {
			t.Errorf("with --changed-body: %s: %s: %s", c.Name, c.Result, c.Detail)
		}
	}
}

func TestRunNeedsAURL(t *testing.T) {
	if _, err := verify.Run(context.Background(), verify.Config{}); err == nil {
		t.Fatal("no error without a URL")
	}
}

// TestRunRefusesWhatItCannotSend: a URL without a scheme
// ("localhost:8080/v1/charges", a common slip), or of another scheme than
// http and https, and a negative timeout or concurrency are errors, before
// any request. (The URLs were sent, retried five times and reported "the
// endpoint cannot be reached"; the negative numbers became the defaults.)
func TestRunRefusesWhatItCannotSend(t *testing.T) {
	var hits atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { hits.Add(1) }))
	defer srv.Close()
	for _, tc := range []struct {
		cfg  verify.Config
		want string
	}{
		{verify.Config{URL: "localhost:8080/v1/charges"}, "the URL has no scheme: did you mean http://localhost:8080/v1/charges?"},
		{verify.Config{URL: "127.0.0.1:8080/v1/charges"}, "the URL has no scheme: did you mean http://127.0.0.1:8080/v1/charges?"},
		{verify.Config{URL: "api.example.com/v1/charges"}, "the URL has no scheme: did you mean http://api.example.com/v1/charges?"},
		{verify.Config{URL: "alice:s3cr3t-pw@localhost:8080/v1/charges"}, "did you mean http://alice:xxxxx@localhost:8080/v1/charges?"},
		{verify.Config{URL: "ftp://127.0.0.1:8080/v1/charges"}, "the URL's scheme is ftp"},
		{verify.Config{URL: "http:///v1/charges"}, "the URL names no host"},
		{verify.Config{URL: srv.URL, EffectsURL: "localhost:8080/effects"}, "the effects URL has no scheme: did you mean http://localhost:8080/effects?"},
		{verify.Config{URL: srv.URL, EffectsURL: "file:///tmp/effects.json"}, "the effects URL's scheme is file"},
		{verify.Config{URL: srv.URL, Timeout: -time.Second}, "the timeout is negative (-1s)"},
		{verify.Config{URL: srv.URL, Concurrency: -1}, "the concurrency is negative (-1)"},
	} {
		rep, err := verify.Run(context.Background(), tc.cfg)
		if err == nil || !strings.Contains(err.Error(), tc.want) || len(rep.Checks) != 0 || strings.Contains(err.Error(), "s3cr3t") {
			t.Errorf("Run(%+v) = %+v, %v; want no report and an error saying %q", tc.cfg, rep, err, tc.want)
		}
	}
	if hits.Load() != 0 {
		t.Errorf("%d requests were sent for configurations Run refuses", hits.Load())
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

// TestRedirectIsNotFollowed: the idem middleware in front of a handler that
// answers a POST with 303 See Other (the resource's URL) honours the
// contract: the retry gets the 303 back, marked replayed. verify's clients
// followed the redirect and judged the GET of the resource instead, which
// is not replayed: a correct endpoint failed. With a client of the
// caller's own, the same, and the caller's client is left as it was.
func TestRedirectIsNotFollowed(t *testing.T) {
	eng, _ := idem.New(idem.Config{Store: memstore.New()})
	mw, _ := httpidem.New(httpidem.Config{Engine: eng, RequireKey: true, Scope: httpidem.HashScope("Authorization")})
	var n atomic.Int64
	mux := http.NewServeMux()
	mux.Handle("POST /v1/charges", mw.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.ReadAll(r.Body)
		w.Header().Set("Location", fmt.Sprintf("/v1/charges/ch_%d", n.Add(1)))
		w.WriteHeader(http.StatusSeeOther)
	})))
	mux.HandleFunc("GET /v1/charges/{id}", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"id":%q}`, r.PathValue("id"))
	})
	srv := httptest.NewServer(mux)
	defer srv.Close()
	own := &http.Client{Timeout: 10 * time.Second}
	for name, client := range map[string]*http.Client{"default client": nil, "own client": own} {
		rep, err := verify.Run(context.Background(), verify.Config{URL: srv.URL + "/v1/charges", Body: `{"amount":100}`, RequireKey: true,
			Credentials: []string{"Bearer alice", "Bearer bob"}, Client: client})
		if err != nil {
			t.Fatal(err)
		}
		for _, c := range rep.Checks {
			if c.Result == verify.Fail {
				t.Errorf("%s: %s: %s: %s", name, c.Name, c.Result, c.Detail)
			}
		}
	}
	if own.CheckRedirect != nil || own.Timeout != 10*time.Second {
		t.Errorf("Run changed the caller's client: %+v", own)
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

// problem writes an RFC 9457 problem of type typ.
func problem(w http.ResponseWriter, status int, typ string) {
	w.Header().Set("Content-Type", "application/problem+json")
	w.WriteHeader(status)
	fmt.Fprintf(w, `{"type":%q,"title":%q,"status":%d}`, typ, typ, status)
}

// actThenRecord is the classic check-then-act idempotency bug: it looks the
// key up, runs the work without holding the key, and records the outcome
// afterwards, insert-if-absent. A retry is replayed and another payload gets
// 422, but duplicates sent at once all run; the losers answer 409 or the
// winner's stored answer, marked replayed, so every answer looks right.
// GET /effects counts the executions.
type actThenRecord struct {
	onLoser string // "409" or "replay"
	execs   atomic.Int64
	mu      sync.Mutex
	done    map[string][2]string // key → body, answer
	// A run waits (half a second at most) for a second run of its key, so
	// that duplicates sent at once overlap however the machine schedules
	// them: the race is there to be found.
	running map[string]*overlap
}

type overlap struct {
	n    int
	both chan struct{}
}

func newActThenRecord(onLoser string) *actThenRecord {
	return &actThenRecord{onLoser: onLoser, done: map[string][2]string{}, running: map[string]*overlap{}}
}

func (s *actThenRecord) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method == http.MethodGet && r.URL.Path == "/effects" {
		fmt.Fprintf(w, `{"executions":%d}`, s.execs.Load())
		return
	}
	key, err := httpidem.ParseKey(r.Header.Values("Idempotency-Key"), httpidem.KeyAny)
	if err != nil {
		problem(w, 400, "key-invalid")
		return
	}
	key = r.Header.Get("Authorization") + "\x00" + key
	body, _ := io.ReadAll(r.Body)
	replay := func(st [2]string) {
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Idempotent-Replayed", "true")
		w.WriteHeader(201)
		io.WriteString(w, st[1])
	}
	s.mu.Lock()
	st, ok := s.done[key]
	o := s.running[key]
	if o == nil {
		o = &overlap{both: make(chan struct{})}
		s.running[key] = o
	}
	if !ok {
		if o.n++; o.n == 2 {
			close(o.both)
		}
	}
	s.mu.Unlock()
	if ok {
		if st[0] != string(body) {
			problem(w, 422, "mismatch")
			return
		}
		replay(st)
		return
	}
	select { // the side effect, unprotected
	case <-o.both:
	case <-time.After(500 * time.Millisecond):
	}
	resp := fmt.Sprintf(`{"execution":%d}`, s.execs.Add(1))
	s.mu.Lock()
	if st, ok := s.done[key]; ok { // lost the race
		s.mu.Unlock()
		if s.onLoser == "409" {
			problem(w, 409, "in-progress")
		} else {
			replay(st)
		}
		return
	}
	s.done[key] = [2]string{string(body), resp}
	s.mu.Unlock()
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(201)
	io.WriteString(w, resp)
}

// TestConcurrentPassSaysWhatAnswersCannotShow: an endpoint that runs every
// duplicate and answers the losers with 409 or the winner's stored answer
// gives nothing away in its answers; the check passes it, and says so.
// (It passed with "one outcome …; a later retry replayed it", no word of
// what it could not see.)
func TestConcurrentPassSaysWhatAnswersCannotShow(t *testing.T) {
	s := newActThenRecord("replay")
	srv := httptest.NewServer(s)
	defer srv.Close()
	rep, err := verify.Run(context.Background(), verify.Config{URL: srv.URL, Body: `{"amount":100}`})
	if err != nil {
		t.Fatal(err)
	}
	if c := results(rep)["concurrent-duplicates"]; c.Result != verify.Pass || !strings.Contains(c.Detail, "answers alone cannot show") {
		t.Fatalf("concurrent-duplicates: %+v; want a pass that names its blind spot", c)
	}
}

// TestEffectsProbeCatchesARunPerDuplicate: with an effects URL, the same
// endpoint fails: its executions moved by more than one run's. (Every check
// passed, though it ran 14 times for 5.)
func TestEffectsProbeCatchesARunPerDuplicate(t *testing.T) {
	for _, loser := range []string{"409", "replay"} {
		t.Run(loser, func(t *testing.T) {
			s := newActThenRecord(loser)
			srv := httptest.NewServer(s)
			defer srv.Close()
			rep, err := verify.Run(context.Background(), verify.Config{URL: srv.URL, Body: `{"amount":100}`, EffectsURL: srv.URL + "/effects"})
			if err != nil {
				t.Fatal(err)
			}
			c := results(rep)["concurrent-duplicates"]
			if c.Result != verify.Fail || !strings.Contains(c.Detail, "/executions moved by") || !strings.Contains(c.Detail, "one run moves it by 1") {
				t.Fatalf("concurrent-duplicates: %+v; want a failure naming the executions", c)
			}
		})
	}
}

// TestEffectsProbeAgainstTheMiddleware: the middleware's duplicates move
// the effects as one run does; a probe that no run moves is said to show
// nothing, not passed.
func TestEffectsProbeAgainstTheMiddleware(t *testing.T) {
	eng, _ := idem.New(idem.Config{Store: memstore.New()})
	mw, _ := httpidem.New(httpidem.Config{Engine: eng, RequireKey: true})
	var n atomic.Int64
	mux := http.NewServeMux()
	mux.Handle("POST /v1/charges", mw.Wrap(charge(&n)))
	mux.HandleFunc("GET /effects", func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, `{"customer":"cus_1","charges":[%s],"sum":%d}`, strings.TrimSuffix(strings.Repeat("{},", int(n.Load())), ","), -100*n.Load())
	})
	mux.HandleFunc("GET /constant", func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, `{"ok":1}`) })
	srv := httptest.NewServer(mux)
	defer srv.Close()
	for path, want := range map[string]string{"/effects": "moved as one run moves them", "/constant": "did not change when one request ran"} {
		rep, err := verify.Run(context.Background(), verify.Config{URL: srv.URL + "/v1/charges", Body: `{"amount":100}`, EffectsURL: srv.URL + path})
		if err != nil {
			t.Fatal(err)
		}
		c := results(rep)["concurrent-duplicates"]
		if wantResult := map[string]verify.Result{"/effects": verify.Pass, "/constant": verify.Fail}[path]; c.Result != wantResult || !strings.Contains(c.Detail, want) {
			t.Errorf("%s: concurrent-duplicates: %+v; want %s saying %q", path, c, wantResult, want)
		}
	}
}

// TestConcurrentCountsAReleasedAnswerAsNoOutcome: the duplicate that runs
// first answers 503 (nothing happened, the key released, as the demo does
// when its acquirer is busy), and a waiting duplicate then runs and gets
// 201. That is the contract. (It failed: "got 2 different answers: it ran
// more than once".)
func TestConcurrentCountsAReleasedAnswerAsNoOutcome(t *testing.T) {
	eng, _ := idem.New(idem.Config{Store: memstore.New()})
	mw, _ := httpidem.New(httpidem.Config{Engine: eng, RequireKey: true})
	var n, calls atomic.Int64
	srv := httptest.NewServer(mw.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if calls.Add(1) == 4 { // the concurrent check's first execution (replay: 1, payload-mismatch: 2, its changed body alone: 3)
			httpidem.NothingHappened(r)
			problem(w, 503, "acquirer-unavailable")
			return
		}
		charge(&n)(w, r)
	})))
	defer srv.Close()
	rep, err := verify.Run(context.Background(), verify.Config{URL: srv.URL, Body: `{"amount":100}`, RequireKey: true})
	if err != nil {
		t.Fatal(err)
	}
	// No check fails: the 503 fell in the concurrent check (in another,
	// that check would fail), which passes: it was not counted as an
	// outcome.
	for _, c := range rep.Checks {
		if c.Result == verify.Fail {
			t.Errorf("%s: %+v; want no failure", c.Name, c)
		}
	}
	if c := results(rep)["concurrent-duplicates"]; c.Result != verify.Pass {
		t.Fatalf("concurrent-duplicates: %+v; want a pass", c)
	}
	if calls.Load() < 4 {
		t.Fatalf("the handler ran %d times; the 503 was never sent", calls.Load())
	}
}

// wedged: duplicates that arrive together all back off with 409 and leave
// the key in progress for good; a lone request works.
type wedged struct {
	mu       sync.Mutex
	inflight map[string]int
	stuck    map[string]bool
	done     map[string]string
	n        atomic.Int64
	// A run waits (half a second at most) for a second run of its key, so
	// that duplicates sent at once collide however the machine schedules
	// them.
	running map[string]*overlap
}

func (s *wedged) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	key, err := httpidem.ParseKey(r.Header.Values("Idempotency-Key"), httpidem.KeyAny)
	if err != nil {
		problem(w, 400, "key-invalid")
		return
	}
	body, _ := io.ReadAll(r.Body)
	s.mu.Lock()
	if resp, ok := s.done[key]; ok {
		s.mu.Unlock()
		if !strings.HasPrefix(resp, string(body)) {
			problem(w, 422, "mismatch")
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Idempotent-Replayed", "true")
		w.WriteHeader(201)
		io.WriteString(w, resp)
		return
	}
	if s.stuck[key] {
		s.mu.Unlock()
		problem(w, 409, "in-progress")
		return
	}
	s.inflight[key]++
	o := s.running[key]
	if o == nil {
		o = &overlap{both: make(chan struct{})}
		s.running[key] = o
	}
	if o.n++; o.n == 2 {
		close(o.both)
	}
	s.mu.Unlock()
	select { // the work
	case <-o.both:
	case <-time.After(500 * time.Millisecond):
	}
	s.mu.Lock()
	if s.inflight[key] > 1 || s.stuck[key] { // "a conflict": everyone backs off, the key stays taken
		s.stuck[key] = true
		s.mu.Unlock()
		problem(w, 409, "in-progress")
		return
	}
	resp := fmt.Sprintf(`%s{"execution":%d}`, body, s.n.Add(1))
	s.done[key] = resp
	s.mu.Unlock()
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(201)
	io.WriteString(w, resp)
}

// TestConcurrentFailsWhenNoDuplicateGotAnOutcome: every duplicate got 409
// and the key stays taken for good. (It passed: "one outcome (0 replayed
// it, 10 got 409); a later retry replayed it", though the retry got 409.)
func TestConcurrentFailsWhenNoDuplicateGotAnOutcome(t *testing.T) {
	s := &wedged{inflight: map[string]int{}, stuck: map[string]bool{}, done: map[string]string{}, running: map[string]*overlap{}}
	srv := httptest.NewServer(s)
	defer srv.Close()
	rep, err := verify.Run(context.Background(), verify.Config{URL: srv.URL, Body: `{"amount":100}`})
	if err != nil {
		t.Fatal(err)
	}
	if c := results(rep)["concurrent-duplicates"]; c.Result != verify.Fail || !strings.Contains(c.Detail, "got an outcome") {
		t.Fatalf("concurrent-duplicates: %+v; want a failure: no duplicate got an outcome", c)
	}
}

// TestStoredDeclineIsAnOutcome: a 4xx the endpoint stores and replays (a
// declined card's 402) is an outcome, not a refusal: every check runs and
// passes. (The run stopped at the first request with ErrRefused.)
func TestStoredDeclineIsAnOutcome(t *testing.T) {
	eng, _ := idem.New(idem.Config{Store: memstore.New()})
	mw, _ := httpidem.New(httpidem.Config{Engine: eng, RequireKey: true, Scope: httpidem.HashScope("Authorization")})
	var n atomic.Int64
	srv := httptest.NewServer(mw.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		time.Sleep(20 * time.Millisecond) // real work takes a while: duplicates overlap
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusPaymentRequired)
		fmt.Fprintf(w, `{"id":"ch_%d","status":"declined"}`, n.Add(1))
	})))
	defer srv.Close()
	rep, err := verify.Run(context.Background(), verify.Config{URL: srv.URL, Body: `{"amount":100}`, RequireKey: true,
		Credentials: []string{"Bearer alice", "Bearer bob"}})
	if err != nil {
		t.Fatalf("Run: %v", err)
	}
	for _, c := range rep.Checks {
		if c.Result != verify.Pass {
			t.Errorf("%s: %s: %s", c.Name, c.Result, c.Detail)
		}
	}
}

// TestURLPasswordIsNotPrinted: a password in the URL is in no report and no
// error. (It was printed in Report.URL and in ErrUnreachable and ErrRefused.)
func TestURLPasswordIsNotPrinted(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	closed := ln.Addr().String()
	ln.Close()
	refusing := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		problem(w, 400, "invalid")
	}))
	defer refusing.Close()
	for name, addr := range map[string]string{"unreachable": closed, "refused": strings.TrimPrefix(refusing.URL, "http://")} {
		rep, err := verify.Run(context.Background(), verify.Config{URL: "http://alice:s3cr3t-pw@" + addr + "/v1/charges"})
		printed := fmt.Sprint(rep, err)
		if err == nil || strings.Contains(printed, "s3cr3t") || !strings.Contains(rep.URL, "alice:xxxxx@") {
			t.Errorf("%s: report %+v, error %v; want an error and the password in neither", name, rep, err)
		}
	}
}

// TestAnEndpointThatAsksForRetriesIsReachable: an API whose store is down
// answers every request 503; the retrying client gives up on it with an
// error, which made the run stop as if the endpoint could not be reached.
// The checks run and say what it answered.
func TestAnEndpointThatAsksForRetriesIsReachable(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		(&httpidem.Problem{Type: httpidem.ProblemStoreUnavailable, Title: "Idempotency store unavailable", Status: 503}).Write(w)
	}))
	defer srv.Close()
	rep, err := verify.Run(context.Background(), verify.Config{URL: srv.URL + "/v1/charges", Timeout: 5 * time.Second})
	if errors.Is(err, verify.ErrUnreachable) || len(rep.Checks) < 2 || !strings.Contains(fmt.Sprint(rep), "503") {
		t.Fatalf("an endpoint answering 503: %+v, %v; want every check run, failing on the 503", rep, err)
	}
	// The detail says what came back, and that it was retried. (It said
	// "the first request failed (503 )".)
	if d := rep.Checks[0].Detail; !strings.Contains(d, "503 Service Unavailable") || !strings.Contains(d, "attempts, asking for a retry") {
		t.Errorf("detail %q does not say what the endpoint answered", d)
	}
}

// TestURLQuerySecretIsNotPrinted: a secret in a URL's query (an api_key, a
// token) is in no check's detail and no error. Report.URL hid it, but every
// failed request quoted net/http's error, which names the URL whole.
func TestURLQuerySecretIsNotPrinted(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	closed := ln.Addr().String()
	ln.Close()
	rep, err := verify.Run(context.Background(), verify.Config{URL: "http://" + closed + "/v1/charges?api_key=sk_live_s3cr3t"})
	if printed := fmt.Sprint(rep, err); err == nil || strings.Contains(printed, "s3cr3t") {
		t.Errorf("unreachable endpoint: report %+v, error %v; want an error without the api_key", rep, err)
	}
	// The endpoint answers, the effects page cannot be read.
	eng, _ := idem.New(idem.Config{Store: memstore.New()})
	mw, _ := httpidem.New(httpidem.Config{Engine: eng, RequireKey: true})
	var n atomic.Int64
	srv := httptest.NewServer(mw.Wrap(charge(&n)))
	defer srv.Close()
	rep, err = verify.Run(context.Background(), verify.Config{URL: srv.URL + "/v1/charges", EffectsURL: "http://" + closed + "/balance?access_token=tok_s3cr3t"})
	if printed := fmt.Sprint(rep, err); !strings.Contains(printed, "could not be read") || strings.Contains(printed, "s3cr3t") {
		t.Errorf("unreadable effects page: report %+v, error %v; want it said, without the token", rep, err)
	}
}

// TestEachRequestIsBounded: with a client that has no timeout of its own,
// an endpoint that takes requests and never answers ends the run with
// ErrUnreachable after Timeout. (Run never returned.)
func TestEachRequestIsBounded(t *testing.T) {
	release := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-r.Context().Done():
		case <-release:
		}
	}))
	defer srv.Close()
	defer close(release) // before Close, which waits for the handlers
	type result struct {
		rep verify.Report
		err error
	}
	done := make(chan result, 1)
	go func() {
		rep, err := verify.Run(context.Background(), verify.Config{URL: srv.URL, Client: &http.Client{}, Timeout: 200 * time.Millisecond})
		done <- result{rep, err}
	}()
	select {
	case got := <-done:
		if !errors.Is(got.err, verify.ErrUnreachable) || len(got.rep.Checks) != 1 {
			t.Fatalf("Run = %+v, %v; want one failed check and ErrUnreachable", got.rep, got.err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not return within 10 s against an endpoint that never answers")
	}
}
