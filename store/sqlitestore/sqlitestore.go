// Package sqlitestore is an [store.Store] in a SQLite file: idem's embedded
// default. It needs no server and no set-up, it is pure Go (modernc.org/sqlite,
// no cgo), and it is durable: a record written is on disk when the call
// returns (WAL journal, synchronous=FULL), so it survives a crash or restart of
// the process and of the machine.
//
// It is for one instance (one process, or several processes on one machine
// sharing the file). Instances on several machines need a networked store.
//
// # Costs
//
// Nothing crosses a network. A new key is one INSERT and the owner's finish
// one UPDATE; a replay is one read and no write. Every statement is prepared
// once. Writes are group-committed: SQLite allows one writer at a time, so
// the writes that arrive while a transaction commits wait, and the next
// transaction runs them all, in the order they came, with one fsync of the
// WAL for all of them. A lone write costs what it would alone; under
// concurrency the fsync, which is most of a write's cost, is shared.
// Writers in other processes wait on the busy timeout.
//
// Measured with go test -run '^$' -bench . -benchtime 3000x -count 3
// (medians) on a 2-vCPU VM, one caller at a time, next to the bare
// statements, prepared once, on a table of the same shape:
//
//	benchmark                                        ns/op   ops/s
//	AcquireComplete  acquire a new key, complete   353 294   2 831
//	RawInsertUpdate  INSERT, then UPDATE by key    294 351   3 397   idem/raw 1.20
//	Replay           acquire of a completed key     12 708  78 691
//	RawSelect        SELECT by key                   4 938 202 511   idem/raw 2.57
//
// A new key costs its two fsyncs and the read that looks for a record
// first; a replay reads one whole row and decodes the stored response (the
// engine's cache answers the replays after the first without the store).
// With 16 concurrent callers (go run ./bench, BENCHMARKS.md) the shared
// fsyncs make the middleware on this store faster than the raw statements
// each committed on their own.
//
// # Atomicity
//
// Each write is a function of the row it reads in a BEGIN IMMEDIATE
// transaction, which holds SQLite's write lock: a new key is created by
// INSERT … ON CONFLICT DO NOTHING, which creates the record or, when a row
// appeared since the read, nothing (then decided from that row); the
// owner's finish is an UPDATE whose WHERE is [store.FinishParams.Apply]'s
// condition (the token holds the record, running or unknown); anything else
// (an expired record, a takeover, a repeat of a finish, a renewal, a
// checkpoint) reads the row, applies the root package's transition
// ([store.AcquireParams.Apply], ...) and writes it back. The writes that
// share a transaction run one after another, each on what the ones before
// it left, as they would alone. One that fails is reported failed and the
// transaction is rolled back and run again without it, so what commits is
// exactly the writes reported done; a write whose caller gave up before it
// ran is never run. An acquire that needs no write (a replay, a lease still
// running) is answered from a plain read first, without the lock.
//
// # Transactional completion
//
// [Store.DB] is the store's database, so an application can keep its own
// tables in the same file and complete a record in the same transaction as
// its business writes with [Store.FinishTx]. The store's tables are named
// idem_*; the file's user_version is left to the application (the store
// records its migrations in idem_migrations).
package sqlitestore

import (
	"context"
	"database/sql"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"net/url"
	"os"
	"path"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/idemhq/idem/store"
	"modernc.org/sqlite"
	sqlite3 "modernc.org/sqlite/lib"
)

var (
	_ store.Store      = (*Store)(nil)
	_ store.TxFinisher = (*Store)(nil)
)

// DefaultBusyTimeout is how long a writer waits for another process's write
// lock when [Config.BusyTimeout] is zero.
const DefaultBusyTimeout = 10 * time.Second

// Config configures [Open].
type Config struct {
	// Path is the database file, created if missing (readable by its owner
	// alone: it holds the stored responses). Required.
	Path string
	// BusyTimeout is how long a write waits for another process holding the
	// write lock before failing with [store.ErrUnavailable]. Defaults to
	// [DefaultBusyTimeout].
	BusyTimeout time.Duration
}

