// Package redisstore is an [store.Store] on Redis (6.2 or later), standalone or
// Redis Cluster, through go-redis v9. Its [Notifier] wakes callers waiting in
// [store.Engine.Await] on other instances through pub/sub as soon as a record
// is settled.
//
// # Layout
//
// Records are spread over a fixed number of shards ([Config.Shards]); a
// record's shard is crc32(scope + "\x00" + key) mod Shards. Every key of a
// shard begins with the same hash tag, so on Redis Cluster a record and its
// shard's index live in one slot and every script touches one slot only:
//
//	<prefix>{<prefix>:<shard>}:<len(scope)>:<scope>:<key>   hash: one record
//	<prefix>{<prefix>:<shard>}:pending                      sorted set: the shard's unsettled records
//
// The prefix may not hold braces, so the first {…} of every key is the hash
// tag, whatever the scope and key contain; the scope's length makes scope
// and key unambiguous ("a:b","c" is not "a","b:c"). A record's hash has the
// fields state, fp, token, fence, lease, ts (takeover safe, 0 or 1), resp
// (the bytes of [store.Response.MarshalBinary], only while COMPLETED),
// created, updated, exp (0 while unsettled), scope, key and cps (the
// checkpoints: the concatenated [store.AppendCheckpoint] lines, oldest first;
// absent when there are none). Times are unix milliseconds taken from the
// params (the store never reads a clock, nor Redis TIME); they are truncated
// to the millisecond and come back in UTC. A checkpoint's own time, inside
// cps, is kept as the params gave it.
//
// The pending set of a shard lists its IN_PROGRESS and UNKNOWN records
// (member: the record's Redis key; score: the lease's end in milliseconds,
// or for a record marked UNKNOWN by its owner before that, the time it was
// marked). [Store.Scan] reads only these sets.
//
// No index lists the settled records, so [Store.List] (an operator's tool,
// off the hot path) reads every key of Redis with SCAN, MATCH
// <prefix>{<prefix>:*}:* and TYPE hash, node after node: the one server, or
// each master of a cluster in the order of their addresses. It filters by
// scope and key on the Redis key, then on the record's hash read without
// its response and checkpoints. Its cursor holds the node, the SCAN cursor,
// and the scope and key of the matching records a SCAN call returned beyond
// the page's room. Those are few: a call that finds more than fit is made
// again with a COUNT of the room left, and Redis returns little more than
// COUNT keys. A resharding of a cluster during a listing may hide the
// records it moves from that listing; a master that is gone fails the next
// page with [store.ErrUnavailable].
//
// Settled records (COMPLETED, FAILED) get a Redis TTL equal to their
// remaining retention, so Redis deletes them itself and [Store.Prune] has
// nothing to do. IN_PROGRESS and UNKNOWN records never have a TTL: they may
// stand for a side effect nobody has accounted for yet, and the reconciler
// needs them. Run Redis with maxmemory-policy noeviction, or without a
// maxmemory: when memory fills, a volatile-* policy evicts settled records,
// which have a TTL, within their retention (the next retry of a COMPLETED
// one runs the work again instead of replaying it), and an allkeys-* policy
// may evict a running record or a shard's pending set too. Under noeviction
// a full Redis refuses writes instead, which the store reports as
// unavailable. [Store.Durability] reports any other setting as not crash
// safe.
//
// # Round trips
//
// Each operation is one Lua script, so one round trip: acquire 1 (the same
// script returns the existing record, so the lookup that decides a replay is
// that round trip too), renew 1, checkpoint 1, complete/release/mark-unknown
// 1, get 1 (HGETALL). Scripts that callers run at the same time share round
// trips: those that come while pipelines are on their way go in the next
// one ([store.Batcher]; up to 4 pipelines at once), one network write and
// read for all of them, each script still atomic on its own.
//
// A scan page costs 2 pipelined round trips when nothing changes under it:
// one pipeline runs a range script on the pending set of every shard from
// the cursor's on (each returns at most Limit+1 members whose score is due),
// and one fetches those records (HGETALL each); records that settle or
// vanish between the two cost another pair. On Cluster a pipeline
// goes to every node concurrently. The first run of a script on a server
// that has not cached it costs one more round trip (EVALSHA answers
// NOSCRIPT, then EVAL).
//
// A list page costs one round trip per SCAN call (COUNT 1000, or the page's
// room when a call found more matching records than fit, which is then made
// again), one pipeline per call that returned keys passing the scope and key
// filter (HMGET of each), and one pipeline that reads the page's records
// whole (HGETALL each). A page goes on until it is full or every key has
// been read, so a whole listing costs O(keys in Redis) work on the servers,
// about one SCAN call per 1000 keys of each node, whatever the filter.
//
// # Errors
//
// Errors are translated at the store's edge: a token that no longer owns
// the record gives [store.ErrLeaseLost], a missing or expired record
// [store.ErrNotFound], and a failure to reach Redis or to get its answer
// (refused or broken connections, timeouts, a closed client or exhausted
// pool, a deadline that ran out) wraps [store.ErrUnavailable], and so does
// a refusal of a call on records that may pass: LOADING, CLUSTERDOWN,
// TRYAGAIN, MASTERDOWN, READONLY, BUSY, max-clients, OOM, MISCONF,
// NOREPLICAS (the writes refused, READONLY, OOM, MISCONF, NOREPLICAS, with
// [store.ErrRefused] too); MOVED and ASK once go-redis's redirections ran
// out; NOAUTH, WRONGPASS, NOPERM (with [store.ErrDenied] too). Neither is
// ever a reason to fail open; on Redis 6.2 these come wrapped in "ERR Error running script". The scripts return each decision they make as a value, so a
// script that fails on what it found (a key of another type, a damaged
// record) is Redis's answer about that record, wrapped as it is. A
// cancelled context stays recognisable with errors.Is, and is not
// unavailability. The calls that are not about records
// ([Store.Durability], the [Notifier]'s) take an error reply that refuses
// the command (an ACL's NOPERM, a renamed command) as Redis's answer, and
// only the replies of a server that is starting, failing over or
// overloaded as unavailability.
//
// # Durability
//
// Redis durability is the server's, not this package's. Without AOF and
// appendfsync always, a crash or failover loses the most recent writes. A
// lost COMPLETED record turns a replay into a re-run, and a lost IN_PROGRESS
// record lets a retry run the work a second time while the first run may
// still be going: the exactly-once promise holds only as long as Redis keeps
// what it acknowledged, and a failover to a replica that had not yet
// received the last writes loses them just the same (replication is
// asynchronous, and the store does not WAIT for replicas). Where a duplicate
// side effect is unacceptable, run Redis with appendonly yes and appendfsync
// always, maxmemory-policy noeviction (or no maxmemory) and no replicas, or
// use a store backed by a database that syncs its commits.
// [Store.Durability] reads these settings (INFO, and CONFIG GET for
// appendfsync and save; when CONFIG is refused or renamed, appendfsync is
// unknown and the server is not called crash safe) and reports a server
// that lacks any of them, or has replicas, as not crash safe.
//
// # Performance
//
// Measured with go test -run '^$' -bench . -benchtime 5000x against a local
// Redis 7.0 (loopback TCP, one request at a time, a 2-vCPU VM shared with
// other work; median of 10 interleaved runs), next to the bare driver
// commands a hand-written idempotency check needs:
//
//	benchmark                                  ns/op    ops/s   round trips/op
//	AcquireComplete (acquire new + complete)  293009     3413   2
//	RawSetNXSet (SET NX PX, then SET XX)      234782     4259   2
//	Replay (acquire of a completed key)       135990     7354   1
//	RawGet (GET)                              114204     8756   1
//
// idem/raw: AcquireComplete/RawSetNXSet = 1.25, Replay/RawGet = 1.19. Both
// make the same number of round trips; the difference is the work Redis
// does in the scripts (18.6 µs of server time per script call on average,
// against 0.9 µs for GET and 3.5 µs for SET, by INFO commandstats) and the
// decoding of a whole record. On this VM a loopback round trip cost about
// 100 µs during that run, which hides most of the difference; in earlier
// runs, when it cost about 15 µs, idem took about 3 times as long as the raw
// commands (measured with an earlier acquire script that read the hash twice).
package redisstore

