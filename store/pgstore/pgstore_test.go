package pgstore_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"reflect"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/faultnet"
	"github.com/idemhq/idem/internal/wait"
	"github.com/idemhq/idem/store"
	"github.com/idemhq/idem/store/memstore"
	"github.com/idemhq/idem/store/pgstore"
	"github.com/idemhq/idem/store/storetest"
)

var ctx = context.Background()

// t0 is a whole-millisecond time, like the suite's.
var t0 = time.Date(2030, 1, 2, 3, 4, 5, 6e6, time.UTC)

func fp(body string) idem.Fingerprint {
	return idem.NewFingerprint(idem.Payload{Method: "POST", Path: "/v1/charges", Body: []byte(body)})
}

func acquireParams(key, token string, now time.Time) store.AcquireParams {
	return store.AcquireParams{Scope: "s", Key: key, Fingerprint: fp("a"), Token: token, Now: now, LeaseExpires: now.Add(30 * time.Second)}
}

func completeParams(key, token string, now time.Time) idem.FinishParams {
	return idem.FinishParams{Scope: "s", Key: key, Token: token, Now: now, State: idem.StateCompleted,
		Response: &idem.Response{Status: 201, Body: []byte(`{"id":"ch_1"}`)}, Expires: now.Add(time.Hour)}
}

func mustAcquire(t *testing.T, s *pgstore.Store, p store.AcquireParams) idem.Record {
	t.Helper()
	r, err := s.Acquire(ctx, p)
	if err != nil {
		t.Fatalf("Acquire(%q): %v", p.Key, err)
	}
	if r.Token != p.Token {
		t.Fatalf("Acquire(%q) did not take the lease: %+v", p.Key, r)
	}
	return r
}

func countRows(t *testing.T, pool *pgxpool.Pool, sql string, args ...any) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(ctx, sql, args...).Scan(&n); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
	return n
}

func TestConformance(t *testing.T) {
	storetest.Run(t, func(t *testing.T) idem.Store {
		s, _ := newStore(t)
		return s
	})
}

// TestConformanceOnReleasedLayout runs the suite on a records table created
// by release 0.1.0's first migration, whose columns are in another order
// than a table created now (see migrations/001_records.sql): the upgraded
// store works on the tables it did not create.
func TestConformanceOnReleasedLayout(t *testing.T) {
	storetest.Run(t, func(t *testing.T) idem.Store {
		schema := releasedSchema(t)
		s, err := pgstore.New(ctx, pgstore.Config{Pool: sharedPool(t), Schema: schema})
		if err != nil {
			t.Fatalf("New: %v", err)
		}
		return s
	})
}

