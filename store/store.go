package store

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"math"
	"net/http"
	"slices"
	"strings"
	"time"
	"unicode/utf8"
)

// Store keeps records. Implementations must make each method atomic with
// respect to every other call on the same scope and key, across every process
// that shares the store, and must translate their driver's errors into the
// sentinels of this package ([ErrNotFound], [ErrLeaseLost], [ErrInvalid],
// [ErrUnavailable]) at their edge.
//
// A store never reads a clock: every call carries the time it should act at
// (the engine's clock), so that all stores behave alike and tests can move
// time. Each params type has an Apply or Validate method that states the
// semantics exactly; stores that run the logic in Go (memory, SQLite) call
// them, and stores that run it on the server (SQL, Lua) must match them. The
// conformance suite in store/storetest checks that they do.
type Store interface {
	// Acquire atomically creates the record or returns the one that exists,
	// applying the transitions of [AcquireParams.Apply]. The caller holds the
	// lease exactly when the returned record's Token equals p.Token.
	Acquire(ctx context.Context, p AcquireParams) (Record, error)
	// Renew extends a lease; see [RenewParams.Apply]. A token that no longer
	// owns a running record gives [ErrLeaseLost].
	Renew(ctx context.Context, p RenewParams) error
	// Checkpoint appends a recovery point to a running record; see
	// [CheckpointParams.Apply]. A token that no longer owns a running record
	// gives [ErrLeaseLost].
	Checkpoint(ctx context.Context, p CheckpointParams) error
	// Finish settles a record as COMPLETED, FAILED or UNKNOWN; see
	// [FinishParams.Apply]. A token that no longer owns the record gives
	// [ErrLeaseLost].
	Finish(ctx context.Context, p FinishParams) error
	// Get returns the live record under scope and key, or [ErrNotFound].
	Get(ctx context.Context, p GetParams) (Record, error)
	// Scan lists stale records (see [Record.Stale]) for the reconciler, a
	// page at a time; see [ScanParams].
	Scan(ctx context.Context, p ScanParams) (ScanResult, error)
	// List lists the live records that match a filter, in any state, a
	// page at a time, for operators (idem keys ls); see [ListParams]. Unlike
	// Scan it may read every record the store holds.
	List(ctx context.Context, p ListParams) (ScanResult, error)
	// Prune deletes up to p.Limit terminal records that expired at or before
	// p.Now and reports how many it deleted. Stores whose server expires
	// records by itself (Redis TTL) may report 0.
	Prune(ctx context.Context, p PruneParams) (int, error)
}

// TxFinisher is implemented by stores whose records live in a database that
// an application writes to as well (PostgreSQL, SQLite), so that a handler's
// own writes and the record's outcome commit in one transaction.
type TxFinisher interface {
	// FinishTx settles a record like Finish, but inside tx, a transaction
	// of the store's own database: a pgx.Tx for pgstore, a *sql.Tx for
	// sqlitestore; a transaction of another kind gives ErrInvalid. It never
	// counts a repeat as done (FinishParams.Repeat is ignored): the
	// caller's own writes in tx must not commit twice.
	FinishTx(ctx context.Context, tx any, p FinishParams) error
}

// Unwrap returns the store s wraps (a store that measures or logs the calls
// of another has an Unwrap() Store method), or nil.
func Unwrap(s Store) Store {
	if u, ok := s.(interface{ Unwrap() Store }); ok {
		return u.Unwrap()
	}
	return nil
}

// BodyLimiter is implemented by stores that cannot keep response bodies of
// any size (DynamoDB's items are capped at 400 KB, Memcached's at 1 MB). A
// store that implements it never fails a Finish for a body over MaxBody: it
// stores the outcome with the body omitted (Response.BodyOmitted), so a
// retry is told honestly that the response cannot be replayed, and callers
// (httpidem) cap what they try to store at MaxBody. math.MaxInt means no
// limit.
type BodyLimiter interface {
	MaxBody() int
}

