package memstore_test

import (
	"testing"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/store/memstore"
	"github.com/idemhq/idem/store/storetest"
)

// TestConformance runs the suite. There is no TestConformanceInstances
// (storetest.RunInstances): a memstore's records live in its process, so two
// instances never share them.
func TestConformance(t *testing.T) {
	storetest.Run(t, func(t *testing.T) idem.Store { return memstore.New() })
}

// TestConformanceWithBodyLimit runs the suite on a store that keeps bodies
// of at most 64 KiB, as DynamoDB and Memcached must.
func TestConformanceWithBodyLimit(t *testing.T) {
	storetest.Run(t, func(t *testing.T) idem.Store { return memstore.NewLimited(64 << 10) })
}
