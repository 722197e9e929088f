package idem_test

import (
	"context"
	"encoding/json"
	"net/http"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/testkit"
	"github.com/idemhq/idem/internal/wait"
	"github.com/idemhq/idem/store"
	"github.com/idemhq/idem/store/memstore"
	"github.com/idemhq/idem/store/sqlitestore"
	"github.com/idemhq/idem/store/storetest"
)

// modalStore answers each settling write by its state as the test says:
// unavailable, held until released, or through to the store.
type modalStore struct {
	idem.Store
	mu      sync.Mutex
	mode    map[idem.State]string // "down", "hold"; anything else: through
	held    chan struct{}         // a held write has arrived
	release chan struct{}
}

func (s *modalStore) set(state idem.State, mode string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.mode[state] = mode
}

func (s *modalStore) Finish(ctx context.Context, p store.FinishParams) error {
	s.mu.Lock()
	mode := s.mode[p.State]
	s.mu.Unlock()
	switch mode {
	case "down":
		return idem.ErrUnavailable
	case "hold": // bounded: a test that went wrong fails, it does not hang in Close
		select {
		case s.held <- struct{}{}:
		case <-time.After(10 * time.Second):
		}
		select {
		case <-s.release:
		case <-time.After(10 * time.Second):
		}
	}
	return s.Store.Finish(ctx, p)
}

// TestLateCompleteAfterMarkUnknownIsKept: the owner marks its record
// UNKNOWN and then, late, completes it, under the same lease, both while
// the store is away, so both wait in the journal. The MARK lands while the
// Complete waits: the Complete is still kept, and lands. (Both were one
// file, by lease; landing the mark removed the outcome the client had
// been given, and the record stayed UNKNOWN.)
func TestLateCompleteAfterMarkUnknownIsKept(t *testing.T) {
	s := &modalStore{Store: memstore.New(), mode: map[idem.State]string{}, held: make(chan struct{}), release: make(chan struct{})}
	e, err := idem.New(idem.Config{Store: s, StoreTimeout: 100 * time.Millisecond, JournalDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		e.Close(ctx)
	})
	out, err := e.Begin(ctx, idem.BeginParams{Key: "k", Fingerprint: payload})
	if err != nil || out.Decision != idem.Execute {
		t.Fatal(out.Decision, err)
	}
	s.set(idem.StateUnknown, "down")
	s.set(idem.StateCompleted, "down")
	if err := e.MarkUnknown(ctx, out.Lease); err != nil {
		t.Fatalf("MarkUnknown with the store away: %v, want it kept", err)
	}
	s.set(idem.StateUnknown, "hold") // the journal's next try of the mark is on its way
	wait.Recv(t, s.held, 10*time.Second, "the journal to send the mark")
	if err := e.Complete(ctx, out.Lease, &idem.Response{Status: 201, Body: []byte("charged")}); err != nil {
		t.Fatalf("the late Complete with the store away: %v, want it kept", err)
	}
	s.set(idem.StateCompleted, "")
	close(s.release) // the mark lands
	wait.Until(t, 10*time.Second, "the late outcome to be stored", func() bool {
		r, err := s.Get(ctx, store.GetParams{Key: "k", Now: time.Now()})
		return err == nil && r.State == idem.StateCompleted && string(r.Response.Body) == "charged"
	})
}

// plainDeadlineStore's settling writes take longer than their deadline and
// then return the context's own error, as a store that passes it through
// does, without saying that it did not answer.
type plainDeadlineStore struct{ idem.Store }

func (plainDeadlineStore) Finish(ctx context.Context, _ store.FinishParams) error {
	<-ctx.Done()
	return ctx.Err()
}

// TestUnansweredWriteIsKept: a settling write that the store did not answer
// by its deadline is kept in the journal, whatever error the store gave
// with it: its outcome is not known. (A plain deadline error was taken as
// the store's refusal, and the outcome was dropped.)
func TestUnansweredWriteIsKept(t *testing.T) {
	e, out := started(t, idem.Config{Store: plainDeadlineStore{memstore.New()}, StoreTimeout: 100 * time.Millisecond})
	if err := e.Complete(ctx, out.Lease, &idem.Response{Status: 201}); err != nil {
		t.Fatalf("Complete unanswered: %v, want it kept", err)
	}
	if e.Pending() != 1 {
		t.Fatalf("%d outcomes in the journal, want 1", e.Pending())
	}
}

