// Package storeopen turns a store DSN into an [idem.Store]. It is the one
// place that knows every store.
//
//	sqlite:PATH            the embedded default (sqlite:idem.db)
//	memory:                in memory; forgotten on exit (tests and demos)
package storeopen

import (
	"context"
	"fmt"
	"strings"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/store/memstore"
	"github.com/idemhq/idem/store/sqlitestore"
)

// Default is the DSN used when none is given: SQLite in the working directory.
const Default = "sqlite:idem.db"

// Opened is an open store with what else it offers.
type Opened struct {
	Store idem.Store
	// Notifier wakes waiters across instances, when the store has one.
	Notifier idem.Notifier
	// Close releases the store's connections or file.
	Close func() error
}

// Open opens the store named by dsn.
func Open(ctx context.Context, dsn string) (*Opened, error) {
	scheme, rest, _ := strings.Cut(dsn, ":")
	switch scheme {
	case "memory", "mem":
		return &Opened{Store: memstore.New(), Close: func() error { return nil }}, nil
	case "sqlite", "sqlite3", "file":
		path := strings.TrimPrefix(rest, "//")
		if path == "" {
			return nil, fmt.Errorf("%w: store %q: sqlite needs a path, as in sqlite:idem.db", idem.ErrInvalid, dsn)
		}
		s, err := sqlitestore.Open(ctx, sqlitestore.Config{Path: path})
		if err != nil {
			return nil, err
		}
		return &Opened{Store: s, Close: s.Close}, nil
	}
	return nil, fmt.Errorf("%w: store %q: unknown kind %q; use sqlite:PATH, postgres://…, redis://… or memory:", idem.ErrInvalid, dsn, scheme)
}
