package testkit

import (
	"fmt"
	"io"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
)

// The environment variables that point the integration tests at servers,
// with an example value each (what `bash .ci/run` sets).
var servers = map[string]string{
	"IDEM_TEST_DATABASE_URL":        "postgres://postgres@127.0.0.1:5432/test?sslmode=disable",
	"IDEM_TEST_REDIS_URL":           "redis://127.0.0.1:6379/0",
	"IDEM_TEST_REDIS_CLUSTER_ADDRS": "127.0.0.1:7000,127.0.0.1:7001,127.0.0.1:7002",
	"IDEM_TEST_MEMCACHED_ADDR":      "127.0.0.1:11211",
	"IDEM_TEST_DYNAMODB_URL":        "http://127.0.0.1:8765",
	// Not a server but PostgreSQL's server binaries, for the tests that run
	// a server of their own to crash it.
	"IDEM_TEST_PG_BINDIR": "/usr/lib/postgresql/15/bin",
}

// skipped counts the tests skipped for want of each variable.
var skipped = struct {
	sync.Mutex
	by map[string]int
}{by: map[string]int{}}

// Server returns the value of env, which points a test at a server (a DSN,
// a URL or host:port). Without it the test is skipped, and [Main] says so
// at the end of the run.
func Server(tb testing.TB, env string) string {
	tb.Helper()
	v := os.Getenv(env)
	if v == "" {
		if _, ok := servers[env]; !ok {
			tb.Fatalf("testkit: %s is not a server variable", env)
		}
		skipped.Lock()
		skipped.by[env]++
		skipped.Unlock()
		tb.Skipf("set %s (e.g. %s) to run this test", env, servers[env])
	}
	return v
}

// Main runs a package's tests (call it from TestMain) and then says which
// integration tests did not run for want of a server, and how to run them.
// `go test ./...` shows what a passing package prints only with -v, so
// without -v the notice goes to the terminal, where the person running the
// tests sees it; with -v, or without a terminal, to stderr. The cleanups
// run after the tests.
func Main(m *testing.M, cleanups ...func()) {
	code := m.Run()
	for _, c := range cleanups {
		c()
	}
	skipped.Lock()
	by := skipped.by
	skipped.Unlock()
	if len(by) > 0 {
		var w io.Writer = os.Stderr
		if !testing.Verbose() {
			if tty, err := os.OpenFile("/dev/tty", os.O_WRONLY, 0); err == nil {
				defer tty.Close()
				w = tty
			}
		}
		io.WriteString(w, SkipNotice(strings.TrimSuffix(filepath.Base(os.Args[0]), ".test"), by))
	}
	os.Exit(code)
}

// SkipNotice is what [Main] says of a package whose tests skipped for want
// of servers: by counts the skips for each variable.
func SkipNotice(pkg string, by map[string]int) string {
	var b strings.Builder
	for _, env := range slices.Sorted(maps.Keys(by)) {
		fmt.Fprintf(&b, "NOTE %s: %d integration test(s) did not run: set %s=%s to run them (bash .ci/run starts every server and runs them all)\n",
			pkg, by[env], env, servers[env])
	}
	return b.String()
}
