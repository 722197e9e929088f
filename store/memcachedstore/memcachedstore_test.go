package memcachedstore

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"reflect"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/bradfitz/gomemcache/memcache"
	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/testkit"
	"github.com/idemhq/idem/internal/wait"
	"github.com/idemhq/idem/store"
	"github.com/idemhq/idem/store/storetest"
)

func TestConformance(t *testing.T) {
	client := testClient(t)
	storetest.Run(t, func(t *testing.T) idem.Store { return newTestStore(t, client, Config{}) })
}

// TestConformanceOneShard indexes every record in one item, so that scans
// page through one index and the 200 racers of distinct keys append to one
// item.
func TestConformanceOneShard(t *testing.T) {
	client := testClient(t)
	storetest.Run(t, func(t *testing.T) idem.Store { return newTestStore(t, client, Config{Shards: 1}) })
}

// TestConformanceInstances runs the two-instance cases on two stores under
// one prefix, each with a client of its own, as two processes would have.
func TestConformanceInstances(t *testing.T) {
	storetest.RunInstances(t, func(t *testing.T) (idem.Store, idem.Store) {
		prefix := randomPrefix(t)
		instance := func() idem.Store {
			client := memcache.New(testAddr(t))
			client.MaxIdleConns = 256 // as testClient's, for 200 racers
			client.Timeout = 10 * time.Second
			t.Cleanup(func() { client.Close() })
			return newTestStore(t, client, Config{Prefix: prefix})
		}
		return instance(), instance()
	})
}

func TestNewValidatesConfig(t *testing.T) {
	client := memcache.New("127.0.0.1:1") // never contacted
	for name, cfg := range map[string]Config{
		"no client":           {},
		"prefix with a space": {Client: client, Prefix: "a b"},
		"prefix with a tab":   {Client: client, Prefix: "a\tb"},
		"prefix not ASCII":    {Client: client, Prefix: "pré"},
		"prefix too long":     {Client: client, Prefix: strings.Repeat("p", MaxPrefixLen+1)},
		"negative shards":     {Client: client, Shards: -1},
		"too many shards":     {Client: client, Shards: MaxShards + 1},
		"item too small":      {Client: client, MaxItem: MinMaxItem - 1},
		"item too large":      {Client: client, MaxItem: MaxMaxItem + 1},
		"empty server":        {Client: client, Servers: []string{"127.0.0.1:1", ""}},
	} {
		if _, err := New(cfg); !errors.Is(err, idem.ErrInvalid) {
			t.Errorf("New with %s: err = %v, want ErrInvalid", name, err)
		}
	}
	s, err := New(Config{Client: client})
	if err != nil {
		t.Fatal(err)
	}
	if len(s.indexKeys) != DefaultShards || s.indexKeys[5] != "idem:i:5" || s.MaxBody() != DefaultMaxItem-BodyReserve ||
		store.MaxBody(s) != 1<<20-64<<10 {
		t.Fatalf("defaults: %d shards, index key %q, max body %d", len(s.indexKeys), s.indexKeys[5], s.MaxBody())
	}
	if _, err := New(Config{Client: client, Prefix: strings.Repeat("p", MaxPrefixLen), Shards: MaxShards, MaxItem: MinMaxItem}); err != nil {
		t.Fatalf("New at the limits: %v", err)
	}
}

// legalKey is gomemcache's rule, which is Memcached's: at most 250 bytes,
// none of them a space or a control character.
func legalKey(key string) bool {
	if len(key) > 250 {
		return false
	}
	for i := 0; i < len(key); i++ {
		if key[i] <= ' ' || key[i] == 0x7f {
			return false
		}
	}
	return true
}

func TestRecordKeys(t *testing.T) {
	s, err := New(Config{Client: memcache.New("127.0.0.1:1"), Prefix: strings.Repeat("p", MaxPrefixLen)})
	if err != nil {
		t.Fatal(err)
	}
	var printable strings.Builder
	for c := byte(0x20); c <= 0x7e; c++ {
		printable.WriteByte(c)
	}
	refs := [][2]string{
		{"", "k"},
		{strings.Repeat(" ", idem.MaxScopeLen), strings.Repeat(" ", idem.MaxKeyLen)},
		{strings.Repeat("s p", 85), strings.Repeat("k y", 85)},
		{"tenant a", printable.String()},
		{"a:b", "c"}, {"a", "b:c"},
		{"ab", "c"}, {"a", "bc"},
		{"", "ab"}, {"a", "b"},
	}
	seen := map[string][2]string{}
	for _, ref := range refs {
		h := recordHash(ref[0], ref[1])
		key := s.recordKey(h)
		if !legalKey(key) {
			t.Errorf("scope %q key %q: Memcached key %q (%d bytes) is not legal", ref[0], ref[1], key, len(key))
		}
		if other, ok := seen[key]; ok {
			t.Errorf("%q and %q share the key %q", ref, other, key)
		}
		seen[key] = ref
		if s.shard(h) < 0 || s.shard(h) >= DefaultShards {
			t.Errorf("shard %d out of range", s.shard(h))
		}
	}
	if n := len(s.recordKey(recordHash("s", "k"))); n != 250 {
		t.Errorf("record key with the longest prefix is %d bytes, want 250", n)
	}
	for i := range s.indexKeys {
		if !legalKey(s.indexKeys[i]) {
			t.Errorf("index key %q is not legal", s.indexKeys[i])
		}
	}
}

// TestLongNamesOnTheServer stores, reads and scans a record whose scope and
// key are 255 bytes with spaces, through a real server.
func TestLongNamesOnTheServer(t *testing.T) {
	t.Parallel()
	s := newTestStore(t, testClient(t), Config{Prefix: randomPrefix(t) + strings.Repeat("p", MaxPrefixLen-25)})
	scope, key := strings.Repeat("a b", 85), strings.Repeat("c d", 85)
	r := testkit.Acquire(t, s, scope, key, t0, time.Minute)
	got, err := s.Get(context.Background(), store.GetParams{Scope: scope, Key: key, Now: t0})
	if err != nil || !reflect.DeepEqual(got, r) {
		t.Fatalf("Get = %+v, %v; want %+v", got, err, r)
	}
	res, err := s.Scan(context.Background(), store.ScanParams{Now: t0.Add(time.Minute)})
	if err != nil || len(res.Records) != 1 || res.Records[0].Scope != scope || res.Records[0].Key != key {
		t.Fatalf("Scan = %+v, %v", res, err)
	}
}