// Store keeps records in a SQLite database. Close it when done.
//
// Its errors wrap [store.ErrUnavailable] when the database stays locked by
// another process, cannot be opened, read or written (an I/O error, a full
// disk, a damaged page, a file that is no database), the store is closed,
// or a call is not done by its deadline: the engine keeps an outcome and
// tries again. Those wrap [store.ErrDenied] too when the file or its
// directory refuses access (permissions, a read-only mount), and
// [store.ErrRefused] when the file is damaged or full, or an acquire read
// the record and could not write what it decided: the file may hold the
// record, so neither is ever a reason to fail open.
type Store struct {
	db     *sql.DB
	path   string      // the database file, as configured
	owner  string      // names this store in its scan cursors
	closed atomic.Bool // Close was called: every call is unavailable
	// writes group-commits the writes of this process, one transaction at
	// a time (SQLite has one writer), on conn.
	writes store.Batcher[func(context.Context, *txn) error]
	// conn is the connection writes run on, with the statements prepared on
	// it (onConn: the pool's statement to conn's) and the transaction's own.
	conn                                *sql.Conn
	onConn                              map[*sql.Stmt]*sql.Stmt
	beginStmt, commitStmt, rollbackStmt *sql.Stmt
	// The statements of every call, prepared once (on each connection of
	// the pool, by database/sql).
	getStmt, insertStmt, createStmt, updateStmt, settleStmt *sql.Stmt
}

// The statements the store prepares.
const (
	getSQL    = `SELECT ` + columns + ` FROM idem_records WHERE scope = ? AND key = ?`
	insertSQL = `INSERT INTO idem_records (state, fingerprint, token, fence, lease_expires, takeover_safe,
		response, created, updated, expires, checkpoints, scope, key) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)`
	// createSQL is insertSQL for a key that has no row: a new record in one
	// statement, or nothing when a row appeared meanwhile.
	createSQL = insertSQL + ` ON CONFLICT (scope, key) DO NOTHING`
	updateSQL = `UPDATE idem_records SET state = ?, fingerprint = ?, token = ?, fence = ?, lease_expires = ?,
		takeover_safe = ?, response = ?, created = ?, updated = ?, expires = ?, checkpoints = ? WHERE scope = ? AND key = ?`
	// settleSQL is the owner's Finish in one statement:
	// [store.FinishParams.Apply] on a record its token holds, running or
	// unknown. It changes nothing otherwise, and Finish decides in Go.
	settleSQL = `UPDATE idem_records SET state = ?, response = ?, expires = ?, updated = ?
		WHERE scope = ? AND key = ? AND token = ? AND state IN ('in_progress', 'unknown')`
)

//go:embed migrations/*.sql
var migrations embed.FS

// Open opens (creating if needed) the database at cfg.Path and applies the
// embedded migrations. Its errors name the file, and wrap the root's
// sentinels as [Store]'s calls do.
func Open(ctx context.Context, cfg Config) (*Store, error) {
	if cfg.Path == "" {
		return nil, fmt.Errorf("%w: sqlitestore: no path", store.ErrInvalid)
	}
	if strings.HasPrefix(cfg.Path, ":memory:") {
		// Each connection of the pool would open a database of its own.
		return nil, fmt.Errorf("%w: sqlitestore: %s is not a file (for records in memory, use memstore, DSN memory:)", store.ErrInvalid, cfg.Path)
	}
	busy := cfg.BusyTimeout
	if busy == 0 {
		busy = DefaultBusyTimeout
	}
	q := url.Values{}
	q.Set("_txlock", "immediate")
	q.Set("_busy_timeout", strconv.FormatInt(busy.Milliseconds(), 10))
	q.Set("_journal_mode", "WAL")
	q.Set("_synchronous", "FULL")
	// A new database is readable by its owner alone: it holds the stored
	// responses. (SQLite gives its -wal and -shm files the database's mode.)
	// A path that cannot be created is left for SQLite to report.
	if f, err := os.OpenFile(cfg.Path, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600); err == nil {
		f.Close()
	}
	// An absolute path goes after an empty authority (file:///data/idem.db),
	// so that one starting with // is not read as file://authority/path.
	file := (&url.URL{Path: cfg.Path}).EscapedPath()
	if strings.HasPrefix(file, "/") {
		file = "//" + file
	}
	db, err := sql.Open("sqlite", "file:"+file+"?"+q.Encode())
	if err != nil {
		return nil, fmt.Errorf("sqlitestore: open %s: %w", cfg.Path, err)
	}
	s := &Store{db: db, path: cfg.Path, owner: "sqlitestore:" + cfg.Path}
	s.writes.Run = s.commit
	if err := s.migrate(ctx); err != nil {
		db.Close()
		return nil, s.translate("open "+cfg.Path+": migrate", err)
	}
	if err := s.prepare(ctx); err != nil {
		err = s.translate("open "+cfg.Path+": prepare", err)
		s.Close() // the statements prepared and the connections opened so far
		return nil, err
	}
	return s, nil
}

