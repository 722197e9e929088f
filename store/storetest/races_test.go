package storetest_test

import (
	"context"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/store"
	"github.com/idemhq/idem/store/memstore"
	"github.com/idemhq/idem/store/storetest"
)

// slowStore is memstore whose acquires and finishes each take a millisecond
// more, as a round trip to a server does, and that counts how many of them
// are in the store at once.
type slowStore struct {
	*memstore.Store
	acquires, finishes underWay
}

// underWay counts the calls in a store now, and the most there were at once.
type underWay struct{ now, most atomic.Int32 }

func (u *underWay) call(fn func() error) error {
	n := u.now.Add(1)
	defer u.now.Add(-1)
	for m := u.most.Load(); n > m && !u.most.CompareAndSwap(m, n); m = u.most.Load() {
	}
	time.Sleep(time.Millisecond) // the round trip: what the racers overlap in
	return fn()
}

func (s *slowStore) Acquire(ctx context.Context, p store.AcquireParams) (r store.Record, err error) {
	err = s.acquires.call(func() error {
		r, err = s.Store.Acquire(ctx, p)
		return err
	})
	return r, err
}

func (s *slowStore) Finish(ctx context.Context, p store.FinishParams) error {
	return s.finishes.call(func() error { return s.Store.Finish(ctx, p) })
}

// TestSuiteRacesReachTheStore: the suite's races of raw store calls put
// many calls of one key in the store at once, so a store that is not atomic
// fails them (see the racyAcquire and racyFinish mutants). Its races of
// Begins through one engine do not: the engine sends one acquire of a key
// to the store at a time.
func TestSuiteRacesReachTheStore(t *testing.T) {
	var mu sync.Mutex
	stores := map[string]*slowStore{} // by case
	t.Run("suite", func(t *testing.T) {
		storetest.Run(t, func(t *testing.T) idem.Store {
			s := &slowStore{Store: memstore.New()}
			if c := strings.TrimPrefix(t.Name(), "TestSuiteRacesReachTheStore/suite/"); strings.HasPrefix(c, "Concurrent") {
				mu.Lock()
				stores[c] = s
				mu.Unlock()
			}
			return s
		})
	})
	for c, s := range stores {
		t.Logf("%s: at most %d acquires and %d finishes in the store at once", c, s.acquires.most.Load(), s.finishes.most.Load())
	}
	for c, calls := range map[string]func(s *slowStore) *underWay{
		"ConcurrentStoreAcquiresOneWinner": func(s *slowStore) *underWay { return &s.acquires },
		"ConcurrentSettlementsOneLands":    func(s *slowStore) *underWay { return &s.finishes },
	} {
		s := stores[c]
		if s == nil {
			t.Errorf("the suite has no case %s", c)
			continue
		}
		if most := calls(s).most.Load(); most < 2 {
			t.Errorf("%s never had two racers' calls in the store at once (at most %d)", c, most)
		}
	}
}
