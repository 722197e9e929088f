package sqlitestore_test

import (
	"context"
	"database/sql"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/wait"
	"github.com/idemhq/idem/store"
	"github.com/idemhq/idem/store/sqlitestore"
	"github.com/idemhq/idem/store/storetest"
)

var ctx = context.Background()

func open(t testing.TB, path string) *sqlitestore.Store {
	t.Helper()
	s, err := sqlitestore.Open(ctx, sqlitestore.Config{Path: path})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

func TestConformance(t *testing.T) {
	storetest.Run(t, func(t *testing.T) idem.Store {
		return open(t, filepath.Join(t.TempDir(), "idem.db"))
	})
}

// TestConformanceInstances runs the two-instance cases on two stores opened
// on one file, as two processes would open it: the file's lock, not a store's
// own mutex, must let exactly one racer win.
func TestConformanceInstances(t *testing.T) {
	storetest.RunInstances(t, func(t *testing.T) (idem.Store, idem.Store) {
		path := filepath.Join(t.TempDir(), "idem.db")
		return open(t, path), open(t, path)
	})
}

func engine(t *testing.T, s idem.Store, clock idem.Clock) *idem.Engine {
	t.Helper()
	e, err := idem.New(idem.Config{Store: s, Clock: clock})
	if err != nil {
		t.Fatal(err)
	}
	return e
}

var payload = idem.NewFingerprint(idem.Payload{Method: "POST", Path: "/charges", Body: []byte(`{"amount":100}`)})

// TestDurableAcrossRestart shows that a record written before the store is
// closed (as when the process restarts) is replayed after it is reopened,
// and that an in-progress one is still held.
func TestDurableAcrossRestart(t *testing.T) {
	path := filepath.Join(t.TempDir(), "idem.db")
	s := open(t, path)
	e := engine(t, s, nil)
	done, err := e.Begin(ctx, idem.BeginParams{Key: "done", Fingerprint: payload})
	if err != nil {
		t.Fatal(err)
	}
	if err := e.Complete(ctx, done.Lease, &idem.Response{Status: 201, Body: []byte("charged")}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.Begin(ctx, idem.BeginParams{Key: "running", Fingerprint: payload}); err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}

	e = engine(t, open(t, path), nil)
	out, err := e.Begin(ctx, idem.BeginParams{Key: "done", Fingerprint: payload})
	if err != nil || out.Decision != idem.Replay || string(out.Record.Response.Body) != "charged" {
		t.Fatalf("after reopen: %v %+v %v, want the replay", out.Decision, out.Record.Response, err)
	}
	if out, err := e.Begin(ctx, idem.BeginParams{Key: "running", Fingerprint: payload}); err != nil || out.Decision != idem.InFlight {
		t.Fatalf("after reopen: running key = %v, %v; want in flight", out.Decision, err)
	}
}

func TestFinishTx(t *testing.T) {
	s := open(t, filepath.Join(t.TempDir(), "idem.db"))
	e := engine(t, s, nil)
	if _, err := s.DB().ExecContext(ctx, `CREATE TABLE ledger (key TEXT PRIMARY KEY, amount INTEGER)`); err != nil {
		t.Fatal(err)
	}
	charge := func(key string, commit bool) error {
		out, err := e.Begin(ctx, idem.BeginParams{Key: key, Fingerprint: payload, TakeoverSafe: true})
		if err != nil || out.Decision != idem.Execute {
			t.Fatalf("Begin(%s) = %v, %v", key, out.Decision, err)
		}
		tx, err := s.DB().BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback()
		if _, err := tx.ExecContext(ctx, `INSERT INTO ledger VALUES (?, 100)`, key); err != nil {
			t.Fatal(err)
		}
		return e.Settle(ctx, out.Lease, idem.Settlement{State: idem.StateCompleted, Response: &idem.Response{Status: 201},
			Commit: func(ctx context.Context, p idem.FinishParams) error {
				if err := s.FinishTx(ctx, tx, p); err != nil {
					return err
				}
				if !commit {
					return nil // rolled back by the deferred Rollback
				}
				return tx.Commit()
			}})
	}
	ledger := func(key string) int {
		var n int
		if err := s.DB().QueryRowContext(ctx, `SELECT count(*) FROM ledger WHERE key = ?`, key).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}

	if err := charge("committed", true); err != nil {
		t.Fatal(err)
	}
	if r, _ := e.Get(ctx, "", "committed"); r.State != idem.StateCompleted || ledger("committed") != 1 {
		t.Fatalf("committed: record %v, ledger rows %d", r.State, ledger("committed"))
	}
	if err := charge("rolled-back", false); err != nil {
		t.Fatal(err)
	}
	if r, _ := e.Get(ctx, "", "rolled-back"); r.State != idem.StateInProgress || ledger("rolled-back") != 0 {
		t.Fatalf("rolled back: record %v, ledger rows %d; want in progress and no debit", r.State, ledger("rolled-back"))
	}
}

func TestPruneDeletesRows(t *testing.T) {
	s := open(t, filepath.Join(t.TempDir(), "idem.db"))
	clock := storetest.NewClock(time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC))
	e := engine(t, s, clock)
	for _, key := range []string{"a", "b", "c"} {
		out, err := e.Begin(ctx, idem.BeginParams{Key: key, Fingerprint: payload})
		if err != nil {
			t.Fatal(err)
		}
		if err := e.Complete(ctx, out.Lease, &idem.Response{Status: 200}); err != nil {
			t.Fatal(err)
		}
	}
	clock.Advance(idem.DefaultRetention)
	if n, err := s.Prune(ctx, store.PruneParams{Now: clock.Now(), Limit: 2}); err != nil || n != 2 {
		t.Fatalf("Prune with limit 2 = %d, %v", n, err)
	}
	if n, err := e.Prune(ctx, idem.PruneOptions{}); err != nil || n != 1 {
		t.Fatalf("Prune of the rest = %d, %v", n, err)
	}
	var rows int
	if err := s.DB().QueryRowContext(ctx, `SELECT count(*) FROM idem_records`).Scan(&rows); err != nil || rows != 0 {
		t.Fatalf("rows left = %d, %v", rows, err)
	}
}

