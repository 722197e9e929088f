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
	ProblemIdempotencyFailed = ProblemBase + "internal"
)

// Problem is an RFC 9457 problem detail.
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
}

// Write sends p as application/problem+json.
func (p *Problem) Write(w http.ResponseWriter) {
	body, _ := json.Marshal(p)
	h := w.Header()
	h.Set("Content-Type", "application/problem+json")
	h.Set("Content-Length", strconv.Itoa(len(body)))
	if p.RetryAfter > 0 {
		h.Set("Retry-After", strconv.Itoa(int((p.RetryAfter+time.Second-1)/time.Second)))
	}
	w.WriteHeader(p.Status)
	w.Write(body)
}
