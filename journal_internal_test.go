package idem

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/idemhq/idem/internal/wait"
	"github.com/idemhq/idem/store"
	"github.com/idemhq/idem/store/memstore"
)

// lostAcquire is a store whose acquires of the key "lost" are never
// answered, and whose settlements fail while off is set.
type lostAcquire struct {
	Store
	mu  sync.Mutex
	off bool
}

func (s *lostAcquire) Acquire(ctx context.Context, p store.AcquireParams) (store.Record, error) {
	if p.Key == "lost" {
		return store.Record{}, ErrUnavailable
	}
	return s.Store.Acquire(ctx, p)
}

func (s *lostAcquire) Finish(ctx context.Context, p store.FinishParams) error {
	s.mu.Lock()
	off := s.off
	s.mu.Unlock()
	if off {
		return ErrUnavailable
	}
	return s.Store.Finish(ctx, p)
}

func (s *lostAcquire) setOff(off bool) {
	s.mu.Lock()
	s.off = off
	s.mu.Unlock()
}

// TestCloseStoresAnOutcomeJournaledAfterOnlyReleasesWereLeft: the journal
// held only a release kept for a late acquire (so close need not wait for
// it) when an outcome came in, while the store was away again; the store
// is back, and Close stores the outcome before it returns. (Close saw the
// journal as holding kept releases only, from before the outcome came,
// and returned at once: the outcome, given to its client, was lost.)
func TestCloseStoresAnOutcomeJournaledAfterOnlyReleasesWereLeft(t *testing.T) {
	ctx := context.Background()
	s := &lostAcquire{Store: memstore.New()}
	eng, err := New(Config{Store: s, StoreTimeout: 50 * time.Millisecond, Lease: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	fp := NewFingerprint(Payload{Method: "POST", Path: "/charges", Body: []byte(`{}`)})
	out, err := eng.Begin(ctx, BeginParams{Key: "k", Fingerprint: fp})
	if err != nil || out.Decision != Execute {
		t.Fatal(out.Decision, err)
	}
	if _, err := eng.Begin(ctx, BeginParams{Key: "lost", Fingerprint: fp}); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("Begin of the lost acquire: %v", err)
	}
	j := eng.journal
	wait.Until(t, 10*time.Second, "the journal to hold only the kept release", func() bool {
		j.mu.Lock()
		defer j.mu.Unlock()
		if j.quiet == nil {
			return false
		}
		select {
		case <-j.quiet:
			return true
		default:
			return false
		}
	})
	s.setOff(true)
	if err := eng.Complete(ctx, out.Lease, &Response{Status: 201}); err != nil {
		t.Fatal(err)
	}
	s.setOff(false)
	closeCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := eng.Close(closeCtx); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if r, err := s.Store.Get(ctx, store.GetParams{Key: "k", Now: time.Now()}); err != nil || r.State != StateCompleted {
		t.Fatalf("the outcome: %+v, %v; want it stored", r, err)
	}
}

// TestCloseDoesNotWaitForKeptReleases: an acquire whose answer was lost
// leaves a release in the journal, kept until the acquire's lease would
// have ended (the store answers it lease lost: nothing was acquired); an
// outcome waits in the journal too, until the store is back. Close returns
// once the outcome is stored, not when the release's lease ends. (It
// waited for the drain loop, which runs until no entry is left, kept
// releases included: up to a whole lease past every outcome stored.)
func TestCloseDoesNotWaitForKeptReleases(t *testing.T) {
	s := &lostAcquire{Store: memstore.New()}
	fp := NewFingerprint(Payload{Method: "POST", Path: "/charges", Body: []byte(`{}`)})
	eng, err := New(Config{Store: s, StoreTimeout: 50 * time.Millisecond, Lease: time.Hour, JournalDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	out, err := eng.Begin(context.Background(), BeginParams{Key: "k", Fingerprint: fp})
	if err != nil || out.Decision != Execute {
		t.Fatal(out.Decision, err)
	}
	if _, err := eng.Begin(context.Background(), BeginParams{Key: "lost", Fingerprint: fp}); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("Begin of the lost acquire: %v", err)
	}
	s.setOff(true)
	if err := eng.Complete(context.Background(), out.Lease, &Response{Status: 201}); err != nil {
		t.Fatal(err)
	}
	s.setOff(false)
	closed := make(chan error, 1)
	go func() { closed <- eng.Close(context.Background()) }()
	if err := wait.Recv(t, closed, 20*time.Second, "Close (the release's lease is an hour)"); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if r, err := s.Store.Get(context.Background(), store.GetParams{Key: "k", Now: time.Now()}); err != nil || r.State != StateCompleted {
		t.Fatalf("the outcome: %+v, %v; want it stored", r, err)
	}
}
