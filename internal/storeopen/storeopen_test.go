package storeopen_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/faultnet"
	"github.com/idemhq/idem/internal/storeopen"
	"github.com/idemhq/idem/internal/testkit"
	"github.com/idemhq/idem/store"
)

func TestMain(m *testing.M) { testkit.Main(m) }

// roundTrip opens dsn and runs one request through it.
func roundTrip(t *testing.T, dsn string) {
	t.Helper()
	ctx := context.Background()
	o, err := storeopen.Open(ctx, dsn)
	if err != nil {
		t.Fatalf("Open(%s): %v", dsn, err)
	}
	defer o.Close()
	e, err := idem.New(idem.Config{Store: o.Store})
	if err != nil {
		t.Fatal(err)
	}
	p := idem.BeginParams{Key: "storeopen-" + t.Name(), Fingerprint: idem.NewFingerprint(idem.Payload{Method: "POST"})}
	out, err := e.Begin(ctx, p)
	if err != nil || out.Decision != idem.Execute {
		t.Fatalf("%s: Begin = %v, %v", dsn, out.Decision, err)
	}
	if err := e.Release(ctx, out.Lease); err != nil {
		t.Fatal(err)
	}
	if o.NewNotifier != nil {
		n, err := o.NewNotifier(ctx)
		if err != nil {
			t.Fatalf("%s: NewNotifier: %v", dsn, err)
		}
		ch, cancel := n.Subscribe("", "k")
		defer cancel()
		if err := n.Notify(ctx, "", "k"); err != nil {
			t.Fatal(err)
		}
		select { // the notifier hears itself
		case <-ch:
		case <-time.After(10 * time.Second):
			t.Fatalf("%s: the notifier did not deliver its own notification", dsn)
		}
	}
}

func TestOpen(t *testing.T) {
	roundTrip(t, "memory:")
	roundTrip(t, "sqlite:"+filepath.Join(t.TempDir(), "idem.db"))
}

// TestOpenServers opens each networked store from a DSN, when its test
// server is configured (CI configures all of them).
func TestOpenServers(t *testing.T) {
	with := func(q string) func(string) string {
		return func(base string) string {
			if strings.Contains(base, "?") {
				return base + "&" + q
			}
			return base + "?" + q
		}
	}
	for _, c := range []struct {
		name, env string
		dsn       func(string) string
	}{
		{"postgres", "IDEM_TEST_DATABASE_URL", with("idem_schema=idem_storeopen_test")},
		{"redis", "IDEM_TEST_REDIS_URL", with("idem_prefix=idem-storeopen-test")},
		{"dynamodb", "IDEM_TEST_DYNAMODB_URL", func(u string) string {
			return "dynamodb://local:secret@" + strings.TrimPrefix(u, "http://") + "?region=us-east-1&table=idem_storeopen_test&create_table=true"
		}},
		{"memcached", "IDEM_TEST_MEMCACHED_ADDR", func(a string) string { return "memcached://" + a + "?idem_prefix=idem-storeopen-test" }},
	} {
		t.Run(c.name, func(t *testing.T) {
			roundTrip(t, c.dsn(testkit.Server(t, c.env)))
		})
	}
}

func TestOpenRefusesBadDSNs(t *testing.T) {
	for _, dsn := range []string{"", "mysql://x", "sqlite:", "postgres://u:secret@127.0.0.1:1/x?sslmode=bogus", "redis://127.0.0.1:6379/notanumber", "memcached://", "dynamodb://?table=x",
		"postgres://u:s3cret@host:abc/db", "redis://:secret@host:port/0", "redis+cluster://u:secret@h:x", "dynamodb://KEY:secret@h:p?table=t", "mysql://u:secret@h/x"} {
		_, err := storeopen.Open(context.Background(), dsn)
		if err == nil {
			t.Errorf("Open(%q) succeeded", dsn)
			continue
		}
		if !errors.Is(err, idem.ErrInvalid) {
			t.Errorf("Open(%q) = %v, want ErrInvalid", dsn, err)
		}
		if strings.Contains(err.Error(), "secret") || strings.Contains(err.Error(), "s3cret") {
			t.Errorf("Open(%q) leaked the password: %v", dsn, err)
		}
	}
}

