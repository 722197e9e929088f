package redisstore

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"reflect"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/testkit"
	"github.com/idemhq/idem/store"
	"github.com/idemhq/idem/store/storetest"
	"github.com/redis/go-redis/v9"
)

func TestMain(m *testing.M) { testkit.Main(m) }

// testClusterClient returns a client of the Redis Cluster that
// IDEM_TEST_REDIS_CLUSTER_ADDRS lists (testdata/start-cluster.sh starts
// one), or skips.
func testClusterClient(tb testing.TB) *redis.ClusterClient {
	tb.Helper()
	addrs := testkit.Server(tb, "IDEM_TEST_REDIS_CLUSTER_ADDRS")
	client := redis.NewClusterClient(&redis.ClusterOptions{Addrs: strings.Split(addrs, ","), PoolSize: 64})
	tb.Cleanup(func() { client.Close() })
	return client
}

// testOptions returns the client options of IDEM_TEST_REDIS_URL, or skips.
func testOptions(tb testing.TB) *redis.Options {
	tb.Helper()
	opt, err := redis.ParseURL(testkit.Server(tb, "IDEM_TEST_REDIS_URL"))
	if err != nil {
		tb.Fatalf("IDEM_TEST_REDIS_URL: %v", err)
	}
	return opt
}

var shared struct {
	once   sync.Once
	client *redis.Client
}

// testClient returns a client shared by the tests, or skips.
func testClient(tb testing.TB) *redis.Client {
	tb.Helper()
	opt := testOptions(tb)
	shared.once.Do(func() {
		opt.PoolSize = 64 // the suite races 200 goroutines on one key
		opt.PoolTimeout = 30 * time.Second
		shared.client = redis.NewClient(opt)
	})
	return shared.client
}

// randomPrefix returns a prefix no other test uses.
func randomPrefix(tb testing.TB) string {
	var b [8]byte
	if _, err := rand.Read(b[:]); err != nil {
		tb.Fatal(err)
	}
	return "idemtest-" + hex.EncodeToString(b[:])
}

// newTestStore returns a store under a fresh prefix whose keys are deleted
// when the test ends.
func newTestStore(tb testing.TB, client redis.UniversalClient, shards int) *Store {
	tb.Helper()
	prefix := randomPrefix(tb)
	s, err := New(Config{Client: client, Prefix: prefix, Shards: shards})
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() {
		if err := deleteKeys(context.Background(), client, prefix+"{*"); err != nil {
			tb.Errorf("deleting the test's keys: %v", err)
		}
	})
	return s
}

// deleteKeys unlinks every key matching pattern, on every master of a cluster.
func deleteKeys(ctx context.Context, client redis.UniversalClient, pattern string) error {
	del := func(ctx context.Context, c *redis.Client) error {
		iter := c.Scan(ctx, 0, pattern, 1000).Iterator()
		var batch []string
		for iter.Next(ctx) {
			batch = append(batch, iter.Val())
		}
		if err := iter.Err(); err != nil {
			return err
		}
		// UNLINK one key at a time: on a cluster the keys span many slots.
		pipe := c.Pipeline()
		for _, k := range batch {
			pipe.Unlink(ctx, k)
		}
		if len(batch) > 0 {
			_, err := pipe.Exec(ctx)
			return err
		}
		return nil
	}
	switch c := client.(type) {
	case *redis.ClusterClient:
		return c.ForEachMaster(ctx, del)
	case *redis.Client:
		return del(ctx, c)
	}
	return fmt.Errorf("cannot clean up after a %T", client)
}

func TestConformance(t *testing.T) {
	client := testClient(t)
	storetest.Run(t, func(t *testing.T) idem.Store { return newTestStore(t, client, 0) })
}

// TestConformanceOneShard puts every record in one shard, so that scans
// page through one pending set full of equal scores.
func TestConformanceOneShard(t *testing.T) {
	client := testClient(t)
	storetest.Run(t, func(t *testing.T) idem.Store { return newTestStore(t, client, 1) })
}

// TestConformanceCluster runs the suite on Redis Cluster when
// IDEM_TEST_REDIS_CLUSTER_ADDRS lists its nodes (testdata/start-cluster.sh
// starts one).
func TestConformanceCluster(t *testing.T) {
	client := testClusterClient(t)
	storetest.Run(t, func(t *testing.T) idem.Store { return newTestStore(t, client, 0) })
}

