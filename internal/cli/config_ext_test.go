package cli_test

import (
	"cmp"
	"context"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemhq/idem/internal/cli"
)

// TestStoreAndResolverStillComeFromTheEnvironment: with the flags' defaults
// no longer read from the environment, the environment still applies.
func TestStoreAndResolverStillComeFromTheEnvironment(t *testing.T) {
	dsn, _ := seed(t)
	var out, errOut strings.Builder
	code := cli.Main(context.Background(), []string{"keys", "ls"}, cli.EnvOf(map[string]string{"IDEM_STORE": dsn}), &out, &errOut)
	if code != 0 || !strings.Contains(out.String(), "done") {
		t.Errorf("keys ls with IDEM_STORE: exit %d, %s %s", code, out.String(), errOut.String())
	}
	out.Reset()
	errOut.Reset()
	code = cli.Main(context.Background(), []string{"reconcile", "--once", "--store", dsn}, cli.EnvOf(map[string]string{"IDEM_RESOLVER_URL": "http://127.0.0.1:1/resolve"}), &out, &errOut)
	if strings.Contains(errOut.String(), "--resolver-url is required") {
		t.Errorf("reconcile ignores IDEM_RESOLVER_URL: exit %d, %s", code, errOut.String())
	}
}

// TestKeysAndReconcileReadTheConfigFile: idem keys and idem reconcile take
// the deployment's file, for its store and its longest retention; keys
// never creates a missing SQLite database.
func TestKeysAndReconcileReadTheConfigFile(t *testing.T) {
	dsn, engine := seed(t)
	path := cli.WriteFile(t, "idem.yaml", "upstream: http://x\nstore: "+dsn+"\nretention: 24h\nroutes:\n  - match: POST /v1/charges\n    retention: 72h\n")
	for _, env := range []map[string]string{{"IDEM_CONFIG": path}, {}} {
		args := []string{"keys", "ls"}
		if len(env) == 0 {
			args = append(args, "--config", path)
		}
		var out, errOut strings.Builder
		code := cli.Main(context.Background(), args, cli.EnvOf(env), &out, &errOut)
		if code != 0 || !strings.Contains(out.String(), "done") {
			t.Errorf("%v %v: exit %d, %s %s; want the file's store listed", args, env, code, out.String(), errOut.String())
		}
	}

	// resolve settles with the longest retention of the file's routes.
	var out, errOut strings.Builder
	code := cli.Main(context.Background(), []string{"keys", "resolve", "unknown", "--config", path, "--completed", "--status", "201", "--force"}, cli.EnvOf(nil), &out, &errOut)
	if code != 0 {
		t.Fatalf("resolve: exit %d, %s", code, errOut.String())
	}
	r, err := engine().Get(context.Background(), "tenant", "unknown")
	if err != nil {
		t.Fatal(err)
	}
	if left := time.Until(r.Expires); left < 71*time.Hour {
		t.Errorf("resolved with %v of retention left; want the file's longest, 72h", left.Round(time.Hour))
	}

	// A missing SQLite database is an error, not a new empty one.
	missing := filepath.Join(t.TempDir(), "idem.db")
	errOut.Reset()
	code = cli.Main(context.Background(), []string{"keys", "ls", "--store", "sqlite:" + missing}, cli.EnvOf(nil), io.Discard, &errOut)
	if _, err := os.Stat(missing); code == 0 || err == nil {
		t.Errorf("keys ls on a missing database: exit %d (%s), file made: %v", code, errOut.String(), err == nil)
	}
}

// runDemoUntilUp runs idem demo until it says where it listens, and returns what
// it printed.
func runDemoUntilUp(t *testing.T, args []string, env map[string]string) string {
	t.Helper()
	t.Chdir(t.TempDir()) // the demo's files
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	out := &untilWriter{want: "payments API listening", seen: cancel}
	var errOut strings.Builder
	args = append([]string{"demo", "--listen", "127.0.0.1:0", "--acquirer-listen", "127.0.0.1:0", "--admin-listen", ""}, args...)
	code := cli.Main(ctx, args, cli.EnvOf(env), out, &errOut)
	if code != 0 || !strings.Contains(out.String(), "payments API listening") {
		t.Fatalf("demo: exit %d, %s %s", code, out.String(), errOut.String())
	}
	return out.String()
}

// untilWriter calls seen once what is written holds want.
type untilWriter struct {
	mu   sync.Mutex
	b    strings.Builder
	want string
	seen func()
}

func (w *untilWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.b.Write(p)
	if strings.Contains(w.b.String(), w.want) {
		w.seen()
	}
	return len(p), nil
}

func (w *untilWriter) String() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.String()
}

// TestDemoPrintsNoPassword: the demo says which store it uses without the
// DSN's password.
func TestDemoPrintsNoPassword(t *testing.T) {
	if testing.Short() {
		t.Skip("needs PostgreSQL")
	}
	dsn := strings.Replace(cmp.Or(os.Getenv("IDEM_TEST_DATABASE_URL"), "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"), "postgres@", "postgres:hunter2@", 1)
	if out := runDemoUntilUp(t, []string{"--store", dsn}, nil); strings.Contains(out, "hunter2") || !strings.Contains(out, "postgres://postgres:xxxxx@") {
		t.Errorf("demo prints:\n%s", out)
	}
}

