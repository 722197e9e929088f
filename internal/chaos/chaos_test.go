package chaos_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"flag"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemhq/idem/internal/chaos"
	"github.com/idemhq/idem/internal/faultnet"
	"github.com/idemhq/idem/internal/testbin"
	"github.com/idemhq/idem/internal/testkit"
)

// The size of a run. CI runs the defaults; RELIABILITY.md's figures come
// from, e.g.:
//
//	go test ./internal/chaos -run Chaos -v -timeout 3h -chaos.ops 100000
var (
	ops       = flag.Int("chaos.ops", 1200, "operations per store")
	clients   = flag.Int("chaos.clients", 24, "operations at once")
	proxies   = flag.Int("chaos.proxies", 3, "idem proxy processes sharing the store")
	killEvery = flag.Duration("chaos.kill-every", 2*time.Second, "how often a proxy is SIGKILLed (on average)")
	outageFor = flag.Duration("chaos.outage", 5*time.Second, "how long the store outage lasts")
	report    = flag.String("chaos.report", "", "append each store's report to this file")
)

var idemBin string

func TestMain(m *testing.M) {
	flag.Parse()
	testbin.Main(m, &idemBin)
}

// config is a run's configuration with the faults every store gets.
func config(t *testing.T, store string) chaos.Config {
	return chaos.Config{
		Bin: idemBin, Store: store, Dir: t.TempDir(),
		Ops: *ops, Clients: *clients, Proxies: *proxies,
		Duplicates: 0.1, Bodyless: 0.5,
		ClientFaults:   faultnet.Faults{DropReply: 0.03, DropRequest: 0.01},
		UpstreamFaults: faultnet.Faults{DropReply: 0.02, DropRequest: 0.01},
		KillEvery:      *killEvery,
		OpTimeout:      2 * time.Minute,
		Logf:           t.Logf,
	}
}

