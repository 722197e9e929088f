package payments_test

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/payments"
	"github.com/idemhq/idem/internal/testkit"
	"github.com/idemhq/idem/reconcile"
	"github.com/idemhq/idem/store/pgstore"
	"github.com/idemhq/idem/store/sqlitestore"
	"github.com/idemhq/idem/store/storetest"
	"github.com/idemhq/idem/verify"
)

type fixture struct {
	acq   *payments.Acquirer
	api   *httptest.Server
	svc   *payments.Service
	eng   *idem.Engine
	clock *storetest.Clock
	// authorized receives when the acquirer has done with an authorization
	// (charged, answered, dropped or given up on it).
	authorized chan struct{}
}

func newFixture(t *testing.T) *fixture {
	t.Helper()
	return newFixtureOn(t, sqliteStore(t))
}

// newFixtureOn is newFixture on a store of the caller's.
func newFixtureOn(t *testing.T, store idem.Store) *fixture {
	t.Helper()
	acq := payments.NewAcquirer(false, 1)
	authorized := make(chan struct{}, 64)
	acqSrv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/authorize" {
			defer func() {
				select {
				case authorized <- struct{}{}:
				default: // nobody is counting
				}
			}()
		}
		acq.ServeHTTP(w, r)
	}))
	t.Cleanup(acqSrv.Close)
	f := newServiceOn(t, store, acqSrv.URL, io.Discard)
	f.acq, f.authorized = acq, authorized
	return f
}

// newServiceOn serves the service on store, calling the acquirer at
// acquirerURL and logging to log; the fixture has no acquirer of its own.
func newServiceOn(t *testing.T, store idem.Store, acquirerURL string, log io.Writer) *fixture {
	t.Helper()
	clock := storetest.NewClock(time.Now())
	eng, _ := idem.New(idem.Config{Store: store, Clock: clock})
	db, err := payments.NewDB(store)
	if err != nil {
		t.Fatal(err)
	}
	svc, err := payments.New(payments.Config{Engine: eng, DB: db, AcquirerURL: acquirerURL, AcquirerTimeout: time.Second,
		Logger: slog.New(slog.NewTextHandler(log, nil))})
	if err != nil {
		t.Fatal(err)
	}
	if err := svc.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	h, err := svc.Handler()
	if err != nil {
		t.Fatal(err)
	}
	api := httptest.NewServer(h)
	t.Cleanup(api.Close)
	return &fixture{api: api, svc: svc, eng: eng, clock: clock}
}

func (f *fixture) do(t *testing.T, method, path, key, body string) (int, map[string]any) {
	t.Helper()
	req, _ := http.NewRequest(method, f.api.URL+path, strings.NewReader(body))
	req.Header.Set("Authorization", "Bearer sk_test")
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var v map[string]any
	json.NewDecoder(resp.Body).Decode(&v)
	return resp.StatusCode, v
}

