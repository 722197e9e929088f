package reconcile_test

import (
	"context"
	"fmt"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/reconcile"
	"github.com/idemhq/idem/store/memstore"
	"github.com/idemhq/idem/store/storetest"
)

// A charge whose process died mid-call to the acquirer is settled by asking
// the acquirer, by the downstream key the handler recorded.
func Example() {
	ctx := context.Background()
	clock := storetest.NewClock(time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC))
	engine, _ := idem.New(idem.Config{Store: memstore.New(), Clock: clock})
	params := idem.BeginParams{Key: "charge-1", Fingerprint: idem.NewFingerprint(idem.Payload{Method: "POST", Path: "/v1/charges"})}

	out, _ := engine.Begin(ctx, params)
	key := out.Lease.DownstreamKey("authorize")
	_ = engine.Checkpoint(ctx, out.Lease, "authorize", []byte(key))
	// ... the process dies here, after the acquirer charged the card ...
	clock.Advance(5 * time.Minute)

	acquirerCharged := map[string]bool{key: true}
	r, _ := reconcile.New(reconcile.Config{Engine: engine,
		Resolver: reconcile.ResolverFunc(func(ctx context.Context, rec idem.Record) (reconcile.Resolution, error) {
			if acquirerCharged[rec.DownstreamKey("authorize")] {
				return reconcile.Resolution{Outcome: reconcile.Completed, Response: &idem.Response{Status: 201, Body: []byte(`{"status":"succeeded"}`)}}, nil
			}
			return reconcile.Resolution{Outcome: reconcile.Failed}, nil
		})})
	report, _ := r.RunOnce(ctx)
	fmt.Println("completed:", report.Completed)

	retry, _ := engine.Begin(ctx, params)
	fmt.Println(retry.Decision, string(retry.Record.Response.Body))
	// Output:
	// completed: 1
	// replay {"status":"succeeded"}
}