// TestDemoTakesTheEnvironment: the demo reads IDEM_STORE (and the other
// variables of the settings it shares with the proxy) as the proxy does.
func TestDemoTakesTheEnvironment(t *testing.T) {
	dir := t.TempDir()
	out := runDemoUntilUp(t, nil, map[string]string{"IDEM_STORE": "sqlite:" + filepath.Join(dir, "from-env.db")})
	if !strings.Contains(out, "from-env.db") {
		t.Errorf("demo ignores IDEM_STORE:\n%s", out)
	}
}

// TestDemoRefusesAnEmptyJournalDir: the demo, like the proxy, refuses an
// empty --journal-dir (it meant no journal without a word): none says so.
func TestDemoRefusesAnEmptyJournalDir(t *testing.T) {
	var out, errOut strings.Builder
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second) // a demo that started would serve until then
	defer cancel()
	code := cli.Main(ctx, []string{"demo", "--journal-dir="}, cli.EnvOf(nil), &out, &errOut)
	if code != 2 || !strings.Contains(errOut.String(), "write none") {
		t.Fatalf("demo --journal-dir=: exit %d, %s; want 2 and the way to say none", code, errOut.String())
	}
}

// TestDemoRefusesAStoreWithoutShowingIt: a store the demo cannot keep its
// ledger in is refused by its kind, never shown whole: a libpq key=value
// DSN, which has no scheme, was echoed password and all, from --store and
// from IDEM_STORE.
func TestDemoRefusesAStoreWithoutShowingIt(t *testing.T) {
	for _, c := range []struct {
		args []string
		env  map[string]string
		want string
	}{
		{[]string{"--store", "host=db user=app password=hunter2 dbname=pay"}, nil, "not a sqlite: or postgres:// DSN"},
		{nil, map[string]string{"IDEM_STORE": "host=db password=hunter2"}, "not a sqlite: or postgres:// DSN"},
		{[]string{"--store", "password=hunter2:x"}, nil, "not a sqlite: or postgres:// DSN"},
		{[]string{"--store", "redis://:hunter2@127.0.0.1:6379"}, nil, "not redis"},
	} {
		t.Chdir(t.TempDir()) // the files of a demo that would start
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		var out, errOut strings.Builder
		args := append([]string{"demo", "--listen", "127.0.0.1:0", "--acquirer-listen", "127.0.0.1:0", "--admin-listen", ""}, c.args...)
		code := cli.Main(ctx, args, cli.EnvOf(c.env), &out, &errOut)
		cancel()
		if code != 2 || strings.Contains(errOut.String()+out.String(), "hunter2") || !strings.Contains(errOut.String(), c.want) {
			t.Errorf("demo %q %v: exit %d, %s; want 2, %q, and no password", c.args, c.env, code, errOut.String(), c.want)
		}
	}
}

// TestDemoRefusesAnAcquirerThatIsNoURL: --acquirer must be an http(s) URL,
// said before the demo starts. (127.0.0.1:8090 started a demo whose every
// charge failed.)
func TestDemoRefusesAnAcquirerThatIsNoURL(t *testing.T) {
	// A demo that started would write its files here, and serve until the
	// context ends.
	t.Chdir(t.TempDir())
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var out, errOut strings.Builder
	code := cli.Main(ctx, []string{"demo", "--listen", "127.0.0.1:0", "--admin-listen", "", "--acquirer", "127.0.0.1:8090"}, cli.EnvOf(nil), &out, &errOut)
	if code != 2 || !strings.Contains(errOut.String(), "--acquirer") || !strings.Contains(errOut.String(), "http://") {
		t.Fatalf("demo --acquirer 127.0.0.1:8090: exit %d, %s; want 2 and what --acquirer takes", code, errOut.String())
	}
}

// TestProxyRefusesAPasswordReadAsAPort: a password with an unencoded / at
// its start ("/…", or digits then "/") is read by url.Parse as a port and
// a path. With the store's, the proxy started (the "host", the user name,
// does not resolve: unavailable), and its log and /readyz, which load
// balancers and anyone reaching the admin listener read, showed the
// password in the driver's error ("database=hunter2@…"); with the
// upstream's, it started, sending every request to the host "svc", and its
// start-up line showed the password. Both are refused now, asking for the
// password percent-encoded, without showing it.
func TestProxyRefusesAPasswordReadAsAPort(t *testing.T) {
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--upstream", "http://127.0.0.1:9", "--store", "postgres://app.invalid:/hunter2@127.0.0.1:5432/test"}, "percent-encoded"},
		{[]string{"--upstream", "http://127.0.0.1:9", "--store", "postgres://app.invalid:2024/hunter2@127.0.0.1:5432/test"}, "percent-encoded"},
		{[]string{"--upstream", "http://127.0.0.1:9", "--store", "redis://:/hunter2@127.0.0.1:6379/0"}, "percent-encoded"},
		{[]string{"--upstream", "http://svc:/hunter2@127.0.0.1:9", "--store", "memory:"}, "user information"},
	} {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		var out, errOut strings.Builder
		args := append([]string{"proxy", "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0",
			"--journal-dir", filepath.Join(t.TempDir(), "journal")}, c.args...)
		code := cli.Main(ctx, args, cli.EnvOf(nil), &out, &errOut)
		timedOut := ctx.Err() != nil
		cancel()
		if code == 0 || timedOut || strings.Contains(errOut.String()+out.String(), "hunter2") || !strings.Contains(errOut.String(), c.want) {
			t.Errorf("proxy %q: exit %d (ran until the deadline: %v), %s; want it refused at start, saying %q, without the password",
				c.args, code, timedOut, errOut.String()+out.String(), c.want)
		}
	}
}
