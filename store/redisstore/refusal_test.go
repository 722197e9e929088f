package redisstore

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/httpidem"
	"github.com/idemhq/idem/internal/faultnet"
	"github.com/idemhq/idem/internal/testkit"
	"github.com/idemhq/idem/store"
	"github.com/idemhq/idem/store/memstore"
	"github.com/redis/go-redis/v9"
)

// TestRefusedAccessIsUnavailable: a Redis that refuses a client (no
// credentials, a wrong password, an ACL user without the keys' permission)
// answers with an error, not with a verdict on the record: the store says
// unavailable, so the engine keeps the outcome and tries again, where an
// error of another kind would drop it. The refused scripts wrote nothing,
// and the error names neither the password nor the record.
func TestRefusedAccessIsUnavailable(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	port := redisWithUsers(t, true)
	client := func(user, password string) *redis.Client {
		c := redis.NewClient(&redis.Options{Addr: "127.0.0.1:" + port, Username: user, Password: password})
		t.Cleanup(func() { c.Close() })
		return c
	}
	prefix := randomPrefix(t)
	storeOf := func(c *redis.Client) *Store {
		s, err := New(Config{Client: c, Prefix: prefix})
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	admin := storeOf(client("admin", "admin-secret"))
	r := testkit.Acquire(t, admin, "tenant", "refused-access", t0, time.Minute)
	finish := store.FinishParams{Scope: r.Scope, Key: r.Key, Token: r.Token, Now: t0.Add(time.Second),
		State: store.StateCompleted, Response: &store.Response{Status: 201, Body: []byte("charged")}, Expires: t0.Add(time.Hour)}
	for _, c := range []struct {
		name, user, password, reply string
	}{
		// Redis cuts an unauthenticated client off at a command of more
		// than 10 arguments (an EVALSHA of Finish has 12).
		{"no credentials", "", "", "unauthenticated"},
		{"a wrong password", "keyless", "wrong-secret", "WRONGPASS"},
		{"a user without the keys", "keyless", "keyless-secret", "NOPERM"},
	} {
		err := storeOf(client(c.user, c.password)).Finish(ctx, finish)
		if !errors.Is(err, idem.ErrUnavailable) || !strings.Contains(err.Error(), c.reply) {
			t.Errorf("Finish with %s: %v, want ErrUnavailable from a %s reply", c.name, err, c.reply)
		}
		if err != nil {
			for _, secret := range []string{"secret", prefix, r.Scope, r.Key, "charged"} {
				if strings.Contains(err.Error(), secret) {
					t.Errorf("Finish with %s: the error %q contains %q", c.name, err, secret)
				}
			}
		}
		if got, err := admin.Get(ctx, store.GetParams{Scope: r.Scope, Key: r.Key, Now: finish.Now}); err != nil || got.State != store.StateInProgress {
			t.Fatalf("after the refused Finish with %s: %+v, %v; want the record still in progress", c.name, got, err)
		}
	}
	if _, err := storeOf(client("", "")).Get(ctx, store.GetParams{Scope: r.Scope, Key: r.Key, Now: finish.Now}); !errors.Is(err, idem.ErrUnavailable) || !strings.Contains(err.Error(), "NOAUTH") {
		t.Errorf("Get with no credentials: %v, want ErrUnavailable from a NOAUTH reply", err)
	}
	if err := admin.Finish(ctx, finish); err != nil {
		t.Fatalf("Finish with access: %v", err)
	}
}

// TestMovedIsUnavailable: a cluster node that does not own the record's slot
// answers MOVED, which a client that follows no more redirections (a plain
// client, or a cluster client whose redirections ran out during a
// resharding) returns as it is. Nothing was decided, so the store says
// unavailable and the engine keeps the outcome.
func TestMovedIsUnavailable(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cluster := testClusterClient(t)
	s := newTestStore(t, cluster, 1)
	r := testkit.Acquire(t, s, "tenant", "moved", t0, time.Minute)
	finish := store.FinishParams{Scope: r.Scope, Key: r.Key, Token: r.Token, Now: t0.Add(time.Second),
		State: store.StateCompleted, Response: &store.Response{Status: 201, Body: []byte("charged")}, Expires: t0.Add(time.Hour)}
	prefix, _, _ := strings.Cut(s.tags[0], "{")
	moved := 0
	for _, addr := range strings.Split(testkit.Server(t, "IDEM_TEST_REDIS_CLUSTER_ADDRS"), ",") {
		node := redis.NewClient(&redis.Options{Addr: addr})
		t.Cleanup(func() { node.Close() })
		on, err := New(Config{Client: node, Prefix: prefix, Shards: 1})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := on.Get(ctx, store.GetParams{Scope: r.Scope, Key: r.Key, Now: t0}); err == nil {
			continue // the node that owns the slot
		}
		moved++
		err = on.Finish(ctx, finish)
		if !errors.Is(err, idem.ErrUnavailable) || !strings.Contains(err.Error(), "MOVED") {
			t.Errorf("Finish on a node that does not own the slot: %v, want ErrUnavailable from a MOVED reply", err)
		}
	}
	if moved == 0 {
		t.Fatal("no node answered MOVED")
	}
	if got, err := s.Get(ctx, store.GetParams{Scope: r.Scope, Key: r.Key, Now: finish.Now}); err != nil || got.State != store.StateInProgress {
		t.Fatalf("after the refused Finishes: %+v, %v; want the record still in progress", got, err)
	}
	if err := s.Finish(ctx, finish); err != nil {
		t.Fatalf("Finish through the cluster: %v", err)
	}
}

// TestRefusedAccessIsNoReasonToFailOpen: a Redis that refuses the client
// (a password or an ACL rotated) was reached, and may hold the record: a
// middleware with fail_open answers 503 instead of running the request
// unprotected. (It ran a completed request again.)
func TestRefusedAccessIsNoReasonToFailOpen(t *testing.T) {
	t.Parallel()
	port := redisWithUsers(t, false)
	prefix := randomPrefix(t)
	serve := func(user, password string, runs *atomic.Int64) *httptest.Server {
		c := redis.NewClient(&redis.Options{Addr: "127.0.0.1:" + port, Username: user, Password: password})
		t.Cleanup(func() { c.Close() })
		s, err := New(Config{Client: c, Prefix: prefix})
		if err != nil {
			t.Fatal(err)
		}
		eng, err := idem.New(idem.Config{Store: s, StoreTimeout: 500 * time.Millisecond, CacheSize: -1})
		if err != nil {
			t.Fatal(err)
		}
		mw, err := httpidem.New(httpidem.Config{Engine: eng, FailOpen: true})
		if err != nil {
			t.Fatal(err)
		}
		srv := httptest.NewServer(mw.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			runs.Add(1)
			w.WriteHeader(http.StatusCreated)
		})))
		t.Cleanup(srv.Close)
		return srv
	}
	post := func(srv *httptest.Server) int {
		req, _ := http.NewRequest("POST", srv.URL+"/charges", strings.NewReader(`{"amount":1}`))
		req.Header.Set("Idempotency-Key", "charge-1")
		client := *srv.Client()
		client.Timeout = 10 * time.Second // a regression fails, it does not hang
		resp, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	var runs atomic.Int64
	if status := post(serve("admin", "admin-secret", &runs)); status != http.StatusCreated || runs.Load() != 1 {
		t.Fatalf("the first request: %d after %d runs", status, runs.Load())
	}
	for _, who := range [][2]string{{"keyless", "keyless-secret"}, {"keyless", "rotated-away"}} {
		if status := post(serve(who[0], who[1], &runs)); status != http.StatusServiceUnavailable || runs.Load() != 1 {
			t.Fatalf("its retry through a client Redis refuses (%s): %d after %d runs; want 503, run once", who[1], status, runs.Load())
		}
	}
}

