// Package httpidem puts the idempotency contract in front of any net/http
// handler:
//
//	mw, err := httpidem.New(httpidem.Config{Engine: engine, Scope: scopeByAPIKey})
//	http.ListenAndServe(addr, mw.Wrap(mux))
//
// For each covered request (POST, PUT, PATCH and DELETE by default) that carries an
// Idempotency-Key, the middleware fingerprints the payload, asks the engine,
// and either runs the handler once, replays its stored outcome
// (with "Idempotent-Replayed: true"), or answers with an RFC 9457 problem:
//
//	key missing (when required), malformed     400
//	request body over the limit                413
//	same key, different payload                422
//	same key while the first still runs        409 + Retry-After (or wait)
//	outcome of an earlier run unknown          409 operation-uncertain
//	stored response could not be kept          409 response-not-replayable
//	store unreachable                          503, nothing runs
//	request's context ended before it ran      503 not-run (409 in-progress
//	                                           when the first still runs)
//
// The handler's response is buffered and stored before the client sees it
// (or, while the store cannot be reached, kept in the engine's journal, which
// stores it as soon as the store answers), so a client that saw an outcome
// gets exactly that outcome on its retry. The store calls are detached from
// the client: one that goes away mid-acquire leaves a released key, never a
// record for work that did not run.
// Everything the handler returns is stored — a 500 included — except 429 and
// 503 and responses the handler marks with [NothingHappened]: those release
// the key and the next retry runs. A panic marks the outcome unknown. The
// handler's context is not cancelled when the client goes away (its outcome
// is stored for the retry), but it is cancelled when the lease is lost.
//
// # A 429 or 503 releases the key, whoever writes it
//
// Any 429 or 503 written inside Wrap releases the key: the handler's own,
// http.TimeoutHandler's, a reverse proxy's passing on an upstream's. The
// middleware takes it as "nothing happened", and the retry runs again. Put
// http.TimeoutHandler outside Wrap, never inside: inside, it writes its 503
// when its timer fires while the handler it wraps goes on running (the card
// is still charged), and that 503 looks like any other, so the retry would
// run the charge a second time. Outside, its deadline ends the request's
// context, the handler goes on detached, its outcome is stored, and the
// retry gets it (or 409 in-progress meanwhile). Where a 429 or 503 may come
// after an effect, set [Config.ExplicitRelease]: only [NothingHappened] then
// releases the key.
package httpidem

import (
	"bufio"
	"bytes"
	"compress/gzip"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idemhq/idem"
)

// Defaults for [Config].
const (
	// DefaultMaxRequestBody is the largest request body fingerprinted; a
	// larger one is refused with 413.
	DefaultMaxRequestBody = 1 << 20
	// DefaultMaxResponseBody is the largest response body stored for replay;
	// a larger one is delivered once and replays as not replayable.
	DefaultMaxResponseBody = 1 << 20
)

// DefaultMethods returns the methods covered when [Config.Methods] is empty:
// every unsafe method, as Stripe's SDKs send a key on each of them.
func DefaultMethods() []string {
	return []string{http.MethodPost, http.MethodPut, http.MethodPatch, http.MethodDelete}
}

// DefaultWait is how long a duplicate of a running request waits for the
// first to finish, when [Config.Wait] is zero.
const DefaultWait = 5 * time.Second

// HeaderIgnored is set on the answer to a request that carries an
// Idempotency-Key the middleware does not honour (its method is not
// covered, or [Config.FailOpen] ran it while the store was unreachable):
// the request ran, without idempotency, and the header says why. A key is
// never ignored silently, so that a client does not retry such an answer
// believing the retry safe.
const HeaderIgnored = "Idempotent-Ignored"

// Ignored returns w as the writer of an answer to a request whose key is
// not honoured: its final answer carries [HeaderIgnored] set to why,
// however the handler writes it. (A reverse proxy clears the headers after
// passing on an upstream's 1xx, 100 Continue or 103 Early Hints; a header
// set once beforehand was lost, and the key ignored silently.)
func Ignored(w http.ResponseWriter, why string) http.ResponseWriter {
	w.Header().Set(HeaderIgnored, why)
	return &ignoredWriter{ResponseWriter: w, why: why}
}

// ignoredWriter sets HeaderIgnored as the final answer's header is written.
type ignoredWriter struct {
	http.ResponseWriter
	why   string
	wrote bool
}

