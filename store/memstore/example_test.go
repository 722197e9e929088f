package memstore_test

import (
	"context"
	"fmt"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/store/memstore"
)

func Example() {
	ctx := context.Background()
	engine, _ := idem.New(idem.Config{Store: memstore.New()})
	params := idem.BeginParams{Key: "order-7", Fingerprint: idem.NewFingerprint(idem.Payload{Method: "POST", Path: "/orders"})}

	first, _ := engine.Begin(ctx, params)
	second, _ := engine.Begin(ctx, params) // a duplicate while the first runs
	fmt.Println(first.Decision, second.Decision)

	_ = engine.Complete(ctx, first.Lease, &idem.Response{Status: 201, Body: []byte("created")})
	third, _ := engine.Begin(ctx, params)
	fmt.Println(third.Decision, third.Record.Response.Status, string(third.Record.Response.Body))
	// Output:
	// execute in_flight
	// replay 201 created
}
