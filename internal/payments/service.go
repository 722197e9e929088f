// Package payments is the reference payments service behind `idem demo`: a
// charge API whose every charge touches two worlds — its own ledger, in the
// same database as the idempotency records, and a card acquirer it does not
// control — and is exactly-once across both.
//
// POST /v1/charges runs behind the httpidem middleware. Before it calls the
// acquirer it records a checkpoint with the downstream key it will send
// (derived from the record, so every attempt at the same charge sends the
// same one). The acquirer's answer, the charge row, the ledger debit and the
// record's completion then commit in one transaction. If the process dies,
// or the acquirer's reply is lost, between the call and that commit, the
// record is UNKNOWN; the reconciler asks the acquirer by the downstream key
// and commits the same rows the handler would have.
package payments

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptrace"
	"net/url"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/httpidem"
	"github.com/idemhq/idem/internal/redact"
	"github.com/idemhq/idem/reconcile"
	"github.com/idemhq/idem/store"
)

// DefaultAcquirerTimeout bounds a call to the acquirer.
const DefaultAcquirerTimeout = 2 * time.Second

// Config configures a [Service].
type Config struct {
	// Engine keeps the idempotency records. Required.
	Engine *idem.Engine
	// DB is the database of the engine's store (see [NewDB]). Required.
	DB DB
	// AcquirerURL is the card acquirer's base URL, http:// or https://
	// (see [ParseAcquirerURL]). Required.
	AcquirerURL string
	// AcquirerTimeout bounds each acquirer call. Defaults to
	// [DefaultAcquirerTimeout].
	AcquirerTimeout time.Duration
	// Logger defaults to slog.Default().
	Logger *slog.Logger
	// Observe is passed to the middleware (httpidem.Config.Observe).
	Observe func(*http.Request, string)
}

// Service is the payments API.
type Service struct {
	cfg    Config
	client *http.Client
	log    *slog.Logger
}

// New returns the service; call Migrate before serving. An acquirer URL
// that [ParseAcquirerURL] refuses is an error wrapping [idem.ErrInvalid].
func New(cfg Config) (*Service, error) {
	if cfg.Engine == nil || cfg.DB == nil || cfg.AcquirerURL == "" {
		return nil, errors.New("payments: config needs an engine, a database and an acquirer URL")
	}
	base, err := ParseAcquirerURL(cfg.AcquirerURL)
	if err != nil {
		return nil, err
	}
	cfg.AcquirerURL = base
	if cfg.AcquirerTimeout == 0 {
		cfg.AcquirerTimeout = DefaultAcquirerTimeout
	}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	transport := http.DefaultTransport.(*http.Transport).Clone()
	transport.MaxIdleConnsPerHost = 64
	return &Service{cfg: cfg, log: log, client: &http.Client{Timeout: cfg.AcquirerTimeout, Transport: transport}}, nil
}

// ParseAcquirerURL returns an acquirer's base URL as the service uses it:
// http:// or https://, a host, and a path if any, without a trailing slash
// (the service appends /authorize and /payments/{key}). A URL that is not
// one, or has a query or a fragment, is an error wrapping [idem.ErrInvalid],
// which does not show the URL's password.
func ParseAcquirerURL(raw string) (string, error) {
	u, err := url.Parse(raw)
	if err != nil || u.Scheme != "http" && u.Scheme != "https" || u.Host == "" || u.RawQuery != "" || u.ForceQuery || u.Fragment != "" {
		return "", fmt.Errorf("%w: acquirer URL %s: want http://host:port or https://…, with a path if any and no query", idem.ErrInvalid, redact.URL(raw))
	}
	return strings.TrimRight(raw, "/"), nil
}

// schema is the ledger, in the same database as the records. There is
// deliberately no unique constraint on the ledger's charge: a double debit
// must be prevented by idem, and the audit must be able to see one if it
// ever happened.
var schema = []string{
	`CREATE TABLE IF NOT EXISTS {{s}}payments_charges (
		id TEXT PRIMARY KEY, idem_scope TEXT NOT NULL, idem_key TEXT NOT NULL, customer TEXT NOT NULL,
		amount BIGINT NOT NULL, currency TEXT NOT NULL, status TEXT NOT NULL, acquirer_payment TEXT NOT NULL,
		created BIGINT NOT NULL)`,
	`CREATE TABLE IF NOT EXISTS {{s}}payments_ledger (
		id TEXT PRIMARY KEY, customer TEXT NOT NULL, amount BIGINT NOT NULL, charge_id TEXT NOT NULL,
		idem_scope TEXT NOT NULL, idem_key TEXT NOT NULL, created BIGINT NOT NULL)`,
	`CREATE INDEX IF NOT EXISTS payments_ledger_customer ON {{s}}payments_ledger (customer)`,
}

