package httpidem_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/httpidem"
	"github.com/idemhq/idem/store/memstore"
	"github.com/idemhq/idem/store/sqlitestore"
)

func Example() {
	engine, _ := idem.New(idem.Config{Store: memstore.New()})
	mw, _ := httpidem.New(httpidem.Config{
		Engine:     engine,
		RequireKey: true,
		Scope:      httpidem.HashScope("Authorization"), // one key space per caller
	})
	charges := 0
	handler := mw.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		charges++
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"id":"ch_%d"}`, charges)
	}))

	post := func(key, body string) {
		r := httptest.NewRequest("POST", "/v1/charges", strings.NewReader(body))
		r.Header.Set("Authorization", "Bearer sk_test_1")
		if key != "" {
			r.Header.Set("Idempotency-Key", key)
		}
		w := httptest.NewRecorder()
		handler.ServeHTTP(w, r)
		b, _ := io.ReadAll(w.Body)
		if w.Header().Get("Content-Type") != "application/problem+json" {
			fmt.Println(w.Code, w.Header().Get("Idempotent-Replayed"), strings.TrimSpace(string(b)))
			return
		}
		var p struct {
			Type  string
			Error struct{ Type, Code string }
		}
		json.Unmarshal(b, &p)
		_, kind, _ := strings.Cut(p.Type, "#")
		fmt.Println(w.Code, kind, p.Error.Type, p.Error.Code, "retry:", w.Header().Get("Stripe-Should-Retry"))
	}
	post("k1", `{"amount":100}`)
	post("k1", `{"amount":100}`) // the retry: replayed, not charged again
	post("k1", `{"amount":500}`) // the key reused for another charge
	post("", `{"amount":100}`)   // no key
	fmt.Println("charges:", charges)
	// Output:
	// 201  {"id":"ch_1"}
	// 201 true {"id":"ch_1"}
	// 422 payload-mismatch idempotency_error idempotency_key_reused retry: false
	// 400 key-missing invalid_request_error idempotency_key_missing retry: false
	// charges: 1
}

// A debit and the record's completion commit in one SQLite transaction: the
// retry is a replay, and the ledger holds one debit.
func ExampleFinish() {
	ctx := context.Background()
	dir, _ := os.MkdirTemp("", "idem-example")
	defer os.RemoveAll(dir)
	store, _ := sqlitestore.Open(ctx, sqlitestore.Config{Path: filepath.Join(dir, "idem.db")})
	defer store.Close()
	store.DB().Exec(`CREATE TABLE ledger (customer TEXT, amount INTEGER)`)
	engine, _ := idem.New(idem.Config{Store: store})
	mw, _ := httpidem.New(httpidem.Config{Engine: engine, TakeoverSafe: true})

	debit := mw.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tx, err := store.DB().BeginTx(r.Context(), nil)
		if err != nil {
			http.Error(w, "database unavailable", http.StatusServiceUnavailable)
			return
		}
		defer tx.Rollback()
		if _, err := tx.ExecContext(r.Context(), `INSERT INTO ledger VALUES ('cus_1', -100)`); err != nil {
			httpidem.NothingHappened(r) // the debit was not written: the retry may run
			http.Error(w, "try again", http.StatusServiceUnavailable)
			return
		}
		resp := &idem.Response{Status: http.StatusCreated, Body: []byte(`{"debited":100}`)}
		if err := httpidem.Finish(w, r, resp, func(p idem.FinishParams) error {
			if err := store.FinishTx(r.Context(), tx, p); err != nil {
				return err
			}
			return tx.Commit()
		}); err != nil {
			httpidem.NothingHappened(r) // rolled back: the retry may run
			http.Error(w, "try again", http.StatusServiceUnavailable)
		}
	}))
	for range 2 {
		r := httptest.NewRequest("POST", "/debit", nil)
		r.Header.Set("Idempotency-Key", "debit-1")
		w := httptest.NewRecorder()
		debit.ServeHTTP(w, r)
		fmt.Println(w.Code, w.Header().Get("Idempotent-Replayed"), w.Body.String())
	}
	var debits int
	store.DB().QueryRow(`SELECT count(*) FROM ledger`).Scan(&debits)
	fmt.Println("debits:", debits)
	// Output:
	// 201  {"debited":100}
	// 201 true {"debited":100}
	// debits: 1
}
