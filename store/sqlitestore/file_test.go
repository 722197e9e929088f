package sqlitestore_test

import (
	"database/sql"
	"errors"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/httpidem"
	"github.com/idemhq/idem/internal/testkit"
	"github.com/idemhq/idem/store"
	"github.com/idemhq/idem/store/sqlitestore"
)

// complete stores key as completed.
func complete(t *testing.T, s *sqlitestore.Store, key string) {
	t.Helper()
	t0 := time.Now()
	testkit.Finish(t, s, testkit.Acquire(t, s, "", key, t0, time.Minute), t0, store.StateCompleted, time.Hour)
}

// openFiles counts the descriptors this process holds on files in dir.
func openFiles(t *testing.T, dir string) int {
	t.Helper()
	if runtime.GOOS != "linux" {
		t.Skip("counts descriptors in /proc/self/fd")
	}
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, e := range ents {
		if l, err := os.Readlink(filepath.Join("/proc/self/fd", e.Name())); err == nil && filepath.Dir(l) == dir {
			n++
		}
	}
	return n
}

// TestClosedFileHoldsTheRecords: Close releases the file (every descriptor,
// so the WAL is checkpointed into the database and removed), and the
// database file alone, as an operator copies it once the proxy stopped,
// holds the records. Close left the statements open, so database/sql kept
// their connections, the descriptors and the WAL, which held the outcomes:
// a copy of idem.db had none.
func TestClosedFileHoldsTheRecords(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "idem.db")
	s, err := sqlitestore.Open(ctx, sqlitestore.Config{Path: path})
	if err != nil {
		t.Fatal(err)
	}
	complete(t, s, "k")
	if _, err := s.Get(ctx, store.GetParams{Key: "k", Now: time.Now()}); err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if n := openFiles(t, dir); n != 0 {
		t.Errorf("after Close, %d descriptors are still open on the database's files", n)
	}
	if _, err := os.Stat(path + "-wal"); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("after Close, the WAL is still there (%v)", err)
	}
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	cp := filepath.Join(t.TempDir(), "copy.db")
	if err := os.WriteFile(cp, data, 0o600); err != nil {
		t.Fatal(err)
	}
	r, err := open(t, cp).Get(ctx, store.GetParams{Key: "k", Now: time.Now()})
	if err != nil || r.State != store.StateCompleted {
		t.Fatalf("a copy of the closed database file: %v, %v; want the completed record", r.State, err)
	}
}

// TestFailedOpenClosesWhatItOpened: an Open that fails while preparing its
// statements (here, a table of another shape) closes the statements it
// prepared and its connections, and its error names the file. (Which
// statement is prepared first varies, and one that succeeds before the
// first that fails kept its connection open: it tries many times.)
func TestFailedOpenClosesWhatItOpened(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "idem.db")
	db, err := sql.Open("sqlite", path)
	if err != nil {
		t.Fatal(err)
	}
	// Migrations 1 and 2 recorded as applied, on a table with no
	// checkpoints column: the statements that read it fail, the others not.
	for _, q := range []string{
		`CREATE TABLE idem_migrations (version INTEGER PRIMARY KEY, applied TEXT NOT NULL)`,
		`INSERT INTO idem_migrations VALUES (1, ''), (2, '')`,
		`CREATE TABLE idem_records (scope TEXT, key TEXT, state TEXT, fingerprint TEXT, token TEXT, fence INTEGER,
			lease_expires INTEGER, takeover_safe INTEGER, response BLOB, created INTEGER, updated INTEGER, expires INTEGER,
			PRIMARY KEY (scope, key))`,
	} {
		if _, err := db.Exec(q); err != nil {
			t.Fatal(err)
		}
	}
	db.Close()
	for i := range 50 {
		s, err := sqlitestore.Open(ctx, sqlitestore.Config{Path: path})
		if err == nil {
			s.Close()
			t.Fatal("Open of a table without its checkpoints column succeeded")
		}
		if i == 0 && !strings.Contains(err.Error(), path) {
			t.Errorf("Open's error does not name the file: %v", err)
		}
	}
	if n := openFiles(t, dir); n != 0 {
		t.Errorf("after the failed Opens, %d descriptors are still open on the database's files", n)
	}
}

