package httpidem_test

import (
	"testing"

	"github.com/idemhq/idem/httpidem"
)

func TestCanonicalJSON(t *testing.T) {
	for in, want := range map[string]string{
		// RFC 8785 §3.2.2.3 number examples and friends.
		`[1E30, 4.50, 2e-3, 0.000001, 1e-7, -0, 333333333.33333329, 1e21, 123456789012345680000]`: `[1e+30,4.5,0.002,0.000001,1e-7,0,333333333.3333333,1e+21,123456789012345680000]`,
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
	for _, bad := range []string{`{"a":1} x`, `{"a":`, `1e999`, `{"a":1}}`, `[1]]`, `{"a":1} {"a":1}`} {
		if _, err := httpidem.CanonicalJSON([]byte(bad)); err == nil {
			t.Errorf("CanonicalJSON(%s) accepted", bad)
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
