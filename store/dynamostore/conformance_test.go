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

// TestConformanceInstances runs the two-instance cases on two stores on one
// table, each with a client of its own, as two processes would have.
func TestConformanceInstances(t *testing.T) {
	url := endpoint(t)
	storetest.RunInstances(t, func(t *testing.T) (idem.Store, idem.Store) {
		table := newTable(t)
		instance := func() idem.Store {
			client, _ := newClient(url)
			s, err := New(Config{Client: client, Table: table})
			if err != nil {
				t.Fatal(err)
			}
			return s
		}
		return instance(), instance()
	})
}