func TestCodec(t *testing.T) {
	every := make([]byte, 256)
	for i := range every {
		every[i] = byte(i)
	}
	base := idem.Record{Scope: "s c", Key: `k"\<>&` + "\u007f", State: idem.StateCompleted, Fingerprint: testkit.Fingerprint("a"),
		Token: "tok", Fence: 3, LeaseExpires: t0.Add(time.Minute), TakeoverSafe: true,
		Created: t0, Updated: t0.Add(time.Second), Expires: t0.Add(time.Hour),
		Checkpoints: []idem.Checkpoint{{Name: "a", Data: []byte("x\ny"), At: t0}, {Name: "b", At: t0.Add(time.Second)}}}
	for name, resp := range map[string]*idem.Response{
		"none":            nil,
		"body with bytes": {Status: 200, Header: http.Header{"X": {"a\nb", ""}}, Body: every},
		"newlines only":   {Status: 200, Body: []byte("\n\n")},
		"no body":         {Status: 204},
		"omitted":         {Status: 200, BodyOmitted: true},
	} {
		r := base
		r.Response = resp
		if resp == nil {
			r.State, r.Expires, r.TakeoverSafe = idem.StateUnknown, time.Time{}, false
		}
		v, err := encode(&r)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		got, err := decode(v, true, r.Scope, r.Key, "")
		if err != nil {
			t.Fatalf("%s: decode: %v", name, err)
		}
		if !reflect.DeepEqual(got, r) {
			t.Errorf("%s: decoded %+v\nwant %+v", name, got, r)
		}
		if got2, err := decode(v, false, "", "", recordHash(r.Scope, r.Key)); err != nil || !reflect.DeepEqual(got2, got) {
			t.Errorf("%s: decode by hash = %v", name, err)
		}
		if _, err := decode(v, true, r.Scope, r.Key+"x", ""); !errors.Is(err, errForeign) {
			t.Errorf("%s: decode under another key: %v, want errForeign", name, err)
		}
		if _, err := decode(v, false, "", "", recordHash(r.Scope+"x", r.Key)); !errors.Is(err, errForeign) {
			t.Errorf("%s: decode under another hash: %v, want errForeign", name, err)
		}
	}
	for _, v := range []string{"", "{}", `{"v":2}` + "\n", `{"v":1,"state":"x"}` + "\n", `{"v":1,"state":"failed"}` + "\nbody"} {
		if _, err := decode([]byte(v), false, "", "", recordHash("", "")); err == nil || errors.Is(err, errForeign) {
			t.Errorf("decode(%q) = %v, want a corruption error", v, err)
		}
	}
}

func TestParseIndex(t *testing.T) {
	a, b := recordHash("", "a"), recordHash("", "b")
	log := bytes.Join([][]byte{
		addLine(a, 1, 100), addLine(b, 1, 50), addLine(a, 1, 90), // a's lease end is the latest
		removeLine(b, 1), removeLine(b, 7), // removing an absent entry is nothing
		addLine(b, 2, 60), addLine(a, 2, 70),
	}, nil)
	set, err := parseIndex(log)
	if err != nil {
		t.Fatal(err)
	}
	want := indexSet{{a, 1}: 100, {a, 2}: 70, {b, 2}: 60}
	if !reflect.DeepEqual(set, want) {
		t.Fatalf("folded = %v, want %v", set, want)
	}
	if hs := set.hashes(); len(hs) != 2 || hs[0] > hs[1] {
		t.Fatalf("hashes = %v", hs)
	}
	again, err := parseIndex(set.bytes())
	if err != nil || !reflect.DeepEqual(again, set) {
		t.Fatalf("folded log reads back as %v, %v", again, err)
	}
	if len(set.bytes()) >= len(log) {
		t.Errorf("folding did not shrink the log")
	}
	for _, bad := range []string{"+x 1 2\n", "+" + a + " 1\n", "-" + a + " x\n", "*" + a + " 1\n", string(addLine(a, 1, 2))[:20]} {
		if _, err := parseIndex([]byte(bad)); err == nil {
			t.Errorf("parseIndex(%q) did not fail", bad)
		}
	}
}

func TestExpirationValue(t *testing.T) {
	now := time.Unix(1_900_000_000, 250e6) // 2030
	for _, c := range []struct {
		d    time.Duration
		want int32
	}{
		{time.Millisecond, 2},
		{time.Second, 2},
		{time.Second + time.Millisecond, 3},
		{time.Hour, 3601},
		{24 * time.Hour, 86401},
		{30*24*time.Hour - time.Second, maxRelative},
		{30 * 24 * time.Hour, int32(now.Add(30*24*time.Hour).Unix() + 2)},
		{90 * 24 * time.Hour, int32(now.Add(90*24*time.Hour).Unix() + 2)},
		{20 * 365 * 24 * time.Hour, math.MaxInt32}, // past 2038
	} {
		if got := expiration(now, now.Add(c.d)); got != c.want {
			t.Errorf("expiration for %v = %d, want %d", c.d, got, c.want)
		}
	}
}

// TestExpiration reads, with the meta command mg, the expiration the store
// gives its items.
func TestExpiration(t *testing.T) {
	t.Parallel()
	s := newTestStore(t, testClient(t), Config{Shards: 1})
	key := func(k string) string { return s.recordKey(recordHash("s", k)) }

	done := testkit.Acquire(t, s, "s", "done", t0, time.Minute)
	if ttl := metaTTL(t, key("done")); ttl != -1 {
		t.Errorf("IN_PROGRESS record: ttl %d, want -1 (never expires)", ttl)
	}
	testkit.Finish(t, s, done, t0, idem.StateCompleted, time.Hour)
	if ttl := metaTTL(t, key("done")); ttl < 3599 || ttl > 3601 {
		t.Errorf("COMPLETED record with an hour's retention: ttl %d, want 3601 give or take the server's clock tick", ttl)
	}
	failed := testkit.Acquire(t, s, "s", "failed", t0, time.Minute)
	testkit.Finish(t, s, failed, t0.Add(time.Second), idem.StateFailed, 90*time.Second+time.Millisecond)
	if ttl := metaTTL(t, key("failed")); ttl < 90 || ttl > 92 {
		t.Errorf("FAILED record with 90.001 s of retention: ttl %d, want 92", ttl)
	}
	unknown := testkit.Acquire(t, s, "s", "unknown", t0, time.Minute)
	testkit.Finish(t, s, unknown, t0, idem.StateUnknown, 0)
	if ttl := metaTTL(t, key("unknown")); ttl != -1 {
		t.Errorf("UNKNOWN record: ttl %d, want -1", ttl)
	}
	if ttl := metaTTL(t, s.indexKeys[0]); ttl != -1 {
		t.Errorf("index: ttl %d, want -1", ttl)
	}
	// Over 30 days, the expiration is absolute: it is read against the
	// server's clock, so this case uses the wall clock as the engine would.
	now := time.Now()
	long := testkit.Acquire(t, s, "s", "long", now, time.Minute)
	testkit.Finish(t, s, long, now, idem.StateCompleted, 40*24*time.Hour)
	want := int(40 * 24 * time.Hour / time.Second)
	if ttl := metaTTL(t, key("long")); ttl < want-5 || ttl > want+5 {
		t.Errorf("COMPLETED record with 40 days of retention: ttl %d, want about %d", ttl, want)
	}
	// The record re-created over an expired one never expires again.
	again := testkit.Acquire(t, s, "s", "failed", t0.Add(time.Hour), time.Minute)
	if ttl := metaTTL(t, key("failed")); ttl != -1 || again.Fence != 1 {
		t.Errorf("record re-created over an expired one: ttl %d fence %d, want -1 and 1", ttl, again.Fence)
	}
}

// TestServerExpiresSettledRecord settles a record with one second of
// retention and waits, with a deadline, for the server to drop it.
func TestServerExpiresSettledRecord(t *testing.T) {
	t.Parallel()
	client := testClient(t)
	s := newTestStore(t, client, Config{})
	r := testkit.Acquire(t, s, "s", "brief", t0, time.Minute)
	testkit.Finish(t, s, r, t0, idem.StateCompleted, time.Second) // expiration 2 s
	key := s.recordKey(recordHash("s", "brief"))
	start := time.Now()
	deadline := start.Add(10 * time.Second)
	for {
		_, err := client.Get(key)
		if errors.Is(err, memcache.ErrCacheMiss) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		if time.Now().After(deadline) {
			t.Fatalf("the record with a 2 s expiration is still there after %v", time.Since(start))
		}
		time.Sleep(100 * time.Millisecond)
	}
	if waited := time.Since(start); waited < time.Second {
		t.Errorf("the record was gone after %v, before its retention of 1 s", waited)
	}
	if _, err := s.Get(context.Background(), store.GetParams{Scope: "s", Key: "brief", Now: t0}); !errors.Is(err, idem.ErrNotFound) {
		t.Fatalf("Get after the server dropped it: %v", err)
	}
}

