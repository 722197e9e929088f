package cli_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"io"
	mrand "math/rand/v2"
	"net"
	"net/http"
	"net/http/httptest"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/idemclient"
	"github.com/idemhq/idem/internal/payments"
	"github.com/idemhq/idem/internal/storeopen"
	"github.com/idemhq/idem/internal/testkit"
	"github.com/idemhq/idem/internal/wait"
)

// Chaos parameters: how many charges, how many clients at once.
const (
	chaosCharges = 2000
	chaosClients = 24
)

func TestChaosSQLite(t *testing.T) {
	runChaos(t, "sqlite:"+filepath.Join(t.TempDir(), "payments.db"))
}

func TestChaosPostgres(t *testing.T) {
	base := testkit.Server(t, "IDEM_TEST_DATABASE_URL")
	b := make([]byte, 6)
	rand.Read(b)
	schema := "chaos_" + hex.EncodeToString(b)
	conn, err := pgx.Connect(context.Background(), base)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	if _, err := conn.Exec(context.Background(), "CREATE SCHEMA "+schema); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		c, err := pgx.Connect(context.Background(), base)
		if err == nil {
			c.Exec(context.Background(), "DROP SCHEMA "+schema+" CASCADE")
			c.Close(context.Background())
		}
	})
	sep := "?"
	if strings.Contains(base, "?") {
		sep = "&"
	}
	runChaos(t, base+sep+"idem_schema="+schema+"&search_path="+schema)
}

// chaosClient is one client's view of one charge.
type chaosClient struct {
	status   int    // the final answer: 201 or 402
	body     string // its body
	attempts int
}

