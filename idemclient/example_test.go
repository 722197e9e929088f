package idemclient_test

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"

	"github.com/idemhq/idem/idemclient"
)

// The server is busy the first time; the client retries with the same key.
func Example() {
	var attempts atomic.Int64
	keys := map[string]bool{}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		keys[r.Header.Get("Idempotency-Key")] = true
		if attempts.Add(1) == 1 {
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		w.WriteHeader(http.StatusCreated)
		io.WriteString(w, `{"id":"ch_1"}`)
	}))
	defer srv.Close()

	client := &http.Client{Transport: idemclient.New(idemclient.Config{})}
	resp, err := client.Post(srv.URL+"/v1/charges", "application/json", strings.NewReader(`{"amount":100}`))
	if err != nil {
		panic(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	fmt.Println(resp.StatusCode, string(body), "after", attempts.Load(), "attempts with", len(keys), "key")
	// Output: 201 {"id":"ch_1"} after 2 attempts with 1 key
}
