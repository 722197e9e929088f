// Package pgstore is an [store.Store] on PostgreSQL, through pgx v5 and a
// [pgxpool.Pool], for many instances sharing one database, and for handlers
// whose own writes must commit together with the record ([Store.FinishTx]).
// Its [Notifier] wakes callers waiting in [store.Engine.Await] on other
// instances through LISTEN/NOTIFY as soon as a record is settled.
//
// # Schema
//
// The records are in <schema>.records (the schema is [Config.Schema]), created
// by the embedded migrations, which [New] applies unless told not to:
//
//	scope text, key text             PRIMARY KEY (scope, key), COLLATE "C"; the key as sent, never hashed
//	fingerprint bytea                store.Fingerprint.Compact (text in a table of release 0.1.0)
//	token text
//	fence bigint
//	lease_expires, created timestamptz
//	takeover_safe boolean
//	state text                       in_progress | completed | failed | unknown (CHECK)
//	updated timestamptz
//	expires timestamptz              NULL while in_progress or unknown
//	response bytea                   store.Response.MarshalCompact (MarshalBinary in a table of 0.1.0); NULL unless completed
//	checkpoints bytea                store.AppendCheckpoint lines, oldest first; NULL when there are none
//
// Its only index is the primary key, and inserts fill a page to 30%
// (fillfactor), leaving the rest for the completed rows, so that a complete,
// which changes state, updated, expires and response, is a HOT update: the
// row is rewritten in its page, no index entry is written, and the WAL is the
// least PostgreSQL can write. Those four columns come last (in a table
// created since release 0.1.0; one created by it keeps its order, and every
// statement names its columns): a HOT update logs only the bytes between
// the prefix and the suffix the new row shares with the old one, so the
// complete logs none of the columns it keeps (unless wal_level is logical:
// PostgreSQL then logs every new row whole, for logical decoding). What the
// reconciler's scan and the pruner look up
// lives in <schema>.records_due, an UNLOGGED table (it writes no WAL) that
// triggers on records keep in step in the same transaction: one row per
// record, its expiry, NULL while the record is unsettled, with a partial
// index on (scope, key) over the unsettled rows (scan) and one on expires
// over the others (prune). PostgreSQL empties an unlogged table after a
// crash and on a promoted standby; a mark (the row of the empty scope and
// key, which no record has) says it is whole, every scan and prune checks
// for it in the same round trip, and when it is missing the store rebuilds
// the table from records (about 13 µs a record here: 27 s for 2 million)
// and answers once it is whole; a scan or prune whose deadline comes first
// is unavailable, and the rebuild goes on. It copies 10,000 records per
// transaction, so a write meanwhile waits at most for the part under way,
// and a part waits at most 200 ms for a row that an open transaction wrote
// (a business transaction between its FinishTx and its COMMIT) before it
// steps aside and tries again. While another process rebuilds, scans and
// prunes are unavailable and hold no connection. Applied migrations are listed in
// <schema>.migrations:
//
//	001_records.sql      the table and its indexes
//	002_checkpoints.sql  the checkpoints column
//	003_records_due.sql  records_due and its triggers; the two partial indexes
//	                     of records dropped; its fillfactor
//
// # Round trips
//
// Every operation is one statement, so at most one round trip and, for a
// write, one commit. Writes made at the same time share both: the store sends
// the acquires, renewals, checkpoints and completions that its callers make
// while a batch is on its way as the next batch ([store.Batcher]), one
// pipeline in one implicit transaction, in the order of their scope and key
// (so that batches lock records in one order and never deadlock). A
// statement that fails is reported to its caller and the rest of its batch
// runs again without it; a batch begins with one more statement, which
// bounds how long its writes wait for a row another transaction holds
// (batchLockTimeoutSQL). Up to half the pool's connections carry batches at
// once; the rest serve reads, scans and listeners.
//
//	acquire        1  (INSERT … ON CONFLICT DO UPDATE … WHERE, in a CTE, RETURNING)
//	replay lookup  1  (it is the acquire statement itself)
//	renew          1  (UPDATE … WHERE token = $n)
//	checkpoint     1  (UPDATE … SET checkpoints = checkpoints || $n … WHERE token = $n)
//	complete       1  (UPDATE … WHERE token = $n; or inside the caller's transaction with FinishTx)
//	get            1
//	scan           1 per page (keyset pagination on scope, key; the check of records_due with it)
//	list           1 per page (keyset pagination on scope, key; filters read the table)
//	prune          1 per batch (the check of records_due with it)
//
// The first use of a statement on a pooled connection also prepares it (pgx's
// statement cache), which is paid once per connection, not per call. Acquire
// runs its statement again in one rare race (see [Store.Acquire]).
//
// # The atomic primitive
//
// Acquire is a single statement: a CTE reads the row under its key; unless that
// row can be returned as it is, an INSERT … ON CONFLICT (scope, key) DO UPDATE
// SET … WHERE … creates the record, re-creates it over an expired or FAILED one,
// takes over an expired takeover-safe lease, or turns an expired lease into
// UNKNOWN, exactly as [store.AcquireParams.Apply] says; the statement returns the
// row as it now stands. The uniqueness check of ON CONFLICT serialises racers on
// one key, and the WHERE is evaluated on the latest committed row, so of any
// number of concurrent acquirers exactly one wins. A row that needs no change
// (a replay, a lease still running, an UNKNOWN record) is only read: the INSERT
// does not run, so it is neither written nor even locked — a bare ON CONFLICT
// DO UPDATE whose WHERE fails would still lock the row, which costs a
// transaction id, WAL and a synchronous commit on every replay.
//
// Renew, Checkpoint and Finish are compare-and-set UPDATEs on the lease token;
// Checkpoint appends to the stored checkpoints with ||, without reading them.
// The store never reads a clock: every statement acts at the time its params
// carry. Times are kept to the microsecond (a checkpoint's own time, inside
// its stored line, as the params gave it).
//
// # Performance
//
// go test -run '^$' -bench . -benchtime 2000x, on a pool of one connection to
// a local PostgreSQL 15 (fsync and synchronous_commit on) on a shared 2 vCPU
// machine; medians of 12 interleaved runs. The raw benchmarks do the same
// work with bare statements on a bare table of the same shape (primary key
// only) in the same schema:
//
//	benchmark                                            ns/op    ops/s  round trips
//	AcquireComplete  Acquire of a new key, Finish      893 000    1 120  2
//	RawInsertUpdate  INSERT, UPDATE by primary key     735 000    1 361  2   idem/raw 1.22
//	Replay           Acquire of a completed key        141 000    7 070  1
//	RawSelect        SELECT by primary key              94 000   10 612  1   idem/raw 1.50
//
// A new key costs what its two commits cost (each waits for an fsync, shared
// by the writes of a batch under concurrency); the store adds the CTE and the
// CHECKs (and, since these figures were taken, the triggers that keep
// records_due). A replay is
// one statement that reads one row and writes nothing, so its commit writes no
// WAL; what it adds over a bare SELECT is starting an INSERT that inserts
// nothing (the executor opens the table's indexes for ON CONFLICT) and
// decoding the stored response. On this noisy machine the best runs were
// closer: 1.13 and 1.18.
package pgstore

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemhq/idem/store"
)

