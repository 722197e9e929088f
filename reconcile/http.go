package reconcile

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/redact"
)

// HTTPResolver asks a web service what happened to a record, so that an API
// in any language (behind `idem proxy`) can answer for its own side effects.
// It POSTs the record as JSON:
//
//	{"scope": "…", "key": "…", "state": "unknown", "fence": 1,
//	 "created": "2026-11-30T18:00:00Z", "lease_expires": "…",
//	 "checkpoints": [{"name": "authorize", "data": "<base64>", "at": "…"}]}
//
// and expects 200 with
//
//	{"outcome": "completed", "status": 201, "header": {"Content-Type": ["application/json"]}, "body": "…"}
//
// where outcome is "completed" (status, header and body are what retries
// will replay), "failed" (nothing happened: the key is released) or
// "unknown" (ask again later).
type HTTPResolver struct {
	// URL receives the POSTs. Required.
	URL string
	// Client makes the requests. Defaults to a client with a 10 s timeout.
	Client *http.Client
}

type httpRecord struct {
	Scope        string            `json:"scope"`
	Key          string            `json:"key"`
	State        idem.State        `json:"state"`
	Fence        int64             `json:"fence"`
	Created      time.Time         `json:"created"`
	LeaseExpires time.Time         `json:"lease_expires"`
	Checkpoints  []idem.Checkpoint `json:"checkpoints"`
}

type httpAnswer struct {
	Outcome string              `json:"outcome"`
	Status  int                 `json:"status"`
	Header  map[string][]string `json:"header"`
	Body    string              `json:"body"`
}

var defaultHTTPClient = &http.Client{Timeout: 10 * time.Second}

// Resolve implements [Resolver].
func (h HTTPResolver) Resolve(ctx context.Context, rec idem.Record) (Resolution, error) {
	body, err := json.Marshal(httpRecord{Scope: rec.Scope, Key: rec.Key, State: rec.State, Fence: rec.Fence,
		Created: rec.Created, LeaseExpires: rec.LeaseExpires, Checkpoints: rec.Checkpoints})
	if err != nil {
		return Resolution{}, err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, h.URL, bytes.NewReader(body))
	if err != nil {
		return Resolution{}, fmt.Errorf("%w: reconcile: the resolver URL does not parse", idem.ErrInvalid) // its error would show it whole
	}
	req.Header.Set("Content-Type", "application/json")
	client := h.Client
	if client == nil {
		client = defaultHTTPClient
	}
	resp, err := client.Do(req)
	if err != nil {
		return Resolution{}, fmt.Errorf("reconcile: asking %s: %w", h.where(), redact.Err(err)) // its error names the URL whole
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(io.LimitReader(resp.Body, 16<<20))
	if err != nil {
		return Resolution{}, fmt.Errorf("reconcile: reading %s: %w", h.where(), err)
	}
	if resp.StatusCode != http.StatusOK {
		return Resolution{}, fmt.Errorf("reconcile: %s answered %d", h.where(), resp.StatusCode)
	}
	var a httpAnswer
	if err := json.Unmarshal(raw, &a); err != nil {
		return Resolution{}, fmt.Errorf("reconcile: %s answered something that is not a resolution: %w", h.where(), err)
	}
	switch a.Outcome {
	case "completed":
		if a.Status < 100 || a.Status > 999 {
			return Resolution{}, fmt.Errorf("reconcile: %s said completed with status %d", h.where(), a.Status)
		}
		return Resolution{Outcome: Completed, Response: &idem.Response{Status: a.Status, Header: a.Header, Body: []byte(a.Body)}}, nil
	case "failed":
		return Resolution{Outcome: Failed}, nil
	case "unknown":
		return Resolution{Outcome: StillUnknown}, nil
	}
	return Resolution{}, fmt.Errorf("reconcile: %s answered outcome %q; want completed, failed or unknown", h.where(), a.Outcome)
}

// where names the resolver in errors, which are logged: its URL without a
// password or a secret option.
func (h HTTPResolver) where() string { return redact.URL(h.URL) }
