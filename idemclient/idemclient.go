// Package idemclient is the caller's side of the idempotency contract: an
// [http.RoundTripper] that gives every POST, PUT, PATCH and DELETE an
// Idempotency-Key and retries it safely.
//
//	client := &http.Client{Transport: idemclient.New(idemclient.Config{})}
//	resp, err := client.Post(url, "application/json", body)
//
// Every attempt of one request carries the same key, so the server runs it
// once however often the network fails. It retries what the server's
// Stripe-Should-Retry header says to retry and, without one, network errors,
// 409 in-progress, 429, 502, 503 and 504, honouring Retry-After, with capped
// exponential backoff and full jitter, within a limit on attempts and on
// total time, and stops when the request's context ends (a transport's own
// timeouts, which end an attempt and not the request, are network errors).
// It never retries a request without a key (nothing would make the retry
// safe), an answer whose Idempotent-Ignored header says the server did not
// honour the key, a replay of the key's stored outcome (Idempotent-Replayed:
// every retry would get it again, whatever its status), nor 400, 422, 409
// operation-uncertain, or any other answer. When it gives
// up on a request it sent (attempts or time ran out on network errors or on
// answers that asked for a retry, or the request's context ended), its
// error is an [*Error] that carries the key, with which the request can be
// sent again without running it twice; a final answer is returned as it
// came. A
// caller's own key, in Idempotency-Key or X-Idempotency-Key, is kept as
// it is.
//
// It honours the RoundTripper contract: the caller's request is never
// modified (each attempt is a clone), the body is rewound with GetBody
// (or buffered once when there is none), and the bodies of responses it
// discards are drained (for a second at most) and closed.
package idemclient

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"math"
	mrand "math/rand/v2"
	"mime"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// Defaults for [Config].
const (
	DefaultMaxAttempts = 5
	DefaultMaxElapsed  = 30 * time.Second
	DefaultBaseDelay   = 100 * time.Millisecond
	DefaultMaxDelay    = 5 * time.Second
	// DefaultMaxBody is the largest body buffered to retry a request that
	// has no GetBody.
	DefaultMaxBody = 10 << 20
)

// DefaultMethods returns the methods that get a key when they have none.
func DefaultMethods() []string {
	return []string{http.MethodPost, http.MethodPut, http.MethodPatch, http.MethodDelete}
}

// Config configures a [Transport]. Zero values are defaults.
type Config struct {
	// Base sends each attempt. Defaults to http.DefaultTransport.
	Base http.RoundTripper
	// Key makes a new key. Defaults to [NewUUIDv4]: the client cannot know
	// whether the server scopes keys per caller, and a v4 key reveals
	// nothing. [NewUUIDv7] keeps time order, which B-tree stores like.
	Key func() (string, error)
	// Methods get a key when the request has none. Defaults to
	// [DefaultMethods]. A request of any method that already carries an
	// Idempotency-Key is retried too.
	Methods []string
	// MaxAttempts bounds the attempts per request, the first included.
	// Defaults to [DefaultMaxAttempts].
	MaxAttempts int
	// MaxElapsed bounds the time from the first attempt to the start of
	// the last. Defaults to [DefaultMaxElapsed].
	MaxElapsed time.Duration
	// BaseDelay and MaxDelay shape the backoff: attempt n waits a random
	// time up to min(MaxDelay, BaseDelay·2ⁿ), or the server's Retry-After
	// when that is longer (but never past MaxElapsed). Default to
	// [DefaultBaseDelay] and [DefaultMaxDelay].
	BaseDelay, MaxDelay time.Duration
	// MaxBody is the largest body buffered when a request has no GetBody.
	// Defaults to [DefaultMaxBody].
	MaxBody int64
	// OnRetry, when set, is called before each retry with the attempt that
	// failed (1 for the first), its response (nil on a network error) or
	// error, and the wait.
	OnRetry func(attempt int, resp *http.Response, err error, wait time.Duration)
}

// Transport is a retrying, key-adding [http.RoundTripper].
type Transport struct {
	cfg     Config
	methods map[string]bool
}

