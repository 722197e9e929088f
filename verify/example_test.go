package verify_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/httpidem"
	"github.com/idemhq/idem/store/memstore"
	"github.com/idemhq/idem/verify"
)

func Example() {
	engine, _ := idem.New(idem.Config{Store: memstore.New()})
	mw, _ := httpidem.New(httpidem.Config{Engine: engine, RequireKey: true, Scope: httpidem.HashScope("Authorization")})
	n := 0
	api := httptest.NewServer(mw.Wrap(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n++
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"id":"ch_%d"}`, n)
	})))
	defer api.Close()

	report, _ := verify.Run(context.Background(), verify.Config{
		URL: api.URL + "/v1/charges", RequireKey: true, Concurrency: 1,
		Credentials: []string{"Bearer alice", "Bearer bob"},
	})
	for _, c := range report.Checks {
		fmt.Println(c.Name, c.Result)
	}
	fmt.Println("passed:", report.Passed())
	// Output:
	// replay pass
	// payload-mismatch pass
	// concurrent-duplicates pass
	// missing-key pass
	// malformed-keys pass
	// scopes pass
	// problem-json pass
	// passed: true
}
