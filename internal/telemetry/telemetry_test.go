package telemetry_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"go.opentelemetry.io/otel"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/httpidem"
	"github.com/idemhq/idem/internal/telemetry"
	"github.com/idemhq/idem/internal/testbin"
	"github.com/idemhq/idem/internal/testkit"
	"github.com/idemhq/idem/reconcile"
	"github.com/idemhq/idem/store"
	"github.com/idemhq/idem/store/memstore"
	"github.com/idemhq/idem/store/sqlitestore"
)

var idemBin string

func TestMain(m *testing.M) { testbin.Main(m, &idemBin) }

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

// badEndpoint has a password with a / in it, not percent-encoded: url reads
// "pa" as a port, and the URL does not parse.
const badEndpoint = "http://collector:pa/ss-S3CRET@127.0.0.1:4318"

// jsonLog sends the SDK's lines to a JSON log for the test, and back to the
// process's default log after it.
func jsonLog(t *testing.T) *testkit.SyncBuffer {
	t.Helper()
	buf := &testkit.SyncBuffer{}
	telemetry.SetLogger(slog.New(slog.NewJSONHandler(buf, &slog.HandlerOptions{Level: slog.LevelDebug})))
	t.Cleanup(func() { telemetry.SetLogger(slog.Default()) })
	return buf
}

// checkJSONLines fails the test if a line of log is not JSON or holds one
// of secrets.
func checkJSONLines(t *testing.T, log string, secrets ...string) {
	t.Helper()
	for _, line := range strings.Split(strings.TrimSpace(log), "\n") {
		if line == "" {
			continue
		}
		if !json.Valid([]byte(line)) {
			t.Errorf("a log line is not JSON: %s", line)
		}
		for _, secret := range secrets {
			if strings.Contains(line, secret) {
				t.Errorf("a log line holds the secret %q: %s", secret, line)
			}
		}
	}
}

// TestAnUnparsableEndpointIsRefused: an endpoint whose password has a / in
// it is refused, by the name of its variable, and neither the error nor a
// log line shows the password: one url.Parse refuses, and one whose start
// url.Parse reads as a port (it was accepted, the password in the path). (The SDK logged the whole URL, then sent the
// traces to https://localhost:4318.)
func TestAnUnparsableEndpointIsRefused(t *testing.T) {
	for _, name := range []string{"OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"} {
		for _, value := range []string{badEndpoint, "collector:4318", "http:///v1/traces",
			// A password whose start reads as a port: url.Parse succeeds,
			// with the host "collector:" and the rest in the path.
			"http://collector:/pa-S3CRET@127.0.0.1:4318", "http://collector:2024/S3CRET@127.0.0.1:4318"} {
			t.Run(name+"="+value, func(t *testing.T) {
				log := jsonLog(t)
				tel, err := telemetry.New(context.Background(), envOf(map[string]string{name: value}))
				if err == nil {
					tel.Shutdown(context.Background())
					t.Fatalf("New accepted %s=%s", name, value)
				}
				if !errors.Is(err, idem.ErrInvalid) || !strings.Contains(err.Error(), "$"+name+":") {
					t.Errorf("error %q: want idem.ErrInvalid, naming $%s", err, name)
				}
				for _, secret := range []string{"S3CRET", "pa/ss"} {
					if strings.Contains(err.Error(), secret) {
						t.Errorf("the error holds the password: %s", err)
					}
				}
				checkJSONLines(t, log.String(), "S3CRET", "pa/ss")
			})
		}
	}
	// Traces off: idem does not read the variable, nor does the SDK.
	tel, err := telemetry.New(context.Background(), envOf(map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": badEndpoint, "OTEL_TRACES_EXPORTER": "none"}))
	if err != nil {
		t.Fatalf("with OTEL_TRACES_EXPORTER=none: %v", err)
	}
	tel.Shutdown(context.Background())
}

// TestSDKLinesFollowTheLogger: what the SDK logs by itself (its logger's
// lines, the errors it hands its error handler) goes to SetLogger's logger,
// as JSON lines without a URL's password nor a header's token.
func TestSDKLinesFollowTheLogger(t *testing.T) {
	log := jsonLog(t)
	// The SDK reads the headers from the process's environment; one it
	// cannot parse, it logs.
	t.Setenv("OTEL_EXPORTER_OTLP_HEADERS", "Authorization Bearer-T0KEN")
	failing := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Error(w, "no", http.StatusBadRequest)
	}))
	defer failing.Close()
	tel, err := telemetry.New(context.Background(), envOf(map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": strings.Replace(failing.URL, "://", "://collector:S3CRET@", 1)}))
	if err != nil {
		t.Fatal(err)
	}
	srv, _ := serve(t, tel)
	post(t, srv.URL, "k", "a")
	tel.Shutdown(context.Background()) // its export fails: the collector answers 400
	otel.Handle(errors.New(`traces export: Post "http://collector:S3CRET@127.0.0.1:4318/v1/traces": connection refused`))
	out := log.String()
	for _, want := range []string{`"msg":"parse headers"`, `"sdk":"opentelemetry"`, `"err":"traces export: Post \"http://collector:xxxxx@127.0.0.1:4318/v1/traces\": connection refused"`} {
		if !strings.Contains(out, want) {
			t.Errorf("the log lacks %s:\n%s", want, out)
		}
	}
	checkJSONLines(t, out, "S3CRET", "T0KEN")
}

// TestProxyRefusesAnUnparsableEndpoint runs `idem proxy --log-format json`
// with an endpoint whose password has a / in it: it refuses to start, by the
// variable's name, and its standard error never shows the password; every
// line but that last word is JSON. (It started, exporting to
// https://localhost:4318, after the SDK had written the URL, password
// included, twice, in plain text.)
func TestProxyRefusesAnUnparsableEndpoint(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, idemBin, "proxy", "--log-format", "json", "--listen", "127.0.0.1:0",
		"--upstream", "http://127.0.0.1:1", "--store", "memory:", "--journal-dir", filepath.Join(t.TempDir(), "journal"))
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "OTEL_") && !strings.HasPrefix(kv, "IDEM_") {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	cmd.Env = append(cmd.Env, "OTEL_EXPORTER_OTLP_ENDPOINT="+badEndpoint)
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	var lines []string
	for scan := bufio.NewScanner(stderr); scan.Scan(); {
		lines = append(lines, scan.Text())
		if strings.Contains(scan.Text(), "idem proxy listening") {
			t.Error("idem proxy started")
			cmd.Process.Signal(os.Interrupt) // its stop ends the loop
		}
	}
	err = cmd.Wait()
	if ctx.Err() != nil {
		t.Fatalf("idem proxy did not stop within a minute: %q", lines)
	}
	var exit *exec.ExitError
	if !errors.As(err, &exit) || exit.ExitCode() != 2 {
		t.Errorf("exit: %v; want status 2 (invalid configuration)", err)
	}
	const refusal = "idem proxy: telemetry: $OTEL_EXPORTER_OTLP_ENDPOINT: "
	logged := lines
	if len(lines) == 0 || !strings.HasPrefix(lines[len(lines)-1], refusal) {
		t.Errorf("the last line is not %q…: %q", refusal, lines)
	} else {
		logged = lines[:len(lines)-1] // the command's last word, plain text like every start-up failure's
	}
	checkJSONLines(t, strings.Join(logged, "\n"))
	for _, line := range lines {
		for _, secret := range []string{"S3CRET", "pa/ss"} {
			if strings.Contains(line, secret) {
				t.Errorf("standard error holds the password: %s", line)
			}
		}
	}
}