// MaxBody is the largest response body s keeps: its BodyLimiter's limit,
// or math.MaxInt.
func MaxBody(s Store) int {
	if l, ok := s.(BodyLimiter); ok {
		return l.MaxBody()
	}
	return math.MaxInt
}

// Durability is what a crash of a store's server would cost, as far as the
// store can tell from the server's settings.
type Durability struct {
	// CrashSafe is true when every write the server acknowledged survives a
	// crash of the server and of its machine. When it is false, a crash
	// loses records: retries of the requests they recorded run again.
	CrashSafe bool
	// Detail names the settings read and what they mean, in a sentence.
	Detail string
	// Instance identifies the server's current run (Redis's run_id,
	// PostgreSQL's start time); it changes when the server restarts. Empty
	// when the store cannot tell.
	Instance string
}

// DurabilityReporter is implemented by stores that can read their server's
// durability settings.
type DurabilityReporter interface {
	Durability(ctx context.Context) (Durability, error)
}

// AcquireParams asks a store to create a record or return the existing one.
type AcquireParams struct {
	Scope, Key  string
	Fingerprint Fingerprint
	// Token is the new lease's token, made by the caller.
	Token string
	// Now is the time the store acts at.
	Now time.Time
	// LeaseExpires is when the new lease ends; after Now.
	LeaseExpires time.Time
	// TakeoverSafe is stored on the record; see [Record.TakeoverSafe].
	TakeoverSafe bool
}

// Validate reports malformed params; the error wraps [ErrInvalid].
func (p AcquireParams) Validate() error {
	if err := validateRef(p.Scope, p.Key, p.Token, p.Now); err != nil {
		return err
	}
	if err := validateFingerprint(p.Fingerprint); err != nil {
		return err
	}
	if !p.LeaseExpires.After(p.Now) {
		return invalid("lease must expire after now")
	}
	return nil
}

// Apply is the acquire transition. existing is the record stored under the
// scope and key, or nil. It returns the record as it must be after the call,
// and whether it must be written:
//
//   - no record, an expired one, or a FAILED one: a new IN_PROGRESS record
//     owned by p.Token (the fence continues from a FAILED record, restarts at
//     1 otherwise);
//   - IN_PROGRESS with an expired lease, TakeoverSafe, same fingerprint: taken
//     over by p.Token with the next fence;
//   - IN_PROGRESS with an expired lease, not TakeoverSafe: becomes UNKNOWN;
//   - anything else: returned as it is, not written.
func (p AcquireParams) Apply(existing *Record) (next Record, write bool) {
	fresh := Record{
		Scope:        p.Scope,
		Key:          p.Key,
		State:        StateInProgress,
		Fingerprint:  p.Fingerprint,
		Token:        p.Token,
		Fence:        1,
		LeaseExpires: p.LeaseExpires,
		TakeoverSafe: p.TakeoverSafe,
		Created:      p.Now,
		Updated:      p.Now,
	}
	if existing == nil || !existing.Live(p.Now) {
		return fresh, true
	}
	r := *existing
	switch {
	case r.State == StateFailed:
		fresh.Fence = r.Fence + 1
		return fresh, true
	case r.State == StateInProgress && !p.Now.Before(r.LeaseExpires):
		if !r.TakeoverSafe {
			r.State = StateUnknown
			r.Updated = p.Now
			return r, true
		}
		if r.Fingerprint != p.Fingerprint {
			return r, false
		}
		r.Token = p.Token
		r.Fence++
		r.LeaseExpires = p.LeaseExpires
		r.TakeoverSafe = p.TakeoverSafe
		r.Updated = p.Now
		return r, true
	}
	return r, false
}

// RenewParams asks a store to extend a lease.
type RenewParams struct {
	Scope, Key, Token string
	Now               time.Time
	// LeaseExpires is the lease's new end; after Now.
	LeaseExpires time.Time
}

// Validate reports malformed params; the error wraps [ErrInvalid].
func (p RenewParams) Validate() error {
	if err := validateRef(p.Scope, p.Key, p.Token, p.Now); err != nil {
		return err
	}
	if !p.LeaseExpires.After(p.Now) {
		return invalid("lease must expire after now")
	}
	return nil
}

