package storetest

import (
	"testing"

	"github.com/idemhq/idem"
)

// RunInstances runs, as parallel subtests, the cases that race one key
// through two instances of a store on one backend, as the processes of a
// service that share a store do: Racers acquires of the key from each state
// an acquire starts from, split over the two instances, and Racers
// settlements of one record under the token that reconcilers borrowed from
// it. Each race
// must have exactly the winners the store's Apply methods allow, whichever
// instance each caller went through, so a store must take its atomicity from
// the backend (a transaction, a file lock, a script, a conditional write),
// never from its process (a mutex, a cache). [Run] races the same raw calls
// through one instance, which shows that each call is atomic, but a store
// that took its atomicity from its process would pass it: only two
// instances on one backend tell the two apart.
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

// testInstancesAcquireOneWinner: [Racers] acquires of one key, split over
// the two instances, from each state an acquire starts from; see
// [testAcquiresOneWinner].
func testInstancesAcquireOneWinner(t *testing.T, instances [2]idem.Store) {
	testAcquiresOneWinner(t, instances[:], Racers)
}

// testInstancesBorrowedTokenSettlesOnce: [Racers] settlements of one record
// under the token reconcilers borrowed from it, split over the two
// instances; see [testSettlementsOneLands].
func testInstancesBorrowedTokenSettlesOnce(t *testing.T, instances [2]idem.Store) {
	testSettlementsOneLands(t, instances[:], Racers)
}