// TestOpenEventuallyFailsAtOnceOnAWrongDSN: a database that does not
// exist, a user the server refuses and a SQLite file that cannot be made
// are mistakes, not a server not up yet: the proxy must not start on them
// (answering 503 forever, or with fail_open running unprotected).
func TestOpenEventuallyFailsAtOnceOnAWrongDSN(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	dsns := []string{"sqlite:" + filepath.Join(t.TempDir(), "missing-dir", "idem.db")}
	if pg := os.Getenv("IDEM_TEST_DATABASE_URL"); pg != "" {
		dsns = append(dsns, withPath(t, pg, "/idem_no_such_db"), withUser(t, pg, "idem_no_such_user"))
	}
	for _, dsn := range dsns {
		o, err := storeopen.OpenEventually(ctx, dsn)
		if err == nil {
			o.Close()
			t.Errorf("OpenEventually(%s) started; want it to fail at once", dsn)
		}
	}
	// A server that is down is still waited for.
	o, err := storeopen.OpenEventually(ctx, "postgres://postgres@127.0.0.1:1/test?sslmode=disable&connect_timeout=1")
	if err != nil {
		t.Errorf("a server that is down: %v; want a store that opens eventually", err)
	} else {
		o.Close()
	}
}

func withPath(t *testing.T, dsn, path string) string {
	u, err := url.Parse(dsn)
	if err != nil {
		t.Fatal(err)
	}
	u.Path = path
	return u.String()
}

func withUser(t *testing.T, dsn, user string) string {
	u, err := url.Parse(dsn)
	if err != nil {
		t.Fatal(err)
	}
	u.User = url.User(user)
	return u.String()
}

// TestErrorsHideEveryPassword: a password in the query (password=,
// sslpassword=) and one in a DSN that does not parse stay out of errors.
func TestErrorsHideEveryPassword(t *testing.T) {
	for _, dsn := range []string{
		"postgres://idem@127.0.0.1:5432/test?password=hunter2&sslmode=bogus",
		"postgres://idem@127.0.0.1:5432/test?sslpassword=hunter2&sslmode=bogus",
		"postgres://idem@127.0.0.1:5432/test?password=hunter2&connect_timeout=abc",
		"postgres://idem:hunter2/x@127.0.0.1:5432/test",
		"postgres://idem:hu%zznter2@127.0.0.1:5432/test",
		"redis://127.0.0.1:6379/0?password=hunter2&dial_timeout=x",
		"memcached://u:hunter2@",
		"dynamodb://AKIA:hunter2@%zz",
		"mysql://127.0.0.1/x?password=hunter2",
	} {
		_, err := storeopen.Open(context.Background(), dsn)
		if err == nil {
			t.Errorf("Open(%s) succeeded", dsn)
			continue
		}
		if strings.Contains(err.Error(), "hunter") {
			t.Errorf("Open(%s): %v", dsn, err)
		}
	}
}

// TestRedact: what messages and the demo show of a DSN.
func TestRedact(t *testing.T) {
	for dsn, want := range map[string]string{
		"postgres://idem:hunter2@h/db?sslmode=disable": "postgres://idem:xxxxx@h/db?sslmode=disable",
		"postgres://idem@h/db?password=hunter2&x=1":    "postgres://idem@h/db?password=xxxxx&x=1",
		"postgres://idem@h/db?sslpassword=hunter2":     "postgres://idem@h/db?sslpassword=xxxxx",
		"postgres://idem:hunter2/x@h/db":               "postgres://…",
		"host=h password=hunter2":                      "(a DSN that is not a URL)",
		"redis://:hunter2@h:6379/0":                    "redis://:xxxxx@h:6379/0",
		"sqlite:idem.db":                               "sqlite:idem.db",
		"memory:":                                      "memory:",
		"dynamodb://AKIA:hunter2@h:8000?table=t":       "dynamodb://AKIA:xxxxx@h:8000?table=t",
		"postgres:idem:hunter2@h/db":                   "postgres://…",
	} {
		if got := storeopen.Redact(dsn); got != want {
			t.Errorf("Redact(%s) = %s, want %s", dsn, got, want)
		}
	}
}

