package pgstore_test

import (
	"context"
	"fmt"
	"log"
	"os"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/store/pgstore"
)

// Example runs a request once on PostgreSQL: the first Begin executes it and
// stores the outcome, and a retry with the same key and payload replays it.
// It needs a server (IDEM_TEST_DATABASE_URL), so it is compiled, not run.
func Example() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("IDEM_TEST_DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	store, err := pgstore.New(ctx, pgstore.Config{Pool: pool}) // creates schema "idem" if missing
	if err != nil {
		log.Fatal(err)
	}
	eng, err := idem.New(idem.Config{Store: store})
	if err != nil {
		log.Fatal(err)
	}

	req := idem.BeginParams{
		Scope:       "tenant-42",
		Key:         "018f6f2e-7b1a-7c3d-9e4f-0a1b2c3d4e5f",
		Fingerprint: idem.NewFingerprint(idem.Payload{Method: "POST", Path: "/v1/charges", Body: []byte(`{"amount":500}`)}),
	}
	for range 2 { // the client retries
		out, err := eng.Begin(ctx, req)
		if err != nil {
			log.Fatal(err) // ErrUnavailable: answer 503, run nothing
		}
		switch out.Decision {
		case idem.Execute:
			// ... charge the card ...
			resp := &idem.Response{Status: 201, Body: []byte(`{"id":"ch_1"}`)}
			if err := eng.Complete(ctx, out.Lease, resp); err != nil {
				log.Fatal(err)
			}
			fmt.Println("executed:", string(resp.Body))
		case idem.Replay:
			fmt.Println("replayed:", string(out.Record.Response.Body))
		default:
			fmt.Println(out.Decision)
		}
	}
}

// ExampleStore_FinishTx completes a record in the same transaction as the
// handler's own write, so both commit or neither does; such work may declare
// itself TakeoverSafe. It needs a server, so it is compiled, not run.
func ExampleStore_FinishTx() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("IDEM_TEST_DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	store, err := pgstore.New(ctx, pgstore.Config{Pool: pool})
	if err != nil {
		log.Fatal(err)
	}
	eng, err := idem.New(idem.Config{Store: store})
	if err != nil {
		log.Fatal(err)
	}
	out, err := eng.Begin(ctx, idem.BeginParams{
		Key:          "refund-7",
		Fingerprint:  idem.NewFingerprint(idem.Payload{Method: "POST", Path: "/v1/refunds", Body: []byte(`{"charge":"ch_1"}`)}),
		TakeoverSafe: true,
	})
	if err != nil || out.Decision != idem.Execute {
		log.Fatal(out.Decision, err)
	}

	tx, err := pool.Begin(ctx)
	if err != nil {
		log.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }() // a no-op once committed
	if _, err := tx.Exec(ctx, "INSERT INTO ledger (charge, amount) VALUES ($1, $2)", "ch_1", -500); err != nil {
		log.Fatal(err)
	}
	resp := &idem.Response{Status: 201, Body: []byte(`{"id":"re_1"}`)}
	err = eng.Settle(ctx, out.Lease, idem.Settlement{State: idem.StateCompleted, Response: resp,
		Commit: func(ctx context.Context, p idem.FinishParams) error {
			if err := store.FinishTx(ctx, tx, p); err != nil {
				return err // ErrLeaseLost: a newer owner has the record; the ledger write rolls back
			}
			return tx.Commit(ctx)
		}})
	if err != nil {
		log.Fatal(err)
	}
}
