package storeopen_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/storeopen"
)

// TestStoreWithNoKindIsNotShown: a store with no kind is refused without
// being shown unless it is a plain file path: a libpq key=value DSN was
// echoed password and all ("store \"host=db … password=hunter2\" names no
// kind"). A file name still gets the DSN to use.
func TestStoreWithNoKindIsNotShown(t *testing.T) {
	for _, dsn := range []string{"host=db user=app password=hunter2 dbname=pay", "password=hunter2", "user@hunter2"} {
		_, err := storeopen.Open(context.Background(), dsn)
		if !errors.Is(err, idem.ErrInvalid) || !strings.Contains(err.Error(), "names no kind") || strings.Contains(err.Error(), "hunter2") {
			t.Errorf("store %q: %v; want ErrInvalid saying it names no kind, without the password", dsn, err)
		}
	}
	_, err := storeopen.Open(context.Background(), "data/idem.db")
	if want := `store "data/idem.db" names no kind: a SQLite file is sqlite:data/idem.db`; err == nil || !strings.Contains(err.Error(), want) {
		t.Errorf("a file path: %v; want %q", err, want)
	}
}
