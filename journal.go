package idem

import (
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"
)

// journal keeps the settling writes ([FinishParams]) that the store could not
// take when they were made, and sends them again until it does: the outcome
// a client was given is never lost because the store was away. Each entry
// is a file in dir, written and synced before the write is reported kept, and
// removed once the store has it; without a dir, entries live in memory.
//
// Sending an entry again is safe whatever became of the first attempt: a
// settling write is a compare-and-set on its lease token, and a repeat of one
// that landed succeeds (see [FinishParams.Apply]).
type journal struct {
	e   *Engine
	dir string

	mu       sync.Mutex
	entries  map[string]*journalEntry // by file name
	byRecord map[string]*journalEntry // completed entries by KeyHash, for replays
	running  bool                     // the drain loop is running
	closed   bool
	wake     chan struct{} // cuts the drain loop's pause short
	stop     chan struct{}
	drained  chan struct{} // closed when the drain loop exits
	// quiet is closed while only the releases kept for a late acquire are
	// left (lenLocked is 0): close need not wait for them. put makes a new
	// one when it adds an entry.
	quiet chan struct{}
}

// journalVersion is the version of the entry encoding: 2 keeps the
// response in Response, byte for byte (version 1, which this build reads
// too, kept it in Params as JSON, which changes a header that is no UTF-8).
const journalVersion = 2

type journalEntry struct {
	V           int          `json:"v"`
	Params      FinishParams `json:"params"`
	Fingerprint Fingerprint  `json:"fingerprint"`
	// Response is Params.Response as [Response.MarshalCompact] encodes it
	// (Params.Response is then nil in the file).
	Response []byte `json:"response,omitempty"`
	// Until is, for the release of an acquire whose answer was lost, when
	// that acquire's lease would have ended. The acquire may still land
	// (its statement held up in the store), so a release that finds no
	// record is sent again until then.
	Until time.Time `json:"until,omitzero"`
	// Keep is, for an UNKNOWN write (which sets no expiry), when an outcome
	// settled at the same moment would have expired: the lease's
	// retention from the write's Now. See bound.
	Keep time.Time `json:"keep,omitzero"`
	name string
	// early is set when the store answered the release that it holds no
	// such record (yet): the release is kept for a late acquire, and no
	// longer counts as an outcome waiting for the store.
	early bool
}

// bound is until when an engine whose store holds no record of the entry
// leaves it in the directory, for the engine of its store (see
// [journal.lost]): a release of a lost acquire, until that acquire's lease
// would have ended; a COMPLETED or FAILED write, until the outcome's
// expiry (its retention); an UNKNOWN write, until Keep, the retention its
// lease gives an outcome, from the write. An UNKNOWN entry that an older
// build wrote, without Keep, is kept for retention (the engine's default)
// from the write.
func (ent *journalEntry) bound(retention time.Duration) time.Time {
	switch {
	case ent.Params.State == StateFailed && !ent.Until.IsZero():
		return ent.Until
	case !ent.Keep.IsZero():
		return ent.Keep
	case !ent.Params.Expires.IsZero():
		return ent.Params.Expires
	}
	return ent.Params.Now.Add(retention)
}