import (
	"context"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"math"
	"net"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/idemhq/idem/store"
	"github.com/redis/go-redis/v9"
)

var _ store.Store = (*Store)(nil)

// Defaults for [Config].
const (
	// DefaultPrefix begins every Redis key the store writes.
	DefaultPrefix = "idem"
	// DefaultShards is the number of shards records are spread over.
	DefaultShards = 64
	// MaxShards is the largest number of shards, as many as Redis Cluster
	// has hash slots.
	MaxShards = 16384
)

// Config configures a [Store]. The zero value of every field but Client is a
// sensible default.
type Config struct {
	// Client talks to Redis: a *redis.Client, a *redis.ClusterClient, or any
	// other redis.UniversalClient. Required. The store does not close it.
	// Build it with ContextTimeoutEnabled set in its options: without it,
	// go-redis ignores a call's deadline while it waits for Redis, and a
	// Redis that stops answering holds each call for the client's
	// ReadTimeout (5 s by default) whatever the engine's StoreTimeout.
	Client redis.UniversalClient
	// Prefix begins every key the store writes, so several stores (or other
	// data) can share one Redis. It must not contain '{' or '}'. Defaults to
	// [DefaultPrefix].
	Prefix string
	// Shards is the number of shards records are spread over, 1 to
	// [MaxShards]. The keys of a shard share one Redis Cluster hash slot, so
	// more shards spread the records over more nodes of a cluster; but a scan
	// page runs one script per shard (in one pipeline), so more shards make
	// scans dearer. Shards decides where a record lives: it must never change
	// for a deployment, since a store with another value does not find the
	// records already written. Defaults to [DefaultShards].
	Shards int
}

// Store is an [store.Store] on Redis. It is safe for concurrent use, and any
// number of processes may share one Redis through stores with the same
// Prefix and Shards. Make one with [New].
type Store struct {
	client  redis.UniversalClient
	shards  uint32
	tags    []string // tags[i] = prefix + "{" + prefix + ":" + i + "}"
	pending []string // pending[i] = tags[i] + ":pending"
	records string   // a SCAN pattern that matches the keys of every shard
	// calls sends the scripts that callers run at the same time in one
	// pipeline: one network write and read for all of them.
	calls store.Batcher[*scriptCall]
}

// New returns a store for cfg. The error wraps [store.ErrInvalid] when cfg is
// not valid. New does not contact Redis.
func New(cfg Config) (*Store, error) {
	if cfg.Client == nil {
		return nil, fmt.Errorf("redisstore: %w: config has no client", store.ErrInvalid)
	}
	prefix := cfg.Prefix
	if prefix == "" {
		prefix = DefaultPrefix
	}
	if strings.ContainsAny(prefix, "{}") {
		return nil, fmt.Errorf("redisstore: %w: prefix %q contains a brace", store.ErrInvalid, prefix)
	}
	shards := cfg.Shards
	if shards == 0 {
		shards = DefaultShards
	}
	if shards < 1 || shards > MaxShards {
		return nil, fmt.Errorf("redisstore: %w: shards must be 1 to %d, not %d", store.ErrInvalid, MaxShards, shards)
	}
	glob := globEscape(prefix)
	s := &Store{client: cfg.Client, shards: uint32(shards), tags: make([]string, shards), pending: make([]string, shards),
		records: glob + "{" + glob + ":*}:*"}
	for i := range shards {
		s.tags[i] = prefix + "{" + prefix + ":" + strconv.Itoa(i) + "}"
		s.pending[i] = s.tags[i] + ":pending"
	}
	s.calls.Run, s.calls.Runners = s.pipeline, pipelines
	return s, nil
}

// shard returns the shard of a record.
func (s *Store) shard(scope, key string) uint32 {
	h := crc32.Update(0, crc32.IEEETable, []byte(scope))
	h = crc32.Update(h, crc32.IEEETable, []byte{0})
	h = crc32.Update(h, crc32.IEEETable, []byte(key))
	return h % s.shards
}

// keys returns the Redis key of a record and its shard's pending set.
func (s *Store) keys(scope, key string) (record, pending string) {
	i := s.shard(scope, key)
	return s.tags[i] + ":" + strconv.Itoa(len(scope)) + ":" + scope + ":" + key, s.pending[i]
}

// recordRef returns the scope and key of a record's Redis key, and false for
// a key that is not the key of one of this store's records (a pending set,
// another store's record).
func (s *Store) recordRef(rec string) (scope, key string, ok bool) {
	_, rest, _ := strings.Cut(rec, "}:") // the prefix holds no brace
	n, rest, _ := strings.Cut(rest, ":")
	l, err := strconv.Atoi(n)
	if err != nil || l < 0 || l >= len(rest) || rest[l] != ':' {
		return "", "", false
	}
	scope, key = rest[:l], rest[l+1:]
	if r, _ := s.keys(scope, key); r != rec {
		return "", "", false
	}
	return scope, key, true
}

