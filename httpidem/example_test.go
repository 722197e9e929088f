package httpidem_test

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/httpidem"
	"github.com/idemhq/idem/store/memstore"
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
		fmt.Println(w.Code, w.Header().Get("Idempotent-Replayed"), strings.TrimSpace(string(b)))
	}
	post("k1", `{"amount":100}`)
	post("k1", `{"amount":100}`) // the retry: replayed, not charged again
	post("k1", `{"amount":500}`) // the key reused for another charge
	post("", `{"amount":100}`)   // no key
	fmt.Println("charges:", charges)
	// Output:
	// 201  {"id":"ch_1"}
	// 201 true {"id":"ch_1"}
	// 422  {"type":"https://github.com/idemhq/idem/blob/main/docs/problems.md#payload-mismatch","title":"Idempotency-Key reused with a different payload","status":422,"detail":"this key was first used with a request that differs in body","differs":["body"]}
	// 400  {"type":"https://github.com/idemhq/idem/blob/main/docs/problems.md#key-missing","title":"Idempotency-Key required","status":400,"detail":"POST /v1/charges requires an Idempotency-Key header"}
	// charges: 1
}
