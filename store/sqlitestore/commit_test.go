package sqlitestore

import (
	"context"
	"errors"
	"path/filepath"
	"testing"
	"time"

	"github.com/idemhq/idem/internal/testkit"
	"github.com/idemhq/idem/internal/wait"
	"github.com/idemhq/idem/store"
)

// TestGroupCommit queues writes behind a transaction that is still running
// and checks that the one transaction that
// then runs them all applies each in its turn, reports each as it went, and
// commits exactly the writes reported done: a write that sees the one
// before it, a refused write and a failing one beside writes that succeed,
// and a write whose caller gave up while it waited, which never runs.
func TestGroupCommit(t *testing.T) {
	bg := context.Background()
	s, err := Open(bg, Config{Path: filepath.Join(t.TempDir(), "idem.db")})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	now := time.Now()
	fp := store.Fingerprint("POST /charges sha256:" + "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef")
	acquire := func(key, token string) store.AcquireParams {
		return store.AcquireParams{Key: key, Fingerprint: fp, Token: token, Now: now, LeaseExpires: now.Add(time.Minute)}
	}
	complete := func(key, token string) store.FinishParams {
		return store.FinishParams{Key: key, Token: token, Now: now, State: store.StateCompleted,
			Response: &store.Response{Status: 201, Body: []byte("charged")}, Expires: now.Add(time.Hour)}
	}
	failing := errors.New("after a write, a statement that fails")

	// A transaction that runs until released: every write below queues.
	running, release := make(chan struct{}), make(chan struct{})
	held := make(chan error, 1)
	go func() {
		held <- s.write(bg, "test", func(context.Context, *txn) error {
			close(running)
			<-release
			return nil
		})
	}()
	wait.Recv(t, running, 10*time.Second, "the holding transaction to run")
	q := &testkit.Queue{T: t, Waiting: s.writes.Queued, Results: map[string]chan error{}}
	queue, results := q.Add, q.Results
	queue("acquire a", func() error { _, err := s.Acquire(bg, acquire("a", "tok-a")); return err })
	queue("complete a", func() error { return s.Finish(bg, complete("a", "tok-a")) })
	queue("complete b", func() error { return s.Finish(bg, complete("b", "tok-b")) }) // never acquired: refused
	queue("failing write", func() error {
		return s.write(bg, "test", func(ctx context.Context, in *txn) error {
			next, _ := acquire("f", "tok-f").Apply(nil)
			if err := s.put(ctx, in, &next, false); err != nil {
				return err
			}
			if _, err := in.conn.ExecContext(ctx, "INSERT INTO no_such_table VALUES (1)"); err != nil {
				return errors.Join(failing, err)
			}
			return nil
		})
	})
	queue("acquire c", func() error { _, err := s.Acquire(bg, acquire("c", "tok-c")); return err })
	gaveUp, giveUp := context.WithCancel(bg)
	queue("abandoned acquire d", func() error { _, err := s.Acquire(gaveUp, acquire("d", "tok-d")); return err })

	giveUp()
	if err := wait.Recv(t, results["abandoned acquire d"], 10*time.Second, "the abandoned write to return while the transaction runs"); !errors.Is(err, context.Canceled) {
		t.Fatalf("abandoned write: %v, want context.Canceled", err)
	}
	close(release) // the transaction commits: the queued writes run
	if err := wait.Recv(t, held, 10*time.Second, "the holding transaction"); err != nil {
		t.Fatal(err)
	}
	for name, want := range map[string]error{"acquire a": nil, "complete a": nil, "complete b": store.ErrLeaseLost,
		"failing write": failing, "acquire c": nil} {
		if err := wait.Recv(t, results[name], 10*time.Second, name); !errors.Is(err, want) || (want == nil) != (err == nil) {
			t.Errorf("%s: %v, want %v", name, err, want)
		}
	}
	for key, want := range map[string]store.State{"a": store.StateCompleted, "c": store.StateInProgress, "f": "", "d": ""} {
		r, err := s.Get(bg, store.GetParams{Key: key, Now: now})
		switch {
		case want == "" && !errors.Is(err, store.ErrNotFound):
			t.Errorf("%s: %v %v, want no record", key, r.State, err)
		case want != "" && (err != nil || r.State != want):
			t.Errorf("%s: %v %v, want %v", key, r.State, err, want)
		}
	}
}