// New returns a Transport for cfg.
func New(cfg Config) *Transport {
	if cfg.Base == nil {
		cfg.Base = http.DefaultTransport
	}
	if cfg.Key == nil {
		cfg.Key = NewUUIDv4
	}
	if len(cfg.Methods) == 0 {
		cfg.Methods = DefaultMethods()
	}
	if cfg.MaxAttempts <= 0 {
		cfg.MaxAttempts = DefaultMaxAttempts
	}
	if cfg.MaxElapsed <= 0 {
		cfg.MaxElapsed = DefaultMaxElapsed
	}
	if cfg.BaseDelay <= 0 {
		cfg.BaseDelay = DefaultBaseDelay
	}
	if cfg.MaxDelay <= 0 {
		cfg.MaxDelay = DefaultMaxDelay
	}
	if cfg.MaxBody <= 0 {
		cfg.MaxBody = DefaultMaxBody
	}
	t := &Transport{cfg: cfg, methods: map[string]bool{}}
	for _, m := range cfg.Methods {
		t.methods[strings.ToUpper(m)] = true
	}
	return t
}

// ErrBodyTooLarge is returned for a request without GetBody whose body is
// over MaxBody: it cannot be retried safely, so it is not sent.
var ErrBodyTooLarge = errors.New("idemclient: request body too large to buffer for retries")

// Error is what RoundTrip returns when it gives up on a request it has
// sent at least once: attempts or time ran out on network errors or on
// answers that asked for a retry (a 503, a 409 in-progress…), or the
// request's context ended. The server may have run the request (an attempt
// whose answer was lost, or one still running); sending it again with Key
// (set as the request's Idempotency-Key) learns its outcome without running
// it twice, where a new key could run it again. Its message does not show
// the key.
type Error struct {
	// Key is the idempotency key every attempt carried.
	Key string
	// Attempts is how many attempts were sent.
	Attempts int
	// Status is the status of the last attempt's answer, which asked for
	// a retry; 0 when the last attempt got no answer.
	Status int
	// RetryAfter is that answer's Retry-After, when it had one: how long
	// the server asked to wait before sending the request again.
	RetryAfter time.Duration
	// Err is the last attempt's error, or the context's, or what its
	// answer was.
	Err error
}

func (e *Error) Error() string {
	return fmt.Sprintf("idemclient: gave up after %d attempt(s): %v", e.Attempts, e.Err)
}

// Unwrap returns e.Err.
func (e *Error) Unwrap() error { return e.Err }

// drainTimeout bounds the reading of an answer's body that is discarded.
const drainTimeout = time.Second

// RoundTrip implements [http.RoundTripper].
func (t *Transport) RoundTrip(req *http.Request) (*http.Response, error) {
	header, key := "Idempotency-Key", req.Header.Get("Idempotency-Key")
	if key == "" && req.Header.Get("X-Idempotency-Key") != "" {
		header, key = "X-Idempotency-Key", req.Header.Get("X-Idempotency-Key") // the caller's, under the name it chose
	}
	if key == "" && !t.methods[req.Method] {
		return t.cfg.Base.RoundTrip(req) // no key, no retry
	}
	if req.Body != nil {
		defer req.Body.Close() // each attempt sends a body of its own
	}
	if key == "" {
		var err error
		if key, err = t.cfg.Key(); err != nil {
			return nil, fmt.Errorf("idemclient: making a key: %w", err)
		}
	}
	ctx := req.Context()
	getBody := req.GetBody
	if req.Body != nil && req.Body != http.NoBody && getBody == nil {
		b, err := t.buffer(ctx, req.Body)
		if err != nil {
			return nil, err
		}
		getBody = func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(b)), nil }
	}
	start := time.Now()
	var last answered // the last answer, which asked for a retry
	for attempt := 1; ; attempt++ {
		out := req.Clone(ctx)
		out.Header.Set(header, key)
		if getBody != nil {
			body, err := getBody()
			if err != nil {
				return nil, t.gaveUp(key, attempt-1, last, fmt.Errorf("idemclient: rewinding the request body: %w", err))
			}
			out.Body, out.GetBody = body, getBody
		}
		resp, err := t.cfg.Base.RoundTrip(out)
		if !retryable(ctx, resp, err, start.Add(t.cfg.MaxElapsed)) {
			return resp, t.gaveUp(key, attempt, answered{}, err)
		}
		last = answered{}
		if resp != nil {
			last = answered{resp.StatusCode, retryAfter(resp.Header.Get("Retry-After"))}
		}
		var wait time.Duration
		stop := ctx.Err() != nil || attempt >= t.cfg.MaxAttempts
		if !stop {
			wait = t.backoff(attempt, resp)
			stop = wait > t.cfg.MaxElapsed-time.Since(start) // not a sum: a Retry-After may be near MaxInt64
		}
		if stop {
			if resp == nil {
				return nil, t.gaveUp(key, attempt, last, err)
			}
			// An answer that asks for a retry is not the request's
			// outcome: an earlier attempt may have run, or this one
			// still runs. Giving up on it is an error with the key.
			discard(resp.Body)
			return nil, t.gaveUp(key, attempt, last, fmt.Errorf("the server answered %s, asking for a retry", resp.Status))
		}
		if t.cfg.OnRetry != nil {
			t.cfg.OnRetry(attempt, resp, err, wait)
		}
		if resp != nil {
			discard(resp.Body)
		}
		timer := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			timer.Stop()
			return nil, t.gaveUp(key, attempt, last, ctx.Err())
		case <-timer.C:
		}
	}
}

