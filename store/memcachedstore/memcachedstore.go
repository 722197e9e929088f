// Package memcachedstore is an [store.Store] on Memcached, through
// github.com/bradfitz/gomemcache.
//
// # What Memcached cannot promise
//
// Memcached is a cache. It keeps items in memory only, and it may drop any
// of them at any time to make room for others. This store makes every write
// atomic (add and compare-and-swap), but it cannot make Memcached keep what
// it was given:
//
//   - Under memory pressure Memcached evicts items, least recently used
//     first, whatever their expiry. An evicted IN_PROGRESS record lets a
//     retry run the work a second time while the first run may still be going,
//     or after it crashed mid side effect. An evicted COMPLETED record turns
//     a replay into a re-run. An evicted UNKNOWN record is forgotten, and
//     the next retry runs work whose first outcome nobody knows.
//   - A restart of the server, or of the machine, loses every record.
//   - The index a scan reads (below) is made of items too, and may be
//     evicted or lost the same way: the reconciler then misses the records
//     it named, until one of them is seen again by an acquire that marks it
//     UNKNOWN, which puts it back.
//   - With several servers, the client picks one per key; a server that
//     leaves the list takes its records with it, and one that joins takes
//     over keys whose records are elsewhere.
//
// So the exactly-once promise holds only while Memcached keeps every item.
// Size it so that it never evicts (watch the evictions counter of "stats"),
// or run it with -M, which makes it answer a write it has no room for with
// an error instead of evicting: the store then fails closed with
// [store.ErrRefused] (wrapped with [store.ErrUnavailable]) rather than
// forget a record, so the middleware's fail_open never runs a request
// while Memcached is full (the record it cannot write may say the request
// ran). Or use a store that persists (SQLite, PostgreSQL, Redis with
// appendonly). This store is for teams who already run Memcached and who
// accept a rare duplicate after an eviction or a restart in exchange for
// its latency; not for payments whose duplicates cost money.
//
// # Layout
//
// Memcached keys are at most 250 bytes without spaces or control
// characters, while a scope and a key may each be 255 bytes of printable
// ASCII, spaces included. A record therefore lives under a hash of its
// names:
//
//	<prefix>:r:<hash>    one record: base64url(SHA-256(v1, len(scope), scope, key))
//	<prefix>:i:<shard>   the index of a shard: its unsettled records
//
// The value of a record is one line of JSON holding every field of
// [store.Record] but the response body (times as unix milliseconds from the
// params, truncated to the millisecond and read back in UTC; the response
// as [store.Response.MarshalBinary] without its body; the checkpoints as
// [store.EncodeCheckpoints] lines), then the body, raw, so that base64 does
// not eat a quarter of the item size limit. The value carries the scope and
// key as sent, and every read compares them: a value of another scope and
// key (a hash collision) is never returned as a record. Get, Renew,
// Checkpoint and Finish treat it as absent; Acquire fails with an error
// rather than overwrite another key's record.
//
// A record's shard is crc32(hash) mod [Config.Shards]. A shard's index is a
// log appended to with Memcached's append command, one line when a lease
// begins (acquire of a new key, re-run after FAILED, expired record
// re-created, takeover: hash, fence, lease end) and one when that lease is
// settled as COMPLETED or FAILED (hash, fence); folded, it is the set of
// unsettled leases. Appends are atomic on the server and never conflict, so
// 200 concurrent acquires of distinct keys cost one append each, without a
// compare-and-swap loop on a shared item. The entry is appended before the
// record is written, so a crash or a network failure between the two
// leaves an entry without a record (dropped later), never an unsettled
// record that no scan can find. Memcached copies an item to append to it,
// so the log is kept short: every 128th append of a store to an index is
// followed by a rewrite of it, folded (gets, cas; lost harmlessly to a
// concurrent append). A scan rewrites the indexes it reads, folded, dropping the entries whose record has gone (evicted) or is
// settled once their lease has ended at the scan's time (an entry whose
// lease runs may belong to an acquire that has not written its record yet;
// so the instances' clocks must agree within a lease, as the engine asks
// anyway); a writer whose append finds the index
// at the server's item size limit rewrites it folded too. An index holds
// about 17,000 unsettled leases per MiB of item size; past that, acquires in
// its shard fail with [store.ErrUnavailable] until records are settled.
//
// # Round trips
//
// Each store method checks ctx, then makes these Memcached calls, each one
// round trip:
//
//	Acquire of a new key      3: gets (miss), append to the index, add
//	                          (5 for the first record of a shard: the append
//	                          finds no index, gets it, adds it)
//	Acquire that replays, or  1: gets; the record is returned as it is
//	finds the work in flight
//	Acquire that re-runs a    3: gets, append to the index, cas
//	FAILED or expired record,
//	or takes over a lease
//	Acquire that marks an     3: gets, cas, append to the index (the entry
//	expired lease UNKNOWN     again, in case the index lost it)
//	Renew, Checkpoint         2: gets, cas
//	Finish as COMPLETED or    3: gets, cas, append the removal to the index
//	FAILED
//	Finish as UNKNOWN         2: gets, cas
//	Get                       1: gets
//	Scan page                 2: the indexes of every remaining shard in one
//	                          multi-get, then the records they name in one
//	                          multi-get per batch (of twice the page size or
//	                          at least 64); plus one cas per index it tidies
//	List page                 one lru_crawler metadump per server of
//	                          Config.Servers, on a connection of its own (it
//	                          reads every item the server holds), the
//	                          indexes in one multi-get, then the records
//	                          after the cursor in one multi-get per batch,
//	                          as a scan
//	Prune                     0
//
// Every 128th append of a store to an index costs 2 more round trips, the
// fold (1/64 of a round trip per append on average). A compare-and-swap that
// loses to a concurrent write costs its gets and cas again. Each loss is another writer's success, so a write loses at
// most once per other writer of the same record; it gives up with
// [store.ErrUnavailable] after 100 losses.
//
// Acquire reads first rather than adding first. The index entry must be
// appended before the record is written, so adding first would append an
// entry on every call, then add: 2 round trips for a new key, but 3 for a
// replay (append, the add that fails, gets), with a useless entry left
// behind by each. Reading first costs a new key 3 and a replay, the common
// case of a retry, 1, the same as a bare get; only an acquire that is about
// to write a record appends an entry.
//
// A request that runs thus costs 6 round trips (acquire 3, complete 3)
// where Redis takes 2 (one script each): Memcached has no server-side
// logic, and the index is 2 of the 6.
//
// # Listing
//
// The indexes name only unsettled leases, so [Store.List] cannot find
// settled records through them. It asks each server of [Config.Servers] for
// every key it holds, with the text command lru_crawler metadump (memcached
// 1.4.31 and later; memcached -X or -o no_lru_crawler turns it off, and List
// then fails with [store.ErrUnavailable]), keeps this store's record keys,
// adds the unsettled records the indexes name, sorts them by hash, and
// reads the ones after the cursor's. A dump is not a snapshot: while the
// server takes writes, its crawler passes over some items that move in its
// LRU lists, so a settled record can be left out of a listing under
// traffic; an unsettled one, named by the indexes too, is not. A server's
// crawler serves one dump at a time and runs crawls of its own: List tries a
// busy one again, backing off, for up to [DefaultBusyWait]. Every page dumps
// every server again, so its cost grows with the number of items in
// Memcached, of every prefix (about 150 bytes of answer per item, some 10 ms
// per 10,000 items on loopback), not with the page size: List is a tool for
// operators (idem keys ls), not for a request's path. A record evicted,
// expired or deleted between the dump and the read is skipped.
//
// # Expiry
//
// A COMPLETED or FAILED record is written with a Memcached expiration
// computed from the params, never from a clock: the record's Expires minus
// p.Now, rounded up to the second, plus one second for Memcached's
// one-second clock, as a relative time when that is at most 30 days, and
// otherwise as the absolute unix time of Expires plus a second (so the
// engine's and the server's clocks must agree for retentions over 30 days;
// Memcached's expirations stop at 2038-01-19). Reads check Expires too, so
// a record is never replayed past it. IN_PROGRESS and UNKNOWN records, and
// indexes, never expire: they may stand for a side effect nobody has
// accounted for yet. Memcached drops expired items itself, so [Store.Prune]
// has nothing to do and reports 0.
//
// # Body size
//
// A Memcached item holds at most 1 MiB by default (memcached -I), key and
// item header included. The store implements [store.BodyLimiter]:
// [Store.MaxBody] is [Config.MaxItem] less [BodyReserve] (64 KiB for the
// record's other fields, headers and checkpoints), and Finish stores an
// outcome whose body is larger with the body omitted
// (Response.BodyOmitted), never failing for it. Checkpoints may take more
// than the reserve, up to the item size limit less 16 KiB kept for the
// outcome's status and headers (a checkpoint past it fails with
// [store.ErrInvalid], before the step it guards, and is not written).
// A completion that does not fit in the item (its body beside the
// checkpoints, or headers over the 16 KiB they left), or that the server
// refuses as too large (its -I below Config.MaxItem), is stored in the
// first of these forms that fits: without its checkpoints (recovery points
// for a running lease, which a settled record no longer needs), so that a
// replay still sends the body; with its body omitted and its checkpoints
// kept; without either. The choice is made on the record alone, so a
// repeat of the Finish finds what the first wrote. Only a completion too
// large without its body and checkpoints (headers of about the item size
// limit) fails, with an error wrapping [store.ErrInvalid], before anything
// is written.
//
// # Errors and contexts
//
// Errors are translated at the store's edge: a token that no longer owns the
// record gives [store.ErrLeaseLost], a missing or expired record
// [store.ErrNotFound], and a failure to reach Memcached or to get its answer
// (refused or broken connections, timeouts, no servers, a SERVER_ERROR
// reply) wraps [store.ErrUnavailable]. A write refused for want of memory
// (SERVER_ERROR out of memory, from a memcached run with -M) wraps
// [store.ErrRefused] too: Memcached was reached, and may hold the record,
// so it is never a reason to fail open. gomemcache takes no context: the
// store checks ctx before every call, so a cancelled or expired context
// stops an operation between two round trips (and errors.Is finds the
// context's error), but a call in flight runs until the client's Timeout
// (500 ms by default), however ctx ends. List's dumps are the exception:
// they use connections of their own, closed as soon as ctx ends.
//
// The client keeps at most MaxIdleConns idle connections per server (2 by
// default) and dials a new one for every concurrent call beyond them; set it
// to the peak number of concurrent calls, or each burst opens and closes
// connections.
//
// # Performance
//
// Measured with go test -run '^$' -bench . -benchtime 2000x against a local
// memcached 1.6.18 (loopback TCP, one request at a time, a 2-vCPU VM shared
// with other work; median of 10 interleaved runs, and the range), next to
// the bare client calls a hand-written idempotency check needs:
//
//	benchmark                                 ns/op (min–max)           round trips/op
//	AcquireComplete (acquire new + complete)  446249 (321980–657089)   6.024
//	RawAddSet (add, then set)                 128884 (81332–198337)    2
//	Replay (acquire of a completed key)        32808 (22470–54435)     1
//	RawGet (get)                               11036 (10194–17501)     1
//
// idem/raw: AcquireComplete/RawAddSet = 3.5, Replay/RawGet = 3.0. A request
// that runs makes 6 round trips where the bare check makes 2 (the .024 is
// the folds of the indexes, one per 128 appends), and that is its time: the
// same six client calls in a row without the store, timed call by call with
// a throwaway benchmark, took as long as AcquireComplete, 75–90 µs each,
// gets and writes alike (a get repeated alone, as in RawGet, takes 10–20 µs
// on this VM). A replay makes the same single round trip as a bare get, and
// adds 10–20 µs of work in Go: hashing the names and decoding the value (556
// bytes here) take 10 µs alone. The spread between runs is the VM's: read
// the ratios and the round trips, not the nanoseconds.
package memcachedstore

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/bradfitz/gomemcache/memcache"
	"github.com/idemhq/idem/store"
)

