package payments

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"sync"
	"time"
)

// Faults make the simulated acquirer fail the way real ones do. Rates are
// fractions of authorizations, drawn independently.
type Faults struct {
	// Latency is added to every authorization, before it charges. A caller
	// that is gone before then (its timeout ran out) gets nothing charged,
	// as if the connection had been reset: an authorization its caller gave
	// up on never charges later, after the reconciler has asked about it
	// and settled it FAILED, which a retry would then charge again.
	Latency Duration `json:"latency"`
	// Decline is the share of authorizations declined (an answer, not a fault).
	Decline float64 `json:"decline"`
	// Unavailable answers 503 before charging: nothing happened.
	Unavailable float64 `json:"unavailable"`
	// ResetBefore drops the connection before charging: nothing happened,
	// but the caller cannot tell.
	ResetBefore float64 `json:"reset_before"`
	// LostReply charges the card and then drops the connection: the effect
	// happened and the caller never hears of it.
	LostReply float64 `json:"lost_reply"`
}

// Duration is a time.Duration that JSON spells as Go does: "2ms", "1.5s".
type Duration time.Duration

// MarshalJSON implements json.Marshaler.
func (d Duration) MarshalJSON() ([]byte, error) { return json.Marshal(time.Duration(d).String()) }

// UnmarshalJSON implements json.Unmarshaler.
func (d *Duration) UnmarshalJSON(b []byte) error {
	var s string
	v, err := time.Duration(0), json.Unmarshal(b, &s)
	if err == nil {
		v, err = time.ParseDuration(s)
	}
	if err != nil || v < 0 {
		return fmt.Errorf("%s is not a duration such as \"2ms\" or \"1.5s\"", b)
	}
	*d = Duration(v)
	return nil
}

// check reports a fault rate that is not a fraction.
func (f Faults) check() error {
	for name, rate := range map[string]float64{"decline": f.Decline, "unavailable": f.Unavailable, "reset_before": f.ResetBefore, "lost_reply": f.LostReply} {
		if rate < 0 || rate > 1 {
			return fmt.Errorf("%s %v: want a fraction from 0 to 1", name, rate)
		}
	}
	return nil
}

// Payment is an authorization the acquirer made.
type Payment struct {
	ID        string `json:"id"`
	Key       string `json:"key"`       // the caller's idempotency key (downstream key)
	Reference string `json:"reference"` // the caller's own reference, for audits
	Amount    int64  `json:"amount"`
	Currency  string `json:"currency"`
	Customer  string `json:"customer"`
	Status    string `json:"status"` // approved or declined
}

// AuthorizeRequest is the body of POST /authorize.
type AuthorizeRequest struct {
	Key       string `json:"key"`
	Reference string `json:"reference"`
	Amount    int64  `json:"amount"`
	Currency  string `json:"currency"`
	Customer  string `json:"customer"`
}

// AcquirerStats counts what the acquirer saw and did.
type AcquirerStats struct {
	Requests       int `json:"requests"`
	Charges        int `json:"charges"`
	Approved       int `json:"approved"`
	Unavailable    int `json:"unavailable"`
	ResetsBefore   int `json:"resets_before"`
	LostReplies    int `json:"lost_replies"`
	DuplicateKeys  int `json:"duplicate_keys"`  // authorizations for a key already charged
	ReplayedByKeys int `json:"replayed_by_key"` // of those, answered from the first (Dedupe)
	Abandoned      int `json:"abandoned"`       // authorizations whose caller was gone before the charge: nothing charged
}

// Acquirer is a simulated card acquirer: POST /authorize charges, GET
// /payments/{key} looks a charge up by the caller's idempotency key, PUT
// /faults switches faults on and off, GET /stats counts.
//
// With Dedupe (what real acquirers do), a second authorization with a key
// already charged returns the first charge. Without it, every authorization
// that reaches it charges again — which is how the chaos test shows that
// idem alone never sends a charge twice. An authorization whose caller is
// gone before it charges (see [Faults.Latency]) charges nothing.
type Acquirer struct {
	mu       sync.Mutex
	faults   Faults
	dedupe   bool
	byKey    map[string][]*Payment
	stats    AcquirerStats
	rand     *rand.Rand
	sequence int
}

// NewAcquirer returns an acquirer with no faults.
func NewAcquirer(dedupe bool, seed uint64) *Acquirer {
	return &Acquirer{dedupe: dedupe, byKey: map[string][]*Payment{}, rand: rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))}
}

// SetFaults replaces the faults.
func (a *Acquirer) SetFaults(f Faults) {
	a.mu.Lock()
	a.faults = f
	a.mu.Unlock()
}

// Stats returns the counts so far.
func (a *Acquirer) Stats() AcquirerStats {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.stats
}

// Charges returns every charge made under key (more than one only without
// Dedupe, and only if a caller sent the same authorization twice).
func (a *Acquirer) Charges(key string) []Payment {
	a.mu.Lock()
	defer a.mu.Unlock()
	var out []Payment
	for _, p := range a.byKey[key] {
		out = append(out, *p)
	}
	return out
}

