package httpidem

import (
	"encoding/json"
	"net/http"
	"strconv"
	"time"
)

// ProblemBase prefixes every problem type; the fragment names the case and
// the document explains it.
const ProblemBase = "https://github.com/idemhq/idem/blob/main/docs/problems.md#"

// The problem types idem answers with, one per case, stable across versions
// (RFC 9457 "type").
const (
	ProblemKeyMissing        = ProblemBase + "key-missing"
	ProblemKeyInvalid        = ProblemBase + "key-invalid"
	ProblemRequestTooLarge   = ProblemBase + "request-too-large"
	ProblemRequestUnreadable = ProblemBase + "request-unreadable"
	ProblemPayloadMismatch   = ProblemBase + "payload-mismatch"
	ProblemInProgress        = ProblemBase + "in-progress"
	ProblemUncertain         = ProblemBase + "operation-uncertain"
	ProblemNotReplayable     = ProblemBase + "response-not-replayable"
	ProblemStoreUnavailable  = ProblemBase + "store-unavailable"
	// ProblemNotRun: the request's context ended (a deadline set before
	// the middleware, or the client went away) before it could run, and
	// no request with its key was known to be running: it did not run, and
	// a retry with the same key is answered as any request with it is.
	ProblemNotRun         = ProblemBase + "not-run"
	ProblemUpstreamFailed = ProblemBase + "upstream-failed"
	// ProblemUpstreamUncertain: (idem proxy) the upstream took a request
	// that idempotency did not cover (no key honoured: a bypassed route, a
	// method not covered, fail-open) and gave no answer. It may have run,
	// and a retry would run it again.
	ProblemUpstreamUncertain = ProblemBase + "upstream-uncertain"
	ProblemIdempotencyFailed = ProblemBase + "internal"
)

// HeaderShouldRetry says whether a client should send the request again
// (with the same key): "true" or "false", on every problem of idem's types.
// stripe-node, stripe-php and idemclient read it; stripe-go reads it only
// on answers below 400 and decides on the others by the "error" member (see
// [Problem]).
const HeaderShouldRetry = "Stripe-Should-Retry"

// kinds says, for each problem type, whether a retry can change the answer,
// and how a Stripe-style client names the final ones: the type and code of
// the "error" member that Stripe's SDKs turn into a typed error. A problem
// that asks for a retry has no "error" member, so that those SDKs retry it.
var kinds = map[string]struct {
	retry      bool
	stripeType string
	code       string
}{
	ProblemKeyMissing:        {false, "invalid_request_error", "idempotency_key_missing"},
	ProblemKeyInvalid:        {false, "invalid_request_error", "idempotency_key_invalid"},
	ProblemRequestTooLarge:   {false, "invalid_request_error", "request_too_large"},
	ProblemRequestUnreadable: {true, "", ""},
	ProblemPayloadMismatch:   {false, "idempotency_error", "idempotency_key_reused"},
	ProblemInProgress:        {true, "", ""},
	ProblemUncertain:         {false, "idempotency_error", "idempotency_outcome_unknown"},
	ProblemNotReplayable:     {false, "idempotency_error", "idempotency_response_not_replayable"},
	ProblemStoreUnavailable:  {true, "", ""},
	ProblemNotRun:            {true, "", ""},
	ProblemUpstreamFailed:    {true, "", ""},
	ProblemUpstreamUncertain: {false, "api_error", "upstream_outcome_unknown"},
	ProblemIdempotencyFailed: {false, "api_error", "idempotency_internal"},
}

// stripeError is the "error" member of a final problem, in the shape of
// Stripe's API errors.
type stripeError struct {
	Type    string `json:"type"`
	Code    string `json:"code"`
	Message string `json:"message"`
	DocURL  string `json:"doc_url"`
}

// Problem is an RFC 9457 problem detail. Written, one of idem's types says
// whether a retry may change the answer: a final one (a retry would get the
// same answer) carries a Stripe-compatible "error" member and
// Stripe-Should-Retry: false; one worth retrying carries
// Stripe-Should-Retry: true and no "error" member. A type of a handler's
// own gets neither (a client decides by its status), unless the handler set
// the header itself before Write.
type Problem struct {
	Type   string `json:"type"`
	Title  string `json:"title"`
	Status int    `json:"status"`
	Detail string `json:"detail,omitempty"`
	// Differs names the payload parts that differed (payload-mismatch).
	Differs []string `json:"differs,omitempty"`
	// OriginalStatus is the status of the response that could not be
	// replayed (response-not-replayable).
	OriginalStatus int `json:"original_status,omitempty"`
	// RetryAfter, when set, is also sent as the Retry-After header.
	RetryAfter time.Duration `json:"-"`
	// Error is the Stripe-compatible member, set by Write for final
	// problems.
	Error *stripeError `json:"error,omitempty"`
}

// Retry reports whether sending the request again, with the same key, may
// get another answer.
func (p *Problem) Retry() bool { return kinds[p.Type].retry }

// Write sends p as application/problem+json.
func (p *Problem) Write(w http.ResponseWriter) {
	k, known := kinds[p.Type]
	out := *p
	if known && !k.retry {
		msg := p.Title
		if p.Detail != "" {
			msg += ": " + p.Detail
		}
		out.Error = &stripeError{Type: k.stripeType, Code: k.code, Message: msg, DocURL: p.Type}
	}
	body, _ := json.Marshal(&out)
	body = append(body, '\n')
	h := w.Header()
	h.Set("Content-Type", "application/problem+json")
	h.Set("Content-Length", strconv.Itoa(len(body)))
	if known {
		h.Set(HeaderShouldRetry, strconv.FormatBool(k.retry))
	}
	if p.RetryAfter > 0 {
		h.Set("Retry-After", strconv.Itoa(int((p.RetryAfter+time.Second-1)/time.Second)))
	}
	w.WriteHeader(p.Status)
	w.Write(body)
}