var (
	_ store.Store       = (*Store)(nil)
	_ store.BodyLimiter = (*Store)(nil)
)

// Defaults and limits for [Config].
const (
	// DefaultPrefix begins every Memcached key the store writes.
	DefaultPrefix = "idem"
	// MaxPrefixLen is the longest prefix: a record's key, the prefix and
	// ":r:" and a 43-byte hash, must fit Memcached's 250 bytes.
	MaxPrefixLen = 250 - len(":r:") - hashLen
	// DefaultShards is the number of shards, and so of index items, the
	// unsettled records are spread over.
	DefaultShards = 16
	// MaxShards is the largest number of shards.
	MaxShards = 1024
	// DefaultMaxItem is Memcached's default item size limit, 1 MiB.
	DefaultMaxItem = 1 << 20
	// MinMaxItem is the smallest item size limit the store works with.
	MinMaxItem = 2 * BodyReserve
	// MaxMaxItem is the largest item size limit Memcached accepts, 1 GiB.
	MaxMaxItem = 1 << 30
	// BodyReserve is the room an item keeps for a record's fields other
	// than its response body: [Store.MaxBody] is [Config.MaxItem] less it.
	BodyReserve = 64 << 10
)

// itemOverhead is what Memcached counts in an item's size besides the value
// and the key: about 60 bytes of item header (measured on memcached 1.6),
// with a margin.
const itemOverhead = 128