// TestRefusedWritesAreNoReasonToFailOpen: a request whose owner crashed
// mid side effect (in progress, its lease run out) must become UNKNOWN and
// never run again. A Redis out of memory under noeviction (or short of
// replicas, or a replica) reads the record and refuses the write that
// marks it: a middleware with fail_open answers 503 instead of running the
// request unprotected. (It ran it again: a second charge.)
func TestRefusedWritesAreNoReasonToFailOpen(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	port := testkit.FreePort(t)
	testkit.StartRedis(t, port)
	client := redis.NewClient(&redis.Options{Addr: "127.0.0.1:" + port})
	t.Cleanup(func() { client.Close() })
	s := newTestStore(t, client, 0)
	var runs atomic.Int64
	charge := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		w.WriteHeader(http.StatusCreated)
	})
	post := func(st idem.Store, key string) int {
		eng, err := idem.New(idem.Config{Store: st, StoreTimeout: 500 * time.Millisecond, CacheSize: -1})
		if err != nil {
			t.Fatal(err)
		}
		mw, err := httpidem.New(httpidem.Config{Engine: eng, FailOpen: true})
		if err != nil {
			t.Fatal(err)
		}
		w := httptest.NewRecorder()
		r := httptest.NewRequest("POST", "/charges", strings.NewReader(`{"amount":1}`))
		r.Header.Set("Idempotency-Key", key)
		mw.Wrap(charge).ServeHTTP(w, r)
		return w.Code
	}
	// The record a crashed owner leaves: in progress, its lease run out,
	// with the request's fingerprint (as a store of the test's own takes it).
	probe := memstore.New()
	post(probe, "charge-1")
	rec, err := probe.Get(ctx, store.GetParams{Key: "charge-1", Now: time.Now()})
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	if _, err := s.Acquire(ctx, store.AcquireParams{Scope: rec.Scope, Key: rec.Key, Fingerprint: rec.Fingerprint, Token: "crashed",
		Now: now.Add(-2 * time.Minute), LeaseExpires: now.Add(-time.Minute)}); err != nil {
		t.Fatal(err)
	}
	runs.Store(0)
	for _, refusal := range []struct{ set, reset []any }{
		{[]any{"maxmemory-policy", "noeviction", "maxmemory", "1"}, []any{"maxmemory", "0"}},
		{[]any{"min-replicas-to-write", "1"}, []any{"min-replicas-to-write", "0"}},
	} {
		if err := client.Do(ctx, append([]any{"CONFIG", "SET"}, refusal.set...)...).Err(); err != nil {
			t.Fatal(err)
		}
		status := post(s, "charge-1")
		if err := client.Do(ctx, append([]any{"CONFIG", "SET"}, refusal.reset...)...).Err(); err != nil {
			t.Fatal(err)
		}
		if status != http.StatusServiceUnavailable || runs.Load() != 0 {
			t.Fatalf("a retry while Redis refuses writes (CONFIG SET %v): %d after %d runs; want 503, no run", refusal.set, status, runs.Load())
		}
	}
	if status := post(s, "charge-1"); status != http.StatusConflict || runs.Load() != 0 {
		t.Fatalf("the retry once Redis takes writes: %d after %d runs; want 409 (unknown), no run", status, runs.Load())
	}
}