// releasedSchema returns a fresh schema as release 0.1.0 created it: its
// first migration applied and recorded; New applies the others.
func releasedSchema(t *testing.T) string {
	t.Helper()
	schema := newSchema(t)
	v1, err := os.ReadFile("testdata/v0.1.0/001_records.sql")
	if err != nil {
		t.Fatal(err)
	}
	quoted := pgx.Identifier{schema}.Sanitize()
	for _, sql := range []string{
		"CREATE SCHEMA " + quoted,
		"CREATE TABLE " + table(schema, "migrations") + " (version integer PRIMARY KEY, applied timestamptz NOT NULL)",
		strings.ReplaceAll(string(v1), "{{schema}}", quoted),
		"INSERT INTO " + table(schema, "migrations") + " (version, applied) VALUES (1, now())",
	} {
		if _, err := sharedPool(t).Exec(ctx, sql); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	return schema
}

// TestCompleteLogsWhatItWrites reads the WAL record of a complete (with
// pg_walinspect): a HOT update logs the new row's bytes between the prefix
// and the suffix it shares with the old one, so the columns a complete
// keeps (fingerprint, token, fence, lease, creation time) stay out of it
// only when they come before the columns it writes. The record's bytes
// beyond the stored response are compared with those of the same complete
// on a table of release 0.1.0's order, where state came third.
func TestCompleteLogsWhatItWrites(t *testing.T) {
	pool := sharedPool(t)
	if _, err := pool.Exec(ctx, "CREATE EXTENSION IF NOT EXISTS pg_walinspect"); err != nil {
		t.Fatalf("pg_walinspect (in PostgreSQL's contrib, a superuser to create it): %v", err)
	}
	var level string
	if err := pool.QueryRow(ctx, "SHOW wal_level").Scan(&level); err != nil {
		t.Fatal(err)
	}
	if level == "logical" {
		// PostgreSQL logs the whole new row of every update for logical
		// decoding: the column order saves nothing there.
		t.Skip("wal_level is logical: updates are logged whole, whatever the column order")
	}
	scope := strings.Repeat("5e", 32) // as long as httpidem.HashScope's
	response := &idem.Response{Status: 201, Header: http.Header{"Content-Type": {"application/json"}},
		Body: []byte(`{"id":"ch_3MmlLrLkdIwHu7ix0snN0B15","object":"charge","amount":1099,"currency":"usd","status":"succeeded"}`)}
	// overhead is the length of the WAL record of one complete on a
	// schema's records table, less the stored response's.
	overhead := func(schema string) int {
		t.Helper()
		s, err := pgstore.New(ctx, pgstore.Config{Pool: pool, Schema: schema})
		if err != nil {
			t.Fatalf("New: %v", err)
		}
		const token = "3f1b8d6e-2c4a-4e7b-9a0d-5b6c7d8e9f01"
		// A checkpoint between the acquire and the complete makes the
		// complete log its whole page instead (a full-page image): such a
		// record is measured again, on another key.
		for i := range 3 {
			key := fmt.Sprint("k", i)
			p := acquireParams(key, token, t0)
			p.Scope = scope
			mustAcquire(t, s, p)
			var start, end, node string
			if err := pool.QueryRow(ctx, "SELECT pg_current_wal_insert_lsn()::text, pg_relation_filenode($1::regclass)::text",
				table(schema, "records")).Scan(&start, &node); err != nil {
				t.Fatal(err)
			}
			f := completeParams(key, token, t0)
			f.Scope, f.Response = scope, response
			if err := s.Finish(ctx, f); err != nil {
				t.Fatal(err)
			}
			if err := pool.QueryRow(ctx, "SELECT pg_current_wal_insert_lsn()::text").Scan(&end); err != nil {
				t.Fatal(err)
			}
			// The records of other tests' writes are in the range too: only
			// those on this table count.
			rows, err := pool.Query(ctx, `SELECT record_type, record_length, fpi_length FROM pg_get_wal_records_info($1::pg_lsn, $2::pg_lsn)
				WHERE resource_manager = 'Heap' AND block_ref LIKE '%/' || $3 || ' %'`, start, end, node)
			if err != nil {
				t.Fatal(err)
			}
			var kinds []string
			n, fpi := 0, 0
			for rows.Next() {
				var kind string
				var length, image int
				if err := rows.Scan(&kind, &length, &image); err != nil {
					t.Fatal(err)
				}
				kinds, n, fpi = append(kinds, kind), length, fpi+image
			}
			if err := rows.Err(); err != nil {
				t.Fatal(err)
			}
			if len(kinds) != 1 || kinds[0] != "HOT_UPDATE" {
				t.Fatalf("the complete wrote %v to records, want one HOT_UPDATE", kinds)
			}
			if fpi == 0 {
				var stored int
				if err := pool.QueryRow(ctx, "SELECT octet_length(response) FROM "+table(schema, "records")+" WHERE key = $1", key).Scan(&stored); err != nil {
					t.Fatal(err)
				}
				return n - stored
			}
		}
		t.Fatal("three completes in a row logged their page whole: checkpoints come too often to measure")
		return 0
	}
	now, released := overhead(newSchema(t)), overhead(releasedSchema(t))
	t.Logf("a complete's WAL record beyond its stored response: %d B (release 0.1.0's order: %d B)", now, released)
	// Besides the record's headers (about 70 B), a complete logs its state,
	// the update and expiry times and the response's length (about 40 B
	// with their alignment); the fingerprint alone is 129 B (178 as text).
	if now > 128 {
		t.Errorf("a complete logs %d B beyond its response, want at most 128: columns it keeps are in its WAL", now)
	}
}

// TestConformanceInstances runs the two-instance cases on two stores in one
// schema, each with a pool of its own, as two processes would have.
func TestConformanceInstances(t *testing.T) {
	storetest.RunInstances(t, func(t *testing.T) (idem.Store, idem.Store) {
		schema := newSchema(t)
		instance := func() idem.Store {
			pool, err := pgxpool.New(ctx, databaseURL(t))
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(pool.Close)
			s, err := pgstore.New(ctx, pgstore.Config{Pool: pool, Schema: schema})
			if err != nil {
				t.Fatalf("New: %v", err)
			}
			return s
		}
		return instance(), instance()
	})
}

func TestPruneDeletesRows(t *testing.T) {
	t.Parallel()
	s, schema := newStore(t)
	pool := sharedPool(t)
	countAll := "SELECT count(*) FROM " + table(schema, "records")

	// Seven settled records that expire at t0+1h, one that lives longer, one
	// running and one unknown.
	for i := range 7 {
		key := fmt.Sprintf("old-%d", i)
		mustAcquire(t, s, acquireParams(key, "tok", t0))
		p := completeParams(key, "tok", t0)
		if i%2 == 1 {
			p.State, p.Response = idem.StateFailed, nil
		}
		if err := s.Finish(ctx, p); err != nil {
			t.Fatal(err)
		}
	}
	mustAcquire(t, s, acquireParams("live", "tok", t0))
	live := completeParams("live", "tok", t0)
	live.Expires = t0.Add(2 * time.Hour)
	if err := s.Finish(ctx, live); err != nil {
		t.Fatal(err)
	}
	mustAcquire(t, s, acquireParams("running", "tok", t0))
	mustAcquire(t, s, acquireParams("unknown", "tok", t0))
	if err := s.Finish(ctx, idem.FinishParams{Scope: "s", Key: "unknown", Token: "tok", Now: t0, State: idem.StateUnknown}); err != nil {
		t.Fatal(err)
	}
	if n := countRows(t, pool, countAll); n != 10 {
		t.Fatalf("%d rows before pruning, want 10", n)
	}

	// Just before expiry nothing goes.
	if n, err := s.Prune(ctx, store.PruneParams{Now: t0.Add(time.Hour - time.Microsecond), Limit: 3}); err != nil || n != 0 {
		t.Fatalf("Prune before expiry = %d, %v; want 0", n, err)
	}
	// At expiry, batches of at most 3: 3, 3, 1, 0.
	now := t0.Add(time.Hour)
	for i, want := range []int{3, 3, 1, 0} {
		n, err := s.Prune(ctx, store.PruneParams{Now: now, Limit: 3})
		if err != nil || n != want {
			t.Fatalf("Prune batch %d = %d, %v; want %d", i, n, err, want)
		}
		if rows := countRows(t, pool, countAll); rows != 10-min(3*(i+1), 7) {
			t.Fatalf("after batch %d: %d rows left, want %d", i, rows, 10-min(3*(i+1), 7))
		}
	}
	if n := countRows(t, pool, countAll+" WHERE key LIKE 'old-%'"); n != 0 {
		t.Fatalf("%d expired rows survived pruning", n)
	}
	for _, key := range []string{"live", "running", "unknown"} {
		if _, err := s.Get(ctx, store.GetParams{Scope: "s", Key: key, Now: now}); err != nil {
			t.Fatalf("Get(%q) after prune: %v", key, err)
		}
	}
}

// TestPruneRacesAcquire: records that expired are pruned while retries
// re-create them; a re-created record is never deleted.
func TestPruneRacesAcquire(t *testing.T) {
	t.Parallel()
	s, _ := newStore(t)
	const n = 200
	for i := range n {
		key := fmt.Sprintf("k-%03d", i)
		mustAcquire(t, s, acquireParams(key, "old", t0))
		if err := s.Finish(ctx, completeParams(key, "old", t0)); err != nil {
			t.Fatal(err)
		}
	}
	now := t0.Add(time.Hour) // every record has just expired
	var wg sync.WaitGroup
	errs := make(chan error, n+1)
	wg.Go(func() {
		for {
			k, err := s.Prune(ctx, store.PruneParams{Now: now, Limit: 1})
			if err != nil {
				errs <- err
				return
			}
			if k == 0 {
				return
			}
		}
	})
	for i := range n {
		wg.Go(func() {
			key := fmt.Sprintf("k-%03d", i)
			r, err := s.Acquire(ctx, acquireParams(key, "new", now))
			if err == nil && (r.Token != "new" || r.Fence != 1) {
				err = fmt.Errorf("%s: Acquire over an expired record = %+v", key, r)
			}
			if err != nil {
				errs <- err
			}
		})
	}
	wait.Done(t, 2*time.Minute, "the concurrent goroutines to finish", wg.Wait)
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if k, err := s.Prune(ctx, store.PruneParams{Now: now}); err != nil || k != 0 {
		t.Fatalf("final Prune = %d, %v; want nothing left to prune", k, err)
	}
	for i := range n {
		key := fmt.Sprintf("k-%03d", i)
		if r, err := s.Get(ctx, store.GetParams{Scope: "s", Key: key, Now: now}); err != nil || r.Token != "new" || r.State != idem.StateInProgress {
			t.Fatalf("%s after the race: %+v, %v; want the re-created record", key, r, err)
		}
	}
}

// ledger creates a business table in schema for the transactional tests.
func ledger(t *testing.T, schema string) string {
	t.Helper()
	name := table(schema, "ledger")
	if _, err := sharedPool(t).Exec(ctx, "CREATE TABLE "+name+" (id text PRIMARY KEY, amount bigint NOT NULL)"); err != nil {
		t.Fatal(err)
	}
	return name
}

func TestFinishTxCommitsTogether(t *testing.T) {
	t.Parallel()
	s, schema := newStore(t)
	pool := sharedPool(t)
	ledger := ledger(t, schema)
	mustAcquire(t, s, acquireParams("k", "tok", t0))

	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := tx.Exec(ctx, "INSERT INTO "+ledger+" VALUES ('ch_1', 500)"); err != nil {
		t.Fatal(err)
	}
	if err := s.FinishTx(ctx, tx, completeParams("k", "tok", t0)); err != nil {
		t.Fatalf("FinishTx: %v", err)
	}
	// Until the commit, others see neither the record's outcome nor the debit.
	if r, err := s.Get(ctx, store.GetParams{Scope: "s", Key: "k", Now: t0}); err != nil || r.State != idem.StateInProgress {
		t.Fatalf("before commit: Get = %v, %v; want in progress", r.State, err)
	}
	if n := countRows(t, pool, "SELECT count(*) FROM "+ledger); n != 0 {
		t.Fatalf("before commit: %d ledger rows visible", n)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	r, err := s.Acquire(ctx, acquireParams("k", "other", t0.Add(time.Second)))
	if err != nil || r.State != idem.StateCompleted || string(r.Response.Body) != `{"id":"ch_1"}` {
		t.Fatalf("after commit: Acquire = %+v, %v; want the completed record", r, err)
	}
	if n := countRows(t, pool, "SELECT count(*) FROM "+ledger+" WHERE id = 'ch_1' AND amount = 500"); n != 1 {
		t.Fatalf("after commit: %d ledger rows, want 1", n)
	}
}

func TestFinishTxRollbackLeavesInProgress(t *testing.T) {
	t.Parallel()
	s, schema := newStore(t)
	pool := sharedPool(t)
	ledger := ledger(t, schema)
	mustAcquire(t, s, acquireParams("k", "tok", t0))

	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, "INSERT INTO "+ledger+" VALUES ('ch_1', 500)"); err != nil {
		t.Fatal(err)
	}
	if err := s.FinishTx(ctx, tx, completeParams("k", "tok", t0)); err != nil {
		t.Fatalf("FinishTx: %v", err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	r, err := s.Get(ctx, store.GetParams{Scope: "s", Key: "k", Now: t0})
	if err != nil || r.State != idem.StateInProgress || r.Token != "tok" || r.Response != nil || !r.Expires.IsZero() {
		t.Fatalf("after rollback: Get = %+v, %v; want the record in progress under the same lease", r, err)
	}
	if n := countRows(t, pool, "SELECT count(*) FROM "+ledger); n != 0 {
		t.Fatalf("after rollback: %d ledger rows, want none", n)
	}
	// The lease still owns the record, so a later Finish works.
	if err := s.Finish(ctx, completeParams("k", "tok", t0)); err != nil {
		t.Fatalf("Finish after the rolled-back FinishTx: %v", err)
	}
}

func TestFinishTxStaleToken(t *testing.T) {
	t.Parallel()
	s, _ := newStore(t)
	pool := sharedPool(t)
	p := acquireParams("k", "old", t0)
	p.TakeoverSafe = true
	mustAcquire(t, s, p)
	// The lease runs out and a retry takes over.
	p.Token, p.Now, p.LeaseExpires = "new", t0.Add(31*time.Second), t0.Add(61*time.Second)
	if r := mustAcquire(t, s, p); r.Fence != 2 {
		t.Fatalf("takeover fence = %d, want 2", r.Fence)
	}

	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	err = s.FinishTx(ctx, tx, completeParams("k", "old", p.Now))
	if !errors.Is(err, idem.ErrLeaseLost) {
		t.Fatalf("FinishTx with the stale token = %v, want ErrLeaseLost", err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if r, err := s.Get(ctx, store.GetParams{Scope: "s", Key: "k", Now: p.Now}); err != nil || r.Token != "new" || r.State != idem.StateInProgress {
		t.Fatalf("record after the stale FinishTx = %+v, %v", r, err)
	}
	err = s.FinishTx(ctx, nil, completeParams("k", "new", p.Now))
	if !errors.Is(err, idem.ErrInvalid) {
		t.Fatalf("FinishTx with a nil tx = %v, want ErrInvalid", err)
	}
}

// closedPortPool returns a pool to a port on 127.0.0.1 that nothing listens
// on. It connects lazily, so making it succeeds.
func closedPortPool(t *testing.T) *pgxpool.Pool {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	cfg, err := pgxpool.ParseConfig("postgres://postgres@" + addr + "/test?sslmode=disable&connect_timeout=2")
	if err != nil {
		t.Fatal(err)
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// TestUnreachableServer needs no server: it runs without the variable.
func TestUnreachableServer(t *testing.T) {
	t.Parallel()
	pool := closedPortPool(t)
	if _, err := pgstore.New(ctx, pgstore.Config{Pool: pool}); !errors.Is(err, idem.ErrUnavailable) {
		t.Fatalf("New (migrating) on an unreachable server = %v, want ErrUnavailable", err)
	}
	if _, err := pgstore.New(ctx, pgstore.Config{Pool: pool, NoMigrate: true}); err != nil {
		t.Fatalf("New without migrating does no I/O, yet: %v", err)
	}
	// What every call does on an unreachable server is the suite's
	// (RunFaults).
}

// TestDeadlineIsUnavailable: a statement that does not answer before the
// context's deadline (here, one waiting on a row lock held by another
// transaction) is reported as ErrUnavailable, and the deadline stays visible.
func TestDeadlineIsUnavailable(t *testing.T) {
	t.Parallel()
	s, schema := newStore(t)
	pool := sharedPool(t)
	mustAcquire(t, s, acquireParams("k", "tok", t0))
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := tx.Exec(ctx, "SELECT 1 FROM "+table(schema, "records")+" WHERE key = 'k' FOR UPDATE"); err != nil {
		t.Fatal(err)
	}
	short, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	defer cancel()
	err = s.Finish(short, completeParams("k", "tok", t0))
	if !errors.Is(err, idem.ErrUnavailable) || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Finish blocked past its deadline = %v, want ErrUnavailable wrapping context.DeadlineExceeded", err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	// The outcome is unknown, as ErrUnavailable says: the abandoned statement
	// may still run on the server once the lock is free. Retrying with the
	// same token settles it either way: the retry completes the record, or it
	// finds the record already completed by the first attempt.
	if err := s.Finish(ctx, completeParams("k", "tok", t0)); err != nil && !errors.Is(err, idem.ErrLeaseLost) {
		t.Fatalf("retried Finish: %v", err)
	}
	if r, err := s.Get(ctx, store.GetParams{Scope: "s", Key: "k", Now: t0}); err != nil || r.State != idem.StateCompleted || r.Token != "tok" {
		t.Fatalf("record after the retried Finish = %+v, %v; want completed", r, err)
	}
}

// TestRolledBackIsUnavailable: a statement that PostgreSQL rolls back for
// a reason of the moment (here a real deadlock with another transaction:
// the Finish's trigger waits on a records_due row that the other holds,
// which then waits on the record) wrote nothing and may succeed when tried
// again: it is ErrUnavailable, so that the engine keeps the outcome and
// retries it, where an error of another kind would drop it.
func TestRolledBackIsUnavailable(t *testing.T) {
	t.Parallel()
	s, schema := newStore(t)
	mustAcquire(t, s, acquireParams("k", "tok", t0))
	conn, err := sharedPool(t).Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	// This session never looks for the deadlock first: the store's does,
	// and is the one rolled back.
	if _, err := conn.Exec(ctx, "SET deadlock_timeout = '1min'"); err != nil {
		t.Fatal(err)
	}
	defer conn.Exec(ctx, "RESET deadlock_timeout")
	pid := conn.Conn().PgConn().PID()
	tx, err := conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := tx.Exec(ctx, "UPDATE "+table(schema, "records_due")+" SET expires = expires WHERE key = 'k'"); err != nil {
		t.Fatal(err)
	}
	bounded, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	finished := make(chan error, 1)
	go func() { finished <- s.Finish(bounded, completeParams("k", "tok", t0)) }()
	wait.Until(t, 10*time.Second, "the Finish to wait on the other transaction", func() bool {
		return countRows(t, sharedPool(t), "SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))", int32(pid)) == 1
	})
	if _, err := tx.Exec(ctx, "SELECT FROM "+table(schema, "records")+" WHERE key = 'k' FOR UPDATE"); err != nil {
		t.Fatalf("the other transaction, once the store's is rolled back: %v", err)
	}
	err = wait.Recv(t, finished, 40*time.Second, "the Finish that waited")
	if !errors.Is(err, idem.ErrUnavailable) || !errors.Is(err, idem.ErrRefused) || !strings.Contains(err.Error(), "40P01") {
		t.Fatalf("Finish rolled back by a deadlock = %v, want ErrUnavailable and ErrRefused (SQLSTATE 40P01)", err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if r, err := s.Get(ctx, store.GetParams{Scope: "s", Key: "k", Now: t0}); err != nil || r.State != idem.StateInProgress {
		t.Fatalf("record after the rolled-back Finish = %+v, %v; want it still in progress", r, err)
	}
	if err := s.Finish(ctx, completeParams("k", "tok", t0)); err != nil {
		t.Fatalf("Finish tried again: %v", err)
	}
}

func TestConcurrentNewMigratesOnce(t *testing.T) {
	t.Parallel()
	schema := newSchema(t)
	pool := sharedPool(t)
	const n = 10
	errs := make([]error, n)
	stores := make([]*pgstore.Store, n)
	start := make(chan struct{})
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			<-start
			stores[i], errs[i] = pgstore.New(ctx, pgstore.Config{Pool: pool, Schema: schema})
		})
	}
	close(start)
	wait.Done(t, 2*time.Minute, "the concurrent goroutines to finish", wg.Wait)
	for i, err := range errs {
		if err != nil {
			t.Fatalf("New #%d: %v", i, err)
		}
	}
	files, err := filepath.Glob("migrations/*.sql")
	if err != nil || len(files) < 3 {
		t.Fatalf("migrations/*.sql = %v, %v", files, err)
	}
	for version := 1; version <= len(files); version++ {
		if v := countRows(t, pool, "SELECT count(*) FROM "+table(schema, "migrations")+" WHERE version = $1", version); v != 1 {
			t.Fatalf("migration %d recorded %d times, want once", version, v)
		}
	}
	if v := countRows(t, pool, "SELECT count(*) FROM "+table(schema, "migrations")); v != len(files) {
		t.Fatalf("%d migrations recorded, want %d", v, len(files))
	}
	// Migrating again changes nothing, and every store works on the one table.
	if err := stores[0].Migrate(ctx); err != nil {
		t.Fatalf("Migrate again: %v", err)
	}
	mustAcquire(t, stores[3], acquireParams("k", "tok", t0))
	if r, err := stores[7].Get(ctx, store.GetParams{Scope: "s", Key: "k", Now: t0}); err != nil || r.Token != "tok" {
		t.Fatalf("Get through another store = %+v, %v", r, err)
	}
}

// TestCheckpointsKeptAndDropped follows a record's checkpoints through the
// acquire statement: the UNKNOWN transition and settling keep them, and so
// does the record Acquire returns; a re-creation over an expired record drops
// them.
func TestCheckpointsKeptAndDropped(t *testing.T) {
	t.Parallel()
	s, schema := newStore(t)
	names := func(r idem.Record) string {
		var n []string
		for _, c := range r.Checkpoints {
			n = append(n, c.Name)
		}
		return strings.Join(n, " ")
	}
	r := mustAcquire(t, s, acquireParams("k", "tok", t0))
	binary := []byte{0, '\n', 0xff, '"'}
	for i, name := range []string{"authorize", "capture"} {
		if err := s.Checkpoint(ctx, store.CheckpointParams{Scope: "s", Key: "k", Token: r.Token,
			Now: t0.Add(time.Duration(i+1) * time.Second), Name: name, Data: binary}); err != nil {
			t.Fatalf("Checkpoint %s: %v", name, err)
		}
	}
	stored, err := s.Get(ctx, store.GetParams{Scope: "s", Key: "k", Now: t0})
	if err != nil || names(stored) != "authorize capture" || !stored.Updated.Equal(t0.Add(2*time.Second)) ||
		!stored.Checkpoints[1].At.Equal(t0.Add(2*time.Second)) || string(stored.Checkpoints[1].Data) != string(binary) {
		t.Fatalf("stored after two checkpoints = %+v, %v", stored, err)
	}

	unknown, err := s.Acquire(ctx, acquireParams("k", "other", t0.Add(30*time.Second)))
	if err != nil || unknown.State != idem.StateUnknown || names(unknown) != "authorize capture" {
		t.Fatalf("Acquire after expiry = %+v, %v; want unknown with both checkpoints", unknown, err)
	}
	if stored, err := s.Get(ctx, store.GetParams{Scope: "s", Key: "k", Now: t0}); err != nil || !reflect.DeepEqual(stored, unknown) {
		t.Fatalf("stored unknown record = %+v, %v; Acquire returned %+v", stored, err, unknown)
	}
	if err := s.Finish(ctx, completeParams("k", "tok", t0.Add(time.Minute))); err != nil {
		t.Fatal(err)
	}
	replay, err := s.Acquire(ctx, acquireParams("k", "other", t0.Add(time.Minute)))
	if err != nil || replay.State != idem.StateCompleted || names(replay) != "authorize capture" {
		t.Fatalf("replay = %+v, %v; want completed with both checkpoints", replay, err)
	}

	again := mustAcquire(t, s, acquireParams("k", "again", t0.Add(2*time.Hour)))
	if again.Checkpoints != nil {
		t.Fatalf("re-created record has checkpoints %+v", again.Checkpoints)
	}
	if n := countRows(t, sharedPool(t), "SELECT count(*) FROM "+table(schema, "records")+" WHERE checkpoints IS NULL"); n != 1 {
		t.Fatalf("re-created row: %d rows with NULL checkpoints, want 1", n)
	}
}

// TestMigrateUpgradesVersion1 applies migration 2 to a schema that has only
// migration 1, as a store of an earlier release left it, with a record in it.
func TestMigrateUpgradesVersion1(t *testing.T) {
	t.Parallel()
	schema := releasedSchema(t)
	pool := sharedPool(t)
	if _, err := pool.Exec(ctx, `INSERT INTO `+table(schema, "records")+` (scope, key, state, fingerprint, token, fence, lease_expires, takeover_safe, created, updated)
		VALUES ('s', 'k', 'in_progress', $1, 'tok', 1, $2, true, $3, $3)`, string(fp("a")), t0.Add(30*time.Second), t0); err != nil {
		t.Fatal(err)
	}
	hasColumn := func() bool {
		t.Helper()
		return countRows(t, pool, `SELECT count(*) FROM information_schema.columns
			WHERE table_schema = $1 AND table_name = 'records' AND column_name = 'checkpoints' AND data_type = 'bytea'`, schema) == 1
	}
	if hasColumn() {
		t.Fatal("the version 1 schema already has the checkpoints column")
	}

	s, err := pgstore.New(ctx, pgstore.Config{Pool: pool, Schema: schema}) // migrates
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	if !hasColumn() {
		t.Fatal("Migrate did not add the checkpoints column")
	}
	if v := countRows(t, pool, "SELECT count(*) FROM "+table(schema, "migrations")+" WHERE version = 2"); v != 1 {
		t.Fatalf("migration 2 recorded %d times, want once", v)
	}
	if err := s.Migrate(ctx); err != nil {
		t.Fatalf("Migrate again: %v", err)
	}

	// The record written before the upgrade reads with no checkpoints and
	// takes one.
	r, err := s.Get(ctx, store.GetParams{Scope: "s", Key: "k", Now: t0})
	if err != nil || r.Token != "tok" || r.Checkpoints != nil {
		t.Fatalf("Get of the old record = %+v, %v", r, err)
	}
	if err := s.Checkpoint(ctx, store.CheckpointParams{Scope: "s", Key: "k", Token: "tok", Now: t0.Add(time.Second), Name: "authorize"}); err != nil {
		t.Fatalf("Checkpoint of the old record: %v", err)
	}
	r, err = s.Get(ctx, store.GetParams{Scope: "s", Key: "k", Now: t0})
	if err != nil || len(r.Checkpoints) != 1 || r.Checkpoints[0].Name != "authorize" || r.TakeoverSafe {
		t.Fatalf("Get after Checkpoint = %+v, %v", r, err)
	}
	// Once its lease has run out, the reconciler's scan finds it, although
	// it was written before records_due existed.
	res, err := s.Scan(ctx, store.ScanParams{Now: t0.Add(time.Hour)})
	if err != nil || len(res.Records) != 1 || res.Records[0].Key != "k" {
		t.Fatalf("Scan after the upgrade = %+v, %v; want the old record", res, err)
	}
}

// TestRoundTrips counts the statements and round trips of each operation.
func TestRoundTrips(t *testing.T) {
	t.Parallel()
	s, _, _, counter := countedStore(t, 1)
	cost := func(what string, statements, trips int64, op func() error) {
		t.Helper()
		n, rt := counter.n.Load(), counter.trips.Load()
		if err := op(); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		if n, rt = counter.n.Load()-n, counter.trips.Load()-rt; n != statements || rt != trips {
			t.Fatalf("%s took %d statements in %d round trips, want %d in %d", what, n, rt, statements, trips)
		}
	}
	// A store that New did not migrate reads the records table's layout
	// before its first write, once.
	cost("the first Acquire of a store New did not migrate", 2, 2, func() error {
		_, err := s.Acquire(ctx, acquireParams("first", "tok", t0))
		return err
	})
	cost("Acquire of a new key", 1, 1, func() error { _, err := s.Acquire(ctx, acquireParams("k", "tok", t0)); return err })
	renew := store.RenewParams{Scope: "s", Key: "k", Token: "tok", Now: t0.Add(time.Second), LeaseExpires: t0.Add(time.Minute)}
	cost("Renew", 1, 1, func() error { return s.Renew(ctx, renew) })
	checkpoint := store.CheckpointParams{Scope: "s", Key: "k", Token: "tok", Now: t0.Add(time.Second), Name: "authorize", Data: []byte("x")}
	cost("Checkpoint", 1, 1, func() error { return s.Checkpoint(ctx, checkpoint) })
	checkpoint.Now = t0.Add(1500 * time.Millisecond)
	cost("second Checkpoint", 1, 1, func() error { return s.Checkpoint(ctx, checkpoint) })
	cost("Finish", 1, 1, func() error { return s.Finish(ctx, completeParams("k", "tok", t0.Add(2*time.Second))) })
	cost("Acquire that replays", 1, 1, func() error {
		r, err := s.Acquire(ctx, acquireParams("k", "other", t0.Add(3*time.Second)))
		if err == nil && r.State != idem.StateCompleted {
			err = fmt.Errorf("state %v, want completed", r.State)
		}
		return err
	})
	cost("Get", 1, 1, func() error { _, err := s.Get(ctx, store.GetParams{Scope: "s", Key: "k", Now: t0}); return err })
	// The first scan of a new schema finds records_due not yet filled
	// (TestRecordsDueRebuilt): the check and the scan, then the lock, the
	// check again, the rebuild's one part (the table is small), the mark,
	// the unlock, and the scan again. From then on a scan or a prune is the
	// check and the statement, in one round trip.
	cost("first Scan", 8, 7, func() error { _, err := s.Scan(ctx, store.ScanParams{Now: t0}); return err })
	cost("Scan", 2, 1, func() error { _, err := s.Scan(ctx, store.ScanParams{Now: t0}); return err })
	cost("Prune", 2, 1, func() error { _, err := s.Prune(ctx, store.PruneParams{Now: t0}); return err })
	cost("List", 1, 1, func() error { _, err := s.List(ctx, store.ListParams{Now: t0}); return err })
}

// TestReplayWritesNothing: an acquire that returns the row as it is (a replay,
// a running lease, an UNKNOWN record, a refused takeover) neither writes a new
// row version nor even locks the row.
func TestReplayWritesNothing(t *testing.T) {
	t.Parallel()
	s, schema := newStore(t)
	pool := sharedPool(t)
	version := func(key string) string {
		t.Helper()
		var v string
		// A new row version changes ctid and xmin; a lock, even one that
		// does not update, sets xmax to the locker's transaction.
		if err := pool.QueryRow(ctx, "SELECT ctid::text || ' ' || xmin::text || ' ' || xmax::text FROM "+
			table(schema, "records")+" WHERE key = $1", key).Scan(&v); err != nil {
			t.Fatal(err)
		}
		return v
	}
	same := func(what, key string, p store.AcquireParams, want idem.State) {
		t.Helper()
		before := version(key)
		r, err := s.Acquire(ctx, p)
		if err != nil || r.State != want || r.Token == p.Token {
			t.Fatalf("%s: Acquire = %+v, %v; want the %v record as it was", what, r, err, want)
		}
		if after := version(key); after != before {
			t.Fatalf("%s wrote the row: (ctid xmin xmax) %s -> %s", what, before, after)
		}
	}

	mustAcquire(t, s, acquireParams("done", "tok", t0))
	if err := s.Finish(ctx, completeParams("done", "tok", t0)); err != nil {
		t.Fatal(err)
	}
	same("a replay", "done", acquireParams("done", "x", t0.Add(time.Second)), idem.StateCompleted)
	other := acquireParams("done", "x", t0.Add(time.Second))
	other.Fingerprint = fp("b")
	same("a mismatch", "done", other, idem.StateCompleted)

	mustAcquire(t, s, acquireParams("running", "tok", t0))
	same("an acquire during the lease", "running", acquireParams("running", "x", t0.Add(time.Second)), idem.StateInProgress)

	// The first acquire after expiry writes UNKNOWN; the next ones only read.
	mustAcquire(t, s, acquireParams("lost", "tok", t0))
	if r, err := s.Acquire(ctx, acquireParams("lost", "x", t0.Add(time.Minute))); err != nil || r.State != idem.StateUnknown {
		t.Fatalf("Acquire after expiry = %+v, %v; want unknown", r, err)
	}
	same("an acquire of an unknown record", "lost", acquireParams("lost", "y", t0.Add(2*time.Minute)), idem.StateUnknown)

	safe := acquireParams("safe", "tok", t0)
	safe.TakeoverSafe = true
	mustAcquire(t, s, safe)
	refused := acquireParams("safe", "x", t0.Add(time.Minute))
	refused.Fingerprint, refused.TakeoverSafe = fp("b"), true
	same("a takeover refused for another payload", "safe", refused, idem.StateInProgress)
}

// TestAcquireRetriesAfterConcurrentCommit forces the race Acquire re-runs its
// statement for: another transaction writes the row after the statement's
// snapshot, so ON CONFLICT finds nothing to write while the snapshot shows no
// usable row. Acquire must return the committed row, not nothing and not the
// row as the snapshot saw it.
func TestAcquireRetriesAfterConcurrentCommit(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		before func(t *testing.T, s *pgstore.Store) // the row before the race
		write  string                               // the concurrent transaction's statement
	}{
		{
			name: "inserted",
			before: func(t *testing.T, s *pgstore.Store) {
				mustAcquire(t, s, acquireParams("another", "tok", t0)) // the store's first write reads the table's layout
			},
			write: `INSERT INTO %s (scope, key, state, fingerprint, token, fence, lease_expires, takeover_safe, created, updated)
				VALUES ('s', 'k', 'in_progress', $1, 'winner', 1, $2, false, $3, $3)`,
		},
		{
			name: "taken over",
			before: func(t *testing.T, s *pgstore.Store) {
				p := acquireParams("k", "first", t0.Add(-time.Minute))
				p.TakeoverSafe = true
				mustAcquire(t, s, p)
			},
			write: `UPDATE %s SET token = 'winner', fence = fence + 1, lease_expires = $2, updated = $3
				WHERE key = 'k' AND fingerprint = $1`,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			s, schema, pool, counter := countedStore(t, 1)
			tc.before(t, s)
			var pid int32
			if err := pool.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid); err != nil {
				t.Fatal(err)
			}

			tx, err := sharedPool(t).Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = tx.Rollback(ctx) }()
			if _, err := tx.Exec(ctx, fmt.Sprintf(tc.write, table(schema, "records")), fp("a").Compact(), t0.Add(30*time.Second), t0); err != nil {
				t.Fatal(err)
			}

			p := acquireParams("k", "loser", t0)
			p.TakeoverSafe = true
			before := counter.n.Load()
			type result struct {
				r   idem.Record
				err error
			}
			done := make(chan result, 1)
			go func() {
				r, err := s.Acquire(ctx, p)
				done <- result{r, err}
			}()
			// Wait until the acquire blocks on the uncommitted row (its
			// snapshot is taken by then), then commit.
			waitForLockWait(t, pid)
			if err := tx.Commit(ctx); err != nil {
				t.Fatal(err)
			}
			res := wait.Recv(t, done, 30*time.Second, "the acquire blocked on the uncommitted row")
			if res.err != nil {
				t.Fatalf("Acquire: %v", res.err)
			}
			if res.r.Token != "winner" || res.r.State != idem.StateInProgress || !res.r.LeaseExpires.Equal(t0.Add(30*time.Second)) {
				t.Fatalf("Acquire returned %+v, want the committed record owned by the winner", res.r)
			}
			if n := counter.n.Load() - before; n != 2 {
				t.Fatalf("Acquire sent %d statements, want 2 (the statement and one re-run)", n)
			}
		})
	}
}

// waitForLockWait polls until the backend pid waits on a lock.
func waitForLockWait(t *testing.T, pid int32) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		var waiting bool
		if err := sharedPool(t).QueryRow(ctx,
			"SELECT coalesce(wait_event_type = 'Lock', false) FROM pg_stat_activity WHERE pid = $1", pid).Scan(&waiting); err != nil {
			t.Fatal(err)
		}
		if waiting {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("the acquire never waited on the concurrent transaction's row")
		}
	}
}