// maxAttempts is how many times a compare-and-swap loop reads and writes
// again after losing to a concurrent write before it gives up.
const maxAttempts = 100

// Config configures a [Store]. The zero value of every field but Client is a
// sensible default, and that of Servers leaves [Store.List] out.
type Config struct {
	// Client talks to Memcached. Required. The store does not close it. Set
	// its MaxIdleConns to the peak number of concurrent calls and its
	// Timeout to the longest a call may take.
	Client *memcache.Client
	// Servers are the addresses of the Memcached servers Client talks to,
	// as given to memcache.New. [Store.List] asks each of them for the keys
	// it holds (lru_crawler metadump), since gomemcache neither sends that
	// command nor tells its servers. Only List uses them: without them List
	// fails with an error wrapping [store.ErrInvalid], and every other
	// method works.
	Servers []string
	// Prefix begins every key the store writes, so that several stores (or
	// other data) can share one Memcached: 1 to [MaxPrefixLen] bytes of
	// printable ASCII without spaces. Defaults to [DefaultPrefix].
	Prefix string
	// Shards is the number of index items the unsettled records are spread
	// over, 1 to [MaxShards]. More shards hold more unsettled records (about
	// 17,000 per shard per MiB of item size) and spread the appends of busy
	// services; a scan page reads every index in one multi-get either way.
	// Shards decides where a record is indexed: it must never change for a
	// deployment, or scans miss the records indexed before (and refuse the
	// cursors of the old number). A deployment that needs more shards
	// moves to a new Prefix, whose store does not see the records under the
	// old one. Defaults to [DefaultShards].
	Shards int
	// MaxItem is the server's item size limit in bytes (memcached -I),
	// [MinMaxItem] to [MaxMaxItem]. It must not be larger than the server's:
	// records are checked against it before they are written, and [Store.MaxBody]
	// derives from it. (When it is, a completion the server refuses is
	// stored in a smaller form, see [Store.Finish], two round trips later
	// for each form it refuses, and other writes it refuses fail with
	// [store.ErrInvalid].) Defaults to [DefaultMaxItem].
	MaxItem int
}

