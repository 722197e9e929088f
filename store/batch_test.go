package store_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemhq/idem/internal/wait"
	"github.com/idemhq/idem/store"
)

// TestBatcherRunsWhatQueuedAsOneBatch holds a batch running and checks that
// what queues meanwhile runs as the next batch, in order, each caller getting
// its own result, and that a caller who gives up while queued is answered at
// once and never run.
func TestBatcherRunsWhatQueuedAsOneBatch(t *testing.T) {
	release := make(chan struct{})
	var mu sync.Mutex
	var batches [][]string
	b := &store.Batcher[string]{Run: func(ctx context.Context, ops []string) []error {
		mu.Lock()
		batches = append(batches, slices.Clone(ops))
		mu.Unlock()
		if ops[0] == "first" {
			<-release
		}
		errs := make([]error, len(ops))
		for i, op := range ops {
			if op == "refused" {
				errs[i] = store.ErrLeaseLost
			}
		}
		return errs
	}}
	bg := context.Background()
	results := map[string]chan error{}
	do := func(ctx context.Context, op string) {
		results[op] = make(chan error, 1)
		go func() { results[op] <- b.Do(ctx, op) }()
	}
	do(bg, "first")
	wait.Until(t, 10*time.Second, "the first batch to run", func() bool { mu.Lock(); defer mu.Unlock(); return len(batches) == 1 })
	gaveUp, giveUp := context.WithCancel(bg)
	for i, op := range []string{"a", "refused", "abandoned", "b"} {
		ctx := bg
		if op == "abandoned" {
			ctx = gaveUp
		}
		do(ctx, op)
		wait.Until(t, 10*time.Second, op+" to queue", func() bool { return b.Queued() == i+1 })
	}
	giveUp()
	if err := wait.Recv(t, results["abandoned"], 10*time.Second, "the abandoned operation to return"); !errors.Is(err, context.Canceled) {
		t.Fatalf("abandoned: %v, want context.Canceled", err)
	}
	close(release)
	for op, want := range map[string]error{"first": nil, "a": nil, "refused": store.ErrLeaseLost, "b": nil} {
		if err := wait.Recv(t, results[op], 10*time.Second, op); !errors.Is(err, want) || (want == nil) != (err == nil) {
			t.Errorf("%s: %v, want %v", op, err, want)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if want := [][]string{{"first"}, {"a", "refused", "b"}}; fmt.Sprint(batches) != fmt.Sprint(want) {
		t.Fatalf("batches %v, want %v", batches, want)
	}
}

// TestBatcherUnderLoad runs 2,000 operations from as many goroutines through
// three runners: each runs exactly once, gets its own result, and no more
// than three batches run at once.
func TestBatcherUnderLoad(t *testing.T) {
	const n = 2000
	var runs [n]atomic.Int32
	var running, most atomic.Int32
	b := &store.Batcher[int]{Runners: 3, MaxBatch: 16, Run: func(ctx context.Context, ops []int) []error {
		now := running.Add(1)
		defer running.Add(-1)
		for m := most.Load(); now > m && !most.CompareAndSwap(m, now); m = most.Load() {
		}
		if len(ops) > 16 {
			t.Errorf("a batch of %d, over MaxBatch", len(ops))
		}
		errs := make([]error, len(ops))
		for i, op := range ops {
			runs[op].Add(1)
			errs[i] = fmt.Errorf("op %d", op)
		}
		return errs
	}}
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := b.Do(context.Background(), i); err == nil || err.Error() != fmt.Sprintf("op %d", i) {
				t.Errorf("op %d got %v", i, err)
			}
		}()
	}
	wait.Done(t, time.Minute, "every operation to return", wg.Wait)
	for i := range runs {
		if got := runs[i].Load(); got != 1 {
			t.Fatalf("op %d ran %d times", i, got)
		}
	}
	if m := most.Load(); m > 3 {
		t.Fatalf("%d batches ran at once, over Runners", m)
	}
}

// TestBatcherRunPanics checks that a batch whose Run panics leaves no caller
// waiting: the panic is every caller's error.
func TestBatcherRunPanics(t *testing.T) {
	release, started := make(chan struct{}), make(chan struct{})
	b := &store.Batcher[string]{Run: func(ctx context.Context, ops []string) []error {
		if ops[0] == "first" {
			close(started)
			<-release
			return []error{nil}
		}
		panic("boom")
	}}
	first := make(chan error, 1)
	go func() { first <- b.Do(context.Background(), "first") }()
	wait.Recv(t, started, 10*time.Second, "the first batch to run")
	others := make(chan error, 2)
	for range 2 {
		go func() {
			defer func() {
				if r := recover(); r != nil {
					others <- fmt.Errorf("panicked: %v", r)
				}
			}()
			others <- b.Do(context.Background(), "second")
		}()
	}
	wait.Until(t, 10*time.Second, "two operations to queue", func() bool { return b.Queued() == 2 })
	close(release)
	wait.Recv(t, first, 10*time.Second, "the first operation")
	for range 2 {
		if err := wait.Recv(t, others, 10*time.Second, "a caller of the batch that panicked"); err == nil {
			t.Fatal("a caller of the batch that panicked got no error")
		}
	}
}