func TestClosedStoreIsUnavailable(t *testing.T) {
	s := open(t, filepath.Join(t.TempDir(), "idem.db"))
	s.Close()
	_, err := engine(t, s, nil).Begin(ctx, idem.BeginParams{Key: "k", Fingerprint: payload})
	if !errors.Is(err, idem.ErrUnavailable) {
		t.Fatalf("Begin on a closed store: %v, want ErrUnavailable", err)
	}
}

func TestOpenNeedsPath(t *testing.T) {
	if _, err := sqlitestore.Open(ctx, sqlitestore.Config{}); !errors.Is(err, idem.ErrInvalid) {
		t.Fatalf("Open without a path: %v", err)
	}
}

// TestFinishTxNeedsItsTransaction: a transaction of another kind is refused.
func TestFinishTxNeedsItsTransaction(t *testing.T) {
	s, err := sqlitestore.Open(context.Background(), sqlitestore.Config{Path: filepath.Join(t.TempDir(), "idem.db")})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	now := time.Now()
	p := idem.FinishParams{Key: "k", Token: "tok", Now: now, State: idem.StateFailed, Expires: now.Add(time.Hour)}
	for _, tx := range []any{nil, "a transaction", (*sql.Tx)(nil)} {
		if err := s.FinishTx(context.Background(), tx, p); !errors.Is(err, idem.ErrInvalid) {
			t.Errorf("FinishTx with %T: %v, want ErrInvalid", tx, err)
		}
	}
}

