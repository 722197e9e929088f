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
	signalled, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	// The first signal begins a graceful stop; a second one ends the
	// process at once (Go's default, restored by stop). The stop begins
	// once the default is back, so that no second signal is swallowed
	// after the command has said it is stopping.
	ctx, cancel := context.WithCancel(context.Background())
	context.AfterFunc(signalled, func() { stop(); cancel() })
	code := cli.Main(ctx, os.Args[1:], os.Getenv, os.Stdout, os.Stderr)
	stop()
	cancel()
	os.Exit(code)
}
