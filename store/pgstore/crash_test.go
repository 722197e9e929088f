package pgstore_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/testkit"
	"github.com/idemhq/idem/internal/wait"
	"github.com/idemhq/idem/store"
	"github.com/idemhq/idem/store/pgstore"
)

// privateServer starts a PostgreSQL server of the test's own, from the
// binaries in IDEM_TEST_PG_BINDIR, in a directory of its own, so that the
// test can crash it: crash stops it as a crash of the server does (pg_ctl
// stop -m immediate: no shutdown checkpoint, and crash recovery when it
// starts again) and starts it again on the same port. The server is stopped
// and its directory removed when the test ends.
func privateServer(t *testing.T) (dsn string, crash func()) {
	t.Helper()
	bindir := testkit.Server(t, "IDEM_TEST_PG_BINDIR")
	dir, err := os.MkdirTemp("", "idem-pg-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	var cred *syscall.Credential
	if os.Geteuid() == 0 { // PostgreSQL refuses to run as root: run it as postgres
		u, err := user.Lookup("postgres")
		if err != nil {
			t.Fatalf("running as root, and no postgres user to run PostgreSQL as: %v", err)
		}
		uid, _ := strconv.Atoi(u.Uid)
		gid, _ := strconv.Atoi(u.Gid)
		if err := os.Chown(dir, uid, gid); err != nil {
			t.Fatal(err)
		}
		cred = &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}
	}
	run := func(name string, args ...string) {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		cmd := exec.CommandContext(ctx, filepath.Join(bindir, name), args...)
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: cred}
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("%s %v: %v\n%s", name, args, err, out)
		}
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	l.Close()

	data := filepath.Join(dir, "data")
	run("initdb", "-D", data, "-A", "trust", "-U", "postgres", "-E", "UTF8", "--no-sync")
	start := func() {
		t.Helper()
		run("pg_ctl", "-D", data, "-l", filepath.Join(dir, "log"), "-w", "-t", "60", "-o",
			fmt.Sprintf("-p %d -k %s -c listen_addresses=127.0.0.1 -c fsync=off", port, dir), "start")
	}
	stop := func() {
		t.Helper()
		run("pg_ctl", "-D", data, "-m", "immediate", "-w", "-t", "60", "stop")
	}
	start()
	t.Cleanup(stop)
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", port), func() {
		t.Helper()
		stop()
		start()
	}
}

// TestRecordsDueAfterACrash crashes PostgreSQL, whose crash recovery empties
// the unlogged records_due, and checks that the same store, on the same
// pool, still finds what the reconciler and the pruner need: the records
// running before the crash, and those that have expired.
func TestRecordsDueAfterACrash(t *testing.T) {
	t.Parallel()
	dsn, crash := privateServer(t)
	pool, err := pgxpool.New(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	s, err := pgstore.New(ctx, pgstore.Config{Pool: pool})
	if err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		mustAcquire(t, s, acquireParams(fmt.Sprintf("running-%d", i), "tok", t0))
		done := fmt.Sprintf("done-%d", i)
		mustAcquire(t, s, acquireParams(done, "tok", t0))
		if err := s.Finish(ctx, completeParams(done, "tok", t0)); err != nil {
			t.Fatal(err)
		}
	}
	stale := store.ScanParams{Now: t0.Add(time.Minute)}
	if res, err := s.Scan(ctx, stale); err != nil || len(res.Records) != 3 {
		t.Fatalf("Scan before the crash = %+v, %v; want the 3 running records", res, err)
	}
	dueRows := func() int {
		var n int
		if err := pool.QueryRow(ctx, "SELECT count(*) FROM idem.records_due").Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	if n := dueRows(); n != 7 {
		t.Fatalf("records_due holds %d rows before the crash, want the 6 records and the mark", n)
	}

	crash()
	// The pool's connections died with the server: the first calls may fail.
	wait.Until(t, 30*time.Second, "the store to answer again after the restart", func() bool {
		_, err := s.Get(ctx, store.GetParams{Scope: "s", Key: "running-0", Now: t0})
		return err == nil
	})
	if n := dueRows(); n != 0 {
		t.Fatalf("records_due holds %d rows after the crash; crash recovery should have emptied it", n)
	}
	res, err := s.Scan(ctx, stale)
	if err != nil || len(res.Records) != 3 {
		t.Fatalf("Scan after the crash = %+v, %v; want the 3 running records", res, err)
	}
	if n, err := s.Prune(ctx, store.PruneParams{Now: t0.Add(time.Hour)}); err != nil || n != 3 {
		t.Fatalf("Prune after the crash = %d, %v; want the 3 expired records", n, err)
	}
	for i := range 3 {
		r, err := s.Get(ctx, store.GetParams{Scope: "s", Key: fmt.Sprintf("running-%d", i), Now: t0.Add(time.Hour)})
		if err != nil || r.State != idem.StateInProgress {
			t.Fatalf("running-%d after the prune: %+v, %v", i, r, err)
		}
	}
}

// TestDamagedPageIsRefused: a read of a damaged page (SQLSTATE XX001,
// data_corrupted) is a refusal, as store.ErrRefused says (the store was
// reached and holds the record), so it wraps ErrRefused and ErrUnavailable
// and the engine keeps a completed outcome to try again. It was a plain
// error, and the outcome the client saw was dropped.
func TestDamagedPageIsRefused(t *testing.T) {
	t.Parallel()
	dsn, crash := privateServer(t)
	pool, err := pgxpool.New(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	s, err := pgstore.New(ctx, pgstore.Config{Pool: pool})
	if err != nil {
		t.Fatal(err)
	}
	mustAcquire(t, s, acquireParams("k", "tok", t0))
	var path string
	if err := pool.QueryRow(ctx, `SELECT current_setting('data_directory') || '/' || pg_relation_filepath('idem.records')`).Scan(&path); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, "CHECKPOINT"); err != nil { // the page is in the file
		t.Fatal(err)
	}
	f, err := os.OpenFile(path, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	garbage := make([]byte, 24) // the page header of block 0
	for i := range garbage {
		garbage[i] = 0xff
	}
	if _, err := f.WriteAt(garbage, 0); err != nil {
		t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	crash() // drops shared buffers: the next read of block 0 comes from the file
	wait.Until(t, 30*time.Second, "the server to answer again", func() bool {
		_, err := pool.Exec(ctx, "SELECT 1")
		return err == nil
	})
	err = s.Finish(ctx, completeParams("k", "tok", t0.Add(time.Second)))
	if err == nil {
		t.Fatal("Finish on a damaged page succeeded")
	}
	if !errors.Is(err, store.ErrRefused) || !errors.Is(err, store.ErrUnavailable) {
		t.Fatalf("Finish on a damaged page = %v; want ErrRefused and ErrUnavailable", err)
	}
}
