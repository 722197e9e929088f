package store

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"sync"
)

// Notifier wakes callers waiting for a record to be settled, across
// instances (PostgreSQL LISTEN/NOTIFY, Redis pub/sub). The engine always
// wakes waiters in its own process; a Notifier adds the others. Delivery may
// be lost and wake-ups may be spurious: a value on the channel only means
// "look again", and waiters also poll, so a Notifier only makes them faster.
// The caller that made a Notifier owns it and closes it; the engine does not.
//
// With a Notifier, every settled record costs one more store round trip,
// made in the background off the request's path.
type Notifier interface {
	// Subscribe returns a channel that receives a value after a later
	// Notify for scope and key, and a function that ends the subscription.
	// It must never block a Notify.
	Subscribe(scope, key string) (ch <-chan struct{}, cancel func())
	// Notify tells every subscriber of scope and key, in every process,
	// that the record was settled.
	Notify(ctx context.Context, scope, key string) error
}

// KeyHash names a record without revealing its key: the hex of the first 16
// bytes of SHA-256(scope, NUL, key). Keys are client data, so every component
// logs this instead, as key_hash (one record can be followed across the
// middleware, the journal, the reconciler and the CLI), and Notifiers send it,
// since a notification may be seen by every listener on a shared channel.
func KeyHash(scope, key string) string {
	var buf [128]byte // on the stack unless the key is long
	sum := sha256.Sum256(append(append(append(buf[:0], scope...), 0), key...))
	var out [32]byte
	hex.Encode(out[:], sum[:16])
	return string(out[:])
}

// Waiters is a registry of channels waiting for records to be settled, by
// [KeyHash], for [Notifier] implementations. Waking never blocks: each
// channel holds at most one pending wake-up. The zero value is ready to use.
type Waiters struct {
	mu sync.Mutex
	m  map[string]map[chan struct{}]struct{}
}

// Add subscribes a new channel to id and returns it with the function that
// unsubscribes it.
func (w *Waiters) Add(id string) (<-chan struct{}, func()) {
	ch := make(chan struct{}, 1)
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.m == nil {
		w.m = map[string]map[chan struct{}]struct{}{}
	}
	if w.m[id] == nil {
		w.m[id] = map[chan struct{}]struct{}{}
	}
	w.m[id][ch] = struct{}{}
	return ch, func() {
		w.mu.Lock()
		defer w.mu.Unlock()
		delete(w.m[id], ch)
		if len(w.m[id]) == 0 {
			delete(w.m, id)
		}
	}
}

// Len reports how many channels are subscribed to id.
func (w *Waiters) Len(id string) int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return len(w.m[id])
}

// Wake wakes the channels subscribed to id.
func (w *Waiters) Wake(id string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	for ch := range w.m[id] {
		poke(ch)
	}
}

// WakeAll wakes every subscribed channel, as after a lost connection, when
// notifications may have been missed.
func (w *Waiters) WakeAll() {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, chans := range w.m {
		for ch := range chans {
			poke(ch)
		}
	}
}

// poke puts a value in ch unless one is already waiting there.
func poke(ch chan struct{}) {
	select {
	case ch <- struct{}{}:
	default:
	}
}