// Apply is the renew transition on the stored record r (nil when there is
// none): it succeeds only while r is IN_PROGRESS under p.Token and its lease
// has not run out, because once it has, others may have acted on that.
func (p RenewParams) Apply(r *Record) error {
	if r == nil || !r.Live(p.Now) || r.Token != p.Token || r.State != StateInProgress || !p.Now.Before(r.LeaseExpires) {
		return ErrLeaseLost
	}
	r.LeaseExpires = p.LeaseExpires
	r.Updated = p.Now
	return nil
}

// FinishParams asks a store to settle a record.
type FinishParams struct {
	Scope, Key, Token string
	Now               time.Time
	// State is COMPLETED, FAILED or UNKNOWN.
	State State
	// Response is required for COMPLETED and must be nil otherwise.
	Response *Response
	// Expires is when a COMPLETED or FAILED record expires; after Now. It
	// must be zero for UNKNOWN.
	Expires time.Time
	// Repeat lets the write succeed as a repeat of the one that settled the
	// record: same token, terminal state and response. It is for the lease's
	// owner sending again a write whose answer was lost. Writers that borrow
	// a record's token (a reconciler, an operator) leave it false, so that
	// of two of them only one succeeds; a store's transactional finish
	// ignores it, since the caller's own writes would commit twice.
	Repeat bool
}

// Validate reports malformed params; the error wraps [ErrInvalid].
func (p FinishParams) Validate() error {
	if err := validateRef(p.Scope, p.Key, p.Token, p.Now); err != nil {
		return err
	}
	switch p.State {
	case StateCompleted:
		if p.Response == nil {
			return invalid("a completed record needs a response")
		}
		if st := p.Response.Status; st < 200 && st != http.StatusSwitchingProtocols || st > 999 {
			return invalid("response status %d is not a final HTTP status (200 to 999; a 1xx is an interim answer, which a replay would follow with an empty 200)", st)
		}
		if p.Response.BodyOmitted && len(p.Response.Body) > 0 {
			return invalid("a response whose body is omitted cannot carry one")
		}
	case StateFailed, StateUnknown:
		if p.Response != nil {
			return invalid("only a completed record has a response")
		}
	default:
		return invalid("cannot finish a record as %q", p.State)
	}
	if p.State.Terminal() != !p.Expires.IsZero() {
		return invalid("expiry is required for a terminal state and forbidden otherwise")
	}
	if p.State.Terminal() && !p.Expires.After(p.Now) {
		return invalid("expiry must be after now")
	}
	return nil
}

// Apply is the finish transition on the stored record r (nil when there is
// none). It succeeds while r is IN_PROGRESS or UNKNOWN under p.Token, even
// after the lease ran out: nobody else owns the record then, and the owner's
// late outcome is exactly what an UNKNOWN record waits for. Once a record is
// settled or taken over, the token has lost it — except, when p.Repeat, to
// a repeat of the write that settled it: the same token, terminal state and
// response. An owner whose Finish got no answer sends it again, and must
// learn that it landed, not that the lease was lost. A repeat changes
// nothing.
func (p FinishParams) Apply(r *Record) error {
	if p.Repeat && r != nil && r.Token == p.Token && p.State.Terminal() && r.State == p.State && r.Response.Equal(p.Response) {
		return nil
	}
	if r == nil || r.Token != p.Token || (r.State != StateInProgress && r.State != StateUnknown) {
		return ErrLeaseLost
	}
	r.State = p.State
	r.Response = p.Response
	r.Expires = p.Expires
	r.Updated = p.Now
	return nil
}

// GetParams asks a store for one record.
type GetParams struct {
	Scope, Key string
	// Now decides whether a terminal record has expired.
	Now time.Time
}

