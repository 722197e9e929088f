package dynamostore

import (
	"testing"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/store/storetest"
)

func TestConformance(t *testing.T) {
	client := sharedClient(t)
	storetest.Run(t, func(t *testing.T) idem.Store { return newTestStore(t, client, 0) })
}

// TestConformanceOneShard puts every unsettled record in one partition of
// the index, so that scans page through it with LastEvaluatedKey.
func TestConformanceOneShard(t *testing.T) {
	client := sharedClient(t)
	storetest.Run(t, func(t *testing.T) idem.Store { return newTestStore(t, client, 1) })
}