var (
	_ store.Store      = (*Store)(nil)
	_ store.TxFinisher = (*Store)(nil)
)

// DefaultSchema is the schema that holds the tables when [Config.Schema] is
// empty.
const DefaultSchema = "idem"

// maxIdentifierLen is PostgreSQL's NAMEDATALEN-1: longer names are silently
// truncated by the server, so two long schema names could name one schema.
const maxIdentifierLen = 63

// acquireAttempts bounds the re-runs of the acquire statement; see
// [Store.Acquire].
const acquireAttempts = 5

// Config configures a [Store]. The zero value of every field but Pool is a
// sensible default.
type Config struct {
	// Pool is the connection pool the store uses. Required. The store does
	// not close it.
	Pool *pgxpool.Pool
	// Schema is the PostgreSQL schema that holds the records and migrations
	// tables. Any name up to 63 bytes is accepted and quoted. Defaults to
	// [DefaultSchema].
	//
	// An existing schema is used as it is: applying migrations needs USAGE
	// and CREATE on it (a schema created for the pool's role, CREATE
	// SCHEMA … AUTHORIZATION role, has both), and no privilege on the
	// database beyond CONNECT. A missing schema is created, which needs
	// CREATE on the database; without it, New fails with an error
	// wrapping [store.ErrDenied] that names the schema.
	Schema string
	// NoMigrate stops New from applying the migrations (run [Store.Migrate]
	// yourself, or manage the schema elsewhere). Defaults to false: New
	// migrates.
	NoMigrate bool
}

// Store is an [store.Store] on PostgreSQL. It is safe for concurrent use, and
// any number of stores in any number of processes may share one schema.
type Store struct {
	pool   *pgxpool.Pool
	schema string // as configured, unquoted

	acquireSQL, renewSQL, checkpointSQL, finishSQL, getSQL, scanSQL, listSQL, pruneSQL string
	dueWholeSQL, dueFillSQL, dueMarkSQL                                                string

	// layout is how the records table keeps fingerprints and responses
	// (see [Store.Migrate]): layoutCompact on a table created since
	// release 0.1.0, layoutText on a table of 0.1.0; 0 until read.
	layout atomic.Int32

	// writes sends the writes that callers make at the same time as one
	// batch: one round trip and one transaction (one commit) for all.
	writes store.Batcher[*write]

	// filling is the rebuild of records_due running now, if any
	// (rebuildDue).
	filling struct {
		mu      sync.Mutex
		running *fill
	}
}

// New returns a store on cfg.Pool and, unless cfg.NoMigrate, applies the
// migrations (see [Store.Migrate]). An invalid config gives an error wrapping
// [store.ErrInvalid]; an unreachable server one wrapping [store.ErrUnavailable].
func New(ctx context.Context, cfg Config) (*Store, error) {
	if cfg.Pool == nil {
		return nil, fmt.Errorf("pgstore: %w: config has no pool", store.ErrInvalid)
	}
	schema := cfg.Schema
	if schema == "" {
		schema = DefaultSchema
	}
	if len(schema) > maxIdentifierLen || strings.IndexByte(schema, 0) >= 0 {
		return nil, fmt.Errorf("pgstore: %w: schema name must be 1 to %d bytes without NUL", store.ErrInvalid, maxIdentifierLen)
	}
	sub := strings.NewReplacer("{{table}}", pgx.Identifier{schema, "records"}.Sanitize(),
		"{{due}}", pgx.Identifier{schema, "records_due"}.Sanitize()).Replace
	s := &Store{
		pool:          cfg.Pool,
		schema:        schema,
		acquireSQL:    sub(acquireSQL),
		renewSQL:      sub(renewSQL),
		checkpointSQL: sub(checkpointSQL),
		finishSQL:     sub(finishSQL),
		getSQL:        sub(getSQL),
		scanSQL:       sub(scanSQL),
		listSQL:       sub(listSQL),
		pruneSQL:      sub(pruneSQL),
		dueWholeSQL:   sub(dueWholeSQL),
		dueFillSQL:    sub(dueFillSQL),
		dueMarkSQL:    sub(dueMarkSQL),
	}
	s.writes.Run = s.batch
	s.writes.Runners = max(1, int(cfg.Pool.Config().MaxConns)/2) // the rest for reads, scans and listeners
	if !cfg.NoMigrate {
		if err := s.Migrate(ctx); err != nil {
			return nil, err
		}
	}
	return s, nil
}

// The layouts of the records table (Store.layout).
const (
	layoutText    = 1 // release 0.1.0's: the fingerprint as text, the response as JSON
	layoutCompact = 2 // store.Fingerprint.Compact, store.Response.MarshalCompact
)

