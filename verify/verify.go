// Package verify checks, from the outside, whether an HTTP endpoint honours
// the idempotency contract: it sends the requests a careful client would
// and reads the answers. It is what `idem verify` runs.
//
// The checks, each with a fresh random key:
//
//	replay                a retry gets the first answer, byte for byte, marked Idempotent-Replayed
//	payload-mismatch      the same key with another payload gets 422 and, read with an effects page, moves no side effect
//	                      (judged only when the other payload, alone under a fresh key, is not refused too)
//	concurrent-duplicates N requests at once: one outcome (the others replay it or get 409, 429 or 503), replayed after
//	missing-key           no key gets 400 (only with RequireKey)
//	malformed-keys        an empty, over-long, non-ASCII or doubled key gets 400
//	scopes                the same key from another credential is not replayed across (with two Credentials)
//	problem-json          every 4xx the checks saw is application/problem+json
//
// Answers alone show a second execution only when it answers differently (a
// new id, a counter). An endpoint that runs every duplicate and answers all
// but one with 409 or with the first's stored answer, marked replayed, gives
// nothing away in its answers, and nor does one whose every answer is the
// same byte for byte: the concurrent check passes them, and says so. Give
// [Config.EffectsURL], a page that shows the request's side effects, and
// the check reads them too: the duplicates must move them exactly as one
// run does. The payload-mismatch check reads them as well: an endpoint
// that runs the other payload before it answers 422 moves them, and fails.
//
// A 422 is the answer to a payload mismatch only if the endpoint takes the
// other payload on its own: a validator that refuses it (a member it does
// not know, say) answers 422 to it under any key. The first time a check
// gets a 422 to the other payload, verify sends that payload once more,
// alone under a fresh key (one request more, after any effects reading, so
// the side effects the checks compare do not see it); when it is refused
// there too, the check is not judged and fails, saying to give a changed
// body the endpoint accepts.
//
// verify never follows a redirect: an endpoint that answers a POST with a
// 303 and a Location is judged by that 303, which a retry must replay.
//
// A 4xx answer is an outcome, not a refusal, when the endpoint stores it: a
// retry with the same key gets it back marked replayed (a declined card's
// 402). Only a 4xx that a retry does not replay stops the checks
// ([ErrRefused]); a 4xx outcome is not held to problem-json.
//
// A password in the URL is printed as "xxxxx", in the report and the errors.
// The report says what each check saw.
package verify

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"math"
	"math/big"
	"mime"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/idemhq/idem/idemclient"
	"github.com/idemhq/idem/internal/redact"
)

// The errors of [Run] when the first request shows that no check can run;
// the report holds that first check.
var (
	// ErrUnreachable: the endpoint gives no answer at all (refused
	// connections, DNS, timeouts).
	ErrUnreachable = errors.New("the endpoint cannot be reached")
	// ErrRefused: the endpoint answers the first request with a 4xx that a
	// retry with the same key does not replay (a 4xx it stores and replays
	// is an outcome, and the checks go on); give it a body it accepts and
	// the headers it needs.
	ErrRefused = errors.New("the endpoint refuses the request")
)

// DefaultConcurrency is how many duplicates the concurrent check sends.
const DefaultConcurrency = 10

// DefaultTimeout bounds each request when [Config.Timeout] is zero.
const DefaultTimeout = 30 * time.Second

