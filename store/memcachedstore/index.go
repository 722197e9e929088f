package memcachedstore

import (
	"bytes"
	"cmp"
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"hash/crc32"
	"maps"
	"slices"
	"strconv"
	"strings"

	"github.com/bradfitz/gomemcache/memcache"
	"github.com/idemhq/idem/store"
)

// The index of a shard is one item, a log of lines appended with
// Memcached's append command:
//
//	+<hash> <fence> <lease end, unix ms>   the lease <fence> of the record began
//	-<hash> <fence>                        the record was settled under that lease
//
// Folded in order, the log is a set of (hash, fence) entries, each with the
// latest lease end it was added with. Writers only append (one round trip,
// atomic on the server, no compare-and-swap to lose). Memcached copies an
// item to append to it, so the log is kept short: every foldEvery-th append
// of a store to an index, a scan, and a writer whose append would make the
// item too large rewrite it folded, with a compare-and-swap that loses
// harmlessly to any concurrent append.

// shard returns the shard of a record hash: crc32 mod Shards.
func (s *Store) shard(h string) int {
	return int(crc32.ChecksumIEEE([]byte(h)) % uint32(len(s.indexKeys)))
}

func addLine(h string, fence, lease int64) []byte {
	return []byte("+" + h + " " + strconv.FormatInt(fence, 10) + " " + strconv.FormatInt(lease, 10) + "\n")
}

func removeLine(h string, fence int64) []byte {
	return []byte("-" + h + " " + strconv.FormatInt(fence, 10) + "\n")
}

// entry names one lease of one record in an index.
type entry struct {
	h     string
	fence int64
}

// indexSet is a folded index: entry → the latest lease end (unix ms) it was
// added with.
type indexSet map[entry]int64

// parseIndex folds an index log.
func parseIndex(v []byte) (indexSet, error) {
	set := indexSet{}
	for len(v) > 0 {
		line, rest, ok := bytes.Cut(v, []byte("\n"))
		if !ok {
			return nil, errors.New("the index ends in the middle of a line")
		}
		v = rest
		if len(line) < 1+hashLen+2 || line[1+hashLen] != ' ' {
			return nil, fmt.Errorf("malformed index line %q", line)
		}
		h, fields := string(line[1:1+hashLen]), strings.Fields(string(line[2+hashLen:]))
		switch {
		case line[0] == '+' && len(fields) == 2:
			fence, err1 := strconv.ParseInt(fields[0], 10, 64)
			lease, err2 := strconv.ParseInt(fields[1], 10, 64)
			if err1 != nil || err2 != nil {
				return nil, fmt.Errorf("malformed index line %q", line)
			}
			e := entry{h, fence}
			if old, ok := set[e]; !ok || lease > old {
				set[e] = lease
			}
		case line[0] == '-' && len(fields) == 1:
			fence, err := strconv.ParseInt(fields[0], 10, 64)
			if err != nil {
				return nil, fmt.Errorf("malformed index line %q", line)
			}
			delete(set, entry{h, fence})
		default:
			return nil, fmt.Errorf("malformed index line %q", line)
		}
	}
	return set, nil
}

// bytes returns the folded log: one add line per entry, in order.
func (set indexSet) bytes() []byte {
	var b []byte
	for _, e := range slices.SortedFunc(maps.Keys(set), func(a, b entry) int {
		return cmp.Or(strings.Compare(a.h, b.h), cmp.Compare(a.fence, b.fence))
	}) {
		b = append(b, addLine(e.h, e.fence, set[e])...)
	}
	return b
}

// hashes returns the record hashes of set, sorted, each once.
func (set indexSet) hashes() []string {
	seen := make(map[string]bool, len(set))
	hs := make([]string, 0, len(set))
	for e := range set {
		if !seen[e.h] {
			seen[e.h] = true
			hs = append(hs, e.h)
		}
	}
	slices.Sort(hs)
	return hs
}

