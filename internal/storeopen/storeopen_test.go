package storeopen_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/storeopen"
)

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
	pg, redisURL := os.Getenv("IDEM_TEST_DATABASE_URL"), os.Getenv("IDEM_TEST_REDIS_URL")
	if pg == "" || redisURL == "" {
		t.Skip("set IDEM_TEST_DATABASE_URL and IDEM_TEST_REDIS_URL to open PostgreSQL and Redis")
	}
	sep := "?"
	if strings.Contains(pg, "?") {
		sep = "&"
	}
	roundTrip(t, pg+sep+"idem_schema=idem_storeopen_test")
	roundTrip(t, redisURL+"?idem_prefix=idem-storeopen-test")
}

func TestOpenRefusesBadDSNs(t *testing.T) {
	for _, dsn := range []string{"", "mysql://x", "sqlite:", "postgres://u:secret@127.0.0.1:1/x?sslmode=bogus", "redis://127.0.0.1:6379/notanumber"} {
		_, err := storeopen.Open(context.Background(), dsn)
		if err == nil {
			t.Errorf("Open(%q) succeeded", dsn)
			continue
		}
		if !errors.Is(err, idem.ErrInvalid) {
			t.Errorf("Open(%q) = %v, want ErrInvalid", dsn, err)
		}
		if strings.Contains(err.Error(), "secret") {
			t.Errorf("Open(%q) leaked the password: %v", dsn, err)
		}
	}
}