// TestForeignRecordNeverReturned puts a record's value under the Memcached
// key of another scope and key, as a hash collision would: no read returns
// it, no write touches it, and a scan returns the real record once.
func TestForeignRecordNeverReturned(t *testing.T) {
	t.Parallel()
	client := testClient(t)
	s := newTestStore(t, client, Config{Shards: 1})
	ctx := context.Background()
	a := testkit.Acquire(t, s, "tenant-a", "k1", t0, time.Minute)
	it, err := client.Get(s.recordKey(recordHash("tenant-a", "k1")))
	if err != nil {
		t.Fatal(err)
	}
	hb := recordHash("tenant-b", "k2")
	if err := client.Set(&memcache.Item{Key: s.recordKey(hb), Value: it.Value}); err != nil {
		t.Fatal(err)
	}
	if err := client.Append(&memcache.Item{Key: s.indexKeys[0], Value: addLine(hb, 1, t0.UnixMilli())}); err != nil {
		t.Fatal(err)
	}

	if _, err := s.Get(ctx, store.GetParams{Scope: "tenant-b", Key: "k2", Now: t0}); !errors.Is(err, idem.ErrNotFound) {
		t.Errorf("Get under the colliding name: %v, want ErrNotFound", err)
	}
	errs := map[string]error{
		"Renew": s.Renew(ctx, store.RenewParams{Scope: "tenant-b", Key: "k2", Token: a.Token, Now: t0, LeaseExpires: t0.Add(time.Hour)}),
		"Checkpoint": s.Checkpoint(ctx, store.CheckpointParams{Scope: "tenant-b", Key: "k2", Token: a.Token, Now: t0,
			Name: "x"}),
		"Finish": s.Finish(ctx, idem.FinishParams{Scope: "tenant-b", Key: "k2", Token: a.Token, Now: t0,
			State: idem.StateFailed, Expires: t0.Add(time.Hour)}),
	}
	for name, err := range errs {
		if !errors.Is(err, idem.ErrLeaseLost) {
			t.Errorf("%s with the other record's token: %v, want ErrLeaseLost", name, err)
		}
	}
	r, err := s.Acquire(ctx, store.AcquireParams{Scope: "tenant-b", Key: "k2", Fingerprint: testkit.Fingerprint("a"), Token: strings.Repeat("b", 32),
		Now: t0, LeaseExpires: t0.Add(time.Minute)})
	if err == nil || errors.Is(err, idem.ErrUnavailable) || errors.Is(err, idem.ErrInvalid) {
		t.Errorf("Acquire under the colliding name = %+v, %v; want a plain error", r, err)
	}
	if after, err := client.Get(s.recordKey(hb)); err != nil || !bytes.Equal(after.Value, it.Value) {
		t.Fatalf("the foreign value was changed: %v", err)
	}
	res, err := s.Scan(ctx, store.ScanParams{Now: t0.Add(time.Minute)})
	if err != nil || len(res.Records) != 1 || res.Records[0].Scope != "tenant-a" {
		t.Fatalf("Scan = %+v, %v; want tenant-a's record once", res, err)
	}
	if indexed(t, s, "tenant-b", "k2") {
		t.Errorf("the entry of the colliding name is still indexed after a scan past its lease")
	}
}

func TestRoundTrips(t *testing.T) {
	t.Parallel()
	client, cnt := countingClient(t)
	s := newTestStore(t, client, Config{Shards: 1})
	ctx := context.Background()
	cost := func(what string, want int64, fn func() error) {
		t.Helper()
		before := cnt.n.Load()
		if err := fn(); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		if got := cnt.n.Load() - before; got != want {
			t.Errorf("%s cost %d round trips, want %d", what, got, want)
		}
	}
	tok := strings.Repeat("a", 32)
	acq := func(key, tok string, now time.Time) func() error {
		return func() error {
			_, err := s.Acquire(ctx, store.AcquireParams{Scope: "s", Key: key, Fingerprint: testkit.Fingerprint("a"), Token: tok,
				Now: now, LeaseExpires: now.Add(time.Minute)})
			return err
		}
	}
	fin := func(key, tok string, state idem.State, now time.Time) func() error {
		return func() error {
			p := idem.FinishParams{Scope: "s", Key: key, Token: tok, Now: now, State: state}
			if state == idem.StateCompleted {
				p.Response = &idem.Response{Status: 201, Body: []byte("ok")}
			}
			if state.Terminal() {
				p.Expires = now.Add(time.Hour)
			}
			return s.Finish(ctx, p)
		}
	}
	cost("Acquire of the first key of a shard (no index yet)", 5, acq("first", tok, t0))
	cost("Acquire of a new key", 3, acq("k", tok, t0))
	cost("Acquire while it runs", 1, acq("k", strings.Repeat("b", 32), t0))
	cost("Renew", 2, func() error {
		return s.Renew(ctx, store.RenewParams{Scope: "s", Key: "k", Token: tok, Now: t0, LeaseExpires: t0.Add(2 * time.Minute)})
	})
	for i := range 2 {
		cost("Checkpoint "+strconv.Itoa(i+1), 2, func() error {
			return s.Checkpoint(ctx, store.CheckpointParams{Scope: "s", Key: "k", Token: tok, Now: t0, Name: "step", Data: []byte("x")})
		})
	}
	cost("Finish as COMPLETED", 3, fin("k", tok, idem.StateCompleted, t0))
	cost("Acquire that replays", 1, acq("k", strings.Repeat("b", 32), t0))
	cost("Get", 1, func() error {
		_, err := s.Get(ctx, store.GetParams{Scope: "s", Key: "k", Now: t0})
		return err
	})
	cost("Acquire of another new key", 3, acq("f", tok, t0))
	cost("Finish as FAILED", 3, fin("f", tok, idem.StateFailed, t0))
	cost("Acquire that re-runs a FAILED record", 3, acq("f", strings.Repeat("c", 32), t0))
	cost("Finish as UNKNOWN", 2, fin("f", strings.Repeat("c", 32), idem.StateUnknown, t0))
	cost("Acquire that marks an expired lease UNKNOWN", 3, acq("first", strings.Repeat("d", 32), t0.Add(time.Minute)))
	cost("Acquire of an expired record", 3, acq("k", strings.Repeat("e", 32), t0.Add(2*time.Hour)))
	for i := range 20 {
		u := testkit.Acquire(t, s, "s", "u"+strconv.Itoa(i), t0, time.Minute)
		testkit.Finish(t, s, u, t0, idem.StateUnknown, 0)
		testkit.Acquire(t, s, "s", "running"+strconv.Itoa(i), t0, time.Minute) // not stale: read, not returned
	}
	cost("Scan page", 2, func() error {
		res, err := s.Scan(ctx, store.ScanParams{Now: t0, Limit: 30})
		if err == nil && (len(res.Records) != 22 || res.Cursor != "") {
			err = fmt.Errorf("got %d records, cursor %q; want the 22 unknown ones", len(res.Records), res.Cursor)
		}
		return err
	})
	cost("Prune", 0, func() error {
		_, err := s.Prune(ctx, store.PruneParams{Now: t0})
		return err
	})
}