// TestStoreCallsEndWithTheirDeadline: a store that stops answering without
// refusing connections (a paused server, a partition) fails a call when
// the call's deadline passes, so that store_timeout bounds every request.
// Redis calls ran for go-redis's own read timeout instead (5 s; 10 s
// with its retry), whatever the deadline.
func TestStoreCallsEndWithTheirDeadline(t *testing.T) {
	for _, c := range []struct {
		name, env string
		dsn       func(addr string) string
	}{
		{"redis", "IDEM_TEST_REDIS_URL", func(a string) string { return "redis://" + a + "/0?idem_prefix=idem-storeopen-deadline" }},
		{"postgres", "IDEM_TEST_DATABASE_URL", func(a string) string {
			return "postgres://postgres@" + a + "/test?sslmode=disable&idem_schema=idem_storeopen_deadline"
		}},
		{"memcached", "IDEM_TEST_MEMCACHED_ADDR", func(a string) string { return "memcached://" + a + "?idem_prefix=idem-storeopen-deadline" }},
	} {
		t.Run(c.name, func(t *testing.T) {
			server := testkit.Server(t, c.env)
			if u, err := url.Parse(server); err == nil && u.Host != "" {
				server = u.Host
			}
			proxy, err := faultnet.Listen(server)
			if err != nil {
				t.Fatal(err)
			}
			defer proxy.Close()
			ctx := context.Background()
			o, err := storeopen.Open(ctx, c.dsn(proxy.Addr()))
			if err != nil {
				t.Fatal(err)
			}
			defer o.Close()
			get := func(d time.Duration) (time.Duration, error) {
				ctx, cancel := context.WithTimeout(ctx, d)
				defer cancel()
				began := time.Now()
				_, err := o.Store.Get(ctx, store.GetParams{Scope: "s", Key: "k", Now: time.Now()})
				return time.Since(began), err
			}
			if _, err := get(10 * time.Second); !errors.Is(err, idem.ErrNotFound) { // a connection in the pool
				t.Fatalf("Get before the pause: %v", err)
			}
			resume := proxy.Pause()
			defer resume()
			const deadline = 300 * time.Millisecond
			took, err := get(deadline)
			if err == nil || took > deadline+time.Second {
				t.Fatalf("Get with a %v deadline while the server does not answer: %v after %v; want an error by the deadline", deadline, err, took)
			}
		})
	}
}

