package store_test

import (
	"bytes"
	"net/http"
	"reflect"
	"strings"
	"testing"

	"github.com/idemhq/idem"
	"github.com/idemhq/idem/store"
)

// responses are outcomes as handlers give them, and the odd ones a store
// must keep as well.
var responses = []*store.Response{
	{Status: 201, Header: http.Header{"Content-Type": {"application/json"}, "Request-Id": {"req_123"}},
		Body: []byte(`{"id":"ch_1","amount":1099}`)},
	{Status: 204},
	{Status: 500, Header: http.Header{"X-Many": {"a", "", "c"}}, Body: []byte{0, 1, 2, 0xff}},
	{Status: 200, Header: http.Header{"Content-Type": {"text/plain"}}, BodyOmitted: true},
	{Status: 999, Body: bytes.Repeat([]byte("x"), 70_000)},
	{Status: 100, Header: http.Header{strings.Repeat("N", 300): {strings.Repeat("v", 200)}}},
}

// TestCompactResponseReadsAsTheOriginal: what MarshalCompact writes,
// UnmarshalBinary reads back as the same response that MarshalBinary's
// encoding gives, and in less room.
func TestCompactResponseReadsAsTheOriginal(t *testing.T) {
	for i, r := range responses {
		viaJSON, err := r.MarshalBinary()
		if err != nil {
			t.Fatal(err)
		}
		compact, err := r.MarshalCompact()
		if err != nil {
			t.Fatalf("%d: MarshalCompact: %v", i, err)
		}
		var fromJSON, fromCompact store.Response
		if err := fromJSON.UnmarshalBinary(viaJSON); err != nil {
			t.Fatal(err)
		}
		if err := fromCompact.UnmarshalBinary(compact); err != nil {
			t.Fatalf("%d: reading the compact form: %v", i, err)
		}
		if !reflect.DeepEqual(fromCompact, fromJSON) {
			t.Errorf("%d: compact form read as %+v, want %+v", i, fromCompact, fromJSON)
		}
		if len(compact) >= len(viaJSON) {
			t.Errorf("%d: compact form is %d bytes, MarshalBinary's %d", i, len(compact), len(viaJSON))
		}
	}
	// A typical answer: the body as is, a few bytes around it.
	r := responses[0]
	compact, _ := r.MarshalCompact()
	headers := len("Content-Type") + len("application/json") + len("Request-Id") + len("req_123")
	if over := len(compact) - len(r.Body) - headers; over > 12 {
		t.Errorf("compact form takes %d bytes beyond its body and headers, want at most 12", over)
	}
}

// TestCompactResponseIsDeterministic: a store compares a repeat's encoding
// with the stored one (FinishParams.Repeat), so one response has one
// encoding, whatever the order a map is walked in.
func TestCompactResponseIsDeterministic(t *testing.T) {
	h := http.Header{}
	for _, name := range []string{"A", "B", "C", "D", "E", "F", "G", "H"} {
		h[name] = []string{name}
	}
	r := &store.Response{Status: 200, Header: h}
	first, _ := r.MarshalCompact()
	for range 50 {
		again, _ := r.Clone().MarshalCompact()
		if !bytes.Equal(again, first) {
			t.Fatalf("two encodings of one response differ:\n%q\n%q", first, again)
		}
	}
}

// TestCorruptCompactResponseIsRefused: a stored response cut short or with
// lengths past its end is an error, never a panic or a huge allocation.
func TestCorruptCompactResponseIsRefused(t *testing.T) {
	compact, _ := responses[2].MarshalCompact()
	for n := 1; n < len(compact)-4; n++ { // the last 4 bytes are the body: any cut of it is a body
		var r store.Response
		if err := r.UnmarshalBinary(compact[:n]); err == nil {
			t.Errorf("a compact response cut to %d of %d bytes was read as %+v", n, len(compact), r)
		}
	}
	for _, bad := range [][]byte{
		{2, 0, 0xc8, 1, 0xff, 0xff, 0xff, 0xff, 0x0f}, // a header count of 4 billion
		{2, 0, 0xc8, 1, 1, 1, 'A', 0xff, 0xff, 0x7f},  // a value count past the end
		{2, 4, 0xc8, 1, 0},                            // an unknown flag
		{3, 0, 0xc8, 1, 0},                            // an unknown version
		{2, 0, 0xe8, 0x07, 0},                         // status 1000
		{2, 0, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f}, // a varint past 64 bits
	} {
		var r store.Response
		if err := r.UnmarshalBinary(bad); err == nil {
			t.Errorf("%x was read as %+v", bad, r)
		}
	}
	if _, err := (&store.Response{Status: -1}).MarshalCompact(); err == nil {
		t.Error("a negative status was encoded")
	}
}

// TestCompactFingerprint: a fingerprint of NewFingerprint is kept in 129
// bytes and read back as it was; any other (a test's, a later version's,
// or one whose base64 is not canonical) is kept as its text.
func TestCompactFingerprint(t *testing.T) {
	fp := idem.NewFingerprint(idem.Payload{Method: "POST", Path: "/v1/charges", Body: []byte(`{"amount":1099}`)})
	b := fp.Compact()
	if len(b) != 1+4*32 {
		t.Errorf("a version-1 fingerprint of %d characters compacts to %d bytes, want 129", len(fp), len(b))
	}
	for _, f := range []store.Fingerprint{fp, "fp-a", "v1.a.b.c.d", "v2" + fp[2:],
		// The last base64 character carries 4 bits of a 32-byte sum: one
		// with other bits in the 2 it does not use reads as the same sum.
		fp[:len(fp)-1] + "B", fp[:len(fp)-1] + "A"} {
		got, err := store.FingerprintFromCompact(f.Compact())
		if err != nil || got != f {
			t.Errorf("%q compacted and read back as %q, %v", f, got, err)
		}
	}
	if a, b := (fp[:len(fp)-1] + "A").Compact(), (fp[:len(fp)-1] + "B").Compact(); bytes.Equal(a, b) {
		t.Error("two fingerprints compact alike")
	}
	for _, bad := range [][]byte{nil, {1}, append([]byte{1}, make([]byte, 127)...), {0x7f, 'a'}, {'a', 0}} {
		if f, err := store.FingerprintFromCompact(bad); err == nil {
			t.Errorf("%x was read as fingerprint %q", bad, f)
		}
	}
}
