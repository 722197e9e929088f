package httpidem_test

import (
	"strings"
	"testing"

	"github.com/idemhq/idem/httpidem"
)

func TestParseKey(t *testing.T) {
	for _, c := range []struct {
		values []string
		format httpidem.KeyFormat
		want   string
		ok     bool
	}{
		{[]string{`"8e03978e-40d5-43e8-bc93-6894a57f9324"`}, httpidem.KeyUUID, "8e03978e-40d5-43e8-bc93-6894a57f9324", true},
		{[]string{`8e03978e-40d5-43e8-bc93-6894a57f9324`}, httpidem.KeyAny, "8e03978e-40d5-43e8-bc93-6894a57f9324", true},
		{[]string{` "with space and \"quote\" and \\" `}, httpidem.KeyAny, `with space and "quote" and \`, true},
		{[]string{"order:42/retry"}, httpidem.KeyAny, "order:42/retry", true},
		{[]string{strings.Repeat("k", 255)}, httpidem.KeyAny, strings.Repeat("k", 255), true},
		{nil, httpidem.KeyAny, "", false},
		{[]string{""}, httpidem.KeyAny, "", false},
		{[]string{`""`}, httpidem.KeyAny, "", false},
		{[]string{strings.Repeat("k", 256)}, httpidem.KeyAny, "", false},
		{[]string{"a", "b"}, httpidem.KeyAny, "", false},
		{[]string{`"abc`}, httpidem.KeyAny, "", false},
		{[]string{`"a\nb"`}, httpidem.KeyAny, "", false},
		{[]string{"\"caf\xc3\xa9\""}, httpidem.KeyAny, "", false},
		{[]string{"a,b"}, httpidem.KeyAny, "", false},
		{[]string{"8e03978e40d543e8bc936894a57f9324"}, httpidem.KeyUUID, "", false},
		{[]string{"8e03978e-40d5-43e8-bc93-6894a57f932g"}, httpidem.KeyUUID, "", false},
	} {
		got, err := httpidem.ParseKey(c.values, c.format)
		if (err == nil) != c.ok || got != c.want {
			t.Errorf("ParseKey(%q) = %q, %v; want %q ok=%v", c.values, got, err, c.want, c.ok)
		}
	}
}

// TestParseKeyErrorsAdvise: a key's error says what is wrong and what to do,
// and never quotes the key, nor a character of it.
func TestParseKeyErrorsAdvise(t *testing.T) {
	for _, c := range []struct {
		value, want, not string
	}{
		{"clé-ü-€", "not printable ASCII at offset 2", "quoted"},
		{`"clé-ü-€"`, "not printable ASCII at offset 3", "0x"},
		{"order 1", "a space at offset 5", ""},
		{"a,b", "a comma at offset 1", ""},
		{`a"b`, "a double quote at offset 1", ""},
	} {
		_, err := httpidem.ParseKey([]string{c.value}, httpidem.KeyAny)
		if err == nil {
			t.Errorf("ParseKey(%q) accepted it", c.value)
			continue
		}
		msg := err.Error()
		if !strings.Contains(msg, c.want) || (c.not != "" && strings.Contains(msg, c.not)) {
			t.Errorf("ParseKey(%q) = %q; want it to say %q and not %q", c.value, msg, c.want, c.not)
		}
		for _, r := range strings.Trim(c.value, `"`)[1:] {
			if r > 0x7e || r == ' ' {
				continue
			}
			if strings.Contains(msg, "'"+string(r)+"'") || strings.ContainsRune(msg, 'Ã') {
				t.Errorf("ParseKey(%q) = %q: it quotes a character of the key", c.value, msg)
			}
		}
	}
}
