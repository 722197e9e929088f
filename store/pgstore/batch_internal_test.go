package pgstore

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemhq/idem/internal/testkit"
	"github.com/idemhq/idem/internal/wait"
	"github.com/idemhq/idem/store"
)

// newStore returns a store in a schema of its own, dropped when the test
// ends, on a pool of at most maxConns connections to the test server.
func newStore(t *testing.T, maxConns int32) (*Store, *pgxpool.Pool, string) {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(testkit.Server(t, "IDEM_TEST_DATABASE_URL"))
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = maxConns
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	var b [8]byte
	rand.Read(b[:])
	schema := "idem_test_" + hex.EncodeToString(b[:])
	t.Cleanup(func() {
		pool.Exec(context.Background(), "DROP SCHEMA IF EXISTS "+pgx.Identifier{schema}.Sanitize()+" CASCADE")
	})
	s, err := New(context.Background(), Config{Pool: pool, Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	return s, pool, schema
}

// holdRunner starts a batch that runs until the function it returns is
// called (it waits for an advisory lock, a number of the test's own, that
// the test holds), so that what the test queues meanwhile runs as one batch.
func holdRunner(t *testing.T, s *Store, pool *pgxpool.Pool, schema string) (release func()) {
	t.Helper()
	bg := context.Background()
	lock := lockKey(t.Name(), schema) & (1<<31 - 1) // in pg_locks' objid whole
	hold, err := pool.Acquire(bg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(hold.Release)
	if _, err := hold.Exec(bg, "SELECT pg_advisory_lock($1)", lock); err != nil {
		t.Fatal(err)
	}
	held := make(chan error, 1)
	go func() {
		held <- s.writes.Do(bg, &write{scope: "", key: "~", sql: "SELECT $1::text, $2::text, pg_advisory_xact_lock($3)", args: []any{"", "~", lock}})
	}()
	wait.Until(t, 10*time.Second, "the holding batch to wait for the lock", func() bool {
		var waiting bool
		err := hold.QueryRow(bg, `SELECT count(*) > 0 FROM pg_locks WHERE locktype = 'advisory' AND objid = $1 AND NOT granted`, lock).Scan(&waiting)
		return err == nil && waiting
	})
	return func() {
		t.Helper()
		if _, err := hold.Exec(bg, "SELECT pg_advisory_unlock($1)", lock); err != nil {
			t.Fatal(err)
		}
		if err := wait.Recv(t, held, 10*time.Second, "the holding batch"); err != nil {
			t.Fatal(err)
		}
	}
}

// TestBatch queues writes behind a batch that is still running (it waits
// for an advisory lock the test holds) and checks that the one batch that
// then runs them all applies each in its turn, reports each as it went, and
// commits exactly the writes reported done: a write that sees the one before
// it on the same record, a refused write and a failing statement beside
// writes that succeed, and a write whose caller gave up while it waited,
// which never runs.
func TestBatch(t *testing.T) {
	bg := context.Background()
	s, pool, schema := newStore(t, 3) // one batch at a time
	if s.writes.Runners != 1 {
		t.Fatalf("%d runners on a pool of 3, want 1", s.writes.Runners)
	}

	now := time.Now().UTC().Truncate(time.Microsecond)
	fp := store.Fingerprint("POST /charges sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef")
	acquire := func(key, token string) store.AcquireParams {
		return store.AcquireParams{Key: key, Fingerprint: fp, Token: token, Now: now, LeaseExpires: now.Add(time.Minute)}
	}
	complete := func(key, token string) store.FinishParams {
		return store.FinishParams{Key: key, Token: token, Now: now, State: store.StateCompleted,
			Response: &store.Response{Status: 201, Body: []byte("charged")}, Expires: now.Add(time.Hour)}
	}

	release := holdRunner(t, s, pool, schema)

	q := &testkit.Queue{T: t, Waiting: s.writes.Queued, Results: map[string]chan error{}}
	queue, results := q.Add, q.Results
	queue("acquire c", func() error { _, err := s.Acquire(bg, acquire("c", "tok-c")); return err })
	queue("acquire a", func() error { _, err := s.Acquire(bg, acquire("a", "tok-a")); return err })
	queue("complete a", func() error { return s.Finish(bg, complete("a", "tok-a")) })
	queue("complete b", func() error { return s.Finish(bg, complete("b", "tok-b")) }) // never acquired: refused
	queue("failing statement", func() error {
		return s.writes.Do(bg, &write{scope: "", key: "b2", sql: "SELECT $1::text, $2::text, 1/0", args: []any{"", "b2"}})
	})
	gaveUp, giveUp := context.WithCancel(bg)
	queue("abandoned acquire d", func() error { _, err := s.Acquire(gaveUp, acquire("d", "tok-d")); return err })

	giveUp()
	if err := wait.Recv(t, results["abandoned acquire d"], 10*time.Second, "the abandoned write to return while the batch runs"); !errors.Is(err, context.Canceled) {
		t.Fatalf("abandoned write: %v, want context.Canceled", err)
	}
	release()
	for name, want := range map[string]error{"acquire a": nil, "complete a": nil, "complete b": store.ErrLeaseLost, "acquire c": nil} {
		if err := wait.Recv(t, results[name], 10*time.Second, name); !errors.Is(err, want) || (want == nil) != (err == nil) {
			t.Errorf("%s: %v, want %v", name, err, want)
		}
	}
	var pgErr interface{ SQLState() string }
	if err := wait.Recv(t, results["failing statement"], 10*time.Second, "the failing statement"); !errors.As(err, &pgErr) || pgErr.SQLState() != "22012" {
		t.Errorf("failing statement: %v, want division by zero", err)
	}
	for key, want := range map[string]store.State{"a": store.StateCompleted, "c": store.StateInProgress, "d": ""} {
		r, err := s.Get(bg, store.GetParams{Key: key, Now: now})
		switch {
		case want == "" && !errors.Is(err, store.ErrNotFound):
			t.Errorf("%s: %v %v, want no record", key, r.State, err)
		case want != "" && (err != nil || r.State != want || r.Fence != 1):
			t.Errorf("%s: %v fence %d %v, want %v fence 1", key, r.State, r.Fence, err, want)
		}
	}
}

// TestRebuildOutlastsItsCaller: a rebuild of records_due that takes longer
// than the scan that started it is not cut short with it: the scan answers
// unavailable when its deadline passes, the rebuild goes on and commits, and
// the scans after it find what records_due had lost. (The rebuild is held
// back by a transaction that wrote the row of records_due it copies and
// stays open: it waits, steps aside and tries again, until the
// transaction has ended.)
func TestRebuildOutlastsItsCaller(t *testing.T) {
	bg := context.Background()
	s, pool, schema := newStore(t, 4)
	now := time.Now().UTC().Truncate(time.Microsecond)
	if _, err := s.Acquire(bg, store.AcquireParams{Key: "stale", Fingerprint: "fp", Token: "tok", Now: now, LeaseExpires: now.Add(time.Second)}); err != nil {
		t.Fatal(err)
	}
	due := pgx.Identifier{schema, "records_due"}.Sanitize()
	// records_due as PostgreSQL leaves it after a crash: empty.
	if _, err := pool.Exec(bg, "TRUNCATE "+due); err != nil {
		t.Fatal(err)
	}
	hold, err := pool.Begin(bg)
	if err != nil {
		t.Fatal(err)
	}
	defer hold.Rollback(bg)
	if _, err := hold.Exec(bg, "INSERT INTO "+due+" (scope, key, expires) VALUES ('', 'stale', NULL)"); err != nil {
		t.Fatal(err)
	}
	scan := store.ScanParams{Now: now.Add(time.Minute)}
	short, cancel := context.WithTimeout(bg, 2*time.Second)
	defer cancel()
	scanned := make(chan error, 1)
	go func() { _, err := s.Scan(short, scan); scanned <- err }()
	wait.Until(t, 10*time.Second, "the rebuild to wait for the open transaction", func() bool {
		var n int
		err := pool.QueryRow(bg, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()
			AND wait_event_type = 'Lock' AND query LIKE '%records_due%'`).Scan(&n)
		return err == nil && n > 0
	})
	if err := wait.Recv(t, scanned, 10*time.Second, "the scan whose deadline passed"); !errors.Is(err, store.ErrUnavailable) {
		t.Fatalf("Scan while records_due is rebuilt: %v; want ErrUnavailable", err)
	}
	if err := hold.Rollback(bg); err != nil {
		t.Fatal(err)
	}
	wait.Until(t, 10*time.Second, "the rebuild to commit after its caller gave up", func() bool {
		var whole bool
		err := pool.QueryRow(bg, s.dueWholeSQL).Scan(&whole)
		return err == nil && whole
	})
	res, err := s.Scan(bg, scan)
	if err != nil || len(res.Records) != 1 || res.Records[0].Key != "stale" {
		t.Fatalf("Scan after the rebuild = %+v, %v; want the stale record", res, err)
	}
}

// TestBatchReportsAnUnreadableRecordToItsCallerAlone: an acquire that finds
// a record it cannot read (its stored response written by another version
// of idem, or damaged) fails alone; the batch it ran in committed, and the
// other writes in it are reported done. (They were reported failed: an
// acquire that had created its record returned an error, and the key stayed
// taken by a lease nobody held.)
func TestBatchReportsAnUnreadableRecordToItsCallerAlone(t *testing.T) {
	bg := context.Background()
	s, pool, schema := newStore(t, 3) // one batch at a time
	now := time.Now().UTC().Truncate(time.Microsecond)
	fp := store.Fingerprint("POST /charges sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef")
	acquire := func(key, token string) store.AcquireParams {
		return store.AcquireParams{Key: key, Fingerprint: fp, Token: token, Now: now, LeaseExpires: now.Add(time.Minute)}
	}
	if _, err := s.Acquire(bg, acquire("unreadable", "tok-1")); err != nil {
		t.Fatal(err)
	}
	if err := s.Finish(bg, store.FinishParams{Key: "unreadable", Token: "tok-1", Now: now, State: store.StateCompleted,
		Response: &store.Response{Status: 201, Body: []byte("charged")}, Expires: now.Add(time.Hour)}); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(bg, "UPDATE "+pgx.Identifier{schema, "records"}.Sanitize()+` SET response = '\x00ff'::bytea`); err != nil {
		t.Fatal(err)
	}

	release := holdRunner(t, s, pool, schema)
	q := &testkit.Queue{T: t, Waiting: s.writes.Queued, Results: map[string]chan error{}}
	q.Add("replay of the unreadable record", func() error { _, err := s.Acquire(bg, acquire("unreadable", "tok-2")); return err })
	q.Add("acquire of a new key", func() error { _, err := s.Acquire(bg, acquire("new", "tok-new")); return err })
	release()

	err := wait.Recv(t, q.Results["replay of the unreadable record"], 10*time.Second, "the replay")
	if err == nil || errors.Is(err, store.ErrUnavailable) || strings.Contains(err.Error(), "unreadable") {
		t.Errorf("replay of the unreadable record: %v; want an error, not ErrUnavailable, that does not name the key", err)
	}
	if err := wait.Recv(t, q.Results["acquire of a new key"], 10*time.Second, "the acquire"); err != nil {
		t.Errorf("acquire of a new key in the same batch: %v, want done", err)
	}
	if r, err := s.Get(bg, store.GetParams{Key: "new", Now: now}); err != nil || r.Token != "tok-new" {
		t.Errorf("the new key: %+v, %v; want it held by its acquire", r, err)
	}
}

// TestRebuildLetsWritesThrough: while records_due is rebuilt after a crash,
// a write to a record the rebuild has passed goes through; it does not wait
// for the whole rebuild (about 13 µs a record: minutes on a large table),
// only, at worst, for the part of it under way. Here the rebuild is held
// back two parts on (by a row of records_due that the test writes and
// does not commit), and a Finish of the first record settles it.
func TestRebuildLetsWritesThrough(t *testing.T) {
	bg := context.Background()
	s, pool, schema := newStore(t, 4)
	records, due := pgx.Identifier{schema, "records"}.Sanitize(), pgx.Identifier{schema, "records_due"}.Sanitize()
	now := time.Now().UTC().Truncate(time.Microsecond)
	n := 2*dueChunk + 10
	if _, err := pool.Exec(bg, `INSERT INTO `+records+` (scope, key, state, fingerprint, token, fence, lease_expires, takeover_safe, created, updated)
		SELECT '', 'k' || lpad(i::text, 8, '0'), 'in_progress', 'fp', 'tok', 1, $1, false, $2, $2 FROM generate_series(1, $3) AS i`,
		now.Add(time.Hour), now, n); err != nil {
		t.Fatal(err)
	}
	// records_due as PostgreSQL leaves it after a crash: empty.
	if _, err := pool.Exec(bg, "TRUNCATE "+due); err != nil {
		t.Fatal(err)
	}
	hold, err := pool.Begin(bg)
	if err != nil {
		t.Fatal(err)
	}
	defer hold.Rollback(bg)
	late := fmt.Sprintf("k%08d", n-5) // in the rebuild's last part
	if _, err := hold.Exec(bg, `INSERT INTO `+due+` (scope, key, expires) VALUES ('', $1, NULL)`, late); err != nil {
		t.Fatal(err)
	}
	var holder int32
	if err := hold.QueryRow(bg, "SELECT pg_backend_pid()").Scan(&holder); err != nil {
		t.Fatal(err)
	}
	scanned := make(chan error, 1)
	go func() { // finds records_due empty, and waits for its rebuild
		_, err := s.Scan(bg, store.ScanParams{Now: now})
		scanned <- err
	}()
	wait.Until(t, 30*time.Second, "the rebuild to reach the row the test holds", func() bool {
		var waiting bool
		err := pool.QueryRow(bg, "SELECT count(*) > 0 FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))", holder).Scan(&waiting)
		return err == nil && waiting
	})
	finishing, cancelFinish := context.WithTimeout(bg, 5*time.Second)
	defer cancelFinish()
	err = s.Finish(finishing, store.FinishParams{Key: "k00000001", Token: "tok", Now: now, State: store.StateCompleted,
		Response: &store.Response{Status: 201}, Expires: now.Add(time.Hour)})
	if err != nil {
		t.Fatalf("Finish of a record the rebuild has passed: %v; want it settled while the rebuild goes on", err)
	}
	if err := hold.Rollback(bg); err != nil {
		t.Fatal(err)
	}
	if err := wait.Recv(t, scanned, 30*time.Second, "the scan that waited for the rebuild"); err != nil {
		t.Fatalf("the scan that waited for the rebuild: %v", err)
	}
	var rows, settled int
	if err := pool.QueryRow(bg, `SELECT count(*), count(expires) FROM `+due+` WHERE key <> ''`).Scan(&rows, &settled); err != nil {
		t.Fatal(err)
	}
	if rows != n || settled != 1 {
		t.Fatalf("records_due after the rebuild: %d rows, %d settled; want %d, 1", rows, settled, n)
	}
}

// TestLockedRecordDoesNotHoldUpItsBatch: a record whose row a business
// transaction holds (FinishTx done, its COMMIT not answered: slow, or its
// client gone while the server keeps the transaction open) makes its
// lease's renewal wait. Batched with that renewal, the acquire of an
// unrelated key ran first (batches go in key order), kept that key's row
// locked and waited with it: the other client got a false 503, and so did
// its retries and every write queued behind the batch, for as long as the
// renewal's caller waited. A write in a batch now waits for a row at most
// batchLockTimeout, then fails alone (unavailable, for its caller to try
// again) and its batch-mates go through.
func TestLockedRecordDoesNotHoldUpItsBatch(t *testing.T) {
	bg := context.Background()
	s, _, schema := newStore(t, 3) // one runner
	other, err := pgxpool.New(bg, testkit.Server(t, "IDEM_TEST_DATABASE_URL"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(other.Close)
	now := time.Now().UTC().Truncate(time.Microsecond)
	fp := store.Fingerprint("POST /charges sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef")
	acquire := func(key string) store.AcquireParams {
		return store.AcquireParams{Key: key, Fingerprint: fp, Token: "tok-" + key, Now: now, LeaseExpires: now.Add(time.Minute)}
	}
	if _, err := s.Acquire(bg, acquire("zz")); err != nil {
		t.Fatal(err)
	}
	business, err := other.Begin(bg)
	if err != nil {
		t.Fatal(err)
	}
	defer business.Rollback(bg)
	if err := s.FinishTx(bg, business, store.FinishParams{Key: "zz", Token: "tok-zz", Now: now, State: store.StateCompleted,
		Response: &store.Response{Status: 201}, Expires: now.Add(time.Hour)}); err != nil {
		t.Fatal(err)
	}

	release := holdRunner(t, s, other, schema)
	q := &testkit.Queue{T: t, Waiting: s.writes.Queued, Results: map[string]chan error{}}
	q.Add("renew zz", func() error { // the handler's lease renewal, meanwhile
		c, cancel := context.WithTimeout(bg, 5*time.Second)
		defer cancel()
		return s.Renew(c, store.RenewParams{Key: "zz", Token: "tok-zz", Now: now, LeaseExpires: now.Add(2 * time.Minute)})
	})
	q.Add("acquire aa", func() error { // another client's new request
		c, cancel := context.WithTimeout(bg, 3*time.Second)
		defer cancel()
		_, err := s.Acquire(c, acquire("aa"))
		return err
	})
	release()
	if err := wait.Recv(t, q.Results["acquire aa"], 10*time.Second, "acquire aa"); err != nil {
		t.Errorf("the acquire of an unrelated key batched with the waiting renewal: %v; want it done", err)
	}
	if err := wait.Recv(t, q.Results["renew zz"], 10*time.Second, "renew zz"); !errors.Is(err, store.ErrUnavailable) {
		t.Errorf("the renewal of the record the business transaction holds: %v; want ErrUnavailable (tried again by its caller)", err)
	}
	c, cancel := context.WithTimeout(bg, 3*time.Second)
	defer cancel()
	if _, err := s.Acquire(c, acquire("bb")); err != nil {
		t.Errorf("the acquire of a third key, after: %v", err)
	}
}

// TestMigratePauseStaysBounded: the pause between tries of a migration
// that waited for a lock grew by shifting and overflowed from the 37th try
// on (about 90 s into a long transaction): the migration then queued for
// its lock back to back, and the fleet's writes behind it.
func TestMigratePauseStaysBounded(t *testing.T) {
	for n := range 200 {
		if p := migratePause(n); p < 100*time.Millisecond || p > 2*time.Second {
			t.Fatalf("migratePause(%d) = %v; want between 100 ms and 2 s", n, p)
		}
	}
}