// TestIndex follows the index of one shard: a lease's entry is there from
// its acquire, and gone when it is settled; an UNKNOWN record stays; a
// record evicted from under its entry is skipped by a scan without error,
// and its entry dropped once its lease has ended.
func TestIndex(t *testing.T) {
	t.Parallel()
	client := testClient(t)
	s := newTestStore(t, client, Config{Shards: 1})
	ctx := context.Background()
	const lease = time.Minute
	recs := map[string]idem.Record{}
	for _, k := range []string{"done", "failed", "unknown", "evicted", "running"} {
		recs[k] = testkit.Acquire(t, s, "s", k, t0, lease)
		if !indexed(t, s, "s", k) {
			t.Fatalf("%s: not indexed after its acquire", k)
		}
	}
	testkit.Finish(t, s, recs["done"], t0, idem.StateCompleted, time.Hour)
	testkit.Finish(t, s, recs["failed"], t0, idem.StateFailed, time.Hour)
	testkit.Finish(t, s, recs["unknown"], t0, idem.StateUnknown, 0)
	for k, want := range map[string]bool{"done": false, "failed": false, "unknown": true, "evicted": true, "running": true} {
		if indexed(t, s, "s", k) != want {
			t.Errorf("%s: indexed %v after settling, want %v", k, !want, want)
		}
	}
	if err := client.Delete(s.recordKey(recordHash("s", "evicted"))); err != nil {
		t.Fatal(err)
	}
	keys := func(res idem.ScanResult) string {
		var ks []string
		for _, r := range res.Records {
			ks = append(ks, r.Key)
		}
		return strings.Join(ks, ",")
	}
	// Before the evicted record's lease ends, its entry may stand for an
	// acquire that has not written its record yet: it stays.
	res, err := s.Scan(ctx, store.ScanParams{Now: t0.Add(time.Second)})
	if err != nil || keys(res) != "unknown" {
		t.Fatalf("Scan during the lease = %q, %v; want unknown", keys(res), err)
	}
	if !indexed(t, s, "s", "evicted") {
		t.Fatalf("the evicted record's entry was dropped while its lease ran")
	}
	res, err = s.Scan(ctx, store.ScanParams{Now: t0.Add(lease)})
	if err != nil || len(res.Records) != 2 || res.Cursor != "" {
		t.Fatalf("Scan after the lease = %q, %v; want unknown and running", keys(res), err)
	}
	if indexed(t, s, "s", "evicted") || !indexed(t, s, "s", "running") || !indexed(t, s, "s", "unknown") {
		t.Fatalf("after a scan past the lease: index %v", indexOf(t, s, 0))
	}
	if n := len(indexOf(t, s, 0)); n != 2 {
		t.Fatalf("the index holds %d entries, want 2", n)
	}
}

// TestIndexFoldsHistory: the 128th append of a store to an index folds it,
// so the history of settled leases does not pile up between scans.
func TestIndexFoldsHistory(t *testing.T) {
	t.Parallel()
	client := testClient(t)
	s := newTestStore(t, client, Config{Shards: 1})
	const pairs = foldEvery/2 + 1 // the first acquire creates the index: no append
	for i := range pairs {
		r := testkit.Acquire(t, s, "s", "k"+strconv.Itoa(i), t0, time.Minute)
		testkit.Finish(t, s, r, t0, idem.StateCompleted, time.Hour)
	}
	it, err := client.Get(s.indexKeys[0])
	if err != nil {
		t.Fatal(err)
	}
	last := recordHash("s", "k"+strconv.Itoa(pairs-1))
	if want := string(addLine(last, 1, t0.Add(time.Minute).UnixMilli())) + string(removeLine(last, 1)); string(it.Value) != want {
		t.Fatalf("index after %d appends = %d bytes %q; want the fold, then the last removal", 2*pairs-1, len(it.Value), it.Value)
	}
}

// TestIndexLost deletes a shard's index, as an eviction would: new leases
// index themselves again, and an acquire that finds an expired lease marks
// the record UNKNOWN and puts its entry back, so the reconciler finds it.
func TestIndexLost(t *testing.T) {
	t.Parallel()
	client := testClient(t)
	s := newTestStore(t, client, Config{Shards: 1})
	ctx := context.Background()
	crashed := testkit.Acquire(t, s, "s", "crashed", t0, time.Minute)
	if err := client.Delete(s.indexKeys[0]); err != nil {
		t.Fatal(err)
	}
	testkit.Acquire(t, s, "s", "later", t0, time.Hour)
	if !indexed(t, s, "s", "later") || indexed(t, s, "s", "crashed") {
		t.Fatalf("index after it was lost and one acquire: %v", indexOf(t, s, 0))
	}
	now := t0.Add(time.Minute)
	r, err := s.Acquire(ctx, store.AcquireParams{Scope: "s", Key: "crashed", Fingerprint: testkit.Fingerprint("a"), Token: strings.Repeat("b", 32),
		Now: now, LeaseExpires: now.Add(time.Minute)})
	if err != nil || r.State != idem.StateUnknown || r.Token != crashed.Token {
		t.Fatalf("Acquire after the lease = %+v, %v; want unknown under the old token", r, err)
	}
	res, err := s.Scan(ctx, store.ScanParams{Now: now})
	if err != nil || len(res.Records) != 1 || res.Records[0].Key != "crashed" {
		t.Fatalf("Scan = %+v, %v; want the crashed record", res, err)
	}
}

// maxValue finds, by bisection, the largest value the server stores under a
// key of keyLen bytes.
func maxValue(t *testing.T, client *memcache.Client, prefix string, keyLen int) int {
	t.Helper()
	key := prefix + ":p"
	key += strings.Repeat("x", keyLen-len(key))
	defer client.Delete(key)
	lo, hi := 0, 4<<20
	for lo < hi {
		mid := (lo + hi + 1) / 2
		err := client.Set(&memcache.Item{Key: key, Value: make([]byte, mid)})
		switch {
		case err == nil:
			lo = mid
		case strings.Contains(err.Error(), "SERVER_ERROR object too large"):
			hi = mid - 1
		default:
			t.Fatal(err)
		}
	}
	return lo
}

// fakeHash returns the i-th made-up record hash.
func fakeHash(i int) string {
	sum := sha256.Sum256([]byte(strconv.Itoa(i)))
	return base64.RawURLEncoding.EncodeToString(sum[:])
}

// TestIndexFull fills a shard's index to the server's item size limit, by
// hand: with history (entries added and removed), an acquire folds it and
// goes on; with that many unsettled leases, an acquire fails closed, before
// it writes its record.
func TestIndexFull(t *testing.T) {
	t.Parallel()
	client := testClient(t)
	s := newTestStore(t, client, Config{Shards: 1})
	ctx := context.Background()
	limit := maxValue(t, client, s.prefix, len(s.indexKeys[0]))
	fill := func(history bool) {
		t.Helper()
		var b []byte
		for i := 0; ; i++ {
			line := addLine(fakeHash(i), 1, t0.UnixMilli())
			if history {
				line = append(line, removeLine(fakeHash(i), 1)...)
			}
			if len(b)+len(line)+47 > limit {
				break
			}
			b = append(b, line...)
		}
		// Pad to the limit exactly with the removal of nothing, its fence
		// written with as many leading zeros as it takes.
		pad := limit - len(b) - len(removeLine(fakeHash(0), 1))
		b = append(b, "-"+fakeHash(-1)+" "+strings.Repeat("0", pad)+"1\n"...)
		if err := client.Set(&memcache.Item{Key: s.indexKeys[0], Value: b}); err != nil {
			t.Fatalf("setting an index of %d bytes: %v", len(b), err)
		}
		if err := client.Append(&memcache.Item{Key: s.indexKeys[0], Value: []byte("-")}); !errors.Is(err, memcache.ErrNotStored) {
			t.Fatalf("the index is not full: append = %v", err)
		}
	}

	fill(true)
	testkit.Acquire(t, s, "s", "fits", t0, time.Minute)
	set := indexOf(t, s, 0)
	if len(set) != 1 || !indexed(t, s, "s", "fits") {
		t.Fatalf("after folding a full index of history: %d entries", len(set))
	}

	fill(false)
	_, err := s.Acquire(ctx, store.AcquireParams{Scope: "s", Key: "no room", Fingerprint: testkit.Fingerprint("a"), Token: strings.Repeat("a", 32),
		Now: t0, LeaseExpires: t0.Add(time.Minute)})
	if !errors.Is(err, idem.ErrUnavailable) {
		t.Fatalf("Acquire with a full index: %v, want ErrUnavailable", err)
	}
	if _, err := s.Get(ctx, store.GetParams{Scope: "s", Key: "no room", Now: t0}); !errors.Is(err, idem.ErrNotFound) {
		t.Fatalf("the record was written though its lease could not be indexed: %v", err)
	}
}