// Config says what to check and how to reach it.
type Config struct {
	// URL is the endpoint, an http:// or https:// URL. Required.
	URL string
	// Method defaults to POST.
	Method string
	// Body is a request the endpoint accepts. Defaults to
	// {"idem_verify": "<random>"}.
	Body string
	// ChangedBody is the "different payload": another request the endpoint
	// accepts (the scopes check runs it). Defaults to Body changed the least
	// that an endpoint that validates is likely to accept: when Body is a
	// JSON object, its first number member (in name order) plus one, or
	// else one more member ("idem_verify_changed": true); otherwise Body
	// with "-changed" appended. Give your own to an endpoint that refuses it:
	// one that refuses it on its own (under a fresh key) leaves the
	// payload-mismatch and scopes checks unjudged, and failed.
	ChangedBody string
	// Header is sent with every request (Content-Type, credentials…).
	Header http.Header
	// Concurrency is how many duplicates the concurrent check sends at
	// once. Zero means [DefaultConcurrency]; negative is an error.
	Concurrency int
	// RequireKey checks that a request without a key is refused.
	RequireKey bool
	// ScopeHeader and Credentials: with two credentials (two values of
	// ScopeHeader, which defaults to Authorization), the scopes check sends
	// one key under each.
	ScopeHeader string
	Credentials []string
	// Client sends the requests. Defaults to http.Client's zero value.
	// The endpoint's answers are judged as they come, so a redirect is
	// never followed: verify sends them with a copy of Client whose
	// CheckRedirect returns [http.ErrUseLastResponse] (Client itself is not
	// changed, and its own CheckRedirect is not used for them). The
	// effects page is read with Client as it is.
	Client *http.Client
	// Timeout bounds each request the checks send, with its retries for
	// the checks that retry, whether or not Client has a Timeout of its
	// own (which, when shorter, applies too). Zero means
	// [DefaultTimeout]; negative is an error.
	Timeout time.Duration
	// EffectsURL, when set, is a page that shows the request's side effects
	// (a count of charges, a balance, a ledger) as JSON: the concurrent
	// check reads it (GET, with Header) before one run of the request with
	// a key of its own, after that run, and after the duplicates. Its
	// numbers, and the lengths of its arrays, must move during the
	// duplicates exactly as they moved during the one run: a second
	// execution that answers like a replay or a 409 moves them again. The
	// one run must move at least one of them, or the probe shows nothing
	// and the check fails saying so. The payload-mismatch check reads it
	// before and after the request with the other payload, which must move
	// none of them: an endpoint that runs it and then answers 422 has run
	// a second request under one key. Give a page that nothing else changes
	// while verify runs, whose numbers move by the same amount with every
	// run (not a clock or a random id), and whose effects are written
	// before the request is answered. Without it, the check reads answers
	// only and its report says what that cannot show.
	EffectsURL string
	// Progress, when set, is called after each request with the count so
	// far, one call at a time.
	Progress func(sent int)
}

// Result is what a check found.
type Result string

// The results of a check.
const (
	Pass Result = "pass"
	Fail Result = "FAIL"
	Skip Result = "skip"
)

// Check is one line of the report.
type Check struct {
	Name   string `json:"name"`
	Result Result `json:"result"`
	Detail string `json:"detail"`
}

// Report is the outcome of [Run].
type Report struct {
	// URL is Config.URL without its password nor its secret options.
	URL    string  `json:"url"`
	Checks []Check `json:"checks"`
}

// Passed reports whether no check failed.
func (r Report) Passed() bool {
	for _, c := range r.Checks {
		if c.Result == Fail {
			return false
		}
	}
	return true
}

// answer is one response, read whole.
type answer struct {
	status int
	header http.Header
	body   []byte
	err    error
	// retries says, for an answer the retrying client gave up on, after
	// how many attempts (the answer's body is not kept).
	retries int
}

func (a answer) String() string {
	if a.err != nil {
		return "error: " + a.err.Error()
	}
	if a.retries > 0 {
		return fmt.Sprintf("%d %s to the last of %d attempts, asking for a retry", a.status, http.StatusText(a.status), a.retries)
	}
	var p struct{ Title, Detail string }
	if a.problemJSON() && json.Unmarshal(a.body, &p) == nil && p.Title != "" {
		return strings.TrimSuffix(fmt.Sprintf("%d %s: %s", a.status, p.Title, p.Detail), ": ")
	}
	b := a.body
	if len(b) > 120 {
		b = append(b[:117:117], "..."...)
	}
	return fmt.Sprintf("%d %s", a.status, bytes.TrimSpace(b))
}

func (a answer) replayed() bool { return a.header.Get("Idempotent-Replayed") == "true" }

func (a answer) problemJSON() bool {
	mt, _, _ := mime.ParseMediaType(a.header.Get("Content-Type"))
	return mt == "application/problem+json"
}

type runner struct {
	cfg      Config
	url      string       // cfg.URL as printed: without its password
	plain    *http.Client // sees every answer as it is, a redirect included
	retrying *http.Client // idemclient: rides out 503s and 409 in-progress with the same key; follows no redirect
	reader   *http.Client // reads the effects page: Config.Client as it is
	// alone is what changedAlone found (nil until a check asks).
	alone *string
	mu    sync.Mutex
	// stop is why the checks cannot go on after the first request.
	stop     error
	sent     int
	seen4xx  []seen4xx       // the endpoint's 4xx answers
	outcomes map[string]bool // the 4xx answers (by signature) that a retry replayed: outcomes, not errors
}

// seen4xx is a 4xx answer, for the problem-json check.
type seen4xx struct {
	signature string
	problem   bool   // application/problem+json
	describe  string // its status and content type
}