// readLayout learns the records table's layout from the type of its
// fingerprint column, once: Migrate reads it, or the first write after a
// New that did not migrate, through tx when it is a FinishTx (which must
// not need another of the pool's connections), else through the pool. A
// table that does not exist yet is taken as compact, as the migrations
// create it, but not remembered.
func (s *Store) readLayout(ctx context.Context, tx pgx.Tx) (int32, error) {
	if l := s.layout.Load(); l != 0 {
		return l, nil
	}
	query := s.pool.QueryRow
	if tx != nil {
		query = tx.QueryRow
	}
	var text bool
	err := query(ctx, `SELECT atttypid = 'text'::regtype FROM pg_attribute
		WHERE attrelid = to_regclass($1) AND attname = 'fingerprint' AND NOT attisdropped`,
		pgx.Identifier{s.schema, "records"}.Sanitize()).Scan(&text)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return layoutCompact, nil
	case err != nil:
		return 0, err
	case text:
		s.layout.Store(layoutText)
	default:
		s.layout.Store(layoutCompact)
	}
	return s.layout.Load(), nil
}

// fingerprint is f as the records table keeps it.
func (s *Store) fingerprint(ctx context.Context, f store.Fingerprint) (any, error) {
	l, err := s.readLayout(ctx, nil)
	if l == layoutText {
		return string(f), err
	}
	return f.Compact(), err
}

// columns are the records columns in the order scanRecord reads them.
const columns = `scope, key, state, fingerprint, token, fence, lease_expires, takeover_safe, response, created, updated, expires, checkpoints`

// acquireSQL is AcquireParams.Apply in one statement.
//
// cur reads the existing row and decides whether Apply would write it
// (must_write). When it would not (a replay, a running lease, an UNKNOWN
// record, a takeover refused for another payload), the INSERT gets no row to
// insert, so nothing is written or locked, and the statement returns cur.
// Otherwise the INSERT runs and ON CONFLICT decides again on the latest
// committed row, whose WHERE admits exactly the three cases Apply writes:
//
//   - an expired record, or a FAILED one: re-created (fence 1 over an expired
//     record, continued over a live FAILED one);
//   - IN_PROGRESS past its lease and TakeoverSafe, same fingerprint: taken
//     over (new token and lease, fence + 1);
//   - IN_PROGRESS past its lease and not TakeoverSafe: becomes UNKNOWN.
//
// Given that WHERE, the state of the old row tells the cases apart in the SET:
// in_progress and not takeover_safe is the UNKNOWN case, in_progress and
// takeover_safe the takeover, anything else a re-creation. The first two keep
// the checkpoints; a re-creation starts with none.
//
// The statement returns no row when the row changed between the statement's
// snapshot and the INSERT (see Store.Acquire).
const acquireSQL = `
WITH cur AS (
	SELECT ` + columns + `,
		(expires IS NOT NULL AND expires <= $5)
		OR state = 'failed'
		OR (state = 'in_progress' AND lease_expires <= $5 AND (NOT takeover_safe OR fingerprint = $3))
		AS must_write
	FROM {{table}}
	WHERE scope = $1 AND key = $2
), up AS (
	INSERT INTO {{table}} AS r (` + columns + `)
	SELECT $1::text, $2::text, 'in_progress', $3, $4::text, 1, $6::timestamptz, $7::boolean,
		NULL, $5::timestamptz, $5::timestamptz, NULL, NULL
	WHERE NOT EXISTS (SELECT FROM cur WHERE NOT cur.must_write)
	ON CONFLICT (scope, key) DO UPDATE SET
		state = CASE WHEN r.state = 'in_progress' AND NOT r.takeover_safe THEN 'unknown'
			ELSE 'in_progress' END,
		fingerprint = CASE WHEN r.state = 'in_progress' THEN r.fingerprint
			ELSE excluded.fingerprint END,
		token = CASE WHEN r.state = 'in_progress' AND NOT r.takeover_safe THEN r.token
			ELSE excluded.token END,
		fence = CASE WHEN r.state = 'in_progress' AND NOT r.takeover_safe THEN r.fence
			WHEN r.state = 'in_progress' THEN r.fence + 1
			WHEN r.state = 'failed' AND r.expires > excluded.updated THEN r.fence + 1
			ELSE 1 END,
		lease_expires = CASE WHEN r.state = 'in_progress' AND NOT r.takeover_safe THEN r.lease_expires
			ELSE excluded.lease_expires END,
		takeover_safe = CASE WHEN r.state = 'in_progress' AND NOT r.takeover_safe THEN r.takeover_safe
			ELSE excluded.takeover_safe END,
		response = NULL,
		created = CASE WHEN r.state = 'in_progress' THEN r.created
			ELSE excluded.created END,
		updated = excluded.updated,
		expires = NULL,
		checkpoints = CASE WHEN r.state = 'in_progress' THEN r.checkpoints
			ELSE NULL END
	WHERE (r.expires IS NOT NULL AND r.expires <= excluded.updated)
		OR r.state = 'failed'
		OR (r.state = 'in_progress' AND r.lease_expires <= excluded.updated
			AND (NOT r.takeover_safe OR r.fingerprint = excluded.fingerprint))
	RETURNING r.scope, r.key, r.state, r.fingerprint, r.token, r.fence, r.lease_expires,
		r.takeover_safe, r.response, r.created, r.updated, r.expires, r.checkpoints
)
SELECT ` + columns + ` FROM up
UNION ALL
SELECT ` + columns + ` FROM cur WHERE NOT cur.must_write`

// renewSQL is RenewParams.Apply: only a running lease under the token, before
// it runs out, is extended. (An IN_PROGRESS record never expires.)
const renewSQL = `
UPDATE {{table}} SET lease_expires = $5, updated = $4
WHERE scope = $1 AND key = $2 AND token = $3 AND state = 'in_progress' AND lease_expires > $4`

