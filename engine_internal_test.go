package idem

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/idemhq/idem/store"
	"github.com/idemhq/idem/store/memstore"
)

// TestCacheCountsCheckpoints: the cache's bound left out the checkpoints of
// the records it keeps (every store returns them with the record), so with
// one full checkpoint per record a 1 MiB cache held 8 MB.
func TestCacheCountsCheckpoints(t *testing.T) {
	const max = 1 << 20
	eng, err := New(Config{Store: memstore.New(), CacheSize: max})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	fp := NewFingerprint(Payload{Method: "POST", Path: "/charges", Body: []byte(`{}`)})
	for i := range 2000 {
		p := BeginParams{Scope: "tenant", Key: fmt.Sprintf("order-%d", i), Fingerprint: fp}
		out, err := eng.Begin(ctx, p)
		if err != nil || out.Decision != Execute {
			t.Fatal(out.Decision, err)
		}
		if err := eng.Checkpoint(ctx, out.Lease, "authorize", make([]byte, store.MaxCheckpointData)); err != nil {
			t.Fatal(err)
		}
		if err := eng.Complete(ctx, out.Lease, &Response{Status: 201, Body: []byte(`{"id":"ch_1"}`)}); err != nil {
			t.Fatal(err)
		}
		if out, err := eng.Begin(ctx, p); err != nil || out.Decision != Replay {
			t.Fatal(out.Decision, err)
		}
	}
	c := eng.cache
	c.mu.Lock()
	defer c.mu.Unlock()
	held := 0
	for el := c.order.Front(); el != nil; el = el.Next() {
		e := el.Value.(*cached)
		held += len(e.rec.Response.Body)
		for _, cp := range e.rec.Checkpoints {
			held += len(cp.Data)
		}
	}
	if held > max {
		t.Fatalf("the cache holds %d bytes of bodies and checkpoints in %d records; its bound is %d", held, len(c.items), max)
	}
}

// TestRetryPauseStaysBounded: the pause before a retry grew by shifting
// and overflowed from the 20th round on (negative or zero): the journal's
// loop, which sends a kept release again round after round until the
// acquire's lease ends, then sent it with no pause at all (1.4 million
// times in 15 s against a store that answered).
func TestRetryPauseStaysBounded(t *testing.T) {
	for n := range 200 {
		if p := retryPause(n); p < 10*time.Millisecond || p > 500*time.Millisecond {
			t.Fatalf("retryPause(%d) = %v; want between 10 ms and 500 ms", n, p)
		}
	}
}