func TestScanCursor(t *testing.T) {
	t.Parallel()
	s, _ := newStore(t)
	// Scopes and keys that would collide if simply joined.
	for _, ref := range [][2]string{{"a:b", "c"}, {"a", "b:c"}, {"a", "b"}, {"", "z"}} {
		if _, err := s.Acquire(ctx, store.AcquireParams{Scope: ref[0], Key: ref[1], Fingerprint: fp("a"), Token: "tok",
			Now: t0, LeaseExpires: t0.Add(time.Second)}); err != nil {
			t.Fatal(err)
		}
	}
	var got []string
	cursor := ""
	for {
		res, err := s.Scan(ctx, store.ScanParams{Now: t0.Add(time.Second), Limit: 1, Cursor: cursor})
		if err != nil {
			t.Fatal(err)
		}
		for _, r := range res.Records {
			got = append(got, r.Scope+"|"+r.Key)
		}
		if cursor = res.Cursor; cursor == "" {
			break
		}
	}
	if want := []string{"|z", "a|b", "a|b:c", "a:b|c"}; strings.Join(got, " ") != strings.Join(want, " ") {
		t.Fatalf("scan order %q, want %q", got, want)
	}
	for _, bad := range []string{"%%%", "AA", "AQ", "Ag"} {
		if _, err := s.Scan(ctx, store.ScanParams{Now: t0, Cursor: bad}); !errors.Is(err, idem.ErrInvalid) {
			t.Fatalf("Scan with cursor %q = %v, want ErrInvalid", bad, err)
		}
	}
}