func (w *ignoredWriter) WriteHeader(code int) {
	if !w.wrote && (code >= 200 || code == http.StatusSwitchingProtocols) {
		w.wrote = true
		w.Header().Set(HeaderIgnored, w.why)
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *ignoredWriter) Write(b []byte) (int, error) {
	if !w.wrote {
		w.WriteHeader(http.StatusOK)
	}
	return w.ResponseWriter.Write(b)
}

// Flush writes the header first, as Write does, then flushes.
func (w *ignoredWriter) Flush() {
	if !w.wrote {
		w.WriteHeader(http.StatusOK)
	}
	http.NewResponseController(w.ResponseWriter).Flush()
}

// ReadFrom writes the header first, as Write does, then copies r.
func (w *ignoredWriter) ReadFrom(r io.Reader) (int64, error) {
	if !w.wrote {
		w.WriteHeader(http.StatusOK)
	}
	return io.Copy(w.ResponseWriter, r)
}

// Hijack hands the connection over, as the writer beneath does (a
// WebSocket upgrader asks for an http.Hijacker).
func (w *ignoredWriter) Hijack() (net.Conn, *bufio.ReadWriter, error) {
	return http.NewResponseController(w.ResponseWriter).Hijack()
}

// Unwrap gives http.ResponseController the writer beneath.
func (w *ignoredWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// InProgressRetryAfter is the Retry-After of a 409 in-progress answer.
const InProgressRetryAfter = time.Second

// HeaderExpires tells the client until when the outcome of the request that
// created a record will be replayed (an HTTP-date): the retention policy the
// IETF draft asks servers to publish. It is [idem.HeaderExpires].
const HeaderExpires = idem.HeaderExpires

// Config configures a [Middleware]. Zero values are defaults. The fields
// that are data carry the names `idem proxy` gives them in its YAML file,
// flags and IDEM_* variables (the proxy's routes are made of this struct).
type Config struct {
	// Engine decides and stores. Required.
	Engine *idem.Engine `yaml:"-"`
	// Methods are the methods covered; others pass straight through.
	// Defaults to [DefaultMethods].
	Methods []string `yaml:"methods"`
	// RequireKey makes a covered request without a key a 400. Defaults to
	// false: such a request passes through without protection.
	RequireKey bool `yaml:"require_key"`
	// KeyFormat restricts keys further. Defaults to [KeyAny].
	KeyFormat KeyFormat `yaml:"key_format"`
	// Scope names the caller, so that the same key from two callers is two
	// records and neither can replay the other's response. It must return
	// at most 255 bytes of printable ASCII ([HashScope] makes any value so).
	// When nil, ScopeHeaders name the caller.
	Scope func(*http.Request) string `yaml:"-"`
	// ScopeHeaders, when Scope is nil, name the caller by the SHA-256 of
	// these request headers together ([HashScope]): an API key, a tenant, a
	// connected account (Authorization and Stripe-Account).
	//
	// WARNING: with neither Scope nor ScopeHeaders, which is the default,
	// there is one scope for everybody: any client that guesses or learns
	// another client's key gets that client's response. Set one whenever
	// more than one caller can reach the handler.
	ScopeHeaders []string `yaml:"scope_headers"`
	// CanonicalJSON fingerprints a JSON request body in its RFC 8785
	// canonical form, so key order and whitespace do not count. A body that
	// is not JSON, or that [CanonicalJSON] refuses (an object with two
	// members whose names differ only in case, or repeat, which
	// encoding/json binds to one field), is fingerprinted as sent. Defaults
	// to false.
	CanonicalJSON bool `yaml:"canonical_json"`
	// IncludeFields, when set, fingerprints only these members of a JSON
	// body (dotted paths such as "card.last4"), matching names as
	// encoding/json binds them to fields: the member whose name equals the
	// path's under case folding ("Card.Last4") counts, under its name as
	// the body has it. Implies CanonicalJSON.
	IncludeFields []string `yaml:"include_fields"`
	// ExcludeFields leaves these members of a JSON body out of its
	// fingerprint (a client timestamp, say), named exactly. Implies
	// CanonicalJSON.
	ExcludeFields []string `yaml:"exclude_fields"`
	// MaxRequestBody is the largest body accepted. Defaults to
	// [DefaultMaxRequestBody].
	MaxRequestBody int64 `yaml:"max_request_body"`
	// MaxResponseBody is the largest body stored. Defaults to
	// [DefaultMaxResponseBody], and is never more than the store keeps.
	MaxResponseBody int64 `yaml:"max_response_body"`
	// StoreHeaders, when set, is an allowlist: only these response headers
	// are stored and replayed. Defaults to nil: every header but
	// Set-Cookie, Authorization, hop-by-hop headers and Date.
	StoreHeaders []string `yaml:"store_headers"`
	// Wait is how long a duplicate of a running request waits for the first
	// to finish, to get its replay; a duplicate whose wait runs out (or
	// is cut short by its request's context: an outer deadline) gets
	// 409 in-progress. Clients seldom honour Retry-After (Stripe's SDKs
	// give up after a second or two), so waiting is what lets a duplicate of
	// a slow request succeed. Defaults to [DefaultWait]; negative answers
	// 409 at once.
	Wait time.Duration `yaml:"wait"`
	// TakeoverSafe declares that the handler's effects all commit together
	// with the record, so an expired lease may be taken over and a panic
	// before the handler began its answer releases the key instead of
	// making the outcome unknown. (A panic once it began one, a status
	// written, as a reverse proxy's abort when its upstream's body breaks
	// off, still makes the outcome unknown: the handler may have acted.)
	// Defaults to false.
	TakeoverSafe bool `yaml:"takeover_safe"`
	// Lease overrides the engine's lease for these requests. Defaults to
	// the engine's.
	Lease time.Duration `yaml:"lease"`
	// Retention overrides the engine's retention for these requests.
	// Defaults to the engine's.
	Retention time.Duration `yaml:"retention"`
	// ExplicitRelease makes only [NothingHappened] release the key: a 429 or
	// 503 the handler writes is then stored and replayed like any other
	// status (a 500). Set it when a 429 or 503 from inside Wrap may follow
	// an effect: an http.TimeoutHandler inside Wrap (whose 503 is written
	// while the handler it wraps goes on running; better, put it outside),
	// a proxy passing on an upstream's 503 after the upstream may have
	// acted. Defaults to false: a 429 or 503 means "nothing happened", and
	// the retry runs (see the package doc).
	ExplicitRelease bool `yaml:"explicit_release"`
	// FailOpen runs the handler unprotected when the store cannot be
	// reached (an error wrapping [idem.ErrUnavailable]), instead of
	// answering 503; never when the store answered: with an error of
	// another kind (a record it cannot read), refusing access
	// ([idem.ErrDenied]: a password or permission rotated), or refusing
	// the call for a reason of its own ([idem.ErrRefused]: out of memory, a
	// read-only replica, a lock held by the key's running request). Nor
	// while another request with the same key is served by this
	// middleware: a duplicate of one running here (with the store's lease
	// or failed open) gets 409 in-progress, of one that completed here
	// while the duplicate waited its replay, and any other 503. Defaults to
	// false: fail closed.
	FailOpen bool `yaml:"fail_open"`
	// Logger receives a line per problem. Keys are logged as a hash, never
	// as sent. Defaults to slog.Default().
	Logger *slog.Logger `yaml:"-"`
	// Observe, when set, is told what became of each covered request: one
	// of the Observed* names. For metrics.
	Observe func(r *http.Request, observed string) `yaml:"-"`
}

// What [Config.Observe] is told about a covered request.
const (
	ObservedExecuted      = "executed"       // the handler ran
	ObservedReplayed      = "replayed"       // the stored outcome was sent again
	ObservedMismatch      = "mismatch"       // 422: same key, another payload
	ObservedInFlight      = "in_flight"      // 409: the first is still running
	ObservedUncertain     = "uncertain"      // 409: the outcome is unknown
	ObservedNotReplayable = "not_replayable" // 409: the outcome was not kept
	ObservedStoreError    = "store_error"    // 503: the store could not be reached
	ObservedFailOpen      = "fail_open"      // the store could not be reached; ran unprotected
	ObservedKeyMissing    = "key_missing"    // 400
	ObservedKeyInvalid    = "key_invalid"    // 400
	ObservedNoKey         = "no_key"         // no key, none required: ran unprotected
	ObservedRejected      = "rejected"       // 413 or an unreadable body
	ObservedClientGone    = "client_gone"    // the client went away before anything ran
	ObservedMisconfigured = "misconfigured"  // 500: the engine refused the request's scope or the config
)

type keyHashKey struct{}

// KeyHashOf returns the key hash ([idem.KeyHash]) of a keyed request the
// middleware serves, as its log lines name the key: from the request the
// handler is given, or the one [Config.Observe] is told about once the key
// is read. It is "" for any other request.
func KeyHashOf(r *http.Request) string {
	if c := callFrom(r.Context()); c != nil {
		return idem.KeyHash(c.lease.Scope, c.lease.Key)
	}
	h, _ := r.Context().Value(keyHashKey{}).(string)
	return h
}

func (m *Middleware) observe(r *http.Request, what string) {
	if m.cfg.Observe != nil {
		m.cfg.Observe(r, what)
	}
}

// Middleware enforces the idempotency contract on a handler.
type Middleware struct {
	cfg     Config
	methods map[string]bool
	allow   map[string]bool
	log     *slog.Logger
	active  active // with FailOpen: the keyed requests served now
}

// New checks cfg and returns the middleware.
func New(cfg Config) (*Middleware, error) {
	if cfg.Engine == nil {
		return nil, fmt.Errorf("%w: httpidem: config has no engine", idem.ErrInvalid)
	}
	for _, v := range []struct {
		name  string
		value int64
	}{{"max request body", cfg.MaxRequestBody}, {"max response body", cfg.MaxResponseBody}, {"lease", int64(cfg.Lease)}, {"retention", int64(cfg.Retention)}} {
		if v.value < 0 {
			return nil, fmt.Errorf("%w: httpidem: %s is negative: want a positive value, or 0 for the default", idem.ErrInvalid, v.name)
		}
	}
	if cfg.MaxRequestBody == 0 {
		cfg.MaxRequestBody = DefaultMaxRequestBody
	}
	// The body is read up to one byte past the limit, to tell a body at the
	// limit from a longer one: a limit of the largest int64 ("none") wrapped
	// round, and every body was read as empty.
	cfg.MaxRequestBody = min(cfg.MaxRequestBody, math.MaxInt64-1)
	if cfg.Wait == 0 {
		cfg.Wait = DefaultWait
	}
	if cfg.MaxResponseBody == 0 {
		cfg.MaxResponseBody = DefaultMaxResponseBody
	}
	// Never ask the store to keep more than it can.
	cfg.MaxResponseBody = min(cfg.MaxResponseBody, int64(cfg.Engine.MaxBody()))
	if len(cfg.Methods) == 0 {
		cfg.Methods = DefaultMethods()
	}
	if cfg.Scope == nil && len(cfg.ScopeHeaders) > 0 {
		cfg.Scope = HashScope(cfg.ScopeHeaders...)
	}
	m := &Middleware{cfg: cfg, methods: map[string]bool{}, log: cfg.Logger}
	for _, method := range cfg.Methods {
		m.methods[strings.ToUpper(method)] = true
	}
	if cfg.StoreHeaders != nil {
		m.allow = map[string]bool{}
		for _, h := range cfg.StoreHeaders {
			m.allow[http.CanonicalHeaderKey(h)] = true
		}
	}
	if m.log == nil {
		m.log = slog.Default()
	}
	return m, nil
}

// Wrap returns next behind the middleware.
func (m *Middleware) Wrap(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { m.serve(w, r, next) })
}

// HashScope returns a Scope function that names the caller by the SHA-256
// of request headers (an API key, a tenant id, the Authorization header and
// a connected account's Stripe-Account), so that the secrets themselves are
// never stored. Requests that carry none of them share the empty scope.
//
// With one header, the scope is the SHA-256 of its (first) value, as it has
// always been, so records stay found across an upgrade.
func HashScope(headers ...string) func(*http.Request) string {
	if len(headers) == 1 {
		return func(r *http.Request) string {
			v := r.Header.Get(headers[0])
			if v == "" {
				return ""
			}
			sum := sha256.Sum256([]byte(v))
			return hex.EncodeToString(sum[:])
		}
	}
	return func(r *http.Request) string {
		h := sha256.New()
		seen := false
		for _, name := range headers {
			v := r.Header.Values(name)
			seen = seen || len(v) > 0
			fmt.Fprintf(h, "%d:%s%d", len(name), name, len(v))
			for _, x := range v {
				fmt.Fprintf(h, ":%d:%s", len(x), x)
			}
		}
		if !seen {
			return ""
		}
		return hex.EncodeToString(h.Sum(nil))
	}
}

// call is what the middleware knows about a request it runs, reachable from
// the handler's context.
type call struct {
	m       *Middleware
	lease   idem.Lease
	verdict atomic.Int32
	settled atomic.Pointer[idem.Response] // what the handler stored itself (Finish)
}

// expires is the Idempotency-Expires of the call's outcome if it were
// settled now.
func (c *call) expires() string {
	return c.m.cfg.Engine.Expires(c.lease).UTC().Format(http.TimeFormat)
}

const (
	verdictDefault int32 = iota
	verdictNothing
	verdictUnknown
)

// releases reports whether a call that ends with verdict and status has
// its key released (its retry runs again), not its outcome stored.
func (m *Middleware) releases(verdict int32, status int) bool {
	return verdict == verdictNothing ||
		!m.cfg.ExplicitRelease && (status == http.StatusTooManyRequests || status == http.StatusServiceUnavailable)
}

// active are the keyed requests a middleware with FailOpen serves now, by
// record: what it knows of a key when the store cannot be reached, so that
// it never runs a request unprotected while another with its key runs here.
type active struct {
	mu sync.Mutex
	m  map[activeKey]*activity
}

type activeKey struct{ scope, key string }

// activity is what the requests served now for one key know of it.
type activity struct {
	members int // requests for the key being served
	running int // of them, running the handler
	// outcome is the outcome a run here stored, for the payload whose
	// fingerprint is fp; ran alone says a run here ended without one.
	outcome *idem.Response
	ran     bool
	fp      idem.Fingerprint
}

// enter counts a request for scope and key in.
func (a *active) enter(scope, key string) *activity {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.m == nil {
		a.m = map[activeKey]*activity{}
	}
	id := activeKey{scope, key}
	act := a.m[id]
	if act == nil {
		act = &activity{}
		a.m[id] = act
	}
	act.members++
	return act
}

// leave counts the request out: the last one forgets the key.
func (a *active) leave(scope, key string, act *activity) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if act.members--; act.members == 0 {
		delete(a.m, activeKey{scope, key})
	}
}

