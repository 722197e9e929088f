package memcachedstore

import (
	"bufio"
	"bytes"
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"net"
	"net/url"
	"slices"
	"strings"
	"time"

	"github.com/bradfitz/gomemcache/memcache"
	"github.com/idemhq/idem/store"
)

// The indexes name only unsettled leases, so List finds records by asking
// every server for the keys it holds, with the text command
// "lru_crawler metadump all" (memcached 1.4.31 and later). The server answers
// one line per item, "key=<URL-encoded key> exp=... la=... ...", then
// "END\r\n"; or one line of error, such as "BUSY currently processing crawler
// request" while another dump or crawl runs, "ERROR metadump not allowed"
// under memcached -X, "CLIENT_ERROR lru crawler disabled".

// DefaultBusyWait is how long List tries again, backing off, a server whose
// LRU crawler is busy (another metadump, or a crawl of the server's own)
// before it fails with [store.ErrUnavailable].
const DefaultBusyWait = 5 * time.Second

// errBusy is the answer of a server whose LRU crawler is busy.
var errBusy = errors.New("lru_crawler metadump answered BUSY")

// List implements [store.Store]. Each page dumps the keys of every server of
// [Config.Servers] (two lru_crawler metadumps each, one after the other, each
// of which reads every item the server holds, of every prefix), keeps this
// store's record keys, adds the
// unsettled records the indexes name (as Scan reads them), and reads the
// records after the cursor's, in the order of their hashes, in batches of
// one multi-get each, until Limit of them match. The cursor is the last
// record returned, so a matching record is returned at most once.
//
// An unsettled record (IN_PROGRESS or UNKNOWN) that stays in Memcached
// during the listing is returned. A settled one is returned if the dump
// names it, and a dump is not a snapshot: while the server takes writes,
// its crawler passes over some of the items that move in its LRU lists
// (up to half of them in a test that writes and reads between
// listings), so a listing of settled records may be incomplete under
// traffic (the second dump makes it rarer: the conformance suite, whose
// parallel tests write to the same server, missed two settled records in
// one of about thirty CI runs with one dump).
// Without Servers it fails with an error wrapping [store.ErrInvalid].
func (s *Store) List(ctx context.Context, p store.ListParams) (store.ScanResult, error) {
	if err := store.Ready(ctx, "memcachedstore", "list", p); err != nil {
		return store.ScanResult{}, err
	}
	if len(s.servers) == 0 {
		return store.ScanResult{}, fmt.Errorf("memcachedstore: list: %w: Config.Servers is empty; List reads the keys from the servers", store.ErrInvalid)
	}
	after, err := s.decodeListCursor(p.Cursor)
	if err != nil {
		return store.ScanResult{}, err
	}
	// Two dumps of each server: an item that moves in its LRU lists while
	// the crawler passes is missed by one crawl, and seldom by the next.
	var hs []string
	for range 2 {
		for _, addr := range s.servers {
			found, err := s.dumpRetrying(ctx, addr)
			if err != nil {
				return store.ScanResult{}, err
			}
			hs = append(hs, found...)
		}
	}
	// The dump can pass over items the server moves meanwhile: the
	// unsettled records, which operators list most, are read from the
	// indexes too.
	items, err := s.client.GetMulti(s.indexKeys)
	if err != nil {
		return store.ScanResult{}, translate("list", err)
	}
	for _, it := range items {
		set, err := parseIndex(it.Value)
		if err != nil {
			return store.ScanResult{}, fmt.Errorf("memcachedstore: list: index %s: %w", it.Key, err)
		}
		hs = append(hs, set.hashes()...)
	}
	slices.Sort(hs)
	hs = slices.Compact(hs) // a key may linger on a server the client no longer picks
	i, ok := slices.BinarySearch(hs, after)
	if ok {
		i++
	}
	cands := hs[i:]

	size := p.PageSize()
	var res store.ScanResult
	for i := 0; i < len(cands) && len(res.Records) < size; {
		batch := cands[i:min(i+min(max(2*(size-len(res.Records)), 64), 1024), len(cands))]
		keys := make([]string, len(batch))
		for j, h := range batch {
			keys[j] = s.recordKey(h)
		}
		if err := ctx.Err(); err != nil {
			return store.ScanResult{}, fmt.Errorf("memcachedstore: list: %w", err)
		}
		recs, err := s.client.GetMulti(keys)
		if err != nil {
			return store.ScanResult{}, translate("list", err)
		}
		for j, h := range batch {
			i++
			it := recs[keys[j]]
			if it == nil {
				continue // gone since the dump
			}
			r, err := decode(it.Value, false, "", "", h)
			if errors.Is(err, errForeign) {
				continue
			}
			if err != nil {
				return store.ScanResult{}, fmt.Errorf("memcachedstore: list: record %s: %w", keys[j], err)
			}
			if !p.Match(r) {
				continue
			}
			res.Records = append(res.Records, r)
			if len(res.Records) == size {
				if i < len(cands) {
					res.Cursor = store.EncodeCursor(s.owner(), "list", h)
				}
				break
			}
		}
	}
	return res, nil
}