// Run runs every check against cfg.URL. An error means the checks could not
// run at all (bad config); a failing endpoint is a Report with failures.
func Run(ctx context.Context, cfg Config) (Report, error) {
	if cfg.URL == "" {
		return Report{}, errors.New("verify: no URL")
	}
	if err := checkURL("URL", cfg.URL); err != nil {
		return Report{}, err
	}
	if cfg.EffectsURL != "" {
		if err := checkURL("effects URL", cfg.EffectsURL); err != nil {
			return Report{}, err
		}
	}
	if cfg.Timeout < 0 {
		return Report{}, fmt.Errorf("verify: the timeout is negative (%s); zero means the default, %s", cfg.Timeout, DefaultTimeout)
	}
	if cfg.Concurrency < 0 {
		return Report{}, fmt.Errorf("verify: the concurrency is negative (%d); zero means the default, %d", cfg.Concurrency, DefaultConcurrency)
	}
	if cfg.Timeout == 0 {
		cfg.Timeout = DefaultTimeout
	}
	cfg.Method = strings.ToUpper(cmpOr(cfg.Method, http.MethodPost))
	if cfg.Body == "" {
		k, _ := idemclient.NewUUIDv4()
		cfg.Body = fmt.Sprintf(`{"idem_verify":%q}`, k)
	}
	if cfg.ChangedBody == "" {
		cfg.ChangedBody = changed(cfg.Body)
	}
	if cfg.ChangedBody == cfg.Body {
		return Report{}, errors.New("verify: the changed body is the same as the body")
	}
	if cfg.Concurrency == 0 {
		cfg.Concurrency = DefaultConcurrency
	}
	cfg.ScopeHeader = cmpOr(cfg.ScopeHeader, "Authorization")
	if cfg.Header == nil {
		cfg.Header = http.Header{}
	}
	if cfg.Header.Get("Content-Type") == "" && json.Valid([]byte(cfg.Body)) {
		cfg.Header.Set("Content-Type", "application/json")
	}
	reader := cfg.Client
	if reader == nil {
		reader = &http.Client{} // each request is bounded by cfg.Timeout
	}
	plain := *reader // a copy: the caller's client is left as it is
	plain.CheckRedirect = stopAtRedirect
	base := plain.Transport
	if base == nil {
		base = http.DefaultTransport
	}
	r := &runner{cfg: cfg, url: redact.URL(cfg.URL), plain: &plain, reader: reader, outcomes: map[string]bool{},
		retrying: &http.Client{Timeout: plain.Timeout, CheckRedirect: stopAtRedirect,
			Transport: idemclient.New(idemclient.Config{Base: base, MaxElapsed: 20 * time.Second})}}
	rep := Report{URL: r.url}
	for _, check := range []func(context.Context) Check{r.replay, r.mismatch, r.concurrent, r.missingKey, r.malformed, r.scopes} {
		rep.Checks = append(rep.Checks, check(ctx))
		if r.stop != nil {
			return rep, r.stop
		}
	}
	rep.Checks = append(rep.Checks, r.problemJSON())
	return rep, nil
}

// problemJSON checks the 4xx answers the other checks saw, but for the
// outcomes the endpoint stored and replayed.
func (r *runner) problemJSON() Check {
	c := Check{Name: "problem-json"}
	n, outcomes := 0, 0
	var bad []string
	for _, s := range r.seen4xx {
		switch {
		case r.outcomes[s.signature]:
			outcomes++
		case !s.problem:
			bad = append(bad, s.describe)
			fallthrough
		default:
			n++
		}
	}
	switch {
	case len(bad) > 0:
		c.Result, c.Detail = Fail, "not application/problem+json: "+strings.Join(bad, "; ")
	case n == 0 && outcomes > 0:
		c.Result, c.Detail = Skip, fmt.Sprintf("the only 4xx answers seen (%d) were a stored outcome, replayed, which need not be problem+json", outcomes)
	case n == 0:
		c.Result, c.Detail = Skip, "no 4xx answer was seen"
	default:
		c.Result, c.Detail = Pass, fmt.Sprintf("all %d 4xx answers were application/problem+json", n)
		if outcomes > 0 {
			c.Detail += fmt.Sprintf("; %d more were a stored outcome, replayed, which need not be", outcomes)
		}
	}
	return c
}

// stopAtRedirect makes a client return a redirect as the answer: the
// endpoint's answer is what the checks judge, not the page it points to.
func stopAtRedirect(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }

// checkURL refuses a URL the checks could not send to: one that does not
// parse, has no host, or is not http or https. A URL without a scheme
// ("localhost:8080/v1/charges", which parses with "localhost" as its
// scheme) is the common slip: the error says what was likely meant. The
// errors show the URL without its secrets.
func checkURL(what, raw string) error {
	u, err := url.Parse(raw)
	if !strings.Contains(raw, "://") && (err != nil || u.Scheme == "" || u.Opaque != "") {
		return fmt.Errorf("verify: the %s has no scheme: did you mean %s?", what, redact.URL("http://"+raw))
	}
	switch {
	case err != nil:
		return fmt.Errorf("verify: the %s is not valid: %v", what, redact.Err(err))
	case u.Scheme != "http" && u.Scheme != "https":
		return fmt.Errorf("verify: the %s's scheme is %s: verify sends HTTP requests, to an http:// or https:// URL", what, u.Scheme)
	case u.Host == "":
		return fmt.Errorf("verify: the %s names no host: %s", what, redact.URL(raw))
	}
	return nil
}

func cmpOr(v, def string) string {
	if v == "" {
		return def
	}
	return v
}

// changed makes another payload (see Config.ChangedBody).
func changed(body string) string {
	var obj map[string]json.RawMessage
	if json.Unmarshal([]byte(body), &obj) != nil || obj == nil {
		return body + "-changed"
	}
	obj["idem_verify_changed"] = json.RawMessage("true")
	for _, name := range slices.Sorted(maps.Keys(obj)) {
		if n, err := strconv.ParseInt(string(obj[name]), 10, 64); err == nil && n < math.MaxInt64 {
			delete(obj, "idem_verify_changed")
			obj[name] = json.RawMessage(strconv.FormatInt(n+1, 10))
			break
		}
	}
	b, _ := json.Marshal(obj)
	return string(b)
}

func newKey() string {
	k, _ := idemclient.NewUUIDv4()
	return k
}

// send makes one request to the endpoint: keys is nil for none, or the
// header values to send.
func (r *runner) send(ctx context.Context, c *http.Client, body string, keys []string, extra http.Header) answer {
	h := r.cfg.Header.Clone()
	for name, v := range extra {
		h[name] = v
	}
	for _, k := range keys {
		h.Add("Idempotency-Key", k)
	}
	a := r.do(ctx, c, r.cfg.Method, r.cfg.URL, body, h)
	if a.err == nil && a.status >= 400 && a.status < 500 {
		r.mu.Lock()
		r.seen4xx = append(r.seen4xx, seen4xx{signature: a.signature(), problem: a.problemJSON(),
			describe: fmt.Sprintf("%d (%s)", a.status, cmpOr(a.header.Get("Content-Type"), "no content type"))})
		r.mu.Unlock()
	}
	return a
}