// run notes that a request runs the handler.
func (a *active) run(act *activity) {
	a.mu.Lock()
	defer a.mu.Unlock()
	act.running++
}

// ran notes that a run ended, having stored outcome (nil: none, or not
// known) for the request whose fingerprint is fp.
func (a *active) ran(act *activity, fp idem.Fingerprint, outcome *idem.Response) {
	a.mu.Lock()
	defer a.mu.Unlock()
	act.running--
	act.ran = true
	if outcome != nil {
		act.outcome, act.fp = outcome, fp
	}
}

// failOpen decides for a request whose store cannot be reached: it may run
// unprotected (and then counts as running) only when it is the only request
// for its key served here; otherwise it gets 409 in-progress while another
// runs, the outcome stored here for its payload, or nothing (a 503).
func (a *active) failOpen(act *activity, fp idem.Fingerprint) (run, inFlight bool, outcome *idem.Response) {
	a.mu.Lock()
	defer a.mu.Unlock()
	switch {
	case act.running > 0:
		return false, true, nil
	case act.outcome != nil && act.fp == fp:
		return false, false, act.outcome
	case act.members > 1 || act.ran:
		return false, false, nil
	}
	act.running++
	return true, false, nil
}

type callKey struct{}

func callFrom(ctx context.Context) *call {
	c, _ := ctx.Value(callKey{}).(*call)
	return c
}

