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
// Settled records (COMPLETED, FAILED) get a Redis TTL equal to their
// remaining retention, so Redis deletes them itself and [Store.Prune] has
// nothing to do. IN_PROGRESS and UNKNOWN records never have a TTL: they may
// stand for a side effect nobody has accounted for yet, and the reconciler
// needs them. Run Redis with maxmemory-policy noeviction (or a volatile-*
// policy, which only evicts settled records): an allkeys-* policy may evict
// a running record, and the next retry would run the work again.
//
// # Round trips
//
// Each operation is one Lua script, so one round trip: acquire 1 (the same
// script returns the existing record, so the lookup that decides a replay is
// that round trip too), renew 1, checkpoint 1, complete/release/mark-unknown
// 1, get 1 (HGETALL). A scan page costs 2 pipelined round trips when nothing changes
// under it: one pipeline runs a range script on the pending set of every
// shard from the cursor's on (each returns at most Limit+1 members whose
// score is due), and one fetches those records (HGETALL each); records that
// settle or vanish between the two cost another pair. On Cluster a pipeline
// goes to every node concurrently. The first run of a script on a server
// that has not cached it costs one more round trip (EVALSHA answers
// NOSCRIPT, then EVAL).
//
// # Errors
//
// Errors are translated at the store's edge: a token that no longer owns
// the record gives [store.ErrLeaseLost], a missing or expired record
// [store.ErrNotFound], and a failure to reach Redis or to get its answer
// (refused or broken connections, timeouts, a closed client or exhausted
// pool, a deadline that ran out, and the LOADING, CLUSTERDOWN, TRYAGAIN,
// MASTERDOWN, READONLY, BUSY and max-clients replies of a server that is
// starting, failing over or overloaded) wraps [store.ErrUnavailable]. A
// cancelled context stays recognisable with errors.Is.
//
// # Durability
//
// Redis durability is the server's, not this package's. Without AOF and
// appendfsync always, a crash or failover loses the most recent writes. A
// lost COMPLETED record turns a replay into a re-run, and a lost IN_PROGRESS
// record lets a retry run the work a second time while the first run may
// still be going: the exactly-once promise holds only as long as Redis keeps
// what it acknowledged, and a failover to a replica that had not yet
// received the last writes loses them just the same. Where a duplicate side
// effect is unacceptable, run Redis with appendonly yes and appendfsync
// always, or use a store backed by a database that syncs its commits.
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
	s := &Store{client: cfg.Client, shards: uint32(shards), tags: make([]string, shards), pending: make([]string, shards)}
	for i := range shards {
		s.tags[i] = prefix + "{" + prefix + ":" + strconv.Itoa(i) + "}"
		s.pending[i] = s.tags[i] + ":pending"
	}
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

// ms converts a time to unix milliseconds, as stored.
func ms(t time.Time) string { return strconv.FormatInt(t.UnixMilli(), 10) }