// buffer reads body whole, MaxBody at most, until ctx ends: then it closes
// body (which unblocks a stalled Read of a pipe or a connection) and returns
// ctx's error, as the transport would for a body it could not send.
func (t *Transport) buffer(ctx context.Context, body io.ReadCloser) ([]byte, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	type read struct {
		b   []byte
		err error
	}
	done := make(chan read, 1)
	go func() {
		b, err := io.ReadAll(io.LimitReader(body, t.cfg.MaxBody+1))
		done <- read{b, err}
	}()
	select {
	case <-ctx.Done():
		body.Close()
		return nil, ctx.Err()
	case r := <-done:
		if r.err != nil {
			return nil, fmt.Errorf("idemclient: reading the request body: %w", r.err)
		}
		if int64(len(r.b)) > t.cfg.MaxBody {
			return nil, ErrBodyTooLarge
		}
		return r.b, nil
	}
}

// answered is the status and Retry-After of an answer that asked for a
// retry; zero for an attempt that got no answer.
type answered struct {
	status     int
	retryAfter time.Duration
}

// gaveUp is err, when not nil, as an [*Error] carrying the key and what
// the last attempt was answered.
func (t *Transport) gaveUp(key string, attempts int, last answered, err error) error {
	if err == nil || attempts == 0 {
		return err
	}
	return &Error{Key: key, Attempts: attempts, Status: last.status, RetryAfter: last.retryAfter, Err: err}
}

// discard drains (so that the connection is reused) and closes the body
// of an answer that is not returned, in at most drainTimeout.
func discard(body io.ReadCloser) {
	stop := time.AfterFunc(drainTimeout, func() { body.Close() }) // unblocks a stalled Read
	io.Copy(io.Discard, io.LimitReader(body, 1<<16))
	stop.Stop()
	body.Close()
}

// retryable reports whether an attempt's result may be retried with the
// same key.
//
// The server's Stripe-Should-Retry header decides when present (idem sends it
// on every problem; so do Stripe's API and APIs modelled on it); otherwise
// the status, and for a 409 the problem type, do.
func retryable(ctx context.Context, resp *http.Response, err error, deadline time.Time) bool {
	if err != nil {
		// Decided by the caller's context, not by the error: a transport's
		// own timeouts (ResponseHeaderTimeout, a dial's, a deadline a Base
		// gives each attempt) are context.DeadlineExceeded too, while the
		// caller still waits and a retry with the key is safe.
		return ctx.Err() == nil
	}
	if resp.Header.Get(headerIgnored) != "" {
		return false // the key was not honoured: the request ran without idempotency
	}
	if resp.Header.Get(headerReplayed) == "true" {
		return false // a stored outcome, which every retry would replay as it is
	}
	switch resp.Header.Get("Stripe-Should-Retry") {
	case "true":
		return true
	case "false":
		return false
	}
	switch resp.StatusCode {
	case http.StatusTooManyRequests, http.StatusBadGateway, http.StatusServiceUnavailable, http.StatusGatewayTimeout:
		return true
	case http.StatusConflict:
		return inProgress(resp, deadline)
	}
	return false
}

