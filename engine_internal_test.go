package idem

import (
	"container/list"
	"context"
	"fmt"
	"net/http"
	"runtime"
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

// TestCacheBoundsItsMemory: what the cache holds in memory, measured by
// the heap that dropping it frees, stays within its bound (and a quarter,
// for the measure's noise), for records with many short header values
// (nothing caps their number) and for typical ones. (It counted the bytes
// of names and values only: 20,000 empty values cost nothing, and 200 such
// records held 64 MB under a 1 MiB bound; a typical record held twice what
// was counted.)
func TestCacheBoundsItsMemory(t *testing.T) {
	const max = 1 << 20
	typical := http.Header{}
	for i := range 15 {
		typical.Set(fmt.Sprintf("X-Header-%d", i), "value-of-a-typical-header")
	}
	for _, tc := range []struct {
		name    string
		records int
		header  http.Header
	}{
		{"20,000 empty header values each", 200, http.Header{"Link": make([]string, 20000)}},
		{"15 headers and 200 B of body each", 2000, typical},
	} {
		t.Run(tc.name, func(t *testing.T) {
			eng, err := New(Config{Store: memstore.New(), CacheSize: max})
			if err != nil {
				t.Fatal(err)
			}
			ctx := context.Background()
			fp := NewFingerprint(Payload{Method: "POST", Path: "/charges", Body: []byte(`{}`)})
			for i := range tc.records {
				p := BeginParams{Scope: "tenant", Key: fmt.Sprintf("order-%d", i), Fingerprint: fp}
				out, err := eng.Begin(ctx, p)
				if err != nil || out.Decision != Execute {
					t.Fatal(out.Decision, err)
				}
				if err := eng.Complete(ctx, out.Lease, &Response{Status: 201, Header: tc.header, Body: make([]byte, 200)}); err != nil {
					t.Fatal(err)
				}
				if out, err := eng.Begin(ctx, p); err != nil || out.Decision != Replay {
					t.Fatal(out.Decision, err)
				}
			}
			var before, after runtime.MemStats
			runtime.GC()
			runtime.ReadMemStats(&before)
			c := eng.cache
			c.mu.Lock()
			n := len(c.items)
			c.items, c.order, c.size = map[recordKey]*list.Element{}, list.New(), 0
			c.mu.Unlock()
			runtime.GC()
			runtime.ReadMemStats(&after)
			runtime.KeepAlive(eng) // and its store, which holds the records too
			freed := int64(before.HeapAlloc) - int64(after.HeapAlloc)
			t.Logf("%d records held %d bytes", n, freed)
			if freed > max*5/4 {
				t.Errorf("a cache bounded at %d bytes held %d bytes in %d records", max, freed, n)
			}
		})
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
