package pgstore

import (
	"encoding/base64"
	"encoding/binary"
	"errors"
	"strings"
	"testing"

	"github.com/idemhq/idem"
)

func TestCursorRoundTrip(t *testing.T) {
	for _, ref := range [][2]string{
		{"", "k"},
		{"a:b", "c"},
		{"a", "b:c"},
		{strings.Repeat("s", 255), strings.Repeat("k", 255)},
		{" ~", "\"'\\"},
	} {
		c := encodeCursor(ref[0], ref[1])
		scope, key, err := decodeCursor(c)
		if err != nil || scope != ref[0] || key != ref[1] {
			t.Fatalf("decodeCursor(encodeCursor(%q, %q)) = %q, %q, %v", ref[0], ref[1], scope, key, err)
		}
	}
	if encodeCursor("a:b", "c") == encodeCursor("a", "b:c") {
		t.Fatal("distinct scope and key pairs share a cursor")
	}
	if scope, key, err := decodeCursor(""); err != nil || scope != "" || key != "" {
		t.Fatalf("the empty cursor = %q, %q, %v; want the start", scope, key, err)
	}
	raw := func(b ...byte) string { return base64.RawURLEncoding.EncodeToString(b) }
	for _, bad := range []string{
		"!!",                         // not base64
		encodeCursor("", "k") + "==", // padding is not part of the encoding
		encodeCursor("a", "b")[:2],   // truncated
		raw(1),                       // version only
		raw(2, 1, 'a', 'b'),          // unknown version
		raw(1, 1, 'a'),               // no key
		raw(1, 3, 'a', 'b'),          // scope longer than what follows
		raw(append(append([]byte{1}, binary.AppendUvarint(nil, 1<<40)...), 'a', 'b')...), // absurd length
		raw(1, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x01),         // varint overflow
	} {
		if _, _, err := decodeCursor(bad); !errors.Is(err, idem.ErrInvalid) {
			t.Fatalf("decodeCursor(%q) = %v, want ErrInvalid", bad, err)
		}
	}
}