// Migrate creates the service's tables.
func (s *Service) Migrate(ctx context.Context) error {
	for _, ddl := range schema {
		if err := s.cfg.DB.Exec(ctx, ddl); err != nil {
			return fmt.Errorf("payments: creating tables: %w", err)
		}
	}
	return nil
}

// maxChargeBody is the largest body of a charge request; the middleware
// answers 413 to a larger one.
const maxChargeBody = 64 << 10

// Handler serves the API: POST /v1/charges (idempotent, a key required,
// keys scoped by the Authorization header, the body at most 64
// KiB), GET /v1/charges/{id}, GET /v1/customers/{id}/balance.
func (s *Service) Handler() (http.Handler, error) {
	mw, err := httpidem.New(httpidem.Config{
		Engine:         s.cfg.Engine,
		Methods:        []string{http.MethodPost},
		RequireKey:     true,
		Scope:          httpidem.HashScope("Authorization"),
		CanonicalJSON:  true,
		MaxRequestBody: maxChargeBody, // the one limit: the handler reads the body whole
		Logger:         s.log,
		Observe:        s.cfg.Observe,
	})
	if err != nil {
		return nil, err
	}
	mux := http.NewServeMux()
	mux.Handle("POST /v1/charges", mw.Wrap(http.HandlerFunc(s.createCharge)))
	mux.HandleFunc("GET /v1/charges/{id}", s.getCharge)
	mux.HandleFunc("GET /v1/customers/{id}/balance", s.getBalance)
	return mux, nil
}

// Charge is the API's view of a charge.
type Charge struct {
	ID              string `json:"id"`
	Amount          int64  `json:"amount"`
	Currency        string `json:"currency"`
	Customer        string `json:"customer"`
	Status          string `json:"status"` // succeeded or declined
	AcquirerPayment string `json:"acquirer_payment"`
}

type chargeRequest struct {
	Amount   int64  `json:"amount"`
	Currency string `json:"currency"`
	Customer string `json:"customer"`
}

var (
	currencyRE = regexp.MustCompile(`^[a-z]{3}$`)
	customerRE = regexp.MustCompile(`^[A-Za-z0-9_-]{1,64}$`)
)

// problemTypes are the service's problem types, by the fragment of their
// type (docs/payments.md lists them): their titles, and whether a retry with
// the same key may get another answer (Stripe-Should-Retry).
var problemTypes = map[string]struct {
	title string
	retry bool
}{
	"invalid-charge":       {"Invalid charge", false},
	"acquirer-unavailable": {"Card acquirer unavailable", true},
	"acquirer-silent":      {"Card acquirer did not answer", true},
	"ledger-failed":        {"Charge not recorded", true},
	"settled-elsewhere":    {"Charge settled by another attempt", true},
	"unavailable":          {"Service unavailable", true},
	"not-found":            {"Charge not found", false},
	"internal":             {"Internal error", false},
}

func problem(w http.ResponseWriter, status int, kind, detail string) {
	k := problemTypes[kind]
	w.Header().Set(httpidem.HeaderShouldRetry, strconv.FormatBool(k.retry)) // httpidem says it for its own types only
	(&httpidem.Problem{Type: "https://github.com/idemhq/idem/blob/main/docs/payments.md#" + kind, Title: k.title,
		Status: status, Detail: detail}).Write(w)
}

// chargeExample is a valid charge, for the errors that describe one.
const chargeExample = `{"amount":1000,"currency":"eur","customer":"cus_1"}`