// TestSchemaNameIsQuoted: a schema name that is not a plain identifier is
// quoted everywhere, including in the migrations.
func TestSchemaNameIsQuoted(t *testing.T) {
	t.Parallel()
	pool := sharedPool(t)
	schema := newSchema(t) + `; DROP TABLE x; "Mixed Case`
	t.Cleanup(func() {
		if _, err := pool.Exec(ctx, "DROP SCHEMA IF EXISTS "+pgx.Identifier{schema}.Sanitize()+" CASCADE"); err != nil {
			t.Error(err)
		}
	})
	s, err := pgstore.New(ctx, pgstore.Config{Pool: pool, Schema: schema})
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	mustAcquire(t, s, acquireParams("k", "tok", t0))
	if n := countRows(t, pool, "SELECT count(*) FROM "+table(schema, "records")); n != 1 {
		t.Fatalf("%d rows in the quoted schema's table, want 1", n)
	}
}

// loginRole creates a role that may log in and has no privilege beyond
// PUBLIC's (on the test database: CONNECT and TEMP, not CREATE), dropped
// when the test ends (after anything the test created later and dropped
// in its own cleanup, such as a schema it owns), and a pool that logs in
// as it, closed when the test ends.
func loginRole(t *testing.T) (string, *pgxpool.Pool) {
	t.Helper()
	admin := sharedPool(t)
	var b [6]byte
	if _, err := rand.Read(b[:]); err != nil {
		t.Fatal(err)
	}
	role := "rvpg_app_" + hex.EncodeToString(b[:])
	if _, err := admin.Exec(ctx, "CREATE ROLE "+pgx.Identifier{role}.Sanitize()+" LOGIN"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if _, err := admin.Exec(context.Background(), "DROP ROLE IF EXISTS "+pgx.Identifier{role}.Sanitize()); err != nil {
			t.Errorf("dropping role %s: %v", role, err)
		}
	})
	cfg, err := pgxpool.ParseConfig(databaseURL(t))
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.User = role
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	var create bool
	if err := pool.QueryRow(ctx, "SELECT has_database_privilege(current_database(), 'CREATE')").Scan(&create); err != nil {
		t.Fatal(err)
	}
	if create {
		t.Fatalf("role %s may create schemas in the test database (CREATE granted to PUBLIC?): the test needs a database that does not grant it", role)
	}
	return role, pool
}

