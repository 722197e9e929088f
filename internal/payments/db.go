package payments

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/store"
	"github.com/idemhq/idem/store/pgstore"
	"github.com/idemhq/idem/store/sqlitestore"
)

// DB is the database the ledger shares with the idempotency records, so that
// a debit and the record's completion commit in one transaction.
type DB interface {
	// InTx runs fn in a transaction and commits it when fn returns nil.
	InTx(ctx context.Context, fn func(Tx) error) error
	// QueryRow runs a query outside any transaction. Queries use ?
	// placeholders.
	QueryRow(ctx context.Context, query string, args ...any) Row
	// Query runs a query outside any transaction and calls each with the
	// Scan of every row it returns, in turn.
	Query(ctx context.Context, query string, each func(scan func(dest ...any) error) error, args ...any) error
	// Exec runs a statement outside any transaction.
	Exec(ctx context.Context, query string, args ...any) error
}

// Tx is a transaction of a [DB].
type Tx interface {
	Exec(ctx context.Context, query string, args ...any) error
	// Finish settles an idempotency record in this transaction.
	Finish(ctx context.Context, p idem.FinishParams) error
}

// Row is one result row.
type Row interface{ Scan(dest ...any) error }

// errNoRows is what Row.Scan returns when there is no row, on every database.
var errNoRows = errors.New("payments: no rows")

// NewDB returns the ledger's database for the records' store: SQLite's own
// file, or PostgreSQL's pool. s may be a wrapper (telemetry's): the
// database is found under it, and records are settled through it, so those
// settlements are measured like the rest.
func NewDB(s idem.Store) (DB, error) {
	fin, ok := s.(store.TxFinisher)
	if !ok {
		return nil, fmt.Errorf("payments: the ledger needs a store that settles records in transactions, not %T", s)
	}
	for inner := s; inner != nil; inner = store.Unwrap(inner) {
		switch db := inner.(type) {
		case *sqlitestore.Store:
			return sqliteDB{db: db.DB(), fin: fin}, nil
		case *pgstore.Store:
			return pgDB{pool: db.Pool(), fin: fin, schema: pgx.Identifier{db.Schema()}.Sanitize() + "."}, nil
		}
	}
	return nil, fmt.Errorf("payments: the ledger needs a SQLite or PostgreSQL store, not %T", s)
}

type sqliteDB struct {
	db  *sql.DB
	fin store.TxFinisher
}

type sqliteTx struct {
	fin store.TxFinisher
	tx  *sql.Tx
}

type sqlRow struct{ *sql.Row }

func (r sqlRow) Scan(dest ...any) error {
	if err := r.Row.Scan(dest...); errors.Is(err, sql.ErrNoRows) {
		return errNoRows
	} else {
		return err
	}
}

func (d sqliteDB) InTx(ctx context.Context, fn func(Tx) error) error {
	tx, err := d.db.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	defer tx.Rollback()
	if err := fn(sqliteTx{d.fin, tx}); err != nil {
		return err
	}
	return tx.Commit()
}

func (d sqliteDB) QueryRow(ctx context.Context, q string, args ...any) Row {
	return sqlRow{d.db.QueryRowContext(ctx, inSchema(q, ""), args...)}
}

func (d sqliteDB) Query(ctx context.Context, q string, each func(func(...any) error) error, args ...any) error {
	rows, err := d.db.QueryContext(ctx, inSchema(q, ""), args...)
	if err != nil {
		return err
	}
	defer rows.Close()
	return eachRow(rows, each)
}

// eachRow calls each with the Scan of every row of rows, in turn.
func eachRow(rows interface {
	Next() bool
	Scan(dest ...any) error
	Err() error
}, each func(func(...any) error) error) error {
	for rows.Next() {
		if err := each(rows.Scan); err != nil {
			return err
		}
	}
	return rows.Err()
}

func (d sqliteDB) Exec(ctx context.Context, q string, args ...any) error {
	_, err := d.db.ExecContext(ctx, inSchema(q, ""), args...)
	return err
}

func (t sqliteTx) Exec(ctx context.Context, q string, args ...any) error {
	_, err := t.tx.ExecContext(ctx, inSchema(q, ""), args...)
	return err
}

func (t sqliteTx) Finish(ctx context.Context, p idem.FinishParams) error {
	return t.fin.FinishTx(ctx, t.tx, p)
}

// pgDB keeps the ledger's tables in the records' schema (a demo in a
// schema of its own has a ledger of its own, and dropping the schema
// drops both).
type pgDB struct {
	pool   *pgxpool.Pool
	fin    store.TxFinisher
	schema string // quoted, with its dot
}

type pgTx struct {
	fin    store.TxFinisher
	tx     pgx.Tx
	schema string
}

type pgRow struct{ pgx.Row }

func (r pgRow) Scan(dest ...any) error {
	if err := r.Row.Scan(dest...); errors.Is(err, pgx.ErrNoRows) {
		return errNoRows
	} else {
		return err
	}
}

// inSchema puts the tables that q names as {{s}}table in schema: "" (the
// database's own, on SQLite) or a quoted schema and its dot.
func inSchema(q, schema string) string { return strings.ReplaceAll(q, "{{s}}", schema) }

// rebind turns ? placeholders into PostgreSQL's $1, $2, …, then puts the
// tables in schema (see [inSchema]), whose quoted name may hold a ?.
func rebind(q, schema string) string {
	var b strings.Builder
	n := 0
	for _, c := range q {
		if c == '?' {
			n++
			b.WriteString("$" + strconv.Itoa(n))
			continue
		}
		b.WriteRune(c)
	}
	return inSchema(b.String(), schema)
}

func (d pgDB) InTx(ctx context.Context, fn func(Tx) error) error {
	tx, err := d.pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer tx.Rollback(ctx)
	if err := fn(pgTx{d.fin, tx, d.schema}); err != nil {
		return err
	}
	return tx.Commit(ctx)
}

func (d pgDB) QueryRow(ctx context.Context, q string, args ...any) Row {
	return pgRow{d.pool.QueryRow(ctx, rebind(q, d.schema), args...)}
}

func (d pgDB) Query(ctx context.Context, q string, each func(func(...any) error) error, args ...any) error {
	rows, err := d.pool.Query(ctx, rebind(q, d.schema), args...)
	if err != nil {
		return err
	}
	defer rows.Close()
	return eachRow(rows, each)
}

func (d pgDB) Exec(ctx context.Context, q string, args ...any) error {
	_, err := d.pool.Exec(ctx, rebind(q, d.schema), args...)
	return err
}

func (t pgTx) Exec(ctx context.Context, q string, args ...any) error {
	_, err := t.tx.Exec(ctx, rebind(q, t.schema), args...)
	return err
}

func (t pgTx) Finish(ctx context.Context, p idem.FinishParams) error {
	return t.fin.FinishTx(ctx, t.tx, p)
}