// TestBatcherCallerGivesUpWhileItsBatchRuns checks that a caller is answered
// when its context ends even though its batch is still running, and that a
// batch whose every caller has given up is cancelled.
func TestBatcherCallerGivesUpWhileItsBatchRuns(t *testing.T) {
	started, cancelled := make(chan struct{}), make(chan struct{})
	b := &store.Batcher[string]{Run: func(ctx context.Context, ops []string) []error {
		close(started)
		<-ctx.Done()
		close(cancelled)
		return []error{ctx.Err()}
	}}
	ctx, cancel := context.WithCancel(context.Background())
	got := make(chan error, 1)
	go func() { got <- b.Do(ctx, "slow") }()
	wait.Recv(t, started, 10*time.Second, "the batch to start")
	cancel()
	if err := wait.Recv(t, got, 10*time.Second, "the caller to be answered"); !errors.Is(err, context.Canceled) {
		t.Fatalf("Do = %v, want context.Canceled", err)
	}
	wait.Recv(t, cancelled, 10*time.Second, "the abandoned batch to be cancelled")
}

// TestBatcherLeaderAnsweredAtItsDeadline: the caller that starts a batch
// (here one whose deadline is short, with another caller, who has none, in
// its batch) is answered when its context ends, like every other caller,
// although the batch runs on. (It waited for the whole batch.)
func TestBatcherLeaderAnsweredAtItsDeadline(t *testing.T) {
	releaseFirst, releaseSecond := make(chan struct{}), make(chan struct{})
	firstRuns, secondRuns := make(chan struct{}), make(chan struct{})
	b := &store.Batcher[string]{Run: func(ctx context.Context, ops []string) []error {
		if ops[0] == "first" {
			close(firstRuns)
			<-releaseFirst
		} else {
			close(secondRuns)
			select {
			case <-releaseSecond:
			case <-ctx.Done(): // only once every caller has given up
			}
		}
		return make([]error, len(ops))
	}}
	bg := context.Background()
	first := make(chan error, 1)
	go func() { first <- b.Do(bg, "first") }()
	wait.Recv(t, firstRuns, 10*time.Second, "the first batch to run")
	short, cancel := context.WithTimeout(bg, 100*time.Millisecond)
	defer cancel()
	leader, patient := make(chan error, 1), make(chan error, 1)
	go func() { leader <- b.Do(short, "short") }() // queued first: leads the next batch
	wait.Until(t, 10*time.Second, "the short one to queue", func() bool { return b.Queued() == 1 })
	go func() { patient <- b.Do(bg, "patient") }()
	wait.Until(t, 10*time.Second, "the patient one to queue", func() bool { return b.Queued() == 2 })
	close(releaseFirst)
	wait.Recv(t, first, 10*time.Second, "the first operation")
	wait.Recv(t, secondRuns, 10*time.Second, "the second batch to run")
	defer func() { // whatever happened, the second batch ends and its callers with it
		close(releaseSecond)
		wait.Recv(t, patient, 10*time.Second, "the patient caller")
	}()
	if err := wait.Recv(t, leader, 5*time.Second, "the caller with the short deadline"); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("the caller with the short deadline: %v, want context.DeadlineExceeded", err)
	}
}

// TestIsolate: an operation that fails on its own is reported and the
// others are tried again without it, in their order; what the last attempt
// answers is everyone's left.
func TestIsolate(t *testing.T) {
	bad := map[int]error{2: errors.New("op 2"), 4: errors.New("op 4")}
	var attempts [][]int
	errs := store.Isolate([]int{4, 3, 2, 1, 0}, func(run []int) (int, error) {
		attempts = append(attempts, slices.Clone(run))
		for pos, i := range run {
			if bad[i] != nil {
				return pos, bad[i]
			}
		}
		return -1, nil
	})
	if want := [][]int{{4, 3, 2, 1, 0}, {3, 2, 1, 0}, {3, 1, 0}}; fmt.Sprint(attempts) != fmt.Sprint(want) {
		t.Fatalf("attempts %v, want %v", attempts, want)
	}
	if want := []error{nil, nil, bad[2], nil, bad[4]}; fmt.Sprint(errs) != fmt.Sprint(want) {
		t.Fatalf("errors %v, want %v", errs, want)
	}
	whole := errors.New("connection lost")
	if errs := store.Isolate([]int{0, 1}, func([]int) (int, error) { return -1, whole }); errs[0] != whole || errs[1] != whole {
		t.Fatalf("a failed attempt gave %v, want its error for every operation", errs)
	}
}
