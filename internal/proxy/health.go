package proxy

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/store"
)

// Health watches the store: whether it answers, what a crash of its server
// would cost, and whether the server restarted since the last look. /readyz
// reports it; changes are logged as they are seen.
type Health struct {
	eng   *idem.Engine
	store idem.Store // as opened: what it says of its durability
	kind  string
	log   *slog.Logger

	stopping atomic.Bool // the process is shutting down: not ready, whatever the store says

	mu     sync.Mutex
	status HealthStatus
	seen   bool // a check has reached the store
}

// HealthStatus is what a health check found.
type HealthStatus struct {
	// Store is the store's kind (postgres, redis, …).
	Store string
	// Reachable is true when the store answered the last check.
	Reachable bool
	// Err is why it did not.
	Err string
	// Durability is what the store last said of its server, when Known.
	Durability store.Durability
	Known      bool
	// Restarts counts the server restarts seen (its instance changed).
	Restarts int
	// Pending counts outcomes waiting in the journal for the store.
	Pending int
	// Stopping is true once the process is shutting down: it is not ready
	// for new requests, whatever the store says.
	Stopping bool
}

// Ready reports whether /readyz answers 200: the store answered its last
// check, and the process is not shutting down.
func (s HealthStatus) Ready() bool { return s.Reachable && !s.Stopping }

// SetStopping marks the process as shutting down: from now on /readyz
// answers 503 at once, without asking the store, so that probes see a
// draining process as not ready. (The proxied listener stops accepting at
// the same moment: a load balancer must stop sending before the signal, as
// Kubernetes' preStop hook lets it.) A nil Health does nothing.
func (h *Health) SetStopping() {
	if h != nil {
		h.stopping.Store(true)
	}
}

// Stopping reports whether SetStopping was called.
func (h *Health) Stopping() bool { return h != nil && h.stopping.Load() }

// NewHealth watches store (as opened, so that it can report durability)
// through eng.
func NewHealth(eng *idem.Engine, store idem.Store, kind string, log *slog.Logger) *Health {
	return &Health{eng: eng, store: store, kind: kind, log: log, status: HealthStatus{Store: kind}}
}

// readinessKey is the key /readyz looks up: a read that finds nothing.
const readinessKey = "idem-readiness-probe"

// Check looks at the store once and returns what it found, logging what
// changed: the store becoming unreachable or reachable again, its
// durability, and a restart of its server.
func (h *Health) Check(ctx context.Context) HealthStatus {
	_, err := h.eng.Get(ctx, "", readinessKey)
	reachable := err == nil || errors.Is(err, idem.ErrNotFound)
	var d store.Durability
	known := false
	if r, ok := h.store.(store.DurabilityReporter); ok && reachable {
		var derr error
		if d, derr = r.Durability(ctx); derr == nil {
			known = true
		} else if errors.Is(derr, idem.ErrUnavailable) {
			reachable, err = false, derr
		}
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	prev := h.status
	st := HealthStatus{Store: h.kind, Reachable: reachable, Durability: prev.Durability, Known: prev.Known,
		Restarts: prev.Restarts, Pending: h.eng.Pending()}
	if !reachable {
		st.Err = err.Error()
		if prev.Reachable || !h.seen {
			h.log.Error("the store cannot be reached: requests fail closed (503) until it answers", "store", h.kind, "err", err)
		}
	} else if !prev.Reachable && h.seen {
		h.log.Info("the store answers again", "store", h.kind, "journal_pending", st.Pending)
	}
	if known {
		switch {
		case !prev.Known:
			h.logDurability(d)
		case d.Instance != "" && prev.Durability.Instance != "" && d.Instance != prev.Durability.Instance:
			st.Restarts++
			if d.CrashSafe {
				h.log.Warn("the store's server restarted or failed over", "store", h.kind, "durability", d.Detail)
			} else {
				h.log.Error("THE STORE'S SERVER RESTARTED OR FAILED OVER, AND IT DOES NOT KEEP ITS RECORDS ACROSS THAT: "+
					"records written before are lost, and retries of those requests will run again", "store", h.kind, "durability", d.Detail)
			}
		case d.CrashSafe != prev.Durability.CrashSafe || d.Detail != prev.Durability.Detail:
			h.logDurability(d)
		}
		st.Durability, st.Known = d, true
	}
	h.seen = h.seen || reachable
	h.status = st
	st.Stopping = h.stopping.Load()
	return st
}

func (h *Health) logDurability(d store.Durability) {
	if d.CrashSafe {
		h.log.Info("store durability: a crash of the store loses nothing it acknowledged", "store", h.kind, "durability", d.Detail)
		return
	}
	h.log.Warn("store durability: a crash of the store loses records, and retries of the requests they recorded run again",
		"store", h.kind, "durability", d.Detail)
}

// Status returns what the last check found.
func (h *Health) Status() HealthStatus {
	h.mu.Lock()
	defer h.mu.Unlock()
	st := h.status
	st.Pending = h.eng.Pending()
	st.Stopping = h.stopping.Load()
	return st
}

// Start checks now and then every interval until ctx ends.
func (h *Health) Start(ctx context.Context, every time.Duration) {
	go func() {
		for {
			check, cancel := context.WithTimeout(ctx, min(every, 5*time.Second))
			h.Check(check)
			cancel()
			select {
			case <-ctx.Done():
				return
			case <-time.After(every):
			}
		}
	}()
}

// String is the /readyz text.
func (s HealthStatus) String() string {
	var b strings.Builder
	if s.Stopping {
		b.WriteString("not ready\nstopping: shutting down, letting in-flight requests finish\n")
		if s.Reachable {
			fmt.Fprintf(&b, "store: %s, answering\n", s.Store)
		} else {
			fmt.Fprintf(&b, "store: %s, not answering: %s\n", s.Store, s.Err)
		}
	} else if s.Reachable {
		fmt.Fprintf(&b, "ready\nstore: %s, answering\n", s.Store)
	} else {
		fmt.Fprintf(&b, "not ready\nstore: %s, not answering: %s\n", s.Store, s.Err)
	}
	switch {
	case !s.Known:
		b.WriteString("durability: not known yet\n")
	case s.Durability.CrashSafe:
		fmt.Fprintf(&b, "durability: crash-safe (%s)\n", s.Durability.Detail)
	default:
		fmt.Fprintf(&b, "durability: NOT crash-safe (%s)\n", s.Durability.Detail)
	}
	fmt.Fprintf(&b, "restarts seen: %d\njournal: %d outcome(s) waiting for the store\n", s.Restarts, s.Pending)
	return b.String()
}