// prepare prepares the statements of every call on the pool and on the
// write connection, which it opens.
func (s *Store) prepare(ctx context.Context) (err error) {
	if s.conn, err = s.db.Conn(ctx); err != nil {
		return err
	}
	s.onConn = map[*sql.Stmt]*sql.Stmt{}
	for st, query := range map[**sql.Stmt]string{&s.getStmt: getSQL, &s.insertStmt: insertSQL, &s.createStmt: createSQL,
		&s.updateStmt: updateSQL, &s.settleStmt: settleSQL} {
		if *st, err = s.db.PrepareContext(ctx, query); err != nil {
			return err
		}
		if s.onConn[*st], err = s.conn.PrepareContext(ctx, query); err != nil {
			return err
		}
	}
	for st, query := range map[**sql.Stmt]string{&s.beginStmt: "BEGIN IMMEDIATE", &s.commitStmt: "COMMIT", &s.rollbackStmt: "ROLLBACK"} {
		if *st, err = s.conn.PrepareContext(ctx, query); err != nil {
			return err
		}
	}
	return nil
}

// DB returns the store's database, for an application's own tables and for
// transactions that [Store.FinishTx] joins.
func (s *Store) DB() *sql.DB { return s.db }

// Close closes the database: its statements and every connection, so the
// file is released and, unless another process has it open, its WAL is
// checkpointed into it and removed (the database file alone then holds
// every record). Calls after Close fail with [store.ErrUnavailable].
func (s *Store) Close() error {
	s.closed.Store(true)
	var errs []error
	// A connection is closed only once no statement prepared on it is
	// open: database/sql would keep it (and the file) open for ever.
	for _, st := range []*sql.Stmt{s.beginStmt, s.commitStmt, s.rollbackStmt} {
		if st != nil {
			errs = append(errs, st.Close())
		}
	}
	for _, st := range s.onConn {
		if st != nil {
			errs = append(errs, st.Close())
		}
	}
	for _, st := range []*sql.Stmt{s.getStmt, s.insertStmt, s.createStmt, s.updateStmt, s.settleStmt} {
		if st != nil {
			errs = append(errs, st.Close())
		}
	}
	if s.conn != nil {
		s.conn.Close() // back to the pool, which db.Close closes
	}
	errs = append(errs, s.db.Close())
	return errors.Join(errs...)
}

