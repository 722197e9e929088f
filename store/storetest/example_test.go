package storetest_test

import (
	"fmt"
	"time"

	"github.com/idemhq/idem/store/storetest"
)

// A store's conformance test is one call:
//
//	func TestConformance(t *testing.T) {
//		storetest.Run(t, func(t *testing.T) idem.Store { return newIsolatedStore(t) })
//	}
//
// The suite moves time with its Clock, which tests of engines and stores can
// use too.
func ExampleClock() {
	clock := storetest.NewClock(time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC))
	clock.Advance(90 * time.Second)
	fmt.Println(clock.Now().Format(time.TimeOnly))
	// Output: 00:01:30
}
