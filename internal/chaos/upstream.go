package chaos

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	mrand "math/rand/v2"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"
)

// execution is one run of a request at the upstream: a side effect.
type execution struct {
	ID      int64
	Method  string
	Path    string
	BodySHA string // hex SHA-256 of the request body as the upstream read it
	Status  int
	Body    []byte // the response it sent
}

// upstream is the API behind the proxies: it numbers every request it runs
// (each one is a side effect, a charge), remembers what it answered, and
// answers the reconciler's question "what became of key K?" from that.
//
// It also counts the connections open to it (track), so that the suite can
// wait until no request is running there before it counts the executions: a
// request a proxy sent just before it stopped is recorded only once its
// delay is over.
type upstream struct {
	mu      sync.Mutex
	next    int64
	runs    map[string][]execution // by idempotency key
	asked   map[string]bool        // keys the reconciler asked about
	open    int                    // connections open, from track
	changed chan struct{}          // closed, and replaced, whenever open changes
	slow    float64                // probability of a slow request
	delay   time.Duration          // how slow
	// hold, when set, is called by every execution before it is recorded:
	// tests hold one there to make it late.
	hold func()
}

func newUpstream(slow float64, delay time.Duration) *upstream {
	return &upstream{runs: map[string][]execution{}, asked: map[string]bool{}, changed: make(chan struct{}), slow: slow, delay: delay}
}

// track is the ConnState hook of the server the proxies reach the upstream
// through. A request runs within its connection, which the server closes
// only once the handler has returned: while none is open, none runs.
func (u *upstream) track(_ net.Conn, s http.ConnState) {
	u.mu.Lock()
	defer u.mu.Unlock()
	switch s {
	case http.StateNew:
		u.open++
	case http.StateClosed, http.StateHijacked:
		u.open--
	default:
		return
	}
	close(u.changed)
	u.changed = make(chan struct{})
}

// waitIdle waits up to d until no connection is open to the upstream, and
// reports whether that happened. Once nothing can connect any more (the
// proxies and the server's listener are closed), an idle upstream runs
// nothing more, and its executions can be counted.
func (u *upstream) waitIdle(d time.Duration) bool {
	timer := time.NewTimer(d)
	defer timer.Stop()
	for {
		u.mu.Lock()
		open, changed := u.open, u.changed
		u.mu.Unlock()
		if open == 0 {
			return true
		}
		select {
		case <-changed:
		case <-timer.C:
			return false
		}
	}
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
	if u.hold != nil {
		u.hold()
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
	u.runs[key] = append(u.runs[key], execution{ID: a.Exec, Method: r.Method, Path: r.URL.Path, BodySHA: a.BodySHA, Status: status, Body: out})
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
	u.asked[rec.Key] = true
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

// askedAbout reports whether the reconciler asked what became of key.
func (u *upstream) askedAbout(key string) bool {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.asked[key]
}

// total is the number of executions in all.
func (u *upstream) total() int64 {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.next
}