// Store is an [store.Store] on Memcached. It is safe for concurrent use, and
// any number of processes may share one Memcached through stores with the
// same Prefix and Shards. Make one with [New].
type Store struct {
	client    *memcache.Client
	prefix    string
	indexKeys []string        // indexKeys[i] = prefix + ":i:" + i
	appends   []atomic.Uint64 // appends[i]: this store's appends to index i
	maxItem   int
	servers   []string      // Config.Servers, sorted, each once
	busyWait  time.Duration // how long List waits for a busy crawler
}

// New returns a store for cfg. The error wraps [store.ErrInvalid] when cfg is
// not valid. New does not contact Memcached.
func New(cfg Config) (*Store, error) {
	bad := func(format string, args ...any) (*Store, error) {
		return nil, fmt.Errorf("memcachedstore: %w: %s", store.ErrInvalid, fmt.Sprintf(format, args...))
	}
	if cfg.Client == nil {
		return bad("config has no client")
	}
	prefix := cfg.Prefix
	if prefix == "" {
		prefix = DefaultPrefix
	}
	if len(prefix) > MaxPrefixLen {
		return bad("prefix is %d bytes, over the limit of %d", len(prefix), MaxPrefixLen)
	}
	for i := 0; i < len(prefix); i++ {
		if prefix[i] <= ' ' || prefix[i] > '~' {
			return bad("prefix %q has a space or a byte that is not printable ASCII at offset %d", prefix, i)
		}
	}
	shards := orDefault(cfg.Shards, DefaultShards)
	if shards < 1 || shards > MaxShards {
		return bad("shards must be 1 to %d, not %d", MaxShards, shards)
	}
	maxItem := orDefault(cfg.MaxItem, DefaultMaxItem)
	if maxItem < MinMaxItem || maxItem > MaxMaxItem {
		return bad("max item must be %d to %d bytes, not %d", MinMaxItem, MaxMaxItem, maxItem)
	}
	if slices.Contains(cfg.Servers, "") {
		return bad("config has an empty server address")
	}
	s := &Store{client: cfg.Client, prefix: prefix, indexKeys: make([]string, shards), appends: make([]atomic.Uint64, shards), maxItem: maxItem,
		servers: slices.Compact(slices.Sorted(slices.Values(cfg.Servers))), busyWait: DefaultBusyWait}
	for i := range shards {
		s.indexKeys[i] = prefix + ":i:" + strconv.Itoa(i)
	}
	return s, nil
}