// TestScanSkipsVanishedRecords: an indexed record that is gone (evicted) is
// skipped, and the page is still filled.
func TestScanSkipsVanishedRecords(t *testing.T) {
	t.Parallel()
	client := testClient(t)
	s := newTestStore(t, client, Config{Shards: 1})
	var order []string // scan order: by hash
	for i := range 6 {
		testkit.Acquire(t, s, "s", fmt.Sprintf("k%d", i), t0, time.Minute)
	}
	for _, h := range indexOf(t, s, 0).hashes() {
		for i := range 6 {
			if recordHash("s", fmt.Sprintf("k%d", i)) == h {
				order = append(order, fmt.Sprintf("k%d", i))
			}
		}
	}
	for _, key := range []string{order[1], order[2]} {
		if err := client.Delete(s.recordKey(recordHash("s", key))); err != nil {
			t.Fatal(err)
		}
	}
	res, err := s.Scan(context.Background(), store.ScanParams{Now: t0.Add(time.Minute), Limit: 3})
	if err != nil {
		t.Fatal(err)
	}
	var keys []string
	for _, r := range res.Records {
		keys = append(keys, r.Key)
	}
	if strings.Join(keys, ",") != strings.Join([]string{order[0], order[3], order[4]}, ",") || res.Cursor == "" {
		t.Fatalf("page = %v, cursor %q; want %v and more to come", keys, res.Cursor, []string{order[0], order[3], order[4]})
	}
	res, err = s.Scan(context.Background(), store.ScanParams{Now: t0.Add(time.Minute), Limit: 3, Cursor: res.Cursor})
	if err != nil || len(res.Records) != 1 || res.Records[0].Key != order[5] || res.Cursor != "" {
		t.Fatalf("second page = %+v, %v; want %s alone, and the end", res, err, order[5])
	}
}

// TestConcurrentWritesOneRecord hammers the compare-and-swap loop: many
// checkpoints of one lease at once all land, none lost.
func TestConcurrentWritesOneRecord(t *testing.T) {
	t.Parallel()
	s := newTestStore(t, testClient(t), Config{})
	r := testkit.Acquire(t, s, "s", "k", t0, time.Minute)
	const n = 40
	var wg sync.WaitGroup
	errs := make(chan error, n)
	start := make(chan struct{})
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			errs <- s.Checkpoint(context.Background(), store.CheckpointParams{Scope: "s", Key: "k", Token: r.Token,
				Now: t0.Add(time.Duration(i) * time.Millisecond), Name: "step-" + strconv.Itoa(i)})
		}()
	}
	close(start)
	wait.Done(t, 2*time.Minute, "the concurrent goroutines to finish", wg.Wait)
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	got, err := s.Get(context.Background(), store.GetParams{Scope: "s", Key: "k", Now: t0})
	if err != nil {
		t.Fatal(err)
	}
	names := map[string]bool{}
	for _, c := range got.Checkpoints {
		names[c.Name] = true
	}
	if len(got.Checkpoints) != n || len(names) != n {
		t.Fatalf("%d checkpoints stored (%d distinct), want %d", len(got.Checkpoints), len(names), n)
	}
}

// TestConcurrentAcquiresOneIndex: 200 new keys acquired at once in one shard
// all append to its index; a scan finds every one of them.
func TestConcurrentAcquiresOneIndex(t *testing.T) {
	t.Parallel()
	s := newTestStore(t, testClient(t), Config{Shards: 1})
	const n = storetest.Racers
	var wg sync.WaitGroup
	errs := make(chan error, n)
	start := make(chan struct{})
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			_, err := s.Acquire(context.Background(), store.AcquireParams{Scope: "s", Key: "k" + strconv.Itoa(i), Fingerprint: testkit.Fingerprint("a"),
				Token: strings.Repeat("a", 32), Now: t0, LeaseExpires: t0.Add(time.Minute)})
			errs <- err
		}()
	}
	close(start)
	wait.Done(t, 2*time.Minute, "the concurrent goroutines to finish", wg.Wait)
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	if got := len(indexOf(t, s, 0)); got != n {
		t.Fatalf("the index holds %d entries, want %d", got, n)
	}
	seen := map[string]bool{}
	cursor := ""
	for {
		res, err := s.Scan(context.Background(), store.ScanParams{Now: t0.Add(time.Minute), Limit: 30, Cursor: cursor})
		if err != nil {
			t.Fatal(err)
		}
		for _, r := range res.Records {
			if seen[r.Key] {
				t.Fatalf("%s returned twice", r.Key)
			}
			seen[r.Key] = true
		}
		if cursor = res.Cursor; cursor == "" {
			break
		}
	}
	if len(seen) != n {
		t.Fatalf("scan found %d of %d records", len(seen), n)
	}
}

// TestBodyLimit: bodies up to MaxBody are kept byte for byte, larger ones
// are omitted, and a record still too large (headers over the item, or too
// many checkpoints) fails with ErrInvalid before anything is written.
func TestBodyLimit(t *testing.T) {
	t.Parallel()
	client, cnt := countingClient(t)
	s := newTestStore(t, client, Config{MaxItem: MinMaxItem})
	ctx := context.Background()
	if s.MaxBody() != MinMaxItem-BodyReserve {
		t.Fatalf("MaxBody = %d", s.MaxBody())
	}
	for key, size := range map[string]int{"at": s.MaxBody(), "over": s.MaxBody() + 1} {
		r := testkit.Acquire(t, s, "s", key, t0, time.Minute)
		body := bytes.Repeat([]byte{'\n'}, size)
		if err := s.Finish(ctx, idem.FinishParams{Scope: "s", Key: key, Token: r.Token, Now: t0, State: idem.StateCompleted,
			Response: &idem.Response{Status: 200, Body: body}, Expires: t0.Add(time.Hour)}); err != nil {
			t.Fatalf("%s: %v", key, err)
		}
		got, err := s.Get(ctx, store.GetParams{Scope: "s", Key: key, Now: t0})
		if err != nil {
			t.Fatal(err)
		}
		if size <= s.MaxBody() && (!bytes.Equal(got.Response.Body, body) || got.Response.BodyOmitted) ||
			size > s.MaxBody() && (got.Response.Body != nil || !got.Response.BodyOmitted) {
			t.Fatalf("%s: body of %d bytes stored as %d bytes, omitted %v", key, size, len(got.Response.Body), got.Response.BodyOmitted)
		}
	}

	r := testkit.Acquire(t, s, "s", "headers", t0, time.Minute)
	before := cnt.n.Load()
	err := s.Finish(ctx, idem.FinishParams{Scope: "s", Key: "headers", Token: r.Token, Now: t0, State: idem.StateCompleted,
		Response: &idem.Response{Status: 200, Header: http.Header{"X-Big": {strings.Repeat("h", MinMaxItem)}}}, Expires: t0.Add(time.Hour)})
	if !errors.Is(err, idem.ErrInvalid) {
		t.Fatalf("Finish with headers over the reserve: %v, want ErrInvalid", err)
	}
	if n := cnt.n.Load() - before; n != 1 {
		t.Errorf("the refused Finish made %d round trips, want 1 (the read)", n)
	}
	if got, err := s.Get(ctx, store.GetParams{Scope: "s", Key: "headers", Now: t0}); err != nil || got.State != idem.StateInProgress {
		t.Fatalf("after the refused Finish: %+v, %v", got, err)
	}

	data := bytes.Repeat([]byte{'"'}, store.MaxCheckpointData)
	stored := 0
	for i := 0; ; i++ {
		err := s.Checkpoint(ctx, store.CheckpointParams{Scope: "s", Key: "headers", Token: r.Token, Now: t0, Name: "c", Data: data})
		if errors.Is(err, idem.ErrInvalid) {
			break
		}
		if err != nil || i > 100 {
			t.Fatalf("checkpoint %d: %v", i, err)
		}
		stored++
	}
	got, err := s.Get(ctx, store.GetParams{Scope: "s", Key: "headers", Now: t0})
	if err != nil || len(got.Checkpoints) != stored || stored == 0 {
		t.Fatalf("after checkpoints up to the limit: %d stored of %d accepted, %v", len(got.Checkpoints), stored, err)
	}
}

