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
// and what the "error" member says to a Stripe-style client. A final
// problem's is an object, the type and code of a Stripe API error, which
// Stripe's SDKs raise as a typed error without retrying. A problem that
// asks for a retry carries its code alone, a string, as an OAuth error
// does: stripe-go cannot decode a string into its *stripe.Error, so it
// retries the answer as it retries any error not from Stripe (and returns
// an error when it gives up), while stripe-node, which retries on
// Stripe-Should-Retry, raises it once its retries run out instead of
// resolving the call with the problem as if it were the object asked for
// (it raises only on an answer with an "error" member).
var kinds = map[string]struct {
	retry      bool
	stripeType string
	code       string
}{
	ProblemKeyMissing:        {false, "invalid_request_error", "idempotency_key_missing"},
	ProblemKeyInvalid:        {false, "invalid_request_error", "idempotency_key_invalid"},
	ProblemRequestTooLarge:   {false, "invalid_request_error", "request_too_large"},
	ProblemRequestUnreadable: {true, "", "request_unreadable"},
	ProblemPayloadMismatch:   {false, "idempotency_error", "idempotency_key_reused"},
	ProblemInProgress:        {true, "", "idempotency_key_in_use"},
	ProblemUncertain:         {false, "idempotency_error", "idempotency_outcome_unknown"},
	ProblemNotReplayable:     {false, "idempotency_error", "idempotency_response_not_replayable"},
	ProblemStoreUnavailable:  {true, "", "idempotency_store_unavailable"},
	ProblemNotRun:            {true, "", "request_not_run"},
	ProblemUpstreamFailed:    {true, "", "upstream_failed"},
	ProblemUpstreamUncertain: {false, "api_error", "upstream_outcome_unknown"},
	ProblemIdempotencyFailed: {false, "api_error", "idempotency_internal"},
}

// stripeError is the "error" member of one of idem's problems. Of a final
// problem (Type set) it is an object in the shape of Stripe's API errors;
// of a problem worth retrying (no Type) it is the code alone, a JSON
// string, in the shape of an OAuth error (see kinds). It decodes from
// either.
type stripeError struct {
	Type    string `json:"type"`
	Code    string `json:"code"`
	Message string `json:"message"`
	DocURL  string `json:"doc_url"`
}

// MarshalJSON writes e as an object if it has a type, and as its code, a
// string, if not.
func (e *stripeError) MarshalJSON() ([]byte, error) {
	if e.Type == "" {
		return json.Marshal(e.Code)
	}
	type object stripeError
	return json.Marshal((*object)(e))
}

// UnmarshalJSON reads either form MarshalJSON writes.
func (e *stripeError) UnmarshalJSON(b []byte) error {
	var code string
	if json.Unmarshal(b, &code) == nil {
		*e = stripeError{Code: code}
		return nil
	}
	type object stripeError
	return json.Unmarshal(b, (*object)(e))
}

// Problem is an RFC 9457 problem detail. Written, one of idem's types says
// whether a retry may change the answer: a final one (a retry would get the
// same answer) carries a Stripe-compatible "error" member, an object, and
// Stripe-Should-Retry: false; one worth retrying carries
// Stripe-Should-Retry: true and an "error" member that is its code alone, a
// string, with the message in "error_description" (the shape of an OAuth
// error), so that stripe-go and stripe-node retry it and, once they give
// up, return or raise an error rather than the problem as a result (see
// kinds). A type of a handler's own gets neither (a client decides by its
// status), unless the handler set the header itself before Write.
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
	// Error is the member for Stripe's SDKs, set by Write on every problem
	// of idem's types: on a final one an object (type, code, message,
	// doc_url), on one worth retrying the code alone, a string.
	Error *stripeError `json:"error,omitempty"`
	// ErrorDescription is the message that goes with a string Error (a
	// problem worth retrying), where an OAuth error has it: set by Write.
	ErrorDescription string `json:"error_description,omitempty"`
}

// Retry reports whether sending the request again, with the same key, may
// get another answer.
func (p *Problem) Retry() bool { return kinds[p.Type].retry }

// Write sends p as application/problem+json.
func (p *Problem) Write(w http.ResponseWriter) {
	k, known := kinds[p.Type]
	out := *p
	if known {
		msg := p.Title
		if p.Detail != "" {
			msg += ": " + p.Detail
		}
		if k.retry {
			out.Error, out.ErrorDescription = &stripeError{Code: k.code}, msg
		} else {
			out.Error = &stripeError{Type: k.stripeType, Code: k.code, Message: msg, DocURL: p.Type}
		}
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