// NothingHappened tells the middleware that the request had no effect (it
// was refused before doing anything), whatever its status: the key is
// released and the client's retry runs. Call it from the handler with the
// request it was given; elsewhere it does nothing.
func NothingHappened(r *http.Request) { setVerdict(r, verdictNothing) }

// OutcomeUnknown tells the middleware that the request may or may not have
// had its effect (e.g. an upstream call got no answer): the record becomes
// UNKNOWN, retries get 409 operation-uncertain, and the reconciler settles it.
func OutcomeUnknown(r *http.Request) { setVerdict(r, verdictUnknown) }

func setVerdict(r *http.Request, v int32) {
	if c := callFrom(r.Context()); c != nil {
		c.verdict.Store(v)
	}
}

// LeaseFrom returns the lease under which the handler runs: for its
// checkpoints (idem.Engine.Checkpoint) and downstream keys
// (idem.Lease.DownstreamKey).
func LeaseFrom(ctx context.Context) (idem.Lease, bool) {
	if c := callFrom(ctx); c != nil {
		return c.lease, true
	}
	return idem.Lease{}, false
}

// ErrNoCall is returned by [Finish] outside a request the middleware runs.
var ErrNoCall = errors.New("httpidem: not inside a request run by the middleware")

// Finish settles the request's record as resp inside the handler's own
// database transaction, so that the handler's writes (the ledger debit) and
// the stored outcome commit together or not at all. commit gets the params
// to pass to the store's transactional finish (pgstore's or sqlitestore's
// FinishTx) in that transaction, and must then commit the transaction:
//
//	err := httpidem.Finish(w, r, resp, func(p idem.FinishParams) error {
//		if err := store.FinishTx(ctx, tx, p); err != nil {
//			return err
//		}
//		return tx.Commit()
//	})
//
// When commit returns nil, Finish writes resp to w, and the middleware
// stores nothing more. When it returns an error, nothing was written to w
// and the transaction must be rolled back; the handler answers as it sees
// fit (a 503 releases the key, so the client's retry runs again — right
// when the transaction rolled back). [idem.ErrLeaseLost] from FinishTx means
// a newer owner has the record.
//
// The response sent and stored has the headers set on w before Finish is
// called (a Location, a Content-Type), with resp.Header's values in place
// of those it names, as a handler that writes its answer itself has them
// stored: a replay looks like the first answer. The stored copy leaves out
// the headers the middleware never stores; the client gets all of them.
func Finish(w http.ResponseWriter, r *http.Request, resp *idem.Response, commit func(idem.FinishParams) error) error {
	c := callFrom(r.Context())
	if c == nil {
		return ErrNoCall
	}
	header := w.Header().Clone()
	if header == nil {
		header = http.Header{}
	}
	for name, values := range resp.Header {
		header[name] = slices.Clone(values)
	}
	stored := &idem.Response{Status: resp.Status, Header: storedHeader(header, c.m.allow)}
	if int64(len(resp.Body)) > c.m.cfg.MaxResponseBody {
		stored.BodyOmitted = true
	} else {
		stored.Body = resp.Body
	}
	err := c.m.cfg.Engine.Settle(context.WithoutCancel(r.Context()), c.lease, idem.Settlement{State: idem.StateCompleted, Response: stored,
		Commit: func(_ context.Context, p idem.FinishParams) error { return commit(p) }})
	if err != nil {
		return err
	}
	c.settled.Store(stored)
	h := w.Header()
	for name, values := range header {
		h[name] = values
	}
	h.Set(HeaderExpires, stored.Header.Get(HeaderExpires))
	w.WriteHeader(resp.Status)
	w.Write(resp.Body)
	return nil
}

