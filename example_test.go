package idem_test

import (
	"context"
	"fmt"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/store/memstore"
)

// A charge runs once; its retry replays the stored outcome, and a retry with
// another payload is refused.
func Example() {
	ctx := context.Background()
	engine, err := idem.New(idem.Config{Store: memstore.New()})
	if err != nil {
		panic(err)
	}
	charge := func(body string) {
		params := idem.BeginParams{
			Scope:       "customer_42",
			Key:         "018f6f2e-7b1a-7c3d-9e4f-0a1b2c3d4e5f",
			Fingerprint: idem.NewFingerprint(idem.Payload{Method: "POST", Path: "/v1/charges", Body: []byte(body)}),
		}
		out, err := engine.Begin(ctx, params)
		if err != nil {
			panic(err) // the store is down: fail closed
		}
		switch out.Decision {
		case idem.Execute:
			work, stop := engine.Hold(ctx, out.Lease) // renew the lease while charging
			_ = work                                  // ... charge the card with work as the context ...
			lease := stop()
			resp := &idem.Response{Status: 201, Body: []byte(`{"id":"ch_1"}`)}
			if err := engine.Complete(ctx, lease, resp); err != nil {
				panic(err)
			}
			fmt.Println("charged:", string(resp.Body))
		case idem.Replay:
			fmt.Println("replayed:", string(out.Record.Response.Body))
		case idem.Mismatch:
			fmt.Println("refused, the payload differs in", out.Diff)
		default:
			fmt.Println(out.Decision)
		}
	}
	charge(`{"amount":100}`)
	charge(`{"amount":100}`)
	charge(`{"amount":999}`)
	// Output:
	// charged: {"id":"ch_1"}
	// replayed: {"id":"ch_1"}
	// refused, the payload differs in [body]
}