func orDefault(v, def int) int {
	if v == 0 {
		return def
	}
	return v
}

// MaxBody implements [store.BodyLimiter]: [Config.MaxItem] less
// [BodyReserve]. Finish stores a response with a larger body with the body
// omitted.
func (s *Store) MaxBody() int { return s.maxItem - BodyReserve }

// recordKey is the Memcached key of the record whose hash is h.
func (s *Store) recordKey(h string) string { return s.prefix + ":r:" + h }

// responseRoom is the room a running record keeps in its item for the
// status and headers of its outcome: a checkpoint that would leave less
// fails, so that a completion with headers within it keeps the checkpoints
// (it drops them, or omits its body, when that is what does not fit; see
// [smaller]).
const responseRoom = 16 << 10

// fits reports whether an item of key and value is within the item size
// limit.
func (s *Store) fits(key string, value []byte) bool {
	return fitsIn(key, value, s.maxItem)
}

// fitsIn reports whether an item of key and value is within limit bytes.
func fitsIn(key string, value []byte, limit int) bool {
	return len(value)+len(key)+itemOverhead <= limit
}

// tooLarge is the error of an op whose record, value under key, would take
// more than the limit it was checked against.
func tooLarge(op, key string, value []byte, limit int) error {
	why := "Config.MaxItem"
	switch op {
	case "checkpoint":
		why = "Config.MaxItem less 16 KiB kept for the status and headers of the outcome; the checkpoints are too many or too large"
	case "finish":
		why = "Config.MaxItem, with the checkpoints dropped and the body omitted; the response's headers are too large"
	}
	return fmt.Errorf("memcachedstore: %s: %w: the record would take %d bytes, over the %d it may (%s)",
		op, store.ErrInvalid, len(value)+len(key)+itemOverhead, limit, why)
}

// objectTooLarge reports the server's refusal of an item over its own item
// size limit (memcached -I), which a MaxItem above it lets through. The
// refusal of a compare-and-swap leaves the item as it was.
func objectTooLarge(err error) bool {
	return err != nil && strings.Contains(err.Error(), "SERVER_ERROR object too large")
}

// maxRelative is the largest expiration Memcached reads as relative to now;
// a larger one is an absolute unix time.
const maxRelative = 30 * 24 * 60 * 60

// expiration is the Memcached expiration of a record settled at now that
// expires at expires: the time left rounded up to the second, plus a second
// for the server's one-second clock; relative when Memcached reads it so,
// absolute (and at most the largest int32) otherwise.
func expiration(now, expires time.Time) int32 {
	secs := int64((expires.Sub(now)+time.Second-1)/time.Second) + 1
	if secs <= maxRelative {
		return int32(max(secs, 1))
	}
	abs := expires.Unix() + 2 // rounded up, plus the second
	return int32(min(abs, math.MaxInt32))
}

// retryable reports the errors of a conditional write that lost to another
// write (the item changed, appeared or vanished): read and try again.
func retryable(err error) bool {
	return errors.Is(err, memcache.ErrCASConflict) || errors.Is(err, memcache.ErrNotStored) ||
		errors.Is(err, memcache.ErrCacheMiss)
}

func contended(op string) error {
	return fmt.Errorf("memcachedstore: %s: %w: lost %d compare-and-swaps in a row to concurrent writes", op, store.ErrUnavailable, maxAttempts)
}