// TestNewOnAPreCreatedSchema: a DBA creates the schema for the
// application's role (CREATE SCHEMA … AUTHORIZATION app) and grants it no
// CREATE on the database (least privilege). New used to run CREATE SCHEMA
// IF NOT EXISTS, which PostgreSQL refuses without CREATE on the database
// even when the schema exists; it now uses the schema as it is.
func TestNewOnAPreCreatedSchema(t *testing.T) {
	t.Parallel()
	admin := sharedPool(t)
	role, pool := loginRole(t)
	schema := newSchema(t)
	sql := "CREATE SCHEMA " + pgx.Identifier{schema}.Sanitize() + " AUTHORIZATION " + pgx.Identifier{role}.Sanitize()
	if _, err := admin.Exec(ctx, sql); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
	s, err := pgstore.New(ctx, pgstore.Config{Pool: pool, Schema: schema})
	if err != nil {
		t.Fatalf("New on a schema the role owns: %v", err)
	}
	mustAcquire(t, s, acquireParams("k", "tok", t0))
	mustAcquire(t, s, acquireParams("running", "tok", t0))
	if err := s.Finish(ctx, completeParams("k", "tok", t0)); err != nil {
		t.Fatalf("Finish as the role: %v", err)
	}
	// The rest of the store's work needs no more than the schema either:
	// the rebuild of records_due (emptied, as a crash empties it) under its
	// advisory lock, a scan, a prune, and a second New that finds all applied.
	if _, err := admin.Exec(ctx, "DELETE FROM "+table(schema, "records_due")); err != nil {
		t.Fatal(err)
	}
	if res, err := s.Scan(ctx, store.ScanParams{Now: t0.Add(time.Minute)}); err != nil || len(res.Records) != 1 {
		t.Fatalf("Scan as the role = %+v, %v; want the running record", res, err)
	}
	if n, err := s.Prune(ctx, store.PruneParams{Now: t0.Add(time.Hour)}); err != nil || n != 1 {
		t.Fatalf("Prune as the role = %d, %v; want the completed record", n, err)
	}
	if _, err := pgstore.New(ctx, pgstore.Config{Pool: pool, Schema: schema}); err != nil {
		t.Fatalf("New again on the migrated schema: %v", err)
	}
}