// decodeCharge reads a charge request, whole (the middleware bounds it to
// maxChargeBody), and says what is wrong with one that is not valid.
func decodeCharge(r io.Reader) (chargeRequest, error) {
	var req chargeRequest
	body, err := io.ReadAll(r)
	if err == nil {
		dec := json.NewDecoder(bytes.NewReader(body))
		dec.DisallowUnknownFields()
		if err = dec.Decode(&req); err == nil {
			if _, end := dec.Token(); end != io.EOF { // a second value, or a stray } or ]
				err = errors.New("there is more after the charge")
			}
		}
	}
	if err == nil {
		err = oneOfEach(body)
	}
	switch {
	case errors.Is(err, io.EOF):
		return req, errors.New("the body is empty; send a charge such as " + chargeExample)
	case err != nil:
		return req, fmt.Errorf("the body is not a charge (%v); send one such as %s", err, chargeExample)
	case req.Amount < 1 || req.Amount > 1e9:
		return req, fmt.Errorf("amount %d: want a whole number of cents from 1 to 1000000000", req.Amount)
	case !currencyRE.MatchString(req.Currency):
		return req, fmt.Errorf("currency %q: want three lower-case letters (an ISO 4217 code), such as eur", req.Currency)
	case !customerRE.MatchString(req.Customer):
		return req, fmt.Errorf("customer %q: want 1 to 64 letters, digits, _ or -, such as cus_1", req.Customer)
	}
	return req, nil
}

// chargeMembers are the members of a charge, named as documented.
var chargeMembers = []string{"amount", "currency", "customer"}

// oneOfEach refuses a charge that names a member twice, or not exactly as
// documented ("AMOUNT"): encoding/json matches names in any case and keeps
// the last of two, where another reader of the same body (a gateway, a log)
// may keep the first and see another charge.
func oneOfEach(body []byte) error {
	dec := json.NewDecoder(bytes.NewReader(body))
	if t, err := dec.Token(); err != nil || t != json.Delim('{') {
		return nil // no object: decoding it said what is wrong
	}
	var seen []string
	for dec.More() {
		t, err := dec.Token()
		if err != nil {
			return err
		}
		name, _ := t.(string)
		switch {
		case !slices.Contains(chargeMembers, name):
			return fmt.Errorf("member %q: a charge names amount, currency and customer, in lower case", name)
		case slices.Contains(seen, name):
			return fmt.Errorf("member %q twice", name)
		}
		seen = append(seen, name)
		var v json.RawMessage
		if err := dec.Decode(&v); err != nil {
			return err
		}
	}
	return nil
}

// chargeID names the charge of a request: the same for every attempt at it.
func chargeID(l idem.Lease) string {
	return "ch_" + strings.TrimPrefix(l.DownstreamKey("charge"), "idem_")[:20]
}

func (s *Service) createCharge(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	req, err := decodeCharge(r.Body)
	if err != nil {
		httpidem.NothingHappened(r) // a corrected request may reuse the key
		problem(w, http.StatusBadRequest, "invalid-charge", err.Error())
		return
	}
	lease, ok := httpidem.LeaseFrom(ctx)
	if !ok {
		problem(w, http.StatusInternalServerError, "internal", "no idempotency lease")
		return
	}
	downstream := lease.DownstreamKey("authorize")
	if err := s.cfg.Engine.Checkpoint(ctx, lease, "authorize", []byte(downstream)); err != nil {
		httpidem.NothingHappened(r) // the acquirer was not called
		problem(w, http.StatusServiceUnavailable, "unavailable", "could not record the charge's progress; retry")
		return
	}
	pay, sent, err := s.authorize(ctx, AuthorizeRequest{Key: downstream, Reference: lease.Key, Amount: req.Amount, Currency: req.Currency, Customer: req.Customer})
	answer, answered := errors.AsType[*acquirerAnswer](err)
	switch {
	case err != nil && !sent:
		httpidem.NothingHappened(r)
		problem(w, http.StatusServiceUnavailable, "acquirer-unavailable", "the card acquirer could not be reached; retry")
		return
	case answered && answer.refused():
		httpidem.NothingHappened(r) // a retry, once the acquirer takes it, sends the same downstream key
		s.log.Error("payments: "+answer.Error()+"; it charged nothing: check the acquirer URL and its settings", "status", answer.status)
		problem(w, http.StatusInternalServerError, "internal", "the card acquirer refused the authorization; nothing was charged")
		return
	case answered:
		httpidem.OutcomeUnknown(r)
		s.log.Warn("payments: "+answer.Error()+"; it may have charged: the charge will be reconciled", "status", answer.status)
		problem(w, http.StatusBadGateway, "acquirer-silent", "the card acquirer did not say whether it charged; the charge will be reconciled")
		return
	case err != nil:
		httpidem.OutcomeUnknown(r)
		s.log.Warn("payments: acquirer took the authorization but did not answer", "err", err)
		problem(w, http.StatusBadGateway, "acquirer-silent", "the card acquirer did not answer; the charge will be reconciled")
		return
	case pay == nil:
		httpidem.NothingHappened(r)
		problem(w, http.StatusServiceUnavailable, "acquirer-unavailable", "the card acquirer is busy; retry")
		return
	}
	c := chargeOf(chargeID(lease), pay)
	err = httpidem.Finish(w, r, chargeResponse(c), func(p idem.FinishParams) error {
		return s.record(ctx, c, lease.Scope, lease.Key, p)
	})
	switch {
	case errors.Is(err, idem.ErrLeaseLost):
		problem(w, http.StatusConflict, "settled-elsewhere", "this charge was settled by another attempt; retry to get its outcome")
	case err != nil:
		// The acquirer answered but the ledger did not commit: the charge is
		// recorded at the acquirer, so the reconciler will write it.
		httpidem.OutcomeUnknown(r)
		s.log.Error("payments: recording the charge", "err", err)
		problem(w, http.StatusInternalServerError, "ledger-failed", "the charge will be reconciled")
	}
}

