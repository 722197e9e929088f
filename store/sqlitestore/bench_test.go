package sqlitestore_test

import (
	"path/filepath"
	"strconv"
	"testing"

	"github.com/idemhq/idem/store/storetest"
)

// BenchmarkAcquireComplete is one request's store work: acquire a new key,
// then complete it (two write transactions).
func BenchmarkAcquireComplete(b *testing.B) {
	s := open(b, filepath.Join(b.TempDir(), "idem.db"))
	storetest.BenchAcquireComplete(b, s, nil)
}

// BenchmarkAcquireCompleteParallel is BenchmarkAcquireComplete from many
// goroutines at once, whose writes are group-committed.
func BenchmarkAcquireCompleteParallel(b *testing.B) {
	s := open(b, filepath.Join(b.TempDir(), "idem.db"))
	storetest.BenchAcquireCompleteParallel(b, s)
}

// BenchmarkReplay is a retry of a completed request: one read transaction.
func BenchmarkReplay(b *testing.B) {
	s := open(b, filepath.Join(b.TempDir(), "idem.db"))
	storetest.BenchReplay(b, s, nil)
}

// BenchmarkRawInsertUpdate is the physical floor beside AcquireComplete: a
// bare INSERT then UPDATE by primary key on a table of the same shape, each
// its own durable transaction, prepared once, on the same connection
// settings.
func BenchmarkRawInsertUpdate(b *testing.B) {
	s := open(b, filepath.Join(b.TempDir(), "idem.db"))
	db := s.DB()
	if _, err := db.Exec(`CREATE TABLE raw (scope TEXT, key TEXT, state TEXT, body BLOB, PRIMARY KEY (scope, key))`); err != nil {
		b.Fatal(err)
	}
	insert, err := db.Prepare(`INSERT INTO raw VALUES ('', ?, 'in_progress', NULL)`)
	if err != nil {
		b.Fatal(err)
	}
	update, err := db.Prepare(`UPDATE raw SET state = 'completed', body = ? WHERE scope = '' AND key = ?`)
	if err != nil {
		b.Fatal(err)
	}
	body := []byte(`{"id":"ch_1","amount":100}`)
	b.ResetTimer()
	for i := 0; b.Loop(); i++ {
		key := strconv.Itoa(i)
		if _, err := insert.Exec(key); err != nil {
			b.Fatal(err)
		}
		if _, err := update.Exec(body, key); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkRawSelect is the floor beside Replay: a bare SELECT by key,
// prepared once.
func BenchmarkRawSelect(b *testing.B) {
	s := open(b, filepath.Join(b.TempDir(), "idem.db"))
	db := s.DB()
	if _, err := db.Exec(`CREATE TABLE raw (scope TEXT, key TEXT, state TEXT, body BLOB, PRIMARY KEY (scope, key));
		INSERT INTO raw VALUES ('', 'k', 'completed', x'7b7d')`); err != nil {
		b.Fatal(err)
	}
	sel, err := db.Prepare(`SELECT state, body FROM raw WHERE scope = '' AND key = 'k'`)
	if err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	for b.Loop() {
		var state string
		var body []byte
		if err := sel.QueryRow().Scan(&state, &body); err != nil {
			b.Fatal(err)
		}
	}
}
