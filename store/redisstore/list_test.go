package redisstore

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/internal/testkit"
	"github.com/idemhq/idem/store"
	"github.com/redis/go-redis/v9"
)

// listAll lists with p, a page after another, and returns the keys of the
// records listed and how many pages carried records to the next. It fails
// the test on a page over p.Limit or a listing of more than maxPages.
func listAll(t *testing.T, s *Store, p store.ListParams, maxPages int) (keys []string, carried int) {
	t.Helper()
	for pages := 0; ; pages++ {
		if pages == maxPages {
			t.Fatalf("the listing does not end after %d pages", pages)
		}
		res, err := s.List(context.Background(), p)
		if err != nil {
			t.Fatal(err)
		}
		if len(res.Records) > p.Limit {
			t.Fatalf("a page of %d records with limit %d", len(res.Records), p.Limit)
		}
		for _, r := range res.Records {
			keys = append(keys, r.Key)
		}
		if p.Cursor = res.Cursor; p.Cursor == "" {
			return keys, carried
		}
		if c, err := s.decodeListCursor(p.Cursor); err != nil {
			t.Fatal(err)
		} else if len(c.carry) > 0 {
			carried++
		}
	}
}

// TestListPages: small pages list every matching record once or more, on
// standalone Redis and on every master of a cluster.
func TestListPages(t *testing.T) {
	t.Parallel()
	for name, client := range map[string]func(t *testing.T) redis.UniversalClient{
		"standalone": func(t *testing.T) redis.UniversalClient { return testClient(t) },
		"cluster":    func(t *testing.T) redis.UniversalClient { return testClusterClient(t) },
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			client := client(t)
			s := newTestStore(t, client, 0)
			const n = 60
			var all, done []string
			for i := range n {
				key := fmt.Sprintf("k%02d", i)
				r := testkit.Acquire(t, s, "s", key, t0, time.Minute)
				if i%3 == 0 {
					testkit.Finish(t, s, r, t0, idem.StateCompleted, time.Hour)
					done = append(done, key)
				}
				all = append(all, key)
			}
			if c, ok := client.(*redis.ClusterClient); ok {
				err := c.ForEachMaster(context.Background(), func(ctx context.Context, m *redis.Client) error {
					iter := m.Scan(ctx, 0, s.records, 1000).Iterator()
					if !iter.Next(ctx) && iter.Err() == nil {
						return fmt.Errorf("master %s holds none of the test's records", m.Options().Addr)
					}
					return iter.Err()
				})
				if err != nil {
					t.Fatal(err)
				}
			}
			for _, c := range []struct {
				p    store.ListParams
				want []string
			}{
				{store.ListParams{Now: t0, Limit: 1}, all},
				{store.ListParams{Now: t0, Limit: 7}, all},
				{store.ListParams{Now: t0, Limit: 2, States: []idem.State{idem.StateCompleted}}, done},
				{store.ListParams{Now: t0, Limit: 3, KeyPrefix: "k1"}, all[10:20]},
			} {
				got, carried := listAll(t, s, c.p, 10*n)
				t.Logf("limit %d: %d records, %d pages carried records", c.p.Limit, len(got), carried)
				if got = slices.Compact(slices.Sorted(slices.Values(got))); !slices.Equal(got, c.want) {
					t.Errorf("limit %d, states %v, key prefix %q: listed %v; want %v", c.p.Limit, c.p.States, c.p.KeyPrefix, got, c.want)
				}
			}
		})
	}
}

// TestListCarry: records a page had no room for are carried in the cursor,
// returned by the next pages, and skipped when they vanished or no longer
// match.
func TestListCarry(t *testing.T) {
	t.Parallel()
	s := newTestStore(t, testClient(t), 0)
	var carry []string
	for _, key := range []string{"a", "b", "gone", "c", "done"} {
		r := testkit.Acquire(t, s, "s", key, t0, time.Minute)
		if key == "done" {
			testkit.Finish(t, s, r, t0, idem.StateCompleted, time.Hour)
		}
		rec, _ := s.keys("s", key)
		carry = append(carry, rec)
	}
	gone, _ := s.keys("s", "gone")
	if err := testClient(t).Del(context.Background(), gone).Err(); err != nil {
		t.Fatal(err)
	}
	p := store.ListParams{Now: t0, Limit: 2, States: []idem.State{idem.StateInProgress},
		Cursor: s.encodeListCursor(listCursor{done: true, carry: carry})}
	var pages [][]string
	for p.Cursor != "" && len(pages) < 5 {
		res, err := s.List(context.Background(), p)
		if err != nil {
			t.Fatal(err)
		}
		var keys []string
		for _, r := range res.Records {
			keys = append(keys, r.Key)
		}
		pages, p.Cursor = append(pages, keys), res.Cursor
	}
	if fmt.Sprint(pages) != "[[a b] [c] []]" {
		t.Fatalf("pages %v; want [[a b] [c] []]: two carried records, then two with one vanished, then one that no longer matches", pages)
	}
}

// TestListCursorOfAGoneNode: a cursor that names a node the client does not
// know (a cluster master that left) is refused with ErrUnavailable; a
// malformed carry with ErrInvalid.
func TestListCursorOfAGoneNode(t *testing.T) {
	t.Parallel()
	s := newTestStore(t, testClient(t), 0)
	_, err := s.List(context.Background(), store.ListParams{Now: t0, Cursor: s.encodeListCursor(listCursor{addr: "127.0.0.1:1", scan: 7})})
	if !errors.Is(err, idem.ErrUnavailable) || !strings.Contains(err.Error(), "list again") {
		t.Fatalf("List with a cursor of a gone node: %v; want ErrUnavailable, and to list again", err)
	}
	for _, f := range [][]string{{"", "x", ""}, {"", "0", "odd"}, {"", "0", "s\n"}} {
		_, err := s.List(context.Background(), store.ListParams{Now: t0, Cursor: store.EncodeCursor(s.owner()+":list", f...)})
		if !errors.Is(err, idem.ErrInvalid) {
			t.Errorf("List with cursor fields %q: %v; want ErrInvalid", f, err)
		}
	}
}

// TestListPrefixIsQuoted: a prefix holding glob characters lists its
// records: the SCAN pattern quotes them.
func TestListPrefixIsQuoted(t *testing.T) {
	t.Parallel()
	client := testClient(t)
	prefix := randomPrefix(t) + `*?[x]\`
	s, err := New(Config{Client: client, Prefix: prefix})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := deleteKeys(context.Background(), client, globEscape(prefix)+"{*"); err != nil {
			t.Errorf("deleting the test's keys: %v", err)
		}
	})
	testkit.Acquire(t, s, "s", "k", t0, time.Minute)
	if keys, _ := listAll(t, s, store.ListParams{Now: t0, Limit: 10}, 100); fmt.Sprint(keys) != "[k]" {
		t.Fatalf("listed %v; want [k]", keys)
	}
}