// checkpointSQL is CheckpointParams.Apply: like a renewal, only a running
// lease under the token, before it runs out, takes a checkpoint, which is
// appended to the stored ones and ends the record's takeover safety.
const checkpointSQL = `
UPDATE {{table}} SET checkpoints = coalesce(checkpoints, ''::bytea) || $5::bytea,
	takeover_safe = false, updated = $4
WHERE scope = $1 AND key = $2 AND token = $3 AND state = 'in_progress' AND lease_expires > $4`

// finishSQL is FinishParams.Apply: a running or unknown record under the
// token is settled, even past its lease. When $8 (Repeat), a repeat of the
// write that settled it (same token, terminal state and response) matches
// too, and writes nothing: the CASEs keep what is stored.
const finishSQL = `
UPDATE {{table}} SET
	response = CASE WHEN state IN ('in_progress', 'unknown') THEN $5 ELSE response END,
	expires = CASE WHEN state IN ('in_progress', 'unknown') THEN $6 ELSE expires END,
	updated = CASE WHEN state IN ('in_progress', 'unknown') THEN $7 ELSE updated END,
	state = $4
WHERE scope = $1 AND key = $2 AND token = $3 AND (state IN ('in_progress', 'unknown')
	OR ($8 AND state = $4 AND $4 IN ('completed', 'failed') AND response IS NOT DISTINCT FROM $5))`

// getSQL returns the live record: unsettled, or settled and not expired.
const getSQL = `
SELECT ` + columns + ` FROM {{table}}
WHERE scope = $1 AND key = $2 AND (expires IS NULL OR expires > $3)`

// scanSQL returns a page of stale records after the cursor (scope, key),
// walking the unsettled rows of records_due in key order and reading each
// record by its primary key; the state is checked on the record, since
// records_due may hold a row that is no longer true after it was rebuilt
// (see dueFillSQL). Keys are never empty, so the cursor made of an empty
// scope and an empty key starts after records_due's mark and before
// every record.
var scanSQL = `
SELECT ` + qualified("r", columns) + ` FROM {{due}} d JOIN {{table}} r ON r.scope = d.scope AND r.key = d.key
WHERE d.expires IS NULL AND (d.scope, d.key) > ($2, $3)
	AND r.state IN ('in_progress', 'unknown')
	AND (r.state = 'unknown' OR r.lease_expires <= $1)
ORDER BY d.scope, d.key
LIMIT $4`

// listSQL returns a page of the live records that match a filter, after
// the cursor (scope, key): $2 the states (empty: all), $3 and $4 the scope
// and key prefixes, $5 and $6 the creation range (NULL: open).
const listSQL = `
SELECT ` + columns + ` FROM {{table}}
WHERE (expires IS NULL OR expires > $1)
	AND (cardinality($2::text[]) = 0 OR state = ANY($2::text[]))
	AND starts_with(scope, $3) AND starts_with(key, $4)
	AND ($5::timestamptz IS NULL OR created >= $5)
	AND ($6::timestamptz IS NULL OR created < $6)
	AND (scope, key) > ($7, $8)
ORDER BY scope, key
LIMIT $9`

// pruneSQL deletes a batch of settled records that expired at or before $1.
// The inner SELECT finds them through records_due's expiry index, checks
// each on the record itself and locks it, skipping rows that another pruner
// or an acquirer holds; under READ COMMITTED the lock re-checks the condition
// on the latest version of each row, so a record re-created meanwhile is
// skipped, and once locked nobody can change it before the DELETE, which
// finds the rows by ctid (a TID scan: no second index walk). The trigger
// deletes their rows of records_due.
const pruneSQL = `
DELETE FROM {{table}}
WHERE ctid = ANY (ARRAY(
	SELECT r.ctid FROM {{due}} d JOIN {{table}} r ON r.scope = d.scope AND r.key = d.key
	WHERE d.expires <= $1 AND r.state IN ('completed', 'failed') AND r.expires <= $1
	LIMIT $2
	FOR UPDATE OF r SKIP LOCKED))`

// dueWholeSQL tells whether records_due holds its mark, the row of the
// empty scope and key (no record has an empty key), which
// a rebuild writes last (dueMarkSQL): PostgreSQL empties an unlogged table after a
// crash, and the migration that creates it leaves it empty.
const dueWholeSQL = `SELECT EXISTS (SELECT FROM {{due}} WHERE scope = '' AND key = '')`

// dueFillSQL copies into records_due the records after ($1, $2), in (scope,
// key) order, up to $3 of them, and returns how many it read and the last
// one's scope and key: one part of a rebuild, in a transaction of its own,
// so that a write waits at most for the part under way (a write whose row
// of records_due a rebuild has written but not committed waits for it),
// not for the whole rebuild. It runs while records are written: the
// triggers of a write that commits after its snapshot either find the row
// it wrote and update it, or write theirs first and it leaves them alone,
// so every row ends true, save one case: a record deleted after the
// snapshot whose row the rebuild then writes. Such a row names no record
// and is skipped by scans and prunes, which join records. It writes in
// (scope, key) order, the order in which batches lock records (and their
// triggers the rows here), so that it never waits on a batch that waits on
// it.
const dueFillSQL = `
WITH part AS (
	SELECT scope, key, expires FROM {{table}}
	WHERE (scope, key) > ($1::text, $2::text)
	ORDER BY scope, key
	LIMIT $3
), copied AS (
	INSERT INTO {{due}} (scope, key, expires)
	SELECT scope, key, expires FROM part ORDER BY scope, key
	ON CONFLICT (scope, key) DO NOTHING
)
SELECT (SELECT count(*) FROM part), last.scope, last.key
FROM (SELECT) AS one
LEFT JOIN LATERAL (SELECT scope, key FROM part ORDER BY scope DESC, key DESC LIMIT 1) AS last ON true`