// runChaos drives chaosCharges charges through `idem demo` with the
// acquirer's faults on and clients that retry with the same key (random
// delays, concurrent duplicates), SIGKILLs the service a third of the way
// through and restarts it on the same database, lets the reconciler finish,
// and audits the ledger and the acquirer.
func runChaos(t *testing.T, store string) {
	if testing.Short() {
		t.Skip("the chaos test takes a while; run without -short")
	}
	acq := payments.NewAcquirer(false, 42) // no dedupe: only idem stands between a retry and a second charge
	acq.SetFaults(payments.Faults{Latency: payments.Duration(time.Millisecond), Decline: 0.1, Unavailable: 0.05, ResetBefore: 0.05, LostReply: 0.05})
	acquirer := httptest.NewServer(acq)
	defer acquirer.Close()

	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	api := "http://" + addr
	var proc atomic.Pointer[exec.Cmd]
	journal := filepath.Join(t.TempDir(), "journal")
	start := func() {
		cmd := exec.Command(idemBin, "demo", "--listen", addr, "--acquirer", acquirer.URL, "--store", store, "--admin-listen", "127.0.0.1:0",
			"--journal-dir", journal,
			"--lease", "2s", "--grace", "3s", "--reconcile-every", "300ms")
		cmd.Stdout, cmd.Stderr = io.Discard, io.Discard
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		proc.Store(cmd)
		deadline := time.Now().Add(30 * time.Second)
		for {
			if resp, err := http.Get(api + "/v1/customers/probe/balance"); err == nil {
				resp.Body.Close()
				if resp.StatusCode == 200 {
					return
				}
			}
			if time.Now().After(deadline) {
				t.Fatal("idem demo did not come up")
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	start()
	t.Cleanup(func() {
		if cmd := proc.Load(); cmd != nil {
			cmd.Process.Kill()
			cmd.Wait()
		}
	})

	var sent, conflicts, uncertain, unavailable, neterrs, duplicates atomic.Int64
	// The clients retry through idemclient: the same key on every attempt,
	// backoff with jitter, Retry-After honoured; it rides out network
	// errors, 409 in progress, 502, 503 and 504 by itself.
	client := &http.Client{Timeout: 10 * time.Second, Transport: idemclient.New(idemclient.Config{
		Base:       &http.Transport{MaxIdleConnsPerHost: chaosClients * 2},
		MaxElapsed: 20 * time.Second, MaxAttempts: 50, BaseDelay: 5 * time.Millisecond, MaxDelay: 200 * time.Millisecond,
		OnRetry: func(_ int, resp *http.Response, err error, _ time.Duration) {
			sent.Add(1)
			switch {
			case err != nil:
				neterrs.Add(1)
			case resp.StatusCode == 409:
				conflicts.Add(1)
			default:
				unavailable.Add(1)
			}
		},
	})}
	// attempt sends one charge until it gets a final answer; it waits out
	// what idemclient does not retry: 409 operation-uncertain (until the
	// reconciler settles it) and a 500.
	attempt := func(key, body string, rng *mrand.Rand) chaosClient {
		var c chaosClient
		deadline := time.Now().Add(90 * time.Second)
		for time.Now().Before(deadline) {
			c.attempts++
			sent.Add(1)
			req, _ := http.NewRequest("POST", api+"/v1/charges", strings.NewReader(body))
			req.Header.Set("Authorization", "Bearer sk_chaos")
			req.Header.Set("Idempotency-Key", key)
			resp, err := client.Do(req)
			if err == nil {
				b, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				switch {
				case resp.StatusCode == 201 || resp.StatusCode == 402:
					c.status, c.body = resp.StatusCode, string(b)
					return c
				case resp.StatusCode == 409 && strings.Contains(string(b), "operation-uncertain"):
					uncertain.Add(1)
				case resp.StatusCode >= 500:
					unavailable.Add(1)
				default:
					t.Errorf("key %s: unexpected answer %d %s", key, resp.StatusCode, b)
					return c
				}
			} else {
				neterrs.Add(1)
			}
			time.Sleep(time.Duration(100+rng.IntN(200)) * time.Millisecond)
		}
		t.Errorf("key %s: no final answer after %d attempts", key, c.attempts)
		return c
	}

	keys := make(chan int)
	results := make([]chaosClient, chaosCharges)
	bodies := make([]string, chaosCharges)
	var done atomic.Int64
	var wg sync.WaitGroup
	for w := range chaosClients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := mrand.New(mrand.NewPCG(uint64(w), 7))
			for i := range keys {
				key := fmt.Sprintf("chaos-%05d", i)
				bodies[i] = fmt.Sprintf(`{"amount":%d,"currency":"eur","customer":"cus_%d"}`, 100+rng.IntN(9900), rng.IntN(20))
				if rng.IntN(100) < 15 { // a concurrent duplicate, as a double-clicking user sends
					duplicates.Add(1)
					dup := make(chan chaosClient)
					go func() { dup <- attempt(key, bodies[i], mrand.New(mrand.NewPCG(uint64(i), 9))) }()
					results[i] = attempt(key, bodies[i], rng)
					if d := wait.Recv(t, dup, 3*time.Minute, "the concurrent duplicate's final answer"); d.status != results[i].status || d.body != results[i].body {
						t.Errorf("key %s: duplicates saw different outcomes: %d %s / %d %s", key, results[i].status, results[i].body, d.status, d.body)
					}
				} else {
					results[i] = attempt(key, bodies[i], rng)
				}
				done.Add(1)
			}
		}()
	}
	killed := make(chan struct{})
	go func() {
		defer close(killed)
		for done.Load() < chaosCharges/3 {
			time.Sleep(10 * time.Millisecond)
		}
		cmd := proc.Load()
		cmd.Process.Kill() // SIGKILL, mid-run
		cmd.Wait()
		start()
	}()
	began := time.Now()
	for i := range chaosCharges {
		keys <- i
	}
	close(keys)
	wait.Done(t, 10*time.Minute, "every client to get a final answer", wg.Wait)
	wait.Recv(t, killed, time.Minute, "the killed service to restart")
	elapsed := time.Since(began)

	// Let the reconciler settle everything the acquirer can answer.
	acq.SetFaults(payments.Faults{})
	opened, err := storeopen.Open(context.Background(), store)
	if err != nil {
		t.Fatal(err)
	}
	defer opened.Close()
	eng, _ := idem.New(idem.Config{Store: opened.Store})
	deadline := time.Now().Add(30 * time.Second)
	for {
		res, err := eng.Scan(context.Background(), 0, "")
		if err != nil {
			t.Fatal(err)
		}
		if len(res.Records) == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d records still unsettled after the reconciler ran, e.g. %+v", len(res.Records), res.Records[0])
		}
		time.Sleep(100 * time.Millisecond)
	}

	// The audit.
	db, err := payments.NewDB(opened.Store)
	if err != nil {
		t.Fatal(err)
	}
	var doubleDebits, debits, ledgerSum int64
	if err := db.QueryRow(context.Background(), `SELECT COUNT(*) FROM (SELECT idem_key FROM payments_ledger GROUP BY idem_scope, idem_key HAVING COUNT(*) > 1) d`).Scan(&doubleDebits); err != nil {
		t.Fatal(err)
	}
	if err := db.QueryRow(context.Background(), `SELECT COUNT(*), COALESCE(SUM(amount), 0) FROM payments_ledger`).Scan(&debits, &ledgerSum); err != nil {
		t.Fatal(err)
	}
	debitsOf := func(key string) int64 {
		var n int64
		if err := db.QueryRow(context.Background(), `SELECT COUNT(*) FROM payments_ledger WHERE idem_key = ?`, key).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	doubleCharges, approved, approvedSum := 0, 0, int64(0)
	chargedRefs := map[string]int{}
	for _, ps := range acq.AllCharges() {
		if len(ps) > 1 {
			doubleCharges++
		}
		for _, p := range ps {
			chargedRefs[p.Reference]++
			if p.Status == "approved" {
				approved++
				approvedSum += p.Amount
			}
		}
	}
	succeeded, declined, attempts := 0, 0, 0
	for i, r := range results {
		key := fmt.Sprintf("chaos-%05d", i)
		attempts += r.attempts
		switch r.status {
		case 201:
			succeeded++
			if n := debitsOf(key); n != 1 {
				t.Errorf("key %s: the client saw success, and it was debited %d times", key, n)
			}
		case 402:
			declined++
			if n := debitsOf(key); n != 0 {
				t.Errorf("key %s: the client saw a decline, and it was debited %d times", key, n)
			}
		}
		if chargedRefs[key] > 1 {
			t.Errorf("key %s: charged %d times at the acquirer", key, chargedRefs[key])
		}
	}
	stats := acq.Stats()
	t.Logf("%s: %d charges in %v by %d clients (%d with a concurrent duplicate), 1 SIGKILL + restart", strings.SplitN(store, ":", 2)[0], chaosCharges, elapsed.Round(time.Millisecond), chaosClients, duplicates.Load())
	t.Logf("requests sent %d (retries %d): 409 in progress %d, 409 uncertain %d, 5xx %d, network errors %d",
		sent.Load(), sent.Load()-int64(chaosCharges)-duplicates.Load(), conflicts.Load(), uncertain.Load(), unavailable.Load(), neterrs.Load())
	t.Logf("acquirer: %d authorizations, %d charges (%d approved); faults injected: %d unavailable, %d resets before charging, %d replies lost after charging",
		stats.Requests, stats.Charges, stats.Approved, stats.Unavailable, stats.ResetsBefore, stats.LostReplies)
	t.Logf("outcomes: %d succeeded, %d declined; ledger: %d debits; double debits %d, double charges %d", succeeded, declined, debits, doubleDebits, doubleCharges)
	if doubleDebits != 0 || doubleCharges != 0 || stats.DuplicateKeys != 0 {
		t.Errorf("double debits %d, double charges %d, authorizations re-sent for a charged key %d: all must be 0", doubleDebits, doubleCharges, stats.DuplicateKeys)
	}
	if succeeded+declined != chaosCharges {
		t.Errorf("%d of %d charges got a final answer", succeeded+declined, chaosCharges)
	}
	// Money: every approved charge is debited exactly once, nothing else is.
	if int(debits) != approved || -ledgerSum != approvedSum || succeeded != approved {
		t.Errorf("ledger %d debits totalling %d; acquirer %d approved totalling %d; clients saw %d succeed", debits, -ledgerSum, approved, approvedSum, succeeded)
	}
	if stats.LostReplies == 0 || stats.ResetsBefore == 0 || stats.Unavailable == 0 {
		t.Errorf("the faults did not fire: %+v", stats)
	}
}
