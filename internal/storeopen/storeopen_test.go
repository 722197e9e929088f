package storeopen_test

import (
	"context"
	"errors"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/storeopen"
	"github.com/idemhq/idem/internal/testkit"
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