// dueMarkSQL writes the mark that says records_due is whole, once a
// rebuild has copied every record.
const dueMarkSQL = `INSERT INTO {{due}} (scope, key, expires) VALUES ('', '', NULL) ON CONFLICT (scope, key) DO NOTHING`

// qualified prefixes each name of a comma-separated list of columns with
// the table alias a.
func qualified(a, columns string) string {
	return a + "." + strings.ReplaceAll(columns, ", ", ", "+a+".")
}

// Pool returns the store's connection pool, for an application that keeps
// its own tables beside the records and settles records in its own
// transactions ([Store.FinishTx]).
func (s *Store) Pool() *pgxpool.Pool { return s.pool }

// Schema is the schema the store's tables are in, as configured (not
// quoted): an application that keeps its own tables beside the records
// (the ledger that [Store.FinishTx] commits with them) may put them there.
func (s *Store) Schema() string { return s.schema }

// Acquire implements [store.Store] in one statement (see the package doc).
//
// Under READ COMMITTED the statement reads the existing row from its snapshot,
// but ON CONFLICT sees the latest committed row. When a concurrent transaction
// inserted or changed the row after the snapshot was taken, ON CONFLICT may
// find nothing to write while the snapshot shows no usable row, and the
// statement returns no row. Acquire then runs the statement again, with a
// fresh snapshot that sees the committed row, up to a few times; only steady
// contention on one key makes it give up, with [store.ErrUnavailable]. Nothing
// was written by an attempt that returned no row.
func (s *Store) Acquire(ctx context.Context, p store.AcquireParams) (store.Record, error) {
	if err := store.Ready(ctx, "pgstore", "acquire", p); err != nil {
		return store.Record{}, err
	}
	fingerprint, err := s.fingerprint(ctx, p.Fingerprint)
	if err != nil {
		return store.Record{}, translate("acquire", err)
	}
	for range acquireAttempts {
		w := &write{scope: p.Scope, key: p.Key, sql: s.acquireSQL, returns: true,
			args: []any{p.Scope, p.Key, fingerprint, p.Token, p.Now, p.LeaseExpires, p.TakeoverSafe}}
		if err := s.writes.Do(ctx, w); err != nil {
			return store.Record{}, translate("acquire", err)
		}
		if w.noRow {
			continue // the row changed after the snapshot: look again
		}
		r, err := w.row.decode()
		if err != nil {
			return store.Record{}, fmt.Errorf("pgstore: acquire: %w", err)
		}
		return r, nil
	}
	return store.Record{}, fmt.Errorf("pgstore: acquire: %w: the record changed under %d attempts in a row", store.ErrUnavailable, acquireAttempts)
}

// Renew implements [store.Store] with one UPDATE.
func (s *Store) Renew(ctx context.Context, p store.RenewParams) error {
	if err := store.Ready(ctx, "pgstore", "renew", p); err != nil {
		return err
	}
	n, err := s.exec(ctx, nil, s.renewSQL, p.Scope, p.Key, p.Token, p.Now, p.LeaseExpires)
	if err != nil {
		return translate("renew", err)
	}
	if n == 0 {
		return store.ErrLeaseLost
	}
	return nil
}

// Checkpoint implements [store.Store] with one UPDATE.
func (s *Store) Checkpoint(ctx context.Context, p store.CheckpointParams) error {
	if err := store.Ready(ctx, "pgstore", "checkpoint", p); err != nil {
		return err
	}
	n, err := s.exec(ctx, nil, s.checkpointSQL, p.Scope, p.Key, p.Token, p.Now, store.AppendCheckpoint(nil, p.Checkpoint()))
	if err != nil {
		return translate("checkpoint", err)
	}
	if n == 0 {
		return store.ErrLeaseLost
	}
	return nil
}

// Finish implements [store.Store] with one UPDATE.
func (s *Store) Finish(ctx context.Context, p store.FinishParams) error {
	return s.finish(ctx, nil, "finish", p)
}

// FinishTx settles a record like [Store.Finish], but inside the caller's
// transaction tx, so that the handler's own writes and the record's outcome
// commit together or not at all. A crash before the commit leaves neither, so
// work done this way can be declared TakeoverSafe. It is one statement in tx
// (two the first time a store New did not migrate writes: it reads the
// table's layout).
//
// [store.ErrLeaseLost] means the lease no longer owns the record: the caller
// must roll tx back, since a newer owner's outcome stands. Any other error
// also leaves tx unusable (PostgreSQL aborts the transaction). Use READ
// COMMITTED, PostgreSQL's default: under REPEATABLE READ or SERIALIZABLE,
// a write of the lease's own after tx's snapshot (a checkpoint, a renewal
// by [idem.Engine.Hold]) makes FinishTx fail with a serialization error,
// reported as [store.ErrUnavailable]; take checkpoints before tx begins.
//
//	tx, err := pool.Begin(ctx)
//	if err != nil {
//		return err
//	}
//	defer tx.Rollback(ctx) // a no-op once committed
//	if _, err := tx.Exec(ctx, "INSERT INTO ledger (account, amount) VALUES ($1, $2)", acct, amount); err != nil {
//		return err
//	}
//	return eng.Settle(ctx, lease, idem.Settlement{State: idem.StateCompleted, Response: resp,
//		Commit: func(ctx context.Context, p idem.FinishParams) error {
//			if err := records.FinishTx(ctx, tx, p); err != nil { // records: this *Store
//				return err // ErrLeaseLost: the deferred Rollback undoes the ledger write
//			}
//			return tx.Commit(ctx)
//		}})
func (s *Store) FinishTx(ctx context.Context, tx any, p store.FinishParams) error {
	ptx, ok := tx.(pgx.Tx)
	if !ok || ptx == nil {
		return fmt.Errorf("pgstore: finish in transaction: %w: %T is not a pgx.Tx", store.ErrInvalid, tx)
	}
	p.Repeat = false // the caller's writes in tx must never commit twice
	return s.finish(ctx, ptx, "finish in transaction", p)
}

