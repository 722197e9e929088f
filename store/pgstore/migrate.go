package pgstore

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"hash/fnv"
	"io/fs"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

//go:embed migrations/*.sql
var migrationFiles embed.FS

// migration is one embedded migration: migrations/NNN_name.sql, whose SQL
// names the schema as {{schema}}.
type migration struct {
	version int
	name    string
	sql     string
}

// migrations returns the embedded migrations in version order.
func migrations() ([]migration, error) {
	entries, err := fs.ReadDir(migrationFiles, "migrations")
	if err != nil {
		return nil, err
	}
	var ms []migration
	for _, e := range entries {
		prefix, _, ok := strings.Cut(e.Name(), "_")
		v, err := strconv.Atoi(prefix)
		if !ok || err != nil || v <= 0 {
			return nil, fmt.Errorf("migration file %q is not named NNN_name.sql", e.Name())
		}
		b, err := migrationFiles.ReadFile("migrations/" + e.Name())
		if err != nil {
			return nil, err
		}
		ms = append(ms, migration{version: v, name: e.Name(), sql: string(b)})
	}
	slices.SortFunc(ms, func(a, b migration) int { return a.version - b.version })
	for i := 1; i < len(ms); i++ {
		if ms[i].version == ms[i-1].version {
			return nil, fmt.Errorf("migrations %q and %q have the same version", ms[i-1].name, ms[i].name)
		}
	}
	return ms, nil
}

// Migrate creates the schema unless it exists (see [Config.Schema]) and
// applies the embedded migrations that it has not applied yet, recording
// each in <schema>.migrations. It is idempotent and safe to run from several
// processes at once: everything happens in one transaction that first takes
// a transaction-level advisory lock on the schema's name, so concurrent
// callers queue, and each finds what the previous one applied. When
// everything is applied already it changes nothing and needs no privilege
// beyond reading the migrations table. New calls it unless
// [Config.NoMigrate] is set.
//
// A migration that changes records needs a lock that waits for every
// transaction open on the table, and while it waits, every other statement
// on the table waits behind it: one long transaction (a business
// transaction between its FinishTx and its COMMIT) would stall the running
// fleet's traffic for as long as it lasted. So a migration waits for a lock
// at most migrateLockTimeout, then rolls back, steps aside for a moment and
// tries again, until it is applied or ctx ends.
//
// A records table created by release 0.1.0 keeps its layout: the store
// writes its records in the text forms that 0.1.0 reads (the fingerprint
// as text, the response as JSON), so that a rolling upgrade replays on
// every instance. One created since keeps them in their compact forms
// (about 180 B less per key, in the table and in the WAL), which 0.1.0
// cannot read: do not point a 0.1.0 at it.
func (s *Store) Migrate(ctx context.Context) error {
	ms, err := migrations()
	if err != nil {
		return fmt.Errorf("pgstore: migrate: %w", err)
	}
	for n := 0; ; n++ {
		err := s.migrate(ctx, ms)
		if err == nil {
			s.layout.Store(0) // read it again: the migrations may have created the table
			if _, err := s.readLayout(ctx, nil); err != nil {
				return translate("migrate", err)
			}
			return nil
		}
		if pgErr, ok := errors.AsType[*pgconn.PgError](err); !ok || pgErr.Code != "55P03" {
			return err
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%w (it waited for a lock on the records table, which a transaction holds)", err)
		case <-time.After(migratePause(n)):
		}
	}
}

// migratePause is the pause before try n+1 of a migration that waited for
// a lock too long: growing from 100 ms to 2 s, and no shorter after.
func migratePause(n int) time.Duration {
	if n >= 5 { // 100 ms << 5 is past the cap; further shifts overflow
		return 2 * time.Second
	}
	return min(100*time.Millisecond<<n, 2*time.Second)
}

// migrateLockTimeout bounds how long one try of a migration waits for a
// lock (see [Store.Migrate]).
const migrateLockTimeout = "500ms"