// TestNewOnAMissingSchemaItCannotCreate: a role without CREATE on the
// database, whose schema does not exist, is denied (ErrDenied, as before),
// and the error says which schema is missing.
func TestNewOnAMissingSchemaItCannotCreate(t *testing.T) {
	t.Parallel()
	_, pool := loginRole(t)
	schema := newSchema(t)
	_, err := pgstore.New(ctx, pgstore.Config{Pool: pool, Schema: schema})
	if !errors.Is(err, idem.ErrDenied) || !errors.Is(err, idem.ErrUnavailable) {
		t.Fatalf("New on a missing schema the role cannot create = %v; want ErrDenied and ErrUnavailable", err)
	}
	if msg := err.Error(); !strings.Contains(msg, strconv.Quote(schema)) || !strings.Contains(msg, "does not exist") {
		t.Fatalf("New on a missing schema the role cannot create = %q; want it to name the schema and say it does not exist", msg)
	}
}

// TestConfig needs no server.
func TestConfig(t *testing.T) {
	t.Parallel()
	if _, err := pgstore.New(ctx, pgstore.Config{}); !errors.Is(err, idem.ErrInvalid) {
		t.Fatalf("New without a pool = %v, want ErrInvalid", err)
	}
	pool := closedPortPool(t)
	for _, schema := range []string{strings.Repeat("s", 64), "a\x00b"} {
		if _, err := pgstore.New(ctx, pgstore.Config{Pool: pool, Schema: schema, NoMigrate: true}); !errors.Is(err, idem.ErrInvalid) {
			t.Fatalf("New with schema %q = %v, want ErrInvalid", schema, err)
		}
	}
	if _, err := pgstore.New(ctx, pgstore.Config{Pool: pool, Schema: strings.Repeat("s", 63), NoMigrate: true}); err != nil {
		t.Fatalf("New with a 63-byte schema: %v", err)
	}
}

// TestFaults runs the suite's network-fault cases, through a TCP proxy
// between the store and the server, on a pool of one connection that never
// pings (a ping would take the fault meant for the operation).
func TestFaults(t *testing.T) {
	server, err := pgxpool.ParseConfig(databaseURL(t))
	if err != nil {
		t.Fatal(err)
	}
	target := net.JoinHostPort(server.ConnConfig.Host, strconv.Itoa(int(server.ConnConfig.Port)))
	storetest.RunFaults(t, target, func(t *testing.T, addr string) idem.Store {
		cfg, err := pgxpool.ParseConfig(databaseURL(t))
		if err != nil {
			t.Fatal(err)
		}
		host, port, _ := net.SplitHostPort(addr)
		p, _ := strconv.Atoi(port)
		cfg.ConnConfig.Host, cfg.ConnConfig.Port, cfg.ConnConfig.Fallbacks = host, uint16(p), nil
		cfg.MaxConns = 1
		cfg.ShouldPing = func(context.Context, pgxpool.ShouldPingParams) bool { return false }
		pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(pool.Close)
		s, err := pgstore.New(context.Background(), pgstore.Config{Pool: pool, Schema: newSchema(t)})
		if err != nil {
			t.Fatal(err)
		}
		return s
	})
}

// TestCompletesAreHOT: a complete updates the record in place (a HOT update:
// no new index entries), which needs every index to leave the columns a
// complete changes alone, and room in the page for the completed row when
// other records were inserted beside it.
func TestCompletesAreHOT(t *testing.T) {
	t.Parallel()
	// A pool of its own: a backend reports its statistics when it exits.
	s, schema, pool, _ := countedStore(t, 8)
	const callers, each = 16, 40
	errs := make(chan error, callers)
	var wg sync.WaitGroup
	for c := range callers {
		wg.Go(func() {
			// Requests in flight: every caller's records are inserted
			// before they complete.
			for i := range each {
				if _, err := s.Acquire(ctx, acquireParams(fmt.Sprintf("k-%02d-%02d", c, i), "tok", t0)); err != nil {
					errs <- err
					return
				}
			}
			for i := range each {
				if err := s.Finish(ctx, completeParams(fmt.Sprintf("k-%02d-%02d", c, i), "tok", t0)); err != nil {
					errs <- err
					return
				}
			}
		})
	}
	wait.Done(t, 2*time.Minute, "the callers to finish", wg.Wait)
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	pool.Close()
	var upd, hot int64
	wait.Until(t, 20*time.Second, "the pool's backends to report their statistics", func() bool {
		if err := sharedPool(t).QueryRow(ctx, "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relid = $1::regclass",
			table(schema, "records")).Scan(&upd, &hot); err != nil {
			t.Fatal(err)
		}
		return upd == callers*each
	})
	if hot < upd*9/10 {
		t.Fatalf("%d of %d updates were HOT, want at least 90%%", hot, upd)
	}
}

// TestRecordsDueRebuilt: PostgreSQL empties the unlogged records_due after a
// crash (and on a promoted standby). The records written before are found
// again by scans and prunes, and so are those written after the loss.
func TestRecordsDueRebuilt(t *testing.T) {
	t.Parallel()
	s, schema := newStore(t)
	pool := sharedPool(t)
	settle := func(key string, now time.Time) {
		t.Helper()
		mustAcquire(t, s, acquireParams(key, "tok", now))
		if err := s.Finish(ctx, completeParams(key, "tok", now)); err != nil {
			t.Fatal(err)
		}
	}
	for i := range 3 {
		settle(fmt.Sprintf("done-before-%d", i), t0)
		mustAcquire(t, s, acquireParams(fmt.Sprintf("running-before-%d", i), "tok", t0))
	}
	if res, err := s.Scan(ctx, store.ScanParams{Now: t0.Add(time.Minute)}); err != nil || len(res.Records) != 3 {
		t.Fatalf("Scan before the loss = %+v, %v; want the 3 running records", res, err)
	}

	// What crash recovery does to an unlogged table: it is reset to empty.
	if _, err := pool.Exec(ctx, "TRUNCATE "+table(schema, "records_due")); err != nil {
		t.Fatal(err)
	}
	settle("done-after", t0)
	mustAcquire(t, s, acquireParams("running-after", "tok", t0))

	res, err := s.Scan(ctx, store.ScanParams{Now: t0.Add(time.Minute)})
	if err != nil {
		t.Fatal(err)
	}
	var keys []string
	for _, r := range res.Records {
		keys = append(keys, r.Key)
	}
	if want := []string{"running-after", "running-before-0", "running-before-1", "running-before-2"}; !reflect.DeepEqual(keys, want) || res.Cursor != "" {
		t.Fatalf("Scan after the loss = %v (cursor %q), want %v", keys, res.Cursor, want)
	}
	if n := countRows(t, pool, "SELECT count(*) FROM "+table(schema, "records_due")); n != 9 {
		t.Fatalf("records_due holds %d rows after the rebuild, want 8 records and the mark", n)
	}

	if _, err := pool.Exec(ctx, "TRUNCATE "+table(schema, "records_due")); err != nil {
		t.Fatal(err)
	}
	// A prune finds what is due whether or not records_due was whole, and
	// never more than its limit: 3 of the 4 first, then the last.
	for i, want := range []int{3, 1, 0} {
		n, err := s.Prune(ctx, store.PruneParams{Now: t0.Add(time.Hour), Limit: 3})
		if err != nil || n != want {
			t.Fatalf("Prune %d after the loss = %d, %v; want %d", i, n, err, want)
		}
	}
	if n := countRows(t, pool, "SELECT count(*) FROM "+table(schema, "records")+" WHERE state = 'completed'"); n != 0 {
		t.Fatalf("%d completed records survived pruning", n)
	}
	if n := countRows(t, pool, "SELECT count(*) FROM "+table(schema, "records_due")); n != 5 {
		t.Fatalf("records_due holds %d rows after pruning, want the 4 running records and the mark", n)
	}
}