// acquireScript applies store.AcquireParams.Apply to the record in KEYS[1]
// and returns the record as it is afterwards: the values of recordFields, in
// that order, false (nil) for a field the record does not have. It reads the
// hash once, and returns what it read or wrote without reading it again. A
// re-creation starts with no checkpoints; the UNKNOWN transition and a
// takeover keep them.
//
// KEYS: record, pending. ARGV: now, fp, token, lease, ts, scope, key.
var acquireScript = redis.NewScript(`
local rec, pending = KEYS[1], KEYS[2]
local now = tonumber(ARGV[1])
local r = redis.call('HMGET', rec, 'state', 'fp', 'token', 'fence', 'lease', 'ts', 'resp',
  'created', 'updated', 'exp', 'scope', 'key', 'cps')
local state, exp = r[1], tonumber(r[10]) or 0
local live = state and (exp == 0 or now < exp)
if not live or state == 'failed' then
  local fence = '1'
  if live then fence = tostring(tonumber(r[4]) + 1) end
  r = {'in_progress', ARGV[2], ARGV[3], fence, ARGV[4], ARGV[5], false, ARGV[1], ARGV[1], '0', ARGV[6], ARGV[7], false}
  redis.call('DEL', rec) -- drops the old response, checkpoints and TTL
  redis.call('HSET', rec, 'state', r[1], 'fp', r[2], 'token', r[3], 'fence', r[4], 'lease', r[5],
    'ts', r[6], 'created', r[8], 'updated', r[9], 'exp', r[10], 'scope', r[11], 'key', r[12])
  redis.call('ZADD', pending, r[5], rec)
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
// set.
//
// KEYS: record. ARGV: token, now, checkpoint (its store.AppendCheckpoint line).
var checkpointScript = redis.NewScript(`
local cur = redis.call('HMGET', KEYS[1], 'state', 'token', 'lease', 'cps')
if cur[1] ~= 'in_progress' or cur[2] ~= ARGV[1] or tonumber(ARGV[2]) >= tonumber(cur[3]) then
  return 0
end
redis.call('HSET', KEYS[1], 'cps', (cur[4] or '') .. ARGV[3], 'ts', '0', 'updated', ARGV[2])
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
redis.call('HSET', KEYS[1], 'state', ARGV[3], 'exp', ARGV[4], 'updated', ARGV[2])
if ARGV[3] == 'completed' then
  redis.call('HSET', KEYS[1], 'resp', ARGV[6])
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
	v, err := acquireScript.Run(ctx, s.client, []string{rec, pending},
		ms(p.Now), string(p.Fingerprint), p.Token, ms(p.LeaseExpires), ts, p.Scope, p.Key).Slice()
	if err != nil {
		return store.Record{}, translate("acquire", err)
	}
	fields, err := fieldValues(v)
	if err != nil {
		return store.Record{}, fmt.Errorf("redisstore: acquire: %w", err)
	}
	r, err := decode(fields)
	if err != nil {
		return store.Record{}, fmt.Errorf("redisstore: acquire: record %q: %w", rec, err)
	}
	return r, nil
}

