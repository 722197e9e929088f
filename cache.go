package idem

import (
	"container/list"
	"sync"
	"time"
)

// DefaultCacheSize is how many bytes of completed outcomes an engine keeps
// in memory by default; see [Config.CacheSize].
const DefaultCacheSize = 32 << 20

// cache keeps completed records in memory, least recently used first out,
// within a number of bytes. A completed record never changes until it
// expires (nothing settles it again, and nothing deletes it earlier: a
// purge refuses outcomes still replayed), so a copy answers its replays as
// the store would, in every process that shares the store.
type cache struct {
	max int64

	mu    sync.Mutex
	size  int64
	order *list.List // of *cached, most recently used first
	items map[recordKey]*list.Element
}

type cached struct {
	id   recordKey
	rec  Record
	size int64
}

func newCache(max int64) *cache {
	if max <= 0 {
		return nil
	}
	return &cache{max: max, order: list.New(), items: map[recordKey]*list.Element{}}
}

// recordKey names a record in this engine's maps.
type recordKey struct{ scope, key string }

// get returns the completed record under scope and key, if it is kept and
// has not expired at now.
func (c *cache) get(scope, key string, now time.Time) (Record, bool) {
	if c == nil {
		return Record{}, false
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	el, ok := c.items[recordKey{scope, key}]
	if !ok {
		return Record{}, false
	}
	e := el.Value.(*cached)
	if !now.Before(e.rec.Expires) {
		c.remove(el)
		return Record{}, false
	}
	c.order.MoveToFront(el)
	return e.rec, true
}

// put keeps a completed record (a record in any other state, or without
// an expiry, is not kept).
func (c *cache) put(rec Record) {
	if c == nil || rec.State != StateCompleted || rec.Response == nil || rec.Expires.IsZero() {
		return
	}
	id := recordKey{rec.Scope, rec.Key}
	// What a record holds in memory beyond its bytes, as measured on Go
	// 1.26 (TestCacheBoundsItsMemory), a little over: its structs, its
	// strings' headers, the list element and its entry in the map; a
	// header name's slot in the map and slice; a value's string header.
	const perRecord, perName, perValue, perCheckpoint = 768, 48, 16, 64
	size := int64(len(id.scope) + len(id.key) + len(rec.Response.Body) + len(rec.Fingerprint) + len(rec.Token) + perRecord)
	for _, cp := range rec.Checkpoints {
		size += int64(len(cp.Name) + len(cp.Data) + perCheckpoint)
	}
	for name, values := range rec.Response.Header {
		size += int64(len(name) + perName)
		for _, v := range values {
			size += int64(len(v) + perValue)
		}
	}
	if size > c.max/4 {
		return // one outcome may not crowd out the others
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if el, ok := c.items[id]; ok {
		c.remove(el)
	}
	c.items[id] = c.order.PushFront(&cached{id: id, rec: rec, size: size})
	c.size += size
	for c.size > c.max {
		c.remove(c.order.Back())
	}
}

func (c *cache) remove(el *list.Element) {
	e := c.order.Remove(el).(*cached)
	delete(c.items, e.id)
	c.size -= e.size
}