// Validate reports malformed params; the error wraps [ErrInvalid].
func (p GetParams) Validate() error {
	if err := ValidateScope(p.Scope); err != nil {
		return err
	}
	if err := ValidateKey(p.Key); err != nil {
		return err
	}
	if p.Now.IsZero() {
		return invalid("now is zero")
	}
	return nil
}

// ScanParams asks a store for a page of stale records.
type ScanParams struct {
	// Now decides which IN_PROGRESS records have run out of lease.
	Now time.Time
	// Limit is the most records to return; zero means [DefaultScanLimit].
	Limit int
	// Cursor continues a scan: empty to start, then the previous page's
	// ScanResult.Cursor.
	Cursor string
}

// DefaultScanLimit is the page size of a scan when none is given.
const DefaultScanLimit = 100

// Validate reports malformed params; the error wraps [ErrInvalid].
func (p ScanParams) Validate() error {
	if p.Now.IsZero() {
		return invalid("now is zero")
	}
	if p.Limit < 0 {
		return invalid("negative scan limit")
	}
	return nil
}

// PageSize is the page size asked for: Limit, or [DefaultScanLimit].
func (p ScanParams) PageSize() int { return pageSize(p.Limit) }

func pageSize(limit int) int {
	if limit == 0 {
		return DefaultScanLimit
	}
	return limit
}

// ScanResult is one page of a scan. Records that change during a scan may be
// missed or returned twice; a reconciler simply scans again. Records stale at
// the scan's Now that do not change are returned exactly once over the pages.
type ScanResult struct {
	Records []Record
	// Cursor continues the scan; empty when it is complete.
	Cursor string
}

// ListParams asks a store for a page of the live records that match a
// filter ([ListParams.Match]). The order of the records is the store's own.
// A page may hold fewer than Limit records, even none, while its Cursor is
// not empty (a store that filters what it reads); the listing is over when
// the Cursor is empty. A matching record that does not change during the
// listing is returned at least once over the pages (once by most stores; a
// caller that must not see one twice keeps the ones it has seen).
type ListParams struct {
	// Now: records that are not live at Now (expired) are left out.
	Now time.Time
	// States, when not empty, keeps only records in these states.
	States []State
	// ScopePrefix and KeyPrefix keep only records whose scope and key begin
	// with them ("" keeps all).
	ScopePrefix, KeyPrefix string
	// CreatedFrom and CreatedBefore, when not zero, keep only records
	// created at or after CreatedFrom and before CreatedBefore.
	CreatedFrom, CreatedBefore time.Time
	// Limit is the most records to return; zero means [DefaultScanLimit].
	Limit int
	// Cursor continues a listing: empty to start, then the previous page's
	// ScanResult.Cursor.
	Cursor string
}

// Validate reports malformed params; the error wraps [ErrInvalid].
func (p ListParams) Validate() error {
	if p.Now.IsZero() {
		return invalid("now is zero")
	}
	if p.Limit < 0 {
		return invalid("negative list limit")
	}
	for _, st := range p.States {
		if !st.Valid() {
			return invalid("list of state %q", st)
		}
	}
	if !p.CreatedFrom.IsZero() && !p.CreatedBefore.IsZero() && !p.CreatedFrom.Before(p.CreatedBefore) {
		return invalid("list of an empty time range")
	}
	return nil
}

// PageSize is the page size asked for: Limit, or [DefaultScanLimit].
func (p ListParams) PageSize() int { return pageSize(p.Limit) }

// Match reports whether r belongs in the listing.
func (p ListParams) Match(r Record) bool {
	return r.Live(p.Now) &&
		(len(p.States) == 0 || slices.Contains(p.States, r.State)) &&
		strings.HasPrefix(r.Scope, p.ScopePrefix) && strings.HasPrefix(r.Key, p.KeyPrefix) &&
		(p.CreatedFrom.IsZero() || !r.Created.Before(p.CreatedFrom)) &&
		(p.CreatedBefore.IsZero() || r.Created.Before(p.CreatedBefore))
}

// PruneParams asks a store to delete expired records.
type PruneParams struct {
	// Now: terminal records with Expires at or before it are deleted.
	Now time.Time
	// Limit is the most records to delete in one call; zero means
	// [DefaultPruneLimit].
	Limit int
}