// AllCharges returns every charge, by key.
func (a *Acquirer) AllCharges() map[string][]Payment {
	a.mu.Lock()
	defer a.mu.Unlock()
	out := map[string][]Payment{}
	for k, ps := range a.byKey {
		for _, p := range ps {
			out[k] = append(out[k], *p)
		}
	}
	return out
}

// ServeHTTP implements the acquirer's API.
func (a *Acquirer) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	switch {
	case r.Method == http.MethodPost && r.URL.Path == "/authorize":
		a.authorize(w, r)
	case r.Method == http.MethodGet && len(r.URL.Path) > len("/payments/") && r.URL.Path[:len("/payments/")] == "/payments/":
		ps := a.Charges(r.URL.Path[len("/payments/"):])
		if len(ps) == 0 {
			http.Error(w, `{"error":"no such payment"}`, http.StatusNotFound)
			return
		}
		writeJSON(w, http.StatusOK, ps[0])
	case r.Method == http.MethodPut && r.URL.Path == "/faults":
		var f Faults // every fault the body leaves out is off
		dec := json.NewDecoder(io.LimitReader(r.Body, 1<<16))
		dec.DisallowUnknownFields()
		err := dec.Decode(&f)
		if err == nil {
			err = f.check()
		}
		if err != nil {
			writeJSON(w, http.StatusBadRequest, map[string]string{"error": "faults: " + err.Error() +
				`; send {"latency":"2ms","decline":0.1,"unavailable":0.05,"reset_before":0.05,"lost_reply":0.05}`})
			return
		}
		a.SetFaults(f)
		writeJSON(w, http.StatusOK, f)
	case r.Method == http.MethodGet && r.URL.Path == "/faults":
		a.mu.Lock()
		f := a.faults
		a.mu.Unlock()
		writeJSON(w, http.StatusOK, f)
	case r.Method == http.MethodGet && r.URL.Path == "/stats":
		writeJSON(w, http.StatusOK, a.Stats())
	default:
		http.NotFound(w, r)
	}
}

func (a *Acquirer) authorize(w http.ResponseWriter, r *http.Request) {
	var req AuthorizeRequest
	body, _ := io.ReadAll(io.LimitReader(r.Body, 1<<16))
	if err := json.Unmarshal(body, &req); err != nil || req.Key == "" || req.Amount <= 0 {
		http.Error(w, `{"error":"bad authorization"}`, http.StatusBadRequest)
		return
	}
	a.mu.Lock()
	f := a.faults
	a.stats.Requests++
	roll := func(rate float64) bool { return rate > 0 && a.rand.Float64() < rate }
	unavailable, resetBefore, lostReply, decline := roll(f.Unavailable), roll(f.ResetBefore), roll(f.LostReply), roll(f.Decline)
	a.mu.Unlock()

	if !a.wait(r.Context(), time.Duration(f.Latency)) {
		return
	}
	switch {
	case unavailable:
		a.count(func(s *AcquirerStats) { s.Unavailable++ })
		http.Error(w, `{"error":"try again"}`, http.StatusServiceUnavailable)
		return
	case resetBefore:
		a.count(func(s *AcquirerStats) { s.ResetsBefore++ })
		drop(w)
		return
	}

	a.mu.Lock()
	if r.Context().Err() != nil { // the caller is gone: nothing is charged
		a.stats.Abandoned++
		a.mu.Unlock()
		return
	}
	var p *Payment
	if prior := a.byKey[req.Key]; len(prior) > 0 {
		a.stats.DuplicateKeys++
		if a.dedupe {
			a.stats.ReplayedByKeys++
			p = prior[0]
		}
	}
	if p == nil {
		a.sequence++
		p = &Payment{ID: fmt.Sprintf("pay_%06d", a.sequence), Key: req.Key, Reference: req.Reference, Amount: req.Amount,
			Currency: req.Currency, Customer: req.Customer, Status: "approved"}
		if decline {
			p.Status = "declined"
		} else {
			a.stats.Approved++
		}
		a.byKey[req.Key] = append(a.byKey[req.Key], p)
		a.stats.Charges++
	}
	answer := *p
	if lostReply {
		a.stats.LostReplies++
	}
	a.mu.Unlock()
	if lostReply {
		drop(w)
		return
	}
	writeJSON(w, http.StatusOK, answer)
}

// wait is the latency d, cut short by a caller that goes away: false, and
// counted as abandoned, when it did.
func (a *Acquirer) wait(ctx context.Context, d time.Duration) bool {
	if d > 0 {
		t := time.NewTimer(d)
		defer t.Stop()
		select {
		case <-t.C:
		case <-ctx.Done():
		}
	}
	if ctx.Err() != nil {
		a.count(func(s *AcquirerStats) { s.Abandoned++ })
		return false
	}
	return true
}

func (a *Acquirer) count(f func(*AcquirerStats)) {
	a.mu.Lock()
	f(&a.stats)
	a.mu.Unlock()
}

// drop closes the connection without an answer.
func drop(w http.ResponseWriter) {
	if conn, _, err := http.NewResponseController(w).Hijack(); err == nil {
		conn.Close()
		return
	}
	panic(http.ErrAbortHandler)
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	json.NewEncoder(w).Encode(v)
}
