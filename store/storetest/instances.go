package storetest

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/testkit"
	"github.com/idemhq/idem/store"
)

// RunInstances runs, as parallel subtests, the cases that race one key
// through two instances of a store on one backend, as the processes of a
// service that share a store do: Racers acquires of the key from each state
// an acquire starts from, split over the two instances, and settlements of
// one record under the token that reconcilers borrowed from it. Each race
// must have exactly the winners the store's Apply methods allow, whichever
// instance each caller went through, so a store must take its atomicity from
// the backend (a transaction, a file lock, a script, a conditional write),
// never from its process (a mutex, a cache). The single-instance
// concurrency cases of [Run] cannot tell the two apart.
//
// open is called once per subtest and returns two instances of the store,
// each with connections (clients, pools, handles) of its own, on one empty
// backend that no other test uses (one file, schema, key prefix or table),
// releasing them with t.Cleanup. A store whose records live in its process
// (memstore) cannot have two instances on one backend and does not run
// these cases.
func RunInstances(t *testing.T, open func(t *testing.T) (a, b idem.Store)) {
	cases := []struct {
		name string
		fn   func(t *testing.T, instances [2]idem.Store)
	}{
		{"AcquireOneWinner", testInstancesAcquireOneWinner},
		{"BorrowedTokenSettlesOnce", testInstancesBorrowedTokenSettlesOnce},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			a, b := open(t)
			c.fn(t, [2]idem.Store{a, b})
		})
	}
}

// testInstancesAcquireOneWinner: racers split over two instances acquire
// one key, from each state an acquire starts from. Exactly one is granted
// the lease where a key is free (new, released, expired, or a takeover-safe
// lease that ran out), with the fence that follows; none where a lease ran
// out that only the reconciler may resolve, which every racer sees made
// UNKNOWN under the old token. Every racer is answered with the record the
// winner made, and both instances then read it.
func testInstancesAcquireOneWinner(t *testing.T, instances [2]idem.Store) {
	a := instances[0]
	fp := testkit.Fingerprint("a")
	for _, c := range []struct {
		from         string
		takeoverSafe bool
		// prepare makes the key's record (through the first instance) and
		// returns when the race happens and the token of the record as it
		// stands then ("" when there is none).
		prepare func(key string) (at time.Time, token string)
		// winners is how many racers may hold the lease; state and fence
		// are those of the record every racer must be answered with.
		winners int
		state   idem.State
		fence   int64
	}{
		{"no record", false, func(string) (time.Time, string) { return epoch, "" }, 1, idem.StateInProgress, 1},
		{"a released record", false, func(key string) (time.Time, string) {
			r := testkit.Acquire(t, a, "s", key, epoch, lease)
			testkit.Finish(t, a, r, epoch, idem.StateFailed, retention)
			return epoch.Add(time.Second), r.Token
		}, 1, idem.StateInProgress, 2},
		{"an expired record", false, func(key string) (time.Time, string) {
			r := testkit.Acquire(t, a, "s", key, epoch, lease)
			testkit.Finish(t, a, r, epoch, idem.StateCompleted, time.Minute)
			return epoch.Add(time.Minute), r.Token
		}, 1, idem.StateInProgress, 1},
		{"a takeover-safe lease that ran out", true, func(key string) (time.Time, string) {
			tok, err := store.NewToken()
			if err != nil {
				t.Fatal(err)
			}
			r, err := a.Acquire(ctx, store.AcquireParams{Scope: "s", Key: key, Fingerprint: fp, Token: tok, Now: epoch,
				LeaseExpires: epoch.Add(lease), TakeoverSafe: true})
			if err != nil || r.Token != tok {
				t.Fatalf("Acquire(%q) = %+v, %v; want the lease", key, r, err)
			}
			return epoch.Add(lease), tok
		}, 1, idem.StateInProgress, 2},
		{"a lease that ran out", false, func(key string) (time.Time, string) {
			return epoch.Add(lease), testkit.Acquire(t, a, "s", key, epoch, lease).Token
		}, 0, idem.StateUnknown, 1},
	} {
		t.Run("from "+c.from, func(t *testing.T) {
			key := "from " + c.from
			at, before := c.prepare(key)
			tokens := make([]string, Racers)
			for i := range tokens {
				var err error
				if tokens[i], err = store.NewToken(); err != nil {
					t.Fatal(err)
				}
			}
			recs, errs := raceEach(t, func(i int) (idem.Record, error) {
				return instances[i%2].Acquire(ctx, store.AcquireParams{Scope: "s", Key: key, Fingerprint: fp, Token: tokens[i],
					Now: at, LeaseExpires: at.Add(lease), TakeoverSafe: c.takeoverSafe})
			})
			want := before // the token every racer must see
			winners := 0
			for i, r := range recs {
				if errs[i] != nil {
					t.Fatalf("racer %d (instance %d): Acquire: %v", i, i%2, errs[i])
				}
				if r.Token == tokens[i] {
					winners++
					want = r.Token
				}
			}
			if winners != c.winners {
				t.Fatalf("%d racers over two instances were granted the lease; want %d", winners, c.winners)
			}
			for i, r := range recs {
				if r.Token != want || r.State != c.state || r.Fence != c.fence {
					t.Fatalf("racer %d (instance %d) was answered with %s under %q, fence %d; want %s under %q, fence %d",
						i, i%2, r.State, r.Token, r.Fence, c.state, want, c.fence)
				}
			}
			for n, s := range instances {
				r, err := s.Get(ctx, store.GetParams{Scope: "s", Key: key, Now: at})
				if err != nil || r.Token != want || r.State != c.state || r.Fence != c.fence {
					t.Fatalf("instance %d reads %+v, %v; want %s under %q, fence %d", n, r, err, c.state, want, c.fence)
				}
			}
		})
	}
}