// Acquire implements [store.Store]. It reads the record (gets) and applies
// [store.AcquireParams.Apply]; a write that begins a lease first appends its
// entry to the shard's index, then adds the record (new key) or swaps it in
// (compare-and-swap on the read's CAS id), and reads again when another
// write got there first. 1 round trip for a replay, 3 for a new key; see the
// package documentation.
func (s *Store) Acquire(ctx context.Context, p store.AcquireParams) (store.Record, error) {
	if err := p.Validate(); err != nil {
		return store.Record{}, err
	}
	h := recordHash(p.Scope, p.Key)
	key, shard := s.recordKey(h), s.shard(h)
	for range maxAttempts {
		if err := ctx.Err(); err != nil {
			return store.Record{}, fmt.Errorf("memcachedstore: acquire: %w", err)
		}
		it, err := s.client.Get(key)
		var existing *store.Record
		switch {
		case errors.Is(err, memcache.ErrCacheMiss):
			it = nil
		case err != nil:
			return store.Record{}, translate("acquire", err)
		default:
			r, err := decode(it.Value, true, p.Scope, p.Key, h)
			if err != nil {
				// A foreign record (a hash collision) is not overwritten:
				// fail closed, as for a corrupt one.
				return store.Record{}, fmt.Errorf("memcachedstore: acquire: item %s: %w", key, err)
			}
			existing = &r
		}
		next, write := p.Apply(existing)
		if !write {
			return *existing, nil
		}
		value, err := encode(&next)
		if err != nil {
			return store.Record{}, fmt.Errorf("memcachedstore: acquire: %w", err)
		}
		if !s.fits(key, value) {
			return store.Record{}, tooLarge("acquire", key, value, s.maxItem)
		}
		entry := addLine(h, next.Fence, next.LeaseExpires.UnixMilli())
		if next.State == store.StateInProgress { // a lease begins: index it first
			if err := s.indexAppend(ctx, "acquire", shard, entry); err != nil {
				return store.Record{}, err
			}
		}
		if err := ctx.Err(); err != nil {
			return store.Record{}, fmt.Errorf("memcachedstore: acquire: %w", err)
		}
		if it == nil {
			err = s.client.Add(&memcache.Item{Key: key, Value: value})
		} else {
			it.Value, it.Expiration = value, 0
			err = s.client.CompareAndSwap(it)
		}
		if err == nil {
			if next.State == store.StateUnknown {
				// The lease's entry was appended when it began; append it
				// again in case the index was evicted since. The record is
				// written either way, so a failure here is not the caller's.
				_ = s.indexAppend(ctx, "acquire", shard, entry)
			}
			return decode(value, true, p.Scope, p.Key, h) // as stored
		}
		if !retryable(err) {
			return store.Record{}, translate("acquire", err)
		}
	}
	return store.Record{}, contended("acquire")
}

// Renew implements [store.Store]: gets, [store.RenewParams.Apply], cas; 2
// round trips.
func (s *Store) Renew(ctx context.Context, p store.RenewParams) error {
	if err := p.Validate(); err != nil {
		return err
	}
	_, err := s.update(ctx, "renew", p.Scope, p.Key, p.Now, s.maxItem, p.Apply, nil)
	return err
}

// Checkpoint implements [store.Store]: gets, [store.CheckpointParams.Apply],
// cas; 2 round trips. A checkpoint that would leave the record's item less
// than 16 KiB of room for the status and headers of its outcome fails with
// an error wrapping [store.ErrInvalid], and nothing is written.
func (s *Store) Checkpoint(ctx context.Context, p store.CheckpointParams) error {
	if err := p.Validate(); err != nil {
		return err
	}
	_, err := s.update(ctx, "checkpoint", p.Scope, p.Key, p.Now, s.maxItem-responseRoom, p.Apply, nil)
	return err
}

