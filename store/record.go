// Package store is what a store of idem records implements: the [Store]
// interface, the records it keeps, and the transitions each operation
// applies, stated exactly by the params types' Apply and Validate methods,
// with the encodings stores share. It is for store authors; a user of idem
// needs only package idem, whose names for these types are aliases of
// these. Every store passes the conformance suite in store/storetest.
//
// Like package idem, it imports only the standard library.
package store

import (
	"bytes"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"time"
)

// State is where a record stands in its life.
type State string

// The states of a record.
const (
	// StateInProgress: an owner holds the lease and is running the work.
	StateInProgress State = "in_progress"
	// StateCompleted: the outcome is stored and every retry replays it.
	StateCompleted State = "completed"
	// StateFailed: the owner declared that nothing happened; the next retry runs.
	StateFailed State = "failed"
	// StateUnknown: the side effect may or may not have happened (the lease
	// expired, or the owner crashed mid-way); only the owner's late outcome or
	// the reconciler settles it.
	StateUnknown State = "unknown"
)

// Valid reports whether s is one of the four states.
func (s State) Valid() bool {
	switch s {
	case StateInProgress, StateCompleted, StateFailed, StateUnknown:
		return true
	}
	return false
}

// Terminal reports whether s is a settled state (COMPLETED or FAILED). Only
// terminal records expire; IN_PROGRESS and UNKNOWN records are kept until they
// are settled, because they may stand for a side effect nobody has accounted for.
func (s State) Terminal() bool { return s == StateCompleted || s == StateFailed }

// Sentinel errors. Stores translate their drivers' errors into these at their
// edge, so callers test with errors.Is and never see a driver's error type.
var (
	// ErrNotFound: there is no live record under the scope and key.
	ErrNotFound = errors.New("idem: record not found")
	// ErrLeaseLost: the lease token no longer owns the record (it expired,
	// was taken over, or the record was settled by someone else).
	ErrLeaseLost = errors.New("idem: lease lost")
	// ErrInvalid: the input is malformed (bad key, scope, token, state, or a
	// missing response). The wrapping error says which and why.
	ErrInvalid = errors.New("idem: invalid input")
	// ErrUnavailable: the store could not be reached or did not answer. The
	// operation's outcome is not known; callers must fail closed.
	ErrUnavailable = errors.New("idem: store unavailable")
	// ErrDenied: the store was reached but refused the caller's
	// credentials or permissions (a password or an ACL rotated). Stores
	// wrap it together with [ErrUnavailable], since the call may succeed
	// once access is restored (an outcome is kept to try again); it is
	// never a reason to fail open, since the store, reached, may hold the
	// record.
	ErrDenied = errors.New("idem: store refused access")
	// ErrRefused: the store was reached, and holds the record, but refused
	// the call for a reason of its own that may pass: it takes no writes
	// now (out of memory, a read-only replica, a full disk, too few
	// replicas), it rolled the call back (a lock not had in time, a
	// deadlock), or the page the record is on is damaged (until it is
	// repaired). Stores wrap it together with [ErrUnavailable], since
	// the call may succeed when tried again (an outcome is kept to try
	// again); like [ErrDenied], it is never a reason to fail open: the
	// record, which the store holds, may say the request ran (a lease
	// that ran out must become UNKNOWN) or runs now (a row locked by its
	// owner's transaction).
	ErrRefused = errors.New("idem: store refused the call")
	// ErrNotSent: the call never left the process (the store has not
	// opened yet), so it did nothing. Stores wrap it together with
	// [ErrUnavailable]; the engine then has no acquire to release.
	ErrNotSent = errors.New("idem: the call was not sent to the store")
)

// Denied is err, a store's refusal of the caller's credentials or
// permissions, as stores report it: wrapping [ErrUnavailable] and
// [ErrDenied].
func Denied(err error) error { return fmt.Errorf("%w: %w: %w", ErrUnavailable, ErrDenied, err) }

// Refused is err, a store's refusal of a call for a reason of its own (see
// [ErrRefused]), as stores report it: wrapping [ErrUnavailable] and
// [ErrRefused].
func Refused(err error) error { return fmt.Errorf("%w: %w: %w", ErrUnavailable, ErrRefused, err) }

// MaxKeyLen is the longest idempotency key accepted, in bytes.
const MaxKeyLen = 255

// MaxScopeLen is the longest scope accepted, in bytes.
const MaxScopeLen = 255

// Response is the stored outcome of a request: what a replay sends back.
type Response struct {
	// Status is the HTTP status code: a final one (200–999), or 101 for a
	// connection the handler took over. A 1xx is an interim answer: net/http
	// would send a replay of it followed by an empty 200.
	Status int
	// Header holds the headers to replay. Nil means none.
	Header http.Header
	// Body is the response body as sent, or nil when BodyOmitted.
	Body []byte
	// BodyOmitted is true when the body was delivered once but not stored
	// (it was over the size limit, or streamed); a replay must say so rather
	// than send a wrong or empty body.
	BodyOmitted bool
}

// Clone returns a deep copy of r (nil for nil).
func (r *Response) Clone() *Response {
	if r == nil {
		return nil
	}
	c := *r
	c.Header = r.Header.Clone()
	c.Body = bytes.Clone(r.Body)
	return &c
}

