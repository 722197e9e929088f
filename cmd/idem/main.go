// Command idem makes side effects behind HTTP APIs happen exactly once. See
// the README, or run `idem help`.
package main

import (
	"context"
	"os"
	"os/signal"
	"slices"
	"syscall"

	"github.com/idemhq/idem/internal/cli"
)

func main() {
	sigs := []os.Signal{syscall.SIGTERM, os.Interrupt}
	ignored := slices.ContainsFunc(sigs, signal.Ignored) // a background job of a script starts with SIGINT ignored
	signalled, stop := signal.NotifyContext(context.Background(), sigs...)
	// The first signal begins a graceful stop; a second one ends the
	// process at once: Go's default, which stop restores, or, for a signal
	// ignored at start (which stop would restore), an exit. The stop begins
	// once that is in place, so that no second signal is swallowed after
	// the command has said it is stopping.
	ctx, cancel := context.WithCancel(context.Background())
	context.AfterFunc(signalled, func() {
		if ignored {
			again := make(chan os.Signal, 1)
			signal.Notify(again, sigs...)
			go func() { os.Exit(128 + int((<-again).(syscall.Signal))) }()
		}
		stop()
		cancel()
	})
	code := cli.Main(ctx, os.Args[1:], os.Getenv, os.Stdout, os.Stderr)
	stop()
	cancel()
	os.Exit(code)
}
