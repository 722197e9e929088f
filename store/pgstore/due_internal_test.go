package pgstore

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemhq/idem/internal/testkit"
	"github.com/idemhq/idem/internal/wait"
	"github.com/idemhq/idem/store"
)

// TestFinishTxNeedsNoOtherConnection: FinishTx is one statement in the
// caller's transaction, also as the first write of a store New did not
// migrate (a reconciler process: Scan, then Settle with Commit), on a pool
// of one connection that the transaction holds. (It read the table's layout
// on another connection of the pool, and waited for one until its
// deadline.)
func TestFinishTxNeedsNoOtherConnection(t *testing.T) {
	bg := context.Background()
	first, _, schema := newStore(t, 4)
	now := time.Now().UTC().Truncate(time.Microsecond)
	fp := store.Fingerprint("fp")
	if _, err := first.Acquire(bg, store.AcquireParams{Key: "k", Fingerprint: fp, Token: "tok", Now: now, LeaseExpires: now.Add(time.Minute)}); err != nil {
		t.Fatal(err)
	}
	cfg, err := pgxpool.ParseConfig(testkit.Server(t, "IDEM_TEST_DATABASE_URL"))
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 1
	pool, err := pgxpool.NewWithConfig(bg, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	s, err := New(bg, Config{Pool: pool, Schema: schema, NoMigrate: true})
	if err != nil {
		t.Fatal(err)
	}
	tx, err := pool.Begin(bg)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(bg)
	ctx, cancel := context.WithTimeout(bg, 5*time.Second)
	defer cancel()
	if err := s.FinishTx(ctx, tx, store.FinishParams{Key: "k", Token: "tok", Now: now, State: store.StateCompleted,
		Response: &store.Response{Status: 201}, Expires: now.Add(time.Hour)}); err != nil {
		t.Fatalf("FinishTx on a pool of one, its transaction holding it: %v", err)
	}
	if err := tx.Commit(bg); err != nil {
		t.Fatal(err)
	}
	if r, err := s.Get(bg, store.GetParams{Key: "k", Now: now}); err != nil || r.State != store.StateCompleted || r.Fingerprint != fp {
		t.Fatalf("after the commit: %+v, %v", r, err)
	}
}

// TestRebuildLetsOtherWritesThrough: records_due is rebuilt (after a
// crash, or the migration that made it) while a business transaction that
// settled one record stays open. Writes of other records go through
// meanwhile, and the rebuild finishes once the transaction ends. (The
// rebuild waited on that transaction's row for as long as it stayed open,
// holding the rows it had copied before it: completes of those records
// waited with it, and failed at their deadlines.)
func TestRebuildLetsOtherWritesThrough(t *testing.T) {
	bg := context.Background()
	s, pool, schema := newStore(t, 6)
	records, due := pgx.Identifier{schema, "records"}.Sanitize(), pgx.Identifier{schema, "records_due"}.Sanitize()
	now := time.Now().UTC().Truncate(time.Microsecond)
	if _, err := pool.Exec(bg, `INSERT INTO `+records+` (scope, key, state, fingerprint, token, fence, lease_expires, takeover_safe, created, updated)
		SELECT '', 'k' || lpad(i::text, 4, '0'), 'in_progress', 'fp', 'tok' || i, 1, $1, false, $2, $2 FROM generate_series(1, 100) AS i`,
		now.Add(time.Hour), now); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(bg, "TRUNCATE "+due); err != nil { // as after a crash
		t.Fatal(err)
	}
	settle := func(key, token string) store.FinishParams {
		return store.FinishParams{Key: key, Token: token, Now: now, State: store.StateCompleted,
			Response: &store.Response{Status: 201}, Expires: now.Add(time.Hour)}
	}
	business, err := pool.Begin(bg)
	if err != nil {
		t.Fatal(err)
	}
	defer business.Rollback(bg)
	if err := s.FinishTx(bg, business, settle("k0050", "tok50")); err != nil {
		t.Fatal(err)
	}
	scan := func(d time.Duration) error {
		ctx, cancel := context.WithTimeout(bg, d)
		defer cancel()
		_, err := s.Scan(ctx, store.ScanParams{Now: now})
		return err
	}
	if err := scan(500 * time.Millisecond); !errors.Is(err, store.ErrUnavailable) {
		t.Fatalf("a scan while records_due cannot be rebuilt: %v, want unavailable", err)
	}
	// The rebuild reached the open transaction's row.
	wait.Until(t, 10*time.Second, "the rebuild to wait on the open transaction", func() bool {
		var n int
		err := pool.QueryRow(bg, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()
			AND wait_event_type = 'Lock' AND query LIKE '%records_due%'`).Scan(&n)
		return err == nil && n > 0
	})
	ctx, cancel := context.WithTimeout(bg, 5*time.Second)
	defer cancel()
	if err := s.Finish(ctx, settle("k0010", "tok10")); err != nil {
		t.Fatalf("a complete of another record during the rebuild: %v", err)
	}
	if err := business.Commit(bg); err != nil {
		t.Fatal(err)
	}
	wait.Until(t, 30*time.Second, "a scan once the transaction has ended", func() bool { return scan(time.Second) == nil })
	var whole bool
	var unsettled int
	if err := pool.QueryRow(bg, `SELECT EXISTS (SELECT FROM `+due+` WHERE scope = '' AND key = ''),
		(SELECT count(*) FROM `+due+` WHERE expires IS NULL AND key <> '')`).Scan(&whole, &unsettled); err != nil || !whole || unsettled != 98 {
		t.Fatalf("records_due after the rebuild: whole %v, %d unsettled rows (want 98), %v", whole, unsettled, err)
	}
}

// TestRebuildElsewhereHoldsNoConnection: while another process rebuilds
// records_due, this store's scans are unavailable and hold none of its
// pool's connections, so that closing the pool at exit does not wait for
// the other process. (A rebuild of its own waited for the other's lock on
// a connection of the pool, and Close waited for it.)
func TestRebuildElsewhereHoldsNoConnection(t *testing.T) {
	bg := context.Background()
	_, other, schema := newStore(t, 4)
	cfg, err := pgxpool.ParseConfig(testkit.Server(t, "IDEM_TEST_DATABASE_URL"))
	if err != nil {
		t.Fatal(err)
	}
	pool, err := pgxpool.NewWithConfig(bg, cfg)
	if err != nil {
		t.Fatal(err)
	}
	s, err := New(bg, Config{Pool: pool, Schema: schema, NoMigrate: true})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := other.Exec(bg, "TRUNCATE "+pgx.Identifier{schema, "records_due"}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	hold, err := other.Acquire(bg)
	if err != nil {
		t.Fatal(err)
	}
	defer hold.Release()
	if _, err := hold.Exec(bg, "SELECT pg_advisory_lock($1)", lockKey("records_due", schema)); err != nil {
		t.Fatal(err)
	}
	defer hold.Exec(bg, "SELECT pg_advisory_unlock($1)", lockKey("records_due", schema))
	ctx, cancel := context.WithTimeout(bg, time.Second)
	defer cancel()
	if _, err := s.Scan(ctx, store.ScanParams{Now: time.Now()}); !errors.Is(err, store.ErrUnavailable) {
		t.Fatalf("a scan while another process rebuilds records_due: %v, want unavailable", err)
	}
	wait.Done(t, 5*time.Second, "the pool to close", pool.Close)
}