// chargeOf is the charge an acquirer payment stands for.
func chargeOf(id string, p *Payment) Charge {
	status := "succeeded"
	if p.Status != "approved" {
		status = "declined"
	}
	return Charge{ID: id, Amount: p.Amount, Currency: p.Currency, Customer: p.Customer, Status: status, AcquirerPayment: p.ID}
}

// chargeResponse is the API's answer for a charge, the same whoever records it.
func chargeResponse(c Charge) *idem.Response {
	body, _ := json.Marshal(c)
	status := http.StatusCreated
	if c.Status == "declined" {
		status = http.StatusPaymentRequired
	}
	return &idem.Response{Status: status, Header: http.Header{"Content-Type": {"application/json"}}, Body: append(body, '\n')}
}

// record writes the charge, its debit when it succeeded, and the record's
// completion p, in one transaction.
func (s *Service) record(ctx context.Context, c Charge, scope, key string, p idem.FinishParams) error {
	now := time.Now().UnixMilli()
	return s.cfg.DB.InTx(ctx, func(tx Tx) error {
		if err := tx.Exec(ctx, `INSERT INTO {{s}}payments_charges (id, idem_scope, idem_key, customer, amount, currency, status, acquirer_payment, created)
			VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)`, c.ID, scope, key, c.Customer, c.Amount, c.Currency, c.Status, c.AcquirerPayment, now); err != nil {
			return err
		}
		if c.Status == "succeeded" {
			// A random id: nothing but idem stands between a retry and a second debit.
			id, err := store.NewToken()
			if err != nil {
				return err
			}
			if err := tx.Exec(ctx, `INSERT INTO {{s}}payments_ledger (id, customer, amount, charge_id, idem_scope, idem_key, created)
				VALUES (?, ?, ?, ?, ?, ?, ?)`, "le_"+id, c.Customer, -c.Amount, c.ID, scope, key, now); err != nil {
				return err
			}
		}
		return tx.Finish(ctx, p)
	})
}

// acquirerAnswer is an answer of the acquirer's that is no payment.
type acquirerAnswer struct {
	status int
	err    error // why a 200 is no payment
}

func (a *acquirerAnswer) Error() string {
	if a.err != nil {
		return fmt.Sprintf("acquirer answered %d with no payment (%v)", a.status, a.err)
	}
	return fmt.Sprintf("acquirer answered %d", a.status)
}

// refused reports whether the answer says the acquirer charged nothing: a
// 4xx, but 409, which an acquirer answers while another authorization with
// the key is in progress. (429, too busy, is answered as 503 is.)
func (a *acquirerAnswer) refused() bool {
	return a.status >= 400 && a.status < 500 && a.status != http.StatusConflict
}

