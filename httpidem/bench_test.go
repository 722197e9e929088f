package httpidem_test

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/httpidem"
	"github.com/idemhq/idem/store/memstore"
	"github.com/idemhq/idem/store/sqlitestore"
)

// The middleware's cost is read off one run: Bare is the handler alone,
// Execute a new key through the middleware (acquire, run, complete), Replay a
// retry of a completed key. All serve in-process (httptest.ResponseRecorder),
// so only the middleware and the store differ.

var benchBody = `{"amount":100,"currency":"eur","customer":"cus_42"}`

func benchHandler() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(201)
		io.WriteString(w, `{"id":"ch_1","amount":100,"currency":"eur","status":"succeeded"}`)
	})
}

func benchStores(b *testing.B) map[string]func() idem.Store {
	return map[string]func() idem.Store{
		"memstore": func() idem.Store { return memstore.New() },
		"sqlite": func() idem.Store {
			s, err := sqlitestore.Open(context.Background(), sqlitestore.Config{Path: filepath.Join(b.TempDir(), "idem.db")})
			if err != nil {
				b.Fatal(err)
			}
			b.Cleanup(func() { s.Close() })
			return s
		},
	}
}

func serveOnce(b *testing.B, h http.Handler, key string) {
	r := httptest.NewRequest("POST", "/v1/charges", strings.NewReader(benchBody))
	if key != "" {
		r.Header.Set("Idempotency-Key", key)
	}
	w := httptest.NewRecorder()
	h.ServeHTTP(w, r)
	if w.Code != 201 {
		b.Fatalf("status %d: %s", w.Code, w.Body)
	}
}

func BenchmarkMiddleware(b *testing.B) {
	b.Run("bare", func(b *testing.B) {
		h := benchHandler()
		for b.Loop() {
			serveOnce(b, h, "")
		}
	})
	for name, mk := range benchStores(b) {
		wrap := func(b *testing.B) http.Handler {
			eng, _ := idem.New(idem.Config{Store: mk()})
			mw, err := httpidem.New(httpidem.Config{Engine: eng, Scope: httpidem.HashScope("Authorization")})
			if err != nil {
				b.Fatal(err)
			}
			return mw.Wrap(benchHandler())
		}
		b.Run(name+"/execute", func(b *testing.B) {
			h := wrap(b)
			for i := 0; b.Loop(); i++ {
				serveOnce(b, h, "key-"+strconv.Itoa(i))
			}
		})
		b.Run(name+"/replay", func(b *testing.B) {
			h := wrap(b)
			serveOnce(b, h, "hot")
			for b.Loop() {
				serveOnce(b, h, "hot")
			}
		})
	}
}

// BenchmarkCanonicalJSON is the cost of the canonical form of a typical
// payment body (some 350 bytes), which a middleware with CanonicalJSON,
// IncludeFields or ExcludeFields pays on every request.
func BenchmarkCanonicalJSON(b *testing.B) {
	body := []byte(`{"amount":2500,"currency":"eur","customer":"cus_Q7pLx2vN4kTz","description":"Order #100243",
		"capture":true,"metadata":{"order_id":"100243","cart":"c_88f1","channel":"web"},
		"card":{"number":"4242424242424242","exp_month":12,"exp_year":2030,"cvc":"123"},
		"shipping":{"name":"Ada Lovelace","address":{"line1":"12 Analytical St","city":"London","country":"GB"}}}`)
	b.SetBytes(int64(len(body)))
	for b.Loop() {
		if _, err := httpidem.CanonicalJSON(body); err != nil {
			b.Fatal(err)
		}
	}
}
