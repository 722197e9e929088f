package memcachedstore_test

import (
	"context"
	"fmt"
	"log"
	"net/http"
	"os"
	"time"

	"github.com/bradfitz/gomemcache/memcache"
	"github.com/idemhq/idem"
	"github.com/idemhq/idem/store/memcachedstore"
)

// Example runs one request through an engine on Memcached: the first Begin
// executes the work and Complete stores its outcome; a retry with the same
// key and payload gets the stored response back. It needs a Memcached server
// (IDEM_TEST_MEMCACHED_ADDR), so it is compiled but not run by go test.
func Example() {
	addr := os.Getenv("IDEM_TEST_MEMCACHED_ADDR") // e.g. 127.0.0.1:11211
	client := memcache.New(addr)
	client.MaxIdleConns = 64     // the peak number of concurrent calls
	client.Timeout = time.Second // bounds every call: gomemcache takes no context
	defer client.Close()

	// Servers repeats the client's addresses, for List (idem keys ls).
	store, err := memcachedstore.New(memcachedstore.Config{Client: client, Servers: []string{addr}, Prefix: "payments"})
	if err != nil {
		log.Fatal(err)
	}
	engine, err := idem.New(idem.Config{Store: store})
	if err != nil {
		log.Fatal(err)
	}

	ctx := context.Background()
	body := []byte(`{"amount":1000,"currency":"eur"}`)
	req := idem.BeginParams{
		Scope:       "tenant 42", // scopes and keys may hold spaces and be 255 bytes long
		Key:         "0190a6b4-1f2e-7c3d-9e4f-0a1b2c3d4e5f",
		Fingerprint: idem.NewFingerprint(idem.Payload{Method: "POST", Path: "/v1/charges", Body: body}),
	}
	for range 2 { // the client's first attempt, then its retry
		out, err := engine.Begin(ctx, req)
		if err != nil {
			log.Fatal(err) // errors.Is(err, idem.ErrUnavailable): answer 503, run nothing
		}
		switch out.Decision {
		case idem.Execute:
			// Charge the card here, then store what the client is told.
			resp := &idem.Response{Status: http.StatusCreated, Body: []byte(`{"id":"ch_1"}`)}
			if err := engine.Complete(ctx, out.Lease, resp); err != nil {
				log.Fatal(err)
			}
			fmt.Println("executed:", resp.Status)
		case idem.Replay:
			fmt.Println("replayed:", out.Record.Response.Status, string(out.Record.Response.Body))
		default:
			fmt.Println(out.Decision)
		}
	}
}
