package httpidem_test

import (
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/idemhq/idem/httpidem"
)

func TestCanonicalJSON(t *testing.T) {
	for in, want := range map[string]string{
		// RFC 8785 §3.2.2.3 number examples and friends.
		`[1E30, 4.50, 2e-3, 0.000001, 1e-7, -0, 333333333.3333333, 1e21, 123456789012345680000]`: `[1e+30,4.5,0.002,0.000001,1e-7,0,333333333.3333333,1e+21,123456789012345680000]`,
		// Members sorted by UTF-16 code units, nested objects too.
		`{"b":1,"a":{"d":true,"c":null},"€":2,"😀":3,"\r":4}`: `{"\r":4,"a":{"c":null,"d":true},"b":1,"€":2,"😀":3}`,
		`"tab\there \u0001 \"q\" \\ é"`:                      `"tab\there \u0001 \"q\" \\ é"`,
		" { \"z\" : [ ] , \"y\" : { } } ":                    `{"y":{},"z":[]}`,
	} {
		got, err := httpidem.CanonicalJSON([]byte(in))
		if err != nil || string(got) != want {
			t.Errorf("CanonicalJSON(%s)\n got %s, %v\nwant %s", in, got, err, want)
		}
	}
	for _, bad := range []string{`{"a":1} x`, `{"a":`, `{"a":1}}`, `[1]]`, `{"a":1} {"a":1}`} {
		if _, err := httpidem.CanonicalJSON([]byte(bad)); err == nil {
			t.Errorf("CanonicalJSON(%s) accepted", bad)
		}
	}
}

// TestCanonicalJSONKeepsDistinctPayloadsApart: payloads that a handler
// reads differently never share a canonical form (a replay where a 422 was
// due): integers past 2^53, which a float would round together, are kept
// exact, and text that is not UTF-8 (which a decoder would turn into U+FFFD)
// is not JSON to canonicalize.
func TestCanonicalJSONKeepsDistinctPayloadsApart(t *testing.T) {
	a, err := httpidem.CanonicalJSON([]byte(`{"customer":1234567890123456789}`))
	b, err2 := httpidem.CanonicalJSON([]byte(`{"customer":1234567890123456800}`))
	if err != nil || err2 != nil || string(a) == string(b) {
		t.Errorf("two integers past 2^53: %s, %s (%v, %v); want them apart", a, b, err, err2)
	}
	// Numbers with more digits than a float64 keeps, which it reads as
	// another (RFC 8785's 333333333.33333329 reads as 333333333.3333333):
	// a handler that reads decimals (Python's Decimal, BigDecimal,
	// json.Number) reads each pair apart.
	for _, pair := range [][2]string{
		{`{"amount":1.000000000000000001}`, `{"amount":1.000000000000000002}`},
		{`{"amount":1}`, `{"amount":1.0000000000000001}`},
		{`{"v":0.1}`, `{"v":0.10000000000000001}`},
		{`{"amount":12345678901234567.5}`, `{"amount":12345678901234568}`},
		{`{"amount":9007199254740992}`, `{"amount":9007199254740992.9}`},
		{`[333333333.33333329]`, `[333333333.3333333]`},
		{`[1e999]`, `[1e998]`},
		{`[1e-400]`, `[0]`},
	} {
		a, err := httpidem.CanonicalJSON([]byte(pair[0]))
		b, err2 := httpidem.CanonicalJSON([]byte(pair[1]))
		if err != nil || err2 != nil || string(a) == string(b) {
			t.Errorf("%s and %s: %s, %s (%v, %v); want them apart", pair[0], pair[1], a, b, err, err2)
		}
	}
	// One value written two ways is one payload, however it is written.
	for _, same := range []string{
		`[1.10, 1.1, 11e-1, 0.11e1]`, `[100, 1e2, 100.000, 1E+2]`,
		`[9007199254740993, 9007199254740993.0, 90071992547409930e-1]`,
		`[1.0000000000000001, 1.00000000000000010, 10000000000000001e-16]`,
		`[1e999, 10e998, 1e+999]`,
	} {
		got, err := httpidem.CanonicalJSON([]byte(same))
		parts := strings.Split(strings.Trim(string(got), "[]"), ",")
		if err != nil || len(parts) < 2 || len(slices.Compact(parts)) != 1 {
			t.Errorf("%s: %s, %v; want one form", same, got, err)
		}
	}
	if got, err := httpidem.CanonicalJSON([]byte(`[-12, 9007199254740993, -99999999999999999999999, 1.5e3, 100]`)); err != nil ||
		string(got) != `[-12,9007199254740993,-99999999999999999999999,1500,100]` {
		t.Errorf("integers: %s, %v; want those past 2^53 exact, the others as before", got, err)
	}
	// Lone surrogate escapes, which a decoder turns into U+FFFD, also
	// beside a U+FFFD the text holds (it used to let them by), and as the
	// second half or the first of a pair.
	for _, bad := range []string{"{\"name\":\"caf\xe9\"}", `{"name":"\ud800"}`,
		`{"memo":"\ud800","x":"\ufffd"}`, "{\"memo\":\"\\udbff\",\"x\":\"\uFFFD\"}",
		`["\udc00\ud800"]`, `["\ud83d\u0041"]`, `["\ud83d"]`, `["a\ud83d\\ude00"]`} {
		if got, err := httpidem.CanonicalJSON([]byte(bad)); err == nil {
			t.Errorf("CanonicalJSON(%q) = %s; want it refused (not UTF-8)", bad, got)
		}
	}
	// Pairs, escaped backslashes and U+FFFD itself are text.
	for _, good := range []string{`["\ud83d\ude00"]`, `["\\ud800"]`, `["\ufffd"]`, "[\"\uFFFD\"]", `["\\\ud83d\ude00"]`} {
		if _, err := httpidem.CanonicalJSON([]byte(good)); err != nil {
			t.Errorf("CanonicalJSON(%q): %v", good, err)
		}
	}
}