// TestSharedJournalDirectory: engines in several processes may share one
// JournalDir. One opened on it leaves alone the file another is writing
// (a young temporary file) and a file that another removes as it reads the
// directory, and removes what a crash left half-written long ago. (It
// removed every temporary file, so another engine's outcome being written
// was lost, and it failed to start on a file removed under it.)
func TestSharedJournalDirectory(t *testing.T) {
	dir := t.TempDir()
	writing := filepath.Join(dir, "0123.json.tmp")
	crashed := filepath.Join(dir, "4567.json.tmp")
	for _, f := range []string{writing, crashed} {
		if err := os.WriteFile(f, []byte("{"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	long := time.Now().Add(-time.Hour)
	if err := os.Chtimes(crashed, long, long); err != nil {
		t.Fatal(err)
	}
	// Listed, then gone: what an entry that another engine lands and
	// removes looks like to one reading the directory.
	if err := os.Symlink(filepath.Join(dir, "landed-meanwhile"), filepath.Join(dir, "89ab.json")); err != nil {
		t.Fatal(err)
	}
	e, err := idem.New(idem.Config{Store: memstore.New(), JournalDir: dir})
	if err != nil {
		t.Fatalf("New on a shared journal directory: %v", err)
	}
	defer e.Close(context.Background())
	if _, err := os.Stat(writing); err != nil {
		t.Errorf("the file another engine is writing: %v, want it left alone", err)
	}
	if _, err := os.Stat(crashed); !os.IsNotExist(err) {
		t.Errorf("the file a crash left an hour ago: %v, want it removed", err)
	}
}

// finishDownStore refuses every settling write as unreachable; the rest
// goes through.
type finishDownStore struct{ idem.Store }

func (finishDownStore) Finish(context.Context, store.FinishParams) error { return idem.ErrUnavailable }

// TestWaitersWokenByAJournaledOutcome: duplicates waiting in this process
// for work that runs here get its outcome as soon as it is kept in the
// journal (the store away), not at the end of their wait. (Nobody woke
// them: they slept their whole wait, then got 409.)
func TestWaitersWokenByAJournaledOutcome(t *testing.T) {
	e, out := started(t, idem.Config{Store: finishDownStore{memstore.New()}, StoreTimeout: 100 * time.Millisecond, Poll: time.Hour})
	got := make(chan idem.Outcome, 1)
	go func() {
		o, _ := e.Await(ctx, idem.BeginParams{Key: "k", Fingerprint: payload}, time.Hour)
		got <- o
	}()
	wait.Until(t, 10*time.Second, "the duplicate to wait", func() bool { return e.Waiting("", "k") == 1 })
	if err := e.Complete(ctx, out.Lease, &idem.Response{Status: 201, Body: []byte("charged")}); err != nil {
		t.Fatalf("Complete with the store away: %v, want it kept", err)
	}
	o := wait.Recv(t, got, 10*time.Second, "the duplicate's answer")
	if o.Decision != idem.Replay || string(o.Record.Response.Body) != "charged" {
		t.Fatalf("the duplicate got %v %+v; want the replay of the kept outcome", o.Decision, o.Record.Response)
	}
	if got, want := o.Record.Response.Header.Get(idem.HeaderExpires), o.Record.Expires.UTC().Format(http.TimeFormat); got != want {
		t.Fatalf("the journal's replay says %s %q, want %q", idem.HeaderExpires, got, want)
	}
}

// TestJournalLeavesAnOutcomeItsStoreDoesNotHold: an engine opened on a
// directory that another engine, on another store, shares finds an
// outcome its own store holds no record of. It sent it, was refused, took
// the refusal for "settled by someone else" and deleted the file, with the
// outcome the other engine's client had been given. The entry stays in the
// directory until its retention ends; then it goes.
func TestJournalLeavesAnOutcomeItsStoreDoesNotHold(t *testing.T) {
	dir := t.TempDir()
	a, err := idem.New(idem.Config{Store: finishDownStore{memstore.New()}, JournalDir: dir, StoreTimeout: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	out, err := a.Begin(context.Background(), idem.BeginParams{Key: "k", Fingerprint: idem.NewFingerprint(idem.Payload{Method: "POST"})})
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Complete(context.Background(), out.Lease, &idem.Response{Status: 201}); err != nil {
		t.Fatalf("Complete: %v; want the outcome kept in the journal", err)
	}
	stop, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	a.Close(stop)
	cancel()
	entries := func() int {
		files, _ := filepath.Glob(filepath.Join(dir, "*.json"))
		return len(files)
	}

	clock := storetest.NewClock(time.Now())
	b, err := idem.New(idem.Config{Store: memstore.New(), JournalDir: dir, Clock: clock})
	if err != nil {
		t.Fatal(err)
	}
	stop, cancel = context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := b.Close(stop); err != nil {
		t.Fatalf("the other engine's close: %v; want nothing of its own left", err)
	}
	if n := entries(); n != 1 {
		t.Fatalf("%d entries in the directory; want the outcome its store does not hold left there", n)
	}

	clock.Advance(idem.DefaultRetention + time.Minute)
	c, err := idem.New(idem.Config{Store: memstore.New(), JournalDir: dir, Clock: clock})
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Close(stop); err != nil {
		t.Fatal(err)
	}
	if n := entries(); n != 0 {
		t.Fatalf("%d entries in the directory past the outcome's retention; want it gone", n)
	}
}

// TestUnwritableJournalIsRefused: a journal directory that exists but
// cannot be written (here /proc/self, read-only to everyone, root too) is
// refused when the engine is made. (It was accepted, and showed only when
// the store went away: every outcome then failed to be kept.)
func TestUnwritableJournalIsRefused(t *testing.T) {
	if _, err := os.Stat("/proc/self"); err != nil {
		t.Skip("no /proc: not Linux")
	}
	_, err := idem.New(idem.Config{Store: memstore.New(), JournalDir: "/proc/self"})
	if err == nil {
		t.Fatal("New accepted a journal directory that cannot be written")
	}
}

// TestJournalKeepsHeadersByteForByte: an outcome that waits in the journal
// across a restart is stored as the handler gave it, a header that is no
// UTF-8 (a Latin-1 file name, which HTTP allows) included. (The journal's
// JSON changed it to U+FFFD, and every replay sent the changed header.)
func TestJournalKeepsHeadersByteForByte(t *testing.T) {
	dir, st := t.TempDir(), memstore.New()
	a, err := idem.New(idem.Config{Store: finishDownStore{st}, JournalDir: dir, StoreTimeout: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	out, err := a.Begin(ctx, idem.BeginParams{Key: "k", Fingerprint: payload})
	if err != nil {
		t.Fatal(err)
	}
	const cd = "attachment; filename=\"caf\xe9.pdf\""
	if err := a.Complete(ctx, out.Lease, &idem.Response{Status: 200, Header: http.Header{"Content-Disposition": {cd}}, Body: []byte("%PDF")}); err != nil {
		t.Fatal(err)
	}
	stop, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
	a.Close(stop) // the store is still away: the entry stays in the directory
	cancel()
	b, err := idem.New(idem.Config{Store: st, JournalDir: dir})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close(ctx)
	wait.Until(t, 10*time.Second, "the journal to land", func() bool { return b.Pending() == 0 })
	o, err := b.Begin(ctx, idem.BeginParams{Key: "k", Fingerprint: payload})
	if err != nil || o.Decision != idem.Replay {
		t.Fatalf("%v, %v; want a replay", o.Decision, err)
	}
	if got := o.Record.Response.Header.Get("Content-Disposition"); got != cd {
		t.Fatalf("the replay says Content-Disposition %q; the first answer said %q", got, cd)
	}
}

// TestJournalReadsVersionOne: an entry that release 0.1.0 journaled (its
// response inside the params, as JSON) is read and stored after an
// upgrade.
func TestJournalReadsVersionOne(t *testing.T) {
	dir, st := t.TempDir(), memstore.New()
	l := testkit.Acquire(t, st, "", "k", time.Now(), time.Minute)
	now := time.Now()
	p := store.FinishParams{Key: "k", Token: l.Token, Now: now, State: idem.StateCompleted, Expires: now.Add(time.Hour), Repeat: true,
		Response: &idem.Response{Status: 201, Header: http.Header{"Content-Type": {"application/json"}}, Body: []byte(`{"id":"ch_1"}`)}}
	data, err := json.Marshal(struct {
		V           int                `json:"v"`
		Params      store.FinishParams `json:"params"`
		Fingerprint idem.Fingerprint   `json:"fingerprint"`
	}{1, p, l.Fingerprint})
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "entry-1.json"), data, 0o600); err != nil {
		t.Fatal(err)
	}
	e, err := idem.New(idem.Config{Store: st, JournalDir: dir})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close(ctx)
	wait.Until(t, 10*time.Second, "the journal to land", func() bool { return e.Pending() == 0 })
	rec, err := st.Get(ctx, store.GetParams{Key: "k", Now: time.Now()})
	if err != nil || rec.State != idem.StateCompleted || string(rec.Response.Body) != `{"id":"ch_1"}` || rec.Response.Header.Get("Content-Type") != "application/json" {
		t.Fatalf("after the version-1 entry landed: %+v, %v", rec, err)
	}
}

// leftForItsStore is the scenario of a shared journal directory in which
// engines on two stores meet: engine a, on sa, settles a request with
// settle while sa is away, so the write waits in the directory, and a's
// process stops. Engine b, on sb, which holds no record of it, opens the
// directory and closes. Then a's next run, on sa, opens it. It returns the
// record sa then holds and the entries left in the directory after b ran.
func leftForItsStore(t *testing.T, dir string, sa, sb idem.Store, settle func(*idem.Engine, idem.Lease) error) (idem.Record, int) {
	t.Helper()
	a, err := idem.New(idem.Config{Store: finishDownStore{sa}, JournalDir: dir, StoreTimeout: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	out, err := a.Begin(ctx, idem.BeginParams{Key: "k", Fingerprint: payload})
	if err != nil || out.Decision != idem.Execute {
		t.Fatal(out.Decision, err)
	}
	if err := settle(a, out.Lease); err != nil {
		t.Fatalf("settling with the store away: %v; want it kept in the journal", err)
	}
	stop, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
	a.Close(stop) // a's process goes; its write stays in the directory
	cancel()
	if n := journalFiles(dir); n != 1 {
		t.Fatalf("%d entries after a's close; want its write", n)
	}

	b, err := idem.New(idem.Config{Store: sb, JournalDir: dir})
	if err != nil {
		t.Fatal(err)
	}
	stop, cancel = context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := b.Close(stop); err != nil {
		t.Fatalf("the other store's engine's close: %v; want nothing of its own left", err)
	}
	left := journalFiles(dir)

	a2, err := idem.New(idem.Config{Store: sa, JournalDir: dir})
	if err != nil {
		t.Fatal(err)
	}
	if err := a2.Close(stop); err != nil {
		t.Fatal(err)
	}
	rec, err := sa.Get(ctx, store.GetParams{Key: "k", Now: time.Now()})
	if err != nil {
		t.Fatal(err)
	}
	return rec, left
}

func journalFiles(dir string) int {
	files, _ := filepath.Glob(filepath.Join(dir, "*.json"))
	return len(files)
}

func release(e *idem.Engine, l idem.Lease) error     { return e.Release(ctx, l) }
func markUnknown(e *idem.Engine, l idem.Lease) error { return e.MarkUnknown(ctx, l) }

// TestJournalLeavesAnotherStoresRelease: the owner's Release waits in a
// directory shared with an engine on another store. That engine sent it to
// its own store, which holds no such record, and deleted the file: when
// the owner's store came back nothing landed, and its record stayed
// IN_PROGRESS, then UNKNOWN, though its owner said that nothing ran. The
// release is left for the engine of its store, which lands it: the record
// is FAILED and the retry runs.
func TestJournalLeavesAnotherStoresRelease(t *testing.T) {
	sa := memstore.New()
	rec, left := leftForItsStore(t, t.TempDir(), sa, memstore.New(), release)
	if left != 1 {
		t.Errorf("%d entries after the other store's engine ran; want the release left for its store", left)
	}
	if rec.State != idem.StateFailed {
		t.Fatalf("the owner's record is %s; want FAILED, the release its owner made", rec.State)
	}
}

// TestJournalLeavesAnotherStoresReleaseSQLite: as
// TestJournalLeavesAnotherStoresRelease, on two SQLite stores: two proxies
// started in one directory, each with its own database, share the default
// relative journal directory.
func TestJournalLeavesAnotherStoresReleaseSQLite(t *testing.T) {
	base := t.TempDir()
	open := func(name string) *sqlitestore.Store {
		s, err := sqlitestore.Open(ctx, sqlitestore.Config{Path: filepath.Join(base, name)})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { s.Close() })
		return s
	}
	sa, sb := open("a.db"), open("b.db")
	rec, left := leftForItsStore(t, filepath.Join(base, "idem-journal"), sa, sb, release)
	if left != 1 {
		t.Errorf("%d entries after the other store's engine ran; want the release left for its store", left)
	}
	if rec.State != idem.StateFailed {
		t.Fatalf("the owner's record is %s; want FAILED, the release its owner made", rec.State)
	}
	e, err := idem.New(idem.Config{Store: sa})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close(ctx)
	retry, err := e.Begin(ctx, idem.BeginParams{Key: "k", Fingerprint: payload})
	if err != nil || retry.Decision != idem.Execute {
		t.Fatalf("the retry: %v %v; want Execute, since nothing ran", retry.Decision, err)
	}
	if err := e.Release(ctx, retry.Lease); err != nil { // Close waits for the leases held
		t.Fatal(err)
	}
}

// TestJournalLeavesAnotherStoresMarkUnknown: as
// TestJournalLeavesAnotherStoresRelease, for a MarkUnknown: the record
// becomes UNKNOWN, for the reconciler, when its store comes back. (The
// other store's engine deleted the mark too.)
func TestJournalLeavesAnotherStoresMarkUnknown(t *testing.T) {
	sa := memstore.New()
	rec, left := leftForItsStore(t, t.TempDir(), sa, memstore.New(), markUnknown)
	if left != 1 {
		t.Errorf("%d entries after the other store's engine ran; want the mark left for its store", left)
	}
	if rec.State != idem.StateUnknown {
		t.Fatalf("the owner's record is %s; want UNKNOWN, as its owner marked it", rec.State)
	}
}

// TestJournalDropsAnotherStoresWritesAfterTheirRetention: a release or an
// UNKNOWN mark that an engine on another store leaves in the directory is
// not kept for ever: an engine whose store holds no record of it leaves it
// until the retention its lease gives an outcome has run out from the
// write, and drops it after that.
func TestJournalDropsAnotherStoresWritesAfterTheirRetention(t *testing.T) {
	for name, settle := range map[string]func(*idem.Engine, idem.Lease) error{"release": release, "mark": markUnknown} {
		t.Run(name, func(t *testing.T) {
			dir := t.TempDir()
			a, err := idem.New(idem.Config{Store: finishDownStore{memstore.New()}, JournalDir: dir, StoreTimeout: 100 * time.Millisecond})
			if err != nil {
				t.Fatal(err)
			}
			out, err := a.Begin(ctx, idem.BeginParams{Key: "k", Fingerprint: payload, Retention: time.Hour})
			if err != nil || out.Decision != idem.Execute {
				t.Fatal(out.Decision, err)
			}
			if err := settle(a, out.Lease); err != nil {
				t.Fatal(err)
			}
			stop, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
			a.Close(stop)
			cancel()
			stop, cancel = context.WithTimeout(ctx, 10*time.Second)
			defer cancel()
			clock, elapsed := storetest.NewClock(time.Now()), time.Duration(0)
			for _, c := range []struct {
				after time.Duration
				left  int
			}{{59 * time.Minute, 1}, {2 * time.Minute, 0}} {
				clock.Advance(c.after)
				elapsed += c.after
				b, err := idem.New(idem.Config{Store: memstore.New(), JournalDir: dir, Clock: clock})
				if err != nil {
					t.Fatal(err)
				}
				if err := b.Close(stop); err != nil {
					t.Fatal(err)
				}
				if n := journalFiles(dir); n != c.left {
					t.Fatalf("%d entries %v after the write (its lease's retention: an hour); want %d", n, elapsed, c.left)
				}
			}
		})
	}
}

// TestJournalLeavesAWriteForAnotherRecordOfTheKey: the other store holds a
// record of the same key, another request's (one client's "order-123" sent
// to two services, each behind its own proxy and store, the proxies sharing
// a journal directory). That record is not the one the write settles: its
// engine dropped the owner's completed outcome as "settled by someone
// else", and the outcome its client was given was lost. It is left for
// the engine of its store, which lands it.
func TestJournalLeavesAWriteForAnotherRecordOfTheKey(t *testing.T) {
	sa, sb := memstore.New(), memstore.New()
	other, err := idem.New(idem.Config{Store: sb})
	if err != nil {
		t.Fatal(err)
	}
	shipping := idem.NewFingerprint(idem.Payload{Method: "POST", Path: "/shipments", Body: []byte(`{"order":"123"}`)})
	out, err := other.Begin(ctx, idem.BeginParams{Key: "k", Fingerprint: shipping})
	if err != nil || out.Decision != idem.Execute {
		t.Fatal(out.Decision, err)
	}
	if err := other.Complete(ctx, out.Lease, &idem.Response{Status: 201, Body: []byte("shipped")}); err != nil {
		t.Fatal(err)
	}
	rec, left := leftForItsStore(t, t.TempDir(), sa, sb, func(e *idem.Engine, l idem.Lease) error {
		return e.Complete(ctx, l, &idem.Response{Status: 201, Body: []byte("charged")})
	})
	if left != 1 {
		t.Errorf("%d entries after the other store's engine ran; want the outcome left for its store", left)
	}
	if rec.State != idem.StateCompleted || rec.Response == nil || string(rec.Response.Body) != "charged" {
		t.Fatalf("the owner's record is %s (%+v); want COMPLETED with the outcome its client was given", rec.State, rec.Response)
	}
}
