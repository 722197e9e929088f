// Package verify checks, from the outside, whether an HTTP endpoint honours
// the idempotency contract: it sends the requests a careful client would
// and reads the answers. It is what `idem verify` runs.
//
// The checks, each with a fresh random key:
//
//	replay                a retry gets the first answer, byte for byte, marked Idempotent-Replayed
//	payload-mismatch      the same key with another payload gets 422
//	concurrent-duplicates N requests at once: one outcome (or 409s), never two different executions
//	missing-key           no key gets 400 (only with RequireKey)
//	malformed-keys        an empty, over-long, non-ASCII or doubled key gets 400
//	scopes                the same key from another credential is not replayed across (with two Credentials)
//	problem-json          every 4xx the checks saw is application/problem+json
//
// A second execution can only be seen when it answers differently (a new id,
// a counter); an endpoint whose every answer is the same byte for byte can
// hide one. The report says what each check saw.
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
	"mime"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/idemhq/idem/idemclient"
)

// The errors of [Run] when the first request shows that no check can run;
// the report holds that first check.
var (
	// ErrUnreachable: the endpoint gives no answer at all (refused
	// connections, DNS, timeouts).
	ErrUnreachable = errors.New("the endpoint cannot be reached")
	// ErrRefused: the endpoint answers the first request with a 4xx; give
	// it a body it accepts and the headers it needs.
	ErrRefused = errors.New("the endpoint refuses the request")
)

// DefaultConcurrency is how many duplicates the concurrent check sends.
const DefaultConcurrency = 10

// Config says what to check and how to reach it.
type Config struct {
	// URL is the endpoint. Required.
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
	// with "-changed" appended. Give your own to an endpoint that refuses it.
	ChangedBody string
	// Header is sent with every request (Content-Type, credentials…).
	Header http.Header
	// Concurrency is how many duplicates the concurrent check sends at
	// once. Defaults to [DefaultConcurrency].
	Concurrency int
	// RequireKey checks that a request without a key is refused.
	RequireKey bool
	// ScopeHeader and Credentials: with two credentials (two values of
	// ScopeHeader, which defaults to Authorization), the scopes check sends
	// one key under each.
	ScopeHeader string
	Credentials []string
	// Client sends the requests. Defaults to a client with a 30 s timeout.
	Client *http.Client
	// Progress, when set, is called after each request with the count so far.
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
}