// Finish implements [store.Store]: gets, [store.FinishParams.Apply], cas, and
// for COMPLETED and FAILED the removal of the lease's index entry; 3 round
// trips (2 for UNKNOWN). A settled record gets a Memcached expiration at its
// Expires (see the package documentation). A response body over
// [Store.MaxBody] is stored omitted. A settled record that does not fit in
// the item, or that the server refuses as too large (its item size limit
// below [Config.MaxItem]; the gets and cas are then made again, for each
// form it refuses), is stored without its checkpoints, body kept; failing
// that, with its body omitted, checkpoints kept; failing that, without
// either. A repeat of such a Finish ([store.FinishParams.Repeat]) finds
// the record as stored and lands. Only a record too large without its
// body and checkpoints (headers of about the item size limit) fails, with
// an error wrapping [store.ErrInvalid], and nothing is written.
func (s *Store) Finish(ctx context.Context, p store.FinishParams) error {
	if err := p.Validate(); err != nil {
		return err
	}
	if p.Response != nil && len(p.Response.Body) > s.MaxBody() {
		p.Response = p.Response.WithoutBody()
	}
	apply := p.Apply
	if p.Response != nil && len(p.Response.Body) > 0 {
		omitted := p
		omitted.Response = p.Response.WithoutBody()
		apply = func(r *store.Record) error {
			err := p.Apply(r)
			// p.Apply changes nothing when it fails, and omitted.Apply
			// fails or succeeds on the same terms but for a repeat: nil
			// then means r is this Finish, stored with its body omitted
			// because it did not fit, and is left as it is.
			if errors.Is(err, store.ErrLeaseLost) && omitted.Apply(r) == nil {
				return nil
			}
			return err
		}
	}
	r, err := s.update(ctx, "finish", p.Scope, p.Key, p.Now, s.maxItem, apply, smaller)
	if err != nil {
		return err
	}
	if r.State.Terminal() {
		// The record is settled; an entry left behind by a failure here is
		// dropped by a later scan, so the caller is not told of it.
		h := recordHash(p.Scope, p.Key)
		_ = s.indexAppend(ctx, "finish", s.shard(h), removeLine(h, r.Fence))
	}
	return nil
}

// smaller returns the forms of a settled record r that take less room, most
// useful first: without its checkpoints (recovery points for a running
// lease, which a settled record no longer has), so that a replay still
// sends the body; with its body omitted, checkpoints kept; without either.
// An unsettled record has none: its checkpoints are what a reconciler
// resolves it by.
func smaller(r store.Record) []store.Record {
	if !r.State.Terminal() {
		return nil
	}
	var forms []store.Record
	bare := r
	bare.Checkpoints = nil
	if len(r.Checkpoints) > 0 {
		forms = append(forms, bare)
	}
	if r.Response != nil && len(r.Response.Body) > 0 {
		omitted := r
		omitted.Response = r.Response.WithoutBody()
		bare.Response = omitted.Response
		forms = append(forms, omitted)
		if len(r.Checkpoints) > 0 {
			forms = append(forms, bare)
		}
	}
	return forms
}

// update reads the record of scope and key, applies apply to it, and swaps
// it in, reading again when another write got there first. It returns the
// record as written. A missing record, or a foreign one, is passed to apply
// as nil. A record whose item would take more than limit bytes, or not less
// than one the server refused as too large, is written in the first of the
// forms shrink gives (when not nil) that fits; one that still does not fit
// is not written, and the error wraps [store.ErrInvalid].
func (s *Store) update(ctx context.Context, op, scope, key string, now time.Time, limit int,
	apply func(*store.Record) error, shrink func(store.Record) []store.Record) (store.Record, error) {
	h := recordHash(scope, key)
	mkey := s.recordKey(h)
	refused, refusal := 0, error(nil) // the size of the last value the server refused as too large, and its error
	fits := func(value []byte) bool {
		return fitsIn(mkey, value, limit) && (refusal == nil || len(value) < refused)
	}
	for range maxAttempts {
		if err := ctx.Err(); err != nil {
			return store.Record{}, fmt.Errorf("memcachedstore: %s: %w", op, err)
		}
		it, err := s.client.Get(mkey)
		if errors.Is(err, memcache.ErrCacheMiss) {
			return store.Record{}, apply(nil)
		}
		if err != nil {
			return store.Record{}, translate(op, err)
		}
		r, err := decode(it.Value, true, scope, key, h)
		if errors.Is(err, errForeign) {
			return store.Record{}, apply(nil)
		}
		if err != nil {
			return store.Record{}, fmt.Errorf("memcachedstore: %s: item %s: %w", op, mkey, err)
		}
		if err := apply(&r); err != nil {
			return store.Record{}, err
		}
		value, err := encode(&r)
		if err != nil {
			return store.Record{}, fmt.Errorf("memcachedstore: %s: %w", op, err)
		}
		if !fits(value) && shrink != nil {
			for _, form := range shrink(r) {
				r = form
				if value, err = encode(&r); err != nil {
					return store.Record{}, fmt.Errorf("memcachedstore: %s: %w", op, err)
				}
				if fits(value) {
					break
				}
			}
		}
		if !fits(value) {
			if refusal != nil {
				return store.Record{}, translate(op, refusal)
			}
			return store.Record{}, tooLarge(op, mkey, value, limit)
		}
		it.Value, it.Expiration = value, 0
		if r.State.Terminal() {
			it.Expiration = expiration(now, r.Expires)
		}
		if err := ctx.Err(); err != nil {
			return store.Record{}, fmt.Errorf("memcachedstore: %s: %w", op, err)
		}
		err = s.client.CompareAndSwap(it)
		if err == nil {
			return r, nil
		}
		if objectTooLarge(err) && shrink != nil {
			// The server's limit is below MaxItem, and its refusal left
			// the item as it was: read it again and write it smaller.
			refused, refusal = len(value), err
			continue
		}
		if !retryable(err) {
			return store.Record{}, translate(op, err)
		}
	}
	return store.Record{}, contended(op)
}

