package sqlitestore_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"path/filepath"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/store"
	"github.com/idemhq/idem/store/sqlitestore"
)

// TestDeadlineDuringBeginLeavesNoTransaction: a write whose context ends
// while its BEGIN IMMEDIATE runs must not leave the store's one write
// connection inside a transaction. The driver reports such a BEGIN as failed
// (the context's error) although it took the write lock, and the store went
// on without a ROLLBACK: from then on every write failed ("cannot start a
// transaction within a transaction", not ErrUnavailable, so the engine
// dropped outcomes instead of journaling them), and every other process
// sharing the file was locked out. It happened within 19 to 849 writes with
// deadlines this short.
func TestDeadlineDuringBeginLeavesNoTransaction(t *testing.T) {
	path := filepath.Join(t.TempDir(), "idem.db")
	s := open(t, path)
	e := engine(t, s, nil)
	running, err := e.Begin(ctx, idem.BeginParams{Key: "running", Fingerprint: payload})
	if err != nil || running.Decision != idem.Execute {
		t.Fatal(running.Decision, err)
	}
	now := time.Now()
	acq := func(c context.Context, key string) error {
		_, err := s.Acquire(c, store.AcquireParams{Key: key, Fingerprint: payload, Token: "tok", Now: now, LeaseExpires: now.Add(time.Minute)})
		return err
	}
	for i := range 1000 {
		c, cancel := context.WithTimeout(ctx, time.Duration(rand.IntN(300))*time.Microsecond)
		acq(c, fmt.Sprintf("k%d", i))
		cancel()
		if err := acq(ctx, fmt.Sprintf("probe%d", i)); err != nil {
			t.Errorf("after %d short-deadline writes, a write with no deadline fails: %v", i, err)
			break
		}
	}
	if err := acq(ctx, "later"); err != nil {
		t.Errorf("a later write still fails: %v", err)
	}
	err = e.Complete(ctx, running.Lease, &idem.Response{Status: 201, Body: []byte("charged")})
	if err != nil {
		t.Errorf("Complete of a lease taken before: %v; journaled: %d (the outcome is dropped)", err, e.Pending())
	}
	other, err := sqlitestore.Open(ctx, sqlitestore.Config{Path: path, BusyTimeout: 500 * time.Millisecond})
	if err != nil {
		t.Errorf("another process opening the same file: %v", err)
		return
	}
	other.Close()
}
