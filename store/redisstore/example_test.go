package redisstore_test

import (
	"context"
	"fmt"
	"log"
	"net/http"
	"os"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/store/redisstore"
	"github.com/redis/go-redis/v9"
)

// Example runs one request through an engine on Redis: the first Begin
// executes the work and Complete stores its outcome; a retry with the same
// key and payload gets the stored response back. It needs a Redis server
// (IDEM_TEST_REDIS_URL), so it is compiled but not run by go test.
func Example() {
	opt, err := redis.ParseURL(os.Getenv("IDEM_TEST_REDIS_URL")) // e.g. redis://127.0.0.1:6379/0
	if err != nil {
		log.Fatal(err)
	}
	opt.ContextTimeoutEnabled = true // calls end at their deadline (the engine's StoreTimeout)
	client := redis.NewClient(opt)   // or redis.NewClusterClient for Redis Cluster
	defer client.Close()

	store, err := redisstore.New(redisstore.Config{Client: client, Prefix: "payments"})
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
		Scope:       "tenant-42",
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