// do makes one request, bounded by cfg.Timeout, and reads its answer. Its
// error names no URL: net/http's would quote the target whole, a secret in
// its query included.
func (r *runner) do(ctx context.Context, c *http.Client, method, target, body string, h http.Header) answer {
	ctx, cancel := context.WithTimeout(ctx, r.cfg.Timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, method, target, strings.NewReader(body))
	if err != nil {
		return answer{err: redact.Err(err)}
	}
	req.Header = h
	resp, err := c.Do(req)
	r.mu.Lock()
	r.sent++
	if r.cfg.Progress != nil {
		r.cfg.Progress(r.sent) // one call at a time, in order
	}
	r.mu.Unlock()
	var gaveUp *idemclient.Error
	if errors.As(err, &gaveUp) && gaveUp.Status != 0 {
		// The retrying client gave up on an answer that asked for a retry
		// (a 503, a 429): the endpoint answered, and the checks say so.
		return answer{status: gaveUp.Status, header: http.Header{}, retries: gaveUp.Attempts}
	}
	if err != nil {
		return answer{err: redact.Err(err)}
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return answer{status: resp.StatusCode, header: resp.Header, body: b, err: err}
}

// signature is the answer's status and body: what a replay repeats.
func (a answer) signature() string { return fmt.Sprintf("%d %s", a.status, a.body) }

// replays reports whether a is a replay of the answer of: marked
// Idempotent-Replayed, with its status and body.
func (a answer) replays(of answer) bool {
	return a.err == nil && of.err == nil && a.replayed() && a.signature() == of.signature()
}

// stored tells an outcome from a refusal: an answer below 400 is an
// outcome; a 4xx is one only when retry, the same request again, gets it
// back replayed. The 4xx outcomes are remembered for the problem-json check.
func (r *runner) stored(a answer, retry func() answer) bool {
	if a.err != nil || a.status >= 500 {
		return false
	}
	if a.status < 400 {
		return true
	}
	if !retry().replays(a) {
		return false
	}
	r.mu.Lock()
	r.outcomes[a.signature()] = true
	r.mu.Unlock()
	return true
}

// headersDiffer names the headers a replay changed, leaving out those that
// may differ per response.
func headersDiffer(a, b http.Header) []string {
	skip := map[string]bool{"Date": true, "Idempotent-Replayed": true, "Connection": true, "Keep-Alive": true, "Set-Cookie": true}
	var diff []string
	for name, v := range a {
		if !skip[name] && !slices.Equal(v, b[name]) {
			diff = append(diff, name)
		}
	}
	for name := range b {
		if _, ok := a[name]; !ok && !skip[name] {
			diff = append(diff, name)
		}
	}
	slices.Sort(diff)
	return diff
}

func (r *runner) replay(ctx context.Context) Check {
	c := Check{Name: "replay"}
	key := newKey()
	first := r.send(ctx, r.retrying, r.cfg.Body, []string{key}, nil)
	switch {
	case first.err != nil:
		r.stop = fmt.Errorf("%w: %s: %v", ErrUnreachable, r.url, first.err)
		c.Result, c.Detail = Fail, fmt.Sprintf("the first request failed (%s)", first)
		return c
	case first.status >= 500:
		c.Result, c.Detail = Fail, fmt.Sprintf("the first request failed (%s)", first)
		return c
	}
	second := r.send(ctx, r.retrying, r.cfg.Body, []string{key}, nil)
	// A 4xx is a refusal unless the retry replays it: a stored outcome.
	if !r.stored(first, func() answer { return second }) {
		r.stop = fmt.Errorf("%w: %s answered %d", ErrRefused, r.url, first.status)
		c.Result, c.Detail = Fail, fmt.Sprintf("the first request was refused (%s), and a retry did not replay it", first)
		return c
	}
	switch {
	case second.err != nil:
		c.Result, c.Detail = Fail, "the retry failed: "+second.err.Error()
	case second.status != first.status || !bytes.Equal(second.body, first.body):
		c.Result, c.Detail = Fail, fmt.Sprintf("the retry got %s, the first %s: it ran again or answered differently", second, first)
	case !second.replayed():
		c.Result, c.Detail = Fail, "the retry's answer matched but was not marked Idempotent-Replayed: true"
	default:
		c.Result, c.Detail = Pass, fmt.Sprintf("the retry got the first answer (%d, %d bytes), marked replayed", first.status, len(first.body))
		switch differ := headersDiffer(first.header, second.header); {
		case slices.ContainsFunc(differ, func(h string) bool { return replayedHeaders[h] }):
			c.Result, c.Detail = Fail, "the replay changed headers: "+strings.Join(differ, ", ")
		case len(differ) > 0:
			// A layer in front (a load balancer, a CDN) may stamp every
			// response: said, not failed.
			c.Detail += "; these headers differ per response: " + strings.Join(differ, ", ")
		}
	}
	return c
}

// replayedHeaders are the headers of the answer itself, which a replay must
// repeat; others (a request id a layer in front adds) may differ.
var replayedHeaders = map[string]bool{"Content-Type": true, "Content-Encoding": true, "Content-Language": true,
	"Location": true, "Cache-Control": true, "Etag": true, "Last-Modified": true, "Idempotency-Expires": true}

func (r *runner) mismatch(ctx context.Context) Check {
	c := Check{Name: "payload-mismatch"}
	key := newKey()
	first := r.send(ctx, r.retrying, r.cfg.Body, []string{key}, nil)
	if !r.stored(first, func() answer { return r.send(ctx, r.retrying, r.cfg.Body, []string{key}, nil) }) {
		c.Result, c.Detail = Fail, fmt.Sprintf("the first request failed (%s)", first)
		return c
	}
	// With an effects page: read it around the other payload, which must
	// run nothing.
	var before effects
	if r.cfg.EffectsURL != "" {
		var err error
		if before, err = r.effects(ctx); err != nil {
			c.Result, c.Detail = Fail, "the effects URL, before the other payload: "+err.Error()
			return c
		}
	}
	other := r.send(ctx, r.retrying, r.cfg.ChangedBody, []string{key}, nil)
	if other.status != http.StatusUnprocessableEntity {
		c.Result, c.Detail = Fail, fmt.Sprintf("the same key with another payload got %s; want 422", other)
		return c
	}
	var after effects
	if r.cfg.EffectsURL != "" {
		var err error
		if after, err = r.effects(ctx); err != nil {
			c.Result, c.Detail = Fail, "the effects URL, after the other payload: "+err.Error()
			return c
		}
	}
	// Read after the effects page: the other payload alone may run.
	if why := r.changedAlone(ctx); why != "" {
		c.Result, c.Detail = Fail, "not judged: the same key with another payload got 422, but "+why
		return c
	}
	c.Result, c.Detail = Pass, "the same key with another payload got 422"
	if r.cfg.EffectsURL == "" {
		return c
	}
	if moved := movedBetween(before, after); len(moved) > 0 {
		c.Result, c.Detail = Fail, fmt.Sprintf("the same key with another payload got 422 but moved the side effects (%s): it ran before it refused", strings.Join(moved, ", "))
	} else {
		c.Detail += "; the side effects did not move"
	}
	return c
}

// changedAlone sends the changed body alone under a fresh key, the first
// time a check asks, and says why a 422 to it under a used key cannot be
// read as the answer to a payload mismatch ("" when it can): the endpoint
// refuses that body on its own (a 4xx it does not replay: its validator's
// answer, under any key), or the request failed. A 4xx the endpoint stores
// and replays is an outcome: the body was taken.
func (r *runner) changedAlone(ctx context.Context) string {
	if r.alone == nil {
		key := newKey()
		send := func() answer { return r.send(ctx, r.retrying, r.cfg.ChangedBody, []string{key}, nil) }
		a := send()
		why := ""
		switch {
		case a.err != nil || a.status >= 500:
			why = fmt.Sprintf("the changed body alone, under a fresh key, failed (%s), so that 422 cannot be told from a refusal of the body itself; run again, or give a changed body the endpoint accepts (--changed-body)", a)
		case !r.stored(a, send):
			why = fmt.Sprintf("the endpoint refuses the changed body on its own, under a fresh key too (%s), so that 422 may be this refusal; give a changed body it accepts (--changed-body)", a)
		}
		r.alone = &why
	}
	return *r.alone
}

// notOutcome reports whether a duplicate's answer says it did not run: it
// was held back (409, 429), or it ran and nothing happened (503, the key
// released for a later request).
func notOutcome(status int) bool {
	return status == http.StatusConflict || status == http.StatusTooManyRequests || status == http.StatusServiceUnavailable
}

func (r *runner) concurrent(ctx context.Context) Check {
	c := Check{Name: "concurrent-duplicates"}
	// With an effects page: read it before and after one run of the request
	// under a key of its own, to see what one run moves.
	var before, one effects
	if r.cfg.EffectsURL != "" {
		var err error
		if before, err = r.effects(ctx); err != nil {
			c.Result, c.Detail = Fail, "the effects URL, before one run: "+err.Error()
			return c
		}
		k := newKey()
		run := func() answer { return r.send(ctx, r.retrying, r.cfg.Body, []string{k}, nil) }
		if a := run(); !r.stored(a, run) {
			c.Result, c.Detail = Fail, fmt.Sprintf("one run, for the effects URL, failed (%s)", a)
			return c
		}
		if one, err = r.effects(ctx); err != nil {
			c.Result, c.Detail = Fail, "the effects URL, after one run: "+err.Error()
			return c
		}
	}
	key := newKey()
	answers := make([]answer, r.cfg.Concurrency)
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := range answers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			answers[i] = r.send(ctx, r.plain, r.cfg.Body, []string{key}, nil)
		}()
	}
	close(start)
	wg.Wait()
	outcomes := map[string]int{}
	held, replays, fresh, errs := 0, 0, 0, 0
	for _, a := range answers {
		switch {
		case a.err != nil:
			errs++
		case notOutcome(a.status):
			held++
		default:
			if a.replayed() {
				replays++
			} else {
				fresh++
			}
			outcomes[a.signature()]++
		}
	}
	// Once they are done, one more retry must replay the one outcome.
	final := r.send(ctx, r.retrying, r.cfg.Body, []string{key}, nil)
	only := ""
	for o := range outcomes {
		only = o
	}
	n := r.cfg.Concurrency
	switch {
	case len(outcomes) > 1:
		c.Result, c.Detail = Fail, fmt.Sprintf("%d duplicates sent at once got %d different answers: it ran more than once", n, len(outcomes))
		return c
	case errs > 0:
		c.Result, c.Detail = Fail, fmt.Sprintf("%d of %d duplicates failed at the network level", errs, n)
		return c
	case len(outcomes) == 0:
		c.Result, c.Detail = Fail, fmt.Sprintf("none of %d duplicates sent at once got an outcome (all got 409, 429 or 503), and then a retry got %s: one of them must run, or the key is never settled", n, final)
		return c
	case fresh > 1:
		c.Result, c.Detail = Fail, fmt.Sprintf("%d of %d duplicates sent at once got the outcome not marked Idempotent-Replayed: it ran more than once, or its replays are not marked", fresh, n)
		return c
	case final.err != nil || !final.replayed() || final.signature() != only:
		c.Result, c.Detail = Fail, fmt.Sprintf("after the duplicates, a retry got %s, not a replay of their outcome", final)
		return c
	}
	if final.status >= 400 && final.status < 500 {
		r.mu.Lock()
		r.outcomes[only] = true // a stored 4xx, replayed
		r.mu.Unlock()
	}
	c.Result, c.Detail = Pass, fmt.Sprintf("%d duplicates at once: one outcome (%d replayed it, %d got 409, 429 or 503); a later retry replayed it", n, replays, held)
	if r.cfg.EffectsURL == "" {
		c.Detail += "; answers alone cannot show a duplicate that ran and was answered like a replay or a 409: give an effects URL (idem verify --effects-url) to read the side effects"
		return c
	}
	after, err := r.effects(ctx)
	if err != nil {
		c.Result, c.Detail = Fail, "the effects URL, after the duplicates: "+err.Error()
		return c
	}
	moved, unlike := compareEffects(before, one, after)
	switch {
	case len(moved) == 0:
		c.Result, c.Detail = Fail, "the effects URL did not change when one request ran, so it cannot show a second execution: give one whose numbers the request moves (a count of charges, a balance)"
	case len(unlike) > 0:
		c.Result, c.Detail = Fail, fmt.Sprintf("%d duplicates at once moved the side effects unlike one run: %s: it did not run exactly once", n, strings.Join(unlike, "; "))
	default:
		c.Detail += fmt.Sprintf("; the side effects moved as one run moves them (%s)", strings.Join(moved, ", "))
	}
	return c
}