// migrate applies, in order, the embedded migrations not yet applied to the
// file, in one write transaction, and records each in idem_migrations. The
// file is the application's too (Store.DB): its user_version is the
// application's, never read or written here. A file whose migrations
// release 0.1.0 counted in user_version has no idem_migrations: what it
// applied is read from its schema (0001 made idem_records, 0002 added its
// checkpoints column) and recorded. A version this build does not know (a
// newer idem's) is left alone, as its migrations keep older builds working.
func (s *Store) migrate(ctx context.Context) error {
	names, err := fs.Glob(migrations, "migrations/*.sql")
	if err != nil {
		return err
	}
	slices.Sort(names)
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	defer tx.Rollback()
	err = func() error {
		applied := map[int]bool{}
		var tracked bool
		if err := tx.QueryRowContext(ctx, `SELECT count(*) > 0 FROM sqlite_schema WHERE type = 'table' AND name = 'idem_migrations'`).Scan(&tracked); err != nil {
			return err
		}
		if tracked {
			rows, err := tx.QueryContext(ctx, `SELECT version FROM idem_migrations`)
			if err != nil {
				return err
			}
			defer rows.Close()
			for rows.Next() {
				var v int
				if err := rows.Scan(&v); err != nil {
					return err
				}
				applied[v] = true
			}
			if err := rows.Err(); err != nil {
				return err
			}
		} else {
			var records, checkpoints bool
			if err := tx.QueryRowContext(ctx, `SELECT
				(SELECT count(*) > 0 FROM sqlite_schema WHERE type = 'table' AND name = 'idem_records'),
				(SELECT count(*) > 0 FROM pragma_table_info('idem_records') WHERE name = 'checkpoints')`).Scan(&records, &checkpoints); err != nil {
				return err
			}
			applied[1], applied[2] = records, checkpoints
			if _, err := tx.ExecContext(ctx, `CREATE TABLE idem_migrations (version INTEGER PRIMARY KEY, applied TEXT NOT NULL)`); err != nil {
				return err
			}
		}
		for _, name := range names {
			version, err := strconv.Atoi(strings.SplitN(path.Base(name), "_", 2)[0]) // migrations/000N_*.sql
			if err != nil {
				return fmt.Errorf("migration %s is not named 000N_name.sql", name)
			}
			if !applied[version] {
				ddl, err := migrations.ReadFile(name)
				if err != nil {
					return err
				}
				if _, err := tx.ExecContext(ctx, string(ddl)); err != nil {
					return fmt.Errorf("applying %s: %w", name, err)
				}
			}
			// The time applied is bookkeeping for operators, not record
			// semantics: SQLite's clock is fine.
			if _, err := tx.ExecContext(ctx, `INSERT INTO idem_migrations (version, applied)
				VALUES (?, strftime('%Y-%m-%dT%H:%M:%SZ', 'now')) ON CONFLICT DO NOTHING`, version); err != nil {
				return err
			}
		}
		return nil
	}()
	if err == nil {
		err = tx.Commit()
	}
	return err
}

const columns = `scope, key, state, fingerprint, token, fence, lease_expires, takeover_safe, response, created, updated, expires, checkpoints`

// Acquire implements [store.Store].
func (s *Store) Acquire(ctx context.Context, p store.AcquireParams) (store.Record, error) {
	if err := p.Validate(); err != nil {
		return store.Record{}, err
	}
	// A replay, a running lease or an unknown record needs no write: answer
	// from a plain read, which takes no lock. Anything else is decided again
	// under the write lock below.
	existing, err := s.get(ctx, nil, p.Scope, p.Key)
	if err != nil {
		return store.Record{}, s.translate("acquire", err)
	}
	if existing != nil {
		if next, write := p.Apply(existing); !write {
			return next, nil
		}
	}
	var next store.Record
	err = s.write(ctx, "acquire", func(ctx context.Context, in *txn) error {
		if existing == nil {
			// A new key: one INSERT, which creates the record unless a
			// row appeared since the read (then decided below).
			next, _ = p.Apply(nil)
			res, err := s.stmt(ctx, in, s.createStmt).ExecContext(ctx, rowArgs(&next)...)
			if err != nil {
				return err
			}
			if n, err := res.RowsAffected(); err == nil && n == 1 {
				return nil
			}
		}
		cur, err := s.get(ctx, in, p.Scope, p.Key)
		if err != nil {
			return err
		}
		var write bool
		next, write = p.Apply(cur)
		if write {
			return s.put(ctx, in, &next, cur != nil)
		}
		return nil
	})
	if existing != nil && errors.Is(err, store.ErrUnavailable) && !errors.Is(err, store.ErrRefused) {
		// The record was read: the store holds it, and refused (its write
		// lock held past the deadline) to write what it decided, such as
		// UNKNOWN for a lease that ran out: no reason to fail open.
		err = fmt.Errorf("%w: %w", store.ErrRefused, err)
	}
	return next, err
}

// Renew implements [store.Store].
func (s *Store) Renew(ctx context.Context, p store.RenewParams) error {
	if err := p.Validate(); err != nil {
		return err
	}
	return s.update(ctx, "renew", p.Scope, p.Key, p.Apply)
}

// Checkpoint implements [store.Store].
func (s *Store) Checkpoint(ctx context.Context, p store.CheckpointParams) error {
	if err := p.Validate(); err != nil {
		return err
	}
	return s.update(ctx, "checkpoint", p.Scope, p.Key, p.Apply)
}

// Finish implements [store.Store]. The owner's write is one UPDATE; a
// repeat, or a token that lost the record, is decided from the row.
func (s *Store) Finish(ctx context.Context, p store.FinishParams) error {
	if err := p.Validate(); err != nil {
		return err
	}
	return s.write(ctx, "finish", func(ctx context.Context, in *txn) error {
		return s.finish(ctx, in, p)
	})
}

