// Package idem makes the side effect behind a request happen exactly once,
// however often a client retries it.
//
// A request carries an idempotency key. The [Engine] looks the key up under a
// scope (who is calling) in a [Store] and answers with a [Decision]: run the
// work now under a fenced [Lease], replay the stored [Response], refuse a
// different payload sent with the same key, report that the first attempt is
// still running, or report that its outcome is unknown. Every write after the
// lease is acquired is a compare-and-set on the lease token, so an owner whose
// lease was taken over can never overwrite the newer owner's outcome.
//
// The record's life is a small state machine:
//
//	(none) ──acquire──▶ IN_PROGRESS ──complete──▶ COMPLETED (replayed until it expires)
//	                      │      │
//	  release: nothing    │      └── lease expired or crash mid side effect
//	  happened            ▼                         ▼
//	                   FAILED (next retry runs)  UNKNOWN (resolved by the reconciler)
//
// An expired lease is not a free key: the previous owner may have performed the
// side effect, so the record becomes UNKNOWN. Only a caller that declares the
// work takeover-safe (all of its effects commit together with the record) lets a
// retry take over an expired lease.
//
// The engine's store calls are bounded ([Config.StoreTimeout]) and detached
// from the caller's cancellation; an answer lost on the way back is asked for
// again with the same lease token, which is safe; and an outcome the store
// cannot take is kept in a journal ([Config.JournalDir]) until it does, so an
// outcome a client was given is never lost to a store that was away.
//
// This package imports only the standard library. Stores live in their own
// packages under store/, and all of them pass the conformance suite in
// store/storetest.
package idem

import (
	"fmt"

	"github.com/idemhq/idem/store"
)

// The types of records and stores. They are defined in package store, which
// store implementations use; these names are the same types.
type (
	// Store keeps records; the stores are the packages under store/.
	Store = store.Store
	// Record is what a store keeps under one scope and key.
	Record = store.Record
	// State is where a record stands in its life.
	State = store.State
	// Response is the stored outcome of a request: what a replay sends back.
	Response = store.Response
	// Fingerprint identifies a request's payload without revealing it; see
	// [NewFingerprint].
	Fingerprint = store.Fingerprint
	// Checkpoint is a recovery point a handler recorded; see
	// [Engine.Checkpoint].
	Checkpoint = store.Checkpoint
	// Lease is the right to run the work for one record and to write its
	// outcome.
	Lease = store.Lease
	// FinishParams are what a store's transactional finish (pgstore's or
	// sqlitestore's FinishTx) is given by [Settlement.Commit].
	FinishParams = store.FinishParams
	// ScanResult is one page of records; see [Engine.Scan] and [Engine.List].
	ScanResult = store.ScanResult
	// ListParams filters the records [Engine.List] returns.
	ListParams = store.ListParams
	// Notifier wakes waiters in other processes; see [Config.Notifier].
	Notifier = store.Notifier
)

// The states of a record.
const (
	// StateInProgress: an owner holds the lease and is running the work.
	StateInProgress = store.StateInProgress
	// StateCompleted: the outcome is stored and every retry replays it.
	StateCompleted = store.StateCompleted
	// StateFailed: the owner declared that nothing happened; the next retry runs.
	StateFailed = store.StateFailed
	// StateUnknown: the side effect may or may not have happened; only the
	// owner's late outcome or the reconciler settles it.
	StateUnknown = store.StateUnknown
)

// Limits of keys and scopes, in bytes.
const (
	MaxKeyLen   = store.MaxKeyLen
	MaxScopeLen = store.MaxScopeLen
)

// Errors, the same values as package store's: test with errors.Is.
var (
	// ErrNotFound: there is no live record under the scope and key.
	ErrNotFound = store.ErrNotFound
	// ErrLeaseLost: the lease token no longer owns the record.
	ErrLeaseLost = store.ErrLeaseLost
	// ErrInvalid: the input is malformed; the wrapping error says why.
	ErrInvalid = store.ErrInvalid
	// ErrUnavailable: the store could not be reached or did not answer.
	ErrUnavailable = store.ErrUnavailable
	// ErrDenied: the store refused access; it comes with ErrUnavailable,
	// and is never a reason to fail open.
	ErrDenied = store.ErrDenied
	// ErrRefused: the store was reached and refused the call for a reason
	// of its own (it takes no writes now, rolled the call back, or its
	// data is damaged); it
	// comes with ErrUnavailable, and is never a reason to fail open.
	ErrRefused = store.ErrRefused
)

// KeyHash names a record without revealing its key: every component logs
// it as key_hash, so one record can be followed across them; see
// [store.KeyHash].
func KeyHash(scope, key string) string { return store.KeyHash(scope, key) }

// ValidateKey reports whether key is acceptable: 1 to [MaxKeyLen] bytes of
// printable ASCII. The error wraps [ErrInvalid].
func ValidateKey(key string) error { return store.ValidateKey(key) }

func invalid(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrInvalid, fmt.Sprintf(format, args...))
}
