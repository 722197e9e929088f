package sqlitestore_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/store/sqlitestore"
)

func Example() {
	ctx := context.Background()
	dir, _ := os.MkdirTemp("", "idem-example")
	defer os.RemoveAll(dir)

	store, err := sqlitestore.Open(ctx, sqlitestore.Config{Path: filepath.Join(dir, "idem.db")})
	if err != nil {
		panic(err)
	}
	defer store.Close()
	engine, _ := idem.New(idem.Config{Store: store})
	params := idem.BeginParams{Key: "refund-3", Fingerprint: idem.NewFingerprint(idem.Payload{Method: "POST", Path: "/refunds"})}

	out, _ := engine.Begin(ctx, params)
	_ = engine.Complete(ctx, out.Lease, &idem.Response{Status: 200, Body: []byte("refunded")})
	again, _ := engine.Begin(ctx, params)
	fmt.Println(out.Decision, "then", again.Decision, string(again.Record.Response.Body))
	// Output: execute then replay refunded
}
