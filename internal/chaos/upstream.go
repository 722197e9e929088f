package chaos

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	mrand "math/rand/v2"
	"net/http"
	"strings"
	"sync"
	"time"
)

// execution is one run of a request at the upstream: a side effect.
type execution struct {
	ID     int64
	Method string
	Path   string
	Status int
	Body   []byte // the response it sent
}

// upstream is the API behind the proxies: it numbers every request it runs
// (each one is a side effect, a charge), remembers what it answered, and
// answers the reconciler's question "what became of key K?" from that.
type upstream struct {
	mu    sync.Mutex
	next  int64
	runs  map[string][]execution // by idempotency key
	slow  float64                // probability of a slow request
	delay time.Duration          // how slow
}

func newUpstream(slow float64, delay time.Duration) *upstream {
	return &upstream{runs: map[string][]execution{}, slow: slow, delay: delay}
}

// answer is the body of every response: enough to tell which execution a
// client was told about.
type answer struct {
	Key     string `json:"key"`
	Exec    int64  `json:"exec"`
	Method  string `json:"method"`
	BodySHA string `json:"body_sha256"`
}

func (u *upstream) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path == "/resolve" {
		u.resolve(w, r)
		return
	}
	key := r.Header.Get("Idempotency-Key")
	body, err := io.ReadAll(r.Body)
	if err != nil {
		return // the proxy went away mid-request: nothing ran
	}
	if mrand.Float64() < u.slow {
		time.Sleep(u.delay)
	} else {
		time.Sleep(time.Duration(mrand.IntN(3000)) * time.Microsecond)
	}
	sum := sha256.Sum256(body)
	status := http.StatusCreated
	if strings.HasSuffix(key, "7") { // some charges are declined: an outcome like any other
		status = http.StatusPaymentRequired
	}
	u.mu.Lock()
	u.next++
	a := answer{Key: key, Exec: u.next, Method: r.Method, BodySHA: hex.EncodeToString(sum[:])}
	out, _ := json.Marshal(a)
	u.runs[key] = append(u.runs[key], execution{ID: a.Exec, Method: r.Method, Path: r.URL.Path, Status: status, Body: out})
	u.mu.Unlock()
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	w.Write(out)
}

// resolve answers the reconciler (reconcile.HTTPResolver's protocol): a key
// that ran is completed with what it answered; one that never ran failed.
func (u *upstream) resolve(w http.ResponseWriter, r *http.Request) {
	var rec struct {
		Key string `json:"key"`
	}
	if err := json.NewDecoder(r.Body).Decode(&rec); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	u.mu.Lock()
	runs := u.runs[rec.Key]
	u.mu.Unlock()
	w.Header().Set("Content-Type", "application/json")
	if len(runs) == 0 {
		fmt.Fprint(w, `{"outcome":"failed"}`)
		return
	}
	first := runs[0]
	json.NewEncoder(w).Encode(map[string]any{"outcome": "completed", "status": first.Status,
		"header": map[string][]string{"Content-Type": {"application/json"}}, "body": string(first.Body)})
}

// executions returns the runs of key.
func (u *upstream) executions(key string) []execution {
	u.mu.Lock()
	defer u.mu.Unlock()
	return append([]execution(nil), u.runs[key]...)
}

// total is the number of executions in all.
func (u *upstream) total() int64 {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.next
}