func openJournal(e *Engine, dir string) (*journal, error) {
	j := &journal{e: e, dir: dir, entries: map[string]*journalEntry{}, byRecord: map[string]*journalEntry{},
		wake: make(chan struct{}, 1), stop: make(chan struct{})}
	if dir == "" {
		return j, nil
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("idem: journal: %w", err)
	}
	// A directory that cannot be written would show only when the store
	// is away, and every outcome then would be lost: refused now.
	probe, err := os.CreateTemp(dir, "probe-*.tmp")
	if err != nil {
		return nil, fmt.Errorf("idem: journal: the directory cannot be written: %w", err)
	}
	probe.Close()
	os.Remove(probe.Name())
	names, err := filepath.Glob(filepath.Join(dir, "*"))
	if err != nil {
		return nil, fmt.Errorf("idem: journal: %w", err)
	}
	for _, path := range names {
		name := filepath.Base(path)
		if strings.HasSuffix(name, ".tmp") {
			// A write that never completed was never reported kept; one
			// under way in another engine sharing the directory is young.
			if info, err := os.Stat(path); err == nil && time.Since(info.ModTime()) > staleTemp {
				os.Remove(path)
			}
			continue
		}
		if !strings.HasSuffix(name, ".json") {
			continue
		}
		data, err := os.ReadFile(path)
		if errors.Is(err, os.ErrNotExist) {
			continue // landed and removed meanwhile by another engine sharing the directory
		}
		if err != nil {
			return nil, fmt.Errorf("idem: journal: %w", err)
		}
		var ent journalEntry
		err = json.Unmarshal(data, &ent)
		if err == nil && ent.Response != nil {
			ent.Params.Response = new(Response)
			err = ent.Params.Response.UnmarshalBinary(ent.Response)
			ent.Response = nil
		}
		if err != nil || (ent.V != journalVersion && ent.V != 1) {
			e.log.Error("idem journal: an entry cannot be read; it is left in place for an operator",
				"file", path, "err", err, "version", ent.V)
			continue
		}
		ent.name = name
		j.add(&ent)
	}
	if len(j.entries) > 0 {
		e.log.Warn("idem journal: storing outcomes a previous run could not store", "entries", len(j.entries), "dir", dir)
		j.mu.Lock()
		j.startLocked()
		j.mu.Unlock()
	}
	return j, nil
}

// add indexes an entry; the caller holds mu or owns j alone.
func (j *journal) add(ent *journalEntry) {
	j.entries[ent.name] = ent
	if ent.Params.State == StateCompleted {
		j.byRecord[KeyHash(ent.Params.Scope, ent.Params.Key)] = ent
	}
}

// staleTemp is how old a temporary file in the journal's directory must be
// for an engine opened on it to remove it: a write takes moments.
const staleTemp = time.Minute

// entryName names the file of p: one per settling write, so that the
// owner's late Complete after its MarkUnknown, under the same token, is an
// entry of its own, not one that landing the first would remove.
func entryName(p FinishParams) string {
	h := sha256.New()
	for _, part := range []string{p.Scope, p.Key, p.Token, string(p.State)} {
		h.Write([]byte(part))
		h.Write([]byte{0})
	}
	return hex.EncodeToString(h.Sum(nil)[:16]) + ".json"
}

// put keeps p until the store takes it, and starts sending it again. It
// returns nil once p is kept (synced to disk when the journal has a dir).
// until is, for the release of an acquire whose answer was lost, when that
// acquire's lease ends; keep is, for an UNKNOWN write, when an outcome
// settled with it would expire (both zero otherwise; see
// [journalEntry.bound]).
func (j *journal) put(p FinishParams, fp Fingerprint, until, keep time.Time) error {
	ent := &journalEntry{V: journalVersion, Params: p, Fingerprint: fp, Until: until, Keep: keep, name: entryName(p)}
	j.mu.Lock()
	closed := j.closed
	j.mu.Unlock()
	if closed && j.dir == "" {
		j.e.log.Error("idem journal: the engine is closed and has no journal directory: an outcome the store did not take is not kept", "key_hash", KeyHash(p.Scope, p.Key), "state", p.State)
		return fmt.Errorf("idem: the store did not take the outcome and the engine is closed (no journal directory): %w", ErrUnavailable)
	}
	if j.dir != "" {
		if err := j.write(ent); err != nil {
			j.e.log.Error("idem journal: cannot keep an outcome the store did not take", "key_hash", KeyHash(p.Scope, p.Key), "err", err)
			return fmt.Errorf("idem: the store did not take the outcome and the journal cannot keep it: %w: %w", ErrUnavailable, err)
		}
	}
	j.mu.Lock()
	defer j.mu.Unlock()
	j.add(ent)
	if j.quiet != nil { // an outcome to store again: close waits for it
		select {
		case <-j.quiet:
			j.quiet = make(chan struct{})
		default:
		}
	}
	level := slog.LevelWarn
	if p.State == StateFailed {
		level = slog.LevelDebug // a release: nothing ran, nobody waits for it
	}
	j.e.log.Log(context.Background(), level, "idem journal: the store is unreachable; the outcome waits in the journal",
		"key_hash", KeyHash(p.Scope, p.Key), "state", p.State, "pending", len(j.entries))
	j.startLocked()
	return nil
}

