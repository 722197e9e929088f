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

func run(t *testing.T, cfg chaos.Config) {
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
	if rep.Kills == 0 || rep.ClientRepliesLost == 0 || rep.UpstreamRepliesLost == 0 {
		t.Fatalf("the faults did not fire: %s", rep)
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
	cuts := 0
	cfg.CutStore = func() {
		if cuts++; cuts%2 == 0 {
			faults.CutAll()
			return
		}
		admin.Exec(context.Background(), `SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = 'idem-chaos'`)
	}
	cfg.CutEvery = 3 * time.Second
	cfg.Outage, cfg.OutageFor = faults.Outage, *outageFor
	run(t, cfg)
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
	cfg.CutStore = func() {
		for _, f := range cluster.Faults {
			f.CutAll()
		}
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
	run(t, cfg)
}
