package httpidem_test

import (
	"context"
	"database/sql"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"sync/atomic"
	"testing"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/httpidem"
	"github.com/idemhq/idem/store/memstore"
	"github.com/idemhq/idem/store/sqlitestore"
)

// ledgerApp debits a ledger and completes the record in one SQLite
// transaction, through httpidem.Finish.
type ledgerApp struct {
	store      *sqlitestore.Store
	failCommit atomic.Bool // the commit fails: the transaction rolls back
}

func (a *ledgerApp) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	tx, err := a.store.DB().BeginTx(ctx, nil)
	if err != nil {
		http.Error(w, err.Error(), 503)
		return
	}
	defer tx.Rollback()
	key := r.Header.Get("Idempotency-Key")
	if _, err := tx.ExecContext(ctx, `INSERT INTO ledger (idem_key, amount) VALUES (?, -100)`, key); err != nil {
		http.Error(w, err.Error(), 500)
		return
	}
	resp := &idem.Response{Status: 201, Header: http.Header{"Content-Type": {"application/json"}, "Set-Cookie": {"s=1"}},
		Body: []byte(`{"debited":100}`)}
	err = httpidem.Finish(w, r, resp, func(p idem.FinishParams) error {
		if err := a.store.FinishTx(ctx, tx, p); err != nil {
			return err
		}
		if a.failCommit.Load() {
			return errors.New("commit failed: disk full")
		}
		return tx.Commit()
	})
	if err != nil {
		httpidem.NothingHappened(r) // rolled back: let the retry run
		http.Error(w, "try again", 503)
	}
}

func TestFinishCommitsWithBusinessWrites(t *testing.T) {
	store, err := sqlitestore.Open(context.Background(), sqlitestore.Config{Path: filepath.Join(t.TempDir(), "idem.db")})
	if err != nil {
		t.Fatal(err)
	}
	defer store.Close()
	if _, err := store.DB().Exec(`CREATE TABLE ledger (idem_key TEXT, amount INTEGER)`); err != nil {
		t.Fatal(err)
	}
	app := &ledgerApp{store: store}
	srv := serve(t, httpidem.Config{Engine: newEngine(t, store), TakeoverSafe: true}, app)
	debits := func(key string) int {
		var n int
		if err := store.DB().QueryRow(`SELECT count(*) FROM ledger WHERE idem_key = ?`, key).Scan(&n); err != nil && !errors.Is(err, sql.ErrNoRows) {
			t.Fatal(err)
		}
		return n
	}

	first := send(t, srv, "POST", "/debit", "k1", "x")
	again := send(t, srv, "POST", "/debit", "k1", "x")
	if first.status != 201 || first.header.Get("Set-Cookie") != "s=1" || first.header.Get(httpidem.HeaderExpires) == "" {
		t.Fatalf("first answer %d %v", first.status, first.header)
	}
	if again.status != 201 || again.body != `{"debited":100}` || again.header.Get("Idempotent-Replayed") != "true" || again.header.Get("Set-Cookie") != "" {
		t.Fatalf("replay %d %q %v", again.status, again.body, again.header)
	}
	if debits("k1") != 1 {
		t.Fatalf("k1 debited %d times", debits("k1"))
	}

	app.failCommit.Store(true)
	if r := send(t, srv, "POST", "/debit", "k2", "x"); r.status != 503 || debits("k2") != 0 {
		t.Fatalf("failed commit: %d, %d debits", r.status, debits("k2"))
	}
	app.failCommit.Store(false)
	if r := send(t, srv, "POST", "/debit", "k2", "x"); r.status != 201 || debits("k2") != 1 {
		t.Fatalf("retry after a rolled-back attempt: %d, %d debits", r.status, debits("k2"))
	}
}

func TestFinishOutsideMiddleware(t *testing.T) {
	r := httptest.NewRequest("POST", "/", nil)
	err := httpidem.Finish(httptest.NewRecorder(), r, &idem.Response{Status: 200}, func(idem.FinishParams) error {
		t.Fatal("commit called outside the middleware")
		return nil
	})
	if !errors.Is(err, httpidem.ErrNoCall) {
		t.Fatalf("err = %v", err)
	}
}