// WithoutBody returns a copy of r with its body omitted: the outcome a
// store keeps when it has no room for the body (it was delivered once, and
// a replay says it is not kept).
func (r *Response) WithoutBody() *Response {
	o := *r
	o.Body, o.BodyOmitted = nil, true
	return &o
}

// Equal reports whether r and o are the same outcome: status, headers (a
// nil and an empty header are the same), body and BodyOmitted. Two nil
// responses are equal.
func (r *Response) Equal(o *Response) bool {
	if r == nil || o == nil {
		return r == o
	}
	if r.Status != o.Status || r.BodyOmitted != o.BodyOmitted || !bytes.Equal(r.Body, o.Body) || len(r.Header) != len(o.Header) {
		return false
	}
	for name, values := range r.Header {
		if !slices.Equal(values, o.Header[name]) {
			return false
		}
	}
	return true
}

// Record is what a store keeps under one scope and key.
type Record struct {
	// Scope isolates callers: the same key in two scopes is two records.
	Scope string
	// Key is the idempotency key as the client sent it.
	Key string
	// State is the record's state as stored. An IN_PROGRESS record whose lease
	// has expired is effectively UNKNOWN (or free to take over when
	// TakeoverSafe); see [Record.Stale].
	State State
	// Fingerprint identifies the payload of the request that created the record.
	Fingerprint Fingerprint
	// Token is the current lease token. Every write after acquire compares it.
	Token string
	// Fence counts the leases granted on this record: 1 for the first owner,
	// one more for each takeover or re-run after a release. A larger fence is
	// a newer owner, so downstream systems can reject stale writers.
	Fence int64
	// LeaseExpires is when the current lease ends unless renewed.
	LeaseExpires time.Time
	// TakeoverSafe is true when the owner declared that all its effects commit
	// together with the record, so a retry may take over an expired lease.
	TakeoverSafe bool
	// Response is the stored outcome; set only when State is COMPLETED.
	Response *Response
	// Created is when the record (or its current incarnation) was created.
	Created time.Time
	// Updated is when the record was last written.
	Updated time.Time
	// Expires is when a terminal record stops being replayed and may be
	// pruned; zero while the record is IN_PROGRESS or UNKNOWN.
	Expires time.Time
	// Checkpoints are the recovery points the owners recorded, oldest first.
	Checkpoints []Checkpoint
}

// Lease is the record's current lease, borrowed: whoever settles a stale
// record ([Engine.Settle]) does so under its token, so that a compare-and-set
// refuses the settlement once somebody else has settled it.
func (r *Record) Lease() Lease {
	return Lease{Scope: r.Scope, Key: r.Key, Token: r.Token, Fence: r.Fence, Fingerprint: r.Fingerprint, Expires: r.LeaseExpires}
}

// Live reports whether the record is still visible at now: non-terminal
// records always are; terminal ones until Expires.
func (r *Record) Live(now time.Time) bool {
	return r.Expires.IsZero() || now.Before(r.Expires)
}

// Stale reports whether the record needs the reconciler at now: it is UNKNOWN,
// or IN_PROGRESS with a lease that has run out.
func (r *Record) Stale(now time.Time) bool {
	return r.State == StateUnknown || (r.State == StateInProgress && !now.Before(r.LeaseExpires))
}

// Lease is the right to run the work for one record and to write its outcome.
// It is a value: renewing returns a new Lease with a later Expires.
type Lease struct {
	// Scope and Key name the record.
	Scope, Key string
	// Token is a random 128-bit value, hex-encoded; writes compare it.
	Token string
	// Fence is the record's fence at acquisition (see [Record.Fence]).
	Fence int64
	// Fingerprint is the payload's, as stored on the record.
	Fingerprint Fingerprint
	// Expires is when the lease ends unless renewed.
	Expires time.Time
	// Duration is the length of each renewal.
	Duration time.Duration
	// Retention is how long the outcome is kept once stored.
	Retention time.Duration
}

func invalid(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrInvalid, fmt.Sprintf(format, args...))
}

// ValidateKey reports whether key is acceptable: 1 to [MaxKeyLen] bytes of
// printable ASCII (space through tilde). The error wraps [ErrInvalid].
func ValidateKey(key string) error {
	if key == "" {
		return invalid("key is empty")
	}
	if len(key) > MaxKeyLen {
		return invalid("key is %d bytes, over the limit of %d", len(key), MaxKeyLen)
	}
	if i := nonPrintable(key); i >= 0 {
		return invalid("key has a byte that is not printable ASCII at offset %d", i)
	}
	return nil
}

// ValidateScope reports whether scope is acceptable: at most [MaxScopeLen]
// bytes of printable ASCII. The empty scope is allowed (no scoping). The error
// wraps [ErrInvalid].
func ValidateScope(scope string) error {
	if len(scope) > MaxScopeLen {
		return invalid("scope is %d bytes, over the limit of %d", len(scope), MaxScopeLen)
	}
	if i := nonPrintable(scope); i >= 0 {
		return invalid("scope has a byte that is not printable ASCII at offset %d", i)
	}
	return nil
}

func nonPrintable(s string) int {
	for i := 0; i < len(s); i++ {
		if s[i] < 0x20 || s[i] > 0x7e {
			return i
		}
	}
	return -1
}