// DefaultPruneLimit is the batch size of a prune when none is given.
const DefaultPruneLimit = 1000

// Validate reports malformed params; the error wraps [ErrInvalid].
func (p PruneParams) Validate() error {
	if p.Now.IsZero() {
		return invalid("now is zero")
	}
	if p.Limit < 0 {
		return invalid("negative prune limit")
	}
	return nil
}

// BatchSize is the batch size asked for: Limit, or [DefaultPruneLimit].
func (p PruneParams) BatchSize() int {
	if p.Limit == 0 {
		return DefaultPruneLimit
	}
	return p.Limit
}

// MaxTokenLen is the longest lease token a store accepts.
const MaxTokenLen = 64

// MaxFingerprintLen is the longest fingerprint a store accepts.
const MaxFingerprintLen = 255

func validateRef(scope, key, token string, now time.Time) error {
	if err := ValidateScope(scope); err != nil {
		return err
	}
	if err := ValidateKey(key); err != nil {
		return err
	}
	if token == "" || len(token) > MaxTokenLen || nonPrintable(token) >= 0 {
		return invalid("lease token must be 1 to %d bytes of printable ASCII", MaxTokenLen)
	}
	if now.IsZero() {
		return invalid("now is zero")
	}
	return nil
}

func validateFingerprint(f Fingerprint) error {
	if f == "" || len(f) > MaxFingerprintLen || nonPrintable(string(f)) >= 0 {
		return invalid("fingerprint must be 1 to %d bytes of printable ASCII", MaxFingerprintLen)
	}
	return nil
}

// responseVersion is the version of the encoding MarshalBinary writes.
const responseVersion = 1

type responseJSON struct {
	V           int                 `json:"v"`
	Status      int                 `json:"status"`
	Header      map[string][]string `json:"header,omitempty"`
	Body        []byte              `json:"body,omitempty"`
	BodyOmitted bool                `json:"body_omitted,omitempty"`
}

// MarshalBinary encodes r for storage, in a versioned self-describing form.
// Stores that keep the response as one value use it. The form is JSON
// (which release 0.1.0 reads), but for a response with a header name or
// value that is no UTF-8 (HTTP allows any byte in a value: a Latin-1 file
// name), which JSON would change: that one is encoded as [MarshalCompact]
// encodes it, byte for byte.
func (r *Response) MarshalBinary() ([]byte, error) {
	for name, values := range r.Header {
		if !utf8.ValidString(name) || slices.ContainsFunc(values, func(v string) bool { return !utf8.ValidString(v) }) {
			return r.MarshalCompact()
		}
	}
	return json.Marshal(responseJSON{V: responseVersion, Status: r.Status, Header: r.Header, Body: r.Body, BodyOmitted: r.BodyOmitted})
}

// UnmarshalBinary decodes what MarshalBinary or MarshalCompact encoded.
func (r *Response) UnmarshalBinary(data []byte) error {
	if len(data) > 0 && data[0] == compactVersion {
		return r.unmarshalCompact(data)
	}
	var j responseJSON
	if err := json.Unmarshal(data, &j); err != nil {
		return fmt.Errorf("idem: decoding stored response: %w", err)
	}
	if j.V != responseVersion {
		return fmt.Errorf("idem: stored response has encoding version %d, this build reads %d", j.V, responseVersion)
	}
	*r = Response{Status: j.Status, Header: j.Header, Body: j.Body, BodyOmitted: j.BodyOmitted}
	return nil
}

// compactVersion is the first byte of MarshalCompact's encoding; a JSON
// object, MarshalBinary's, starts with '{'.
const compactVersion = 2

// compactBodyOmitted is the flag of a response whose body was not stored.
const compactBodyOmitted = 1