// finish is p in tx: the owner's write in one UPDATE, else (a repeat, or a
// token that lost the record) decided from the row.
func (s *Store) finish(ctx context.Context, in *txn, p store.FinishParams) error {
	if settled, err := s.settle(ctx, in, p); err != nil || settled {
		return err
	}
	return s.apply(ctx, in, p.Scope, p.Key, p.Apply)
}

// settle runs settleSQL (in tx when given) and reports whether it settled
// the record.
func (s *Store) settle(ctx context.Context, in *txn, p store.FinishParams) (bool, error) {
	var resp []byte
	if p.Response != nil {
		var err error
		if resp, err = p.Response.MarshalBinary(); err != nil {
			return false, err
		}
	}
	res, err := s.stmt(ctx, in, s.settleStmt).ExecContext(ctx, string(p.State), resp, nullTime(p.Expires), p.Now.UnixNano(), p.Scope, p.Key, p.Token)
	if err != nil {
		return false, err
	}
	n, err := res.RowsAffected()
	return n == 1, err
}

// FinishTx settles a record inside the caller's transaction tx, which must be
// on [Store.DB]: the record's outcome and the caller's own writes commit
// together, or neither does. On [store.ErrLeaseLost] the caller must roll tx
// back, since another owner has the record. While tx is open it holds the
// database's one write lock, and every write of the store waits for it
// (up to the store timeout): make no other idem write for the request
// meanwhile (take checkpoints before tx begins), and keep tx short.
//
//	tx, _ := records.DB().BeginTx(ctx, nil) // records: this *Store
//	defer tx.Rollback()
//	tx.ExecContext(ctx, `INSERT INTO ledger ...`)
//	return eng.Settle(ctx, lease, idem.Settlement{State: idem.StateCompleted, Response: resp,
//		Commit: func(ctx context.Context, p idem.FinishParams) error {
//			if err := records.FinishTx(ctx, tx, p); err != nil {
//				return err // rolled back: nothing happened
//			}
//			return tx.Commit()
//		}})
func (s *Store) FinishTx(ctx context.Context, tx any, p store.FinishParams) error {
	stx, ok := tx.(*sql.Tx)
	if !ok || stx == nil {
		return fmt.Errorf("%w: sqlitestore: finish in transaction: %T is not a *sql.Tx", store.ErrInvalid, tx)
	}
	if err := p.Validate(); err != nil {
		return err
	}
	p.Repeat = false // the caller's writes in tx must never commit twice
	return s.translate("finish", s.finish(ctx, &txn{tx: stx}, p))
}

// write runs fn in a write transaction and returns once that transaction is
// committed (or failed). Writes are group-committed ([store.Batcher]): the
// writes that arrive while a transaction commits wait for it, and the next
// transaction runs them all, each in turn, with one fsync for all of them.
func (s *Store) write(ctx context.Context, op string, fn func(context.Context, *txn) error) error {
	return s.translate(op, s.writes.Do(ctx, fn))
}

// commit runs a batch of writes in one transaction. A write that fails is
// reported failed and the transaction is run again without it, so that what
// commits is exactly the writes reported done, each applied to what the ones
// before it left.
func (s *Store) commit(ctx context.Context, writes []func(context.Context, *txn) error) []error {
	run := make([]int, len(writes))
	for i := range run {
		run[i] = i
	}
	return store.Isolate(run, func(run []int) (int, error) { return s.try(ctx, writes, run) })
}

// try runs the writes in one transaction on the write connection and
// commits it. When a write fails it rolls back and returns that write's
// position in run and its error; otherwise -1 and the transaction's error
// (nil once committed). The transaction's own statements are prepared, and
// it is no database/sql transaction, which would cost a goroutine each.
func (s *Store) try(ctx context.Context, writes []func(context.Context, *txn) error, run []int) (int, error) {
	if _, err := s.beginStmt.ExecContext(ctx); err != nil {
		// The driver reports a BEGIN that took the write lock as failed when
		// ctx ended meanwhile: end the transaction it may have begun, or
		// every later write on the connection fails and other processes
		// stay locked out.
		s.rollback()
		return -1, err
	}
	in := &txn{conn: s.conn}
	for pos, i := range run {
		if err := writes[i](ctx, in); err != nil {
			s.rollback()
			return pos, err
		}
	}
	// Not cut short: a commit reported failed must not have happened.
	if _, err := s.commitStmt.ExecContext(context.WithoutCancel(ctx)); err != nil {
		s.rollback()
		return -1, err
	}
	return -1, nil
}