// finish settles a record: in tx when given, else as one of a batch.
func (s *Store) finish(ctx context.Context, tx pgx.Tx, op string, p store.FinishParams) error {
	if err := p.Validate(); err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("pgstore: %s: %w", op, err)
	}
	var response, expires any // NULL unless set below
	if p.Response != nil {
		l, err := s.readLayout(ctx, tx)
		if err != nil {
			return translate(op, err)
		}
		encode := p.Response.MarshalCompact
		if l == layoutText {
			encode = p.Response.MarshalBinary
		}
		b, err := encode()
		if err != nil {
			return fmt.Errorf("pgstore: %s: encoding response: %w", op, err)
		}
		response = b
	}
	if !p.Expires.IsZero() {
		expires = p.Expires
	}
	n, err := s.exec(ctx, tx, s.finishSQL, p.Scope, p.Key, p.Token, string(p.State), response, expires, p.Now, p.Repeat)
	if err != nil {
		return translate(op, err)
	}
	if n == 0 {
		return store.ErrLeaseLost
	}
	return nil
}

// A write is one statement of a batch, on the record of scope and key
// (its first two arguments): the acquire statement, whose record is
// returned (row, decoded by its caller, or noRow when it returned none), or
// an UPDATE, whose rows affected are counted (n).
type write struct {
	scope, key string
	sql        string
	args       []any
	returns    bool
	row        stored
	noRow      bool
	n          int64
}

// answer runs w's statement through row (when it returns a record) or exec,
// and keeps what it answered.
func (w *write) answer(row func() pgx.Row, exec func() (pgconn.CommandTag, error)) error {
	if w.returns {
		err := w.row.scan(row())
		if w.noRow = errors.Is(err, pgx.ErrNoRows); w.noRow {
			return nil
		}
		return err
	}
	tag, err := exec()
	w.n = tag.RowsAffected()
	return err
}

// exec runs an UPDATE whose first two arguments are a record's scope and
// key, in tx when given, else as one of a batch, and returns the rows it
// affected.
func (s *Store) exec(ctx context.Context, tx pgx.Tx, sql string, args ...any) (int64, error) {
	if tx != nil {
		tag, err := tx.Exec(ctx, sql, args...)
		return tag.RowsAffected(), err
	}
	w := &write{scope: args[0].(string), key: args[1].(string), sql: sql, args: args}
	err := s.writes.Do(ctx, w)
	return w.n, err
}

// batch runs writes as one pipeline in one implicit transaction: one round
// trip, one commit. They run in the order of their scope and key, so that
// two batches (of this process or another) that touch the same records lock
// them in the same order and never deadlock; writes in a batch are
// concurrent calls, so any order is an order they could have run in. A
// statement that fails rolls the transaction back: it is reported failed and
// the others run again without it, so that what commits is exactly the
// writes reported done. A failure that is not the statement's (a connection
// lost) is every write's.
func (s *Store) batch(ctx context.Context, writes []*write) []error {
	run := make([]int, len(writes))
	for i := range run {
		run[i] = i
	}
	slices.SortStableFunc(run, func(a, b int) int {
		return cmp.Or(strings.Compare(writes[a].scope, writes[b].scope), strings.Compare(writes[a].key, writes[b].key))
	})
	return store.Isolate(run, func(run []int) (int, error) { return s.send(ctx, writes, run) })
}

// batchLockTimeoutSQL bounds how long a statement of a batch waits for a
// row that another transaction holds (a business transaction between its
// FinishTx and its COMMIT, a client gone from it while the server keeps it
// open): one write waiting would hold up every other write of its batch,
// and the rows they had locked, for as long as it waited. Past the timeout
// the statement fails (55P03, unavailable: its caller tries again) and the
// others run again without it. A write sent alone waits as long as its
// caller lets it, holding up nobody else.
const batchLockTimeoutSQL = `SELECT set_config('lock_timeout', '1s', true)`

// send runs the writes in run as one batch. When a statement fails it
// returns that write's position in run and its error; otherwise -1 and the
// batch's error (nil once committed).
func (s *Store) send(ctx context.Context, writes []*write, run []int) (int, error) {
	if len(run) == 1 { // alone: one statement costs less than a batch
		w := writes[run[0]]
		return -1, w.answer(func() pgx.Row { return s.pool.QueryRow(ctx, w.sql, w.args...) },
			func() (pgconn.CommandTag, error) { return s.pool.Exec(ctx, w.sql, w.args...) })
	}
	b := &pgx.Batch{}
	b.Queue(batchLockTimeoutSQL)
	for _, i := range run {
		b.Queue(writes[i].sql, writes[i].args...)
	}
	res := s.pool.SendBatch(ctx, b)
	if _, err := res.Exec(); err != nil {
		res.Close()
		return -1, err
	}
	for pos, i := range run {
		if err := writes[i].answer(res.QueryRow, res.Exec); err != nil {
			res.Close()
			if _, ok := errors.AsType[*pgconn.PgError](err); ok {
				return pos, err
			}
			return -1, err
		}
	}
	return -1, res.Close()
}

// Get implements [store.Store] with one SELECT.
func (s *Store) Get(ctx context.Context, p store.GetParams) (store.Record, error) {
	if err := store.Ready(ctx, "pgstore", "get", p); err != nil {
		return store.Record{}, err
	}
	r, err := scanRecord(s.pool.QueryRow(ctx, s.getSQL, p.Scope, p.Key, p.Now))
	if errors.Is(err, pgx.ErrNoRows) {
		return store.Record{}, store.ErrNotFound
	}
	if err != nil {
		return store.Record{}, translate("get", err)
	}
	return r, nil
}

