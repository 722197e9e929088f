package memstore_test

import (
	"testing"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/store/memstore"
	"github.com/idemhq/idem/store/storetest"
)

func TestConformance(t *testing.T) {
	storetest.Run(t, func(t *testing.T) idem.Store { return memstore.New() })
}