func TestChargeLifecycle(t *testing.T) {
	f := newFixture(t)
	// Invalid input stores nothing: the corrected request may use the key.
	if code, _ := f.do(t, "POST", "/v1/charges", "k1", `{"amount":-1,"currency":"eur","customer":"cus_1"}`); code != 400 {
		t.Fatalf("invalid charge: %d", code)
	}
	code, ch := f.do(t, "POST", "/v1/charges", "k1", `{"amount":250,"currency":"eur","customer":"cus_1"}`)
	if code != 201 || ch["status"] != "succeeded" {
		t.Fatalf("charge: %d %v", code, ch)
	}
	if code, again := f.do(t, "POST", "/v1/charges", "k1", `{"currency":"eur","customer":"cus_1","amount":250}`); code != 201 || again["id"] != ch["id"] {
		t.Fatalf("retry (keys reordered): %d %v", code, again)
	}
	if code, got := f.do(t, "GET", "/v1/charges/"+ch["id"].(string), "", ""); code != 200 || got["amount"] != 250.0 {
		t.Fatalf("GET charge: %d %v", code, got)
	}
	if code, _ := f.do(t, "GET", "/v1/charges/ch_nope", "", ""); code != 404 {
		t.Fatalf("GET a missing charge: %d", code)
	}
	if code, b := f.do(t, "GET", "/v1/customers/cus_1/balance", "", ""); code != 200 || balance(b, "eur") != -250 || b["debits"] != 1.0 {
		t.Fatalf("balance: %d %v", code, b)
	}
	if code, _ := f.do(t, "POST", "/v1/charges", "", `{"amount":1,"currency":"eur","customer":"cus_1"}`); code != 400 {
		t.Fatalf("charge without a key: %d", code)
	}

	f.acq.SetFaults(payments.Faults{Decline: 1})
	if code, d := f.do(t, "POST", "/v1/charges", "k2", `{"amount":99,"currency":"eur","customer":"cus_1"}`); code != 402 || d["status"] != "declined" {
		t.Fatalf("declined charge: %d %v", code, d)
	}
	if code, _ := f.do(t, "POST", "/v1/charges", "k2", `{"amount":99,"currency":"eur","customer":"cus_1"}`); code != 402 {
		t.Fatalf("a decline is an outcome, replayed: %d", code)
	}
	if s := f.acq.Stats(); s.Charges != 2 || s.DuplicateKeys != 0 {
		t.Fatalf("acquirer: %+v; want two charges, none repeated", s)
	}
}

