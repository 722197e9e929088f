package store_test

import (
	"encoding/base64"
	"encoding/binary"
	"errors"
	"strings"
	"testing"

	"github.com/idemhq/idem/store"
)

func TestCursorRoundTrip(t *testing.T) {
	for _, f := range [][]string{
		{"", "k"},
		{"a:b", "c"},
		{"a", "b:c"},
		{strings.Repeat("s", 255), strings.Repeat("k", 255)},
		{" ~", "\"'\\", "\x00\xff"},
		{},
	} {
		c := store.EncodeCursor("owner", f...)
		got, err := store.DecodeCursor(c, "owner", len(f))
		if err != nil || strings.Join(got, "|") != strings.Join(f, "|") || len(got) != len(f) {
			t.Fatalf("DecodeCursor(EncodeCursor(%q)) = %q, %v", f, got, err)
		}
	}
	if store.EncodeCursor("o", "a:b", "c") == store.EncodeCursor("o", "a", "b:c") {
		t.Fatal("distinct fields share a cursor")
	}
	raw := func(b ...byte) string { return base64.RawURLEncoding.EncodeToString(b) }
	good := store.EncodeCursor("owner", "a", "b")
	for _, bad := range []string{
		"!!",        // not base64
		good + "==", // padding is not part of the encoding
		good[:4],    // truncated
		store.EncodeCursor("another owner", "a", "b"), // another store's
		store.EncodeCursor("owner", "a"),              // another number of fields
		raw(),                                         // empty
		raw(2, 5, 'o', 'w', 'n', 'e', 'r'),            // unknown version
		raw(1, 9, 'o'),                                // a length longer than what follows
		raw(append(append([]byte{1}, binary.AppendUvarint(nil, 1<<40)...), 'a', 'b')...), // absurd length
		raw(1, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x01),         // varint overflow
	} {
		if _, err := store.DecodeCursor(bad, "owner", 2); !errors.Is(err, store.ErrInvalid) {
			t.Fatalf("DecodeCursor(%q) = %v, want ErrInvalid", bad, err)
		}
	}
}