// TestDamagedPageIsRefused: a record on a damaged page (a torn write, a
// bad sector) or a file that is not a database is refused (ErrRefused, with
// ErrUnavailable): the store answered, and may hold the record, so a
// fail-open middleware must not run the request again (it did: the damage
// was only "unavailable"), and an outcome the store cannot take now waits in
// the journal for the file to be repaired (for a while it was a plain error,
// and the outcome of a request that had run was dropped).
func TestDamagedPageIsRefused(t *testing.T) {
	path := filepath.Join(t.TempDir(), "idem.db")
	s, err := sqlitestore.Open(ctx, sqlitestore.Config{Path: path})
	if err != nil {
		t.Fatal(err)
	}
	complete(t, s, "k")
	t0 := time.Now()
	running, err := s.Acquire(ctx, store.AcquireParams{Key: "running", Fingerprint: payload, Token: "tok", Now: t0, LeaseExpires: t0.Add(time.Minute)})
	if err != nil {
		t.Fatal(err)
	}
	var root, pageSize int64
	if err := s.DB().QueryRow(`SELECT rootpage FROM sqlite_schema WHERE name = 'idem_records'`).Scan(&root); err != nil {
		t.Fatal(err)
	}
	if err := s.DB().QueryRow(`PRAGMA page_size`).Scan(&pageSize); err != nil {
		t.Fatal(err)
	}
	if _, err := s.DB().Exec(`PRAGMA wal_checkpoint(TRUNCATE)`); err != nil { // the records into the file
		t.Fatal(err)
	}
	s.Close()
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt(make([]byte, pageSize), (root-1)*pageSize); err != nil { // the records' page, zeroed
		t.Fatal(err)
	}
	f.Close()

	s = open(t, path)
	e, err := idem.New(idem.Config{Store: s, JournalDir: t.TempDir(), StoreTimeout: 300 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	_, err = e.Begin(ctx, idem.BeginParams{Key: "k", Fingerprint: "fp"})
	if !errors.Is(err, idem.ErrRefused) || !errors.Is(err, idem.ErrUnavailable) {
		t.Errorf("Begin of a record on a damaged page: %v; want ErrRefused and ErrUnavailable", err)
	}
	lease := idem.Lease{Key: "running", Token: "tok", Fence: running.Fence, Fingerprint: payload, Expires: running.LeaseExpires,
		Duration: time.Minute, Retention: time.Hour}
	if err := e.Complete(ctx, lease, &idem.Response{Status: 201, Body: []byte(`{"id":"ch_1"}`)}); err != nil {
		t.Errorf("Complete on a damaged page: %v; want the outcome kept in the journal", err)
	}
	if out, err := e.Begin(ctx, idem.BeginParams{Key: "running", Fingerprint: payload}); err != nil ||
		out.Decision != idem.Replay || string(out.Record.Response.Body) != `{"id":"ch_1"}` {
		t.Errorf("a retry of the completed request: %v, %v; want the outcome replayed from the journal", out.Decision, err)
	}

	notADB := filepath.Join(t.TempDir(), "notes.txt")
	if err := os.WriteFile(notADB, []byte(strings.Repeat("not a database\n", 512)), 0o600); err != nil {
		t.Fatal(err)
	}
	_, err = sqlitestore.Open(ctx, sqlitestore.Config{Path: notADB})
	if !errors.Is(err, idem.ErrRefused) || !strings.Contains(err.Error(), notADB) {
		t.Errorf("Open of a file that is not a database: %v; want ErrRefused, naming the file", err)
	}
}

// TestAbandonedRecordLockedIsRefused: a record whose lease ran out (the
// first attempt may have charged) must become UNKNOWN; while another
// connection holds SQLite's write lock (idem keys purge, a business
// transaction), the acquire reads the record and cannot write it: refused,
// so a fail-open middleware does not run the request again (it did: a
// second charge).
func TestAbandonedRecordLockedIsRefused(t *testing.T) {
	path := filepath.Join(t.TempDir(), "idem.db")
	s, err := sqlitestore.Open(ctx, sqlitestore.Config{Path: path, BusyTimeout: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	t0 := time.Now()
	if _, err := s.Acquire(ctx, store.AcquireParams{Key: "k", Fingerprint: payload, Token: "crashed",
		Now: t0.Add(-2 * time.Minute), LeaseExpires: t0.Add(-time.Minute)}); err != nil {
		t.Fatal(err)
	}
	e, err := idem.New(idem.Config{Store: s, StoreTimeout: 300 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	mw, err := httpidem.New(httpidem.Config{Engine: e, FailOpen: true})
	if err != nil {
		t.Fatal(err)
	}
	var runs atomic.Int64
	h := mw.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		w.WriteHeader(http.StatusCreated)
	}))
	db, err := sql.Open("sqlite", "file:"+path+"?_pragma=busy_timeout(10)")
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	conn, err := db.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if _, err := conn.ExecContext(ctx, "BEGIN IMMEDIATE"); err != nil {
		t.Fatal(err)
	}
	w := httptest.NewRecorder()
	r := httptest.NewRequest("POST", "/charges", strings.NewReader(`{"amount":100}`))
	r.Header.Set("Idempotency-Key", "k")
	h.ServeHTTP(w, r)
	if w.Code != http.StatusServiceUnavailable || runs.Load() != 0 {
		t.Fatalf("a retry of the abandoned request while the write lock is held: %d after %d runs; want 503, no run", w.Code, runs.Load())
	}
	if _, err := conn.ExecContext(ctx, "ROLLBACK"); err != nil {
		t.Fatal(err)
	}
	w = httptest.NewRecorder()
	r = httptest.NewRequest("POST", "/charges", strings.NewReader(`{"amount":100}`))
	r.Header.Set("Idempotency-Key", "k")
	h.ServeHTTP(w, r)
	if w.Code != http.StatusConflict || runs.Load() != 0 {
		t.Fatalf("a retry once the lock is free: %d after %d runs; want 409 (unknown), no run", w.Code, runs.Load())
	}
}

// TestRefusedAccessIsDenied: a database the store may not write (here, a
// connection set query_only, as a read-only file or mount leaves it) or a
// file it may not create is denied as well as unavailable: the file may
// hold the record, so a fail-open middleware must not run the request.
func TestRefusedAccessIsDenied(t *testing.T) {
	s := open(t, filepath.Join(t.TempDir(), "idem.db"))
	t0 := time.Now()
	if _, err := s.Acquire(ctx, store.AcquireParams{Key: "k", Fingerprint: "fp", Token: "tok", Now: t0, LeaseExpires: t0.Add(time.Minute)}); err != nil {
		t.Fatal(err)
	}
	conn, err := s.DB().Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	tx, err := conn.BeginTx(ctx, &sql.TxOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer conn.ExecContext(ctx, `PRAGMA query_only = OFF`)
	if _, err := tx.ExecContext(ctx, `PRAGMA query_only = ON`); err != nil {
		t.Fatal(err)
	}
	err = s.FinishTx(ctx, tx, store.FinishParams{Key: "k", Token: "tok", Now: t0, State: store.StateCompleted,
		Response: &store.Response{Status: 201}, Expires: t0.Add(time.Hour)})
	tx.Rollback()
	if !errors.Is(err, idem.ErrDenied) || !errors.Is(err, idem.ErrUnavailable) {
		t.Errorf("a write to a read-only database: %v; want ErrDenied and ErrUnavailable", err)
	}

	// A file in a directory the process may not write.
	dir := t.TempDir()
	path := filepath.Join(dir, "idem.db")
	if os.Geteuid() == 0 {
		path = "/sys/idem.db" // sysfs: no file is created there, by root either
	} else if err := os.Chmod(dir, 0o500); err != nil {
		t.Fatal(err)
	} else {
		defer os.Chmod(dir, 0o700)
	}
	if f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600); err == nil {
		f.Close()
		t.Skipf("%s can be created here", path)
	} else if !errors.Is(err, os.ErrPermission) {
		t.Skipf("%s cannot be created, but not for lack of permissions: %v", path, err)
	}
	_, err = sqlitestore.Open(ctx, sqlitestore.Config{Path: path})
	if !errors.Is(err, idem.ErrDenied) || !errors.Is(err, idem.ErrUnavailable) || !strings.Contains(err.Error(), path) {
		t.Errorf("Open of a file that may not be created: %v; want ErrDenied and ErrUnavailable, naming the file", err)
	}
}

// TestPathWithLeadingSlashes: a path starting with // is the file it names
// on the file system, not a URI authority ("invalid uri authority").
func TestPathWithLeadingSlashes(t *testing.T) {
	path := filepath.Join(t.TempDir(), "idem.db")
	s, err := sqlitestore.Open(ctx, sqlitestore.Config{Path: "/" + path})
	if err != nil {
		t.Fatal(err)
	}
	complete(t, s, "k")
	s.Close()
	if r, err := open(t, path).Get(ctx, store.GetParams{Key: "k", Now: time.Now()}); err != nil || r.State != store.StateCompleted {
		t.Fatalf("the file at %s: %v, %v; want the record written through /%s", path, r.State, err, path)
	}
}