// TestLostReplyIsReconciled: the acquirer charges and the reply is lost; the
// charge is uncertain until the reconciler asks the acquirer, then the retry
// gets the charge, debited once, and the acquirer charged once.
func TestLostReplyIsReconciled(t *testing.T) {
	f := newFixture(t)
	f.acq.SetFaults(payments.Faults{LostReply: 1})
	if code, _ := f.do(t, "POST", "/v1/charges", "k", `{"amount":700,"currency":"usd","customer":"cus_2"}`); code != 502 {
		t.Fatalf("lost reply: %d", code)
	}
	f.acq.SetFaults(payments.Faults{})
	if code, p := f.do(t, "POST", "/v1/charges", "k", `{"amount":700,"currency":"usd","customer":"cus_2"}`); code != 409 || !strings.Contains(p["type"].(string), "operation-uncertain") {
		t.Fatalf("retry before reconciling: %d %v", code, p)
	}
	r, _ := reconcile.New(reconcile.Config{Engine: f.eng, Resolver: f.svc, Grace: time.Second, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if rep, err := r.RunOnce(context.Background()); err != nil || rep.Waiting != 1 {
		t.Fatalf("a record marked unknown a moment ago is left alone: %+v, %v", rep, err)
	}
	f.clock.Advance(time.Second)
	rep, err := r.RunOnce(context.Background())
	if err != nil || rep.Completed != 1 {
		t.Fatalf("reconcile: %+v, %v", rep, err)
	}
	code, ch := f.do(t, "POST", "/v1/charges", "k", `{"amount":700,"currency":"usd","customer":"cus_2"}`)
	if code != 201 || ch["status"] != "succeeded" || ch["amount"] != 700.0 {
		t.Fatalf("retry after reconciling: %d %v", code, ch)
	}
	if code, b := f.do(t, "GET", "/v1/customers/cus_2/balance", "", ""); code != 200 || balance(b, "usd") != -700 || b["debits"] != 1.0 {
		t.Fatalf("balance: %v", b)
	}
	if s := f.acq.Stats(); s.Charges != 1 || s.DuplicateKeys != 0 {
		t.Fatalf("acquirer: %+v", s)
	}
}

// TestUnreachableAcquirerReleases: the acquirer answered 503 before
// charging: nothing happened, and the retry charges once.
func TestUnreachableAcquirerReleases(t *testing.T) {
	f := newFixture(t)
	f.acq.SetFaults(payments.Faults{Unavailable: 1})
	if code, _ := f.do(t, "POST", "/v1/charges", "k", `{"amount":5,"currency":"eur","customer":"cus_3"}`); code != 503 {
		t.Fatalf("acquirer busy: %d", code)
	}
	f.acq.SetFaults(payments.Faults{})
	if code, _ := f.do(t, "POST", "/v1/charges", "k", `{"amount":5,"currency":"eur","customer":"cus_3"}`); code != 201 {
		t.Fatalf("retry: %d", code)
	}
	if s := f.acq.Stats(); s.Charges != 1 {
		t.Fatalf("acquirer charged %d times", s.Charges)
	}
}

// TestProblemsSayWhetherToRetry: the service's problems say, in
// Stripe-Should-Retry, whether the same request may get another answer:
// a busy acquirer yes, an invalid charge no. (httpidem says it for its own
// types only: the service's got no header, and its 409 settled-elsewhere,
// whose retry gets the charge, was final to idemclient.)
func TestProblemsSayWhetherToRetry(t *testing.T) {
	f := newFixture(t)
	send := func(key, body string) (int, string) {
		t.Helper()
		req, _ := http.NewRequest("POST", f.api.URL+"/v1/charges", strings.NewReader(body))
		req.Header.Set("Authorization", "Bearer sk_test")
		req.Header.Set("Idempotency-Key", key)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode, resp.Header.Get("Stripe-Should-Retry")
	}
	f.acq.SetFaults(payments.Faults{Unavailable: 1})
	if code, retry := send("k-busy", `{"amount":5,"currency":"eur","customer":"cus_3"}`); code != 503 || retry != "true" {
		t.Errorf("acquirer busy: %d, Stripe-Should-Retry %q; want 503 and true", code, retry)
	}
	if code, retry := send("k-invalid", `{"amount":0,"currency":"eur","customer":"cus_3"}`); code != 400 || retry != "false" {
		t.Errorf("invalid charge: %d, Stripe-Should-Retry %q; want 400 and false", code, retry)
	}
}

// TestInvalidChargeSaysWhy: a charge that is not valid gets a problem with a
// title a person reads and a detail that names what is wrong; the example
// it gives is accepted.
func TestInvalidChargeSaysWhy(t *testing.T) {
	f := newFixture(t)
	for body, want := range map[string]string{
		``: "empty",
		`{"amount":0,"currency":"eur","customer":"cus_1"}`:       "amount 0",
		`{"amount":100,"currency":"EUR","customer":"cus_1"}`:     `currency "EUR"`,
		`{"amount":100,"currency":"eur","customer":"a b"}`:       `customer "a b"`,
		`{"amount":100,"currency":"eur","customer":"c","tip":1}`: `unknown field "tip"`,
		`{"amount":"100","currency":"eur","customer":"cus_1"}`:   "not a charge",
		// A second value after the charge, or a stray brace: not one charge.
		`{"amount":1000,"currency":"eur","customer":"cus_1"} {"amount":999999}`: "more after the charge",
		`{"amount":1000,"currency":"eur","customer":"cus_1"}}`:                  "not a charge",
	} {
		code, p := f.do(t, "POST", "/v1/charges", "k-invalid", body)
		detail, _ := p["detail"].(string)
		if code != 400 || p["title"] != "Invalid charge" || !strings.Contains(detail, want) {
			t.Errorf("%s: %d %v; want 400, title Invalid charge, a detail saying %q", body, code, p, want)
		}
	}
	if code, ch := f.do(t, "POST", "/v1/charges", "k-invalid", `{"amount":1000,"currency":"eur","customer":"cus_1"}`); code != 201 {
		t.Fatalf("the example the errors give: %d %v", code, ch)
	}
}

// TestAmbiguousChargeRefused: a charge that names a member twice, or not
// exactly as documented, is refused and reaches no acquirer: encoding/json
// took the last of two "amount"s (and "AMOUNT" for "amount"), so a gateway,
// a WAF or a log pipeline that reads the first saw another charge than the
// one made. The corrected charge may reuse the key.
func TestAmbiguousChargeRefused(t *testing.T) {
	f := newFixture(t)
	for i, c := range []struct{ body, want string }{
		{`{"amount":100000,"currency":"eur","customer":"cus_1","amount":1}`, `"amount" twice`},
		{`{"amount":100000,"currency":"eur","customer":"cus_1","AMOUNT":1}`, `"AMOUNT"`},
		{`{"Amount":1,"currency":"eur","customer":"cus_1"}`, `"Amount"`},
		{`{"amount":1,"currency":"eur","customer":"cus_1","customer":"cus_2"}`, `"customer" twice`},
	} {
		code, p := f.do(t, "POST", "/v1/charges", fmt.Sprint("k-ambiguous-", i), c.body)
		detail, _ := p["detail"].(string)
		if code != 400 || p["title"] != "Invalid charge" || !strings.Contains(detail, c.want) {
			t.Errorf("%s: %d %v; want 400, title Invalid charge, a detail saying %s", c.body, code, p, c.want)
		}
	}
	if s := f.acq.Stats(); s.Requests != 0 {
		t.Errorf("acquirer: %+v; want no authorization for an ambiguous charge", s)
	}
	if code, ch := f.do(t, "POST", "/v1/charges", "k-ambiguous-0", `{"amount":1,"currency":"eur","customer":"cus_1"}`); code != 201 {
		t.Fatalf("the corrected charge, same key: %d %v", code, ch)
	}
}

// TestChargeBodyHasOneLimit: a charge body is at most 64 KiB, which the
// middleware enforces (413, before any record is made), and one under it is
// read whole: a second value anywhere in it is "more after the charge". (The
// middleware let 1 MiB through and the handler read the first 64 KiB only:
// a second value past that was never seen, and the charge ran.)
func TestChargeBodyHasOneLimit(t *testing.T) {
	f := newFixture(t)
	const limit = 64 << 10
	charge, second := `{"amount":1000,"currency":"eur","customer":"cus_1"}`, `{"amount":999999}`
	if code, p := f.do(t, "POST", "/v1/charges", "k-full", charge+strings.Repeat(" ", limit-len(charge))); code != 201 {
		t.Errorf("a charge padded to %d bytes: %d %v; want 201", limit, code, p)
	}
	near := charge + strings.Repeat(" ", limit-len(charge)-len(second)) + second
	if code, p := f.do(t, "POST", "/v1/charges", "k-near", near); code != 400 || !strings.Contains(fmt.Sprint(p["detail"]), "more after the charge") {
		t.Errorf("a second value at the end of %d bytes: %d %v; want 400, more after the charge", len(near), code, p)
	}
	far := charge + strings.Repeat(" ", 70000) + second
	if code, p := f.do(t, "POST", "/v1/charges", "k-far", far); code != http.StatusRequestEntityTooLarge {
		t.Errorf("a second value past 64 KiB: %d %v; want 413", code, p)
	}
	if code, ch := f.do(t, "POST", "/v1/charges", "k-far", charge); code != 201 {
		t.Errorf("the charge alone, with the key of the one too large: %d %v; want 201", code, ch)
	}
	if s := f.acq.Stats(); s.Charges != 2 {
		t.Errorf("acquirer: %+v; want 2 charges", s)
	}
}

// TestAcquirerURL: the acquirer's URL may end in a slash (every
// authorization went to //authorize, whose 404 was taken for a charge the
// acquirer made and did not answer: a 502 and an UNKNOWN record); one that
// is not an http(s) URL with a host is refused, without its password.
func TestAcquirerURL(t *testing.T) {
	acq := payments.NewAcquirer(true, 1)
	srv := httptest.NewServer(acq)
	t.Cleanup(srv.Close)
	f := newServiceOn(t, sqliteStore(t), srv.URL+"/", io.Discard)
	if code, p := f.do(t, "POST", "/v1/charges", "k", `{"amount":1000,"currency":"eur","customer":"cus_1"}`); code != 201 {
		t.Fatalf("acquirer URL %s/: %d %v; want 201", srv.URL, code, p)
	}
	st := sqliteStore(t)
	eng, _ := idem.New(idem.Config{Store: st})
	db, _ := payments.NewDB(st)
	for _, bad := range []string{"127.0.0.1:8090", "localhost:8090", "ftp://acquirer/", "http://", "http:///authorize",
		"/acquirer", "http://acquirer/?v=1", "http://user:hunter2@acquirer:8090/#x"} {
		_, err := payments.New(payments.Config{Engine: eng, DB: db, AcquirerURL: bad})
		if !errors.Is(err, idem.ErrInvalid) || !strings.Contains(fmt.Sprint(err), "acquirer URL") || strings.Contains(fmt.Sprint(err), "hunter2") {
			t.Errorf("acquirer URL %q: %v; want ErrInvalid naming the acquirer URL, without its password", bad, err)
		}
	}
}

// TestAcquirerAnswers: an acquirer that answers 4xx charged nothing: the
// service says it is misconfigured (500 internal), logs the status, and
// releases the key, so the retry charges once the acquirer is put right.
// One that answers 5xx may have charged: the record is UNKNOWN for the
// reconciler. (Every answer but 200 and 503 was taken for one that never
// came: 502 acquirer-silent, UNKNOWN.)
func TestAcquirerAnswers(t *testing.T) {
	acq := payments.NewAcquirer(false, 1)
	var answer atomic.Int64 // the acquirer's answer to an authorization instead of charging; 0: it charges
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if status := answer.Load(); status != 0 && r.URL.Path == "/authorize" {
			http.Error(w, `{"error":"no"}`, int(status))
			return
		}
		acq.ServeHTTP(w, r)
	}))
	t.Cleanup(srv.Close)
	var log testkit.SyncBuffer
	f := newServiceOn(t, sqliteStore(t), srv.URL, &log)
	body := `{"amount":1000,"currency":"eur","customer":"cus_1"}`
	for _, status := range []int{http.StatusNotFound, http.StatusBadRequest} {
		answer.Store(int64(status))
		code, p := f.do(t, "POST", "/v1/charges", "k", body)
		if code != 500 || !strings.HasSuffix(fmt.Sprint(p["type"]), "#internal") {
			t.Errorf("the acquirer answers %d: %d %v; want 500 internal", status, code, p)
		}
		if want := fmt.Sprintf("acquirer answered %d", status); !strings.Contains(log.String(), want) {
			t.Errorf("the log says:\n%s\nwant a line saying %q", log.String(), want)
		}
	}
	answer.Store(0)
	if code, p := f.do(t, "POST", "/v1/charges", "k", body); code != 201 {
		t.Fatalf("the retry once the acquirer charges: %d %v; want 201 (the key released)", code, p)
	}
	answer.Store(http.StatusInternalServerError)
	if code, p := f.do(t, "POST", "/v1/charges", "k5", body); code != 502 || !strings.HasSuffix(fmt.Sprint(p["type"]), "#acquirer-silent") {
		t.Errorf("the acquirer answers 500: %d %v; want 502 acquirer-silent", code, p)
	}
	if code, p := f.do(t, "POST", "/v1/charges", "k5", body); code != 409 || !strings.Contains(fmt.Sprint(p["type"]), "operation-uncertain") {
		t.Errorf("its retry: %d %v; want 409 operation-uncertain (the record UNKNOWN)", code, p)
	}
	if !strings.Contains(log.String(), "acquirer answered 500") {
		t.Errorf("the log says:\n%s\nwant a line saying the acquirer answered 500", log.String())
	}
	if s := acq.Stats(); s.Charges != 1 {
		t.Errorf("acquirer: %+v; want 1 charge", s)
	}
}