// TestRefusedAccessIsDenied: a role without the privileges on the records
// (a grant revoked, or the wrong role after a rotation) was reached: its
// refusal is unavailable (a completion is kept to try again) and denied
// (never a reason to fail open), as a refused login is.
func TestRefusedAccessIsDenied(t *testing.T) {
	admin, schema := newStore(t)
	r, err := admin.Acquire(ctx, store.AcquireParams{Scope: "s", Key: "k", Fingerprint: "fp", Token: "tok", Now: t0, LeaseExpires: t0.Add(time.Minute)})
	if err != nil {
		t.Fatal(err)
	}
	role := "idem_noperm_" + strconv.Itoa(os.Getpid())
	pool := sharedPool(t)
	if _, err := pool.Exec(ctx, "DROP ROLE IF EXISTS "+role+"; CREATE ROLE "+role+" LOGIN"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pool.Exec(context.Background(), "DROP ROLE IF EXISTS "+role) })
	cfg, err := pgxpool.ParseConfig(databaseURL(t))
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.User = role
	weak, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(weak.Close)
	s, err := pgstore.New(ctx, pgstore.Config{Pool: weak, Schema: schema, NoMigrate: true})
	if err != nil {
		t.Fatal(err)
	}
	_, err = s.Get(ctx, store.GetParams{Scope: "s", Key: "k", Now: t0})
	if !errors.Is(err, idem.ErrUnavailable) || !errors.Is(err, idem.ErrDenied) {
		t.Fatalf("Get as a role without privileges: %v; want ErrUnavailable and ErrDenied", err)
	}
	err = s.Finish(ctx, store.FinishParams{Scope: "s", Key: "k", Token: r.Token, Now: t0, State: store.StateCompleted,
		Response: &store.Response{Status: 201}, Expires: t0.Add(time.Hour)})
	if !errors.Is(err, idem.ErrUnavailable) || !errors.Is(err, idem.ErrDenied) {
		t.Fatalf("Finish as a role without privileges: %v; want ErrUnavailable and ErrDenied", err)
	}
}

// observedFinish passes on each answer PostgreSQL gives the engine's Finish.
type observedFinish struct {
	*pgstore.Store
	finished chan error
}

func (s observedFinish) Finish(ctx context.Context, p store.FinishParams) error {
	err := s.Store.Finish(ctx, p)
	select {
	case s.finished <- err:
	default:
	}
	return err
}

// closeEngine closes eng within 10 s: a test that failed with an outcome
// still waiting in its journal ends, it does not hang in the close.
func closeEngine(eng *idem.Engine) {
	stop, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	eng.Close(stop)
}

// faultedStore returns a store on a schema of its own whose pool reaches
// PostgreSQL through a TCP fault proxy, and the proxy.
func faultedStore(t *testing.T) (*pgstore.Store, string, *faultnet.Proxy) {
	t.Helper()
	_, schema := newStore(t)
	server, err := pgxpool.ParseConfig(databaseURL(t))
	if err != nil {
		t.Fatal(err)
	}
	fault, err := faultnet.Listen(net.JoinHostPort(server.ConnConfig.Host, strconv.Itoa(int(server.ConnConfig.Port))))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { fault.Close() })
	cfg := server.Copy()
	host, port, _ := net.SplitHostPort(fault.Addr())
	p, _ := strconv.Atoi(port)
	cfg.ConnConfig.Host, cfg.ConnConfig.Port, cfg.ConnConfig.Fallbacks = host, uint16(p), nil
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	s, err := pgstore.New(ctx, pgstore.Config{Pool: pool, Schema: schema, NoMigrate: true})
	if err != nil {
		t.Fatal(err)
	}
	return s, schema, fault
}