// TestServerLimitBelowMaxItem: a MaxItem above the server's item size limit
// lets through a record the server refuses. A completed record is then
// stored in the first smaller form the server takes, after as many
// refusals as it takes (and a repeat of its Finish lands); one the server
// refuses even so is ErrInvalid, and the record is left as it was.
func TestServerLimitBelowMaxItem(t *testing.T) {
	t.Parallel()
	s := newTestStore(t, testClient(t), Config{MaxItem: 4 << 20})
	ctx := context.Background()
	r := testkit.Acquire(t, s, "s", "k", t0, time.Minute)
	p := idem.FinishParams{Scope: "s", Key: "k", Token: r.Token, Now: t0, State: idem.StateCompleted,
		Response: &idem.Response{Status: 200, Body: make([]byte, 2<<20)}, Expires: t0.Add(time.Hour)}
	if err := s.Finish(ctx, p); err != nil {
		t.Fatalf("Finish of a body under MaxBody but over the server's limit: %v", err)
	}
	got, err := s.Get(ctx, store.GetParams{Scope: "s", Key: "k", Now: t0})
	if err != nil || got.State != idem.StateCompleted || !got.Response.BodyOmitted || got.Response.Body != nil || got.Response.Status != 200 {
		t.Fatalf("after Finish: %+v, %v; want completed with the body omitted", got.Response, err)
	}
	p.Repeat = true
	if err := s.Finish(ctx, p); err != nil {
		t.Fatalf("the Finish repeated: %v, want it to land", err)
	}

	r = testkit.Acquire(t, s, "s", "headers", t0, time.Minute)
	err = s.Finish(ctx, idem.FinishParams{Scope: "s", Key: "headers", Token: r.Token, Now: t0, State: idem.StateCompleted,
		Response: &idem.Response{Status: 200, Header: http.Header{"X-Big": {strings.Repeat("h", 2<<20)}}}, Expires: t0.Add(time.Hour)})
	if !errors.Is(err, idem.ErrInvalid) || errors.Is(err, idem.ErrUnavailable) {
		t.Fatalf("Finish of headers over the server's limit: %v, want ErrInvalid", err)
	}
	if got, err := s.Get(ctx, store.GetParams{Scope: "s", Key: "headers", Now: t0}); err != nil || got.State != idem.StateInProgress {
		t.Fatalf("after the refused Finish: %+v, %v", got, err)
	}

	// A record with checkpoints and a body over the server's limit: the
	// server refuses it, then its form without the checkpoints, and takes
	// the one with the body omitted, checkpoints kept.
	r = testkit.Acquire(t, s, "s", "checkpoints", t0, time.Minute)
	for i := range 3 {
		if err := s.Checkpoint(ctx, store.CheckpointParams{Scope: "s", Key: "checkpoints", Token: r.Token, Now: t0, Name: fmt.Sprintf("c%d", i), Data: []byte("d")}); err != nil {
			t.Fatalf("checkpoint %d: %v", i, err)
		}
	}
	p = idem.FinishParams{Scope: "s", Key: "checkpoints", Token: r.Token, Now: t0, State: idem.StateCompleted,
		Response: &idem.Response{Status: 200, Body: make([]byte, 2<<20)}, Expires: t0.Add(time.Hour)}
	if err := s.Finish(ctx, p); err != nil {
		t.Fatalf("Finish of a body over the server's limit after checkpoints: %v", err)
	}
	got, err = s.Get(ctx, store.GetParams{Scope: "s", Key: "checkpoints", Now: t0})
	if err != nil {
		t.Fatal(err)
	}
	if got.State != idem.StateCompleted || !got.Response.Equal(p.Response.WithoutBody()) || len(got.Checkpoints) != 3 {
		t.Fatalf("after Finish: %v, body omitted %v, %d checkpoints; want completed with the body omitted and 3 checkpoints",
			got.State, got.Response != nil && got.Response.BodyOmitted, len(got.Checkpoints))
	}
	p.Repeat = true
	if err := s.Finish(ctx, p); err != nil {
		t.Fatalf("the Finish repeated: %v, want it to land", err)
	}
}

// TestCheckpointsTakeBodyRoom: checkpoints, each within its limits, may
// grow a record past the reserve; a completion whose body is under MaxBody
// but no longer fits beside them is stored without the checkpoints, its
// body whole, rather than refused (which would lose an outcome the client
// saw), and a repeat of that Finish lands while another does not.
func TestCheckpointsTakeBodyRoom(t *testing.T) {
	t.Parallel()
	s := newTestStore(t, testClient(t), Config{})
	ctx := context.Background()
	r := testkit.Acquire(t, s, "s", "k", t0, time.Minute)
	data := bytes.Repeat([]byte("x"), store.MaxCheckpointData)
	for i := range 20 { // 20 downstream calls, one checkpoint each
		if err := s.Checkpoint(ctx, store.CheckpointParams{Scope: "s", Key: "k", Token: r.Token, Now: t0, Name: fmt.Sprintf("call-%d", i), Data: data}); err != nil {
			t.Fatalf("checkpoint %d: %v", i, err)
		}
	}
	resp := &idem.Response{Status: 201, Header: http.Header{"Content-Type": {"application/json"}}, Body: bytes.Repeat([]byte("b"), s.MaxBody()-1)}
	p := idem.FinishParams{Scope: "s", Key: "k", Token: r.Token, Now: t0, State: idem.StateCompleted, Response: resp, Expires: t0.Add(time.Hour)}
	if err := s.Finish(ctx, p); err != nil {
		t.Fatalf("Finish of a body under MaxBody after 20 checkpoints: %v", err)
	}
	got, err := s.Get(ctx, store.GetParams{Scope: "s", Key: "k", Now: t0})
	if err != nil {
		t.Fatal(err)
	}
	if got.State != idem.StateCompleted || !got.Response.Equal(resp) || len(got.Checkpoints) != 0 {
		t.Fatalf("after Finish: %v, body omitted %v, %d checkpoints; want completed with the body whole and no checkpoints",
			got.State, got.Response != nil && got.Response.BodyOmitted, len(got.Checkpoints))
	}
	p.Repeat = true
	if err := s.Finish(ctx, p); err != nil {
		t.Fatalf("the Finish repeated: %v, want it to land", err)
	}
	p.Repeat = false
	if err := s.Finish(ctx, p); !errors.Is(err, idem.ErrLeaseLost) {
		t.Fatalf("the Finish sent again, not as a repeat: %v, want ErrLeaseLost", err)
	}
}