// sqliteStore is a SQLite store in a temporary directory.
func sqliteStore(t *testing.T) idem.Store {
	t.Helper()
	store, err := sqlitestore.Open(context.Background(), sqlitestore.Config{Path: filepath.Join(t.TempDir(), "p.db")})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { store.Close() })
	return store
}

// TestBalanceIsPerCurrency: charges in two currencies are two balances
// (1000 euro cents and 1000 yen do not add up).
func TestBalanceIsPerCurrency(t *testing.T) {
	f := newFixture(t)
	for key, cur := range map[string]string{"k-eur": "eur", "k-jpy": "jpy"} {
		if code, ch := f.do(t, "POST", "/v1/charges", key, `{"amount":1000,"currency":"`+cur+`","customer":"cus_m"}`); code != 201 {
			t.Fatalf("charge in %s: %d %v", cur, code, ch)
		}
	}
	code, b := f.do(t, "GET", "/v1/customers/cus_m/balance", "", "")
	if code != 200 || balance(b, "eur") != -1000 || balance(b, "jpy") != -1000 || b["debits"] != 2.0 {
		t.Fatalf("balance: %d %v; want -1000 in eur and in jpy, 2 debits", code, b)
	}
}

// balance is a balance answer's amount in one currency.
func balance(b map[string]any, currency string) float64 {
	m, _ := b["balances"].(map[string]any)
	v, _ := m[currency].(float64)
	return v
}