// TestReleaseOutlastsALateAcquire: an acquire that reached PostgreSQL but
// whose answer never came back (its connection cut while it waited on
// another transaction's insert of the same key; a commit waiting on a
// stalled disk is another case) goes on in its backend: pgx's cancel request
// could not get through, and a backend waiting on a lock does not notice
// its client is gone. The engine's release of it (nothing ran) reached the
// store first, found no record and was dropped; the acquire then committed,
// and the record stood IN_PROGRESS under a lease nobody held: every retry of
// a request that never ran got 409 until the lease ran out, then UNKNOWN
// until a reconciler came. The release is now sent again until the
// acquire's lease would have ended.
func TestReleaseOutlastsALateAcquire(t *testing.T) {
	s, schema, fault := faultedStore(t)
	obs := observedFinish{Store: s, finished: make(chan error, 64)}
	eng, err := idem.New(idem.Config{Store: obs, StoreTimeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer closeEngine(eng)

	records := table(schema, "records")
	tx, err := sharedPool(t).Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := tx.Exec(ctx, `INSERT INTO `+records+` (scope, key, state, fingerprint, token, fence, lease_expires,
		takeover_safe, created, updated) VALUES ('tenant', 'order-1', 'in_progress', 'other', 'other', 1, now(), false, now(), now())`); err != nil {
		t.Fatal(err)
	}
	charge := idem.BeginParams{Scope: "tenant", Key: "order-1", Fingerprint: idem.NewFingerprint(idem.Payload{Method: "POST", Path: "/charges"}),
		Lease: time.Minute}
	begun := make(chan error, 1)
	go func() {
		_, err := eng.Begin(ctx, charge)
		begun <- err
	}()
	wait.Until(t, 10*time.Second, "the acquire to wait on the other transaction", func() bool {
		return countRows(t, sharedPool(t), `SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%INSERT INTO%'`) == 1
	})
	end := fault.Outage() // its connection cut, and pgx's cancel request refused
	if err := wait.Recv(t, begun, 10*time.Second, "Begin to give up"); !errors.Is(err, idem.ErrUnavailable) {
		t.Fatalf("Begin whose acquire got no answer: %v; want ErrUnavailable", err)
	}
	end()
	for {
		err := wait.Recv(t, obs.finished, 10*time.Second, "the release to reach the store")
		if errors.Is(err, idem.ErrLeaseLost) {
			break // no record yet: the acquire still waits in its backend
		}
		if !errors.Is(err, idem.ErrUnavailable) {
			t.Fatalf("the release: %v; want ErrLeaseLost once the store answers", err)
		}
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	wait.Until(t, 10*time.Second, "the abandoned acquire to commit", func() bool {
		return countRows(t, sharedPool(t), `SELECT count(*) FROM `+records+` WHERE key = 'order-1'`) == 1
	})
	wait.Until(t, 10*time.Second, "the release to settle the record the late acquire left (nothing ran under it)", func() bool {
		return countRows(t, sharedPool(t), `SELECT count(*) FROM `+records+` WHERE key = 'order-1' AND state = 'failed'`) == 1
	})
	out, err := eng.Begin(ctx, charge)
	if err != nil || out.Decision != idem.Execute {
		t.Fatalf("the client's retry: %v, %v; want Execute, the request never ran", out.Decision, err)
	}
	if err := eng.Release(ctx, out.Lease); err != nil { // or Close waits for the lease
		t.Fatal(err)
	}
}

// TestMigrationLetsTrafficThrough: a fleet at migration 2 has a business
// transaction open on records (a FinishTx whose COMMIT has not come; a
// client gone from it). A new instance's New applies migration 3, whose
// CREATE TRIGGER and DROP INDEX wait for that transaction; every write of
// every instance to records queued behind the migration's lock request for
// as long as the transaction stayed open: 503s across the fleet during the
// deploy. The migration now waits for its locks briefly, steps back and
// tries again, and finishes once the transaction ends.
func TestMigrationLetsTrafficThrough(t *testing.T) {
	schema := newSchema(t)
	pool := sharedPool(t)
	quoted := pgx.Identifier{schema}.Sanitize()
	stmts := []string{"CREATE SCHEMA " + quoted,
		"CREATE TABLE " + table(schema, "migrations") + " (version integer PRIMARY KEY, applied timestamptz NOT NULL)"}
	for _, f := range []string{"testdata/v0.1.0/001_records.sql", "migrations/002_checkpoints.sql"} {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		stmts = append(stmts, strings.ReplaceAll(string(b), "{{schema}}", quoted))
	}
	stmts = append(stmts, "INSERT INTO "+table(schema, "migrations")+" VALUES (1, now()), (2, now())")
	for _, k := range []string{"r1", "r2"} {
		stmts = append(stmts, `INSERT INTO `+table(schema, "records")+` (scope, key, state, fingerprint, token, fence, lease_expires,
			takeover_safe, created, updated) VALUES ('s', '`+k+`', 'in_progress', 'f', 'tok', 1, now() + interval '1 minute', false, now(), now())`)
	}
	for _, stmt := range stmts {
		if _, err := pool.Exec(ctx, stmt); err != nil {
			t.Fatalf("%s: %v", stmt, err)
		}
	}
	business, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer business.Rollback(ctx)
	if _, err := business.Exec(ctx, "UPDATE "+table(schema, "records")+
		" SET state = 'completed', response = '\\x00', expires = now() + interval '1 day' WHERE key = 'r1'"); err != nil {
		t.Fatal(err)
	}

	started := make(chan error, 1)
	go func() {
		bounded, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		_, err := pgstore.New(bounded, pgstore.Config{Pool: pool, Schema: schema})
		started <- err
	}()
	wait.Until(t, 10*time.Second, "the migration to wait for a lock on records", func() bool {
		return countRows(t, pool, `SELECT count(*) FROM pg_locks WHERE relation = $1::regclass AND NOT granted`, table(schema, "records")) > 0
	})
	for i := range 3 { // writes of the running fleet, for longer than a migration's wait
		c, cancel := context.WithTimeout(ctx, 3*time.Second)
		_, err := pool.Exec(c, "UPDATE "+table(schema, "records")+" SET lease_expires = now() + interval '2 minutes' WHERE key = 'r2'")
		cancel()
		if err != nil {
			t.Fatalf("write %d to another record while the migration waits: %v; want it through", i, err)
		}
	}
	if err := business.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if err := wait.Recv(t, started, 30*time.Second, "New, once the transaction ended"); err != nil {
		t.Fatalf("New: %v", err)
	}
}

// TestJournalLeavesAnotherStoresOutcome: two engines on two stores share a
// journal directory (the default, relative idem-journal, of two proxies
// started in one directory). A's outcome waits there while PostgreSQL is
// cut off, and A stops. B, on another store, read the entry at its start,
// sent it to its own store, which had no such record, took the refusal for
// "settled by someone else" and deleted the file: the outcome A's client
// had been given was lost, and the record stayed IN_PROGRESS. B leaves it,
// since its store holds no record of the key, and A's next start stores
// it, though it reaches PostgreSQL at another address (directly, no longer
// through the fault proxy), as a restart after a failover would.
func TestJournalLeavesAnotherStoresOutcome(t *testing.T) {
	s, schema, fault := faultedStore(t)
	dir := t.TempDir()
	a, err := idem.New(idem.Config{Store: s, StoreTimeout: time.Second, JournalDir: dir})
	if err != nil {
		t.Fatal(err)
	}
	out, err := a.Begin(ctx, idem.BeginParams{Scope: "tenant", Key: "pay-77", Fingerprint: fp("a")})
	if err != nil || out.Decision != idem.Execute {
		t.Fatalf("Begin: %v, %v", out.Decision, err)
	}
	end := fault.Outage()
	if err := a.Complete(ctx, out.Lease, &idem.Response{Status: 201, Body: []byte(`{"id":"ch_36"}`)}); err != nil {
		t.Fatalf("Complete while the store is cut off: %v; want the outcome kept in the journal", err)
	}
	stop, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
	a.Close(stop) // a process that stops with the outcome still waiting
	cancel()

	b, err := idem.New(idem.Config{Store: memstore.New(), JournalDir: dir})
	if err != nil {
		t.Fatal(err)
	}
	stop, cancel = context.WithTimeout(ctx, 5*time.Second)
	if err := b.Close(stop); err != nil {
		t.Fatalf("B's close: %v; want nothing left for its own store", err)
	}
	cancel()
	if files, _ := filepath.Glob(filepath.Join(dir, "*.json")); len(files) != 1 {
		t.Fatalf("%d entries in the directory after B ran; want A's outcome left there", len(files))
	}

	end()
	direct, err := pgstore.New(ctx, pgstore.Config{Pool: sharedPool(t), Schema: schema, NoMigrate: true})
	if err != nil {
		t.Fatal(err)
	}
	a, err = idem.New(idem.Config{Store: direct, StoreTimeout: time.Second, JournalDir: dir})
	if err != nil {
		t.Fatal(err)
	}
	defer closeEngine(a)
	wait.Until(t, 20*time.Second, "A's next start to store the outcome its client was given", func() bool {
		return countRows(t, sharedPool(t), `SELECT count(*) FROM `+table(schema, "records")+` WHERE key = 'pay-77' AND state = 'completed'`) == 1
	})
}

// TestRecordsAreCompact: a records table created now keeps a record's
// fingerprint as its four sums (129 bytes, not 178 characters) and its
// response in the compact form (its body as is, not in base64 inside
// JSON): both are in the WAL of every key, the fingerprint in the
// acquire's and the response in the complete's.
func TestRecordsAreCompact(t *testing.T) {
	pool := sharedPool(t)
	schema := newSchema(t)
	s, err := pgstore.New(ctx, pgstore.Config{Pool: pool, Schema: schema})
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	p := acquireParams("k", "tok", t0)
	mustAcquire(t, s, p)
	f := completeParams("k", "tok", t0)
	f.Response.Header = http.Header{"Content-Type": {"application/json"}}
	if err := s.Finish(ctx, f); err != nil {
		t.Fatal(err)
	}
	var fpLen, respLen int
	if err := pool.QueryRow(ctx, "SELECT octet_length(fingerprint), octet_length(response) FROM "+table(schema, "records")).
		Scan(&fpLen, &respLen); err != nil {
		t.Fatal(err)
	}
	if fpLen != 129 {
		t.Errorf("the fingerprint takes %d bytes, want 129 (%d characters as text)", fpLen, len(p.Fingerprint))
	}
	if want := len(f.Response.Body) + len("Content-Type") + len("application/json") + 12; respLen > want {
		t.Errorf("the response takes %d bytes, want at most %d", respLen, want)
	}
	r, err := s.Get(ctx, store.GetParams{Scope: "s", Key: "k", Now: t0})
	if err != nil {
		t.Fatal(err)
	}
	if r.Fingerprint != p.Fingerprint || !reflect.DeepEqual(r.Response, f.Response) {
		t.Errorf("read back %q %+v, want %q %+v", r.Fingerprint, r.Response, p.Fingerprint, f.Response)
	}
}

// TestReleasedLayoutKeepsReleasedEncoding: on a records table created by
// release 0.1.0, the store writes what 0.1.0 reads (the fingerprint as
// text, the response as JSON), so that the instances not yet upgraded in
// a rolling upgrade replay what the upgraded ones stored.
func TestReleasedLayoutKeepsReleasedEncoding(t *testing.T) {
	pool := sharedPool(t)
	schema := releasedSchema(t)
	s, err := pgstore.New(ctx, pgstore.Config{Pool: pool, Schema: schema})
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	p := acquireParams("k", "tok", t0)
	mustAcquire(t, s, p)
	f := completeParams("k", "tok", t0)
	if err := s.Finish(ctx, f); err != nil {
		t.Fatal(err)
	}
	var fpText string
	var resp []byte
	if err := pool.QueryRow(ctx, "SELECT fingerprint, response FROM "+table(schema, "records")).Scan(&fpText, &resp); err != nil {
		t.Fatal(err)
	}
	want, err := f.Response.MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	if fpText != string(p.Fingerprint) || string(resp) != string(want) {
		t.Errorf("stored %q and %q, want %q and %q", fpText, resp, p.Fingerprint, want)
	}
}

// TestCompactTableReadsTextRecords: a record written in the text forms on
// a table created now (a bulk load, an older idem pointed at it) is read
// as it was written.
func TestCompactTableReadsTextRecords(t *testing.T) {
	pool := sharedPool(t)
	schema := newSchema(t)
	s, err := pgstore.New(ctx, pgstore.Config{Pool: pool, Schema: schema})
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	resp := &idem.Response{Status: 201, Body: []byte(`{"id":"ch_1"}`)}
	asJSON, err := resp.MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `INSERT INTO `+table(schema, "records")+` (scope, key, state, fingerprint, token, fence,
		lease_expires, takeover_safe, response, created, updated, expires)
		VALUES ('s', 'k', 'completed', convert_to($1, 'UTF8'), 'tok', 1, $2, false, $3, $2, $2, $4)`,
		string(fp("a")), t0, asJSON, t0.Add(time.Hour)); err != nil {
		t.Fatal(err)
	}
	r, err := s.Get(ctx, store.GetParams{Scope: "s", Key: "k", Now: t0})
	if err != nil {
		t.Fatal(err)
	}
	if r.Fingerprint != fp("a") || !reflect.DeepEqual(r.Response, resp) {
		t.Errorf("read %q %+v, want %q %+v", r.Fingerprint, r.Response, fp("a"), resp)
	}
}
