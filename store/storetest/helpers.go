package storetest

import (
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/store"
)

// Fingerprint is the fingerprint of a POST /v1/charges with body, for
// tests that call a store directly.
func Fingerprint(body string) idem.Fingerprint {
	return idem.NewFingerprint(idem.Payload{Method: "POST", Path: "/v1/charges", Body: []byte(body)})
}

// Acquire acquires scope and key on s at now with a new token, failing the
// test unless the lease is granted, and returns the record.
func Acquire(t *testing.T, s idem.Store, scope, key string, now time.Time, lease time.Duration) idem.Record {
	t.Helper()
	tok, err := store.NewToken()
	if err != nil {
		t.Fatal(err)
	}
	r, err := s.Acquire(ctx, store.AcquireParams{Scope: scope, Key: key, Fingerprint: Fingerprint("a"),
		Token: tok, Now: now, LeaseExpires: now.Add(lease)})
	if err != nil {
		t.Fatalf("Acquire(%q, %q): %v", scope, key, err)
	}
	if r.Token != tok {
		t.Fatalf("Acquire(%q, %q) did not grant the lease: %+v", scope, key, r)
	}
	return r
}

// Finish settles r on s as state at now (a COMPLETED record with a small
// response; a terminal one kept for retention), failing the test on error.
func Finish(t *testing.T, s idem.Store, r idem.Record, now time.Time, state idem.State, retention time.Duration) {
	t.Helper()
	p := idem.FinishParams{Scope: r.Scope, Key: r.Key, Token: r.Token, Now: now, State: state}
	if state == idem.StateCompleted {
		p.Response = &idem.Response{Status: 201, Body: []byte("ok")}
	}
	if state.Terminal() {
		p.Expires = now.Add(retention)
	}
	if err := s.Finish(ctx, p); err != nil {
		t.Fatalf("Finish(%q) as %s: %v", r.Key, state, err)
	}
}
