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
// total time, and stops when the request's context ends. It never retries a
// request without a key (nothing would make the retry safe), nor 400, 422,
// 409 operation-uncertain, or any other answer.
//
// It honours the RoundTripper contract: the caller's request is never
// modified (each attempt is a clone), the body is rewound with GetBody
// (or buffered once when there is none), and the bodies of responses it
// discards are drained and closed.
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

// RoundTrip implements [http.RoundTripper].
func (t *Transport) RoundTrip(req *http.Request) (*http.Response, error) {
	key := req.Header.Get("Idempotency-Key")
	if key == "" && !t.methods[req.Method] {
		return t.cfg.Base.RoundTrip(req) // no key, no retry
	}
	if key == "" {
		var err error
		if key, err = t.cfg.Key(); err != nil {
			return nil, fmt.Errorf("idemclient: making a key: %w", err)
		}
	}
	getBody := req.GetBody
	if req.Body != nil && req.Body != http.NoBody && getBody == nil {
		b, err := io.ReadAll(io.LimitReader(req.Body, t.cfg.MaxBody+1))
		req.Body.Close()
		if err != nil {
			return nil, fmt.Errorf("idemclient: reading the request body: %w", err)
		}
		if int64(len(b)) > t.cfg.MaxBody {
			return nil, ErrBodyTooLarge
		}
		getBody = func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(b)), nil }
	}
	ctx := req.Context()
	start := time.Now()
	for attempt := 1; ; attempt++ {
		out := req.Clone(ctx)
		out.Header.Set("Idempotency-Key", key)
		if getBody != nil {
			body, err := getBody()
			if err != nil {
				return nil, fmt.Errorf("idemclient: rewinding the request body: %w", err)
			}
			out.Body, out.GetBody = body, getBody
		}
		resp, err := t.cfg.Base.RoundTrip(out)
		if !retryable(resp, err) || ctx.Err() != nil || attempt >= t.cfg.MaxAttempts {
			return resp, err
		}
		wait := t.backoff(attempt, resp)
		if time.Since(start)+wait > t.cfg.MaxElapsed {
			return resp, err
		}
		if t.cfg.OnRetry != nil {
			t.cfg.OnRetry(attempt, resp, err, wait)
		}
		if resp != nil {
			io.Copy(io.Discard, io.LimitReader(resp.Body, 1<<16)) // drain, so the connection is reused
			resp.Body.Close()
		}
		timer := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			timer.Stop()
			return nil, ctx.Err()
		case <-timer.C:
		}
	}
}

// retryable reports whether an attempt's result may be retried with the
// same key.
//
// The server's Stripe-Should-Retry header decides when present (idem sends it
// on every problem; so do Stripe's API and APIs modelled on it); otherwise
// the status, and for a 409 the problem type, do.
func retryable(resp *http.Response, err error) bool {
	if err != nil {
		return !errors.Is(err, context.Canceled) && !errors.Is(err, context.DeadlineExceeded)
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
		return inProgress(resp)
	}
	return false
}

// inProgress reports whether a 409 says the first request is still running
// (worth a retry), rather than, say, operation-uncertain (not now).
func inProgress(resp *http.Response) bool {
	if mt, _, _ := mime.ParseMediaType(resp.Header.Get("Content-Type")); mt != "application/problem+json" {
		return resp.Header.Get("Retry-After") != ""
	}
	// Peek at the problem's type, keeping the body readable for the caller.
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<16))
	resp.Body.Close()
	resp.Body = io.NopCloser(bytes.NewReader(b))
	return bytes.Contains(b, []byte("in-progress"))
}

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
	if s, err := strconv.Atoi(v); err == nil && s >= 0 {
		return time.Duration(s) * time.Second
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