// globEscape quotes the characters SCAN's MATCH patterns give a meaning.
func globEscape(s string) string {
	var b strings.Builder
	for i := range len(s) {
		if strings.IndexByte(`*?[]\`, s[i]) >= 0 {
			b.WriteByte('\\')
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// ms converts a time to unix milliseconds, as stored.
func ms(t time.Time) string { return strconv.FormatInt(t.UnixMilli(), 10) }

// fromMS is t as a read of what ms stored returns it.
func fromMS(t time.Time) time.Time { return time.UnixMilli(t.UnixMilli()).UTC() }

// acquireScript applies store.AcquireParams.Apply to the record in KEYS[1]
// and returns the record as it is afterwards: 1 when it created it where
// there was none (the caller knows that record: the params made it), else
// the values of recordFields, in that order, false (nil) for a field the
// record does not have. It reads an existing record once (a new key only
// with EXISTS, which costs the server less than reading 13 absent fields),
// and returns what it read or wrote without reading it again. A re-creation
// starts with no checkpoints; the UNKNOWN transition and a takeover keep them.
//
// KEYS: record, pending. ARGV: now, fp, token, lease, ts, scope, key.
var acquireScript = redis.NewScript(`
local rec, pending = KEYS[1], KEYS[2]
local now = tonumber(ARGV[1])
local r = {} -- a new key: cheaper than reading 13 absent fields
if redis.call('EXISTS', rec) == 1 then
  r = redis.call('HMGET', rec, 'state', 'fp', 'token', 'fence', 'lease', 'ts', 'resp',
    'created', 'updated', 'exp', 'scope', 'key', 'cps')
end
local state, exp = r[1], tonumber(r[10]) or 0
local live = state and (exp == 0 or now < exp)
if not live or state == 'failed' then
  local fence = '1'
  if live then fence = tostring(tonumber(r[4]) + 1) end
  r = {'in_progress', ARGV[2], ARGV[3], fence, ARGV[4], ARGV[5], false, ARGV[1], ARGV[1], '0', ARGV[6], ARGV[7], false}
  if state then
    redis.call('DEL', rec) -- drops the old response, checkpoints and TTL
  end
  redis.call('HSET', rec, 'state', r[1], 'fp', r[2], 'token', r[3], 'fence', r[4], 'lease', r[5],
    'ts', r[6], 'created', r[8], 'updated', r[9], 'exp', r[10], 'scope', r[11], 'key', r[12])
  redis.call('ZADD', pending, r[5], rec)
  if not state then
    return 1
  end
elseif state == 'in_progress' and now >= tonumber(r[5]) then
  if r[6] ~= '1' then
    r[1], r[9] = 'unknown', ARGV[1]
    redis.call('HSET', rec, 'state', r[1], 'updated', r[9])
  elseif r[2] == ARGV[2] then
    r[3], r[4], r[5], r[6], r[9] = ARGV[3], tostring(tonumber(r[4]) + 1), ARGV[4], ARGV[5], ARGV[1]
    redis.call('HSET', rec, 'token', r[3], 'fence', r[4], 'lease', r[5], 'ts', r[6], 'updated', r[9])
    redis.call('PERSIST', rec)
    redis.call('ZADD', pending, r[5], rec)
  end
end
return r
`)

// recordFields are the fields of a record's hash, in the order
// acquireScript returns their values.
var recordFields = [...]string{"state", "fp", "token", "fence", "lease", "ts", "resp", "created", "updated", "exp", "scope", "key", "cps"}

// renewScript applies store.RenewParams.Apply: 1 when renewed, 0 when the
// lease is lost.
//
// KEYS: record, pending. ARGV: token, now, lease.
var renewScript = redis.NewScript(`
local cur = redis.call('HMGET', KEYS[1], 'state', 'token', 'lease')
if cur[1] ~= 'in_progress' or cur[2] ~= ARGV[1] or tonumber(ARGV[2]) >= tonumber(cur[3]) then
  return 0
end
redis.call('HSET', KEYS[1], 'lease', ARGV[3], 'updated', ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[3], KEYS[1])
return 1
`)

// checkpointScript applies store.CheckpointParams.Apply: 1 when the
// checkpoint was appended (and the record is no longer takeover safe), 0 when
// the lease is lost. The lease does not change, so neither does the pending
// set. A checkpoint that is already the last one, the same line (name,
// data, time), is not appended again: go-redis sends a script again by
// itself when its reply is lost, and the first run did append it.
//
// KEYS: record. ARGV: token, now, checkpoint (its store.AppendCheckpoint line).
var checkpointScript = redis.NewScript(`
local cur = redis.call('HMGET', KEYS[1], 'state', 'token', 'lease', 'cps')
if cur[1] ~= 'in_progress' or cur[2] ~= ARGV[1] or tonumber(ARGV[2]) >= tonumber(cur[3]) then
  return 0
end
local cps, line = cur[4] or '', ARGV[3]
if #cps >= #line and string.sub(cps, -#line) == line and (#cps == #line or string.sub(cps, -#line - 1, -#line - 1) == '\n') then
  return 1
end
redis.call('HSET', KEYS[1], 'cps', cps .. line, 'ts', '0', 'updated', ARGV[2])
return 1
`)

// finishScript applies store.FinishParams.Apply: 1 when settled, 0 when the
// lease is lost. A terminal record leaves the pending set and expires at
// retention; an UNKNOWN one stays pending, scored at most now so that a scan
// finds it at once. When repeat is 1, a repeat of the write that settled the
// record (same token, terminal state and response) returns 1 and writes
// nothing.
//
// KEYS: record, pending. ARGV: token, now, state, exp, ttl (ms), resp, repeat.
var finishScript = redis.NewScript(`
local cur = redis.call('HMGET', KEYS[1], 'state', 'token')
if cur[2] ~= ARGV[1] then
  return 0
end
if cur[1] ~= 'in_progress' and cur[1] ~= 'unknown' then
  if ARGV[7] == '1' and cur[1] == ARGV[3] and (ARGV[3] == 'failed' or (ARGV[3] == 'completed' and redis.call('HGET', KEYS[1], 'resp') == ARGV[6])) then
    return 1
  end
  return 0
end
if ARGV[3] == 'unknown' then
  redis.call('HSET', KEYS[1], 'state', 'unknown', 'updated', ARGV[2])
  redis.call('ZADD', KEYS[2], 'LT', ARGV[2], KEYS[1])
  return 1
end
if ARGV[3] == 'completed' then
  redis.call('HSET', KEYS[1], 'state', ARGV[3], 'exp', ARGV[4], 'updated', ARGV[2], 'resp', ARGV[6])
else
  redis.call('HSET', KEYS[1], 'state', ARGV[3], 'exp', ARGV[4], 'updated', ARGV[2])
end
redis.call('ZREM', KEYS[2], KEYS[1])
redis.call('PEXPIRE', KEYS[1], ARGV[5])
return 1
`)

// scanScript returns up to limit members of a pending set with a score of at
// most now, in (score, member) order, starting strictly after the position
// (score, member) when one is given, as a flat list member, score, ….
// Members compare bytewise, as Redis orders them (Lua's < uses the locale).
//
// KEYS: pending. ARGV: now, after score ("" for the start), after member, limit.
var scanScript = redis.NewScript(`
local key, now, s, m, limit = KEYS[1], tonumber(ARGV[1]), ARGV[2], ARGV[3], tonumber(ARGV[4])
local function lesseq(a, b)
  local n = math.min(#a, #b)
  for i = 1, n do
    local x, y = string.byte(a, i), string.byte(b, i)
    if x ~= y then return x < y end
  end
  return #a <= #b
end
local start = 0
if s ~= '' then
  local cur = redis.call('ZSCORE', key, m)
  if cur and tonumber(cur) == tonumber(s) then
    start = redis.call('ZRANK', key, m) + 1
  else
    -- The member moved or left: find the first member after (s, m) among
    -- those that share the score s, which occupy ranks [lo, hi).
    local lo = redis.call('ZCOUNT', key, '-inf', '(' .. s)
    local hi = lo + redis.call('ZCOUNT', key, s, s)
    while lo < hi do
      local mid = math.floor((lo + hi) / 2)
      if lesseq(redis.call('ZRANGE', key, mid, mid)[1], m) then lo = mid + 1 else hi = mid end
    end
    start = lo
  end
end
local got = redis.call('ZRANGE', key, start, start + limit - 1, 'WITHSCORES')
local out = {}
for i = 1, #got, 2 do
  if tonumber(got[i + 1]) > now then break end
  out[#out + 1] = got[i]
  out[#out + 1] = got[i + 1]
end
return out
`)

// Acquire implements [store.Store]: one round trip, which also returns the
// existing record when there is one.
func (s *Store) Acquire(ctx context.Context, p store.AcquireParams) (store.Record, error) {
	if err := store.Ready(ctx, "redisstore", "acquire", p); err != nil {
		return store.Record{}, err
	}
	rec, pending := s.keys(p.Scope, p.Key)
	ts := "0"
	if p.TakeoverSafe {
		ts = "1"
	}
	res, err := s.run(ctx, acquireScript, []string{rec, pending},
		ms(p.Now), string(p.Fingerprint), p.Token, ms(p.LeaseExpires), ts, p.Scope, p.Key)
	if err != nil {
		return store.Record{}, translate("acquire", err)
	}
	if created, ok := res.(int64); ok && created == 1 {
		r, _ := p.Apply(nil)
		r.LeaseExpires, r.Created, r.Updated = fromMS(p.LeaseExpires), fromMS(p.Now), fromMS(p.Now) // as stored
		return r, nil
	}
	v, ok := res.([]any)
	if !ok {
		return store.Record{}, fmt.Errorf("redisstore: acquire: the script returned %T", res)
	}
	fields, err := fieldValues(recordFields[:], v)
	if err != nil {
		return store.Record{}, fmt.Errorf("redisstore: acquire: %w", err)
	}
	r, err := decode(fields)
	if err != nil {
		return store.Record{}, fmt.Errorf("redisstore: acquire: stored record: %w", err)
	}
	return r, nil
}

// Renew implements [store.Store]: one round trip.
func (s *Store) Renew(ctx context.Context, p store.RenewParams) error {
	if err := store.Ready(ctx, "redisstore", "renew", p); err != nil {
		return err
	}
	rec, pending := s.keys(p.Scope, p.Key)
	res, err := s.run(ctx, renewScript, []string{rec, pending}, p.Token, ms(p.Now), ms(p.LeaseExpires))
	if err != nil {
		return translate("renew", err)
	}
	if n, _ := res.(int64); n != 1 {
		return store.ErrLeaseLost
	}
	return nil
}

// Checkpoint implements [store.Store]: one round trip.
func (s *Store) Checkpoint(ctx context.Context, p store.CheckpointParams) error {
	if err := store.Ready(ctx, "redisstore", "checkpoint", p); err != nil {
		return err
	}
	rec, _ := s.keys(p.Scope, p.Key)
	res, err := s.run(ctx, checkpointScript, []string{rec},
		p.Token, ms(p.Now), store.AppendCheckpoint(nil, p.Checkpoint()))
	if err != nil {
		return translate("checkpoint", err)
	}
	if n, _ := res.(int64); n != 1 {
		return store.ErrLeaseLost
	}
	return nil
}

// Finish implements [store.Store]: one round trip. A COMPLETED or FAILED
// record gets a Redis TTL of its remaining retention (at least 1 ms).
func (s *Store) Finish(ctx context.Context, p store.FinishParams) error {
	if err := store.Ready(ctx, "redisstore", "finish", p); err != nil {
		return err
	}
	var resp []byte
	if p.Response != nil {
		var err error
		if resp, err = p.Response.MarshalBinary(); err != nil {
			return fmt.Errorf("redisstore: finish: encoding the response: %w", err)
		}
	}
	exp, ttl := "0", "0"
	if p.State.Terminal() {
		exp = ms(p.Expires)
		ttl = strconv.FormatInt(max(p.Expires.UnixMilli()-p.Now.UnixMilli(), 1), 10)
	}
	rec, pending := s.keys(p.Scope, p.Key)
	repeat := "0"
	if p.Repeat {
		repeat = "1"
	}
	res, err := s.run(ctx, finishScript, []string{rec, pending},
		p.Token, ms(p.Now), string(p.State), exp, ttl, resp, repeat)
	if err != nil {
		return translate("finish", err)
	}
	if n, _ := res.(int64); n != 1 {
		return store.ErrLeaseLost
	}
	return nil
}

// Get implements [store.Store]: one round trip (HGETALL).
func (s *Store) Get(ctx context.Context, p store.GetParams) (store.Record, error) {
	if err := store.Ready(ctx, "redisstore", "get", p); err != nil {
		return store.Record{}, err
	}
	rec, _ := s.keys(p.Scope, p.Key)
	fields, err := s.client.HGetAll(ctx, rec).Result()
	if err != nil {
		return store.Record{}, translate("get", err)
	}
	if len(fields) == 0 {
		return store.Record{}, store.ErrNotFound
	}
	r, err := decode(fields)
	if err != nil {
		return store.Record{}, fmt.Errorf("redisstore: get: stored record: %w", err)
	}
	if !r.Live(p.Now) {
		return store.Record{}, store.ErrNotFound
	}
	return r, nil
}

// position is where a scan stands: in a shard, after the pending member
// with the given score, or at the shard's start when score is empty.
type position struct {
	shard  uint32
	score  string
	member string
}

// Scan implements [store.Store]. It walks the shards in order, and each
// shard's pending set in (score, member) order; the cursor is the last
// position examined, so a page resumes strictly after it and every stale
// record that does not change during a scan is returned exactly once. A page
// costs 2 round trips (pipelines) when nothing changes under it; see the
// package documentation.
func (s *Store) Scan(ctx context.Context, p store.ScanParams) (store.ScanResult, error) {
	if err := store.Ready(ctx, "redisstore", "scan", p); err != nil {
		return store.ScanResult{}, err
	}
	pos, err := s.decodeCursor(p.Cursor)
	if err != nil {
		return store.ScanResult{}, err
	}
	size := p.PageSize()
	now := ms(p.Now)
	var res store.ScanResult
	for pos.shard < s.shards {
		cands, more, err := s.candidates(ctx, pos, now, size-len(res.Records))
		if err != nil {
			return store.ScanResult{}, err
		}
		if len(cands) == 0 {
			break
		}
		members := make([]string, len(cands))
		for i, c := range cands {
			members[i] = c.member
		}
		recs, err := s.fetch(ctx, "scan", members)
		if err != nil {
			return store.ScanResult{}, err
		}
		for _, r := range recs {
			if r != nil && r.Live(p.Now) && r.Stale(p.Now) {
				res.Records = append(res.Records, *r)
			}
		}
		pos = cands[len(cands)-1]
		if !more {
			break
		}
		if len(res.Records) == size {
			res.Cursor = s.encodeCursor(pos)
			break
		}
	}
	return res, nil
}

// candidates returns, in scan order, up to limit pending members after pos
// with a score of at most now, and whether there are more. It is one
// pipeline: a range script on every shard from pos.shard on, each asked for
// limit+1 members.
func (s *Store) candidates(ctx context.Context, pos position, now string, limit int) ([]position, bool, error) {
	calls := make([]*scriptCall, 0, s.shards-pos.shard)
	for i := pos.shard; i < s.shards; i++ {
		score, member := "", ""
		if i == pos.shard {
			score, member = pos.score, pos.member
		}
		calls = append(calls, &scriptCall{keys: []string{s.pending[i]}, args: []any{now, score, member, limit + 1}})
	}
	cmds := s.runScripts(ctx, scanScript, calls)
	var out []position
	for j, cmd := range cmds {
		v, err := cmd.StringSlice()
		if err != nil {
			return nil, false, translate("scan", err)
		}
		if len(v)%2 != 0 {
			return nil, false, fmt.Errorf("redisstore: scan: range script returned %d values", len(v))
		}
		for k := 0; k < len(v); k += 2 {
			if len(out) == limit {
				return out, true, nil
			}
			out = append(out, position{shard: pos.shard + uint32(j), score: v[k+1], member: v[k]})
		}
	}
	return out, false, nil
}

// fetch reads the records under the Redis keys recs in one pipeline (none
// when there are none), for the operation op; a record that vanished is nil.
func (s *Store) fetch(ctx context.Context, op string, recs []string) ([]*store.Record, error) {
	if len(recs) == 0 {
		return nil, nil
	}
	pipe := s.client.Pipeline()
	cmds := make([]*redis.MapStringStringCmd, len(recs))
	for i, rec := range recs {
		cmds[i] = pipe.HGetAll(ctx, rec)
	}
	if _, err := pipe.Exec(ctx); err != nil {
		return nil, translate(op, err)
	}
	out := make([]*store.Record, len(recs))
	for i, cmd := range cmds {
		fields := cmd.Val()
		if len(fields) == 0 {
			continue
		}
		r, err := decode(fields)
		if err != nil {
			return nil, fmt.Errorf("redisstore: %s: stored record: %w", op, err)
		}
		out[i] = &r
	}
	return out, nil
}

// A scriptCall is a script to run on keys with args; script nil is the
// script of the runScripts call. A pipeline sets res, its result.
type scriptCall struct {
	script *redis.Script
	keys   []string
	args   []any
	res    any
}

// pipelines is how many pipelines of a store's calls run at once.
const pipelines = 4

// run runs script as one of the calls that share a pipeline, and returns its
// result.
func (s *Store) run(ctx context.Context, script *redis.Script, keys []string, args ...any) (any, error) {
	c := &scriptCall{script: script, keys: keys, args: args}
	if err := s.calls.Do(ctx, c); err != nil {
		return nil, err
	}
	return c.res, nil
}

// pipeline runs a batch of calls in one pipeline (runScripts), or a lone
// call on its own, and sets each one's result.
func (s *Store) pipeline(ctx context.Context, calls []*scriptCall) []error {
	if len(calls) == 1 { // alone: a plain call costs less than a pipeline
		c := calls[0]
		var err error
		c.res, err = c.script.Run(ctx, s.client, c.keys, c.args...).Result()
		return []error{err}
	}
	cmds := s.runScripts(ctx, nil, calls)
	errs := make([]error, len(calls))
	for i, cmd := range cmds {
		calls[i].res, errs[i] = cmd.Result()
	}
	return errs
}

// runScripts runs each call's script (or script, for a call without one)
// in one pipeline (EVALSHA), then runs again with EVAL, in a second
// pipeline, the calls that found their script missing from the server's
// cache. Each command carries its own error (a failed pipeline sets it on
// every command).
func (s *Store) runScripts(ctx context.Context, script *redis.Script, calls []*scriptCall) []*redis.Cmd {
	scriptOf := func(c *scriptCall) *redis.Script {
		if c.script != nil {
			return c.script
		}
		return script
	}
	cmds := make([]*redis.Cmd, len(calls))
	pipe := s.client.Pipeline()
	for i, c := range calls {
		cmds[i] = scriptOf(c).EvalSha(ctx, pipe, c.keys, c.args...)
	}
	_, _ = pipe.Exec(ctx)
	pipe = s.client.Pipeline()
	var again bool
	for i, cmd := range cmds {
		if isNoScript(cmd.Err()) {
			cmds[i] = scriptOf(calls[i]).Eval(ctx, pipe, calls[i].keys, calls[i].args...)
			again = true
		}
	}
	if again {
		_, _ = pipe.Exec(ctx)
	}
	return cmds
}

func isNoScript(err error) bool {
	return err != nil && (errors.Is(err, redis.ErrNoScript) || redis.HasErrorPrefix(err, "NOSCRIPT"))
}

// owner names this store in its cursors: its prefix (the first tag holds
// it) and its number of shards.
func (s *Store) owner() string {
	return "redisstore:" + s.tags[0] + ":" + strconv.Itoa(int(s.shards))
}

func (s *Store) encodeCursor(pos position) string {
	return store.EncodeCursor(s.owner(), strconv.FormatUint(uint64(pos.shard), 10), pos.score, pos.member)
}

func (s *Store) decodeCursor(c string) (position, error) {
	if c == "" {
		return position{}, nil
	}
	f, err := store.DecodeCursor(c, s.owner(), 3)
	if err != nil {
		return position{}, fmt.Errorf("redisstore: scan: %w", err)
	}
	bad := fmt.Errorf("redisstore: scan: %w: the cursor names a position this store does not have", store.ErrInvalid)
	shard, err := strconv.ParseUint(f[0], 10, 32)
	if err != nil || shard >= uint64(s.shards) || !strings.HasPrefix(f[2], s.tags[shard]+":") {
		return position{}, bad
	}
	if sc, err := strconv.ParseFloat(f[1], 64); err != nil || math.IsNaN(sc) || math.IsInf(sc, 0) {
		return position{}, bad
	}
	return position{shard: uint32(shard), score: f[1], member: f[2]}, nil
}

// listCount is the COUNT of a listing's SCAN calls: how many keys Redis
// looks at in one call (fewer when a page has less room left).
const listCount = 1000

// summaryFields are the fields of a record's hash but its response and
// checkpoints: enough to decide whether it matches a listing.
var summaryFields = []string{"state", "fp", "token", "fence", "lease", "ts", "created", "updated", "exp", "scope", "key"}

// node is a server whose keys a listing scans: the one server of a
// standalone Redis (addr empty), or a master of Redis Cluster.
type node struct {
	addr   string
	client *redis.Client
}

// listCursor is where a listing stands: at SCAN cursor scan of the node
// addr, or past every node when done; carry holds the Redis keys of
// matching records that a SCAN call returned but the page had no room for.
type listCursor struct {
	addr  string
	scan  uint64
	done  bool
	carry []string
}

// List implements [store.Store]. It reads every key of Redis with SCAN, node
// after node, until the page is full or every key has been read; the cursor
// carries the matching records a SCAN call returned beyond the page's room,
// so that none is skipped. When a cursor names a cluster master that is
// gone, List fails with an error wrapping [store.ErrUnavailable]: list
// again. See the package documentation (Layout, Round trips).
func (s *Store) List(ctx context.Context, p store.ListParams) (store.ScanResult, error) {
	if err := store.Ready(ctx, "redisstore", "list", p); err != nil {
		return store.ScanResult{}, err
	}
	c, err := s.decodeListCursor(p.Cursor)
	if err != nil {
		return store.ScanResult{}, err
	}
	nodes, err := s.nodes(ctx)
	if err != nil {
		return store.ScanResult{}, err
	}
	i := 0 // the node being scanned
	switch {
	case c.done:
		i = len(nodes)
	case p.Cursor != "":
		if i = slices.IndexFunc(nodes, func(n node) bool { return n.addr == c.addr }); i < 0 {
			return store.ScanResult{}, fmt.Errorf("redisstore: list: %w: Redis node %q of the cursor is gone (the cluster changed); list again", store.ErrUnavailable, c.addr)
		}
	}
	size := p.PageSize()
	want, count := c.carry, int64(listCount)
	for len(want) < size && i < len(nodes) {
		keys, next, err := nodes[i].client.ScanType(ctx, c.scan, s.records, count, "hash").Result()
		if err != nil {
			return store.ScanResult{}, translate("list", err)
		}
		matched, err := s.matching(ctx, p, keys)
		if err != nil {
			return store.ScanResult{}, err
		}
		if room := int64(size - len(want)); int64(len(matched)) > room && count > room {
			count = room // read the same keys again, fewer at a time
			continue
		}
		want = append(want, matched...)
		c.scan, count = next, listCount
		if next == 0 {
			i++
		}
	}
	c.carry = nil
	if len(want) > size {
		want, c.carry = want[:size], want[size:]
	}
	recs, err := s.fetch(ctx, "list", want)
	if err != nil {
		return store.ScanResult{}, err
	}
	var res store.ScanResult
	for _, r := range recs {
		if r != nil && p.Match(*r) {
			res.Records = append(res.Records, *r)
		}
	}
	c.done, c.addr = i == len(nodes), ""
	if !c.done {
		c.addr = nodes[i].addr
	}
	if !c.done || len(c.carry) > 0 {
		res.Cursor = s.encodeListCursor(c)
	}
	return res, nil
}

// nodes returns the servers a listing scans, in a stable order: the client's
// server, or the masters of a cluster in the order of their addresses.
func (s *Store) nodes(ctx context.Context) ([]node, error) {
	switch c := s.client.(type) {
	case *redis.Client:
		return []node{{client: c}}, nil
	case *redis.ClusterClient:
		var mu sync.Mutex
		var nodes []node
		err := c.ForEachMaster(ctx, func(_ context.Context, m *redis.Client) error {
			mu.Lock()
			defer mu.Unlock()
			nodes = append(nodes, node{addr: m.Options().Addr, client: m})
			return nil
		})
		if err != nil {
			return nil, translate("list", err)
		}
		slices.SortFunc(nodes, func(a, b node) int { return strings.Compare(a.addr, b.addr) })
		return nodes, nil
	}
	return nil, fmt.Errorf("redisstore: list: cannot list the keys of Redis through a %T, only through a *redis.Client or *redis.ClusterClient", s.client)
}

// matching returns, in their order, the keys among keys (as SCAN returned
// them) of the records that match p. It reads them without their responses
// and checkpoints, in one pipeline, skipping at once the keys that are not
// this store's records or whose scope or key does not match.
func (s *Store) matching(ctx context.Context, p store.ListParams, keys []string) ([]string, error) {
	var cands []string
	for _, rec := range keys {
		if scope, key, ok := s.recordRef(rec); ok && strings.HasPrefix(scope, p.ScopePrefix) && strings.HasPrefix(key, p.KeyPrefix) {
			cands = append(cands, rec)
		}
	}
	if len(cands) == 0 {
		return nil, nil
	}
	pipe := s.client.Pipeline()
	cmds := make([]*redis.SliceCmd, len(cands))
	for i, rec := range cands {
		cmds[i] = pipe.HMGet(ctx, rec, summaryFields...)
	}
	if _, err := pipe.Exec(ctx); err != nil {
		return nil, translate("list", err)
	}
	var out []string
	for i, cmd := range cmds {
		fields, err := fieldValues(summaryFields, cmd.Val())
		if err != nil {
			return nil, fmt.Errorf("redisstore: list: stored record: %w", err)
		}
		if len(fields) == 0 {
			continue // vanished
		}
		r, err := decode(fields)
		if err != nil {
			return nil, fmt.Errorf("redisstore: list: stored record: %w", err)
		}
		if p.Match(r) {
			out = append(out, cands[i])
		}
	}
	return out, nil
}

// encodeListCursor makes a listing's cursor: the node's address, its SCAN
// cursor (empty when done), and the scope and key of each carried record,
// one after the other, separated by newlines (they are printable ASCII).
func (s *Store) encodeListCursor(c listCursor) string {
	scan := ""
	if !c.done {
		scan = strconv.FormatUint(c.scan, 10)
	}
	refs := make([]string, 0, 2*len(c.carry))
	for _, rec := range c.carry {
		scope, key, _ := s.recordRef(rec)
		refs = append(refs, scope, key)
	}
	return store.EncodeCursor(s.owner()+":list", c.addr, scan, strings.Join(refs, "\n"))
}

func (s *Store) decodeListCursor(cursor string) (listCursor, error) {
	if cursor == "" {
		return listCursor{}, nil
	}
	f, err := store.DecodeCursor(cursor, s.owner()+":list", 3)
	if err != nil {
		return listCursor{}, fmt.Errorf("redisstore: list: %w", err)
	}
	bad := fmt.Errorf("redisstore: list: %w: the cursor is malformed", store.ErrInvalid)
	c := listCursor{addr: f[0], done: f[1] == ""}
	if !c.done {
		if c.scan, err = strconv.ParseUint(f[1], 10, 64); err != nil {
			return listCursor{}, bad
		}
	}
	if f[2] == "" {
		return c, nil
	}
	refs := strings.Split(f[2], "\n")
	if len(refs)%2 != 0 {
		return listCursor{}, bad
	}
	for j := 0; j < len(refs); j += 2 {
		if store.ValidateScope(refs[j]) != nil || store.ValidateKey(refs[j+1]) != nil {
			return listCursor{}, bad
		}
		rec, _ := s.keys(refs[j], refs[j+1])
		c.carry = append(c.carry, rec)
	}
	return c, nil
}

// Prune implements [store.Store]. Redis deletes settled records itself when
// their TTL (the retention) runs out, so Prune only validates p and reports 0.
func (s *Store) Prune(ctx context.Context, p store.PruneParams) (int, error) {
	if err := p.Validate(); err != nil {
		return 0, err
	}
	return 0, nil
}

// fieldValues turns the values of the fields names (as acquireScript or
// HMGET return them) into a map like HGETALL's, leaving out the fields the
// record does not have.
func fieldValues(names []string, v []any) (map[string]string, error) {
	if len(v) != len(names) {
		return nil, fmt.Errorf("%d values returned, want %d", len(v), len(names))
	}
	m := make(map[string]string, len(v))
	for i, x := range v {
		switch x := x.(type) {
		case nil:
		case string:
			m[names[i]] = x
		default:
			return nil, fmt.Errorf("a %T returned for field %s", x, names[i])
		}
	}
	return m, nil
}

// decode makes a record of the fields of its hash.
func decode(f map[string]string) (store.Record, error) {
	var firstErr error
	num := func(name string) int64 {
		n, err := strconv.ParseInt(f[name], 10, 64)
		if err != nil && firstErr == nil {
			firstErr = fmt.Errorf("field %s is %q, not an integer", name, f[name])
		}
		return n
	}
	at := func(name string) time.Time { return time.UnixMilli(num(name)).UTC() }
	r := store.Record{
		Scope:        f["scope"],
		Key:          f["key"],
		State:        store.State(f["state"]),
		Fingerprint:  store.Fingerprint(f["fp"]),
		Token:        f["token"],
		Fence:        num("fence"),
		LeaseExpires: at("lease"),
		TakeoverSafe: f["ts"] == "1",
		Created:      at("created"),
		Updated:      at("updated"),
	}
	if exp := num("exp"); exp != 0 {
		r.Expires = time.UnixMilli(exp).UTC()
	}
	if firstErr != nil {
		return store.Record{}, firstErr
	}
	if !r.State.Valid() {
		return store.Record{}, fmt.Errorf("state %q is not a state", f["state"])
	}
	if b, ok := f["resp"]; ok {
		r.Response = new(store.Response)
		if err := r.Response.UnmarshalBinary([]byte(b)); err != nil {
			return store.Record{}, err
		}
	}
	if b, ok := f["cps"]; ok {
		var err error
		if r.Checkpoints, err = store.DecodeCheckpoints([]byte(b)); err != nil {
			return store.Record{}, err
		}
	}
	return r, nil
}

// translate turns the error of a call on records (the scripts, and the
// reads of scan, list and get) into the vocabulary of package idem. A
// failure to reach Redis or to get its answer, and every refusal of the
// call for a reason that may pass, wrap [store.ErrUnavailable] (and still
// the context's error, when that was the cause): a server loading, failing
// over, resharding, too busy or refusing writes (OOM, MISCONF, NOREPLICAS,
// READONLY: these with [store.ErrRefused] too); MOVED or ASK once the
// client's redirections ran out; NOAUTH, WRONGPASS, NOPERM (these with
// [store.ErrDenied] too). Redis was reached then, and holds the record,
// which is no reason to fail open; and on Redis 6.2 any of these inside a
// script, wrapped in "ERR Error running script". The engine then keeps the outcome and
// tries again, where another error would drop it. A script that failed on
// what it found (a key of another type, a damaged record) is the store's
// answer about that record, wrapped as it is: asking again gives the same
// answer, and fail_open must not run a request whose record the store holds
// but cannot read. The caller's cancellation is not unavailability. The
// errors the store finds itself (invalid params, a record it cannot decode)
// are not translated.
func translate(op string, err error) error {
	switch {
	case denied(err):
		return fmt.Errorf("redisstore: %s: %w", op, store.Denied(err))
	case writesRefused(err):
		return fmt.Errorf("redisstore: %s: %w", op, store.Refused(err))
	case unreachable(err) || refused(err):
		return fmt.Errorf("redisstore: %s: %w: %w", op, store.ErrUnavailable, err)
	}
	return fmt.Errorf("redisstore: %s: %w", op, err)
}

// noWrites are the codes of a Redis that is up, reads, and refuses writes:
// out of memory under noeviction, a failed snapshot, too few replicas, a
// replica.
var noWrites = []string{"OOM", "MISCONF", "NOREPLICAS", "READONLY"}

// writesRefused reports whether err is Redis refusing a write, plainly or
// inside a script's error: it was reached, and holds the record (see
// [store.ErrRefused]).
func writesRefused(err error) bool { return replied(err, noWrites) }

// replied reports whether err is a reply of Redis with one of codes, plain
// or inside a script's error.
func replied(err error, codes []string) bool {
	var redisErr redis.Error
	if !errors.As(err, &redisErr) {
		return false
	}
	for _, code := range codes {
		if redis.HasErrorPrefix(err, code) {
			return true
		}
	}
	return refusedInScript(redisErr.Error(), codes)
}

// denials are the codes of Redis's refusals of the client's credentials or
// permissions: Redis was reached, and may hold the record (see
// [store.ErrDenied]).
var denials = []string{"NOAUTH", "WRONGPASS", "NOPERM"}

// denied reports whether err is Redis refusing the client's credentials or
// permissions, plainly, inside a script's error (Redis 6.2), or by cutting
// off a client not yet authenticated.
func denied(err error) bool {
	var redisErr redis.Error
	return replied(err, denials) || errors.As(err, &redisErr) && strings.HasPrefix(redisErr.Error(), "ERR Protocol error: unauthenticated")
}

// refusedInScript reports whether msg is the error of a script whose call
// Redis refused with one of codes, as Redis 6.2 reports it: "ERR Error
// running script (call to f_…): @user_script:18: @user_script: 18: -OOM
// command not allowed…".
func refusedInScript(msg string, codes []string) bool {
	if !strings.HasPrefix(msg, "ERR Error running script") {
		return false
	}
	for _, code := range codes {
		if strings.Contains(msg, ": -"+code+" ") {
			return true
		}
	}
	return false
}

// refusals are the codes of Redis's error replies that refuse a call for a
// reason that may pass, beyond those of a server that cannot serve for now
// (see unreachable) and of access denied (see denied): redirections the
// client could not follow.
var refusals = []string{"MOVED", "ASK"}

// transients are the codes of a server that cannot serve for now, as
// they are left inside a script's error (unreachable finds them in a reply
// of their own with go-redis's tests).
var transients = []string{"OOM", "MISCONF", "NOREPLICAS", "READONLY", "LOADING", "BUSY", "MASTERDOWN",
	"CLUSTERDOWN", "TRYAGAIN"}

// refused reports whether err is one of Redis's refusals of a call on
// records that may pass, beyond unreachable's: see translate.
func refused(err error) bool {
	var redisErr redis.Error
	return replied(err, refusals) || errors.As(err, &redisErr) && refusedInScript(redisErr.Error(), transients)
}

// translateServer turns the error of a call that is not about records
// (subscribing, publishing, reading the server's settings) into the
// vocabulary of package idem: a failure to reach Redis or to get its answer,
// and the replies of a server that is starting, failing over or overloaded,
// wrap [store.ErrUnavailable]; any other error Redis answers with (a command
// that an ACL or a rename refuses) is its answer, wrapped as it is, since
// asking again does not change it.
func translateServer(op string, err error) error {
	if unreachable(err) {
		return fmt.Errorf("redisstore: %s: %w: %w", op, store.ErrUnavailable, err)
	}
	return fmt.Errorf("redisstore: %s: %w", op, err)
}

// unreachable reports whether err says that Redis could not be reached, did
// not answer, or is for now unable to serve: see translateServer.
func unreachable(err error) bool {
	if errors.Is(err, context.Canceled) {
		return false // the caller gave up; that says nothing about the store
	}
	if errors.Is(err, context.DeadlineExceeded) || errors.Is(err, redis.ErrClosed) ||
		errors.Is(err, redis.ErrPoolTimeout) || errors.Is(err, redis.ErrPoolExhausted) ||
		errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
		return true
	}
	var netErr net.Error
	if errors.As(err, &netErr) {
		return true
	}
	var redisErr redis.Error
	if errors.As(err, &redisErr) {
		// A server loading, failing over or resharding, too busy, or up but
		// refusing writes (out of memory under noeviction, a failed
		// snapshot, too few replicas).
		return redis.IsLoadingError(err) || redis.IsClusterDownError(err) || redis.IsTryAgainError(err) ||
			redis.IsMasterDownError(err) || redis.IsReadOnlyError(err) || redis.IsMaxClientsError(err) ||
			redis.HasErrorPrefix(err, "BUSY") || redis.HasErrorPrefix(err, "OOM") ||
			redis.HasErrorPrefix(err, "MISCONF") || redis.HasErrorPrefix(err, "NOREPLICAS")
	}
	// Not an answer from Redis: the client could not talk to it.
	return true
}

var _ store.DurabilityReporter = (*Store)(nil)

// Durability implements [store.DurabilityReporter] from each master's
// settings, with the masters' run_ids as the instance: it changes when any
// of them restarts. Records survive a crash only with appendonly yes and
// appendfsync always; and even then Redis loses records it acknowledged
// when it evicts them, or fails over to a replica, so CrashSafe is also
// false when
//
//   - maxmemory is set and maxmemory-policy is not noeviction (under a
//     volatile-* policy Redis evicts settled records within their retention,
//     under allkeys-* running records and the pending sets too; a retry of
//     an evicted record runs the work again), or INFO does not tell;
//   - the master has replicas: connected ones, or on Redis Cluster any that
//     CLUSTER NODES lists for it, connected or not (replication is
//     asynchronous and the store does not WAIT, so a failover loses the
//     writes the replica had not received), or CLUSTER NODES is refused;
//   - the server is itself a replica.
//
// It reads what the servers say at the time of the call: a replica added
// later, or a setting changed, shows in the next call.
func (s *Store) Durability(ctx context.Context) (store.Durability, error) {
	var mu sync.Mutex
	var details, ids []string
	safe := true
	check := func(ctx context.Context, c *redis.Client) error {
		d, id, err := nodeDurability(ctx, c)
		if err != nil {
			return err
		}
		mu.Lock()
		defer mu.Unlock()
		safe = safe && d.CrashSafe
		details = append(details, d.Detail)
		ids = append(ids, id)
		return nil
	}
	var err error
	switch c := s.client.(type) {
	case *redis.ClusterClient:
		err = c.ForEachMaster(ctx, check)
	case *redis.Client:
		err = check(ctx, c)
	default:
		return store.Durability{Detail: "unknown: the Redis client is neither a client nor a cluster client"}, nil
	}
	if err != nil {
		return store.Durability{}, translateServer("durability", err)
	}
	slices.Sort(ids)
	slices.Sort(details)
	return store.Durability{CrashSafe: safe, Detail: strings.Join(slices.Compact(details), "; "), Instance: strings.Join(ids, ",")}, nil
}

// nodeDurability reads one server's settings and run_id. INFO without a
// section (its default sections, one reply on every version) holds all but
// appendfsync and save, which CONFIG GET reads; when CONFIG is refused or
// renamed, appendfsync is unknown, so the server is not called crash safe.
func nodeDurability(ctx context.Context, c *redis.Client) (store.Durability, string, error) {
	info, err := c.Info(ctx).Result()
	if err != nil {
		return store.Durability{}, "", err
	}
	fields := map[string]string{}
	for _, line := range strings.Split(info, "\n") {
		if k, v, ok := strings.Cut(strings.TrimSpace(line), ":"); ok {
			fields[k] = v
		}
	}
	aof := fields["aof_enabled"] == "1"
	fsync := "unknown (CONFIG GET refused)"
	if v, err := c.ConfigGet(ctx, "appendfsync").Result(); err == nil && v["appendfsync"] != "" {
		fsync = v["appendfsync"]
	}
	save := ""
	if v, err := c.ConfigGet(ctx, "save").Result(); err == nil {
		save = v["save"]
	}
	d := store.Durability{}
	switch {
	case aof && fsync == "always":
		d.CrashSafe = true
		d.Detail = "appendonly yes, appendfsync always: every write is on disk before Redis answers"
	case aof:
		d.Detail = "appendonly yes, appendfsync " + fsync + ": a crash loses the writes of the last second or so"
	case save != "":
		d.Detail = "appendonly no, snapshots (save " + save + "): a crash loses every write since the last snapshot"
	default:
		d.Detail = "appendonly no, no snapshots: a restart loses every record"
	}
	risk := func(detail string) {
		d.CrashSafe = false
		d.Detail += "; " + detail
	}

	maxmemory, policy := fields["maxmemory"], fields["maxmemory_policy"]
	switch {
	case maxmemory == "" || policy == "":
		risk("maxmemory and maxmemory-policy unknown (not in INFO): Redis may evict records, and a retry of an evicted one runs the work again")
	case maxmemory != "0" && policy != "noeviction":
		risk("maxmemory-policy " + policy + " with maxmemory " + maxmemory + ": when memory fills, Redis evicts records " +
			"(settled ones within their retention, or under allkeys-* running ones), and a retry of an evicted one runs the work again")
	}

	if role := fields["role"]; role != "master" {
		risk("role " + role + ", not master: this server is a replica, and its master's writes reach it asynchronously")
	}
	replicas, _ := strconv.Atoi(fields["connected_slaves"])
	known := strconv.Itoa(replicas) + " connected"
	if fields["cluster_enabled"] == "1" {
		listed, err := clusterReplicas(ctx, c)
		switch {
		case err != nil:
			replicas, known = max(replicas, 1), "unknown (CLUSTER NODES refused)"
		case listed > replicas:
			replicas, known = listed, strconv.Itoa(listed)+" (CLUSTER NODES)"
		}
	}
	if replicas > 0 {
		risk("replicas " + known + ": replication is asynchronous, so a failover to a replica loses the acknowledged writes it had not received")
	}
	return d, fields["run_id"], nil
}

// clusterReplicas returns how many replicas CLUSTER NODES, asked of a
// Redis Cluster master, lists for it, connected or not.
func clusterReplicas(ctx context.Context, c *redis.Client) (int, error) {
	nodes, err := c.ClusterNodes(ctx).Result()
	if err != nil {
		return 0, err
	}
	// A line: <id> <addr> <flags> <master id or -> <ping> <pong> <epoch> <link> <slots…>
	var self string
	var lines [][]string
	for _, line := range strings.Split(nodes, "\n") {
		f := strings.Fields(line)
		if len(f) < 4 {
			continue
		}
		if slices.Contains(strings.Split(f[2], ","), "myself") {
			self = f[0]
		}
		lines = append(lines, f)
	}
	n := 0
	for _, f := range lines {
		if self != "" && f[3] == self {
			n++
		}
	}
	return n, nil
}
