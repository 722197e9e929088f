// Command idem makes side effects behind HTTP APIs happen exactly once. See
// the README, or run `idem help`.
package main

import (
	"context"
	"os"
	"os/signal"
	"syscall"

	"github.com/idemhq/idem/internal/cli"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	// The first signal begins a graceful stop; a second one ends the
	// process at once (Go's default, restored by stop).
	context.AfterFunc(ctx, stop)
	code := cli.Main(ctx, os.Args[1:], os.Getenv, os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}