// decodeListCursor returns the record hash a listing's cursor stands after
// ("" for the first page).
func (s *Store) decodeListCursor(c string) (string, error) {
	if c == "" {
		return "", nil
	}
	f, err := store.DecodeCursor(c, s.owner(), 2)
	if err != nil {
		return "", fmt.Errorf("memcachedstore: list: %w", err)
	}
	if _, err := base64.RawURLEncoding.DecodeString(f[1]); err != nil || f[0] != "list" || len(f[1]) != hashLen {
		return "", fmt.Errorf("memcachedstore: list: %w: cursor %q is not a listing's", store.ErrInvalid, c)
	}
	return f[1], nil
}

// dumpRetrying is dump, tried again with a growing pause while the server
// answers that its crawler is busy, for up to busyWait.
func (s *Store) dumpRetrying(ctx context.Context, addr string) ([]string, error) {
	deadline := time.Now().Add(s.busyWait)
	for pause := 5 * time.Millisecond; ; pause = min(2*pause, 200*time.Millisecond) {
		hs, err := s.dump(ctx, addr)
		if !errors.Is(err, errBusy) {
			return hs, err
		}
		if time.Now().Add(pause).After(deadline) {
			return nil, fmt.Errorf("memcachedstore: list: server %s: %w: its LRU crawler stayed busy for %v (another lru_crawler metadump runs, or a crawl of its own)",
				addr, store.ErrUnavailable, s.busyWait)
		}
		t := time.NewTimer(pause)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil, fmt.Errorf("memcachedstore: list: %w", ctx.Err())
		case <-t.C:
		}
	}
}

// dump returns the hashes of this store's records on the server at addr, as
// its lru_crawler metadump names them; errBusy when its crawler is busy. It
// dials as the client does (its DialContext, or TCP; a Unix socket for an
// address with a slash), and each read waits at most the client's Timeout.
func (s *Store) dump(ctx context.Context, addr string) ([]string, error) {
	unavailable := func(err error) error {
		if ctx.Err() != nil {
			return fmt.Errorf("memcachedstore: list: %w", ctx.Err())
		}
		return fmt.Errorf("memcachedstore: list: server %s: %w: %w", addr, store.ErrUnavailable, err)
	}
	timeout := s.client.Timeout
	if timeout == 0 {
		timeout = memcache.DefaultTimeout
	}
	network := "tcp"
	if strings.Contains(addr, "/") {
		network = "unix"
	}
	dial := s.client.DialContext
	if dial == nil {
		dial = (&net.Dialer{}).DialContext
	}
	dctx, cancel := context.WithTimeout(ctx, timeout)
	nc, err := dial(dctx, network, addr)
	cancel()
	if err != nil {
		return nil, unavailable(err)
	}
	defer nc.Close()
	defer context.AfterFunc(ctx, func() { nc.Close() })() // a done ctx ends a read in flight

	if err := nc.SetWriteDeadline(time.Now().Add(timeout)); err != nil {
		return nil, unavailable(err)
	}
	if _, err := nc.Write([]byte("lru_crawler metadump all\r\n")); err != nil {
		return nil, unavailable(err)
	}
	br := bufio.NewReaderSize(readTimeout{nc, timeout}, 64<<10)
	recordPrefix := s.prefix + ":r:"
	var hs []string
	for first := true; ; first = false {
		line, err := br.ReadSlice('\n')
		if err != nil {
			return nil, unavailable(fmt.Errorf("reading the metadump: %w", err))
		}
		line = bytes.TrimRight(line, "\r\n")
		if rest, ok := bytes.CutPrefix(line, []byte("key=")); ok {
			enc, _, _ := bytes.Cut(rest, []byte(" "))
			key, err := url.PathUnescape(string(enc))
			if err != nil {
				return nil, unavailable(fmt.Errorf("the metadump has a malformed key %q", enc))
			}
			if h, ok := strings.CutPrefix(key, recordPrefix); ok && len(h) == hashLen {
				if _, err := base64.RawURLEncoding.DecodeString(h); err == nil {
					hs = append(hs, h)
				}
			}
			continue
		}
		switch {
		case string(line) == "END":
			return hs, nil
		case first && bytes.HasPrefix(line, []byte("NOTSTARTED")): // "no items to crawl"
			return nil, nil
		case first && bytes.HasPrefix(line, []byte("BUSY")):
			return nil, errBusy
		}
		return nil, fmt.Errorf("memcachedstore: list: server %s: %w: lru_crawler metadump answered %q (memcached -X, or -o no_lru_crawler, disables it)",
			addr, store.ErrUnavailable, line)
	}
}

// readTimeout bounds each read of a connection: a server that stops sending
// fails the read, however long the whole answer takes.
type readTimeout struct {
	net.Conn
	d time.Duration
}

func (c readTimeout) Read(b []byte) (int, error) {
	if err := c.Conn.SetReadDeadline(time.Now().Add(c.d)); err != nil {
		return 0, err
	}
	return c.Conn.Read(b)
}
