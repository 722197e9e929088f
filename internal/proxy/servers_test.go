package proxy_test

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"testing"
	"time"

	"github.com/idemhq/idem/internal/proxy"
	"github.com/idemhq/idem/internal/wait"
)

// accepts reports whether addr takes a new TCP connection.
func accepts(addr string) bool {
	c, err := net.DialTimeout("tcp", addr, time.Second)
	if err != nil {
		return false
	}
	c.Close()
	return true
}

// holding serves a request to /hold until release is closed, saying on
// started that it began; anything else is answered at once.
func holding(started chan<- struct{}, release <-chan struct{}) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/hold" {
			started <- struct{}{}
			<-release
		}
		io.WriteString(w, "ok")
	})
}

// getWithin sends a GET in the background and returns where its status
// (or 0 when it failed) arrives.
func getWithin(url string, timeout time.Duration) <-chan int {
	got := make(chan int, 1)
	go func() {
		c := &http.Client{Timeout: timeout}
		resp, err := c.Get(url)
		if err != nil {
			got <- 0
			return
		}
		resp.Body.Close()
		got <- resp.StatusCode
	}()
	return got
}

// TestShutdownStopsTheFrontTogetherThenTheBackendThenTheAdmin: what users
// rely on at a graceful stop is that no server keeps taking requests
// another's drain will not wait for, and that probes see the unready state.
// Sequence: two front servers (the demo's API and a second one), a backend
// (the demo's acquirer, which the API calls) and an admin listener; a
// request held in the first front server; Shutdown begins. OnStop is called
// first (readiness goes false); the second front server stops accepting at
// once, though the first is still draining; the backend and the admin
// listener still accept while the front drains; once the held request
// finishes (it gets its answer), Shutdown returns and every server is
// closed. (Shutdown used to stop them one by one in the order they were
// started, sharing one deadline: the API kept taking charges while the
// acquirer drained, and the admin listener could outlive nothing.)
func TestShutdownStopsTheFrontTogetherThenTheBackendThenTheAdmin(t *testing.T) {
	started, release := make(chan struct{}, 1), make(chan struct{})
	defer func() {
		select {
		case <-release:
		default:
			close(release)
		}
	}()
	stopped := make(chan struct{})
	s := &proxy.Servers{Log: quiet, OnStop: func() { close(stopped) }}
	listen := func(l func(string, http.Handler) (string, error), h http.Handler) string {
		t.Helper()
		addr, err := l("127.0.0.1:0", h)
		if err != nil {
			t.Fatal(err)
		}
		return addr
	}
	backend := listen(s.ListenBackend, holding(nil, nil))
	front1 := listen(s.Listen, holding(started, release))
	front2 := listen(s.Listen, holding(nil, nil))
	admin := listen(s.ListenAdmin, holding(nil, nil))

	held := getWithin("http://"+front1+"/hold", 20*time.Second)
	wait.Recv(t, started, 5*time.Second, "the first front server to take the held request")
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	shut := make(chan error, 1)
	go func() { shut <- s.Shutdown(ctx) }()
	wait.Recv(t, stopped, 5*time.Second, "OnStop as the shutdown begins")
	wait.Until(t, 3*time.Second, "the second front server to stop accepting while the first drains", func() bool { return !accepts(front2) })
	if accepts(front1) {
		t.Error("the first front server still accepts while it drains")
	}
	if !accepts(backend) {
		t.Error("the backend stopped accepting before the front servers that call it drained")
	}
	if status := wait.Recv(t, getWithin("http://"+admin+"/", 5*time.Second), 10*time.Second, "the admin listener's answer"); status != 200 {
		t.Errorf("the admin listener answered %d while the front drained; want it up until the others stop", status)
	}
	close(release)
	if status := wait.Recv(t, held, 10*time.Second, "the held request's answer"); status != 200 {
		t.Errorf("the request in flight at the shutdown got %d; want it to finish", status)
	}
	if err := wait.Recv(t, shut, 10*time.Second, "Shutdown to return"); err != nil {
		t.Fatalf("Shutdown: %v", err)
	}
	for name, addr := range map[string]string{"front": front1, "backend": backend, "admin": admin} {
		if accepts(addr) {
			t.Errorf("the %s server still accepts after Shutdown", name)
		}
	}
}

// TestShutdownSaysWhenItsDeadlineCutsARequest: a connection still open
// when the shutdown's deadline comes is closed and reported (ErrCutShort);
// whether an outcome was at stake is the engine's Close to say. Sequence: a
// request held; Shutdown with a short deadline; it returns ErrCutShort.
func TestShutdownSaysWhenItsDeadlineCutsARequest(t *testing.T) {
	started, release := make(chan struct{}, 1), make(chan struct{})
	defer close(release)
	s := &proxy.Servers{Log: quiet}
	addr, err := s.Listen("127.0.0.1:0", holding(started, release))
	if err != nil {
		t.Fatal(err)
	}
	getWithin("http://"+addr+"/hold", 20*time.Second)
	wait.Recv(t, started, 5*time.Second, "the server to take the held request")
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	var shutErr error
	wait.Done(t, 5*time.Second, "Shutdown to return at its deadline", func() { shutErr = s.Shutdown(ctx) })
	if !errors.Is(shutErr, proxy.ErrCutShort) {
		t.Fatalf("Shutdown with a request still running at its deadline: %v; want ErrCutShort", shutErr)
	}
}