// Get implements [store.Store]: one round trip (gets).
func (s *Store) Get(ctx context.Context, p store.GetParams) (store.Record, error) {
	if err := store.Ready(ctx, "memcachedstore", "get", p); err != nil {
		return store.Record{}, err
	}
	h := recordHash(p.Scope, p.Key)
	it, err := s.client.Get(s.recordKey(h))
	if errors.Is(err, memcache.ErrCacheMiss) {
		return store.Record{}, store.ErrNotFound
	}
	if err != nil {
		return store.Record{}, translate("get", err)
	}
	r, err := decode(it.Value, true, p.Scope, p.Key, h)
	if errors.Is(err, errForeign) {
		return store.Record{}, store.ErrNotFound
	}
	if err != nil {
		return store.Record{}, fmt.Errorf("memcachedstore: get: item %s: %w", it.Key, err)
	}
	if !r.Live(p.Now) {
		return store.Record{}, store.ErrNotFound
	}
	return r, nil
}

// Prune implements [store.Store]. Memcached drops settled records itself when
// their expiration passes, so Prune only validates p and reports 0.
func (s *Store) Prune(ctx context.Context, p store.PruneParams) (int, error) {
	if err := p.Validate(); err != nil {
		return 0, err
	}
	return 0, nil
}

// translate turns a client error into the vocabulary of package idem: an
// item the server refused as too large wraps [store.ErrInvalid] (Config.MaxItem
// is above the server's limit, and the record could not be made smaller:
// see [Store.Finish]); a malformed key or a CLIENT_ERROR reply (a
// bug) is wrapped as it is; a write refused for want of memory (SERVER_ERROR
// out of memory, memcached -M) is [store.Refused]: the server was reached,
// and may hold the record; anything else is a failure to reach Memcached or
// to get its answer (network errors, timeouts, no servers, SERVER_ERROR) and
// wraps [store.ErrUnavailable].
func translate(op string, err error) error {
	msg := err.Error()
	switch {
	case errors.Is(err, context.Canceled):
		return fmt.Errorf("memcachedstore: %s: %w", op, err)
	case strings.Contains(msg, "SERVER_ERROR object too large"):
		return fmt.Errorf("memcachedstore: %s: %w: the server's item size limit is below Config.MaxItem: %w", op, store.ErrInvalid, err)
	case strings.Contains(msg, "SERVER_ERROR out of memory"):
		return fmt.Errorf("memcachedstore: %s: %w", op, store.Refused(err))
	case errors.Is(err, memcache.ErrMalformedKey), strings.Contains(msg, "CLIENT_ERROR"):
		return fmt.Errorf("memcachedstore: %s: %w", op, err)
	}
	return fmt.Errorf("memcachedstore: %s: %w: %w", op, store.ErrUnavailable, err)
}

var _ store.DurabilityReporter = (*Store)(nil)

// Durability implements [store.DurabilityReporter]: Memcached keeps records in
// memory only.
func (s *Store) Durability(context.Context) (store.Durability, error) {
	return store.Durability{Detail: "memcached keeps records in memory only: a restart, or an eviction, loses them"}, nil
}