// TestConformanceInstances runs the two-instance cases on two stores under
// one prefix, each with a client of its own, as two processes would have.
func TestConformanceInstances(t *testing.T) {
	storetest.RunInstances(t, func(t *testing.T) (idem.Store, idem.Store) {
		return newTestInstances(t, func() redis.UniversalClient {
			opt := testOptions(t)
			opt.PoolSize = 64 // 200 racers
			opt.PoolTimeout = 30 * time.Second
			client := redis.NewClient(opt)
			t.Cleanup(func() { client.Close() })
			return client
		})
	})
}

// TestConformanceInstancesCluster runs the two-instance cases on Redis
// Cluster.
func TestConformanceInstancesCluster(t *testing.T) {
	storetest.RunInstances(t, func(t *testing.T) (idem.Store, idem.Store) {
		return newTestInstances(t, func() redis.UniversalClient { return testClusterClient(t) })
	})
}

// newTestInstances returns two stores under one fresh prefix, each on a
// client that newClient makes, whose keys are deleted when the test ends.
func newTestInstances(t *testing.T, newClient func() redis.UniversalClient) (*Store, *Store) {
	t.Helper()
	prefix := randomPrefix(t)
	instance := func() *Store {
		s, err := New(Config{Client: newClient(), Prefix: prefix})
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	a, b := instance(), instance()
	t.Cleanup(func() {
		if err := deleteKeys(context.Background(), a.client, prefix+"{*"); err != nil {
			t.Errorf("deleting the test's keys: %v", err)
		}
	})
	return a, b
}

func TestNewValidatesConfig(t *testing.T) {
	client := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"}) // never contacted
	t.Cleanup(func() { client.Close() })
	for name, cfg := range map[string]Config{
		"no client":       {},
		"prefix with {":   {Client: client, Prefix: "a{b"},
		"prefix with }":   {Client: client, Prefix: "a}b"},
		"negative shards": {Client: client, Shards: -1},
		"too many shards": {Client: client, Shards: MaxShards + 1},
	} {
		if _, err := New(cfg); !errors.Is(err, idem.ErrInvalid) {
			t.Errorf("New with %s: err = %v, want ErrInvalid", name, err)
		}
	}
	s, err := New(Config{Client: client})
	if err != nil {
		t.Fatal(err)
	}
	if len(s.tags) != DefaultShards || s.tags[5] != "idem{idem:5}" || s.pending[5] != "idem{idem:5}:pending" {
		t.Fatalf("defaults: %d shards, tag %q, pending %q", len(s.tags), s.tags[5], s.pending[5])
	}
	if _, err := New(Config{Client: client, Shards: MaxShards}); err != nil {
		t.Fatalf("New with %d shards: %v", MaxShards, err)
	}
}

// crc16 is CRC-16/XMODEM, the checksum of Redis Cluster's key slots.
func crc16(b string) uint16 {
	var crc uint16
	for i := 0; i < len(b); i++ {
		crc ^= uint16(b[i]) << 8
		for range 8 {
			if crc&0x8000 != 0 {
				crc = crc<<1 ^ 0x1021
			} else {
				crc <<= 1
			}
		}
	}
	return crc
}

// keySlot is the Redis Cluster slot of key: the CRC16 of its hash tag (the
// bytes between the first '{' and the first '}' after it, when not empty),
// or of the whole key, mod 16384.
func keySlot(key string) int {
	if i := strings.IndexByte(key, '{'); i >= 0 {
		if j := strings.IndexByte(key[i+1:], '}'); j > 0 {
			key = key[i+1 : i+1+j]
		}
	}
	return int(crc16(key)) % 16384
}

func TestKeySlot(t *testing.T) {
	// Vectors from the CRC-16/XMODEM catalogue and the Redis Cluster spec.
	if got := crc16("123456789"); got != 0x31c3 {
		t.Fatalf("crc16(123456789) = %#x, want 0x31c3", got)
	}
	for key, want := range map[string]int{
		"foo":                  12182,
		"{user1000}.following": keySlot("user1000"),
		"foo{}{bar}":           keySlot("foo{}{bar}"), // empty first tag: the whole key
		"foo{{bar}}zap":        keySlot("{bar"),
	} {
		if got := keySlot(key); got != want {
			t.Errorf("keySlot(%q) = %d, want %d", key, got, want)
		}
	}
	if keySlot("foo{}{bar}") == keySlot("bar") {
		t.Errorf("an empty first tag must not select the second")
	}
}

func TestRecordKeysShareASlot(t *testing.T) {
	client := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"}) // never contacted
	t.Cleanup(func() { client.Close() })
	s, err := New(Config{Client: client, Prefix: "app:idem", Shards: 16})
	if err != nil {
		t.Fatal(err)
	}
	slots := map[int]bool{}
	for _, ref := range [][2]string{
		{"", "k"},
		{"tenant-a", "018f6f2e-7b1a-7c3d-9e4f-0a1b2c3d4e5f"},
		{"{scope}", "{key}"},
		{"a:b", "c"},
		{"a", "b:c"},
		{"}{", "{}:*?[]"},
		{strings.Repeat("s", idem.MaxScopeLen), strings.Repeat("}", idem.MaxKeyLen)},
	} {
		rec, pending := s.keys(ref[0], ref[1])
		if !strings.HasPrefix(rec, "app:idem{app:idem:") {
			t.Fatalf("record key %q does not begin with the shard's tag", rec)
		}
		if keySlot(rec) != keySlot(pending) {
			t.Errorf("scope %q key %q: record %q in slot %d, pending %q in slot %d",
				ref[0], ref[1], rec, keySlot(rec), pending, keySlot(pending))
		}
		slots[keySlot(rec)] = true
	}
	if a, _ := s.keys("a:b", "c"); a == func() string { b, _ := s.keys("a", "b:c"); return b }() {
		t.Errorf("scope and key are ambiguous in %q", a)
	}
	// The 16 shards are 16 slots, so records spread over a cluster.
	for i := range s.tags {
		slots[keySlot(s.pending[i])] = true
	}
	if len(slots) != 16 {
		t.Errorf("16 shards hash to %d slots, want 16", len(slots))
	}
}

var t0 = time.Date(2030, 1, 2, 3, 4, 5, 6e6, time.UTC)

// checkUnsettled asserts that a record has no TTL and sits in its shard's
// pending set with the given score.
func checkUnsettled(t *testing.T, s *Store, client *redis.Client, key string, score time.Time) {
	t.Helper()
	ctx := context.Background()
	rec, pending := s.keys("s", key)
	if ttl := client.PTTL(ctx, rec).Val(); ttl != -1 {
		t.Errorf("%s: PTTL = %v, want -1 (no TTL)", key, ttl)
	}
	got, err := client.ZScore(ctx, pending, rec).Result()
	if err != nil {
		t.Fatalf("%s: not in its pending set: %v", key, err)
	}
	if int64(got) != score.UnixMilli() {
		t.Errorf("%s: pending score %v, want %d", key, got, score.UnixMilli())
	}
}

// checkSettled asserts that a record expires in about retention and has left
// its shard's pending set.
func checkSettled(t *testing.T, s *Store, client *redis.Client, key string, retention time.Duration) {
	t.Helper()
	ctx := context.Background()
	rec, pending := s.keys("s", key)
	ttl, err := client.PTTL(ctx, rec).Result()
	if err != nil {
		t.Fatal(err)
	}
	if ttl > retention || ttl < retention-10*time.Second {
		t.Errorf("%s: PTTL = %v, want just under %v", key, ttl, retention)
	}
	if err := client.ZScore(ctx, pending, rec).Err(); !errors.Is(err, redis.Nil) {
		t.Errorf("%s: still in its pending set (ZSCORE: %v)", key, err)
	}
}

func TestTTLAndPendingSet(t *testing.T) {
	t.Parallel()
	client := testClient(t)
	s := newTestStore(t, client, 4)
	const lease, retention = 30 * time.Second, 2 * time.Hour

	done := testkit.Acquire(t, s, "s", "done", t0, lease)
	checkUnsettled(t, s, client, "done", t0.Add(lease))
	testkit.Finish(t, s, done, t0.Add(time.Second), idem.StateCompleted, retention)
	checkSettled(t, s, client, "done", retention)

	failed := testkit.Acquire(t, s, "s", "failed", t0, lease)
	testkit.Finish(t, s, failed, t0.Add(time.Second), idem.StateFailed, time.Minute)
	checkSettled(t, s, client, "failed", time.Minute)

	// Marked unknown by its owner while the lease runs: pending at once.
	marked := testkit.Acquire(t, s, "s", "marked", t0, lease)
	testkit.Finish(t, s, marked, t0.Add(time.Second), idem.StateUnknown, 0)
	checkUnsettled(t, s, client, "marked", t0.Add(time.Second))
	// ... and settled later by the owner's late outcome.
	testkit.Finish(t, s, marked, t0.Add(time.Hour), idem.StateCompleted, retention)
	checkSettled(t, s, client, "marked", retention)

	// An expired lease turned unknown by a retry keeps its (past) score.
	crashed := testkit.Acquire(t, s, "s", "crashed", t0, lease)
	r, err := s.Acquire(context.Background(), store.AcquireParams{Scope: "s", Key: "crashed", Fingerprint: testkit.Fingerprint("a"),
		Token: strings.Repeat("b", 32), Now: t0.Add(lease), LeaseExpires: t0.Add(2 * lease)})
	if err != nil || r.State != idem.StateUnknown || r.Token != crashed.Token {
		t.Fatalf("Acquire after expiry = %+v, %v; want unknown under the old token", r, err)
	}
	checkUnsettled(t, s, client, "crashed", t0.Add(lease))
	if stored, err := s.Get(context.Background(), store.GetParams{Scope: "s", Key: "crashed", Now: t0.Add(lease)}); err != nil || !reflect.DeepEqual(stored, r) {
		t.Fatalf("stored unknown record = %+v, %v; Acquire returned %+v", stored, err, r)
	}
	// Its owner declaring it unknown later does not move it either.
	testkit.Finish(t, s, crashed, t0.Add(time.Hour), idem.StateUnknown, 0)
	checkUnsettled(t, s, client, "crashed", t0.Add(lease))

	// A takeover of an expired takeover-safe lease: a new lease, stored, and
	// the pending score follows it.
	safe, err := s.Acquire(context.Background(), store.AcquireParams{Scope: "s", Key: "safe", Fingerprint: testkit.Fingerprint("a"),
		Token: strings.Repeat("c", 32), Now: t0, LeaseExpires: t0.Add(lease), TakeoverSafe: true})
	if err != nil {
		t.Fatal(err)
	}
	later := t0.Add(2 * lease)
	taken, err := s.Acquire(context.Background(), store.AcquireParams{Scope: "s", Key: "safe", Fingerprint: testkit.Fingerprint("a"),
		Token: strings.Repeat("d", 32), Now: later, LeaseExpires: later.Add(lease), TakeoverSafe: true})
	if err != nil || taken.Token == safe.Token || taken.Fence != 2 {
		t.Fatalf("takeover = %+v, %v", taken, err)
	}
	stored, err := s.Get(context.Background(), store.GetParams{Scope: "s", Key: "safe", Now: later})
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(stored, taken) || !stored.Updated.Equal(later) || !stored.Created.Equal(t0) || !stored.LeaseExpires.Equal(later.Add(lease)) {
		t.Fatalf("stored after takeover = %+v, Acquire returned %+v", stored, taken)
	}
	checkUnsettled(t, s, client, "safe", later.Add(lease))

	// A renewal moves the score.
	running := testkit.Acquire(t, s, "s", "running", t0, lease)
	if err := s.Renew(context.Background(), store.RenewParams{Scope: "s", Key: "running", Token: running.Token,
		Now: t0.Add(10 * time.Second), LeaseExpires: t0.Add(40 * time.Second)}); err != nil {
		t.Fatal(err)
	}
	checkUnsettled(t, s, client, "running", t0.Add(40*time.Second))

	// Re-created over an expired record: the TTL is gone again.
	again := testkit.Acquire(t, s, "s", "failed", t0.Add(time.Hour), lease)
	if again.Fence != 1 {
		t.Fatalf("re-created over an expired record: fence %d, want 1", again.Fence)
	}
	checkUnsettled(t, s, client, "failed", t0.Add(time.Hour+lease))

	// Over a live FAILED record, the fence continues.
	released := testkit.Acquire(t, s, "s", "released", t0, lease)
	testkit.Finish(t, s, released, t0, idem.StateFailed, time.Hour)
	rerun := testkit.Acquire(t, s, "s", "released", t0.Add(time.Second), lease)
	if rerun.Fence != 2 {
		t.Fatalf("re-run over a failed record: fence %d, want 2", rerun.Fence)
	}
	checkUnsettled(t, s, client, "released", t0.Add(time.Second+lease))
}

// TestCheckpointsKeptAndDropped follows a record's checkpoints through the
// acquire script: the UNKNOWN transition and settling keep them, and so does
// the record Acquire returns; a re-creation over an expired record drops them.
// A checkpoint leaves the pending score alone.
func TestCheckpointsKeptAndDropped(t *testing.T) {
	t.Parallel()
	client := testClient(t)
	s := newTestStore(t, client, 4)
	ctx := context.Background()
	const lease = 30 * time.Second
	names := func(r idem.Record) string {
		var n []string
		for _, c := range r.Checkpoints {
			n = append(n, c.Name)
		}
		return strings.Join(n, " ")
	}

	r := testkit.Acquire(t, s, "s", "k", t0, lease)
	binary := []byte{0, '\n', 0xff, '"'}
	for i, name := range []string{"authorize", "capture"} {
		if err := s.Checkpoint(ctx, store.CheckpointParams{Scope: "s", Key: "k", Token: r.Token,
			Now: t0.Add(time.Duration(i+1) * time.Second), Name: name, Data: binary}); err != nil {
			t.Fatalf("Checkpoint %s: %v", name, err)
		}
	}
	checkUnsettled(t, s, client, "k", t0.Add(lease))
	stored, err := s.Get(ctx, store.GetParams{Scope: "s", Key: "k", Now: t0})
	if err != nil || names(stored) != "authorize capture" || !stored.Updated.Equal(t0.Add(2*time.Second)) ||
		!stored.Checkpoints[1].At.Equal(t0.Add(2*time.Second)) || string(stored.Checkpoints[1].Data) != string(binary) {
		t.Fatalf("stored after two checkpoints = %+v, %v", stored, err)
	}

	unknown, err := s.Acquire(ctx, store.AcquireParams{Scope: "s", Key: "k", Fingerprint: testkit.Fingerprint("a"),
		Token: strings.Repeat("b", 32), Now: t0.Add(lease), LeaseExpires: t0.Add(2 * lease)})
	if err != nil || unknown.State != idem.StateUnknown || names(unknown) != "authorize capture" {
		t.Fatalf("Acquire after expiry = %+v, %v; want unknown with both checkpoints", unknown, err)
	}
	if stored, err := s.Get(ctx, store.GetParams{Scope: "s", Key: "k", Now: t0.Add(lease)}); err != nil || !reflect.DeepEqual(stored, unknown) {
		t.Fatalf("stored unknown record = %+v, %v; Acquire returned %+v", stored, err, unknown)
	}
	testkit.Finish(t, s, r, t0.Add(lease), idem.StateCompleted, time.Hour)
	replay, err := s.Acquire(ctx, store.AcquireParams{Scope: "s", Key: "k", Fingerprint: testkit.Fingerprint("a"),
		Token: strings.Repeat("c", 32), Now: t0.Add(lease), LeaseExpires: t0.Add(2 * lease)})
	if err != nil || replay.State != idem.StateCompleted || names(replay) != "authorize capture" {
		t.Fatalf("replay = %+v, %v; want completed with both checkpoints", replay, err)
	}

	later := t0.Add(lease + 2*time.Hour)
	again := testkit.Acquire(t, s, "s", "k", later, lease)
	if again.Checkpoints != nil {
		t.Fatalf("re-created record has checkpoints %+v", again.Checkpoints)
	}
	rec, _ := s.keys("s", "k")
	if n, err := client.HExists(ctx, rec, "cps").Result(); err != nil || n {
		t.Fatalf("HEXISTS cps after re-creation = %v, %v", n, err)
	}
}

// countingHook counts the round trips a client makes: one per command, one
// per pipeline.
type countingHook struct{ n atomic.Int64 }

func (h *countingHook) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *countingHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		h.n.Add(1)
		return next(ctx, cmd)
	}
}