func (a answer) String() string {
	if a.err != nil {
		return "error: " + a.err.Error()
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
	plain    *http.Client // sees every answer as it is
	retrying *http.Client // idemclient: rides out 503s and 409 in-progress with the same key
	mu       sync.Mutex
	// stop is why the checks cannot go on after the first request.
	stop    error
	sent    int
	seen4xx int      // 4xx answers seen
	errs4xx []string // of those, the ones that were not problem+json
}

// Run runs every check against cfg.URL. An error means the checks could not
// run at all (bad config); a failing endpoint is a Report with failures.
func Run(ctx context.Context, cfg Config) (Report, error) {
	if cfg.URL == "" {
		return Report{}, errors.New("verify: no URL")
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
	if cfg.Concurrency <= 0 {
		cfg.Concurrency = DefaultConcurrency
	}
	cfg.ScopeHeader = cmpOr(cfg.ScopeHeader, "Authorization")
	if cfg.Header == nil {
		cfg.Header = http.Header{}
	}
	if cfg.Header.Get("Content-Type") == "" && json.Valid([]byte(cfg.Body)) {
		cfg.Header.Set("Content-Type", "application/json")
	}
	plain := cfg.Client
	if plain == nil {
		plain = &http.Client{Timeout: 30 * time.Second}
	}
	base := plain.Transport
	if base == nil {
		base = http.DefaultTransport
	}
	r := &runner{cfg: cfg, plain: plain,
		retrying: &http.Client{Timeout: plain.Timeout, Transport: idemclient.New(idemclient.Config{Base: base, MaxElapsed: 20 * time.Second})}}
	rep := Report{URL: cfg.URL}
	for _, check := range []func(context.Context) Check{r.replay, r.mismatch, r.concurrent, r.missingKey, r.malformed, r.scopes} {
		rep.Checks = append(rep.Checks, check(ctx))
		if r.stop != nil {
			return rep, r.stop
		}
	}
	switch {
	case len(r.errs4xx) > 0:
		rep.Checks = append(rep.Checks, Check{"problem-json", Fail, "not application/problem+json: " + strings.Join(r.errs4xx, "; ")})
	case r.seen4xx == 0:
		rep.Checks = append(rep.Checks, Check{"problem-json", Skip, "no 4xx answer was seen"})
	default:
		rep.Checks = append(rep.Checks, Check{"problem-json", Pass, fmt.Sprintf("all %d 4xx answers were application/problem+json", r.seen4xx)})
	}
	return rep, nil
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

// send makes one request: keys is nil for none, or the header values to send.
func (r *runner) send(ctx context.Context, c *http.Client, body string, keys []string, extra http.Header) answer {
	req, err := http.NewRequestWithContext(ctx, r.cfg.Method, r.cfg.URL, strings.NewReader(body))
	if err != nil {
		return answer{err: err}
	}
	req.Header = r.cfg.Header.Clone()
	for name, v := range extra {
		req.Header[name] = v
	}
	for _, k := range keys {
		req.Header.Add("Idempotency-Key", k)
	}
	resp, err := c.Do(req)
	r.mu.Lock()
	r.sent++
	sent := r.sent
	r.mu.Unlock()
	if r.cfg.Progress != nil {
		r.cfg.Progress(sent)
	}
	if err != nil {
		return answer{err: err}
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	a := answer{status: resp.StatusCode, header: resp.Header, body: b, err: err}
	if a.status >= 400 && a.status < 500 {
		r.mu.Lock()
		r.seen4xx++
		if !a.problemJSON() {
			r.errs4xx = append(r.errs4xx, fmt.Sprintf("%d (%s)", a.status, cmpOr(a.header.Get("Content-Type"), "no content type")))
		}
		r.mu.Unlock()
	}
	return a
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
		r.stop = fmt.Errorf("%w: %s: %v", ErrUnreachable, r.cfg.URL, first.err)
		c.Result, c.Detail = Fail, fmt.Sprintf("the first request failed (%s)", first)
		return c
	case first.status >= 400 && first.status < 500:
		r.stop = fmt.Errorf("%w: %s answered %d", ErrRefused, r.cfg.URL, first.status)
		c.Result, c.Detail = Fail, fmt.Sprintf("the first request was refused (%s)", first)
		return c
	case first.status >= 500:
		c.Result, c.Detail = Fail, fmt.Sprintf("the first request failed (%s)", first)
		return c
	}
	second := r.send(ctx, r.retrying, r.cfg.Body, []string{key}, nil)
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
	if first.err != nil || first.status >= 400 {
		c.Result, c.Detail = Fail, fmt.Sprintf("the first request failed (%s)", first)
		return c
	}
	other := r.send(ctx, r.retrying, r.cfg.ChangedBody, []string{key}, nil)
	if other.status == http.StatusUnprocessableEntity {
		c.Result, c.Detail = Pass, "the same key with another payload got 422"
	} else {
		c.Result, c.Detail = Fail, fmt.Sprintf("the same key with another payload got %s; want 422", other)
	}
	return c
}

func (r *runner) concurrent(ctx context.Context) Check {
	c := Check{Name: "concurrent-duplicates"}
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
	conflicts, replays, errs := 0, 0, 0
	for _, a := range answers {
		switch {
		case a.err != nil:
			errs++
		case a.status == http.StatusConflict:
			conflicts++
		default:
			if a.replayed() {
				replays++
			}
			outcomes[fmt.Sprintf("%d %s", a.status, a.body)]++
		}
	}
	// Once they are done, one more retry must replay the one outcome.
	final := r.send(ctx, r.retrying, r.cfg.Body, []string{key}, nil)
	only := ""
	for o := range outcomes {
		only = o
	}
	switch {
	case len(outcomes) > 1:
		c.Result, c.Detail = Fail, fmt.Sprintf("%d duplicates sent at once got %d different answers: it ran more than once", r.cfg.Concurrency, len(outcomes))
	case errs > 0:
		c.Result, c.Detail = Fail, fmt.Sprintf("%d of %d duplicates failed at the network level", errs, r.cfg.Concurrency)
	case final.err != nil || (only != "" && fmt.Sprintf("%d %s", final.status, final.body) != only):
		c.Result, c.Detail = Fail, fmt.Sprintf("after the duplicates, a retry got %s, not their outcome", final)
	default:
		c.Result, c.Detail = Pass, fmt.Sprintf("%d duplicates at once: one outcome (%d replayed it, %d got 409); a later retry replayed it", r.cfg.Concurrency, replays, conflicts)
	}
	return c
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
	a := r.send(ctx, r.retrying, r.cfg.Body, []string{key}, http.Header{http.CanonicalHeaderKey(h): {r.cfg.Credentials[0]}})
	if a.err != nil || a.status >= 400 {
		c.Result, c.Detail = Fail, fmt.Sprintf("the first credential's request failed (%s)", a)
		return c
	}
	// The other caller sends another payload under the same key: with one
	// key space per caller it simply runs; with a shared one it collides.
	b := r.send(ctx, r.retrying, r.cfg.ChangedBody, []string{key}, http.Header{http.CanonicalHeaderKey(h): {r.cfg.Credentials[1]}})
	switch {
	case b.err != nil:
		c.Result, c.Detail = Fail, "the second credential's request failed: "+b.err.Error()
	case b.status == http.StatusUnprocessableEntity:
		c.Result, c.Detail = Fail, "the same key from another credential collided with the first (422): keys are not scoped per caller"
	case b.replayed():
		c.Result, c.Detail = Fail, "the second credential was replayed the first one's answer: keys are not scoped per caller"
	case b.status >= 400 && b.status < 500:
		c.Result, c.Detail = Fail, fmt.Sprintf("the second credential's request, with the changed body, was refused (%s); give another request the endpoint accepts (--changed-body)", b)
	case b.status >= 400:
		c.Result, c.Detail = Fail, fmt.Sprintf("the second credential's request failed (%s)", b)
	default:
		c.Result, c.Detail = Pass, "the same key from two credentials ran as two requests"
	}
	return c
}