// write puts ent in its file: a temporary file, synced, renamed into place,
// and the directory synced, so that a crash leaves either nothing or all of it.
func (j *journal) write(ent *journalEntry) error {
	file := *ent
	if r := ent.Params.Response; r != nil {
		var err error
		if file.Response, err = r.MarshalCompact(); err != nil {
			return err
		}
		file.Params.Response = nil
	}
	data, err := json.Marshal(&file)
	if err != nil {
		return err
	}
	f, err := os.CreateTemp(j.dir, "entry-*.tmp")
	if err != nil {
		return err
	}
	if _, err := f.Write(data); err != nil {
		f.Close()
		os.Remove(f.Name())
		return err
	}
	if err := f.Sync(); err != nil {
		f.Close()
		os.Remove(f.Name())
		return err
	}
	if err := f.Close(); err != nil {
		os.Remove(f.Name())
		return err
	}
	if err := os.Rename(f.Name(), filepath.Join(j.dir, ent.name)); err != nil {
		os.Remove(f.Name())
		return err
	}
	d, err := os.Open(j.dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}

// replay answers a Begin from a completed entry that waits for the store: a
// client that was given the outcome gets it again even while the store is
// away, until its retention runs out (then a request with the key is a new
// one, as it would be for the store).
func (j *journal) replay(scope, key string, fp Fingerprint, now time.Time) (Outcome, bool) {
	j.mu.Lock()
	defer j.mu.Unlock()
	if len(j.byRecord) == 0 {
		return Outcome{}, false
	}
	ent := j.byRecord[KeyHash(scope, key)]
	if ent == nil || ent.Params.Scope != scope || ent.Params.Key != key ||
		(!ent.Params.Expires.IsZero() && !now.Before(ent.Params.Expires)) {
		return Outcome{}, false
	}
	p := ent.Params
	rec := withExpires(Record{Scope: p.Scope, Key: p.Key, State: StateCompleted, Fingerprint: ent.Fingerprint, Token: p.Token,
		Response: p.Response, Updated: p.Now, Expires: p.Expires})
	if ent.Fingerprint != fp {
		return Outcome{Decision: Mismatch, Record: rec, Diff: fp.Diff(ent.Fingerprint)}, true
	}
	return Outcome{Decision: Replay, Record: rec}, true
}

// poke has the drain loop try again now: the store answers again.
func (j *journal) poke() {
	select {
	case j.wake <- struct{}{}:
	default:
	}
}

// len counts the outcomes and releases that have not reached the store
// (not the releases kept for a late acquire).
func (j *journal) len() int {
	j.mu.Lock()
	defer j.mu.Unlock()
	return j.lenLocked()
}

func (j *journal) lenLocked() int {
	n := 0
	for _, ent := range j.entries {
		if !ent.early {
			n++
		}
	}
	return n
}

// startLocked starts the drain loop unless it runs; the caller holds mu.
func (j *journal) startLocked() {
	if j.running || j.closed {
		return
	}
	j.running = true
	j.drained, j.quiet = make(chan struct{}), make(chan struct{})
	go j.drain(j.drained)
}

// drainPause bounds the pause between rounds of the drain loop.
const drainPause = time.Second

// drain sends the entries again, round after round, until none is left or
// the journal is closed.
func (j *journal) drain(drained chan struct{}) {
	defer close(drained)
	for n := 0; ; n++ {
		if j.round() {
			return
		}
		select {
		case <-j.stop:
			return
		case <-j.wake:
		case <-time.After(min(retryPause(n), drainPause)):
		}
	}
}

// round tries every entry once and reports whether the journal is empty (and
// the loop has stopped).
func (j *journal) round() (empty bool) {
	j.mu.Lock()
	ents := make([]*journalEntry, 0, len(j.entries))
	for _, ent := range j.entries {
		ents = append(ents, ent)
	}
	j.mu.Unlock()
	// Outcomes somebody was told first, releases (nothing ran) last.
	slices.SortStableFunc(ents, func(a, b *journalEntry) int {
		return cmp.Compare(b2i(a.Params.State == StateFailed), b2i(b.Params.State == StateFailed))
	})
	for _, ent := range ents {
		select {
		case <-j.stop:
			return false
		default:
		}
		if !j.land(ent) {
			break // the store is still away: try again later
		}
	}
	j.mu.Lock()
	defer j.mu.Unlock()
	if len(j.entries) == 0 {
		j.running = false
		return true
	}
	if j.lenLocked() == 0 {
		select {
		case <-j.quiet:
		default:
			close(j.quiet)
		}
	}
	return false
}

// land sends one entry to the store, and reports false when the store
// could not be reached.
func (j *journal) land(ent *journalEntry) bool {
	p := ent.Params
	ctx, cancel := context.WithTimeout(context.Background(), j.e.storeTimeout)
	err := unanswered(ctx, j.e.store.Finish(ctx, p))
	cancel()
	if errors.Is(err, ErrUnavailable) {
		j.e.down.Store(true) // the first call the store answers pokes the loop
		return false
	}
	log := j.e.log.With("key_hash", KeyHash(p.Scope, p.Key), "state", p.State)
	j.e.answered()
	switch {
	case err == nil:
		log.Info("idem journal: stored an outcome that had waited for the store")
		j.e.notify(context.Background(), p.Scope, p.Key)
	case errors.Is(err, ErrLeaseLost):
		switch j.lost(ent, log) {
		case keepEntry:
			return true
		case retryLater:
			return false
		}
	default:
		log.Error("idem journal: the store refused an outcome; dropping it", "err", err)
	}
	j.remove(ent)
	return true
}

// verdict is what becomes of an entry whose write the store refused.
type verdict int

const (
	dropEntry  verdict = iota // remove the entry and its file
	keepEntry                 // leave it (see lost)
	retryLater                // the store could not tell: send it again later
)

// lost decides on an entry whose write the store refused with
// [ErrLeaseLost]: it holds no record under the entry's token that the
// write may settle. That is the one place where the journal asks whether
// the record is in this store at all, for every state.
//
// A release of an acquire whose answer was lost (ent.Until set) is sent
// again, kept in memory, until that acquire's lease would have ended: the
// acquire may still land (its statement held up in the store), and would
// hold the key for a request that never ran. After that it is dropped: most
// such acquires never landed, and the release is no outcome anybody was
// told.
//
// Any other entry is the write of an owner that held the record in its
// store. When this store holds a record of the key and payload, somebody
// else settled or took it over before the write reached the store, and
// theirs stands. When it holds none (or one of another payload: another
// request's, under the same key, in another store), the entry is another
// store's, in a directory shared by engines on several stores (it reached
// the directory from an engine whose store was away), or its record was
// deleted by hand: removing it would lose an owner's outcome, the FAILED
// that lets its retry run, or the UNKNOWN that holds the retries for the
// reconciler. This engine forgets it, and leaves its file in the directory,
// for the engine of its store, until the entry's bound
// ([journalEntry.bound]); after that it is dropped.
func (j *journal) lost(ent *journalEntry, log *slog.Logger) verdict {
	p := ent.Params
	now := j.e.clock.Now()
	if p.State == StateFailed && !ent.Until.IsZero() {
		if now.Before(ent.Until) {
			j.mu.Lock()
			ent.early = true
			j.mu.Unlock()
			return keepEntry
		}
		log.Debug("idem journal: the release of an acquire whose answer was lost found no record of its own once that acquire's lease was over: dropped")
		return dropEntry
	}
	bound := ent.bound(j.e.retention)
	if !now.Before(bound) {
		log.Warn("idem journal: the store holds no record that a write which waited in the journal may settle, and the write's bound has passed: dropped",
			"until", bound)
		return dropEntry
	}
	rec, err := j.e.Get(context.Background(), p.Scope, p.Key)
	switch {
	case errors.Is(err, ErrNotFound), err == nil && rec.Fingerprint != ent.Fingerprint:
		log.Warn("idem journal: this store holds no record of a write that waits in the journal (another store's?); it is left in the directory until its bound",
			"file", ent.name, "until", bound)
		j.forget(ent)
		return keepEntry
	case err != nil:
		return retryLater
	case p.State == StateCompleted && adopted(rec, Lease{Scope: p.Scope, Key: p.Key, Token: p.Token, Fingerprint: ent.Fingerprint}, cloneResponse(p.Response)):
		log.Info("idem journal: the record was settled meanwhile with the same outcome")
	default:
		log.Error("idem journal: the record was settled or taken over by someone else before the write reached the store; theirs stands", "err", ErrLeaseLost)
	}
	return dropEntry
}

func (j *journal) remove(ent *journalEntry) {
	if j.dir != "" {
		if err := os.Remove(filepath.Join(j.dir, ent.name)); err != nil && !errors.Is(err, os.ErrNotExist) {
			j.e.log.Error("idem journal: cannot remove a stored entry; it will be sent again, harmlessly", "file", ent.name, "err", err)
		}
	}
	j.forget(ent)
}

// forget drops ent from memory, leaving its file.
func (j *journal) forget(ent *journalEntry) {
	j.mu.Lock()
	defer j.mu.Unlock()
	delete(j.entries, ent.name)
	id := KeyHash(ent.Params.Scope, ent.Params.Key)
	if j.byRecord[id] == ent {
		delete(j.byRecord, id)
	}
}

// close drains until empty or ctx ends, then stops the loop. It does not
// wait for the releases kept for a late acquire (in a dir, they are sent
// again by the next engine opened on it, until their acquire's lease ends).
func (j *journal) close(ctx context.Context) error {
	for {
		j.mu.Lock()
		left, running, drained, quiet, closed := j.lenLocked(), j.running, j.drained, j.quiet, j.closed
		j.mu.Unlock()
		if left == 0 || closed {
			break
		}
		if !running {
			j.mu.Lock()
			j.startLocked()
			drained, quiet = j.drained, j.quiet
			j.mu.Unlock()
		}
		select {
		case <-ctx.Done():
		case <-quiet: // every outcome is stored; what is left is kept releases
		case <-drained:
			continue
		}
		break
	}
	j.mu.Lock()
	if !j.closed {
		j.closed = true
		close(j.stop)
	}
	left, drained := j.lenLocked(), j.drained
	j.mu.Unlock()
	if drained != nil {
		<-drained
	}
	if left == 0 {
		return nil
	}
	if j.dir == "" {
		return fmt.Errorf("idem: %d outcome(s) the store never took are lost (set a JournalDir to keep them across restarts)", left)
	}
	return fmt.Errorf("idem: %d outcome(s) the store has not taken yet stay in the journal %s for the next run", left, j.dir)
}

func b2i(b bool) int {
	if b {
		return 1
	}
	return 0
}

// cloneResponse copies r, so that adopting another's expiry leaves the
// journaled response as it was.
func cloneResponse(r *Response) *Response {
	if r == nil {
		return nil
	}
	c := *r
	c.Header = r.Header.Clone()
	if c.Header == nil {
		c.Header = http.Header{}
	}
	return &c
}