// TestCheckpointsLeaveRoomForOutcome: checkpoints stop (ErrInvalid, before
// the step they guard) while the item still has room for a completion's
// status and headers, so that the outcome of the work they recorded can
// always be stored, its body omitted if need be.
func TestCheckpointsLeaveRoomForOutcome(t *testing.T) {
	t.Parallel()
	s := newTestStore(t, testClient(t), Config{MaxItem: MinMaxItem})
	ctx := context.Background()
	r := testkit.Acquire(t, s, "s", "k", t0, time.Minute)
	// Checkpoints of the largest kind until there is no room left: the
	// last one accepted leaves less room than one of them takes.
	data := bytes.Repeat([]byte{'"'}, store.MaxCheckpointData)
	for i := 0; ; i++ {
		err := s.Checkpoint(ctx, store.CheckpointParams{Scope: "s", Key: "k", Token: r.Token, Now: t0, Name: strings.Repeat("n", store.MaxCheckpointName), Data: data})
		if errors.Is(err, idem.ErrInvalid) {
			break
		}
		if err != nil || i > 100 {
			t.Fatalf("checkpoint %d: %v", i, err)
		}
	}
	resp := &idem.Response{Status: 200, Header: http.Header{"X-Trace": {strings.Repeat("h", 8<<10)}}, Body: []byte("ok")}
	if err := s.Finish(ctx, idem.FinishParams{Scope: "s", Key: "k", Token: r.Token, Now: t0, State: idem.StateCompleted,
		Response: resp, Expires: t0.Add(time.Hour)}); err != nil {
		t.Fatalf("Finish with 8 KiB of headers after checkpoints up to the limit: %v", err)
	}
	got, err := s.Get(ctx, store.GetParams{Scope: "s", Key: "k", Now: t0})
	if err != nil || got.State != idem.StateCompleted || got.Response.Header.Get("X-Trace") != resp.Header.Get("X-Trace") {
		t.Fatalf("after Finish: %v; want the record completed with its headers", err)
	}
}

// fillCheckpoints records checkpoints of the largest data on the lease of r
// until the store refuses one (ErrInvalid: the item keeps 16 KiB for the
// outcome), at most limit of them, and returns how many it took.
func fillCheckpoints(t *testing.T, s *Store, r idem.Record, limit int) int {
	t.Helper()
	data := bytes.Repeat([]byte("x"), store.MaxCheckpointData)
	for n := 0; n < limit; n++ {
		err := s.Checkpoint(context.Background(), store.CheckpointParams{Scope: r.Scope, Key: r.Key, Token: r.Token, Now: t0, Name: fmt.Sprintf("call-%d", n), Data: data})
		if errors.Is(err, idem.ErrInvalid) && n > 0 {
			return n
		}
		if err != nil || n > 1000 {
			t.Fatalf("checkpoint %d: %v", n, err)
		}
	}
	return limit
}

// TestOutcomeKeptAfterCheckpointsFillTheItem: a handler that recorded
// checkpoints until the store took no more, then answered with headers over
// the 16 KiB the item keeps for them, has had its side effect; its outcome
// is stored, whole, in place of the checkpoints (recovery points a settled
// record no longer needs), rather than refused and lost (the record left
// IN_PROGRESS, later UNKNOWN). A retry replays it, and the owner's repeat of
// its Finish lands. (The smallest item keeps the test quick: with 1 MiB it
// is 186 checkpoints, and the same failure.)
func TestOutcomeKeptAfterCheckpointsFillTheItem(t *testing.T) {
	t.Parallel()
	s := newTestStore(t, testClient(t), Config{MaxItem: MinMaxItem})
	ctx := context.Background()
	r := testkit.Acquire(t, s, "s", "cps", t0, time.Hour)
	n := fillCheckpoints(t, s, r, math.MaxInt)
	resp := &idem.Response{Status: 200, Header: http.Header{"Content-Security-Policy": {strings.Repeat("a", 20<<10)}}, Body: []byte("ok")}
	p := store.FinishParams{Scope: "s", Key: "cps", Token: r.Token, Now: t0, State: idem.StateCompleted, Response: resp, Expires: t0.Add(time.Hour)}
	if err := s.Finish(ctx, p); err != nil {
		t.Fatalf("Finish with 20 KiB of headers after %d checkpoints: %v", n, err)
	}
	got, err := s.Get(ctx, store.GetParams{Scope: "s", Key: "cps", Now: t0})
	if err != nil {
		t.Fatal(err)
	}
	if got.State != idem.StateCompleted || !got.Response.Equal(resp) || len(got.Checkpoints) != 0 {
		t.Fatalf("after Finish: %v, %d checkpoints; want completed with the response whole and no checkpoints", got.State, len(got.Checkpoints))
	}
	replay, err := s.Acquire(ctx, store.AcquireParams{Scope: "s", Key: "cps", Fingerprint: testkit.Fingerprint("a"), Token: strings.Repeat("b", 32),
		Now: t0, LeaseExpires: t0.Add(time.Minute)})
	if err != nil || replay.State != idem.StateCompleted || replay.Token != r.Token || !replay.Response.Equal(resp) {
		t.Fatalf("a retry's Acquire: %v, %v; want the completed record, to replay", replay.State, err)
	}
	p.Repeat = true
	if err := s.Finish(ctx, p); err != nil {
		t.Fatalf("the owner's repeat of that Finish: %v, want it to land", err)
	}
	p.Repeat = false
	if err := s.Finish(ctx, p); !errors.Is(err, idem.ErrLeaseLost) {
		t.Fatalf("the Finish sent again, not as a repeat: %v, want ErrLeaseLost", err)
	}
}

// TestOutcomeFormThatFits: a completion that does not fit in the item is
// stored in the most useful form that does: without its checkpoints, so
// that a replay still sends the body; else with its body omitted and its
// checkpoints kept; else without either. The owner's repeat of each stored
// Finish lands.
func TestOutcomeFormThatFits(t *testing.T) {
	t.Parallel()
	s := newTestStore(t, testClient(t), Config{MaxItem: MinMaxItem})
	ctx := context.Background()
	for _, c := range []struct {
		name        string
		checkpoints int // at most, up to the store's refusal
		header      int
		body        int
		keepBody    bool
		keepCps     bool
	}{
		{"fits", 2, 1 << 10, s.MaxBody() - 2<<10, true, true},
		{"checkpoints dropped", 8, 40 << 10, s.MaxBody(), true, false},
		{"body omitted", 4, 70 << 10, s.MaxBody(), false, true},
		{"both", math.MaxInt, 70 << 10, s.MaxBody(), false, false},
	} {
		r := testkit.Acquire(t, s, "s", c.name, t0, time.Hour)
		n := fillCheckpoints(t, s, r, c.checkpoints)
		resp := &idem.Response{Status: 201, Header: http.Header{"X-Big": {strings.Repeat("h", c.header)}}, Body: bytes.Repeat([]byte("b"), c.body)}
		p := store.FinishParams{Scope: "s", Key: c.name, Token: r.Token, Now: t0, State: idem.StateCompleted, Response: resp, Expires: t0.Add(time.Hour)}
		if err := s.Finish(ctx, p); err != nil {
			t.Errorf("%s: Finish after %d checkpoints: %v", c.name, n, err)
			continue
		}
		want, wantCps := resp, 0
		if !c.keepBody {
			want = resp.WithoutBody()
		}
		if c.keepCps {
			wantCps = n
		}
		got, err := s.Get(ctx, store.GetParams{Scope: "s", Key: c.name, Now: t0})
		if err != nil {
			t.Fatal(err)
		}
		if got.State != idem.StateCompleted || !got.Response.Equal(want) || len(got.Checkpoints) != wantCps {
			t.Errorf("%s: stored %v, body omitted %v, %d of %d checkpoints; want completed, body kept %v, checkpoints kept %v",
				c.name, got.State, got.Response != nil && got.Response.BodyOmitted, len(got.Checkpoints), n, c.keepBody, c.keepCps)
			continue
		}
		p.Repeat = true
		if err := s.Finish(ctx, p); err != nil {
			t.Errorf("%s: the owner's repeat of that Finish: %v, want it to land", c.name, err)
		}
	}
}