// indexAppend appends line to the index of shard: one round trip when the
// index exists and has room. When it does not exist it is created (unless
// the line is a removal, which then has nothing to remove); when the append
// would make it larger than the server takes, it is rewritten folded with
// the line in it.
func (s *Store) indexAppend(ctx context.Context, op string, shard int, line []byte) error {
	key := s.indexKeys[shard]
	for range maxAttempts {
		if err := ctx.Err(); err != nil {
			return fmt.Errorf("memcachedstore: %s: %w", op, err)
		}
		err := s.client.Append(&memcache.Item{Key: key, Value: line})
		if err == nil {
			if s.appends[shard].Add(1)%foldEvery == 0 {
				s.fold(ctx, key)
			}
			return nil
		}
		if !errors.Is(err, memcache.ErrNotStored) {
			return translate(op, err)
		}
		// Not stored: the index is missing, or too large to grow.
		if err := ctx.Err(); err != nil {
			return fmt.Errorf("memcachedstore: %s: %w", op, err)
		}
		it, err := s.client.Get(key)
		if errors.Is(err, memcache.ErrCacheMiss) {
			if line[0] == '-' {
				return nil
			}
			if err := ctx.Err(); err != nil {
				return fmt.Errorf("memcachedstore: %s: %w", op, err)
			}
			err = s.client.Add(&memcache.Item{Key: key, Value: line})
			if err == nil {
				return nil
			}
			if errors.Is(err, memcache.ErrNotStored) {
				continue // created meanwhile: append again
			}
			return translate(op, err)
		}
		if err != nil {
			return translate(op, err)
		}
		set, err := parseIndex(append(it.Value, line...))
		if err != nil {
			return fmt.Errorf("memcachedstore: %s: index %s: %w", op, key, err)
		}
		it.Value = set.bytes()
		if !s.fits(key, it.Value) {
			return fmt.Errorf("memcachedstore: %s: %w: the index of shard %d is full (%d unsettled leases, %d bytes) until records are settled "+
				"(a reconciler settles the stale ones, and its scans drop the entries of records settled or gone); "+
				"Config.Shards cannot change under a Prefix: more shards take a new Prefix, whose store does not see the records under the old one",
				op, store.ErrUnavailable, shard, len(set), len(it.Value))
		}
		if err := ctx.Err(); err != nil {
			return fmt.Errorf("memcachedstore: %s: %w", op, err)
		}
		err = s.client.CompareAndSwap(it)
		if err == nil {
			return nil
		}
		if !retryable(err) {
			return translate(op, err)
		}
	}
	return contended(op)
}

// foldEvery is how many appends of a store to an index it makes between
// two folds of it.
const foldEvery = 128

// fold rewrites an index folded, dropping its history: 2 round trips (gets,
// cas). It is tidying, not the caller's work: a failure, or a
// compare-and-swap lost to a concurrent append, changes nothing and is not
// reported.
func (s *Store) fold(ctx context.Context, key string) {
	if ctx.Err() != nil {
		return
	}
	it, err := s.client.Get(key)
	if err != nil {
		return
	}
	set, err := parseIndex(it.Value)
	if err != nil {
		return
	}
	if folded := set.bytes(); len(folded) < len(it.Value) && ctx.Err() == nil {
		it.Value = folded
		_ = s.client.CompareAndSwap(it)
	}
}

// position is where a scan stands: in a shard, after the record hash h (at
// the shard's start when h is empty).
type position struct {
	shard int
	h     string
}

// owner names this store in its cursors: its prefix and number of shards.
func (s *Store) owner() string {
	return "memcachedstore:" + s.prefix + ":" + strconv.Itoa(len(s.indexKeys))
}

func (s *Store) encodeCursor(p position) string {
	return store.EncodeCursor(s.owner(), strconv.Itoa(p.shard), p.h)
}

func (s *Store) decodeCursor(c string) (position, error) {
	if c == "" {
		return position{}, nil
	}
	f, err := store.DecodeCursor(c, s.owner(), 2)
	if err != nil {
		return position{}, fmt.Errorf("memcachedstore: scan: %w", err)
	}
	bad := fmt.Errorf("memcachedstore: scan: %w: cursor %q names a position this store does not have", store.ErrInvalid, c)
	if len(f[1]) != hashLen {
		return position{}, bad
	}
	if _, err := base64.RawURLEncoding.DecodeString(f[1]); err != nil {
		return position{}, bad
	}
	shard, err := strconv.Atoi(f[0])
	if err != nil || shard < 0 || shard >= len(s.indexKeys) || s.shard(f[1]) != shard {
		return position{}, bad
	}
	return position{shard: shard, h: f[1]}, nil
}

// candidate is a record named by an index, in scan order.
type candidate struct {
	shard int
	h     string
}

