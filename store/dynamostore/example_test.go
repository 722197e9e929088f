package dynamostore_test

import (
	"context"
	"fmt"
	"log"
	"net/http"
	"os"

	"github.com/aws/aws-sdk-go-v2/config"
	"github.com/aws/aws-sdk-go-v2/service/dynamodb"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/store/dynamostore"
)

// Example runs one request through an engine on DynamoDB: the first Begin
// executes the work and Complete stores its outcome; a retry with the same
// key and payload gets the stored response back. It needs AWS credentials
// (or a local server: IDEM_TEST_DYNAMODB_URL), so it is compiled but not run
// by go test.
func Example() {
	ctx := context.Background()
	cfg, err := config.LoadDefaultConfig(ctx) // region and credentials from the environment
	if err != nil {
		log.Fatal(err)
	}
	client := dynamodb.NewFromConfig(cfg, func(o *dynamodb.Options) {
		if url := os.Getenv("IDEM_TEST_DYNAMODB_URL"); url != "" {
			o.BaseEndpoint = &url // e.g. http://127.0.0.1:8000, a local dynalite
		}
	})
	// Once per deployment (or with the schema of the package documentation
	// in your infrastructure code): idempotent, waits until the table is ACTIVE.
	if err := dynamostore.CreateTable(ctx, client, "payments_idem"); err != nil {
		log.Fatal(err)
	}
	store, err := dynamostore.New(dynamostore.Config{Client: client, Table: "payments_idem"})
	if err != nil {
		log.Fatal(err)
	}
	engine, err := idem.New(idem.Config{Store: store})
	if err != nil {
		log.Fatal(err)
	}

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