func TestCanceledContext(t *testing.T) {
	t.Parallel()
	s := newTestStore(t, testClient(t), Config{})
	r := testkit.Acquire(t, s, "s", "k", t0, time.Minute)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	errs := map[string]error{
		"Renew":      s.Renew(ctx, store.RenewParams{Scope: "s", Key: "k", Token: r.Token, Now: t0, LeaseExpires: t0.Add(time.Hour)}),
		"Checkpoint": s.Checkpoint(ctx, store.CheckpointParams{Scope: "s", Key: "k", Token: r.Token, Now: t0, Name: "x"}),
		"Finish": s.Finish(ctx, idem.FinishParams{Scope: "s", Key: "k", Token: r.Token, Now: t0, State: idem.StateFailed,
			Expires: t0.Add(time.Hour)}),
	}
	_, errs["Acquire"] = s.Acquire(ctx, store.AcquireParams{Scope: "s", Key: "new", Fingerprint: testkit.Fingerprint("a"), Token: r.Token,
		Now: t0, LeaseExpires: t0.Add(time.Minute)})
	_, errs["Get"] = s.Get(ctx, store.GetParams{Scope: "s", Key: "k", Now: t0})
	_, errs["Scan"] = s.Scan(ctx, store.ScanParams{Now: t0})
	for name, err := range errs {
		if !errors.Is(err, context.Canceled) || errors.Is(err, idem.ErrUnavailable) {
			t.Errorf("%s with a canceled context: %v, want context.Canceled", name, err)
		}
	}
	if got, err := s.Get(context.Background(), store.GetParams{Scope: "s", Key: "k", Now: t0}); err != nil ||
		!reflect.DeepEqual(got, r) {
		t.Fatalf("the record changed under canceled calls: %+v, %v", got, err)
	}
	if _, err := s.Get(context.Background(), store.GetParams{Scope: "s", Key: "new", Now: t0}); !errors.Is(err, idem.ErrNotFound) {
		t.Fatalf("a canceled Acquire wrote a record: %v", err)
	}
}

func TestUnreachableServer(t *testing.T) {
	t.Parallel()
	// A server that cannot be reached is the suite's (RunFaults); a client
	// without servers is this store's own case.
	for name, client := range map[string]*memcache.Client{"no servers": memcache.New()} {
		s, err := New(Config{Client: client})
		if err != nil {
			t.Fatal(err)
		}
		ctx := context.Background()
		tok := strings.Repeat("a", 32)
		errs := map[string]error{
			"Renew":      s.Renew(ctx, store.RenewParams{Key: "k", Token: tok, Now: t0, LeaseExpires: t0.Add(time.Minute)}),
			"Checkpoint": s.Checkpoint(ctx, store.CheckpointParams{Key: "k", Token: tok, Now: t0, Name: "x"}),
			"Finish":     s.Finish(ctx, idem.FinishParams{Key: "k", Token: tok, Now: t0, State: idem.StateFailed, Expires: t0.Add(time.Hour)}),
		}
		_, errs["Acquire"] = s.Acquire(ctx, store.AcquireParams{Key: "k", Fingerprint: testkit.Fingerprint("a"), Token: tok, Now: t0, LeaseExpires: t0.Add(time.Minute)})
		_, errs["Get"] = s.Get(ctx, store.GetParams{Key: "k", Now: t0})
		_, errs["Scan"] = s.Scan(ctx, store.ScanParams{Now: t0})
		for op, err := range errs {
			if !errors.Is(err, idem.ErrUnavailable) {
				t.Errorf("%s: %s: err = %v, want ErrUnavailable", name, op, err)
			}
			if !strings.HasPrefix(err.Error(), "memcachedstore: "+strings.ToLower(op)+": ") {
				t.Errorf("%s: error %q does not say which operation failed", name, err)
			}
		}
	}
}

func TestTranslate(t *testing.T) {
	for name, err := range map[string]error{
		"refused":         &net.OpError{Op: "dial", Net: "tcp", Err: errors.New("connection refused")},
		"connect timeout": &memcache.ConnectTimeoutError{Addr: &net.TCPAddr{}},
		"no servers":      memcache.ErrNoServers,
		"server error":    memcache.ErrServerError,
		"eof":             io.EOF,
		"deadline":        fmt.Errorf("read: %w", context.DeadlineExceeded),
	} {
		if got := translate("get", err); !errors.Is(got, idem.ErrUnavailable) || errors.Is(got, store.ErrRefused) || !errors.Is(got, err) {
			t.Errorf("%s: %v, want ErrUnavailable (not ErrRefused) wrapping the cause", name, got)
		}
	}
	// memcached -M refuses a write it has no room for: reached, it may
	// hold the record, so this is never a reason to fail open.
	for name, err := range map[string]error{
		"out of memory storing": fmt.Errorf("memcache: unexpected response line from %q: %q", "cas", "SERVER_ERROR out of memory storing object\r\n"),
		"out of memory append":  fmt.Errorf("memcache: unexpected response line from %q: %q", "append", "SERVER_ERROR out of memory storing object\r\n"),
	} {
		if got := translate("acquire", err); !errors.Is(got, idem.ErrUnavailable) || !errors.Is(got, store.ErrRefused) || !errors.Is(got, err) {
			t.Errorf("%s: %v, want ErrUnavailable and ErrRefused wrapping the cause", name, got)
		}
	}
	tooLarge := translate("finish", fmt.Errorf("memcache: unexpected response line from %q: %q", "cas", "SERVER_ERROR object too large for cache\r\n"))
	if !errors.Is(tooLarge, idem.ErrInvalid) || errors.Is(tooLarge, idem.ErrUnavailable) {
		t.Errorf("too large: %v, want ErrInvalid", tooLarge)
	}
	for name, err := range map[string]error{
		"canceled":      context.Canceled,
		"malformed key": memcache.ErrMalformedKey,
		"client error":  fmt.Errorf("memcache: unexpected response line from %q: %q", "set", "CLIENT_ERROR bad data chunk\r\n"),
	} {
		if got := translate("get", err); errors.Is(got, idem.ErrUnavailable) || !errors.Is(got, err) {
			t.Errorf("%s: %v, want the cause alone", name, got)
		}
	}
}

func TestPrune(t *testing.T) {
	s, err := New(Config{Client: memcache.New("127.0.0.1:1")}) // never contacted
	if err != nil {
		t.Fatal(err)
	}
	if n, err := s.Prune(context.Background(), store.PruneParams{Now: t0}); n != 0 || err != nil {
		t.Fatalf("Prune = %d, %v; want 0, nil (Memcached expires records itself)", n, err)
	}
	if _, err := s.Prune(context.Background(), store.PruneParams{}); !errors.Is(err, idem.ErrInvalid) {
		t.Fatalf("Prune without a time: %v, want ErrInvalid", err)
	}
}

// TestFaults runs the suite's network-fault cases, through a TCP proxy
// between the store and the server.
func TestFaults(t *testing.T) {
	target := testAddr(t)
	storetest.RunFaults(t, target, func(t *testing.T, addr string) idem.Store {
		client := memcache.New(addr)
		client.MaxIdleConns = 1
		return newTestStore(t, client, Config{Servers: []string{addr}})
	})
}