// Scan implements [store.Store] with one SELECT per page. Pages are in byte
// order of scope, then key; the cursor holds the last scope and key
// returned ([store.EncodeCursor]).
func (s *Store) Scan(ctx context.Context, p store.ScanParams) (store.ScanResult, error) {
	if err := store.Ready(ctx, "pgstore", "scan", p); err != nil {
		return store.ScanResult{}, err
	}
	return s.page(ctx, "scan", s.scanSQL, p.Cursor, p.PageSize(), true, p.Now)
}

// List implements [store.Store] with one SELECT per page: the matching
// records in the order of their scope and key.
func (s *Store) List(ctx context.Context, p store.ListParams) (store.ScanResult, error) {
	if err := store.Ready(ctx, "pgstore", "list", p); err != nil {
		return store.ScanResult{}, err
	}
	states := make([]string, len(p.States))
	for i, st := range p.States {
		states[i] = string(st)
	}
	var from, before *time.Time
	if !p.CreatedFrom.IsZero() {
		from = &p.CreatedFrom
	}
	if !p.CreatedBefore.IsZero() {
		before = &p.CreatedBefore
	}
	return s.page(ctx, "list", s.listSQL, p.Cursor, p.PageSize(), false, p.Now, states, p.ScopePrefix, p.KeyPrefix, from, before)
}

// page runs query, whose last three parameters are the cursor's scope and
// key and a limit, and returns up to size of its records. When due, query
// reads records_due: it runs behind the check that records_due is whole, in
// the same round trip, and once more after a rebuild when it was not.
func (s *Store) page(ctx context.Context, op, query, cursor string, size int, due bool, args ...any) (store.ScanResult, error) {
	afterScope, afterKey := "", ""
	if cursor != "" {
		f, err := store.DecodeCursor(cursor, "pgstore:"+s.schema, 2)
		if err != nil {
			return store.ScanResult{}, err
		}
		afterScope, afterKey = f[0], f[1]
	}
	fetch := int64(size) // one more than a page tells whether another page follows
	if fetch < math.MaxInt64 {
		fetch++
	}
	args = append(args, afterScope, afterKey, fetch)
	var res store.ScanResult
	read := func(rows pgx.Rows, err error) error {
		if err != nil {
			return err
		}
		defer rows.Close()
		for rows.Next() {
			if len(res.Records) == size {
				last := res.Records[len(res.Records)-1]
				res.Cursor = store.EncodeCursor("pgstore:"+s.schema, last.Scope, last.Key)
				break
			}
			r, err := scanRecord(rows)
			if err != nil {
				return err
			}
			res.Records = append(res.Records, r)
		}
		rows.Close()
		return rows.Err()
	}
	if !due {
		if err := read(s.pool.Query(ctx, query, args...)); err != nil {
			return store.ScanResult{}, translate(op, err)
		}
		return res, nil
	}
	if err := s.dueChecked(ctx, query, args, func(b pgx.BatchResults) error { return read(b.Query()) },
		func() error { res = store.ScanResult{}; return read(s.pool.Query(ctx, query, args...)) }); err != nil {
		return store.ScanResult{}, translate(op, err)
	}
	return res, nil
}

// Prune implements [store.Store] with one DELETE per call, behind the
// check that records_due is whole, in the same round trip.
func (s *Store) Prune(ctx context.Context, p store.PruneParams) (int, error) {
	if err := store.Ready(ctx, "pgstore", "prune", p); err != nil {
		return 0, err
	}
	var n int64
	exec := func(tag pgconn.CommandTag, err error) error {
		n += tag.RowsAffected()
		return err
	}
	limit := int64(p.BatchSize())
	if err := s.dueChecked(ctx, s.pruneSQL, []any{p.Now, limit}, func(b pgx.BatchResults) error { return exec(b.Exec()) },
		func() error {
			if n == limit {
				return nil
			}
			return exec(s.pool.Exec(ctx, s.pruneSQL, p.Now, limit-n))
		}); err != nil {
		return 0, translate("prune", err)
	}
	return int(n), nil
}

// dueChecked sends dueWholeSQL and query, which reads records_due, in one
// batch, and has read take query's result. When records_due was not whole,
// it rebuilds it and has again run query once more: what query read or did
// was true, but may fall short.
func (s *Store) dueChecked(ctx context.Context, query string, args []any, read func(pgx.BatchResults) error, again func() error) error {
	b := &pgx.Batch{}
	b.Queue(s.dueWholeSQL)
	b.Queue(query, args...)
	res := s.pool.SendBatch(ctx, b)
	var whole bool
	err := res.QueryRow().Scan(&whole)
	if err == nil {
		err = read(res)
	}
	if cerr := res.Close(); err == nil {
		err = cerr
	}
	if err != nil || whole {
		return err
	}
	if err := s.rebuildDue(ctx); err != nil {
		return err
	}
	return again()
}

// rebuildDue has records_due filled from records (fillDue) and waits for it
// until ctx ends. The fill runs on its own, detached from ctx, and one at a
// time per store: it takes about 13 µs a record on a small server (27 s for
// 2 million), which may well outlast the caller's deadline, and a fill cut
// short would roll back and start over on every call. A caller whose
// deadline passes first gets [store.ErrUnavailable] (translate); the next
// finds the fill still running, or done.
func (s *Store) rebuildDue(ctx context.Context) error {
	s.filling.mu.Lock()
	f := s.filling.running
	if f == nil {
		f = &fill{done: make(chan struct{})}
		s.filling.running = f
		go func() {
			f.err = s.fillDue(context.WithoutCancel(ctx))
			s.filling.mu.Lock()
			s.filling.running = nil
			s.filling.mu.Unlock()
			close(f.done)
		}()
	}
	s.filling.mu.Unlock()
	select {
	case <-f.done:
		return f.err
	case <-ctx.Done():
		return fmt.Errorf("records_due is being rebuilt from records: %w", ctx.Err())
	}
}

// A fill is a run of fillDue: done is closed when it has ended, with err.
type fill struct {
	done chan struct{}
	err  error
}

// dueChunk is how many records one transaction of a rebuild copies.
const dueChunk = 10000