func (m *Middleware) serve(w http.ResponseWriter, r *http.Request, next http.Handler) {
	if !m.methods[r.Method] {
		if HasKey(r.Header) {
			w = Ignored(w, r.Method+" is not covered here: the request ran without idempotency")
		}
		next.ServeHTTP(w, r)
		return
	}
	key, err := keyOf(r.Header, m.cfg.KeyFormat)
	switch {
	case errors.Is(err, errKeyMissing) && !m.cfg.RequireKey:
		m.observe(r, ObservedNoKey)
		next.ServeHTTP(w, r)
		return
	case errors.Is(err, errKeyMissing):
		m.observe(r, ObservedKeyMissing)
		(&Problem{Type: ProblemKeyMissing, Title: "Idempotency-Key required", Status: http.StatusBadRequest,
			Detail: fmt.Sprintf("%s %s requires an Idempotency-Key header", r.Method, r.URL.Path)}).Write(w)
		return
	case err != nil:
		m.observe(r, ObservedKeyInvalid)
		(&Problem{Type: ProblemKeyInvalid, Title: "Idempotency-Key malformed", Status: http.StatusBadRequest, Detail: err.Error()}).Write(w)
		return
	}
	scope := ""
	if m.cfg.Scope != nil {
		scope = m.cfg.Scope(r)
	}
	body, err := io.ReadAll(io.LimitReader(r.Body, m.cfg.MaxRequestBody+1))
	if tooLarge, ok := errors.AsType[*http.MaxBytesError](err); ok { // an http.MaxBytesReader around the middleware: final, as ours is
		m.observe(r, ObservedRejected)
		(&Problem{Type: ProblemRequestTooLarge, Title: "Request body too large", Status: http.StatusRequestEntityTooLarge,
			Detail: fmt.Sprintf("a request body may be at most %d bytes here", tooLarge.Limit)}).Write(w)
		return
	}
	if err != nil {
		m.observe(r, ObservedRejected)
		(&Problem{Type: ProblemRequestUnreadable, Title: "Request body unreadable", Status: http.StatusBadRequest, Detail: err.Error()}).Write(w)
		return
	}
	if int64(len(body)) > m.cfg.MaxRequestBody {
		m.observe(r, ObservedRejected)
		(&Problem{Type: ProblemRequestTooLarge, Title: "Request body too large", Status: http.StatusRequestEntityTooLarge,
			Detail: fmt.Sprintf("an idempotent request body may be at most %d bytes", m.cfg.MaxRequestBody)}).Write(w)
		return
	}
	r.Body = io.NopCloser(bytes.NewReader(body))
	params := idem.BeginParams{
		Scope: scope, Key: key, Fingerprint: m.fingerprint(r, body),
		Lease: m.cfg.Lease, Retention: m.cfg.Retention, TakeoverSafe: m.cfg.TakeoverSafe,
	}
	var act *activity
	if m.cfg.FailOpen {
		act = m.active.enter(scope, key)
		defer m.active.leave(scope, key, act)
	}
	if m.cfg.Observe != nil { // KeyHashOf, for what it is told
		r = r.WithContext(context.WithValue(r.Context(), keyHashKey{}, idem.KeyHash(scope, key)))
	}
	log := func() *slog.Logger { // made when a line is logged, not for every request
		return m.log.With("key_hash", idem.KeyHash(scope, key), "method", r.Method, "path", r.URL.Path)
	}

	// The engine's store calls are detached from the client: one that goes
	// away mid-acquire never leaves a record behind for work that did not
	// run. Only a wait for another request ends with the client.
	var out idem.Outcome
	if m.cfg.Wait > 0 {
		out, err = m.cfg.Engine.Await(r.Context(), params, m.cfg.Wait)
	} else {
		out, err = m.cfg.Engine.Begin(r.Context(), params)
	}
	if err != nil && r.Context().Err() != nil && !errors.Is(err, idem.ErrUnavailable) {
		m.observe(r, ObservedClientGone)
		log().Info("idempotency: the client went away while waiting", "err", err)
		// The context may have ended with the client still there (an outer
		// middleware's deadline): answer, or net/http answers 200 OK.
		if out.Decision == idem.InFlight {
			inProgress(w, out.RetryAfter)
		} else {
			notRun(w)
		}
		return
	}
	if err != nil {
		if errors.Is(err, idem.ErrInvalid) {
			m.observe(r, ObservedMisconfigured)
			log().Error("idempotency: invalid input", "err", err)
			(&Problem{Type: ProblemIdempotencyFailed, Title: "Idempotency misconfigured", Status: http.StatusInternalServerError,
				Detail: "the server's idempotency scope is invalid"}).Write(w)
			return
		}
		// Fail open only when the store could not be reached: a store that
		// answered with an error (a record it cannot read) may hold an
		// outcome, and running the handler again would run it twice.
		if m.cfg.FailOpen && errors.Is(err, idem.ErrUnavailable) && !errors.Is(err, idem.ErrDenied) && !errors.Is(err, idem.ErrRefused) &&
			r.Context().Err() == nil {
			// Never for a key served here meanwhile: its duplicate would run
			// twice in this very process.
			run, inFlight, outcome := m.active.failOpen(act, params.Fingerprint)
			switch {
			case run:
				m.observe(r, ObservedFailOpen)
				log().Warn("idempotency store unavailable: running unprotected (fail-open)", "err", err)
				defer m.active.ran(act, params.Fingerprint, nil)
				next.ServeHTTP(Ignored(w, "the idempotency store could not be reached: the request ran without idempotency (fail-open)"), r)
				return
			case inFlight:
				m.observe(r, ObservedInFlight)
				log().Warn("idempotency store unavailable: a request with this key runs here, not failing open", "err", err)
				inProgress(w, InProgressRetryAfter)
				return
			case outcome != nil:
				m.observe(r, ObservedReplayed)
				log().Warn("idempotency store unavailable: replaying the outcome stored here, not failing open", "err", err)
				replay(w, outcome)
				return
			}
			log().Warn("idempotency store unavailable: a request with this key was served here, not failing open", "err", err)
		}
		m.observe(r, ObservedStoreError)
		log().Error("idempotency store unavailable: refusing (fail-closed)", "err", err)
		(&Problem{Type: ProblemStoreUnavailable, Title: "Idempotency store unavailable", Status: http.StatusServiceUnavailable,
			Detail: "the request was not run; retry it with the same key", RetryAfter: time.Second}).Write(w)
		return
	}
	switch out.Decision {
	case idem.Execute:
		if r.Context().Err() != nil {
			// Gone before anything ran: release the key for its retry (then
			// tell Observe, which may look at the record).
			if err := m.cfg.Engine.Release(context.WithoutCancel(r.Context()), out.Lease); err != nil {
				log().Error("idempotency: cannot release the key of a request whose client went away", "err", err)
			}
			m.observe(r, ObservedClientGone)
			notRun(w)
			return
		}
		m.observe(r, ObservedExecuted)
		m.execute(w, r, next, out.Lease, act, log)
	case idem.Replay:
		if out.Record.Response.BodyOmitted {
			m.observe(r, ObservedNotReplayable)
		} else {
			m.observe(r, ObservedReplayed)
		}
		replay(w, out.Record.Response)
	case idem.Mismatch:
		m.observe(r, ObservedMismatch)
		(&Problem{Type: ProblemPayloadMismatch, Title: "Idempotency-Key reused with a different payload", Status: http.StatusUnprocessableEntity,
			Detail:  fmt.Sprintf("this key was first used with a request that differs in %s", strings.Join(out.Diff, ", ")),
			Differs: out.Diff}).Write(w)
	case idem.InFlight:
		m.observe(r, ObservedInFlight)
		inProgress(w, out.RetryAfter)
	case idem.Uncertain:
		m.observe(r, ObservedUncertain)
		(&Problem{Type: ProblemUncertain, Title: "The outcome of the first request with this Idempotency-Key is unknown", Status: http.StatusConflict,
			Detail: "it may or may not have taken effect; it will not be run again until that is resolved"}).Write(w)
	}
}