func (h *countingHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		h.n.Add(1)
		return next(ctx, cmds)
	}
}

// countingClient returns a client of its own with a counting hook.
func countingClient(tb testing.TB) (*redis.Client, *countingHook) {
	tb.Helper()
	client := redis.NewClient(testOptions(tb))
	tb.Cleanup(func() { client.Close() })
	hook := &countingHook{}
	client.AddHook(hook)
	return client, hook
}

// warmUp loads the store's scripts into the server's cache (the first run
// of a script costs an extra EVAL) and opens a connection in each of the
// client's pools (go-redis keeps one for pipelines), so that the commands
// that set up a connection (HELLO, CLIENT SETINFO) are not counted as the
// cost of an operation.
func warmUp(tb testing.TB, s *Store) {
	tb.Helper()
	ctx := context.Background()
	for _, script := range []*redis.Script{acquireScript, renewScript, checkpointScript, finishScript, scanScript} {
		if err := script.Load(ctx, s.client).Err(); err != nil {
			tb.Fatal(err)
		}
	}
	if _, err := s.client.Pipelined(ctx, func(p redis.Pipeliner) error { return p.Ping(ctx).Err() }); err != nil {
		tb.Fatal(err)
	}
}

func TestRoundTrips(t *testing.T) {
	t.Parallel()
	client, hook := countingClient(t)
	s := newTestStore(t, client, 0)
	warmUp(t, s)
	ctx := context.Background()
	cost := func(what string, want int64, fn func() error) {
		t.Helper()
		before := hook.n.Load()
		if err := fn(); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		if got := hook.n.Load() - before; got != want {
			t.Errorf("%s cost %d round trips, want %d", what, got, want)
		}
	}
	var r idem.Record
	tok := strings.Repeat("a", 32)
	cost("Acquire of a new key", 1, func() (err error) {
		r, err = s.Acquire(ctx, store.AcquireParams{Scope: "s", Key: "k", Fingerprint: testkit.Fingerprint("a"), Token: tok,
			Now: t0, LeaseExpires: t0.Add(time.Minute)})
		return err
	})
	if r.Token != tok {
		t.Fatalf("Acquire did not grant the lease: %+v", r)
	}
	cost("Renew", 1, func() error {
		return s.Renew(ctx, store.RenewParams{Scope: "s", Key: "k", Token: tok, Now: t0, LeaseExpires: t0.Add(2 * time.Minute)})
	})
	for i := range 2 {
		cost("Checkpoint "+strconv.Itoa(i+1), 1, func() error {
			return s.Checkpoint(ctx, store.CheckpointParams{Scope: "s", Key: "k", Token: tok, Now: t0, Name: "step", Data: []byte("x")})
		})
	}
	resp := &idem.Response{Status: 201, Body: []byte("ok")}
	cost("Finish", 1, func() error {
		return s.Finish(ctx, idem.FinishParams{Scope: "s", Key: "k", Token: tok, Now: t0, State: idem.StateCompleted,
			Response: resp, Expires: t0.Add(time.Hour)})
	})
	cost("Acquire that replays", 1, func() (err error) {
		r, err = s.Acquire(ctx, store.AcquireParams{Scope: "s", Key: "k", Fingerprint: testkit.Fingerprint("a"), Token: strings.Repeat("b", 32),
			Now: t0, LeaseExpires: t0.Add(time.Minute)})
		return err
	})
	if r.State != idem.StateCompleted || r.Token != tok || r.Response == nil || string(r.Response.Body) != "ok" {
		t.Fatalf("replay returned %+v", r)
	}
	cost("Get", 1, func() error {
		_, err := s.Get(ctx, store.GetParams{Scope: "s", Key: "k", Now: t0})
		return err
	})
	for i := range 20 {
		u := testkit.Acquire(t, s, "s", "u"+strconv.Itoa(i), t0, time.Minute)
		testkit.Finish(t, s, u, t0, idem.StateUnknown, 0)
		testkit.Acquire(t, s, "s", "running"+strconv.Itoa(i), t0, time.Minute) // not stale: not read
	}
	cost("Scan page", 2, func() error {
		res, err := s.Scan(ctx, store.ScanParams{Now: t0, Limit: 20})
		if err == nil && (len(res.Records) != 20 || res.Cursor != "") {
			err = fmt.Errorf("got %d records, cursor %q; want the 20 unknown ones", len(res.Records), res.Cursor)
		}
		return err
	})
}

