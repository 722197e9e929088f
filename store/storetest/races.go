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

// storeRacers is how many goroutines race raw store calls on one key in the
// cases of [Run] that race the store itself: enough to have many calls under
// way at once, few enough for a slow backend (DynamoDB Local) to answer them
// quickly.
const storeRacers = 50

// testConcurrentStoreAcquiresOneWinner: acquires of one key sent to the
// store at once, each with a token of its own, from each state an acquire
// starts from; see [testAcquiresOneWinner]. The engine's concurrency cases
// cannot show this: an engine sends one acquire of a key to the store at a
// time, and answers the requests that come meanwhile with its answer.
func testConcurrentStoreAcquiresOneWinner(t *testing.T, h *harness) {
	testAcquiresOneWinner(t, []idem.Store{h.store}, storeRacers)
}

// testConcurrentSettlementsOneLands: settlements of one record under the
// token reconcilers borrowed from it, sent to the store at once, as
// reconcilers that found the record in one scan (of several processes, or a
// reconciler and an operator) send them; see [testSettlementsOneLands].
func testConcurrentSettlementsOneLands(t *testing.T, h *harness) {
	testSettlementsOneLands(t, []idem.Store{h.store}, storeRacers)
}

// testAcquiresOneWinner: racers acquire one key at once, each with a token
// of its own, from each state an acquire starts from, racer i through
// stores[i%len(stores)] (one store, or instances of one on a shared
// backend). Exactly one is granted the lease where a key is free (new,
// released, expired, or a takeover-safe lease that ran out), with the fence
// that follows; none where a lease ran out that only the reconciler may
// resolve, which every racer sees made UNKNOWN under the old token. Every
// racer is answered with the record the winner made, and every store then
// reads it. A store whose acquire reads the record and then writes it, in
// two steps, lets several racers win.
func testAcquiresOneWinner(t *testing.T, stores []idem.Store, racers int) {
	a := stores[0]
	fp := testkit.Fingerprint("a")
	for _, c := range []struct {
		from         string
		takeoverSafe bool
		// prepare makes the key's record (through the first store) and
		// returns when the race happens and the token of the record as it
		// stands then ("" when there is none).
		prepare func(t *testing.T, key string) (at time.Time, token string)
		// winners is how many racers may hold the lease; state and fence
		// are those of the record every racer must be answered with.
		winners int
		state   idem.State
		fence   int64
	}{
		{"no record", false, func(*testing.T, string) (time.Time, string) { return epoch, "" }, 1, idem.StateInProgress, 1},
		{"a released record", false, func(t *testing.T, key string) (time.Time, string) {
			r := testkit.Acquire(t, a, "s", key, epoch, lease)
			testkit.Finish(t, a, r, epoch, idem.StateFailed, retention)
			return epoch.Add(time.Second), r.Token
		}, 1, idem.StateInProgress, 2},
		{"an expired record", false, func(t *testing.T, key string) (time.Time, string) {
			r := testkit.Acquire(t, a, "s", key, epoch, lease)
			testkit.Finish(t, a, r, epoch, idem.StateCompleted, time.Minute)
			return epoch.Add(time.Minute), r.Token
		}, 1, idem.StateInProgress, 1},
		{"a takeover-safe lease that ran out", true, func(t *testing.T, key string) (time.Time, string) {
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
		{"a lease that ran out", false, func(t *testing.T, key string) (time.Time, string) {
			return epoch.Add(lease), testkit.Acquire(t, a, "s", key, epoch, lease).Token
		}, 0, idem.StateUnknown, 1},
	} {
		t.Run("from "+c.from, func(t *testing.T) {
			raceAgain(t, "from "+c.from, "acquires", racers, func(key string) int {
				at, before := c.prepare(t, key)
				tokens := make([]string, racers)
				for i := range tokens {
					var err error
					if tokens[i], err = store.NewToken(); err != nil {
						t.Fatal(err)
					}
				}
				recs, errs, most := raceEach(t, racers, func(i int) (idem.Record, error) {
					return stores[i%len(stores)].Acquire(ctx, store.AcquireParams{Scope: "s", Key: key, Fingerprint: fp, Token: tokens[i],
						Now: at, LeaseExpires: at.Add(lease), TakeoverSafe: c.takeoverSafe})
				})
				want := before // the token every racer must see
				winners := 0
				for i, r := range recs {
					if errs[i] != nil {
						t.Fatalf("racer %d (store %d): Acquire: %v", i, i%len(stores), errs[i])
					}
					if r.Token == tokens[i] {
						winners++
						want = r.Token
					}
				}
				if winners != c.winners {
					t.Fatalf("%d of %d racers over %d store(s) were granted the lease (at most %d acquires under way at once); want %d",
						winners, racers, len(stores), most, c.winners)
				}
				for i, r := range recs {
					if r.Token != want || r.State != c.state || r.Fence != c.fence {
						t.Fatalf("racer %d (store %d) was answered with %s under %q, fence %d; want %s under %q, fence %d",
							i, i%len(stores), r.State, r.Token, r.Fence, c.state, want, c.fence)
					}
				}
				for n, s := range stores {
					r, err := s.Get(ctx, store.GetParams{Scope: "s", Key: key, Now: at})
					if err != nil || r.Token != want || r.State != c.state || r.Fence != c.fence {
						t.Fatalf("store %d reads %+v, %v; want %s under %q, fence %d", n, r, err, c.state, want, c.fence)
					}
				}
				return most
			})
		})
	}
}

// testSettlementsOneLands: racers that borrowed one record's token from a
// scan (reconcilers) settle it at once, some as released, some as completed
// with responses of their own, none marked a repeat, racer i through
// stores[i/2%len(stores)] (so that each store carries both kinds); once
// where its lease ran out, once where its owner marked it UNKNOWN. Exactly
// one settlement lands, every other is refused with ErrLeaseLost, and every
// store then reads the one that landed: the compare-and-set on the token
// holds, so two reconcilers never both act on one outcome. A store whose
// finish reads the record and then writes it, in two steps, lets several
// land.
func testSettlementsOneLands(t *testing.T, stores []idem.Store, racers int) {
	a := stores[0]
	for _, c := range []struct {
		from  string
		state idem.State // the record's before the race
	}{
		{"a lease that ran out", idem.StateInProgress},
		{"a record marked unknown", idem.StateUnknown},
	} {
		t.Run("from "+c.from, func(t *testing.T) {
			raceAgain(t, "from "+c.from, "settlements", racers, func(key string) int {
				stale := testkit.Acquire(t, a, "s", key, epoch, lease)
				if c.state == idem.StateUnknown {
					testkit.Finish(t, a, stale, epoch, idem.StateUnknown, 0)
				}
				at := epoch.Add(lease) // a scan returns the record
				settlements := make([]idem.FinishParams, racers)
				for i := range settlements {
					p := idem.FinishParams{Scope: "s", Key: key, Token: stale.Token, Now: at, State: idem.StateFailed, Expires: at.Add(retention)}
					if i%2 == 1 {
						p.State, p.Response = idem.StateCompleted, &idem.Response{Status: 201, Body: fmt.Appendf(nil, `{"racer":%d}`, i)}
					}
					settlements[i] = p
				}
				_, errs, most := raceEach(t, racers, func(i int) (struct{}, error) {
					return struct{}{}, stores[i/2%len(stores)].Finish(ctx, settlements[i])
				})
				landed := -1
				for i, err := range errs {
					switch {
					case err == nil && landed >= 0:
						t.Fatalf("racers %d and %d both settled the record under the borrowed token (at most %d settlements under way at once); want one",
							landed, i, most)
					case err == nil:
						landed = i
					case !errors.Is(err, idem.ErrLeaseLost):
						t.Fatalf("racer %d (store %d): Finish: %v; want nil or ErrLeaseLost", i, i/2%len(stores), err)
					}
				}
				if landed < 0 {
					t.Fatalf("none of %d settlements under the borrowed token landed; want one", racers)
				}
				want := settlements[landed]
				for n, s := range stores {
					r, err := s.Get(ctx, store.GetParams{Scope: "s", Key: key, Now: at})
					if err != nil || r.State != want.State || r.Token != stale.Token || !r.Response.Equal(want.Response) {
						t.Fatalf("store %d reads %+v, %v; want racer %d's settlement, %s with response %+v", n, r, err, landed, want.State, want.Response)
					}
				}
				return most
			})
		})
	}
}

// raceAttempts is how many times a race of raw store calls is run, on fresh
// keys, until two of its calls were under way at once.
const raceAttempts = 5

// raceAgain runs race on key, and again on fresh keys (key, attempt n) while
// never two of its calls were under way at once (called and not yet
// answered), and logs how many were. race returns the most of its calls that
// were under way at once. A store that answers over a network has many under
// way; one that answers in microseconds (from memory, or a server on
// loopback that replies before the client reads) may have answered each
// call before the next began, on a busy machine, and such a race shows
// nothing of its atomicity: the suite's own tests show that its races put
// many calls in a store that takes its time (a round trip) at once.
func raceAgain(t *testing.T, key, calls string, racers int, race func(key string) int) {
	t.Helper()
	for attempt := 1; ; attempt++ {
		k := key
		if attempt > 1 {
			k = fmt.Sprintf("%s, attempt %d", key, attempt)
		}
		most := race(k)
		switch {
		case most >= 2:
			t.Logf("%d %s raced: at most %d under way at once (attempt %d)", racers, calls, most, attempt)
			return
		case attempt == raceAttempts:
			t.Logf("in %d races of %d %s, never two were under way at once: the store answered each before the next began", attempt, racers, calls)
			return
		}
	}
}