// effects are the numbers of the effects page, by JSON pointer, with the
// lengths of its arrays.
type effects map[string]*big.Rat

// lengthOf marks the path of an array's length.
const lengthOf = "\x00length"

// effects reads cfg.EffectsURL. Its errors name no URL and quote no body.
func (r *runner) effects(ctx context.Context) (effects, error) {
	h := r.cfg.Header.Clone()
	h.Del("Content-Type")
	a := r.do(ctx, r.reader, http.MethodGet, r.cfg.EffectsURL, "", h)
	switch {
	case a.err != nil:
		return nil, fmt.Errorf("it could not be read: %v", a.err)
	case a.status < 200 || a.status > 299:
		return nil, fmt.Errorf("it answered %d", a.status)
	}
	dec := json.NewDecoder(bytes.NewReader(a.body))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		return nil, errors.New("its answer is not JSON")
	}
	e := effects{}
	e.walk("", v)
	return e, nil
}

func (e effects) walk(path string, v any) {
	switch v := v.(type) {
	case json.Number:
		if n, ok := new(big.Rat).SetString(v.String()); ok {
			e[path] = n
		}
	case map[string]any:
		for name, w := range v {
			e.walk(path+"/"+strings.NewReplacer("~", "~0", "/", "~1").Replace(name), w)
		}
	case []any:
		e[path+lengthOf] = big.NewRat(int64(len(v)), 1)
		for i, w := range v {
			e.walk(path+"/"+strconv.Itoa(i), w)
		}
	}
}