// TestFaultsEndpoint: faults are set with durations and fractions; an
// unknown field or a rate out of range is refused and changes nothing.
func TestFaultsEndpoint(t *testing.T) {
	acq := httptest.NewServer(payments.NewAcquirer(true, 1))
	t.Cleanup(acq.Close)
	put := func(body string) (int, string) {
		req, _ := http.NewRequest("PUT", acq.URL+"/faults", strings.NewReader(body))
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	if code, body := put(`{"latency":"2ms","decline":0.5}`); code != 200 || !strings.Contains(body, `"latency":"2ms"`) {
		t.Fatalf("set faults: %d %s", code, body)
	}
	for _, bad := range []string{`{"bogus":1}`, `{"latency":2000000}`, `{"decline":1.5}`, `{"latency":"-1s"}`} {
		if code, body := put(bad); code != 400 || !strings.Contains(body, "faults:") {
			t.Errorf("PUT %s: %d %s; want 400", bad, code, body)
		}
	}
	resp, err := http.Get(acq.URL + "/faults")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var got map[string]any
	json.NewDecoder(resp.Body).Decode(&got)
	if got["latency"] != "2ms" || got["decline"] != 0.5 {
		t.Fatalf("faults after refused changes: %v", got)
	}
}

// TestCallerGoneBeforeTheChargeIsNotCharged: an authorization slower than
// the service's timeout is given up on; the reconciler, asking the acquirer,
// finds no charge and settles the record FAILED, and the retry charges. The
// acquirer must not charge the abandoned authorization after that: the card
// would be charged twice for one key. (Its latency ignored the caller, so
// the abandoned authorization charged once its latency was over: "charged
// 2 times at the acquirer for one key".)
func TestCallerGoneBeforeTheChargeIsNotCharged(t *testing.T) {
	f := newFixture(t) // AcquirerTimeout 1s; an acquirer without Dedupe
	f.acq.SetFaults(payments.Faults{Latency: payments.Duration(2500 * time.Millisecond)})
	body := `{"amount":700,"currency":"usd","customer":"cus_9"}`
	if code, _ := f.do(t, "POST", "/v1/charges", "k", body); code != 502 {
		t.Fatalf("an authorization slower than the timeout: %d; want 502", code)
	}
	f.acq.SetFaults(payments.Faults{})
	r, _ := reconcile.New(reconcile.Config{Engine: f.eng, Resolver: f.svc, Grace: time.Second, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	f.clock.Advance(time.Second)
	if rep, err := r.RunOnce(context.Background()); err != nil || rep.Failed != 1 {
		t.Fatalf("reconcile: %+v, %v; want the record settled FAILED", rep, err)
	}
	select { // the abandoned authorization is over, one way or the other
	case <-f.authorized:
	case <-time.After(10 * time.Second):
		t.Fatal("the acquirer never finished the abandoned authorization")
	}
	if code, ch := f.do(t, "POST", "/v1/charges", "k", body); code != 201 {
		t.Fatalf("retry: %d %v; want 201", code, ch)
	}
	if s := f.acq.Stats(); s.Charges != 1 || s.DuplicateKeys != 0 || s.Abandoned != 1 {
		t.Errorf("acquirer: %+v; want one charge, and the authorization given up on abandoned", s)
	}
	if _, b := f.do(t, "GET", "/v1/customers/cus_9/balance", "", ""); balance(b, "usd") != -700 || b["debits"] != 1.0 {
		t.Errorf("balance: %v; want one debit of 700", b)
	}
}

// TestVerifyPassesAgainstTheService: idem verify passes the service, its
// concurrent check reading the customer's balance as the side effects; and
// a declined charge, which the service stores and replays as 402, is an
// outcome the checks go on with.
func TestVerifyPassesAgainstTheService(t *testing.T) {
	for name, faults := range map[string]payments.Faults{"approved": {}, "declined": {Decline: 1}} {
		t.Run(name, func(t *testing.T) {
			f := newFixture(t)
			f.acq.SetFaults(faults)
			rep, err := verify.Run(context.Background(), verify.Config{
				URL: f.api.URL + "/v1/charges", Body: `{"amount":1000,"currency":"eur","customer":"cus_v"}`, RequireKey: true,
				Header: http.Header{"Authorization": {"Bearer sk_a"}}, Credentials: []string{"Bearer sk_a", "Bearer sk_b"},
				EffectsURL: f.api.URL + "/v1/customers/cus_v/balance",
			})
			if err != nil {
				t.Fatal(err)
			}
			for _, c := range rep.Checks {
				want := verify.Pass
				if name == "declined" && c.Name == "concurrent-duplicates" {
					want = verify.Fail // a decline debits nothing: the balance cannot show a run
				}
				if c.Result != want {
					t.Errorf("%s: %s: %s; want %s", c.Name, c.Result, c.Detail, want)
				} else {
					t.Logf("%s: %s: %s", c.Name, c.Result, c.Detail)
				}
			}
		})
	}
}

// TestLedgerIsInTheRecordsSchema: on PostgreSQL the ledger's tables are in
// the records' schema, so two services in two schemas of one database keep
// two ledgers. (They were in public, shared: the second service's first
// charge, whose id derives from its scope and key like the first's, failed
// on the first's row, and its record stayed UNKNOWN for good.)
func TestLedgerIsInTheRecordsSchema(t *testing.T) {
	url := testkit.Server(t, "IDEM_TEST_DATABASE_URL")
	ctx := context.Background()
	var schemas []string
	for i := range 2 {
		b := make([]byte, 6)
		rand.Read(b)
		schema := fmt.Sprintf("idem_test_ledger_%d_%x", i, b)
		if i == 1 {
			schema += `?"x` // quoted, and a ? that is no placeholder
		}
		schemas = append(schemas, schema)
		pool, err := pgxpool.New(ctx, url)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			pool.Exec(ctx, "DROP SCHEMA IF EXISTS "+pgx.Identifier{schema}.Sanitize()+" CASCADE")
			pool.Close()
		})
		st, err := pgstore.New(ctx, pgstore.Config{Pool: pool, Schema: schema})
		if err != nil {
			t.Fatal(err)
		}
		f := newFixtureOn(t, st)
		if code, body := f.do(t, "POST", "/v1/charges", "order-1", `{"amount":1000,"currency":"eur","customer":"cus_1"}`); code != http.StatusCreated {
			t.Fatalf("the charge of the service in schema %d: %d %v", i, code, body)
		}
		var n int
		if err := st.Pool().QueryRow(ctx, `SELECT count(*) FROM information_schema.tables WHERE table_schema = $1 AND table_name IN ('payments_charges', 'payments_ledger')`,
			schema).Scan(&n); err != nil || n != 2 {
			t.Fatalf("the ledger's tables in %s: %d, %v; want both", schema, n, err)
		}
	}
}

func TestMain(m *testing.M) { testkit.Main(m) }