// migrate applies the migrations of ms not applied yet, in one transaction.
func (s *Store) migrate(ctx context.Context, ms []migration) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("pgstore: migrate: %w", err)
	}
	tx, err := s.pool.Begin(ctx)
	if err != nil {
		return translate("migrate", err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }() // a no-op after Commit

	schema := pgx.Identifier{s.schema}.Sanitize()
	table := pgx.Identifier{s.schema, "migrations"}.Sanitize()
	if _, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock($1)", lockKey("migrate", s.schema)); err != nil {
		return translate("migrate", err)
	}
	var exists bool
	if err := tx.QueryRow(ctx, "SELECT to_regclass($1) IS NOT NULL", table).Scan(&exists); err != nil {
		return translate("migrate", err)
	}
	if !exists {
		if err := s.createSchema(ctx, tx); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, "CREATE TABLE IF NOT EXISTS "+table+" (version integer PRIMARY KEY, applied timestamptz NOT NULL)"); err != nil {
			return translate("migrate", err)
		}
	}
	rows, err := tx.Query(ctx, "SELECT version FROM "+table)
	if err != nil {
		return translate("migrate", err)
	}
	applied, err := pgx.CollectRows(rows, pgx.RowTo[int32])
	if err != nil {
		return translate("migrate", err)
	}
	bounded := false
	for _, m := range ms {
		if slices.Contains(applied, int32(m.version)) {
			continue
		}
		if !bounded { // the advisory lock above is held: from here, wait for a lock only briefly
			if _, err := tx.Exec(ctx, "SELECT set_config('lock_timeout', '"+migrateLockTimeout+"', true)"); err != nil {
				return translate("migrate", err)
			}
			bounded = true
		}
		if _, err := tx.Exec(ctx, strings.ReplaceAll(m.sql, "{{schema}}", schema)); err != nil {
			return translate("migrate "+m.name, err)
		}
		// The time applied is bookkeeping for operators, not record
		// semantics, so the server's clock is fine here.
		if _, err := tx.Exec(ctx, "INSERT INTO "+table+" (version, applied) VALUES ($1, now())", m.version); err != nil {
			return translate("migrate "+m.name, err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		return translate("migrate", err)
	}
	return nil
}

// createSchema creates the schema unless it exists. An existing schema is
// used as it is: CREATE SCHEMA IF NOT EXISTS would not do, since PostgreSQL
// checks the role's CREATE privilege on the database before it looks for
// the schema, and a role given a schema of its own by a DBA (CREATE SCHEMA
// … AUTHORIZATION app) needs no such privilege.
func (s *Store) createSchema(ctx context.Context, tx pgx.Tx) error {
	var exists bool
	if err := tx.QueryRow(ctx, "SELECT EXISTS (SELECT FROM pg_catalog.pg_namespace WHERE nspname = $1)", s.schema).Scan(&exists); err != nil {
		return translate("migrate", err)
	}
	if exists {
		return nil
	}
	// IF NOT EXISTS: a schema created since by another, which took no
	// advisory lock (an operator), is no error.
	if _, err := tx.Exec(ctx, "CREATE SCHEMA IF NOT EXISTS "+pgx.Identifier{s.schema}.Sanitize()); err != nil {
		if pgErr, ok := errors.AsType[*pgconn.PgError](err); ok && pgErr.Code == "42501" {
			err = fmt.Errorf("schema %q does not exist, and the role may not create it "+
				"(create it for the role, or grant the role CREATE on the database): %w", s.schema, err)
		}
		return translate("migrate", err)
	}
	return nil
}

// lockKey is the advisory lock that serialises the work named what (migrate,
// records_due) on one schema.
func lockKey(what, schema string) int64 {
	h := fnv.New64a()
	h.Write([]byte("github.com/idemhq/idem/store/pgstore " + what + "\x00" + schema))
	return int64(h.Sum64())
}
