package telemetry_test

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/httpidem"
	"github.com/idemhq/idem/internal/telemetry"
	"github.com/idemhq/idem/reconcile"
	"github.com/idemhq/idem/store"
	"github.com/idemhq/idem/store/memstore"
	"github.com/idemhq/idem/store/sqlitestore"
)

func envOf(m map[string]string) func(string) string { return func(k string) string { return m[k] } }

// serve puts a handler behind the middleware, the telemetry's store wrapper
// and its request spans, as the proxy does.
func serve(t *testing.T, tel *telemetry.Telemetry) (*httptest.Server, *idem.Engine) {
	t.Helper()
	eng, _ := idem.New(idem.Config{Store: tel.Store("memory", memstore.New())})
	mw, _ := httpidem.New(httpidem.Config{Engine: eng, Observe: tel.Observe})
	srv := httptest.NewServer(tel.Wrap(mw.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(201)
	}))))
	t.Cleanup(srv.Close)
	return srv, eng
}

func post(t *testing.T, url, key, body string) {
	t.Helper()
	req, _ := http.NewRequest("POST", url, strings.NewReader(body))
	req.Header.Set("Idempotency-Key", key)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
}

func TestMetrics(t *testing.T) {
	tel, err := telemetry.New(context.Background(), envOf(nil))
	if err != nil {
		t.Fatal(err)
	}
	srv, eng := serve(t, tel)
	post(t, srv.URL, "k", "a")
	post(t, srv.URL, "k", "a")
	post(t, srv.URL, "k", "b")
	out, err := eng.Begin(context.Background(), idem.BeginParams{Key: "lost", Fingerprint: idem.NewFingerprint(idem.Payload{})})
	if err != nil {
		t.Fatal(err)
	}
	out.Lease.Token = strings.Repeat("0", 32)
	eng.Renew(context.Background(), out.Lease) // refused: a lost lease
	tel.OnPass(reconcile.Report{Stale: 3, Waiting: 1, Unknown: 2, Completed: 4})

	rec := httptest.NewRecorder()
	tel.Metrics().ServeHTTP(rec, httptest.NewRequest("GET", "/metrics", nil))
	body := rec.Body.String()
	for _, want := range []string{
		`idem_requests_total{outcome="executed"} 1`,
		`idem_requests_total{outcome="replayed"} 1`,
		`idem_requests_total{outcome="mismatch"} 1`,
		// The first request, its replay and the lost one; the replay put the
		// outcome in the engine's cache, which answers the mismatch.
		`idem_store_operation_duration_seconds_count{operation="acquire",result="ok",store="memory"} 3`,
		`idem_store_operation_duration_seconds_count{operation="finish",result="ok",store="memory"} 1`,
		`idem_store_operation_duration_seconds_count{operation="renew",result="lease_lost",store="memory"} 1`,
		`idem_leases_lost_total 1`,
		`idem_reconciler_records{kind="unknown"} 2`,
		`idem_reconciler_settled_total{outcome="completed"} 4`,
		`go_goroutines`,
	} {
		if !strings.Contains(body, want) {
			t.Errorf("metrics lack %s", want)
		}
	}
	// The console reads the same counters.
	c := tel.Counts()
	if req := c.Requests; req["executed"] != 1 || req["replayed"] != 1 || req["mismatch"] != 1 || c.StoreCalls != 5 || c.StoreErrors != 0 ||
		c.Reconciled["completed"] != 4 || c.LastPass["unknown"] != 2 {
		t.Errorf("Counts() = %+v; want 1 executed, replayed, mismatch, 5 store calls (3 acquires, a finish, a renew), none failed, 4 reconciled as completed, 2 unknown in the last pass", c)
	}
}

// receiver is an OTLP/HTTP trace endpoint that keeps what it gets.
type receiver struct {
	mu     sync.Mutex
	bodies [][]byte
}

func (r *receiver) ServeHTTP(w http.ResponseWriter, req *http.Request) {
	b, _ := io.ReadAll(req.Body)
	r.mu.Lock()
	if req.URL.Path == "/v1/traces" && req.Header.Get("Content-Type") == "application/x-protobuf" {
		r.bodies = append(r.bodies, b)
	}
	r.mu.Unlock()
}

func (r *receiver) got(name string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, b := range r.bodies {
		if bytes.Contains(b, []byte(name)) {
			return true
		}
	}
	return false
}

func TestTracesExportedWhenConfigured(t *testing.T) {
	collector := &receiver{}
	otlp := httptest.NewServer(collector)
	defer otlp.Close()
	tel, err := telemetry.New(context.Background(), envOf(map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": otlp.URL, "OTEL_SERVICE_NAME": "payments-test"}))
	if err != nil {
		t.Fatal(err)
	}
	srv, _ := serve(t, tel)
	post(t, srv.URL+"/v1/charges", "k", "a")
	if err := tel.Shutdown(context.Background()); err != nil { // flushes
		t.Fatal(err)
	}
	for _, name := range []string{"POST /v1/charges", "idem.store.acquire", "idem.store.finish", "payments-test", "idem.outcome"} {
		if !collector.got(name) {
			t.Errorf("no exported span mentions %q", name)
		}
	}
}

func TestTracesOffWhenExporterIsNone(t *testing.T) {
	collector := &receiver{}
	otlp := httptest.NewServer(collector)
	defer otlp.Close()
	tel, err := telemetry.New(context.Background(), envOf(map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": otlp.URL, "OTEL_TRACES_EXPORTER": "none"}))
	if err != nil {
		t.Fatal(err)
	}
	srv, _ := serve(t, tel)
	post(t, srv.URL, "k", "a")
	tel.Shutdown(context.Background())
	if collector.got("idem.store.acquire") {
		t.Fatal("spans exported with OTEL_TRACES_EXPORTER=none")
	}
}

// TestFinishTxIsMeasured: a record settled in the application's own
// transaction goes through the wrapper like every other store call.
func TestFinishTxIsMeasured(t *testing.T) {
	tel, err := telemetry.New(context.Background(), envOf(nil))
	if err != nil {
		t.Fatal(err)
	}
	s, err := sqlitestore.Open(context.Background(), sqlitestore.Config{Path: filepath.Join(t.TempDir(), "idem.db")})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	measured := tel.Store("sqlite", s)
	eng, _ := idem.New(idem.Config{Store: measured})
	out, err := eng.Begin(context.Background(), idem.BeginParams{Key: "k", Fingerprint: idem.NewFingerprint(idem.Payload{})})
	if err != nil {
		t.Fatal(err)
	}
	tx, err := s.DB().BeginTx(context.Background(), nil)
	if err != nil {
		t.Fatal(err)
	}
	err = eng.Settle(context.Background(), out.Lease, idem.Settlement{State: idem.StateCompleted, Response: &idem.Response{Status: 201},
		Commit: func(ctx context.Context, p idem.FinishParams) error {
			if err := measured.(store.TxFinisher).FinishTx(ctx, tx, p); err != nil {
				return err
			}
			return tx.Commit()
		}})
	if err != nil {
		t.Fatal(err)
	}
	if store.Unwrap(measured) != store.Store(s) {
		t.Fatal("the wrapper does not unwrap to the store it measures")
	}
	rec := httptest.NewRecorder()
	tel.Metrics().ServeHTTP(rec, httptest.NewRequest("GET", "/metrics", nil))
	if !strings.Contains(rec.Body.String(), `idem_store_operation_duration_seconds_count{operation="finish_tx",result="ok",store="sqlite"} 1`) {
		t.Fatalf("/metrics lacks the transactional finish:\n%s", rec.Body.String())
	}
}