// TestFinishReplaysTheHeadersSetOnTheWriter: a handler sets Location and
// Content-Type on w, then settles with Finish a response that names
// neither. The first client and the replay get the same headers (Set-Cookie
// only the first). (Only resp.Header was stored: the replay had no Location
// and a sniffed Content-Type.)
func TestFinishReplaysTheHeadersSetOnTheWriter(t *testing.T) {
	st, err := sqlitestore.Open(context.Background(), sqlitestore.Config{Path: filepath.Join(t.TempDir(), "idem.db")})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	a := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Location", "/charges/ch_1")
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("X-Trace", "from the writer")
		w.Header().Set("Set-Cookie", "s=1")
		tx, err := st.DB().BeginTx(r.Context(), nil)
		if err != nil {
			http.Error(w, err.Error(), 503)
			return
		}
		defer tx.Rollback()
		resp := &idem.Response{Status: 201, Header: http.Header{"X-Trace": {"from resp"}}, Body: []byte(`{"id":"ch_1"}`)}
		if err := httpidem.Finish(w, r, resp, func(p idem.FinishParams) error {
			if err := st.FinishTx(r.Context(), tx, p); err != nil {
				return err
			}
			return tx.Commit()
		}); err != nil {
			http.Error(w, err.Error(), 500)
		}
	})
	srv := serve(t, httpidem.Config{Engine: newEngine(t, st)}, a)
	first := send(t, srv, "POST", "/pay", "k", "x")
	again := send(t, srv, "POST", "/pay", "k", "x")
	if first.status != 201 || first.header.Get("Set-Cookie") != "s=1" || again.status != 201 || again.header.Get("Idempotent-Replayed") != "true" || again.header.Get("Set-Cookie") != "" {
		t.Fatalf("first %d %v; replay %d %v", first.status, first.header, again.status, again.header)
	}
	for name, want := range map[string]string{"Location": "/charges/ch_1", "Content-Type": "application/json", "X-Trace": "from resp"} {
		if first.header.Get(name) != want || again.header.Get(name) != want {
			t.Errorf("%s: first %q, replay %q; want %q in both", name, first.header.Get(name), again.header.Get(name), want)
		}
	}
}

// TestHeaderNamesInAnyCaseAreJudgedAlike: a handler may set a header under
// a name not in canonical form, and net/http sends it as it is; a cookie or
// a credential set so is not stored or replayed either.
func TestHeaderNamesInAnyCaseAreJudgedAlike(t *testing.T) {
	eng := newEngine(t, memstore.New())
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header()["set-cookie"] = []string{"session=secret-abc"}
		w.Header()["authorization"] = []string{"Bearer sk_live_x"}
		w.Header()["x-request-id"] = []string{"req_1"}
		w.WriteHeader(201)
		io.WriteString(w, "ok")
	})
	srv := serve(t, httpidem.Config{Engine: eng}, h)
	first := send(t, srv, "POST", "/pay", "k1", "x")
	if first.header.Get("Set-Cookie") != "session=secret-abc" {
		t.Fatalf("the first answer lacks the handler's cookie: %v", first.header)
	}
	replay := send(t, srv, "POST", "/pay", "k1", "x")
	if replay.header.Get("Idempotent-Replayed") != "true" || replay.header.Get("X-Request-Id") != "req_1" {
		t.Fatalf("not a replay of the first answer: %d %v", replay.status, replay.header)
	}
	if replay.header.Get("Set-Cookie") != "" || replay.header.Get("Authorization") != "" {
		t.Errorf("the replay carries Set-Cookie %q and Authorization %q", replay.header.Get("Set-Cookie"), replay.header.Get("Authorization"))
	}
	rec, err := eng.Get(context.Background(), "", "k1")
	if err != nil {
		t.Fatal(err)
	}
	for name := range rec.Response.Header {
		if c := http.CanonicalHeaderKey(name); c == "Set-Cookie" || c == "Authorization" {
			t.Errorf("the store holds %s", name)
		}
	}
}
