package pgstore_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemhq/idem/internal/testkit"
	"github.com/idemhq/idem/store/pgstore"
)

// envURL names the variable that points the tests at a PostgreSQL server.
const envURL = "IDEM_TEST_DATABASE_URL"

var shared struct {
	once sync.Once
	pool *pgxpool.Pool
	err  error
}

func TestMain(m *testing.M) {
	testkit.Main(m, func() {
		if shared.pool != nil {
			shared.pool.Close()
		}
	})
}

// databaseURL returns the test server's URL, or skips the test.
func databaseURL(tb testing.TB) string {
	tb.Helper()
	return testkit.Server(tb, envURL)
}

// sharedPool returns the pool every test of this binary shares.
func sharedPool(tb testing.TB) *pgxpool.Pool {
	tb.Helper()
	url := databaseURL(tb)
	shared.once.Do(func() {
		shared.pool, shared.err = pgxpool.New(context.Background(), url)
	})
	if shared.err != nil {
		tb.Fatalf("connecting to %s: %v", envURL, shared.err)
	}
	return shared.pool
}

// newSchema returns a fresh schema name, dropped with everything in it when
// the test ends. The schema itself is not created.
func newSchema(tb testing.TB) string {
	tb.Helper()
	pool := sharedPool(tb)
	var b [8]byte
	if _, err := rand.Read(b[:]); err != nil {
		tb.Fatal(err)
	}
	schema := "idem_test_" + hex.EncodeToString(b[:])
	tb.Cleanup(func() {
		if _, err := pool.Exec(context.Background(), "DROP SCHEMA IF EXISTS "+pgx.Identifier{schema}.Sanitize()+" CASCADE"); err != nil {
			tb.Errorf("dropping schema %s: %v", schema, err)
		}
	})
	return schema
}

// newStore returns a store on the shared pool in a schema of its own.
func newStore(tb testing.TB) (*pgstore.Store, string) {
	tb.Helper()
	schema := newSchema(tb)
	s, err := pgstore.New(context.Background(), pgstore.Config{Pool: sharedPool(tb), Schema: schema})
	if err != nil {
		tb.Fatalf("New: %v", err)
	}
	return s, schema
}

// queryCounter is a pgx QueryTracer and BatchTracer that counts the
// statements sent (n: each Query, QueryRow or Exec is one, and each
// statement of a batch) and the round trips (trips: a statement alone, or a
// batch).
type queryCounter struct{ n, trips atomic.Int64 }

func (c *queryCounter) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	c.n.Add(1)
	c.trips.Add(1)
	return ctx
}

func (c *queryCounter) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func (c *queryCounter) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	c.trips.Add(1)
	return ctx
}

func (c *queryCounter) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {
	c.n.Add(1)
}

func (c *queryCounter) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}

// countingPool returns a pool of at most maxConns connections to the test
// server whose queries c counts. It is closed when the test ends. It never
// pings a connection before handing it out (pgxpool does by default after a
// second idle), since a ping is a round trip the tracer would not see.
func countingPool(tb testing.TB, maxConns int32) (*pgxpool.Pool, *queryCounter) {
	tb.Helper()
	cfg, err := pgxpool.ParseConfig(databaseURL(tb))
	if err != nil {
		tb.Fatal(err)
	}
	c := &queryCounter{}
	cfg.ConnConfig.Tracer = c
	cfg.MaxConns = maxConns
	cfg.ShouldPing = func(context.Context, pgxpool.ShouldPingParams) bool { return false }
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(pool.Close)
	return pool, c
}

// countedStore returns a store in a schema of its own (migrated on the
// shared pool) on a pool of at most maxConns connections whose statements
// the counter counts (countingPool).
func countedStore(tb testing.TB, maxConns int32) (*pgstore.Store, string, *pgxpool.Pool, *queryCounter) {
	tb.Helper()
	_, schema := newStore(tb)
	pool, counter := countingPool(tb, maxConns)
	s, err := pgstore.New(context.Background(), pgstore.Config{Pool: pool, Schema: schema, NoMigrate: true})
	if err != nil {
		tb.Fatal(err)
	}
	return s, schema, pool, counter
}

// table returns the quoted name of a table in schema.
func table(schema, name string) string { return pgx.Identifier{schema, name}.Sanitize() }
