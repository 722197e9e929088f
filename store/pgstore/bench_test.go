package pgstore_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemhq/idem/internal/testkit"
	"github.com/idemhq/idem/store"
	"github.com/idemhq/idem/store/pgstore"
	"github.com/idemhq/idem/store/storetest"
)

// The benchmarks run on a pool of one connection, so ns/op is the latency a
// single caller sees; every write is its own commit, as in production. The
// raw benchmarks do the same work with bare statements on a bare table of
// the same shape in the same schema, to show what the store adds.

type bench struct {
	store   *pgstore.Store
	schema  string
	pool    *pgxpool.Pool // one connection, counted
	counter *queryCounter
}

func newBench(b *testing.B) bench {
	b.Helper()
	s, schema, pool, counter := countedStore(b, 1)
	return bench{store: s, schema: schema, pool: pool, counter: counter}
}

func token(b *testing.B) string {
	t, err := store.NewToken()
	if err != nil {
		b.Fatal(err)
	}
	return t
}

func BenchmarkAcquireComplete(b *testing.B) {
	x := newBench(b)
	storetest.BenchAcquireComplete(b, x.store, x.counter.n.Load)
}

// BenchmarkAcquireCompleteParallel: BenchmarkAcquireComplete from many
// goroutines at once on the shared pool, whose writes share batches.
func BenchmarkAcquireCompleteParallel(b *testing.B) {
	s, _ := newStore(b)
	storetest.BenchAcquireCompleteParallel(b, s)
}

func BenchmarkReplay(b *testing.B) {
	x := newBench(b)
	storetest.BenchReplay(b, x.store, x.counter.n.Load)
}

// rawTable creates a bare table shaped like records (same columns, types and
// primary key; no checks, no partial indexes) and returns its name.
func (x bench) rawTable(b *testing.B) string {
	b.Helper()
	name := table(x.schema, "raw")
	if _, err := sharedPool(b).Exec(ctx, `CREATE TABLE `+name+` (
		scope text COLLATE "C" NOT NULL, key text COLLATE "C" NOT NULL, state text NOT NULL,
		fingerprint bytea NOT NULL, token text NOT NULL, fence bigint NOT NULL,
		lease_expires timestamptz NOT NULL, takeover_safe boolean NOT NULL, response bytea,
		created timestamptz NOT NULL, updated timestamptz NOT NULL, expires timestamptz, checkpoints bytea,
		PRIMARY KEY (scope, key))`); err != nil {
		b.Fatal(err)
	}
	return name
}

func BenchmarkRawInsertUpdate(b *testing.B) {
	x := newBench(b)
	name := x.rawTable(b)
	insert := `INSERT INTO ` + name + ` (scope, key, state, fingerprint, token, fence, lease_expires, takeover_safe, created, updated)
		VALUES ($1, $2, 'in_progress', $3, $4, 1, $5, false, $6, $6)`
	update := `UPDATE ` + name + ` SET state = 'completed', response = $3, expires = $4, updated = $5
		WHERE scope = $1 AND key = $2`
	response, err := testkit.BenchResponse().MarshalCompact()
	if err != nil {
		b.Fatal(err)
	}
	f, now := fp("a").Compact(), time.Now()
	testkit.Measure(b, x.counter.n.Load, func(i int) {
		key := fmt.Sprintf("key-%08d", i)
		if _, err := x.pool.Exec(ctx, insert, "tenant", key, f, token(b), now.Add(30*time.Second), now); err != nil {
			b.Fatal(err)
		}
		if _, err := x.pool.Exec(ctx, update, "tenant", key, response, now.Add(24*time.Hour), now); err != nil {
			b.Fatal(err)
		}
	})
}

func BenchmarkRawSelect(b *testing.B) {
	x := newBench(b)
	name := x.rawTable(b)
	response, err := testkit.BenchResponse().MarshalCompact()
	if err != nil {
		b.Fatal(err)
	}
	now := time.Now()
	if _, err := x.pool.Exec(ctx, `INSERT INTO `+name+` VALUES ('tenant', 'key', 'completed', $1, 'first', 1, $2, false, $3, $4, $4, $5)`,
		fp("a").Compact(), now.Add(30*time.Second), response, now, now.Add(24*time.Hour)); err != nil {
		b.Fatal(err)
	}
	query := `SELECT scope, key, state, fingerprint, token, fence, lease_expires, takeover_safe, response, created, updated, expires, checkpoints
		FROM ` + name + ` WHERE scope = $1 AND key = $2`
	testkit.Measure(b, x.counter.n.Load, func(int) {
		var (
			scope, key, state, tok         string
			fence                          int64
			leaseExpires, created, updated time.Time
			takeoverSafe                   bool
			fingerprint, resp, checkpoints []byte
			expires                        *time.Time
		)
		if err := x.pool.QueryRow(ctx, query, "tenant", "key").Scan(&scope, &key, &state, &fingerprint, &tok, &fence,
			&leaseExpires, &takeoverSafe, &resp, &created, &updated, &expires, &checkpoints); err != nil {
			b.Fatal(err)
		}
	})
}