// inProgress answers 409 in-progress to a duplicate of a request that
// still runs, whose lease ends within retryAfter.
func inProgress(w http.ResponseWriter, retryAfter time.Duration) {
	// The lease's end is only an upper bound on when the first request
	// finishes; most finish far sooner, so ask for a prompt retry.
	if retryAfter <= 0 {
		retryAfter = InProgressRetryAfter
	}
	(&Problem{Type: ProblemInProgress, Title: "A request with this Idempotency-Key is in progress", Status: http.StatusConflict,
		Detail: "retry after the first request finishes", RetryAfter: min(retryAfter, InProgressRetryAfter)}).Write(w)
}

// notRun answers a request whose context ended before it could run: a
// client that went away does not hear it, one still there (an outer
// middleware's deadline ran out) learns that nothing ran.
func notRun(w http.ResponseWriter) {
	(&Problem{Type: ProblemNotRun, Title: "The request was not run", Status: http.StatusServiceUnavailable,
		Detail: "its deadline passed, or its client went away, before it could run; retry it with the same key", RetryAfter: time.Second}).Write(w)
}

// fingerprint hashes the request: method, path, canonical query and the body
// (decoded when gzip-encoded; canonical JSON, with fields selected, when
// configured).
func (m *Middleware) fingerprint(r *http.Request, body []byte) idem.Fingerprint {
	body = decoded(r.Header, body, m.cfg.MaxRequestBody)
	if m.cfg.CanonicalJSON || len(m.cfg.IncludeFields) > 0 || len(m.cfg.ExcludeFields) > 0 {
		if v, err := decodeJSON(body); err == nil {
			var b bytes.Buffer
			if writeCanonical(&b, selectFields(v, m.cfg.IncludeFields, m.cfg.ExcludeFields)) == nil {
				body = b.Bytes()
			}
		}
	}
	return idem.NewFingerprint(idem.Payload{Method: r.Method, Path: fingerprintPath(r.URL), Query: r.URL.RawQuery, Body: body})
}

