package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"sync/atomic"
	"time"
)

// runEcho serves a toy API to put idem in front of: every request it really
// runs gets the next execution number, so a replay is easy to tell from a
// second execution.
func runEcho(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlags("echo")
	listen := fs.String("listen", "127.0.0.1:9000", "`address` to serve on")
	delay := fs.Duration("delay", 0, "how long each request takes (to watch duplicates wait)")
	if err := parseFlagsOnly(fs, args, stdout, stderr); err != nil {
		return exitStatus(err)
	}
	ln, err := net.Listen("tcp", *listen)
	if err != nil {
		return fail(stderr, fs.Name(), err)
	}
	fmt.Fprintf(stdout, "idem echo: a toy API on http://%s that numbers every request it runs\n", ln.Addr())
	var executions atomic.Int64
	srv := &http.Server{ReadHeaderTimeout: 10 * time.Second, Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		n := executions.Add(1)
		select {
		case <-time.After(*delay):
		case <-r.Context().Done():
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, "{\"execution\":%d,\"method\":%q,\"path\":%q,\"body\":%q}\n", n, r.Method, r.URL.Path, body)
	})}
	go func() {
		<-ctx.Done()
		srv.Shutdown(context.Background())
	}()
	if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
		return fail(stderr, fs.Name(), err)
	}
	return 0
}