// run runs the suite on cfg and fails the test if an invariant broke or if
// a fault every store gets did not happen (see floors); it returns the
// report for the store's own floors.
func run(t *testing.T, cfg chaos.Config) *chaos.Report {
	t.Helper()
	rep, err := chaos.Run(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Log(rep)
	if *report != "" {
		f, err := os.OpenFile(*report, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
		if err != nil {
			t.Fatal(err)
		}
		fmt.Fprintf(f, "%s\n%s\n\n", time.Now().UTC().Format(time.RFC3339), rep)
		f.Close()
	}
	if !rep.OK() {
		for _, name := range []string{"proxy-0.log", "reconcile.log"} {
			if b, err := os.ReadFile(filepath.Join(cfg.Dir, name)); err == nil {
				t.Logf("%s (last 3000 bytes):\n%s", name, tail(b, 3000))
			}
		}
		for _, v := range rep.Violations {
			t.Errorf("violation: %s", v) // one line each, so that CI's summary shows them
		}
		t.Fatalf("an invariant broke:\n%s", rep)
	}
	floors(t, rep)
	return rep
}

// floors fails the test unless each fault every store gets happened at
// least once, so that the zeros are not those of a run without faults. At
// CI's size (1,200 operations, 1,800 requests or more) each is expected
// several times over: measured, 5 to 10 SIGKILLs, 14 to 101 lost replies
// and 11 to 29 cut requests on each side.
//
// Every upstream reply lost to a proxy leaves a record UNKNOWN, which only
// the reconciler settles, by asking the upstream: so once one was lost (which
// is required), at least one operation must have gone to the reconciler.
func floors(t *testing.T, rep *chaos.Report) {
	t.Helper()
	for _, f := range []struct {
		what string
		n    int64
	}{
		{"proxies SIGKILLed while running", int64(rep.Kills)},
		{"client replies lost", rep.ClientRepliesLost},
		{"client requests cut", rep.ClientRequestsCut},
		{"upstream replies lost", rep.UpstreamRepliesLost},
		{"upstream requests cut", rep.UpstreamRequestsCut},
		{"operations the reconciler asked the upstream about", int64(rep.Reconciled)},
	} {
		if f.n == 0 {
			t.Errorf("the faults did not fire: want at least one of %s, got none", f.what)
		}
	}
	if t.Failed() {
		t.FailNow()
	}
}

// storeFloors fails the test unless the store's own faults happened: a cut
// of its connections terminated at least one, and the outage took place and
// was recovered from.
func storeFloors(t *testing.T, rep *chaos.Report) {
	t.Helper()
	if rep.StoreCuts == 0 {
		t.Errorf("want at least one store cut that terminated a connection, got none")
	}
	if rep.Outages != 1 {
		t.Errorf("want one store outage, got %d", rep.Outages)
	}
	if rep.Recovery <= 0 {
		t.Errorf("want the recovery after the outage measured (a request served after it), got none within the bound")
	}
}

func tail(b []byte, n int) []byte {
	if len(b) > n {
		return b[len(b)-n:]
	}
	return b
}

// TestChaosSQLite: three proxies on one SQLite file on this machine.
func TestChaosSQLite(t *testing.T) {
	run(t, config(t, "sqlite:"+filepath.Join(t.TempDir(), "chaos.db")))
}

// TestChaosPostgres: three proxies on PostgreSQL through a TCP fault proxy;
// their connections are cut now and then (by the fault proxy, and by
// pg_terminate_backend on the server), and the server is unreachable once,
// for a while.
func TestChaosPostgres(t *testing.T) {
	base := testkit.Server(t, "IDEM_TEST_DATABASE_URL")
	u, err := url.Parse(base)
	if err != nil {
		t.Fatal(err)
	}
	faults, err := faultnet.Listen(u.Host)
	if err != nil {
		t.Fatal(err)
	}
	defer faults.Close()
	var b [6]byte
	rand.Read(b[:])
	schema := "idem_chaos_" + hex.EncodeToString(b[:])
	admin, err := pgx.Connect(context.Background(), base)
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close(context.Background())
	defer admin.Exec(context.Background(), "DROP SCHEMA IF EXISTS "+schema+" CASCADE")
	u.Host = faults.Addr()
	q := u.Query()
	q.Set("idem_schema", schema)
	q.Set("application_name", "idem-chaos")
	u.RawQuery = q.Encode()
	cfg := config(t, u.String())
	// Alternately by the fault proxy and by the server. The counts are
	// written by the suite's cut loop only, and read once Run has returned.
	cuts, byProxy, byServer := 0, 0, 0
	cfg.CutStore = func() int {
		if cuts++; cuts%2 == 0 {
			n := faults.CutAll()
			byProxy += n
			return n
		}
		var n int
		err := admin.QueryRow(context.Background(),
			`SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = 'idem-chaos'`).Scan(&n)
		if err != nil {
			t.Errorf("pg_terminate_backend: %v", err)
		}
		byServer += n
		return n
	}
	cfg.CutEvery = 3 * time.Second
	cfg.Outage, cfg.OutageFor = faults.Outage, *outageFor
	rep := run(t, cfg)
	storeFloors(t, rep)
	t.Logf("store connections cut: %d by the fault proxy, %d by pg_terminate_backend", byProxy, byServer)
	if byProxy == 0 || byServer == 0 {
		t.Errorf("want store connections cut both by the fault proxy and by pg_terminate_backend, got %d and %d", byProxy, byServer)
	}
}

// TestChaosRedisCluster: three proxies on a Redis Cluster of the suite's own
// whose every node is reached through a TCP fault proxy; connections are
// cut now and then, and the whole cluster is unreachable once.
func TestChaosRedisCluster(t *testing.T) {
	testkit.Server(t, "IDEM_TEST_REDIS_URL") // Redis is there (the suite starts a cluster of its own)
	cluster, err := chaos.StartRedisCluster(context.Background(), t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	defer cluster.Stop()
	cfg := config(t, cluster.DSN("chaos"))
	cfg.CutStore = func() int {
		n := 0
		for _, f := range cluster.Faults {
			n += f.CutAll()
		}
		return n
	}
	cfg.CutEvery = 3 * time.Second
	cfg.Outage = func() func() {
		ends := make([]func(), len(cluster.Faults))
		for i, f := range cluster.Faults {
			ends[i] = f.Outage()
		}
		return func() {
			for _, end := range ends {
				end()
			}
		}
	}
	cfg.OutageFor = *outageFor
	storeFloors(t, run(t, cfg))
}