// MarshalCompact encodes r for storage in the compact binary form (encoding
// version 2), which [Response.UnmarshalBinary] reads as well: the body as
// it is (MarshalBinary's JSON writes it in base64, a third longer), the
// headers in name order (one response, one encoding: a store compares a
// repeat's bytes with the stored ones), and a few bytes of lengths. A store
// writes it only where no idem that reads the store is older than this
// form (pgstore: on a records table created since release 0.1.0).
func (r *Response) MarshalCompact() ([]byte, error) {
	if r.Status < 0 || r.Status > 999 {
		return nil, fmt.Errorf("idem: encoding response: status %d is not an HTTP status", r.Status)
	}
	size := 16 + len(r.Body)
	names := make([]string, 0, len(r.Header))
	for name, values := range r.Header {
		names = append(names, name)
		size += 2 + len(name)
		for _, v := range values {
			size += 2 + len(v)
		}
	}
	slices.Sort(names)
	b := make([]byte, 0, size)
	b = append(b, compactVersion, 0)
	if r.BodyOmitted {
		b[1] = compactBodyOmitted
	}
	b = binary.AppendUvarint(b, uint64(r.Status))
	b = binary.AppendUvarint(b, uint64(len(names)))
	for _, name := range names {
		b = binary.AppendUvarint(b, uint64(len(name)))
		b = append(b, name...)
		b = binary.AppendUvarint(b, uint64(len(r.Header[name])))
		for _, v := range r.Header[name] {
			b = binary.AppendUvarint(b, uint64(len(v)))
			b = append(b, v...)
		}
	}
	return append(b, r.Body...), nil
}

// unmarshalCompact decodes what MarshalCompact encoded. A header without
// values reads as nil, an empty body as nil, as from MarshalBinary's JSON.
func (r *Response) unmarshalCompact(data []byte) error {
	bad := func(what string) error { return fmt.Errorf("idem: decoding stored response: %s", what) }
	if len(data) < 2 || data[1]&^compactBodyOmitted != 0 {
		return bad("its flags are not this build's")
	}
	d := compactReader{data: data[2:]}
	status := d.uvarint()
	if status > 999 {
		return bad("its status is not an HTTP status")
	}
	out := Response{Status: int(status), BodyOmitted: data[1]&compactBodyOmitted != 0}
	names := d.count(2) // a name is at least its length and its values' count
	for range names {
		name := d.bytes()
		values := make([]string, d.count(1))
		for i := range values {
			values[i] = string(d.bytes())
		}
		if len(values) == 0 {
			values = nil
		}
		if out.Header == nil {
			out.Header = make(http.Header, names)
		}
		out.Header[string(name)] = values
	}
	if d.bad {
		return bad("it is cut short")
	}
	if len(d.data) > 0 {
		out.Body = slices.Clone(d.data)
	}
	*r = out
	return nil
}

// compactReader reads the lengths and strings of MarshalCompact's form;
// bad is set, and zeros read, once the data runs out.
type compactReader struct {
	data []byte
	bad  bool
}

func (d *compactReader) uvarint() uint64 {
	v, n := binary.Uvarint(d.data)
	if n <= 0 {
		d.bad = true
		d.data = nil
		return 0
	}
	d.data = d.data[n:]
	return v
}

// count reads a count of items of at least min bytes each: one past what
// the rest of the data can hold is bad (and read as 0), so that corrupt
// data never makes a large allocation.
func (d *compactReader) count(min int) int {
	n := d.uvarint()
	if n > uint64(len(d.data)/min) {
		d.bad = true
		d.data = nil
		return 0
	}
	return int(n)
}

func (d *compactReader) bytes() []byte {
	n := d.count(1)
	b := d.data[:n]
	d.data = d.data[n:]
	return b
}

// Ready is what every store method does first: it validates p (an error
// wrapping [ErrInvalid]) and refuses a context that is already done (an
// error naming the store and the operation, wrapping the context's error,
// never [ErrUnavailable]: the caller gave up, the store did nothing wrong).
func Ready(ctx context.Context, name, op string, p interface{ Validate() error }) error {
	if err := p.Validate(); err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("%s: %s: %w", name, op, err)
	}
	return nil
}