// fingerprintPath is the path a request is fingerprinted by: the decoded
// path, as it always was, unless the path as sent has an escaped slash.
// /a%2Fb and /a/b decode alike but are two routes (Go's ServeMux matches
// the escaped path, {id} is "a/b" in the first), so such a path counts as
// sent, after a prefix that no decoded path has (those begin with "/", or
// are "*" or empty), so that it is never taken for a path whose decoded
// form reads the same (/a%252Fb decodes to "/a%2Fb").
func fingerprintPath(u *url.URL) string {
	if raw := u.RawPath; strings.Contains(raw, "%2F") || strings.Contains(raw, "%2f") {
		return "escaped:" + u.EscapedPath()
	}
	return u.Path
}

// decoded returns a gzip-encoded body decoded: what it carries is the
// payload, and the same payload compressed again (another timestamp in the
// gzip header, another level) is the same request. A body that does not
// decode, or would decode to more than limit, is taken as sent. The handler
// gets the body as sent.
func decoded(h http.Header, body []byte, limit int64) []byte {
	if ce := strings.ToLower(strings.TrimSpace(h.Get("Content-Encoding"))); ce != "gzip" && ce != "x-gzip" {
		return body
	}
	zr, err := gzip.NewReader(bytes.NewReader(body))
	if err != nil {
		return body
	}
	out, err := io.ReadAll(io.LimitReader(zr, limit+1))
	if err != nil || int64(len(out)) > limit {
		return body
	}
	return out
}