func TestCanonicalJSONSortsByUTF16(t *testing.T) {
	// U+FF61 (one UTF-16 unit, 0xFF61) against U+1F600 (surrogates 0xD83D...):
	// by code point U+FF61 comes first, by UTF-16 units it comes last.
	got, err := httpidem.CanonicalJSON([]byte(`{"｡":1,"😀":2}`))
	if err != nil || string(got) != `{"😀":2,"｡":1}` {
		t.Fatalf("got %s, %v", got, err)
	}
}

// TestCanonicalJSONRefusesCaseFoldedMembers: encoding/json binds members
// whose names are equal under case folding to one field, the last in the
// document winning (objects merging), so {"amount":100,"AMOUNT":5000}
// (5000) and {"AMOUNT":5000,"amount":100} (100), or {"card":{"number":1},
// "card":{}} (1) and {"card":{"number":2},"card":{}} (2), are two payloads
// that sorting would make one text: CanonicalJSON refuses them, in any
// object at any depth, whether it has few members or many, and the
// middleware hashes them as sent. Names that do not collide, or collide in
// two objects, are canonicalized as before. (Sorting made {"amount":100,
// "AMOUNT":5000} and {"AMOUNT":5000,"amount":100} one text, and a decoded
// map kept only the last "card".)
func TestCanonicalJSONRefusesCaseFoldedMembers(t *testing.T) {
	var many strings.Builder // 20 members: names are compared another way
	for i := range 20 {
		fmt.Fprintf(&many, `"m%02d":%d,`, 19-i, 19-i)
	}
	for _, bad := range []string{
		`{"amount":100,"AMOUNT":5000}`,
		`{"AMOUNT":5000,"amount":100}`,
		`{"amount":1,"amount":1}`,
		`{"card":{"number":1},"card":{}}`,
		`{"b":1,"a":{"d":true,"c":null},"A":3}`,
		`{"x":{"Kelvin":1,"Kelvin":2}}`, // U+212A KELVIN SIGN
		`[{"ok":1},{"s":1,"ſ":2}]`,
		`{"\u0041":1,"a":2}`, // an escaped name
		"{" + many.String() + `"Z":1,"z":2}`,
		"{" + many.String() + `"m07":1}`,
		`{"a":{"b":[{"c":{"d":1,"D":2}}]}}`,
	} {
		if got, err := httpidem.CanonicalJSON([]byte(bad)); err == nil {
			t.Errorf("CanonicalJSON(%s) = %s; want it refused", bad, got)
		}
	}
	var sorted strings.Builder
	for i := range 20 {
		fmt.Fprintf(&sorted, `"m%02d":%d,`, i, i)
	}
	for in, want := range map[string]string{
		`{"amount":1,"amount_x":2,"amounts":3}`:           `{"amount":1,"amount_x":2,"amounts":3}`,
		`{"n":"a:b\":\\","m":[":",{"k":":"}]}`:            `{"m":[":",{"k":":"}],"n":"a:b\":\\"}`, // colons in strings
		`{"a":{"a":1,"b":2},"b":[{"a":1},{"a":2,"B":3}]}`: `{"a":{"a":1,"b":2},"b":[{"a":1},{"B":3,"a":2}]}`,
		`{"straße":1,"STRASSE":2,"ı":3,"I":4}`:            `{"I":4,"STRASSE":2,"straße":1,"ı":3}`,
		"{" + many.String() + `"Z":1}`:                    `{"Z":1,` + sorted.String()[:sorted.Len()-1] + "}",
	} {
		got, err := httpidem.CanonicalJSON([]byte(in))
		if err != nil || string(got) != want {
			t.Errorf("CanonicalJSON(%s)\n got %s, %v\nwant %s", in, got, err, want)
		}
	}
}