// rollback ends the write connection's transaction, if SQLite has not ended
// it already (it does on some errors).
func (s *Store) rollback() {
	s.rollbackStmt.ExecContext(context.Background())
}

// update applies a transition to the record in a write of its own.
func (s *Store) update(ctx context.Context, op, scope, key string, apply func(*store.Record) error) error {
	return s.write(ctx, op, func(ctx context.Context, in *txn) error {
		return s.apply(ctx, in, scope, key, apply)
	})
}

// apply reads the record in tx, applies a transition and writes it back.
func (s *Store) apply(ctx context.Context, in *txn, scope, key string, apply func(*store.Record) error) error {
	r, err := s.get(ctx, in, scope, key)
	if err != nil {
		return err
	}
	if err := apply(r); err != nil {
		return err
	}
	return s.put(ctx, in, r, true)
}

// Get implements [store.Store].
func (s *Store) Get(ctx context.Context, p store.GetParams) (store.Record, error) {
	if err := p.Validate(); err != nil {
		return store.Record{}, err
	}
	r, err := s.get(ctx, nil, p.Scope, p.Key)
	if err != nil {
		return store.Record{}, s.translate("get", err)
	}
	if r == nil || !r.Live(p.Now) {
		return store.Record{}, store.ErrNotFound
	}
	return *r, nil
}

// Scan implements [store.Store]. Pages are in scope and key order; the cursor
// is the last scope and key returned.
func (s *Store) Scan(ctx context.Context, p store.ScanParams) (store.ScanResult, error) {
	if err := p.Validate(); err != nil {
		return store.ScanResult{}, err
	}
	return s.page(ctx, "scan", p.Cursor, p.PageSize(),
		`state IN ('in_progress', 'unknown') AND (state = 'unknown' OR lease_expires <= ?)`, p.Now.UnixNano())
}

// List implements [store.Store]: the matching records in the order of
// their scope and key.
func (s *Store) List(ctx context.Context, p store.ListParams) (store.ScanResult, error) {
	if err := p.Validate(); err != nil {
		return store.ScanResult{}, err
	}
	where, args := []string{"(expires IS NULL OR expires > ?)"}, []any{p.Now.UnixNano()}
	if len(p.States) > 0 {
		where = append(where, "state IN (?"+strings.Repeat(", ?", len(p.States)-1)+")")
		for _, st := range p.States {
			args = append(args, string(st))
		}
	}
	if p.ScopePrefix != "" {
		where, args = append(where, "substr(scope, 1, ?) = ?"), append(args, len(p.ScopePrefix), p.ScopePrefix)
	}
	if p.KeyPrefix != "" {
		where, args = append(where, "substr(key, 1, ?) = ?"), append(args, len(p.KeyPrefix), p.KeyPrefix)
	}
	if !p.CreatedFrom.IsZero() {
		where, args = append(where, "created >= ?"), append(args, p.CreatedFrom.UnixNano())
	}
	if !p.CreatedBefore.IsZero() {
		where, args = append(where, "created < ?"), append(args, p.CreatedBefore.UnixNano())
	}
	return s.page(ctx, "list", p.Cursor, p.PageSize(), strings.Join(where, " AND "), args...)
}

// page returns up to size records that satisfy where, after the cursor's,
// in the order of their scope and key.
func (s *Store) page(ctx context.Context, op, cursor string, size int, where string, args ...any) (store.ScanResult, error) {
	scope, key := "", ""
	if cursor != "" {
		f, err := store.DecodeCursor(cursor, s.owner, 2)
		if err != nil {
			return store.ScanResult{}, err
		}
		scope, key = f[0], f[1]
	}
	rows, err := s.db.QueryContext(ctx, `SELECT `+columns+` FROM idem_records
		WHERE `+where+` AND (scope > ? OR (scope = ? AND key > ?))
		ORDER BY scope, key LIMIT ?`, append(args, scope, scope, key, size+1)...)
	if err != nil {
		return store.ScanResult{}, s.translate(op, err)
	}
	defer rows.Close()
	var res store.ScanResult
	for rows.Next() {
		r, err := scanRecord(rows)
		if err != nil {
			return store.ScanResult{}, s.translate(op, err)
		}
		if len(res.Records) == size {
			last := res.Records[len(res.Records)-1]
			res.Cursor = store.EncodeCursor(s.owner, last.Scope, last.Key)
			break
		}
		res.Records = append(res.Records, *r)
	}
	return res, s.translate(op, rows.Err())
}