// authorize calls the acquirer. sent reports whether the request may have
// reached it; a nil payment with a nil error means it answered 503 or 429
// (busy: nothing charged); an answer that is no payment is an
// *acquirerAnswer.
func (s *Service) authorize(ctx context.Context, a AuthorizeRequest) (pay *Payment, sent bool, err error) {
	body, _ := json.Marshal(a)
	var wrote atomic.Bool
	ctx = httptrace.WithClientTrace(ctx, &httptrace.ClientTrace{WroteHeaders: func() { wrote.Store(true) }})
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, s.cfg.AcquirerURL+"/authorize", strings.NewReader(string(body)))
	if err != nil {
		return nil, false, err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := s.client.Do(req)
	if err != nil {
		return nil, wrote.Load(), err
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	switch {
	case err != nil:
		return nil, true, err
	case resp.StatusCode == http.StatusServiceUnavailable || resp.StatusCode == http.StatusTooManyRequests:
		return nil, true, nil
	case resp.StatusCode != http.StatusOK:
		return nil, true, &acquirerAnswer{status: resp.StatusCode}
	}
	pay = new(Payment)
	if err := json.Unmarshal(raw, pay); err != nil {
		return nil, true, &acquirerAnswer{status: resp.StatusCode, err: err}
	}
	return pay, true, nil
}

// lookup asks the acquirer for the payment under a downstream key; nil when
// it has none.
func (s *Service) lookup(ctx context.Context, key string) (*Payment, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, s.cfg.AcquirerURL+"/payments/"+key, nil)
	if err != nil {
		return nil, err
	}
	resp, err := s.client.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	switch resp.StatusCode {
	case http.StatusNotFound:
		return nil, nil
	case http.StatusOK:
		p := new(Payment)
		return p, json.NewDecoder(resp.Body).Decode(p)
	}
	return nil, fmt.Errorf("acquirer lookup answered %d", resp.StatusCode)
}

// Resolve implements [reconcile.Resolver]: it asks the acquirer about the
// record's authorization by its downstream key, and settles the record
// together with the charge and debit rows the handler would have written.
func (s *Service) Resolve(ctx context.Context, rec idem.Record) (reconcile.Resolution, error) {
	authorized := false
	for _, c := range rec.Checkpoints {
		authorized = authorized || c.Name == "authorize"
	}
	if !authorized {
		// The handler died before calling the acquirer.
		return reconcile.Resolution{Outcome: reconcile.Failed}, nil
	}
	pay, err := s.lookup(ctx, rec.DownstreamKey("authorize"))
	if err != nil {
		return reconcile.Resolution{}, err
	}
	if pay == nil {
		return reconcile.Resolution{Outcome: reconcile.Failed}, nil
	}
	lease := idem.Lease{Scope: rec.Scope, Key: rec.Key, Fingerprint: rec.Fingerprint}
	c := chargeOf(chargeID(lease), pay)
	return reconcile.Resolution{Outcome: reconcile.Completed, Response: chargeResponse(c),
		Commit: func(ctx context.Context, p idem.FinishParams) error { return s.record(ctx, c, rec.Scope, rec.Key, p) }}, nil
}

func (s *Service) getCharge(w http.ResponseWriter, r *http.Request) {
	var c Charge
	err := s.cfg.DB.QueryRow(r.Context(), `SELECT id, amount, currency, customer, status, acquirer_payment FROM {{s}}payments_charges WHERE id = ?`,
		r.PathValue("id")).Scan(&c.ID, &c.Amount, &c.Currency, &c.Customer, &c.Status, &c.AcquirerPayment)
	switch {
	case errors.Is(err, errNoRows):
		problem(w, http.StatusNotFound, "not-found", "no such charge")
	case err != nil:
		s.log.Error("payments: reading a charge", "err", err)
		problem(w, http.StatusServiceUnavailable, "unavailable", "the database could not be reached; retry")
	default:
		writeJSON(w, http.StatusOK, c)
	}
}

// getBalance answers a customer's balance in each currency it was charged
// in (amounts in different currencies do not add up), and the number of
// its debits.
func (s *Service) getBalance(w http.ResponseWriter, r *http.Request) {
	balances := map[string]int64{}
	var debits int64
	err := s.cfg.DB.Query(r.Context(), `SELECT c.currency, SUM(l.amount), COUNT(*) FROM {{s}}payments_ledger l
		JOIN {{s}}payments_charges c ON c.id = l.charge_id WHERE l.customer = ? GROUP BY c.currency`,
		func(scan func(...any) error) error {
			var currency string
			var sum, n int64
			if err := scan(&currency, &sum, &n); err != nil {
				return err
			}
			balances[currency], debits = sum, debits+n
			return nil
		}, r.PathValue("id"))
	if err != nil {
		s.log.Error("payments: reading a balance", "err", err)
		problem(w, http.StatusServiceUnavailable, "unavailable", "the database could not be reached; retry")
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"customer": r.PathValue("id"), "balances": balances, "debits": debits})
}