// diff is how much each number moved from one read of the effects page to
// a later one. Numbers that are not in both reads (an array's new element)
// are left out; its length is not.
func diff(from, to effects) effects {
	d := effects{}
	for path, n := range to {
		if f, ok := from[path]; ok {
			d[path] = new(big.Rat).Sub(n, f)
		}
	}
	return d
}

// effectName names a path of the effects page in a report.
func effectName(path string) string {
	p, isLength := strings.CutSuffix(path, lengthOf)
	if p == "" {
		p = "the answer"
	}
	if isLength {
		return "the length of " + p
	}
	return p
}

// movedBy says how much a number moved: "/charges by 1".
func movedBy(path string, by *big.Rat) string {
	return fmt.Sprintf("%s by %s", effectName(path), by.RatString())
}

// firstFew keeps a report line short: the first three, then "…".
func firstFew(s []string) []string {
	const most = 3
	if len(s) > most {
		return append(s[:most:most], "…")
	}
	return s
}

// movedBetween says which numbers moved from one read to a later one, and
// by how much, in path order.
func movedBetween(from, to effects) []string {
	d := diff(from, to)
	var moved []string
	for _, path := range slices.Sorted(maps.Keys(d)) {
		if d[path].Sign() != 0 {
			moved = append(moved, movedBy(path, d[path]))
		}
	}
	return firstFew(moved)
}

