// Package wait gives tests bounded waits: each fails the test with a message
// naming what it waited for, instead of hanging until go test's timeout.
package wait

import (
	"testing"
	"time"
)

// Recv returns the next value from ch, or fails the test when none comes
// within d.
func Recv[T any](t testing.TB, ch <-chan T, d time.Duration, what string) T {
	t.Helper()
	timer := time.NewTimer(d)
	defer timer.Stop()
	select {
	case v := <-ch:
		return v
	case <-timer.C:
		t.Fatalf("waited %v for %s; it did not happen", d, what)
	}
	var zero T
	return zero
}

// Until polls cond every few milliseconds until it holds, or fails the test
// when it does not within d. For conditions no channel signals (a process
// that starts listening, a row that appears in another process's store).
func Until(t testing.TB, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	pause := time.Millisecond
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("waited %v for %s; it did not happen", d, what)
		}
		time.Sleep(pause)
		pause = min(2*pause, 50*time.Millisecond)
	}
}

// Done waits for fn to return, or fails the test when it has not within d.
func Done(t testing.TB, d time.Duration, what string, fn func()) {
	t.Helper()
	ch := make(chan struct{})
	go func() { defer close(ch); fn() }()
	Recv(t, ch, d, what)
}