// TestScanSkipsVanishedRecords: a pending member whose hash is gone (deleted
// by hand, evicted) is skipped, and the page is still filled.
func TestScanSkipsVanishedRecords(t *testing.T) {
	t.Parallel()
	client := testClient(t)
	s := newTestStore(t, client, 1)
	for i := range 6 {
		testkit.Acquire(t, s, "s", fmt.Sprintf("k%d", i), t0, time.Minute)
	}
	for _, key := range []string{"k1", "k2"} {
		rec, _ := s.keys("s", key)
		if err := client.Del(context.Background(), rec).Err(); err != nil {
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
	if strings.Join(keys, ",") != "k0,k3,k4" || res.Cursor == "" {
		t.Fatalf("page = %v, cursor %q; want k0,k3,k4 and more to come", keys, res.Cursor)
	}
	res, err = s.Scan(context.Background(), store.ScanParams{Now: t0.Add(time.Minute), Limit: 3, Cursor: res.Cursor})
	if err != nil || len(res.Records) != 1 || res.Records[0].Key != "k5" || res.Cursor != "" {
		t.Fatalf("second page = %+v, %v; want k5 alone, and the end", res, err)
	}
}

// closedPort returns a local TCP port nothing listens on.
func closedPort(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	return addr
}

// TestClosedClientIsUnavailable: a store whose client was closed fails
// closed, with ErrUnavailable (the suite's RunFaults covers a server that
// cannot be reached).
func TestClosedClientIsUnavailable(t *testing.T) {
	t.Parallel()
	client := redis.NewClient(testOptions(t))
	s, err := New(Config{Client: client})
	if err != nil {
		t.Fatal(err)
	}
	client.Close()
	_, err = s.Get(context.Background(), store.GetParams{Key: "k", Now: t0})
	if !errors.Is(err, idem.ErrUnavailable) || !strings.HasPrefix(err.Error(), "redisstore: get: ") {
		t.Errorf("Get on a closed client: err = %v, want ErrUnavailable, naming the operation", err)
	}
}

// TestTranslate: every refusal Redis answers with that may pass, like every
// failure to reach it, wraps ErrUnavailable: the engine keeps the outcome
// and tries again instead of dropping it. A script that failed on what it
// found (a key of another type, a damaged record) is the store's answer,
// not unavailability: fail_open must not run past it. The caller's own
// cancellation is not unavailability.
func TestTranslate(t *testing.T) {
	deadline := translate("get", fmt.Errorf("redis: %w", context.DeadlineExceeded))
	if !errors.Is(deadline, idem.ErrUnavailable) || !errors.Is(deadline, context.DeadlineExceeded) {
		t.Errorf("deadline: %v, want both ErrUnavailable and DeadlineExceeded", deadline)
	}
	canceled := translate("get", context.Canceled)
	if errors.Is(canceled, idem.ErrUnavailable) || !errors.Is(canceled, context.Canceled) {
		t.Errorf("canceled: %v, want context.Canceled alone", canceled)
	}
	for _, msg := range []string{"LOADING Redis is loading the dataset in memory", "CLUSTERDOWN The cluster is down",
		"TRYAGAIN Multiple keys request during rehashing of slot", "MASTERDOWN Link with MASTER is down",
		"READONLY You can't write against a read only replica.", "OOM command not allowed when used memory > 'maxmemory'.",
		"MISCONF Redis is configured to save RDB snapshots, but it's currently unable to persist to disk.",
		"NOREPLICAS Not enough good replicas to write.",
		// A cluster client's redirections ran out, or a plain client
		// talks to a cluster node that does not own the slot.
		"MOVED 3999 127.0.0.1:7001", "ASK 3999 127.0.0.1:7001",
		// Authentication and ACLs.
		"NOAUTH Authentication required.",
		"WRONGPASS invalid username-password pair or user is disabled.",
		"NOPERM this user has no permissions to run the 'evalsha' command",
		"NOPERM No permissions to access a key",
		// Redis 6.2 wraps the refusal of a command inside a script.
		"ERR Error running script (call to f_0debf783): @user_script:18: @user_script: 18: -OOM command not allowed when used memory > 'maxmemory'.",
		"ERR Error running script (call to f_0debf783): @user_script:18: @user_script: 18: -MISCONF Errors writing to the AOF file: No space left on device",
		"ERR Error running script (call to f_0debf783): @user_script:18: @user_script: 18: -NOREPLICAS Not enough good replicas to write.",
		"ERR Error running script (call to f_0debf783): @user_script:18: @user_script: 18: -READONLY You can't write against a read only replica.",
		"ERR Protocol error: unauthenticated multibulk length",
	} {
		if err := translate("finish", redisError(t, msg)); !errors.Is(err, idem.ErrUnavailable) {
			t.Errorf("%q: %v, want ErrUnavailable", msg, err)
		}
	}
	// A script that failed on what it found: a key of the wrong type, a
	// Lua error on a damaged record.
	for _, msg := range []string{
		"WRONGTYPE Operation against a key holding the wrong kind of value",
		"ERR user_script:5: attempt to perform arithmetic on a nil value script: 0debf783, on @user_script:5.",
		"ERR Error running script (call to f_0debf783): @user_script:5: user_script:5: attempt to compare nil with number",
	} {
		if err := translate("finish", redisError(t, msg)); errors.Is(err, idem.ErrUnavailable) || err == nil {
			t.Errorf("%q: %v, want the error as it is, not ErrUnavailable", msg, err)
		}
	}
}

// TestTranslateServer: for the calls that are not about records (the
// notifier's, Durability's), a server that cannot be reached or cannot serve
// for now is unavailable, and any other reply (a command refused by an ACL)
// is Redis's answer.
func TestTranslateServer(t *testing.T) {
	if err := translateServer("durability", redisError(t, "LOADING Redis is loading the dataset in memory")); !errors.Is(err, idem.ErrUnavailable) {
		t.Errorf("LOADING: %v, want ErrUnavailable", err)
	}
	if err := translateServer("durability", fmt.Errorf("redis: %w", context.DeadlineExceeded)); !errors.Is(err, idem.ErrUnavailable) {
		t.Errorf("deadline: %v, want ErrUnavailable", err)
	}
	for _, msg := range []string{"NOPERM this user has no permissions to run the 'info' command", "ERR unknown command 'INFO'"} {
		if err := translateServer("durability", redisError(t, msg)); errors.Is(err, idem.ErrUnavailable) {
			t.Errorf("%q: %v, want not ErrUnavailable", msg, err)
		}
	}
}

// redisError returns an error as Redis answers it, by asking a script to
// fail with msg.
func redisError(t *testing.T, msg string) error {
	t.Helper()
	client := testClient(t)
	err := client.Eval(context.Background(), "return redis.error_reply(ARGV[1])", nil, msg).Err()
	var rerr redis.Error
	if !errors.As(err, &rerr) {
		t.Fatalf("Eval of an error reply gave %T %v", err, err)
	}
	return err
}

func TestPrune(t *testing.T) {
	client := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"}) // never contacted
	t.Cleanup(func() { client.Close() })
	s, err := New(Config{Client: client})
	if err != nil {
		t.Fatal(err)
	}
	if n, err := s.Prune(context.Background(), store.PruneParams{Now: t0}); n != 0 || err != nil {
		t.Fatalf("Prune = %d, %v; want 0, nil (Redis expires records itself)", n, err)
	}
	if _, err := s.Prune(context.Background(), store.PruneParams{}); !errors.Is(err, idem.ErrInvalid) {
		t.Fatalf("Prune without a time: %v, want ErrInvalid", err)
	}
}

// TestFaults runs the suite's network-fault cases, through a TCP proxy
// between the store and the server, on a client of one connection.
func TestFaults(t *testing.T) {
	target := testOptions(t).Addr
	storetest.RunFaults(t, target, func(t *testing.T, addr string) idem.Store {
		opt := testOptions(t)
		opt.Addr, opt.PoolSize = addr, 1
		client := redis.NewClient(opt)
		t.Cleanup(func() { client.Close() })
		return newTestStore(t, client, 0)
	})
}

// TestRefusedWritesAreUnavailable: a Redis that is up but refuses writes
// (out of memory under noeviction, too few replicas for
// min-replicas-to-write) is unavailable, not a failed write: the engine
// then keeps the outcome and tries again, where an error of another kind
// would drop it. The refused scripts wrote nothing, so the Finish that
// follows, once Redis takes writes again, settles the record.
func TestRefusedWritesAreUnavailable(t *testing.T) {
	t.Parallel()
	port := testkit.FreePort(t)
	testkit.StartRedis(t, port)
	client := redis.NewClient(&redis.Options{Addr: "127.0.0.1:" + port})
	t.Cleanup(func() { client.Close() })
	s := newTestStore(t, client, 0)
	ctx := context.Background()
	r := testkit.Acquire(t, s, "tenant", "refused", t0, time.Minute)
	finish := store.FinishParams{Scope: r.Scope, Key: r.Key, Token: r.Token, Now: t0.Add(time.Second),
		State: store.StateCompleted, Response: &store.Response{Status: 201, Body: []byte("charged")}, Expires: t0.Add(time.Hour)}
	for _, refusal := range []struct{ set, reset []any }{
		{[]any{"min-replicas-to-write", "1"}, []any{"min-replicas-to-write", "0"}},
		{[]any{"maxmemory-policy", "noeviction", "maxmemory", "1"}, []any{"maxmemory", "0"}},
	} {
		if err := client.Do(ctx, append([]any{"CONFIG", "SET"}, refusal.set...)...).Err(); err != nil {
			t.Fatal(err)
		}
		err := s.Finish(ctx, finish)
		if !errors.Is(err, idem.ErrUnavailable) || !errors.Is(err, idem.ErrRefused) {
			t.Errorf("Finish while Redis refuses writes (CONFIG SET %v): %v, want ErrUnavailable and ErrRefused", refusal.set, err)
		}
		if err := client.Do(ctx, append([]any{"CONFIG", "SET"}, refusal.reset...)...).Err(); err != nil {
			t.Fatal(err)
		}
		if got, err := s.Get(ctx, store.GetParams{Scope: r.Scope, Key: r.Key, Now: finish.Now}); err != nil || got.State != store.StateInProgress {
			t.Fatalf("after the refused Finish: %+v, %v; want the record still in progress", got, err)
		}
	}
	if err := s.Finish(ctx, finish); err != nil {
		t.Fatalf("Finish once Redis takes writes again: %v", err)
	}
	if got, err := s.Get(ctx, store.GetParams{Scope: r.Scope, Key: r.Key, Now: finish.Now}); err != nil ||
		got.State != store.StateCompleted || string(got.Response.Body) != "charged" {
		t.Fatalf("after the Finish: %+v, %v; want it completed with its response", got, err)
	}
}
