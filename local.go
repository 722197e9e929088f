package idem

import (
	"sync"
	"time"
)

// owners are the leases this engine's callers hold, by record: a duplicate
// of a request running in this process is answered without the store. (A
// lease is the caller's until it settles the record or the lease runs out,
// and the record cannot change meanwhile but through it.)
type owners struct {
	mu sync.Mutex
	m  map[recordKey]Record
}

// add notes that the caller holding rec's token runs the work.
func (o *owners) add(rec Record) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.m == nil {
		o.m = map[recordKey]Record{}
	}
	o.m[recordKey{rec.Scope, rec.Key}] = rec
}

// renewed notes a renewal of l.
func (o *owners) renewed(l Lease) {
	o.mu.Lock()
	defer o.mu.Unlock()
	id := recordKey{l.Scope, l.Key}
	if rec, ok := o.m[id]; ok && rec.Token == l.Token {
		rec.LeaseExpires = l.Expires
		o.m[id] = rec
	}
}

// done notes that l's owner settled its record, or gave up.
func (o *owners) done(l Lease) {
	o.mu.Lock()
	defer o.mu.Unlock()
	id := recordKey{l.Scope, l.Key}
	if rec, ok := o.m[id]; ok && rec.Token == l.Token {
		delete(o.m, id)
	}
}

// running counts the leases held at now: not settled, not run out.
func (o *owners) running(now time.Time) int {
	o.mu.Lock()
	defer o.mu.Unlock()
	n := 0
	for _, rec := range o.m {
		if now.Before(rec.LeaseExpires) {
			n++
		}
	}
	return n
}

// get returns the running record under scope and key whose lease a caller
// of this engine holds at now.
func (o *owners) get(scope, key string, now time.Time) (Record, bool) {
	o.mu.Lock()
	defer o.mu.Unlock()
	id := recordKey{scope, key}
	rec, ok := o.m[id]
	if ok && !now.Before(rec.LeaseExpires) {
		delete(o.m, id) // run out: the store knows better now
		return Record{}, false
	}
	return rec, ok
}

// waits groups the callers of Await that wait for one record with one
// payload, so that only one of them at a time asks the store (the poller)
// and the others take its news.
type waits struct {
	mu sync.Mutex
	m  map[waitKey]*waitGroup
}

type waitGroup struct {
	id      waitKey
	members int
	polling bool // a member asks the store
	known   bool // out and err hold the poller's latest answer
	out     Outcome
	err     error
}

// waitKey names the callers waiting for one record with one payload.
type waitKey struct {
	recordKey
	fingerprint Fingerprint
}

func waitKeyOf(p BeginParams) waitKey { return waitKey{recordKey{p.Scope, p.Key}, p.Fingerprint} }

// active reports whether callers already wait for p's record and payload.
func (w *waits) active(p BeginParams) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return len(w.m) > 0 && w.m[waitKeyOf(p)] != nil
}

func (w *waits) join(p BeginParams) *waitGroup {
	id := waitKeyOf(p)
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.m == nil {
		w.m = map[waitKey]*waitGroup{}
	}
	g := w.m[id]
	if g == nil {
		g = &waitGroup{id: id}
		w.m[id] = g
	}
	g.members++
	return g
}

// leave takes a member out; it reports whether others remain who must
// hear that nobody polls any more (the member was the poller).
func (w *waits) leave(g *waitGroup, polling bool) (handOver bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	g.members--
	if g.members == 0 {
		delete(w.m, g.id)
		return false
	}
	if polling {
		g.polling = false
		return true
	}
	return false
}

// claim makes the caller the poller when nobody polls.
func (w *waits) claim(g *waitGroup) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	if g.polling {
		return false
	}
	g.polling = true
	return true
}

// publish records the poller's answer for the others.
func (w *waits) publish(g *waitGroup, out Outcome, err error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	g.known, g.out, g.err = true, out, err
}

// latest is the poller's latest answer, if it has one.
func (w *waits) latest(g *waitGroup) (Outcome, error, bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return g.out, g.err, g.known
}

// flights are the acquires on their way to the store, by record: a request
// for the same record meanwhile takes the answer of the one in flight
// instead of asking too.
type flights struct {
	mu sync.Mutex
	m  map[recordKey]*flight
}

type flight struct {
	id   recordKey
	done chan struct{} // closed when rec and err are set
	rec  Record
	err  error
}

// join returns the flight for scope and key, and whether the caller leads
// it (and must land it).
func (fs *flights) join(scope, key string) (*flight, bool) {
	id := recordKey{scope, key}
	fs.mu.Lock()
	defer fs.mu.Unlock()
	if f, ok := fs.m[id]; ok {
		return f, false
	}
	if fs.m == nil {
		fs.m = map[recordKey]*flight{}
	}
	f := &flight{id: id, done: make(chan struct{})}
	fs.m[id] = f
	return f, true
}

// land gives the flight's answer to the callers that joined it.
func (fs *flights) land(f *flight, rec Record, err error) {
	fs.mu.Lock()
	delete(fs.m, f.id)
	fs.mu.Unlock()
	f.rec, f.err = rec, err
	close(f.done)
}