// headerIgnored is the header a server following the idempotency contract
// (idem does) sets on the answer to a request whose key it did not
// honour: the request ran without idempotency, and a retry would run it
// again.
const headerIgnored = "Idempotent-Ignored"

// headerReplayed is the header a server following the idempotency
// contract sets on a replay of the key's stored outcome, which never
// changes: whatever it says, retrying gets it again.
const headerReplayed = "Idempotent-Replayed"

// inProgress reports whether a 409 says the first request is still running
// (worth a retry), rather than, say, operation-uncertain (not now). It
// reads the start of the body (64 KiB at most: a problem's type comes
// first) until deadline, or for drainTimeout when deadline is nearer, and
// leaves the whole body readable for the caller.
func inProgress(resp *http.Response, deadline time.Time) bool {
	if mt, _, _ := mime.ParseMediaType(resp.Header.Get("Content-Type")); mt != "application/problem+json" {
		return resp.Header.Get("Retry-After") != ""
	}
	body := resp.Body
	stop := time.AfterFunc(max(time.Until(deadline), drainTimeout), func() { body.Close() }) // unblocks a stalled Read
	b, err := io.ReadAll(io.LimitReader(body, 1<<16))
	if !stop.Stop() && err == nil && len(b) == 1<<16 { // closed with more to come
		err = errors.New("idemclient: the answer's body took too long to read")
	}
	switch {
	case err != nil: // cut: what was read, then the error
		body.Close()
		resp.Body = io.NopCloser(io.MultiReader(bytes.NewReader(b), errReader{err}))
		return false
	case len(b) == 1<<16: // more may follow: the rest is the caller's to read
		resp.Body = struct {
			io.Reader
			io.Closer
		}{io.MultiReader(bytes.NewReader(b), body), body}
	default:
		body.Close()
		resp.Body = io.NopCloser(bytes.NewReader(b))
	}
	return bytes.Contains(b, []byte("in-progress"))
}

// errReader is a reader that fails with err.
type errReader struct{ err error }

func (r errReader) Read([]byte) (int, error) { return 0, r.err }

// backoff is the wait before the next attempt: full jitter under a capped
// exponential, or the server's Retry-After when longer.
func (t *Transport) backoff(attempt int, resp *http.Response) time.Duration {
	ceiling := t.cfg.MaxDelay
	if shift := min(max(attempt-1, 0), 62); t.cfg.BaseDelay <= ceiling>>shift { // BaseDelay·2^shift ≤ MaxDelay, without overflow
		ceiling = t.cfg.BaseDelay << shift
	}
	wait := time.Duration(mrand.Int64N(int64(ceiling) + 1))
	if resp != nil {
		if ra := retryAfter(resp.Header.Get("Retry-After")); ra > wait {
			wait = ra
		}
	}
	return wait
}

// retryAfter reads a Retry-After header: seconds or an HTTP date.
func retryAfter(v string) time.Duration {
	if v == "" {
		return 0
	}
	if s, err := strconv.ParseInt(v, 10, 64); err == nil && s >= 0 {
		return time.Duration(min(s, int64(math.MaxInt64/time.Second))) * time.Second // a longer wait than any MaxElapsed, not an overflow
	}
	if t, err := http.ParseTime(v); err == nil {
		return max(time.Until(t), 0)
	}
	return 0
}

// NewUUIDv4 returns a random (version 4) UUID.
func NewUUIDv4() (string, error) {
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", err
	}
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	return format(b), nil
}

// NewUUIDv7 returns a time-ordered (version 7) UUID: 48 bits of Unix
// milliseconds, then random bits.
func NewUUIDv7() (string, error) {
	var b [16]byte
	if _, err := rand.Read(b[6:]); err != nil {
		return "", err
	}
	var ms [8]byte
	binary.BigEndian.PutUint64(ms[:], uint64(time.Now().UnixMilli()))
	copy(b[:6], ms[2:])
	b[6] = b[6]&0x0f | 0x70
	b[8] = b[8]&0x3f | 0x80
	return format(b), nil
}

func format(b [16]byte) string {
	h := hex.EncodeToString(b[:])
	return h[:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:]
}
