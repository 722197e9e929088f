package store

import (
	"context"
	"fmt"
	"runtime/debug"
	"slices"
	"sync"
	"sync/atomic"
)

// A Batcher runs the operations that callers submit at the same time as
// batches: while a batch runs, new operations queue, and the next batch takes
// all of them (up to MaxBatch). A caller alone is a batch of one, run at
// once. Stores use it to share what each call would otherwise pay on its
// own: a commit and its fsync (SQLite), a round trip and a transaction
// (PostgreSQL), a network write and read (Redis).
//
// No caller waits for a batch it is not in longer than that batch runs: the
// next batch starts as soon as a runner is free. No caller waits past the end
// of its context either, even the one that started its batch: it gets the
// context's error at once. Its operation is then never run if it was still
// queued; if its batch had started, it may still be done, as a call cut short
// may have been. A queued batch runs on a goroutine of its own, under a
// context that ends when every caller in it has given up; if Run panics, the
// panic is every caller's error. A caller alone runs its batch of one itself,
// under its own context.
//
// The zero Batcher is not usable: set Run.
type Batcher[T any] struct {
	// Run runs a batch, in the order the operations came, and returns one
	// error per operation (nil: done), in the same order. It must not keep
	// ops after it returns.
	Run func(ctx context.Context, ops []T) []error
	// MaxBatch bounds the operations in one batch; 0 means 256.
	MaxBatch int
	// Runners is how many batches may run at once; 0 means 1.
	Runners int

	once  sync.Once
	lead  chan struct{} // a token per runner
	mu    sync.Mutex
	queue []*batchedOp[T]
}

// A batchedOp is an operation waiting for the batch that runs it.
type batchedOp[T any] struct {
	ctx   context.Context
	op    T
	claim atomic.Int32 // opQueued, then opTaken by a runner or opAbandoned by its caller
	err   error        // set before done is closed
	done  chan struct{}
}

const (
	opQueued int32 = iota
	opTaken
	opAbandoned
)

// Do queues op, runs batches while it waits when a runner is free, and
// returns op's error once its batch has run, or ctx's error if ctx ends
// first.
func (b *Batcher[T]) Do(ctx context.Context, op T) error {
	b.once.Do(func() { b.lead = make(chan struct{}, max(b.Runners, 1)) })
	// Alone (a runner free, nobody queued): a batch of one, run at once
	// under the caller's own context, without the queue's machinery.
	select {
	case b.lead <- struct{}{}:
		b.mu.Lock()
		alone := len(b.queue) == 0
		b.mu.Unlock()
		if alone {
			return b.runAlone(ctx, op)
		}
		<-b.lead
	default:
	}
	w := &batchedOp[T]{ctx: ctx, op: op, done: make(chan struct{})}
	b.mu.Lock()
	b.queue = append(b.queue, w)
	b.mu.Unlock()
	for {
		lead := b.lead
		if w.claim.Load() == opTaken {
			lead = nil // a runner has it: wait for its batch, not for a runner
		}
		select {
		case <-w.done:
			return w.err
		case <-ctx.Done():
			select {
			case <-w.done: // done meanwhile: its result stands
				return w.err
			default:
			}
			// Queued, it is never run (a runner skips it); taken, its batch
			// may still do it, as a call cut short may have been done.
			w.claim.CompareAndSwap(opQueued, opAbandoned)
			return ctx.Err()
		case lead <- struct{}{}:
			if w.claim.Load() != opQueued { // taken meanwhile: let a queued one lead
				<-b.lead
				continue
			}
			// The batch runs on a goroutine of its own, so that this caller,
			// like every other in it, is answered when its context ends.
			go func() {
				defer func() { <-b.lead }()
				b.runQueued()
			}()
		}
	}
}

// runAlone runs op as a batch of its own, holding a runner's token, which it
// gives back.
func (b *Batcher[T]) runAlone(ctx context.Context, op T) error {
	defer func() { <-b.lead }()
	if err := ctx.Err(); err != nil {
		return err
	}
	errs := b.Run(ctx, []T{op})
	switch {
	case len(errs) != 1:
		return fmt.Errorf("store: batch: %d results for 1 operation", len(errs))
	case errs[0] != nil && ctx.Err() != nil:
		return ctx.Err() // cut short because its caller gave up: the caller's reason
	}
	return errs[0]
}

// runQueued runs one batch of what is queued.
func (b *Batcher[T]) runQueued() {
	size := b.MaxBatch
	if size <= 0 {
		size = 256
	}
	b.mu.Lock()
	n := min(len(b.queue), size)
	taken := b.queue[:n:n]
	b.queue = slices.Clone(b.queue[n:])
	b.mu.Unlock()

	batch := taken[:0]
	for _, w := range taken {
		if w.claim.CompareAndSwap(opQueued, opTaken) {
			batch = append(batch, w)
		}
	}
	if len(batch) == 0 {
		return
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var waiting atomic.Int32
	waiting.Store(int32(len(batch)))
	ops := make([]T, len(batch))
	for i, w := range batch {
		ops[i] = w.op
		stop := context.AfterFunc(w.ctx, func() {
			if waiting.Add(-1) == 0 {
				cancel() // every caller gave up
			}
		})
		defer stop()
	}
	errs := []error(nil)
	defer func() { // also when Run panics: no caller is left waiting
		var panicked error
		if r := recover(); r != nil {
			panicked = fmt.Errorf("store: batch: Run panicked: %v\n%s", r, debug.Stack())
		}
		abandoned := ctx.Err() != nil // before the deferred cancel: only every caller's giving up cancels it
		for i, w := range batch {
			switch {
			case panicked != nil:
				w.err = panicked
			case i >= len(errs):
				w.err = fmt.Errorf("store: batch: %d results for %d operations", len(errs), len(batch))
			case errs[i] != nil && abandoned:
				// Cut short because its caller gave up: the caller's own
				// reason (its deadline, or its cancellation).
				w.err = w.ctx.Err()
			default:
				w.err = errs[i]
			}
			close(w.done)
		}
	}()
	errs = b.Run(ctx, ops)
}

// Queued returns how many operations wait for a batch.
func (b *Batcher[T]) Queued() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	n := 0
	for _, w := range b.queue {
		if w.claim.Load() == opQueued {
			n++
		}
	}
	return n
}

// Isolate runs the operations numbered in run (each number below len(run))
// with try, which runs those it is given, in that order, as one attempt (a
// transaction) and returns the position in its argument of the first that
// failed on its own, whose attempt then did nothing, or -1 and the attempt's
// error (nil: all done). The one that failed gets its error and the others
// are tried again without it, so that what is done is exactly what is
// reported done. It returns each operation's error, by number.
func Isolate(run []int, try func(run []int) (failed int, err error)) []error {
	errs := make([]error, len(run))
	run = slices.Clone(run)
	for len(run) > 0 {
		failed, err := try(run)
		if failed < 0 {
			for _, i := range run {
				errs[i] = err
			}
			break
		}
		errs[run[failed]] = err
		run = slices.Delete(run, failed, failed+1)
	}
	return errs
}