// compareEffects says which numbers one run moved, and which the
// duplicates moved otherwise than one run did. Numbers that are not in all
// three reads (an array's new element) are left out; its length is not.
func compareEffects(before, one, after effects) (moved, unlike []string) {
	byOne, byAll := diff(before, one), diff(one, after)
	for _, path := range slices.Sorted(maps.Keys(byOne)) {
		all, ok := byAll[path]
		if !ok {
			continue
		}
		if byOne[path].Sign() != 0 {
			moved = append(moved, movedBy(path, byOne[path]))
		}
		if byOne[path].Cmp(all) != 0 {
			unlike = append(unlike, fmt.Sprintf("%s moved by %s (one run moves it by %s)", effectName(path), all.RatString(), byOne[path].RatString()))
		}
	}
	return firstFew(moved), firstFew(unlike)
}

func (r *runner) missingKey(ctx context.Context) Check {
	c := Check{Name: "missing-key"}
	if !r.cfg.RequireKey {
		c.Result, c.Detail = Skip, "not checked: say that the endpoint requires a key (--require-key)"
		return c
	}
	a := r.send(ctx, r.plain, r.cfg.Body, nil, nil)
	if a.status == http.StatusBadRequest {
		c.Result, c.Detail = Pass, "a request without a key got 400"
	} else {
		c.Result, c.Detail = Fail, fmt.Sprintf("a request without a key got %s; want 400", a)
	}
	return c
}

func (r *runner) malformed(ctx context.Context) Check {
	c := Check{Name: "malformed-keys"}
	var bad []string
	for name, keys := range map[string][]string{
		"an empty key":        {`""`},
		"a 256-byte key":      {strings.Repeat("k", 256)},
		"a non-ASCII key":     {"cl\xc3\xa9-" + newKey()},
		"two Idempotency-Key": {newKey(), newKey()},
	} {
		if a := r.send(ctx, r.plain, r.cfg.Body, keys, nil); a.status != http.StatusBadRequest {
			bad = append(bad, fmt.Sprintf("%s got %s", name, a))
		}
	}
	slices.Sort(bad)
	if len(bad) > 0 {
		c.Result, c.Detail = Fail, strings.Join(bad, "; ")+"; want 400"
	} else {
		c.Result, c.Detail = Pass, "empty, 256-byte, non-ASCII and doubled keys all got 400"
	}
	return c
}

func (r *runner) scopes(ctx context.Context) Check {
	c := Check{Name: "scopes"}
	if len(r.cfg.Credentials) != 2 {
		c.Result, c.Detail = Skip, "not checked: give two credentials (--credential twice)"
		return c
	}
	key := newKey()
	h := r.cfg.ScopeHeader
	as := func(i int, body string) func() answer {
		return func() answer {
			return r.send(ctx, r.retrying, body, []string{key}, http.Header{http.CanonicalHeaderKey(h): {r.cfg.Credentials[i]}})
		}
	}
	a := as(0, r.cfg.Body)()
	if !r.stored(a, as(0, r.cfg.Body)) {
		c.Result, c.Detail = Fail, fmt.Sprintf("the first credential's request failed (%s)", a)
		return c
	}
	// The other caller sends another payload under the same key: with one
	// key space per caller it simply runs; with a shared one it collides.
	b := as(1, r.cfg.ChangedBody)()
	switch {
	case b.err != nil:
		c.Result, c.Detail = Fail, "the second credential's request failed: "+b.err.Error()
	case b.status == http.StatusUnprocessableEntity:
		if why := r.changedAlone(ctx); why != "" {
			c.Result, c.Detail = Fail, "not judged: the same key from another credential, with the changed body, got 422, but "+why
		} else {
			c.Result, c.Detail = Fail, "the same key from another credential collided with the first (422): keys are not scoped per caller"
		}
	case b.replayed():
		c.Result, c.Detail = Fail, "the second credential was replayed the first one's answer: keys are not scoped per caller"
	case b.status >= 400 && b.status < 500 && !r.stored(b, as(1, r.cfg.ChangedBody)):
		c.Result, c.Detail = Fail, fmt.Sprintf("the second credential's request, with the changed body, was refused (%s); give another request the endpoint accepts (--changed-body)", b)
	case b.status >= 500:
		c.Result, c.Detail = Fail, fmt.Sprintf("the second credential's request failed (%s)", b)
	default:
		c.Result, c.Detail = Pass, "the same key from two credentials ran as two requests"
	}
	return c
}