// TestNothingToReleaseWhenTheStoreNeverOpened: a request refused because the
// store has not opened (its server down since the start) sent nothing to
// it, so there is no acquire to release. Each such request wrote a release
// to the journal, synced, for a later start to send: 200 files for 200
// refused requests, read as outcomes owed to the store.
func TestNothingToReleaseWhenTheStoreNeverOpened(t *testing.T) {
	ctx := context.Background()
	closed, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	down := closed.Addr().String()
	closed.Close()
	o, err := storeopen.OpenEventually(ctx, "postgres://postgres@"+down+"/test?sslmode=disable&connect_timeout=1")
	if err != nil {
		t.Fatal(err)
	}
	defer o.Close()
	dir := t.TempDir()
	eng, err := idem.New(idem.Config{Store: o.Store, JournalDir: dir, StoreTimeout: 200 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		stop, cancel := context.WithTimeout(ctx, time.Second)
		defer cancel()
		eng.Close(stop) // bounded: what the journal holds waits for a store that never comes
	}()
	for i := range 3 {
		_, err := eng.Begin(ctx, idem.BeginParams{Key: fmt.Sprint("k", i), Fingerprint: idem.NewFingerprint(idem.Payload{Method: "POST"})})
		if !errors.Is(err, idem.ErrUnavailable) {
			t.Fatalf("Begin while the store has not opened: %v; want ErrUnavailable", err)
		}
	}
	if files, _ := filepath.Glob(filepath.Join(dir, "*")); len(files) != 0 {
		t.Fatalf("%d files in the journal; want none: nothing was sent to the store", len(files))
	}
}

// TestSQLiteDSNIsAPlainPath: a SQLite DSN with options (file:PATH?cache=shared,
// the URI form SQLite drivers document) is refused, naming the path to use:
// it opened a new, empty database named "idem.db?cache=shared" next to the
// one holding the outcomes, and a completed key ran again. A path written
// with a leading // (sqlite:////data/idem.db) is the file it names.
func TestSQLiteDSNIsAPlainPath(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	path := filepath.Join(dir, "idem.db")
	fp := idem.NewFingerprint(idem.Payload{Method: "POST", Body: []byte("x")})
	use := func(dsn string) (idem.Decision, error) {
		o, err := storeopen.Open(ctx, dsn)
		if err != nil {
			return 0, err
		}
		defer o.Close()
		e, err := idem.New(idem.Config{Store: o.Store})
		if err != nil {
			t.Fatal(err)
		}
		defer e.Close(ctx)
		out, err := e.Begin(ctx, idem.BeginParams{Key: "charge-1", Fingerprint: fp})
		if err != nil {
			t.Fatal(err)
		}
		if out.Decision == idem.Execute {
			if err := e.Complete(ctx, out.Lease, &idem.Response{Status: 201}); err != nil {
				t.Fatal(err)
			}
		}
		return out.Decision, nil
	}
	if d, err := use("sqlite:" + path); err != nil || d != idem.Execute {
		t.Fatal(d, err)
	}
	for _, dsn := range []string{"file:" + path + "?cache=shared", "sqlite://" + path + "?_busy_timeout=5000", "sqlite:" + path + "#x"} {
		d, err := use(dsn)
		if !errors.Is(err, idem.ErrInvalid) || !strings.Contains(err.Error(), ":"+path) {
			t.Errorf("%s: %v, %v; want ErrInvalid naming the path to use", dsn, d, err)
		}
		if _, err := storeopen.OpenExisting(ctx, dsn); !errors.Is(err, idem.ErrInvalid) || strings.Contains(err.Error(), "no database") {
			t.Errorf("OpenExisting(%s): %v; want the same refusal", dsn, err)
		}
	}
	if d, err := use("sqlite:///" + path); err != nil || d != idem.Replay {
		t.Errorf("sqlite:///%s: %v, %v; want the replay", path, d, err)
	}
	if names, _ := filepath.Glob(filepath.Join(dir, "*")); len(names) != 1 {
		t.Errorf("the directory holds %q; want idem.db alone", names)
	}
}

// TestStoreWithNoKindIsNotShown: a store with no kind is refused without
// being shown unless it is a plain file path: a libpq key=value DSN was
// echoed password and all ("store \"host=db … password=hunter2\" names no
// kind"). A file name still gets the DSN to use.
func TestStoreWithNoKindIsNotShown(t *testing.T) {
	for _, dsn := range []string{"host=db user=app password=hunter2 dbname=pay", "password=hunter2", "user@hunter2"} {
		_, err := storeopen.Open(context.Background(), dsn)
		if !errors.Is(err, idem.ErrInvalid) || !strings.Contains(err.Error(), "names no kind") || strings.Contains(err.Error(), "hunter2") {
			t.Errorf("store %q: %v; want ErrInvalid saying it names no kind, without the password", dsn, err)
		}
	}
	_, err := storeopen.Open(context.Background(), "data/idem.db")
	if want := `store "data/idem.db" names no kind: a SQLite file is sqlite:data/idem.db`; err == nil || !strings.Contains(err.Error(), want) {
		t.Errorf("a file path: %v; want %q", err, want)
	}
}

// TestOpenEventuallyRefusesRedisCredentialsAtOnce: a DSN whose credentials
// the server refuses fails at once, for every store. A Redis (and Redis
// Cluster) DSN with a user and password the server refuses opened without
// error (the client never talked to the server): idem proxy started, and
// answered 503 to every keyed request for ever. A server that is down is
// still waited for.
func TestOpenEventuallyRefusesRedisCredentialsAtOnce(t *testing.T) {
	for _, c := range []struct {
		name, env string
		dsn       func(server string) string
	}{
		{"redis", "IDEM_TEST_REDIS_URL", func(server string) string {
			u, err := url.Parse(server)
			if err != nil {
				t.Fatal(err)
			}
			u.User = url.UserPassword("idem_no_such_user", "wrong-secret")
			return u.String()
		}},
		{"redis-cluster", "IDEM_TEST_REDIS_CLUSTER_ADDRS", func(addrs string) string {
			first, rest, _ := strings.Cut(addrs, ",")
			dsn := "redis+cluster://idem_no_such_user:wrong-secret@" + first
			if rest != "" {
				dsn += "?addr=" + strings.ReplaceAll(rest, ",", "&addr=")
			}
			return dsn
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			dsn := c.dsn(testkit.Server(t, c.env))
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			o, err := storeopen.OpenEventually(ctx, dsn)
			if err == nil {
				o.Close()
				t.Fatalf("OpenEventually(%s) started; want it to fail at once with ErrDenied, as for PostgreSQL", storeopen.Redact(dsn))
			}
			if !errors.Is(err, idem.ErrDenied) || strings.Contains(err.Error(), "wrong-secret") {
				t.Errorf("OpenEventually(%s) = %v; want ErrDenied, without the password", storeopen.Redact(dsn), err)
			}
		})
	}
	// A Redis that is down is still waited for: the store opens, and its
	// calls fail as unavailable.
	closed, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	down := closed.Addr().String()
	closed.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for _, dsn := range []string{"redis://u:p@" + down + "/0", "redis+cluster://u:p@" + down} {
		o, err := storeopen.OpenEventually(ctx, dsn)
		if err != nil {
			t.Errorf("OpenEventually(%s) with the server down: %v; want a store that opens eventually", dsn, err)
			continue
		}
		if _, err := o.Store.Get(ctx, store.GetParams{Key: "k", Now: time.Now()}); !errors.Is(err, idem.ErrUnavailable) {
			t.Errorf("a call on %s with the server down: %v; want ErrUnavailable", dsn, err)
		}
		o.Close()
	}
}

// TestOpenRefusesAClusterMasterThatRefusesTheCredentials: a Redis Cluster
// keeps its ACLs node by node; a master that refuses the DSN's user
// refuses every call on the records in its slots. Each master in turn is
// the only one that knows the user (the one the client loads the slots
// from): whichever master holds the record the opening reads, the open is
// refused, naming ErrDenied.
func TestOpenRefusesAClusterMasterThatRefusesTheCredentials(t *testing.T) {
	addrs := strings.Split(testkit.Server(t, "IDEM_TEST_REDIS_CLUSTER_ADDRS"), ",")
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	admin := redis.NewClusterClient(&redis.ClusterOptions{Addrs: addrs})
	defer admin.Close()
	var mu sync.Mutex // ForEachMaster asks the masters at once
	var masters []string
	if err := admin.ForEachMaster(ctx, func(ctx context.Context, c *redis.Client) error {
		mu.Lock()
		defer mu.Unlock()
		masters = append(masters, c.Options().Addr)
		return nil
	}); err != nil || len(masters) < 2 {
		t.Fatalf("the cluster's masters: %v, %v; want at least 2", masters, err)
	}
	user := "idem_storeopen_" + strconv.FormatInt(time.Now().UnixNano(), 36)
	deleteUser := func() {
		for _, m := range masters {
			c := redis.NewClient(&redis.Options{Addr: m})
			c.Do(context.Background(), "ACL", "DELUSER", user)
			c.Close()
		}
	}
	t.Cleanup(deleteUser)
	for _, only := range masters {
		deleteUser()
		c := redis.NewClient(&redis.Options{Addr: only})
		err := c.Do(ctx, "ACL", "SETUSER", user, "on", ">s3cr3t-pw", "~*", "&*", "+@all").Err()
		c.Close()
		if err != nil {
			t.Fatal(err)
		}
		dsn := "redis+cluster://" + user + ":s3cr3t-pw@" + only
		o, err := storeopen.OpenEventually(ctx, dsn)
		if err == nil {
			o.Close()
			t.Errorf("OpenEventually(%s) with the user known to %s alone started; want ErrDenied", storeopen.Redact(dsn), only)
		} else if !errors.Is(err, idem.ErrDenied) || strings.Contains(err.Error(), "s3cr3t-pw") {
			t.Errorf("OpenEventually(%s) with the user known to %s alone: %v; want ErrDenied, without the password", storeopen.Redact(dsn), only, err)
		}
	}
	// Known to every master, the user opens the store.
	for _, m := range masters {
		c := redis.NewClient(&redis.Options{Addr: m})
		err := c.Do(ctx, "ACL", "SETUSER", user, "on", ">s3cr3t-pw", "~*", "&*", "+@all").Err()
		c.Close()
		if err != nil {
			t.Fatal(err)
		}
	}
	o, err := storeopen.OpenEventually(ctx, "redis+cluster://"+user+":s3cr3t-pw@"+masters[0])
	if err != nil {
		t.Fatalf("the user known to every master: %v", err)
	}
	o.Close()
}

// TestPasswordWithASlashStaysOutOfErrorsAndRedact: a password with an
// unencoded / (or ?) whose start reads as a port ("/…", "2024/…": base64
// and AWS secrets hold a /) made url.Parse read the DSN as host:port, with
// the rest of the password in the path. Redact showed it whole, and the
// driver's error named the "database" that held it; OpenEventually then
// started the proxy (the "host", the user name, does not resolve), which
// logged that error and served it on /readyz. Such a DSN is refused now,
// before any driver sees it, as one that does not parse is.
func TestPasswordWithASlashStaysOutOfErrorsAndRedact(t *testing.T) {
	for _, dsn := range []string{
		"postgres://app.invalid:/hunter2@127.0.0.1:5432/test",
		"postgres://app.invalid:2024/hunter2@127.0.0.1:5432/test",
		"postgres://app.invalid:?hunter2@127.0.0.1:5432/test",
		"redis://:/hunter2@127.0.0.1:6379/0",
		"redis+cluster://default:/hunter2@127.0.0.1:7000",
		"dynamodb://AKIA:8/hunter2@127.0.0.1:8765?table=idem_records",
		"memcached://app:/hunter2@127.0.0.1:11211",
	} {
		if r := storeopen.Redact(dsn); strings.Contains(r, "hunter2") {
			t.Errorf("Redact(%s) = %s: the password is shown", dsn, r)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		if _, err := storeopen.Open(ctx, dsn); !errors.Is(err, idem.ErrInvalid) || strings.Contains(err.Error(), "hunter2") ||
			!strings.Contains(err.Error(), "percent-encoded") {
			t.Errorf("Open(%s): %v; want ErrInvalid asking for the password percent-encoded, without it", dsn, err)
		}
		if o, err := storeopen.OpenEventually(ctx, dsn); err == nil {
			o.Close()
			t.Errorf("OpenEventually(%s) started; want it refused at once", dsn)
		} else if strings.Contains(err.Error(), "hunter2") {
			t.Errorf("OpenEventually(%s): %v shows the password", dsn, err)
		}
		cancel()
	}
	// Percent-encoded, the same password is read as one.
	if got, want := storeopen.Redact("postgres://app:%2Fhunter2@127.0.0.1:5432/test"), "postgres://app:xxxxx@127.0.0.1:5432/test"; got != want {
		t.Errorf("Redact of the encoded password = %s; want %s", got, want)
	}
}

// TestUnknownDSNOptionsAreRefused: a mistyped option of a DynamoDB or
// Memcached DSN was dropped without a word (Redis's driver refuses one:
// "redis: unexpected option"). tabel=… put the records in the default
// table idem_records, which another deployment may use; idem_prefx=… put
// them under the default prefix idem, shared with every other deployment
// on the server; create_table=1 created nothing; memcached credentials
// were never sent. Each is refused, naming the option.
func TestUnknownDSNOptionsAreRefused(t *testing.T) {
	for dsn, want := range map[string]string{
		"dynamodb://KEY:s3cr3t@127.0.0.1:8765?tabel=idem_staging&region=us-east-1":                   `option "tabel" is not one of this store's`,
		"dynamodb://KEY:s3cr3t@127.0.0.1:8765?table=idem_staging&create_table=1&region=us-east-1":    `option "create_table" wants true or false`,
		"dynamodb://KEY:s3cr3t@127.0.0.1:8765?table=idem_staging&tls=yes&region=us-east-1":           `option "tls" wants true or false`,
		"dynamodb://KEY:s3cr3t@127.0.0.1:8765?table=a&table=b&region=us-east-1":                      `option "table" is given more than once`,
		"dynamodb://KEY:s3cr3t@127.0.0.1:8765?table=&region=us-east-1":                               `option "table" is empty`,
		"dynamodb://KEY:s3cr3t@127.0.0.1:8765/idem_staging?region=us-east-1":                         "the table is ?table=NAME",
		"dynamodb://KEY@127.0.0.1:8765?region=us-east-1":                                             "want both an access key and its secret",
		"dynamodb://KEY:s3cr3t@127.0.0.1:8765?region=us-east-1&aws_secret=s3cr3t":                    `option "aws_secret" is not one of this store's`,
		"memcached://127.0.0.1:11211?idem_prefx=staging":                                             `option "idem_prefx" is not one of this store's`,
		"memcached://app:s3cr3t@127.0.0.1:11211":                                                     "takes no user name or password",
		"memcached://127.0.0.1:11211/staging":                                                        "want memcached://host:port",
		"memcached://127.0.0.1:11211?idem_prefix=a&idem_prefix=b":                                    `option "idem_prefix" is given more than once`,
		"dynamodb://KEY:s3cr3t@127.0.0.1:8765?table=idem_staging&create_table=TRUE&region=us-east-1": `option "create_table" wants true or false`,
		"memcached://127.0.0.1:11211,127.0.0.1:11212?idem_prefix=staging":                            "",
	} {
		o, err := storeopen.Open(context.Background(), dsn)
		if want == "" {
			if err != nil {
				t.Errorf("Open(%s) = %v; want it to open", dsn, err)
			} else {
				o.Close()
			}
			continue
		}
		if err == nil {
			o.Close()
			t.Errorf("Open(%s) succeeded; want ErrInvalid: %s", dsn, want)
		} else if !errors.Is(err, idem.ErrInvalid) || !strings.Contains(err.Error(), want) || strings.Contains(err.Error(), "s3cr3t") {
			t.Errorf("Open(%s) = %v; want ErrInvalid: %s, without the secret", dsn, err, want)
		}
	}
}

// TestOpenRefusesAMissingDynamoTable: a DynamoDB DSN naming a table that
// is not there (a typo in table=, or create_table left out) opened, and
// every call failed. It is refused at open now, naming the table; with
// create_table=true, or once the table is there, it opens.
func TestOpenRefusesAMissingDynamoTable(t *testing.T) {
	addr := strings.TrimPrefix(testkit.Server(t, "IDEM_TEST_DYNAMODB_URL"), "http://")
	table := "idem_storeopen_" + strconv.FormatInt(time.Now().UnixNano(), 36)
	dsn := "dynamodb://local:s3cr3t@" + addr + "?region=us-east-1&table=" + table
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for _, open := range []func(context.Context, string) (*storeopen.Opened, error){storeopen.Open, storeopen.OpenEventually} {
		o, err := open(ctx, dsn+"&create_table=false")
		if err == nil {
			o.Close()
			t.Fatalf("a missing table: opened; want it refused")
		}
		if !errors.Is(err, idem.ErrInvalid) || !strings.Contains(err.Error(), `no table "`+table+`"`) || strings.Contains(err.Error(), "s3cr3t") {
			t.Errorf("a missing table: %v; want ErrInvalid naming it, without the secret", err)
		}
	}
	for _, dsn := range []string{dsn + "&create_table=true", dsn} {
		o, err := storeopen.OpenEventually(ctx, dsn)
		if err != nil {
			t.Fatalf("OpenEventually(%s): %v", storeopen.Redact(dsn), err)
		}
		o.Close()
	}
}

// TestOpenEventuallyRefusesAnOptionThePostgresServerRefuses: a PostgreSQL
// DSN with an option the server refuses for good (a mistyped idem_schema,
// which pgx sends as a run-time parameter: FATAL 42704; a value a
// parameter does not take: 22023) started the proxy answering 503 for
// ever, as a missing database did before it was refused at start.
func TestOpenEventuallyRefusesAnOptionThePostgresServerRefuses(t *testing.T) {
	pg := testkit.Server(t, "IDEM_TEST_DATABASE_URL")
	for name, value := range map[string]string{"idem_schem": "payments", "statement_timeout": "soon"} {
		u, err := url.Parse(pg)
		if err != nil {
			t.Fatal(err)
		}
		q := u.Query()
		q.Set(name, value)
		u.RawQuery = q.Encode()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		o, err := storeopen.OpenEventually(ctx, u.String())
		if err == nil {
			_, gerr := o.Store.Get(ctx, store.GetParams{Key: "k", Now: time.Now()})
			o.Close()
			t.Errorf("OpenEventually(%s) started (its calls: %v); want it to fail at once", u.Redacted(), gerr)
		} else if !strings.Contains(err.Error(), name) {
			t.Errorf("OpenEventually(%s) = %v; want the server's refusal, naming %s", u.Redacted(), err, name)
		}
		cancel()
	}
}