// Renew implements [store.Store]: one round trip.
func (s *Store) Renew(ctx context.Context, p store.RenewParams) error {
	if err := store.Ready(ctx, "redisstore", "renew", p); err != nil {
		return err
	}
	rec, pending := s.keys(p.Scope, p.Key)
	n, err := renewScript.Run(ctx, s.client, []string{rec, pending}, p.Token, ms(p.Now), ms(p.LeaseExpires)).Int()
	if err != nil {
		return translate("renew", err)
	}
	if n != 1 {
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
	n, err := checkpointScript.Run(ctx, s.client, []string{rec},
		p.Token, ms(p.Now), store.AppendCheckpoint(nil, p.Checkpoint())).Int()
	if err != nil {
		return translate("checkpoint", err)
	}
	if n != 1 {
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
	n, err := finishScript.Run(ctx, s.client, []string{rec, pending},
		p.Token, ms(p.Now), string(p.State), exp, ttl, resp, repeat).Int()
	if err != nil {
		return translate("finish", err)
	}
	if n != 1 {
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
		return store.Record{}, fmt.Errorf("redisstore: get: record %q: %w", rec, err)
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
		recs, err := s.fetch(ctx, cands)
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
	calls := make([]scriptCall, 0, s.shards-pos.shard)
	for i := pos.shard; i < s.shards; i++ {
		score, member := "", ""
		if i == pos.shard {
			score, member = pos.score, pos.member
		}
		calls = append(calls, scriptCall{keys: []string{s.pending[i]}, args: []any{now, score, member, limit + 1}})
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

// fetch reads the records of cands in one pipeline; a record that vanished
// is nil.
func (s *Store) fetch(ctx context.Context, cands []position) ([]*store.Record, error) {
	pipe := s.client.Pipeline()
	cmds := make([]*redis.MapStringStringCmd, len(cands))
	for i, c := range cands {
		cmds[i] = pipe.HGetAll(ctx, c.member)
	}
	if _, err := pipe.Exec(ctx); err != nil {
		return nil, translate("scan", err)
	}
	recs := make([]*store.Record, len(cands))
	for i, cmd := range cmds {
		fields := cmd.Val()
		if len(fields) == 0 {
			continue
		}
		r, err := decode(fields)
		if err != nil {
			return nil, fmt.Errorf("redisstore: scan: record %q: %w", cands[i].member, err)
		}
		recs[i] = &r
	}
	return recs, nil
}

type scriptCall struct {
	keys []string
	args []any
}

// runScripts runs script once per call in one pipeline (EVALSHA), then
// runs again with EVAL, in a second pipeline, the calls that found the script
// missing from the server's cache. Each command carries its own error (a
// failed pipeline sets it on every command).
func (s *Store) runScripts(ctx context.Context, script *redis.Script, calls []scriptCall) []*redis.Cmd {
	cmds := make([]*redis.Cmd, len(calls))
	pipe := s.client.Pipeline()
	for i, c := range calls {
		cmds[i] = script.EvalSha(ctx, pipe, c.keys, c.args...)
	}
	_, _ = pipe.Exec(ctx)
	pipe = s.client.Pipeline()
	var again bool
	for i, cmd := range cmds {
		if isNoScript(cmd.Err()) {
			cmds[i] = script.Eval(ctx, pipe, calls[i].keys, calls[i].args...)
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
	bad := fmt.Errorf("redisstore: scan: %w: cursor %q names a position this store does not have", store.ErrInvalid, c)
	shard, err := strconv.ParseUint(f[0], 10, 32)
	if err != nil || shard >= uint64(s.shards) || !strings.HasPrefix(f[2], s.tags[shard]+":") {
		return position{}, bad
	}
	if sc, err := strconv.ParseFloat(f[1], 64); err != nil || math.IsNaN(sc) || math.IsInf(sc, 0) {
		return position{}, bad
	}
	return position{shard: uint32(shard), score: f[1], member: f[2]}, nil
}

// Prune implements [store.Store]. Redis deletes settled records itself when
// their TTL (the retention) runs out, so Prune only validates p and reports 0.
func (s *Store) Prune(ctx context.Context, p store.PruneParams) (int, error) {
	if err := p.Validate(); err != nil {
		return 0, err
	}
	return 0, nil
}

// fieldValues turns the values acquireScript returns into a map like
// HGETALL's, leaving out the fields the record does not have.
func fieldValues(v []any) (map[string]string, error) {
	if len(v) != len(recordFields) {
		return nil, fmt.Errorf("script returned %d values, want %d", len(v), len(recordFields))
	}
	m := make(map[string]string, len(v))
	for i, x := range v {
		switch x := x.(type) {
		case nil:
		case string:
			m[recordFields[i]] = x
		default:
			return nil, fmt.Errorf("script returned a %T for field %s", x, recordFields[i])
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

// translate turns a driver error into the vocabulary of package idem: a
// failure to reach Redis or to get its answer wraps [store.ErrUnavailable]
// (and still the context's error, when that was the cause); an error Redis
// answered with is wrapped as it is, except the transient ones of a server
// that is loading, failing over or resharding, which are unavailability too.
func translate(op string, err error) error {
	if unavailable(err) {
		return fmt.Errorf("redisstore: %s: %w: %w", op, store.ErrUnavailable, err)
	}
	return fmt.Errorf("redisstore: %s: %w", op, err)
}

func unavailable(err error) bool {
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
		return redis.IsLoadingError(err) || redis.IsClusterDownError(err) || redis.IsTryAgainError(err) ||
			redis.IsMasterDownError(err) || redis.IsReadOnlyError(err) || redis.IsMaxClientsError(err) ||
			redis.HasErrorPrefix(err, "BUSY")
	}
	// Not an answer from Redis: the client could not talk to it.
	return true
}

var _ store.DurabilityReporter = (*Store)(nil)

// Durability implements [store.DurabilityReporter] from each master's
// persistence settings (appendonly, appendfsync, save), with the masters'
// run_ids as the instance: it changes when any of them restarts. Records
// survive a crash only with appendonly yes and appendfsync always. A
// failover to a replica that had not yet received the last writes loses
// them whatever the settings.
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
		return store.Durability{}, translate("durability", err)
	}
	slices.Sort(ids)
	slices.Sort(details)
	return store.Durability{CrashSafe: safe, Detail: strings.Join(slices.Compact(details), "; "), Instance: strings.Join(ids, ",")}, nil
}

// nodeDurability reads one server's persistence settings and run_id.
func nodeDurability(ctx context.Context, c *redis.Client) (store.Durability, string, error) {
	info, err := c.Info(ctx, "persistence", "server").Result()
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
	return d, fields["run_id"], nil
}