// testInstancesBorrowedTokenSettlesOnce: reconcilers on two instances that
// borrowed one record's token from a scan settle it at once, some as
// released, some as completed with responses of their own, none marked a
// repeat. Exactly one settlement lands, every other is refused with
// ErrLeaseLost, and both instances then read the one that landed: the
// compare-and-set on the token holds across processes, so two reconcilers
// never both act on one outcome.
func testInstancesBorrowedTokenSettlesOnce(t *testing.T, instances [2]idem.Store) {
	stale := testkit.Acquire(t, instances[0], "s", "stale", epoch, lease)
	at := epoch.Add(lease) // the lease ran out: a scan returns the record
	settlements := make([]idem.FinishParams, Racers)
	for i := range settlements {
		p := idem.FinishParams{Scope: "s", Key: "stale", Token: stale.Token, Now: at, State: idem.StateFailed, Expires: at.Add(retention)}
		if i%2 == 1 {
			p.State, p.Response = idem.StateCompleted, &idem.Response{Status: 201, Body: fmt.Appendf(nil, `{"racer":%d}`, i)}
		}
		settlements[i] = p
	}
	// Racer i goes through instance i/2%2, so that each instance carries
	// both kinds of settlement.
	_, errs := raceEach(t, func(i int) (struct{}, error) {
		return struct{}{}, instances[i/2%2].Finish(ctx, settlements[i])
	})
	landed := -1
	for i, err := range errs {
		switch {
		case err == nil && landed >= 0:
			t.Fatalf("racers %d and %d both settled the record under the borrowed token; want one", landed, i)
		case err == nil:
			landed = i
		case !errors.Is(err, idem.ErrLeaseLost):
			t.Fatalf("racer %d (instance %d): Finish: %v; want nil or ErrLeaseLost", i, i/2%2, err)
		}
	}
	if landed < 0 {
		t.Fatalf("none of %d settlements under the borrowed token landed; want one", Racers)
	}
	want := settlements[landed]
	for n, s := range instances {
		r, err := s.Get(ctx, store.GetParams{Scope: "s", Key: "stale", Now: at})
		if err != nil || r.State != want.State || r.Token != stale.Token || !r.Response.Equal(want.Response) {
			t.Fatalf("instance %d reads %+v, %v; want racer %d's settlement, %s with response %+v", n, r, err, landed, want.State, want.Response)
		}
	}
}