// A part of a rebuild waits at most dueLockTimeout for a row of
// records_due that another transaction wrote and has not committed (a
// business transaction between its FinishTx and its COMMIT): meanwhile the
// rows the part copied before it hold up the writes of their records. It
// then rolls back, steps aside for a moment and tries again, dueAttempts
// times, before the rebuild gives up until the next scan or prune.
const (
	dueLockTimeout = "200ms"
	dueAttempts    = 20
)

// errRebuiltElsewhere is a rebuild that another process is running.
var errRebuiltElsewhere = fmt.Errorf("%w: records_due is being rebuilt by another process", store.ErrUnavailable)

// fillDue rebuilds records_due, part by part (dueFillSQL), and then writes
// its mark, under a lock of the session (on a connection of its own, held
// across the parts) that makes a rebuild in another process step aside
// rather than repeat the work: it is unavailable, and holds no connection
// while the other one runs. The session's lock_timeout is dueLockTimeout
// meanwhile, and then as it was.
func (s *Store) fillDue(ctx context.Context) error {
	conn, err := s.pool.Acquire(ctx)
	if err != nil {
		return err
	}
	defer conn.Release()
	lock := lockKey("records_due", s.schema)
	var locked bool
	var was string
	if err := conn.QueryRow(ctx, `SELECT l.locked, l.was, CASE WHEN l.locked THEN set_config('lock_timeout', '`+dueLockTimeout+`', false) END
		FROM (SELECT pg_try_advisory_lock($1) AS locked, current_setting('lock_timeout') AS was) AS l`, lock).Scan(&locked, &was, nil); err != nil || !locked {
		if err == nil {
			err = errRebuiltElsewhere
		}
		return err
	}
	defer func() {
		if _, err := conn.Exec(ctx, "SELECT pg_advisory_unlock($1), set_config('lock_timeout', $2, false)", lock, was); err != nil {
			conn.Conn().Close(ctx) // never back to the pool with the lock held
		}
	}()
	var whole bool
	if err := conn.QueryRow(ctx, s.dueWholeSQL).Scan(&whole); err != nil || whole {
		return err // or rebuilt by another just before
	}
	scope, key := "", "" // before every record: keys are never empty
	for tries := 1; ; {
		var n int
		var lastScope, lastKey *string
		err := conn.QueryRow(ctx, s.dueFillSQL, scope, key, dueChunk).Scan(&n, &lastScope, &lastKey)
		if pgErr, ok := errors.AsType[*pgconn.PgError](err); ok && pgErr.Code == "55P03" && tries < dueAttempts {
			time.Sleep(migratePause(tries - 1)) // the part rolled back: its rows hold up no write meanwhile
			tries++
			continue
		}
		if err != nil {
			return err
		}
		tries = 1
		if n < dueChunk {
			break
		}
		scope, key = *lastScope, *lastKey
	}
	_, err = conn.Exec(ctx, s.dueMarkSQL)
	return err
}

// scanRecord reads one row of columns.
func scanRecord(row pgx.Row) (store.Record, error) {
	var st stored
	if err := st.scan(row); err != nil {
		return store.Record{}, err
	}
	return st.decode()
}

// stored is a row of columns as read, before its response and checkpoints
// are decoded: a batch reads every row it gets before any is decoded, so
// that a record this build cannot read is its caller's error alone.
type stored struct {
	r                          store.Record
	state                      string
	fingerprint, response, cps []byte
	expires                    *time.Time
}

func (st *stored) scan(row pgx.Row) error {
	r := &st.r
	return row.Scan(&r.Scope, &r.Key, &st.state, &st.fingerprint, &r.Token, &r.Fence, &r.LeaseExpires,
		&r.TakeoverSafe, &st.response, &r.Created, &r.Updated, &st.expires, &st.cps)
}

// decode returns the record. Its errors name no key or scope: an error may
// be logged, and keys are logged only as hashes.
func (st *stored) decode() (store.Record, error) {
	r := st.r
	r.State = store.State(st.state)
	var err error
	if r.Fingerprint, err = store.FingerprintFromCompact(st.fingerprint); err != nil {
		return store.Record{}, fmt.Errorf("stored record: %w", err)
	}
	r.LeaseExpires = r.LeaseExpires.UTC()
	r.Created = r.Created.UTC()
	r.Updated = r.Updated.UTC()
	if st.expires != nil {
		r.Expires = st.expires.UTC()
	}
	if st.response != nil {
		r.Response = new(store.Response)
		if err := r.Response.UnmarshalBinary(st.response); err != nil {
			return store.Record{}, fmt.Errorf("stored record: %w", err)
		}
	}
	if r.Checkpoints, err = store.DecodeCheckpoints(st.cps); err != nil {
		return store.Record{}, fmt.Errorf("stored record: %w", err)
	}
	return r, nil
}

var _ store.DurabilityReporter = (*Store)(nil)

// Durability implements [store.DurabilityReporter] from fsync and
// synchronous_commit, with the server's start time as its instance: a commit
// survives a crash when fsync is on and synchronous_commit is not off.
func (s *Store) Durability(ctx context.Context) (store.Durability, error) {
	var fsync, syncCommit, started string
	err := s.pool.QueryRow(ctx, `SELECT current_setting('fsync'), current_setting('synchronous_commit'),
		pg_postmaster_start_time()::text`).Scan(&fsync, &syncCommit, &started)
	if err != nil {
		return store.Durability{}, translate("durability", err)
	}
	d := store.Durability{Instance: started, Detail: "fsync=" + fsync + ", synchronous_commit=" + syncCommit}
	switch {
	case fsync != "on":
		d.Detail += ": a crash may lose or corrupt committed records"
	case syncCommit == "off":
		d.Detail += ": a crash loses the commits of the last moments (up to 3 × wal_writer_delay)"
	default:
		d.CrashSafe = true
		d.Detail += ": every commit is on disk before PostgreSQL answers"
	}
	return d, nil
}