// Prune implements [store.Store].
func (s *Store) Prune(ctx context.Context, p store.PruneParams) (int, error) {
	if err := p.Validate(); err != nil {
		return 0, err
	}
	var n int64
	err := s.write(ctx, "prune", func(ctx context.Context, in *txn) error {
		res, err := in.conn.ExecContext(ctx, `DELETE FROM idem_records WHERE rowid IN (
			SELECT rowid FROM idem_records
			WHERE state IN ('completed', 'failed') AND expires <= ? LIMIT ?)`,
			p.Now.UnixNano(), p.BatchSize())
		if err != nil {
			return err
		}
		n, err = res.RowsAffected()
		return err
	})
	return int(n), err
}

// A txn is where a write runs its statements: on the store's write
// connection, in the transaction of a batch (conn), or in a caller's
// transaction (tx, for FinishTx).
type txn struct {
	conn *sql.Conn
	tx   *sql.Tx
}

// stmt is st as prepared where in runs, or st itself (on the pool) when in
// is nil.
func (s *Store) stmt(ctx context.Context, in *txn, st *sql.Stmt) *sql.Stmt {
	switch {
	case in == nil:
		return st
	case in.tx != nil:
		return in.tx.StmtContext(ctx, st)
	default:
		return s.onConn[st]
	}
}

// get returns the stored row (in tx when given), or nil when there is none.
func (s *Store) get(ctx context.Context, in *txn, scope, key string) (*store.Record, error) {
	r, err := scanRecord(s.stmt(ctx, in, s.getStmt).QueryRowContext(ctx, scope, key))
	if errors.Is(err, sql.ErrNoRows) {
		return nil, nil
	}
	return r, err
}

// put writes r: an INSERT when there was no row (exists false), else an
// UPDATE in place, which writes fewer pages than a delete and insert.
func (s *Store) put(ctx context.Context, in *txn, r *store.Record, exists bool) error {
	st := s.updateStmt
	if !exists {
		st = s.insertStmt
	}
	_, err := s.stmt(ctx, in, st).ExecContext(ctx, rowArgs(r)...)
	return err
}

// rowArgs are r's columns in the order of insertSQL and updateSQL.
func rowArgs(r *store.Record) []any {
	var resp []byte
	if r.Response != nil {
		resp, _ = r.Response.MarshalBinary() // JSON of plain fields: it cannot fail
	}
	return []any{string(r.State), string(r.Fingerprint), r.Token, r.Fence, r.LeaseExpires.UnixNano(),
		r.TakeoverSafe, resp, r.Created.UnixNano(), r.Updated.UnixNano(), nullTime(r.Expires), store.EncodeCheckpoints(r.Checkpoints), r.Scope, r.Key}
}

// nullTime is t in unix nanoseconds, or NULL for the zero time.
func nullTime(t time.Time) any {
	if t.IsZero() {
		return nil
	}
	return t.UnixNano()
}

func scanRecord(row interface{ Scan(...any) error }) (*store.Record, error) {
	var (
		r                       store.Record
		state, fingerprint      string
		lease, created, updated int64
		expires                 sql.NullInt64
		resp, checkpoints       []byte
	)
	err := row.Scan(&r.Scope, &r.Key, &state, &fingerprint, &r.Token, &r.Fence, &lease, &r.TakeoverSafe, &resp, &created, &updated, &expires, &checkpoints)
	if err != nil {
		return nil, err
	}
	r.State, r.Fingerprint = store.State(state), store.Fingerprint(fingerprint)
	r.LeaseExpires, r.Created, r.Updated = time.Unix(0, lease), time.Unix(0, created), time.Unix(0, updated)
	if expires.Valid {
		r.Expires = time.Unix(0, expires.Int64)
	}
	if r.Checkpoints, err = store.DecodeCheckpoints(checkpoints); err != nil {
		return nil, err
	}
	if resp != nil {
		r.Response = new(store.Response)
		if err := r.Response.UnmarshalBinary(resp); err != nil {
			return nil, err
		}
	}
	return &r, nil
}