// redisWithUsers starts a Redis of the test's own with two ACL users:
// admin (every key and command) and keyless (every command, no key of the
// store's), and, when noDefault, without the default user. It returns its
// port.
func redisWithUsers(t *testing.T, noDefault bool) string {
	t.Helper()
	boot, port, _ := ownRedis(t)
	acls := [][]any{
		{"ACL", "SETUSER", "admin", "on", ">admin-secret", "~*", "&*", "+@all"},
		{"ACL", "SETUSER", "keyless", "on", ">keyless-secret", "~elsewhere:*", "+@all"},
	}
	if noDefault {
		acls = append(acls, []any{"ACL", "SETUSER", "default", "off"})
	}
	for _, acl := range acls {
		if err := boot.Do(context.Background(), acl...).Err(); err != nil {
			t.Fatalf("%v: %v", acl[:3], err)
		}
	}
	return port
}

// TestCheckpointResentOnceStored: go-redis sends a script again by itself
// when its reply is lost (a connection cut after Redis ran it): the
// checkpoint the first run appended is not appended a second time (it was:
// one call, two recovery points).
func TestCheckpointResentOnceStored(t *testing.T) {
	opt := testOptions(t)
	proxy, err := faultnet.Listen(opt.Addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { proxy.Close() })
	client := redis.NewClient(&redis.Options{Addr: proxy.Addr(), DB: opt.DB, Username: opt.Username, Password: opt.Password})
	t.Cleanup(func() { client.Close() })
	ctx := context.Background()
	s := newTestStore(t, client, 0)
	r := testkit.Acquire(t, s, "tenant", "resent", t0, time.Minute)
	// The script is loaded, so that the call below is one EVALSHA.
	if err := s.Checkpoint(ctx, store.CheckpointParams{Scope: r.Scope, Key: r.Key, Token: r.Token, Now: t0, Name: "first"}); err != nil {
		t.Fatal(err)
	}
	proxy.DropNextReply()
	if err := s.Checkpoint(ctx, store.CheckpointParams{Scope: r.Scope, Key: r.Key, Token: r.Token, Now: t0.Add(time.Second), Name: "authorize", Data: []byte("dk")}); err != nil {
		t.Fatalf("Checkpoint whose first reply was lost: %v", err)
	}
	if proxy.Stats().RepliesDropped != 1 {
		t.Fatalf("%+v: no reply was dropped, so nothing was sent again", proxy.Stats())
	}
	got, err := s.Get(ctx, store.GetParams{Scope: r.Scope, Key: r.Key, Now: t0.Add(time.Second)})
	if err != nil {
		t.Fatal(err)
	}
	if len(got.Checkpoints) != 2 || got.Checkpoints[1].Name != "authorize" {
		t.Fatalf("checkpoints %+v; want first and authorize, once each", got.Checkpoints)
	}
}