// Scan implements [store.Store]. It reads the indexes of every shard from the
// cursor's on in one round trip, then the records they name, in (shard,
// hash) order, in batches of one round trip each; the cursor is the last
// record returned, so every stale record that does not change during a scan
// is returned exactly once. Entries whose record is gone (evicted) or
// settled, and whose lease has ended at p.Now, are dropped from their index
// as the scan passes them, with one compare-and-swap per index changed.
func (s *Store) Scan(ctx context.Context, p store.ScanParams) (store.ScanResult, error) {
	if err := store.Ready(ctx, "memcachedstore", "scan", p); err != nil {
		return store.ScanResult{}, err
	}
	pos, err := s.decodeCursor(p.Cursor)
	if err != nil {
		return store.ScanResult{}, err
	}
	items, err := s.client.GetMulti(s.indexKeys[pos.shard:])
	if err != nil {
		return store.ScanResult{}, translate("scan", err)
	}
	sets := make(map[int]indexSet)
	var cands []candidate
	for shard := pos.shard; shard < len(s.indexKeys); shard++ {
		it := items[s.indexKeys[shard]]
		if it == nil {
			continue
		}
		set, err := parseIndex(it.Value)
		if err != nil {
			return store.ScanResult{}, fmt.Errorf("memcachedstore: scan: index %s: %w", it.Key, err)
		}
		sets[shard] = set
		for _, h := range set.hashes() {
			if shard == pos.shard && h <= pos.h {
				continue
			}
			cands = append(cands, candidate{shard, h})
		}
	}

	size, now := p.PageSize(), p.Now.UnixMilli()
	var res store.ScanResult
	drop := make(map[int][]string) // shard → hashes whose ended entries may go
	last := pos.shard
	i := 0
	for i < len(cands) && len(res.Records) < size {
		batch := cands[i:min(i+min(max(2*(size-len(res.Records)), 64), 1024), len(cands))]
		keys := make([]string, len(batch))
		for j, c := range batch {
			keys[j] = s.recordKey(c.h)
		}
		if err := ctx.Err(); err != nil {
			return store.ScanResult{}, fmt.Errorf("memcachedstore: scan: %w", err)
		}
		recs, err := s.client.GetMulti(keys)
		if err != nil {
			return store.ScanResult{}, translate("scan", err)
		}
		for j, c := range batch {
			i++
			last = c.shard
			var r store.Record
			if it := recs[keys[j]]; it != nil {
				r, err = decode(it.Value, false, "", "", c.h)
				if err != nil && !errors.Is(err, errForeign) {
					return store.ScanResult{}, fmt.Errorf("memcachedstore: scan: record %s: %w", keys[j], err)
				}
			}
			if r.State != store.StateInProgress && r.State != store.StateUnknown {
				// Gone, settled, or not this record: nothing to reconcile.
				drop[c.shard] = append(drop[c.shard], c.h)
				continue
			}
			if r.Stale(p.Now) {
				res.Records = append(res.Records, r)
				if len(res.Records) == size {
					if i < len(cands) {
						res.Cursor = s.encodeCursor(position{c.shard, c.h})
					}
					break
				}
			}
		}
	}
	if res.Cursor == "" {
		last = len(s.indexKeys) - 1 // the scan is complete: tidy every index it read
	}
	s.tidy(ctx, items, sets, drop, pos.shard, last, now)
	return res, nil
}

// tidy rewrites, folded, the indexes of the shards a scan went through, when
// entries can be dropped or the log is mostly history: an entry goes when its
// record was found gone or settled and its lease ended at now (an entry whose
// lease has not ended may belong to an acquire that has not written its
// record yet). A compare-and-swap that loses to a concurrent append, or
// fails, changes nothing; the next scan tries again.
func (s *Store) tidy(ctx context.Context, items map[string]*memcache.Item, sets map[int]indexSet, drop map[int][]string, from, to int, now int64) {
	for shard := from; shard <= to; shard++ {
		set := sets[shard]
		if set == nil {
			continue
		}
		gone := make(map[string]bool, len(drop[shard]))
		for _, h := range drop[shard] {
			gone[h] = true
		}
		dropped := false
		for e, lease := range set {
			if gone[e.h] && lease <= now {
				delete(set, e)
				dropped = true
			}
		}
		it := items[s.indexKeys[shard]]
		folded := set.bytes()
		if !dropped && len(it.Value) <= 2*len(folded)+tidySlack {
			continue
		}
		if ctx.Err() != nil {
			return
		}
		it.Value = folded
		_ = s.client.CompareAndSwap(it)
	}
}

// tidySlack is how many bytes of history an index may carry before a scan
// rewrites it folded though it drops nothing.
const tidySlack = 4096