// translate maps driver errors into the root's vocabulary, as [Store]'s
// doc says: SQLITE_BUSY, LOCKED, IOERR, a closed store and a deadline are
// unavailable; READONLY, PERM, AUTH, and CANTOPEN for lack of permissions,
// are denied ([store.Denied]); CORRUPT, NOTADB and FULL are refused
// ([store.Refused]); the rest are plain errors. The root's sentinels and a cancellation pass through.
func (s *Store) translate(op string, err error) error {
	if err == nil || errors.Is(err, store.ErrLeaseLost) || errors.Is(err, store.ErrNotFound) ||
		errors.Is(err, store.ErrInvalid) || errors.Is(err, context.Canceled) {
		return err
	}
	if errors.Is(err, context.DeadlineExceeded) {
		// Not done in time (waiting for another process's write lock, say):
		// a write may still commit, so its outcome is not known.
		return fmt.Errorf("sqlitestore: %s: %w: %w", op, store.ErrUnavailable, err)
	}
	var se *sqlite.Error
	if errors.As(err, &se) {
		switch se.Code() & 0xff {
		case sqlite3.SQLITE_CANTOPEN:
			// SQLite does not say why: ask the file system, which may
			// refuse access.
			if why := s.whyNotOpen(); why != nil {
				err = fmt.Errorf("%w: %w", err, why)
			}
			if errors.Is(err, fs.ErrPermission) || errors.Is(err, syscall.EROFS) {
				return fmt.Errorf("sqlitestore: %s: %w", op, store.Denied(err))
			}
			return fmt.Errorf("sqlitestore: %s: %w: %w", op, store.ErrUnavailable, err)
		case sqlite3.SQLITE_READONLY, sqlite3.SQLITE_PERM, sqlite3.SQLITE_AUTH:
			return fmt.Errorf("sqlitestore: %s: %w", op, store.Denied(err))
		case sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB, sqlite3.SQLITE_FULL:
			return fmt.Errorf("sqlitestore: %s: %w", op, store.Refused(err))
		case sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED, sqlite3.SQLITE_IOERR:
			return fmt.Errorf("sqlitestore: %s: %w: %w", op, store.ErrUnavailable, err)
		}
	}
	if s.closed.Load() || errors.Is(err, sql.ErrConnDone) || strings.Contains(err.Error(), "database is closed") {
		return fmt.Errorf("sqlitestore: %s: %w: %w", op, store.ErrUnavailable, err)
	}
	return fmt.Errorf("sqlitestore: %s: %w", op, err)
}

// whyNotOpen is the file system's reason, if any, why the database file
// cannot be opened (or created) for reading and writing.
func (s *Store) whyNotOpen() error {
	f, err := os.OpenFile(s.path, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		var pe *fs.PathError
		if errors.As(err, &pe) {
			return pe.Err // the reason alone: the path is the store's
		}
		return err
	}
	f.Close()
	return nil
}

var _ store.DurabilityReporter = (*Store)(nil)

// Durability implements [store.DurabilityReporter] from the database's
// journal mode and synchronous setting: with WAL and synchronous=FULL (what
// [Open] sets), a write is on disk before the call returns.
func (s *Store) Durability(ctx context.Context) (store.Durability, error) {
	var mode string
	var sync int
	if err := s.db.QueryRowContext(ctx, "PRAGMA journal_mode").Scan(&mode); err != nil {
		return store.Durability{}, s.translate("durability", err)
	}
	if err := s.db.QueryRowContext(ctx, "PRAGMA synchronous").Scan(&sync); err != nil {
		return store.Durability{}, s.translate("durability", err)
	}
	names := map[int]string{0: "OFF", 1: "NORMAL", 2: "FULL", 3: "EXTRA"}
	d := store.Durability{Detail: fmt.Sprintf("journal_mode=%s, synchronous=%s", mode, names[sync])}
	switch {
	case sync >= 2 || (sync == 1 && mode != "wal"):
		d.CrashSafe = true
		d.Detail += ": every write is on disk before the store answers"
	default:
		d.Detail += ": a crash of the machine may lose the last writes"
	}
	return d, nil
}