// execute runs the handler under the lease and settles the record; act,
// when set, learns of the run and its stored outcome.
func (m *Middleware) execute(w http.ResponseWriter, r *http.Request, next http.Handler, lease idem.Lease, act *activity, log func() *slog.Logger) {
	eng := m.cfg.Engine
	ran := func(outcome *idem.Response) {}
	if act != nil {
		m.active.run(act)
		ran = func(outcome *idem.Response) { m.active.ran(act, lease.Fingerprint, outcome) }
	}
	// The client going away must not stop the work (its retry wants the
	// outcome), and neither it nor a lost lease may stop the outcome from
	// being written.
	detached := context.WithoutCancel(r.Context())
	held, stop := eng.Hold(detached, lease)
	state := &call{m: m, lease: lease}
	ctx := context.WithValue(held, callKey{}, state)
	c := newCapture(w, m.cfg.MaxResponseBody)
	c.call = state
	settle := detached

	// keep settles the record by what the handler did and answered, and
	// returns the engine's Idempotency-Expires stamp for a kept response.
	keep := func(lease idem.Lease) (expires string) {
		status := c.status
		if status == 0 {
			status = http.StatusOK
		}
		var err error
		var stored *idem.Response
		switch verdict := state.verdict.Load(); {
		case state.settled.Load() != nil:
			// The handler settled the record in its own transaction (Finish).
			stored = state.settled.Load()
		case verdict == verdictUnknown:
			err = eng.MarkUnknown(settle, lease)
		case m.releases(verdict, status):
			err = eng.Release(settle, lease)
		default:
			resp := &idem.Response{Status: status, Header: storedHeader(c.Header(), m.allow)}
			if c.omitted() {
				resp.BodyOmitted = true
			} else {
				resp.Body = c.body.Bytes()
			}
			err = eng.Complete(settle, lease, resp)
			switch {
			case err == nil:
				stored = resp
				if !c.omitted() {
					expires = resp.Header.Get(HeaderExpires)
				}
			case errors.Is(err, idem.ErrInvalid):
				// The store refused the outcome as malformed; the handler
				// ran all the same: its outcome is unknown, not in progress
				// until the lease runs out.
				log().Error("idempotency: outcome refused by the store; marking it unknown", "status", status, "err", err)
				err = eng.MarkUnknown(settle, lease)
			}
		}
		ran(stored)
		if err != nil {
			// The engine retries a write whose answer was lost and keeps the
			// outcome in its journal while the store is away, so this is a
			// newer owner's outcome standing (the lease was lost) or a journal
			// that could not write. The work happened; the client gets its
			// outcome all the same, without a promise to replay it. A retry
			// finds the record in progress, unknown, or settled by the newer
			// owner: never run blindly.
			log().Error("idempotency: outcome not stored", "status", status, "err", err, "lease_lost", errors.Is(err, idem.ErrLeaseLost))
		}
		return expires
	}

	panicked := true
	defer func() {
		if !panicked {
			return
		}
		lease := stop()
		if c.passing && c.clientGone {
			// The handler gave up because the client went away while its
			// response went out (as httputil.ReverseProxy does): what it
			// answered, whose status was sent, is the outcome.
			log().Info("idempotency: the client went away during the response; its outcome is kept", "status", c.status)
			keep(lease)
			return
		}
		// A takeover-safe handler's effects commit with its record, so a
		// panic before it began any answer left none: the key is released.
		// Once it began one (a status, a body buffered, flushed or hijacked
		// away: httputil.ReverseProxy aborts mid-body after the upstream
		// answered), or said its outcome is unknown, it may have acted:
		// unknown, as on any other route, never a second run.
		released := m.cfg.TakeoverSafe && c.status == 0 && !c.hijacked && state.verdict.Load() != verdictUnknown
		var err error
		if released {
			err = eng.Release(settle, lease)
		} else {
			err = eng.MarkUnknown(settle, lease)
		}
		ran(nil)
		log().Error("idempotency: handler panicked", "settled_as", map[bool]string{true: "failed", false: "unknown"}[released], "status", c.status, "err", err)
	}()
	next.ServeHTTP(c, r.WithContext(ctx))
	panicked = false
	expires := keep(stop())
	c.deliver(expires)
}

// replay sends a stored response again.
func replay(w http.ResponseWriter, resp *idem.Response) {
	if resp.BodyOmitted {
		(&Problem{Type: ProblemNotReplayable, Title: "The response to this Idempotency-Key cannot be replayed", Status: http.StatusConflict,
			Detail:         fmt.Sprintf("the request was run once and answered %d; that response was streamed or too large to keep", resp.Status),
			OriginalStatus: resp.Status}).Write(w)
		return
	}
	h := resp.Header.Clone()
	if h == nil {
		h = http.Header{}
	}
	h.Set(HeaderReplayed, "true")
	send(w, h, resp.Status, resp.Body)
}