// TestWriteLockHeldIsUnavailable: while another process holds the
// database's write lock (longer than the caller's deadline, shorter than
// the busy timeout), a write that cannot start in time is unavailable: its
// outcome is not known (it may still commit once the lock is free), so the
// engine keeps it and tries again, and the outcome a client was given is
// stored once the lock is free, not dropped.
func TestWriteLockHeldIsUnavailable(t *testing.T) {
	path := filepath.Join(t.TempDir(), "idem.db")
	s := open(t, path)
	e, err := idem.New(idem.Config{Store: s, StoreTimeout: 300 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	out, err := e.Begin(ctx, idem.BeginParams{Key: "k", Fingerprint: payload})
	if err != nil || out.Decision != idem.Execute {
		t.Fatal(out.Decision, err)
	}
	other, err := sql.Open("sqlite", path) // another process's connection
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	conn, err := other.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if _, err := conn.ExecContext(ctx, "BEGIN IMMEDIATE"); err != nil {
		t.Fatal(err)
	}
	short, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	defer cancel()
	_, err = s.Acquire(short, store.AcquireParams{Key: "other", Fingerprint: payload, Token: "tok", Now: time.Now(), LeaseExpires: time.Now().Add(time.Minute)})
	if !errors.Is(err, idem.ErrUnavailable) {
		t.Fatalf("Acquire while the write lock is held: %v, want ErrUnavailable", err)
	}
	if err := e.Complete(ctx, out.Lease, &idem.Response{Status: 201, Body: []byte("charged")}); err != nil {
		t.Fatalf("Complete while the write lock is held: %v, want the outcome kept", err)
	}
	if e.Pending() != 1 {
		t.Fatalf("%d outcomes wait in the journal, want the one Complete kept", e.Pending())
	}
	if _, err := conn.ExecContext(ctx, "ROLLBACK"); err != nil {
		t.Fatal(err)
	}
	wait.Until(t, 10*time.Second, "the kept outcome to be stored", func() bool {
		r, err := s.Get(ctx, store.GetParams{Key: "k", Now: time.Now()})
		return err == nil && r.State == idem.StateCompleted && string(r.Response.Body) == "charged"
	})
}

// TestNewDatabaseIsPrivate: a database the store creates, and its WAL, are
// readable by their owner alone: they hold the stored responses (it was
// created as the umask left it, world-readable).
func TestNewDatabaseIsPrivate(t *testing.T) {
	path := filepath.Join(t.TempDir(), "idem.db")
	s := open(t, path)
	t0 := time.Now()
	if _, err := s.Acquire(ctx, store.AcquireParams{Key: "k", Fingerprint: "fp", Token: "tok", Now: t0, LeaseExpires: t0.Add(time.Minute)}); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{path, path + "-wal"} {
		st, err := os.Stat(p)
		if err != nil {
			t.Fatal(err)
		}
		if st.Mode().Perm() != 0o600 {
			t.Errorf("%s has mode %v; want 0600", filepath.Base(p), st.Mode().Perm())
		}
	}
}

// TestUserVersionIsTheApplications: the store keeps its migrations in a
// table of its own, never in the file's user_version, which is one value
// for the whole file and the application's (its own tables may share the
// file: Store.DB). An application at user_version 1 or 5 before idem first
// opens the file, idem first then the application, and a file where a
// newer idem recorded a migration this one does not know: the store opens,
// and the user_version is as the application (or nobody) left it. (It
// skipped its first migrations when user_version was set, failing to open;
// set user_version to its own count, even when it then failed; and lowered
// a newer idem's.)
func TestUserVersionIsTheApplications(t *testing.T) {
	userVersion := func(t *testing.T, db *sql.DB) int {
		t.Helper()
		var v int
		if err := db.QueryRow(`PRAGMA user_version`).Scan(&v); err != nil {
			t.Fatal(err)
		}
		return v
	}
	for _, appVersion := range []int{0, 1, 5} {
		path := filepath.Join(t.TempDir(), "app.db")
		if appVersion > 0 {
			app, err := sql.Open("sqlite", path)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := app.Exec(`CREATE TABLE ledger (key TEXT PRIMARY KEY, amount INTEGER); PRAGMA user_version = ` + strconv.Itoa(appVersion)); err != nil {
				t.Fatal(err)
			}
			app.Close()
		}
		for range 2 { // opened again: nothing applied twice
			s, err := sqlitestore.Open(ctx, sqlitestore.Config{Path: path})
			if err != nil {
				t.Fatalf("opening the application's file at user_version %d: %v", appVersion, err)
			}
			if v := userVersion(t, s.DB()); v != appVersion {
				t.Errorf("user_version %d after idem opened the file, want the application's %d", v, appVersion)
			}
			mustAcquire(t, s, "k"+strconv.Itoa(appVersion))
			s.Close()
		}
	}
	// A newer idem's migration, unknown here: left alone.
	path := filepath.Join(t.TempDir(), "idem.db")
	s := open(t, path)
	if _, err := s.DB().Exec(`ALTER TABLE idem_records ADD COLUMN future BLOB; INSERT INTO idem_migrations (version, applied) VALUES (3, 'later')`); err != nil {
		t.Fatal(err)
	}
	s.Close()
	s = open(t, path)
	var n int
	if err := s.DB().QueryRow(`SELECT count(*) FROM idem_migrations WHERE version = 3`).Scan(&n); err != nil || n != 1 {
		t.Errorf("a newer idem's migration: %d recorded, %v", n, err)
	}
	mustAcquire(t, s, "k")
}

// TestReleasedFileIsUpgraded: a file that release 0.1.0 migrated, which
// counted its migrations in user_version, opens without applying them
// again, and the application's tables and records stay.
func TestReleasedFileIsUpgraded(t *testing.T) {
	path := filepath.Join(t.TempDir(), "idem.db")
	db, err := sql.Open("sqlite", path)
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"migrations/0001_records.sql", "migrations/0002_checkpoints.sql"} {
		ddl, err := os.ReadFile(name)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := db.Exec(string(ddl)); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := db.Exec(`PRAGMA user_version = 2`); err != nil {
		t.Fatal(err)
	}
	db.Close()
	s := open(t, path)
	mustAcquire(t, s, "k")
	var n int
	if err := s.DB().QueryRow(`SELECT count(*) FROM idem_migrations WHERE version IN (1, 2)`).Scan(&n); err != nil || n != 2 {
		t.Errorf("0.1.0's migrations recorded: %d, %v", n, err)
	}
}

func mustAcquire(t *testing.T, s *sqlitestore.Store, key string) {
	t.Helper()
	now := time.Now().UTC().Truncate(time.Millisecond)
	r, err := s.Acquire(ctx, store.AcquireParams{Scope: "s", Key: key, Fingerprint: "fp", Token: "tok-" + key, Now: now, LeaseExpires: now.Add(time.Minute)})
	if err != nil || r.Token != "tok-"+key {
		t.Fatalf("Acquire(%q) = %+v, %v", key, r, err)
	}
}

// TestInMemoryPathIsRefused: ":memory:" would give each connection of the
// pool a database of its own (the migrations on one, the statements on
// another): it is refused as invalid, naming what to use instead, rather
// than failing with "no such table".
func TestInMemoryPathIsRefused(t *testing.T) {
	_, err := sqlitestore.Open(ctx, sqlitestore.Config{Path: ":memory:"})
	if !errors.Is(err, idem.ErrInvalid) || !strings.Contains(err.Error(), "memstore") {
		t.Fatalf("Open(:memory:) = %v, want ErrInvalid naming memstore", err)
	}
}
